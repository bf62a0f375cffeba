// Causal GMA as a continued computation (SPEC 1.4, 1.5 pieces): gma::State, the State overloads
// of forward (mixture and prepared), and backward across pieces with start/end state gradients.
#include <mixattn/gma.hpp>

#include "test_gma_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace mixattn;
using mixattn::testing::all_close;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;
using mixattn::testing::test_mixture;

// Sums of the causal scan in another order (test_util.hpp).
template <class T>
using Tol = mixattn::testing::ScanTol<T>;

/// Random cut points: pieces of 1 .. max_piece tokens covering [0, n).
std::vector<Index> random_pieces(Index n, Index max_piece, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Index> sizes;
  for (Index done = 0; done < n;) {
    const Index p = std::min<Index>(n - done, 1 + static_cast<Index>(rng() % max_piece));
    sizes.push_back(p);
    done += p;
  }
  return sizes;
}

/// Runs forward over the pieces, continuing one state; returns the stacked outputs.
template <class T, class Mix>
Matrix<T> run_pieces(const Mix& mix, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                     const std::vector<Index>& sizes, const gma::Options& opt, gma::State<T>& st) {
  Matrix<T> out(q.rows(), v.cols());
  Index at = 0;
  for (const Index n : sizes) {
    out.middleRows(at, n) =
        gma::forward(mix, q.middleRows(at, n), k.middleRows(at, n), v.middleRows(at, n), opt, st);
    at += n;
  }
  return out;
}

template <class T>
class GmaState : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GmaState, Scalars);

TYPED_TEST(GmaState, AnyPiecesGiveTheOneCallOutputsAndState) {
  using T = TypeParam;
  using W = detail::wide_t<T>;
  const Index N = 150, K = 7, r = 5, dv = 4;
  const gma::Mixture<T> mix = test_mixture<T>(K, r, 11);
  const Matrix<T> q = random_matrix<T>(N, r, 12), k = random_matrix<T>(N, r, 13);
  const Matrix<T> v = random_matrix<T>(N, dv, 14);
  gma::Options opt;
  opt.causal = true;
  opt.chunk = 16;  // pieces both shorter (one-token path) and longer (chunked scan) than a chunk
  const Matrix<T> whole = gma::forward(mix, q, k, v, opt);

  // The final state against its definition, summed in double from the responsibilities.
  const Matrix<double> gk = gma::responsibilities(mix, k).template cast<double>();
  const Matrix<double> s_ref = gk.transpose() * v.template cast<double>();
  const Vector<double> z_ref = gk.colwise().sum().transpose();

  std::vector<std::vector<Index>> splits = {std::vector<Index>(N, 1), {N}, {1, N - 1}};
  for (std::uint64_t seed = 0; seed < 4; ++seed) splits.push_back(random_pieces(N, 40, seed));
  for (const auto& sizes : splits) {
    SCOPED_TRACE(::testing::Message() << "pieces: " << sizes.size() << ", first " << sizes[0]);
    gma::State<T> st = gma::State<T>::empty(K, dv);
    const Matrix<T> out = run_pieces(mix, q, k, v, sizes, opt, st);
    EXPECT_TRUE(all_close(out, whole, Tol<T>::rtol, Tol<T>::atol));
    EXPECT_EQ(st.tokens_seen, N);
    // the state is double for float inputs: only the gammas' float rounding separates it
    EXPECT_TRUE(all_close(st.S, s_ref, Tol<W>::rtol * 10, Tol<T>::atol * N));
    EXPECT_TRUE(all_close(st.z, z_ref, Tol<W>::rtol * 10, Tol<T>::atol * N));
  }
}

