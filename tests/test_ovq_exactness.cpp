// OVQ forward against its oracles (SPEC.md §2.2, §2.5): full causal softmax attention where OVQ
// must reduce to it, the count-bias merge identity, and a token-by-token transcription of the
// whole algorithm (attention, growth, seeding, assignment, running means).
#include <mixattn/ovq.hpp>
#include <mixattn/reference.hpp>

#include "test_ovq_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using namespace mixattn;
namespace mt = mixattn::testing;
using mixattn::testing::random_matrix;
using mixattn::testing::Tol;
using mixattn::testing::unit_rows;
using mt::close;

template <class T>
class OvqExactness : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(OvqExactness, Scalars);

/// Causal softmax attention on unit-norm q, k with scale s, from the reference oracle.
template <class T>
Matrix<T> causal_softmax(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, double beta,
                         double eps) {
  const Matrix<T> qh = unit_rows(q.template cast<double>(), eps).template cast<T>();
  const Matrix<T> kh = unit_rows(k.template cast<double>(), eps).template cast<T>();
  reference::Options ro;
  ro.causal = true;
  ro.scale = beta * std::sqrt(static_cast<double>(q.cols()));
  return reference::naive_forward<T>(qh, kh, v, ro);
}

// Linear schedule, T <= N_max: every token opens its own centroid (nu = C per block, all
// seeded, count 1, log c = 0), so OVQ is exactly causal softmax attention.
TYPED_TEST(OvqExactness, LinearScheduleWithinCapacityIsCausalSoftmax) {
  using T = TypeParam;
  const Index n = 45, r = 5, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, 11), k = random_matrix<T>(n, r, 12),
                  v = random_matrix<T>(n, dv, 13);
  for (const ovq::Seeding seeding : {ovq::Seeding::greedy_dispersion, ovq::Seeding::one_shot}) {
    ovq::Options opt;
    opt.block = 8;
    opt.max_centroids = 64;
    opt.growth = ovq::Growth::linear;
    opt.seeding = seeding;
    ovq::State<T> st = ovq::State<T>::empty(r, dv);
    const Matrix<T> out = ovq::forward<T>(q, k, v, T(0.8), opt, st);
    EXPECT_TRUE(
        close(out, causal_softmax<T>(q, k, v, 0.8, opt.norm_eps), Tol<T>::rtol, Tol<T>::atol));
    ASSERT_EQ(st.keys.rows(), 40);  // five complete blocks absorbed, five tokens pending
    EXPECT_TRUE((st.counts.array() == T(1)).all());
    EXPECT_EQ(st.pending_keys.rows(), 5);
  }
}

// Block 0 has an empty dictionary: plain causal softmax attention, for a complete block (then
// absorbed) and for a partial one.
TYPED_TEST(OvqExactness, FirstBlockIsCausalSoftmax) {
  using T = TypeParam;
  const Index r = 6, dv = 4;
  for (const Index n : {Index(16), Index(11), Index(1)}) {
    const Matrix<T> q = random_matrix<T>(n, r, 21), k = random_matrix<T>(n, r, 22),
                    v = random_matrix<T>(n, dv, 23);
    ovq::Options opt;
    opt.block = 16;
    opt.max_centroids = 4;
    ovq::State<T> st = ovq::State<T>::empty(r, dv);
    const Matrix<T> out = ovq::forward<T>(q, k, v, T(1.3), opt, st);
    EXPECT_TRUE(
        close(out, causal_softmax<T>(q, k, v, 1.3, opt.norm_eps), Tol<T>::rtol, Tol<T>::atol))
        << "T = " << n;
  }
}

// Two centroids with identical keys and values and count 1 each behave as one centroid of
// count 2: exp(l + log 2) = 2 exp(l).
TYPED_TEST(OvqExactness, MergedIdenticalCentroidsMatchCountTwo) {
  using T = TypeParam;
  const Index r = 4, dv = 3, c = 8;
  const Matrix<T> d = random_matrix<T>(3, r, 31), dval = random_matrix<T>(3, dv, 32);
  Matrix<T> dn = unit_rows(d.template cast<double>(), 1e-5).template cast<T>();
  ovq::State<T> split = ovq::State<T>::empty(r, dv), merged = ovq::State<T>::empty(r, dv);
  split.keys.resize(4, r);
  split.keys << dn.row(0), dn.row(0), dn.row(1), dn.row(2);
  split.values.resize(4, dv);
  split.values << dval.row(0), dval.row(0), dval.row(1), dval.row(2);
  split.counts = Vector<T>::Constant(4, T(1));
  split.counts[3] = T(3);
  split.tokens_seen = 3 * c;
  merged.keys = dn;
  merged.values = dval;
  merged.counts.resize(3);
  merged.counts << T(2), T(1), T(3);
  merged.tokens_seen = 3 * c;

  const Matrix<T> q = random_matrix<T>(c - 1, r, 33), k = random_matrix<T>(c - 1, r, 34),
                  v = random_matrix<T>(c - 1, dv, 35);
  const auto run = [&](const ovq::State<T>& start, bool count_bias) {
    ovq::Options opt;
    opt.block = c;
    opt.count_bias = count_bias;
    ovq::State<T> st = start;
    return Matrix<T>(ovq::forward<T>(q, k, v, T(2.0), opt, st));
  };
  EXPECT_TRUE(close(run(split, true), run(merged, true), Tol<T>::rtol, Tol<T>::atol));
  // Without the count bias the duplicate row weighs twice as much: the outputs must differ,
  // which shows the comparison above can tell the two apart.
  EXPECT_FALSE(close(run(split, false), run(merged, false), 1e-3, 1e-3));
}

// The whole algorithm against the token-by-token transcription of SPEC 2.2-2.3, over enough
// blocks for the plateau schedule to saturate, for every schedule/seeding/bias combination,
// starting from an empty state and from a state with a partial pending block.
using Combo = std::tuple<ovq::Growth, ovq::Seeding, bool, double>;
class OvqOracle : public ::testing::TestWithParam<Combo> {};

template <class T>
void check_against_oracle(const ovq::Options& opt, std::uint64_t seed, Index prefix) {
  const Index n = 75, r = 5, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, seed), k = random_matrix<T>(n, r, seed + 1),
                  v = random_matrix<T>(n, dv, seed + 2);
  ovq::State<T> st = ovq::State<T>::empty(r, dv);
  ovq::State<double> ost = mt::to_double(st);
  mt::Oracle oracle;
  if (prefix > 0) {  // a non-empty start state with a partial pending block
    const Matrix<T> qp = random_matrix<T>(prefix, r, seed + 3),
                    kp = random_matrix<T>(prefix, r, seed + 4),
                    vp = random_matrix<T>(prefix, dv, seed + 5);
    ovq::forward<T>(qp, kp, vp, T(1.1), opt, st);
    oracle.run(qp.template cast<double>(), kp.template cast<double>(), vp.template cast<double>(),
               1.1, opt, ost);
  }
  ovq::Saved<T> saved;
  const Matrix<T> out = ovq::forward<T>(q, k, v, T(1.1), opt, st, &saved);
  const Matrix<double> expect = oracle.run(q.template cast<double>(), k.template cast<double>(),
                                           v.template cast<double>(), 1.1, opt, ost);
  EXPECT_TRUE(close(out, expect, Tol<T>::rtol, Tol<T>::atol)) << "seed " << seed;
  EXPECT_TRUE(mt::states_close(mt::to_double(st), ost, Tol<T>::rtol, Tol<T>::atol))
      << "seed " << seed;
  ASSERT_EQ(saved.assignment.size(), oracle.assignment.size());
  for (std::size_t i = 0; i < oracle.assignment.size(); ++i)
    EXPECT_EQ(saved.assignment[i], oracle.assignment[i]) << "token " << i << ", seed " << seed;
  ASSERT_EQ(saved.seeds.size(), oracle.seeds.size());
  for (std::size_t i = 0; i < oracle.seeds.size(); ++i) EXPECT_EQ(saved.seeds[i], oracle.seeds[i]);
}