TYPED_TEST(GmaState, PreparedMixtureGivesTheSameBits) {
  using T = TypeParam;
  const Index N = 40, K = 6, r = 4, dv = 3;
  const gma::Mixture<T> mix = test_mixture<T>(K, r, 21);
  const Matrix<T> q = random_matrix<T>(N, r, 22), k = random_matrix<T>(N, r, 23);
  const Matrix<T> v = random_matrix<T>(N, dv, 24);
  gma::Options opt;
  opt.causal = true;
  const std::vector<Index> sizes = random_pieces(N, 9, 5);
  gma::State<T> a = gma::State<T>::empty(K, dv), b = gma::State<T>::empty(K, dv);
  const Matrix<T> out_mix = run_pieces(mix, q, k, v, sizes, opt, a);
  const gma::Prepared<T> prep(mix);
  const Matrix<T> out_prep = run_pieces(prep, q, k, v, sizes, opt, b);
  EXPECT_TRUE(out_mix == out_prep);
  EXPECT_TRUE(a.S == b.S);
  EXPECT_TRUE(a.z == b.z);
}

// The Mixture overload keeps the mixture prepared in the State: a mixture changed between tokens
// (in place, at the same address; one entry of each parameter, var_floor too) must be prepared
// again. The slow twin: the Prepared overload on a mixture prepared afresh for every token.
TYPED_TEST(GmaState, ChangedMixtureIsPreparedAgainNotServedStale) {
  using T = TypeParam;
  const Index N = 12, K = 5, r = 4, dv = 3;
  gma::Mixture<T> mix = test_mixture<T>(K, r, 41);
  const Matrix<T> q = random_matrix<T>(N, r, 42), k = random_matrix<T>(N, r, 43);
  const Matrix<T> v = random_matrix<T>(N, dv, 44);
  gma::Options opt;
  opt.causal = true;
  gma::State<T> cached = gma::State<T>::empty(K, dv), fresh = gma::State<T>::empty(K, dv);
  for (Index t = 0; t < N; ++t) {
    switch (t % 6) {  // tokens 0, 5, 11: unchanged; the others change one parameter
      case 1:
        mix.mean(t % K, t % r) += T(0.25);
        break;
      case 2:
        mix.var_raw(t % K, t % r) -= T(0.5);
        break;
      case 3:
        mix.prior_logit(t % K) += T(1);
        break;
      case 4:
        mix.var_floor *= T(2);
        break;
      default:
        break;
    }
    gma::Saved<T> saved;
    const Matrix<T> a = gma::forward(mix, q.row(t), k.row(t), v.row(t), opt, cached, &saved);
    const Matrix<T> b =
        gma::forward(gma::Prepared<T>(mix), q.row(t), k.row(t), v.row(t), opt, fresh);
    ASSERT_TRUE(a == b) << "token " << t;
    ASSERT_TRUE(cached.S == fresh.S && cached.z == fresh.z) << "token " << t;
    // The record names the mixture the call used: backward accepts it, and refuses another one.
    const Matrix<T> dout = random_matrix<T>(1, dv, 45 + t);
    EXPECT_NO_THROW(gma::backward(mix, q.row(t), k.row(t), v.row(t), dout, saved, opt));
    gma::Mixture<T> other = mix;
    other.mean(0, 0) += T(1);
    EXPECT_THROW(gma::backward(other, q.row(t), k.row(t), v.row(t), dout, saved, opt),
                 std::invalid_argument);
  }
  // A mixture prepared without the value checks is checked when a call asks for them.
  gma::Options unchecked = opt;
  unchecked.check_finite = false;
  mix.mean(1, 1) = std::numeric_limits<T>::quiet_NaN();
  gma::forward(mix, q.row(0), k.row(0), v.row(0), unchecked, cached);
  try {
    gma::forward(mix, q.row(0), k.row(0), v.row(0), opt, cached);
    FAIL() << "no throw";
  } catch (const std::domain_error& e) {
    EXPECT_NE(std::string(e.what()).find("mixture.mean"), std::string::npos) << e.what();
  }
}