TEST_P(OvqOracle, MatchesTokenByTokenTranscription) {
  ovq::Options opt;
  opt.block = 8;
  opt.max_centroids = 12;
  std::tie(opt.growth, opt.seeding, opt.count_bias, opt.growth_alpha) = GetParam();
  for (const Index prefix : {Index(0), Index(13)}) {
    check_against_oracle<double>(opt, 100 + static_cast<std::uint64_t>(prefix), prefix);
    check_against_oracle<float>(opt, 200 + static_cast<std::uint64_t>(prefix), prefix);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllRules, OvqOracle,
    ::testing::Combine(::testing::Values(ovq::Growth::plateau, ovq::Growth::linear),
                       ::testing::Values(ovq::Seeding::greedy_dispersion, ovq::Seeding::one_shot),
                       ::testing::Bool(), ::testing::Values(0.0, 3.0)));

// Zero queries and keys normalise to zero vectors (x / (0 + eps)); nothing may turn into NaN.
TYPED_TEST(OvqExactness, ZeroVectorsStayFinite) {
  using T = TypeParam;
  const Index n = 40, r = 4, dv = 3;
  Matrix<T> q = random_matrix<T>(n, r, 41), k = random_matrix<T>(n, r, 42);
  const Matrix<T> v = random_matrix<T>(n, dv, 43);
  for (Index i = 0; i < n; i += 3) q.row(i).setZero();
  for (Index i = 0; i < n; i += 2) k.row(i).setZero();
  ovq::Options opt;
  opt.block = 8;
  opt.max_centroids = 6;
  ovq::State<T> st = ovq::State<T>::empty(r, dv);
  ovq::Saved<T> saved;
  const Matrix<T> out = ovq::forward<T>(q, k, v, T(1), opt, st, &saved);
  EXPECT_TRUE(out.allFinite());
  EXPECT_TRUE(st.keys.allFinite() && st.values.allFinite());
  const ovq::Grad<T> g = ovq::backward<T>(q, k, v, T(1), Matrix<T>::Ones(n, dv), saved, opt);
  EXPECT_TRUE(g.q.allFinite() && g.k.allFinite() && g.v.allFinite() && std::isfinite(g.beta));
  // All-zero input: every logit is 0 (+ log c), still a valid average of values.
  ovq::State<T> st0 = ovq::State<T>::empty(r, dv);
  const Matrix<T> out0 =
      ovq::forward<T>(Matrix<T>::Zero(n, r), Matrix<T>::Zero(n, r), v, T(1), opt, st0);
  EXPECT_TRUE(out0.allFinite());
  // Token 0 sees only itself.
  EXPECT_TRUE(close(out0.row(0), v.row(0), Tol<T>::rtol, Tol<T>::atol));
}

#if MIXATTN_HAS_SIMD
// The forward tile on register tiles (logits transposed, masked in the epilogue, read-out from
// the transposed weights) against Eigen's products, over shapes that reach every branch: no
// dictionary, pending keys of the state before this call's (lo > 0), query counts that are not
// whole vectors (padded lanes), key and value widths with column tails, with and without the
// count bias. Both compute the same sums in different orders, so Tol (a few hundred ulps in
// float) bounds their gap; the finiteness verdicts must agree, including on a NaN dictionary.
TYPED_TEST(OvqExactness, TiledTileForwardMatchesGemmPath) {
  using T = TypeParam;
  struct Shape {
    Index n, r, dv, m, p0, lo;
    bool bias;
  };
  for (const Shape sh : {Shape{0, 64, 64, 64, 0, 0, true}, Shape{100, 64, 64, 64, 64, 0, true},
                         Shape{37, 17, 70, 23, 5, 3, false}, Shape{1, 3, 1, 16, 0, 0, true},
                         Shape{300, 64, 65, 40, 200, 7, true}, Shape{20, 9, 33, 61, 2, 2, false}}) {
    SCOPED_TRACE(::testing::Message() << "n " << sh.n << " r " << sh.r << " d_v " << sh.dv << " m "
                                      << sh.m << " p0 " << sh.p0 << " lo " << sh.lo);
    ASSERT_TRUE(detail::uses_tiled_forward<T>(sh.m));
    const std::uint64_t seed = static_cast<std::uint64_t>(sh.n * 7 + sh.m * 3 + sh.r);
    const Index l = sh.p0 + sh.m;
    const Matrix<T> qh =
        unit_rows(random_matrix<double>(sh.m, sh.r, seed), 1e-6).template cast<T>();
    Matrix<T> dk = unit_rows(random_matrix<double>(sh.n, sh.r, seed + 1), 1e-6).template cast<T>();
    const Matrix<T> dvals = random_matrix<T>(sh.n, sh.dv, seed + 2);
    const Matrix<T> kb =
        unit_rows(random_matrix<double>(l, sh.r, seed + 3), 1e-6).template cast<T>();
    const Matrix<T> vb = random_matrix<T>(l, sh.dv, seed + 4);
    Vector<T> logc(sh.n);
    for (Index i = 0; i < sh.n; ++i) logc[i] = std::log(static_cast<T>(1 + (i * 37) % 11));
    const T s = static_cast<T>(std::sqrt(static_cast<double>(sh.r)));
    const T* lc = sh.bias ? logc.data() : nullptr;
    detail::AttentionScratch<T> sc;
    sc.reserve(sh.n, l, sh.r, false, sh.m);
    Matrix<T> fast(sh.m, sh.dv), slow(sh.m, sh.dv);
    const auto run = [&](bool tiled, Matrix<T>& out) {
      const ConstMatrixRef<T> ko = kb.topRows(sh.lo), vo = vb.topRows(sh.lo);
      const ConstMatrixRef<T> kn = kb.bottomRows(l - sh.lo), vn = vb.bottomRows(l - sh.lo);
      return tiled ? detail::tile_forward_tiled<T>(qh, dk, dvals, lc, ko, vo, kn, vn, sh.p0, s, sc,
                                                   out, true)
                   : detail::tile_forward_gemm<T>(qh, dk, dvals, lc, ko, vo, kn, vn, sh.p0, s, sc,
                                                  out, true);
    };
    EXPECT_TRUE(run(false, slow));
    EXPECT_TRUE(run(true, fast));
    EXPECT_TRUE(close(fast, slow, Tol<T>::rtol, Tol<T>::atol));
    // against the definition: row i attends to the dictionary and block keys 0 .. p0 + i
    Matrix<double> expect(sh.m, sh.dv);
    for (Index i = 0; i < sh.m; ++i) {
      std::vector<double> z;
      for (Index j = 0; j < sh.n; ++j)
        z.push_back(static_cast<double>(s) *
                        qh.row(i).template cast<double>().dot(dk.row(j).template cast<double>()) +
                    (sh.bias ? static_cast<double>(logc[j]) : 0.0));
      for (Index j = 0; j <= sh.p0 + i; ++j)
        z.push_back(static_cast<double>(s) *
                    qh.row(i).template cast<double>().dot(kb.row(j).template cast<double>()));
      const double mx = *std::max_element(z.begin(), z.end());
      double den = 0;
      Eigen::RowVectorXd acc = Eigen::RowVectorXd::Zero(sh.dv);
      for (std::size_t j = 0; j < z.size(); ++j) {
        const double p = std::exp(z[j] - mx);
        den += p;
        const Index jj = static_cast<Index>(j);
        acc += p * (jj < sh.n ? dvals.row(jj) : vb.row(jj - sh.n)).template cast<double>();
      }
      expect.row(i) = acc / den;
    }
    EXPECT_TRUE(close(fast, expect, Tol<T>::rtol, Tol<T>::atol));
    if (sh.n > 0) {
      dk(sh.n / 2, 0) = std::numeric_limits<T>::quiet_NaN();
      EXPECT_FALSE(run(false, slow));
      EXPECT_FALSE(run(true, fast));
    }
  }
}
#endif

}  // namespace

namespace {

// T comes from the State (forward) or the Saved (backward); q, k, v and beta are non-deduced,
// so plain matrices, row blocks and a double literal bind without explicit template arguments.
TEST(OvqApi, ScalarTypeDeducedFromStateAndSaved) {
  using namespace mixattn;
  const Matrix<float> q = mt::random_matrix<float>(12, 4, 91),
                      k = mt::random_matrix<float>(12, 4, 92),
                      v = mt::random_matrix<float>(12, 3, 93);
  ovq::Options opt;
  opt.block = 4;
  ovq::State<float> st = ovq::State<float>::empty(4, 3);
  ovq::Saved<float> saved;
  const Matrix<float> out =
      ovq::forward(q.topRows(10), k.topRows(10), v.topRows(10), 1.0, opt, st, &saved);
  const ovq::Grad<float> g =
      ovq::backward(q.topRows(10), k.topRows(10), v.topRows(10), 1.0, out, saved, opt);
  EXPECT_EQ(out.rows(), 10);
  EXPECT_EQ(g.q.rows(), 10);
  EXPECT_EQ(st.tokens_seen, 10);
}

}  // namespace