TYPED_TEST(GmaState, RejectsNonCausalMismatchedAndNonFiniteStates) {
  using T = TypeParam;
  const Index K = 4, r = 3, dv = 2;
  const gma::Mixture<T> mix = test_mixture<T>(K, r, 31);
  const Matrix<T> q = random_matrix<T>(5, r, 32), v = random_matrix<T>(5, dv, 33);
  gma::Options opt;
  opt.causal = true;
  gma::State<T> st = gma::State<T>::empty(K, dv);
  gma::forward(mix, q, q, v, opt, st);
  const gma::State<T> before = st;
  const auto untouched = [&] {
    EXPECT_TRUE(st.S == before.S && st.z == before.z && st.tokens_seen == before.tokens_seen);
  };
  gma::Options bidir;
  EXPECT_THROW(gma::forward(mix, q, q, v, bidir, st), std::invalid_argument);
  untouched();
  gma::State<T> wrong_k = gma::State<T>::empty(K + 1, dv), wrong_dv = gma::State<T>::empty(K, 3);
  EXPECT_THROW(gma::forward(mix, q, q, v, opt, wrong_k), std::invalid_argument);
  EXPECT_THROW(gma::forward(mix, q, q, v, opt, wrong_dv), std::invalid_argument);
  EXPECT_THROW(gma::forward(mix, q, q.topRows(4), v, opt, st), std::invalid_argument);
  untouched();
  gma::State<T> nan_state = st;
  nan_state.S(1, 1) = std::numeric_limits<T>::quiet_NaN();
  EXPECT_THROW(gma::forward(mix, q, q, v, opt, nan_state), std::domain_error);
  Matrix<T> bad = q;
  bad(2, 0) = std::numeric_limits<T>::infinity();
  EXPECT_THROW(gma::forward(mix, bad, q, v, opt, st), std::domain_error);
  untouched();
  EXPECT_THROW(gma::State<T>::empty(0, dv), std::invalid_argument);
  try {
    gma::forward(mix, q, q, v, opt, wrong_k);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mixattn::gma::forward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("state.S is 5 x 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gma::Prepared<T>(gma::Mixture<T>{}), std::invalid_argument);
  const gma::Prepared<T> prep(mix);
  EXPECT_THROW(gma::forward(prep, q, q, v, bidir, st), std::invalid_argument);
  EXPECT_THROW(gma::forward(prep, q, q, v, opt, wrong_k), std::invalid_argument);
  untouched();

  // grad_state_out: only for a continued forward, and with the state's shapes.
  gma::Saved<T> plain, cont;
  gma::forward(mix, q, q, v, opt, &plain);
  gma::forward(mix, q, q, v, opt, st, &cont);
  const Matrix<T> dout = random_matrix<T>(5, dv, 34);
  gma::StateGrad<T> gs{decltype(gs.S)::Zero(K, dv), decltype(gs.z)::Zero(K)};
  EXPECT_THROW(gma::backward(mix, q, q, v, dout, plain, opt, &gs), std::invalid_argument);
  EXPECT_NO_THROW(gma::backward(mix, q, q, v, dout, cont, opt, &gs));
  gma::StateGrad<T> wrong{decltype(gs.S)::Zero(K, dv + 1), decltype(gs.z)::Zero(K)};
  EXPECT_THROW(gma::backward(mix, q, q, v, dout, cont, opt, &wrong), std::invalid_argument);
  gs.z(0) = std::numeric_limits<detail::wide_t<T>>::quiet_NaN();
  EXPECT_THROW(gma::backward(mix, q, q, v, dout, cont, opt, &gs), std::domain_error);
}

/// A continued forward whose end state overflows under a finite output (fuzz_gma_state, double:
/// values at the top of the range; the chunked scan's outputs read the start state and the
/// chunk's own keys, the end state adds every key): std::domain_error naming the state's S, and
/// the state as it was, with or without a record. It returned instead, with the state rewound to
/// its start (tokens_seen not advanced): the check ran on the restored state.
TEST(GmaStateCheck, EndStateOverflowUnderFiniteOutputThrows) {
  using T = double;
  gma::Mixture<T> mix;
  mix.mean = (Matrix<T>(2, 1) << -3, 3).finished();
  mix.var_raw = Matrix<T>::Zero(2, 1);
  mix.prior_logit = Vector<T>::Zero(2);
  // Keys at component 0 (gamma ~ 1), queries giving it ~1e-3: two values at double's largest
  // make S(0, 0) overflow, while the output (their weighted mean, weights 1e-3) does not.
  const Matrix<T> k = Matrix<T>::Constant(2, 1, -3), q = Matrix<T>::Constant(2, 1, 0.8);
  const Matrix<T> v = Matrix<T>::Constant(2, 1, std::numeric_limits<T>::max());
  gma::Options opt;
  opt.causal = true;
  opt.chunk = 2;  // one chunk of the scan
  gma::State<T> start = gma::State<T>::empty(2, 1);
  start.S(0, 0) = 1;
  start.z << 0.5, 0.5;
  start.tokens_seen = 5;
  {
    gma::Options unchecked = opt;
    unchecked.check_finite = false;
    gma::State<T> st = start;
    const Matrix<T> out = gma::forward(mix, q, k, v, unchecked, st);
    ASSERT_TRUE(out.allFinite()) << out;
    ASSERT_FALSE(st.S.allFinite()) << st.S;
  }
  for (const bool keep : {false, true}) {
    gma::State<T> st = start;
    gma::Saved<T> saved;
    mixattn::testing::expect_throw<std::domain_error>(
        [&] { gma::forward(mix, q, k, v, opt, st, keep ? &saved : nullptr); },
        {"mixattn::gma::forward", "the state's S overflows"});
    EXPECT_EQ(st.tokens_seen, start.tokens_seen) << "saved " << keep;
    EXPECT_EQ(st.S, start.S);
    EXPECT_EQ(st.z, start.z);
  }
}

// The state's finiteness probe (detail::finite_probe over contiguous scalars, 32 sums side by
// side) against Eigen's sum of x * 0, its slow twin, and through a decoding step: a state with
// one inf or NaN anywhere (the unrolled part, the tail past the last 32, z) is rejected before
// anything changes; a finite state of any size passes.
TEST(GmaStateCheck, FiniteProbeFindsEveryNonFiniteEntry) {
  using W = double;
  for (Index n : {0, 1, 31, 32, 33, 64, 100, 4096 + 5}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    Vector<W> x = random_matrix<W>(n, 1, 40 + n, 1e300).col(0);
    EXPECT_EQ(detail::finite_probe(x.data(), n), W(0));
    EXPECT_EQ((x.array() * W(0)).sum(), W(0));
    for (Index at : {Index(0), n / 2, n - 1}) {
      if (n == 0) break;
      for (W bad : {std::numeric_limits<W>::infinity(), -std::numeric_limits<W>::infinity(),
                    std::numeric_limits<W>::quiet_NaN()}) {
        Vector<W> y = x;
        y(at) = bad;
        EXPECT_TRUE(std::isnan(detail::finite_probe(y.data(), n))) << "at " << at;
        EXPECT_TRUE(std::isnan((y.array() * W(0)).sum())) << "at " << at;
      }
    }
  }
  // K x d_v = 35 (one round of 32 and a tail of 3) and 4096 (a decoding step's state)
  for (const auto& kd : {std::pair<Index, Index>{7, 5}, std::pair<Index, Index>{64, 64}}) {
    const Index K = kd.first, dv = kd.second, r = 4;
    SCOPED_TRACE(::testing::Message() << "K " << K << " d_v " << dv);
    const gma::Mixture<float> mix = test_mixture<float>(K, r, 50 + K);
    const gma::Prepared<float> prep(mix);
    const Matrix<float> q = random_matrix<float>(9, r, 51), v = random_matrix<float>(9, dv, 52);
    gma::Options opt;
    opt.causal = true;
    gma::State<float> st = gma::State<float>::empty(K, dv);
    gma::forward(prep, q.topRows(8), q.topRows(8), v.topRows(8), opt, st);
    for (Index at : {Index(0), K * dv / 2, K * dv - 33, K * dv - 1, K * dv + K - 1}) {
      SCOPED_TRACE(::testing::Message() << "entry " << at);
      gma::State<float> bad = st;
      double& e = at < K * dv ? bad.S.data()[at] : bad.z(at - K * dv);
      e = std::numeric_limits<double>::infinity();
      const gma::State<float> before = bad;
      EXPECT_THROW(gma::forward(prep, q.row(8), q.row(8), v.row(8), opt, bad), std::domain_error);
      EXPECT_TRUE(bad.S == before.S && bad.z == before.z && bad.tokens_seen == before.tokens_seen);
    }
    gma::State<float> good = st;
    EXPECT_NO_THROW(gma::forward(prep, q.row(8), q.row(8), v.row(8), opt, good));
    EXPECT_EQ(good.tokens_seen, 9);
  }
}

/// finite_probe of a matrix expression: contiguous ones (a whole matrix of either storage order,
/// whole rows of a row-major one, whole columns of a column-major one, one row or column) in one
/// pointer probe, the others (columns of a row-major matrix, a strided map) row by row. Each
/// sees every non-finite entry of its own and none of the parent's outside it.
TEST(GmaStateCheck, FiniteProbeOfBlocksSeesExactlyTheirEntries) {
  using T = float;
  const T inf = std::numeric_limits<T>::infinity();
  const Matrix<T> base = random_matrix<T>(9, 37, 60);  // 37 columns: a round of 32 and a tail
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> col_major = base;
  EXPECT_EQ(detail::finite_probe(base), T(0));
  EXPECT_EQ(detail::finite_probe(col_major), T(0));
  for (Index i = 0; i < base.rows(); ++i)
    for (Index j = 0; j < base.cols(); ++j) {
      SCOPED_TRACE(::testing::Message() << "entry (" << i << ", " << j << ")");
      Matrix<T> m = base;
      m(i, j) = inf;
      Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> c = col_major;
      c(i, j) = std::numeric_limits<T>::quiet_NaN();
      EXPECT_TRUE(std::isnan(detail::finite_probe(m)));
      EXPECT_TRUE(std::isnan(detail::finite_probe(c)));
      // rows 2 .. 6 (contiguous), columns 3 .. 33 (strided rows), the same columns as a map
      const bool in_rows = i >= 2 && i < 7, in_cols = j >= 3 && j < 34;
      EXPECT_EQ(std::isnan(detail::finite_probe(m.middleRows(2, 5))), in_rows);
      EXPECT_EQ(std::isnan(detail::finite_probe(m.middleCols(3, 31))), in_cols);
      EXPECT_EQ(std::isnan(detail::finite_probe(m.block(2, 3, 5, 31))), in_rows && in_cols);
      EXPECT_EQ(std::isnan(detail::finite_probe(c.middleCols(3, 31))), in_cols);
      EXPECT_EQ(std::isnan(detail::finite_probe(c.middleRows(2, 5))), in_rows);
      const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> strided(
          m.data() + 3, m.rows(), 31, Eigen::OuterStride<>(m.cols()));
      EXPECT_EQ(std::isnan(detail::finite_probe(strided)), in_cols);
      EXPECT_EQ(std::isnan(detail::finite_probe(m.row(i))), true);
      EXPECT_EQ(std::isnan(detail::finite_probe(c.col(j))), true);
      EXPECT_EQ(std::isnan(detail::finite_probe(m.col(j))), true);
      EXPECT_EQ(std::isnan(detail::finite_probe(m.row((i + 1) % m.rows()))), false);
      EXPECT_EQ(std::isnan(detail::finite_probe(c.col((j + 1) % c.cols()))), false);
    }
}

/// Three pieces, backward in reverse (each fed its successor's grad.state) against one call:
/// every gradient.
TEST(GmaStateGrad, PiecesBackwardEqualsOneCall) {
  using T = double;
  const Index N = 90, K = 6, r = 4, dv = 5;
  const gma::Mixture<T> mix = test_mixture<T>(K, r, 41);
  const Matrix<T> q = random_matrix<T>(N, r, 42), k = random_matrix<T>(N, r, 43);
  const Matrix<T> v = random_matrix<T>(N, dv, 44), dout = random_matrix<T>(N, dv, 45);
  gma::Options opt;
  opt.causal = true;
  opt.chunk = 16;
  gma::Saved<T> saved;
  gma::forward(mix, q, k, v, opt, &saved);
  const gma::Grad<T> whole = gma::backward(mix, q, k, v, dout, saved, opt);
  EXPECT_EQ(whole.state.S.size(), 0);  // not a continued forward: no state gradient

  const Index cut[4] = {0, 37, 38, N};  // a long piece, a single token, a long piece
  gma::State<T> st = gma::State<T>::empty(K, dv);
  std::vector<gma::Saved<T>> saves(3);
  for (int p = 0; p < 3; ++p) {
    const Index a = cut[p], n = cut[p + 1] - cut[p];
    gma::forward(mix, q.middleRows(a, n), k.middleRows(a, n), v.middleRows(a, n), opt, st,
                 &saves[p]);
  }
  Matrix<T> gq(N, r), gk(N, r), gv(N, dv);
  gma::MixtureGrad<T> gm{Matrix<T>::Zero(K, r), Matrix<T>::Zero(K, r), Vector<T>::Zero(K)};
  gma::StateGrad<T> carry;
  for (int p = 2; p >= 0; --p) {
    const Index a = cut[p], n = cut[p + 1] - cut[p];
    const gma::Grad<T> g =
        gma::backward(mix, q.middleRows(a, n), k.middleRows(a, n), v.middleRows(a, n),
                      dout.middleRows(a, n), saves[p], opt, p == 2 ? nullptr : &carry);
    gq.middleRows(a, n) = g.q;
    gk.middleRows(a, n) = g.k;
    gv.middleRows(a, n) = g.v;
    gm.mean += g.mixture.mean;
    gm.var_raw += g.mixture.var_raw;
    gm.prior_logit += g.mixture.prior_logit;
    carry = g.state;
  }
  // 1e-10: the pieces' sums are the one call's, reordered (N = 90 terms of O(1) size).
  const double rtol = 1e-10, atol = 1e-12;
  EXPECT_TRUE(all_close(gq, whole.q, rtol, atol));
  EXPECT_TRUE(all_close(gk, whole.k, rtol, atol));
  EXPECT_TRUE(all_close(gv, whole.v, rtol, atol));
  EXPECT_TRUE(all_close(gm.mean, whole.mixture.mean, rtol, atol));
  EXPECT_TRUE(all_close(gm.var_raw, whole.mixture.var_raw, rtol, atol));
  EXPECT_TRUE(all_close(gm.prior_logit, whole.mixture.prior_logit, rtol, atol));
  // The whole sequence started from the empty state: the gradient of its zeros is still
  // defined (the loss is affine in S0, z0), and one piece from empty gives the same.
  EXPECT_EQ(carry.S.rows(), K);
}

/// Central differences in double of a continued forward with a loss that also reads the end
/// state: L = sum(dout . O) + <A, S_T> + <b, z_T>, for S0, z0, q, k, v and the mixture.
TEST(GmaStateGrad, FiniteDifferencesOfStartStateAndInputs) {
  using T = double;
  const Index N = 7, K = 3, r = 2, dv = 3;
  gma::Mixture<T> mix = test_mixture<T>(K, r, 51);
  Matrix<T> q = random_matrix<T>(N, r, 52), k = random_matrix<T>(N, r, 53);
  Matrix<T> v = random_matrix<T>(N, dv, 54);
  const Matrix<T> dout = random_matrix<T>(N, dv, 55);
  gma::Options opt;
  opt.causal = true;
  opt.chunk = 4;  // two chunks, so the scan's state hand-over is inside the check
  gma::State<T> start = gma::State<T>::empty(K, dv);
  start.S = random_matrix<T>(K, dv, 56);
  start.z = (random_matrix<T>(K, 1, 57).array().abs() + 0.5).matrix();  // sums of gammas: > 0
  start.tokens_seen = 11;
  gma::StateGrad<T> end_grad{random_matrix<T>(K, dv, 58), random_matrix<T>(K, 1, 59)};

  const auto loss = [&] {
    gma::State<T> st = start;
    const Matrix<T> o = gma::forward(mix, q, k, v, opt, st);
    return o.cwiseProduct(dout).sum() + st.S.cwiseProduct(end_grad.S).sum() + st.z.dot(end_grad.z);
  };
  gma::State<T> st = start;
  gma::Saved<T> saved;
  gma::forward(mix, q, k, v, opt, st, &saved);
  const gma::Grad<T> g = gma::backward(mix, q, k, v, dout, saved, opt, &end_grad);

  // h = 1e-6 (test_util): truncation O(h^2) and rounding O(1e-16 / h) both near 1e-10, on
  // gradients of O(1): 1e-7 relative leaves a margin of ~100.
  const double rtol = 1e-7, atol = 1e-8;
  EXPECT_TRUE(all_close(g.state.S, numeric_gradient(start.S, loss), rtol, atol));
  EXPECT_TRUE(all_close(g.state.z, numeric_gradient(start.z, loss), rtol, atol));
  EXPECT_TRUE(all_close(g.q, numeric_gradient(q, loss), rtol, atol));
  EXPECT_TRUE(all_close(g.k, numeric_gradient(k, loss), rtol, atol));
  EXPECT_TRUE(all_close(g.v, numeric_gradient(v, loss), rtol, atol));
  EXPECT_TRUE(all_close(g.mixture.mean, numeric_gradient(mix.mean, loss), rtol, atol));
  EXPECT_TRUE(all_close(g.mixture.var_raw, numeric_gradient(mix.var_raw, loss), rtol, atol));
  EXPECT_TRUE(
      all_close(g.mixture.prior_logit, numeric_gradient(mix.prior_logit, loss), rtol, atol));
}

/// The case fuzz_gma_state reported as "chained backward differs from one call": K = 6 alike
/// components (mean, var_raw, prior_logit all 0, var_floor 1), q = k = 0, r = 2, d_v = 1, N = 29,
/// eps = 1, pieces of 6 and 23 tokens. Every dgamma row is then the same in all components, so
/// the softmax passes nothing on: the gradients of the mixture, q and k are exactly 0 (the loss
/// is flat there to first order; long-double central differences shrink as h^2), and the two
/// backwards returned rounding of terms of order 1 (var_raw: 2.4e-18 and 3.6e-18), which a
/// comparison relative to the gradients' own size took for a difference. Here: both backwards
/// agree with central differences and each other, and those gradients are 0 to rounding.
TEST(GmaStateGrad, AlikeComponentsGiveZeroGradientsAcrossPieces) {
  using T = double;
  const Index K = 6, r = 2, dv = 1, N = 29;
  gma::Mixture<T> mix;
  mix.mean = Matrix<T>::Zero(K, r);
  mix.var_raw = Matrix<T>::Zero(K, r);
  mix.prior_logit = Vector<T>::Zero(K);
  mix.var_floor = 1;
  Matrix<T> q = Matrix<T>::Zero(N, r), k = Matrix<T>::Zero(N, r);
  Matrix<T> v = random_matrix<T>(N, dv, 61);
  const Matrix<T> dout = random_matrix<T>(N, dv, 62);
  gma::Options opt;
  opt.causal = true;
  opt.eps = 1;
  const std::vector<Index> cut = {0, 6, N};

  gma::State<T> st = gma::State<T>::empty(K, dv);
  std::vector<gma::Saved<T>> saves(2);
  for (std::size_t p = 0; p < 2; ++p) {
    const Index a = cut[p], n = cut[p + 1] - a;
    gma::forward(mix, q.middleRows(a, n), k.middleRows(a, n), v.middleRows(a, n), opt, st,
                 &saves[p]);
  }
  gma::Grad<T> chained;
  chained.q.resize(N, r);
  chained.k.resize(N, r);
  chained.v.resize(N, dv);
  gma::StateGrad<T> carry;
  for (std::size_t p = 2; p-- > 0;) {
    const Index a = cut[p], n = cut[p + 1] - a;
    const gma::Grad<T> g =
        gma::backward(mix, q.middleRows(a, n), k.middleRows(a, n), v.middleRows(a, n),
                      dout.middleRows(a, n), saves[p], opt, p == 1 ? nullptr : &carry);
    chained.q.middleRows(a, n) = g.q;
    chained.k.middleRows(a, n) = g.k;
    chained.v.middleRows(a, n) = g.v;
    if (p == 1) {
      chained.mixture = g.mixture;
    } else {
      chained.mixture.mean += g.mixture.mean;
      chained.mixture.var_raw += g.mixture.var_raw;
      chained.mixture.prior_logit += g.mixture.prior_logit;
    }
    carry = g.state;
  }
  gma::Saved<T> saved;
  gma::forward(mix, q, k, v, opt, &saved);
  const gma::Grad<T> whole = gma::backward(mix, q, k, v, dout, saved, opt);

  const auto loss = [&] { return gma::forward(mix, q, k, v, opt).cwiseProduct(dout).sum(); };
  // h = 1e-6: rounding O(1e-16 / h) = 1e-10 and truncation O(h^2) on a loss of O(1), as in
  // FiniteDifferencesOfStartStateAndInputs; an exactly zero derivative comes out as that noise.
  const double rtol = 1e-7, atol = 1e-8;
  // 0 to rounding: each entry sums m = 2N terms (query and key side) gamma_k (dgamma_k -
  // gamma . dgamma) times a factor <= 2 (P sigmoid / 2 for var_raw, 1 + pi K for prior_logit, 0 for
  // the others: x = mean), |dgamma| <= 2 N max|v| max|dO| (den >= eps = 1, |O| <= max|v|,
  // z <= N); a sum of m terms rounds by at most m 2^-53 of m times its largest term.
  const double dgamma = 2.0 * N * v.cwiseAbs().maxCoeff() * dout.cwiseAbs().maxCoeff();
  const double zero = (2.0 * N) * (2.0 * N) * 2 * 2 * dgamma * 0x1p-53;
  for (const gma::Grad<T>* g : {static_cast<const gma::Grad<T>*>(&chained), &whole}) {
    EXPECT_TRUE(all_close(g->q, numeric_gradient(q, loss), rtol, atol));
    EXPECT_TRUE(all_close(g->k, numeric_gradient(k, loss), rtol, atol));
    EXPECT_TRUE(all_close(g->v, numeric_gradient(v, loss), rtol, atol));
    EXPECT_TRUE(all_close(g->mixture.mean, numeric_gradient(mix.mean, loss), rtol, atol));
    EXPECT_TRUE(all_close(g->mixture.var_raw, numeric_gradient(mix.var_raw, loss), rtol, atol));
    EXPECT_TRUE(
        all_close(g->mixture.prior_logit, numeric_gradient(mix.prior_logit, loss), rtol, atol));
    EXPECT_LE(g->q.cwiseAbs().maxCoeff(), zero);
    EXPECT_LE(g->k.cwiseAbs().maxCoeff(), zero);
    EXPECT_LE(g->mixture.mean.cwiseAbs().maxCoeff(), zero);
    EXPECT_LE(g->mixture.var_raw.cwiseAbs().maxCoeff(), zero);
    EXPECT_LE(g->mixture.prior_logit.cwiseAbs().maxCoeff(), zero);
  }
  // The pieces reorder the sums of the one call (PiecesBackwardEqualsOneCall's tolerances); the
  // entries at rounding level agree within atol.
  EXPECT_TRUE(all_close(chained.v, whole.v, 1e-10, 1e-12));
  EXPECT_TRUE(all_close(chained.mixture.var_raw, whole.mixture.var_raw, 1e-10, 1e-12));
  EXPECT_TRUE(all_close(chained.mixture.prior_logit, whole.mixture.prior_logit, 1e-10, 1e-12));
}

}  // namespace
