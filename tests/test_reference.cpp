// O(N^2) softmax attention (SPEC.md §3): the naive oracle against a direct triple loop, the tiled
// online-softmax form against the naive one (forward, log-sum-exp and backward, at the public tile
// sizes and at small tile sizes that force many partial and diagonal tiles), every backward
// against central differences in double, argument validation, empty inputs and extreme logits.
#include <mixattn/reference.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;
namespace ref = mixattn::reference;

template <class T>
struct Tol;
// float: logits and probabilities carry ~1e-7 relative rounding, amplified by the sums over
// r, M and d_v terms (<= a few hundred here) and by exp near 1: 1e-4 relative / 2e-5 absolute
// on O(1) outputs leaves a margin of ~10 while still catching any wrong term (O(1/M) effects).
template <>
struct Tol<float> {
  static constexpr double rtol = 1e-4, atol = 2e-5;
};
// double: the same argument at eps = 1.1e-16 gives ~1e-13; 1e-11 leaves a margin of ~100.
template <>
struct Tol<double> {
  static constexpr double rtol = 1e-11, atol = 1e-11;
};

/// Direct triple loop in double: o_i = sum_j softmax_j(scale q_i . k_j, j visible) v_j.
/// Also returns lse_i = log sum_j exp(scale q_i . k_j) over the visible j.
template <class T>
Matrix<double> triple_loop(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, double scale,
                           bool causal, Vector<double>* lse = nullptr) {
  const Index n = q.rows(), m = k.rows(), r = q.cols(), dv = v.cols();
  Matrix<double> out = Matrix<double>::Zero(n, dv);
  if (lse) lse->resize(n);
  std::vector<double> logit(static_cast<size_t>(m));
  for (Index i = 0; i < n; ++i) {
    const Index visible = causal ? i + 1 : m;
    double mx = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < visible; ++j) {
      double s = 0;
      for (Index c = 0; c < r; ++c) s += double(q(i, c)) * double(k(j, c));
      logit[j] = scale * s;
      mx = std::max(mx, logit[j]);
    }
    double sum = 0;
    for (Index j = 0; j < visible; ++j) sum += std::exp(logit[j] - mx);
    for (Index j = 0; j < visible; ++j) {
      const double p = std::exp(logit[j] - mx) / sum;
      for (Index c = 0; c < dv; ++c) out(i, c) += p * double(v(j, c));
    }
    if (lse) (*lse)[i] = mx + std::log(sum);
  }
  return out;
}

struct Shape {
  Index n, m, r, dv;
};

std::string describe(const Shape& s, bool causal, std::uint64_t seed) {
  return "N=" + std::to_string(s.n) + " M=" + std::to_string(s.m) + " r=" + std::to_string(s.r) +
         " d_v=" + std::to_string(s.dv) + (causal ? " causal" : " bidirectional") +
         " seed=" + std::to_string(seed);
}

// Shapes for flash vs naive: tiny N, N != M both ways, sizes off every tile multiple, one key
// tile of 256, several tiles in both directions, and causal query tiles past a whole key tile of
// the forward (float: 192 x 512), whose row maxima come from the score tiles' registers.
const std::vector<Shape> kShapes = {
    {1, 1, 3, 2},    {1, 9, 4, 3},       {2, 2, 5, 4},     {2, 300, 8, 5},    {67, 67, 16, 8},
    {64, 256, 8, 8}, {300, 517, 16, 12}, {515, 515, 8, 6}, {129, 1000, 4, 4}, {777, 777, 8, 16}};

template <class T>
class Reference : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
struct ScalarName {
  template <class T>
  static std::string GetName(int) {
    return std::is_same<T, float>::value ? "float" : "double";
  }
};
TYPED_TEST_SUITE(Reference, Scalars, ScalarName);

// ---------------------------------------------------------------------------------------------
// naive vs the triple loop

TYPED_TEST(Reference, NaiveMatchesTripleLoop) {
  using T = TypeParam;
  struct Case {
    Shape s;
    bool causal;
    double scale;  // 0 = default 1/sqrt(r)
  };
  const std::vector<Case> cases = {{{7, 11, 5, 3}, false, 0}, {{7, 11, 5, 3}, false, 0.37},
                                   {{9, 9, 4, 6}, true, 0},   {{9, 9, 4, 6}, true, 1.7},
                                   {{1, 1, 2, 1}, true, 0},   {{3, 40, 16, 2}, false, 0}};
  std::uint64_t seed = 100;
  for (const Case& c : cases) {
    ++seed;
    SCOPED_TRACE(describe(c.s, c.causal, seed) + " scale=" + std::to_string(c.scale));
    const Matrix<T> q = random_matrix<T>(c.s.n, c.s.r, seed);
    const Matrix<T> k = random_matrix<T>(c.s.m, c.s.r, seed + 1000);
    const Matrix<T> v = random_matrix<T>(c.s.m, c.s.dv, seed + 2000);
    ref::Options opt;
    opt.causal = c.causal;
    opt.scale = c.scale;
    const double scale = c.scale != 0 ? c.scale : 1 / std::sqrt(double(c.s.r));
    const Matrix<double> expected = triple_loop(q, k, v, scale, c.causal);
    ref::Saved<T> saved;
    const Matrix<T> got = ref::naive_forward<T>(q, k, v, opt, &saved);
    EXPECT_TRUE(mixattn::testing::all_close(got, expected, Tol<T>::rtol, Tol<T>::atol));
    // The saved probabilities are row-stochastic and zero above the diagonal when causal.
    ASSERT_EQ(saved.probs.rows(), c.s.n);
    ASSERT_EQ(saved.probs.cols(), c.s.m);
    for (Index i = 0; i < c.s.n; ++i) {
      EXPECT_NEAR(double(saved.probs.row(i).sum()), 1.0, 10 * Tol<T>::rtol);
      if (c.causal) {
        for (Index j = i + 1; j < c.s.m; ++j) EXPECT_EQ(saved.probs(i, j), T(0));
      }
    }
  }
}

// The default scale is 1/sqrt(r), not 1: a loop run at scale 1 must disagree.
TYPED_TEST(Reference, DefaultScaleIsInverseSqrtR) {
  using T = TypeParam;
  const Matrix<T> q = random_matrix<T>(6, 16, 1), k = random_matrix<T>(8, 16, 2);
  const Matrix<T> v = random_matrix<T>(8, 3, 3);
  const Matrix<T> got = ref::flash_forward<T>(q, k, v);
  EXPECT_TRUE(mixattn::testing::all_close(got, triple_loop(q, k, v, 0.25, false), Tol<T>::rtol,
                                          Tol<T>::atol));
  EXPECT_FALSE(mixattn::testing::all_close(got, triple_loop(q, k, v, 1.0, false), Tol<T>::rtol,
                                           Tol<T>::atol));
}

// ---------------------------------------------------------------------------------------------
// flash vs naive, forward

TYPED_TEST(Reference, FlashForwardMatchesNaive) {
  using T = TypeParam;
  std::uint64_t seed = 200;
  for (const Shape& s : kShapes)
    for (bool causal : {false, true}) {
      if (causal && s.n != s.m) continue;
      ++seed;
      SCOPED_TRACE(describe(s, causal, seed));
      const Matrix<T> q = random_matrix<T>(s.n, s.r, seed);
      const Matrix<T> k = random_matrix<T>(s.m, s.r, seed + 1000);
      const Matrix<T> v = random_matrix<T>(s.m, s.dv, seed + 2000);
      ref::Options opt;
      opt.causal = causal;
      const Matrix<T> naive = ref::naive_forward<T>(q, k, v, opt);
      ref::Saved<T> saved;
      const Matrix<T> flash = ref::flash_forward<T>(q, k, v, opt, &saved);
      EXPECT_TRUE(mixattn::testing::all_close(flash, naive, Tol<T>::rtol, Tol<T>::atol));

      // What flash saves: the output itself and the log-sum-exp of every row, O(N) memory.
      EXPECT_EQ(saved.probs.size(), 0);
      EXPECT_TRUE(saved.out == flash);  // the very same numbers
      Vector<double> lse;
      triple_loop(q, k, v, 1 / std::sqrt(double(s.r)), causal, &lse);
      EXPECT_TRUE(mixattn::testing::all_close(saved.lse, lse, Tol<T>::rtol, Tol<T>::atol));
    }
}

// Strided views (a block of a wider matrix) and Maps bind without copies and give the same answer.
TYPED_TEST(Reference, StridedAndMappedInputs) {
  using T = TypeParam;
  const Matrix<T> wide = random_matrix<T>(100, 30, 7);
  const Matrix<T> q = wide.block(0, 0, 70, 8), k = wide.block(10, 9, 90, 8);
  const Matrix<T> v = wide.block(10, 20, 90, 5);
  ref::Options opt;
  const Matrix<T> expected = ref::naive_forward<T>(q, k, v, opt);
  const Eigen::Map<const Matrix<T>> qmap(q.data(), q.rows(), q.cols());
  const Matrix<T> got =
      ref::flash_forward<T>(qmap, wide.block(10, 9, 90, 8), wide.block(10, 20, 90, 5), opt);
  EXPECT_TRUE(mixattn::testing::all_close(got, expected, Tol<T>::rtol, Tol<T>::atol));
}

// ---------------------------------------------------------------------------------------------
// small tiles: the kernels at tile sizes that make every shape span many query and key tiles,
// with query tiles longer, shorter and coprime to key tiles (diagonal tiles cut at odd places).

template <class T, Index BQ, Index BK>
void check_small_tiles(std::uint64_t seed) {
  const std::vector<Shape> shapes = {
      {1, 1, 3, 2}, {2, 2, 3, 2}, {5, 13, 4, 3}, {37, 37, 6, 5}, {40, 23, 5, 4}};
  for (const Shape& s : shapes)
    for (bool causal : {false, true}) {
      if (causal && s.n != s.m) continue;
      ++seed;
      SCOPED_TRACE(describe(s, causal, seed) + " tiles " + std::to_string(BQ) + " x " +
                   std::to_string(BK));
      const Matrix<T> q = random_matrix<T>(s.n, s.r, seed);
      const Matrix<T> k = random_matrix<T>(s.m, s.r, seed + 1000);
      const Matrix<T> v = random_matrix<T>(s.m, s.dv, seed + 2000);
      const Matrix<T> go = random_matrix<T>(s.n, s.dv, seed + 3000);
      ref::Options opt;
      opt.causal = causal;
      opt.scale = 0.6;
      ref::Saved<T> ns;
      const Matrix<T> naive = ref::naive_forward<T>(q, k, v, opt, &ns);
      const ref::Grad<T> ng = ref::naive_backward(q, k, v, go, ns, opt);

      Matrix<T> out(s.n, s.dv);
      Vector<T> lse(s.n);
      mixattn::detail::flash_forward_tiles<T, BQ, BK>(q, k, v, T(0.6), causal, out, lse);
      EXPECT_TRUE(mixattn::testing::all_close(out, naive, Tol<T>::rtol, Tol<T>::atol));
      Matrix<T> dq(s.n, s.r), dk(s.m, s.r), dv(s.m, s.dv);
      mixattn::detail::flash_backward_tiles<T, BQ, BK>(q, k, v, out, go, lse, T(0.6), causal, dq,
                                                       dk, dv);
      EXPECT_TRUE(mixattn::testing::all_close(dq, ng.q, Tol<T>::rtol, Tol<T>::atol)) << "dq";
      EXPECT_TRUE(mixattn::testing::all_close(dk, ng.k, Tol<T>::rtol, Tol<T>::atol)) << "dk";
      EXPECT_TRUE(mixattn::testing::all_close(dv, ng.v, Tol<T>::rtol, Tol<T>::atol)) << "dv";
    }
}

TYPED_TEST(Reference, SmallTilesMatchNaive) {
  check_small_tiles<TypeParam, 4, 4>(300);
  check_small_tiles<TypeParam, 8, 3>(400);
  check_small_tiles<TypeParam, 3, 8>(500);
  check_small_tiles<TypeParam, 5, 7>(600);
}

// ---------------------------------------------------------------------------------------------
// flash backward vs naive backward

TYPED_TEST(Reference, FlashBackwardMatchesNaive) {
  using T = TypeParam;
  std::uint64_t seed = 700;
  for (const Shape& s : kShapes)
    for (bool causal : {false, true}) {
      if (causal && s.n != s.m) continue;
      ++seed;
      SCOPED_TRACE(describe(s, causal, seed));
      const Matrix<T> q = random_matrix<T>(s.n, s.r, seed);
      const Matrix<T> k = random_matrix<T>(s.m, s.r, seed + 1000);
      const Matrix<T> v = random_matrix<T>(s.m, s.dv, seed + 2000);
      const Matrix<T> go = random_matrix<T>(s.n, s.dv, seed + 3000);
      ref::Options opt;
      opt.causal = causal;
      ref::Saved<T> ns, fs;
      ref::naive_forward<T>(q, k, v, opt, &ns);
      ref::flash_forward<T>(q, k, v, opt, &fs);
      const ref::Grad<T> ng = ref::naive_backward(q, k, v, go, ns, opt);
      const ref::Grad<T> fg = ref::flash_backward(q, k, v, go, fs, opt);
      EXPECT_TRUE(mixattn::testing::all_close(fg.q, ng.q, Tol<T>::rtol, Tol<T>::atol)) << "dq";
      EXPECT_TRUE(mixattn::testing::all_close(fg.k, ng.k, Tol<T>::rtol, Tol<T>::atol)) << "dk";
      EXPECT_TRUE(mixattn::testing::all_close(fg.v, ng.v, Tol<T>::rtol, Tol<T>::atol)) << "dv";
    }
}

// The one softmax row and its backward (detail/common/softmax.hpp) that every operator uses, SIMD
// and scalar, against the formulas in long double, at lengths that cover the vector body, the
// scalar tail and rows shorter than one register, with masked (-inf) logits inside the row.
template <class Arch, class T>
void check_softmax_kernels(Arch arch, std::uint64_t seed) {
  namespace d = mixattn::detail;
  using L = long double;
  for (Index n : {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100}) {
    SCOPED_TRACE("n = " + std::to_string(n) + ", seed " + std::to_string(seed));
    const Matrix<T> x = random_matrix<T>(3, n, seed++, 4.0);
    std::vector<T> s(x.row(0).data(), x.row(0).data() + n), p(static_cast<size_t>(n));
    if (n > 2) s[1] = -std::numeric_limits<T>::infinity();  // a masked logit: probability 0
    L mx = -std::numeric_limits<L>::infinity(), sum = 0;
    for (T e : s) mx = std::max(mx, static_cast<L>(e));
    for (T e : s) sum += std::exp(static_cast<L>(e) - mx);
    std::vector<T> logits = s;
    ASSERT_TRUE(d::softmax_row(arch, s.data(), n, n, p.data()));
    // p_j in [0, 1] with a few ulps of rounding from exp, the sum and the scaling
    const double tol = 8 * std::numeric_limits<T>::epsilon();
    for (Index j = 0; j < n; ++j)
      EXPECT_NEAR(double(p[j]), double(std::exp(static_cast<L>(logits[j]) - mx) / sum), tol) << j;
    if (n > 2) {
      EXPECT_EQ(p[1], T(0));
    }
    // backward: ds_j = p_j (dp_j - sum_l p_l dp_l); the reference uses the same p
    std::vector<T> ds(x.row(1).data(), x.row(1).data() + n);
    L delta = 0;
    for (Index j = 0; j < n; ++j) delta += static_cast<L>(p[j]) * static_cast<L>(ds[j]);
    std::vector<L> want(static_cast<size_t>(n));
    for (Index j = 0; j < n; ++j) want[j] = static_cast<L>(p[j]) * (static_cast<L>(ds[j]) - delta);
    d::softmax_backward_row(arch, p.data(), ds.data(), n);
    // |dp| <= 4: each term is off by a few ulps of 4 (delta's rounding to T, then p (dp - delta))
    for (Index j = 0; j < n; ++j) EXPECT_NEAR(double(ds[j]), double(want[j]), 4 * 4 * tol) << j;
  }
  // every logit masked: no finite max, reported rather than divided by zero
  std::vector<T> masked(5, -std::numeric_limits<T>::infinity()), out(5);
  EXPECT_FALSE(d::softmax_row(arch, masked.data(), 5, 5, out.data()));
  // a logit at +inf (an overflowing score, check_finite off) or NaN poisons its row, in the
  // vector body and in the scalar tail alike, so that the caller's finiteness check sees it
  for (Index n : {3, 40})
    for (T bad : {std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()}) {
      std::vector<T> row(static_cast<size_t>(n), T(1)), pr(static_cast<size_t>(n));
      row[static_cast<size_t>(n - 2)] = bad;
      d::softmax_row(arch, row.data(), n, n, pr.data());
      EXPECT_TRUE(std::isnan(pr[static_cast<size_t>(n - 2)])) << n << " " << bad;
    }
  // A NaN is the row's max wherever it stands. The vector max returns its second operand when
  // either is NaN, so a NaN one register after the largest logit, in the same lane, used to drop
  // that logit from the max: the shifted logit exp then saw was huge and positive, and xsimd's
  // double exp converts such an exponent to an integer out of range (undefined behaviour).
  // Every placement of the NaN and the large logit, in the vector body and in the scalar tail:
  for (Index n : {3, 17, 40})
    for (Index big = 0; big < n; ++big)
      for (Index at = 0; at < n; ++at) {
        if (at == big) continue;
        std::vector<T> row(static_cast<size_t>(n), T(0)), pr(static_cast<size_t>(n));
        row[static_cast<size_t>(big)] = T(1e30);
        row[static_cast<size_t>(at)] = std::numeric_limits<T>::quiet_NaN();
        ASSERT_TRUE(std::isnan(d::row_max(arch, row.data(), n))) << n << " " << big << " " << at;
        EXPECT_TRUE(std::isnan(d::max_keep_nan(T(1), row[static_cast<size_t>(at)])));
        d::softmax_row(arch, row.data(), n, n, pr.data());
        for (T e : pr) ASSERT_TRUE(std::isnan(e)) << n << " " << big << " " << at;
      }
  // empty parts (an OVQ row with no dictionary yet): max -inf, sum 0
  EXPECT_EQ(d::row_max(arch, masked.data(), 0), -std::numeric_limits<T>::infinity());
  EXPECT_EQ(d::exp_shifted_sum(arch, masked.data(), 0, T(0)), 0);
}

TYPED_TEST(Reference, SoftmaxRowAndBackwardMatchFormula) {
  check_softmax_kernels<mixattn::detail::simd_arch, TypeParam>({}, 900);
  check_softmax_kernels<mixattn::detail::scalar_arch, TypeParam>({}, 900);
}

#if MIXATTN_HAS_SIMD
/// e[i] = fast_exp(x[i]) (fast_exp_nonpositive when nonpositive) through whole registers; the
/// remainder is padded with zeros.
std::vector<float> fast_exp_of(const std::vector<float>& x, bool nonpositive) {
  using B = xsimd::batch<float, mixattn::detail::simd_arch>;
  const size_t w = B::size;
  std::vector<float> in(x), out((x.size() + w - 1) / w * w);
  in.resize(out.size(), 0.0f);
  for (size_t i = 0; i < in.size(); i += w) {
    const B v = B::load_unaligned(in.data() + i);
    (nonpositive ? mixattn::detail::fast_exp_nonpositive(v) : mixattn::detail::fast_exp(v))
        .store_unaligned(out.data() + i);
  }
  out.resize(x.size());
  return out;
}

/// |got - want| in units of float's spacing at want (2^-149 in the subnormal range).
double ulps_from(float got, double want) {
  const double spacing =
      want < double(std::numeric_limits<float>::min())
          ? std::ldexp(1.0, -149)
          : std::ldexp(1.0, std::ilogb(want) - std::numeric_limits<float>::digits + 1);
  return std::abs(double(got) - want) / spacing;
}

// The flash forward's exp (detail/common/fast_exp.hpp) against exp in double, on a dense sweep of
// the shifted logits' range x <= 0 (normal results, the subnormal range x in [-103.3, -87.3] and
// the underflow to 0 below -103.97), the positive range up to overflow for fast_exp, and the
// special values. 2 ulps: the polynomial is good to 0.2 ulp and its Horner steps and the reduction
// round about 1 ulp in all (the FMA-less SSE2 build rounds each multiply-add twice).
TEST(FastExp, MatchesExpWithinTwoUlps) {
  for (bool nonpositive : {true, false}) {
    SCOPED_TRACE(nonpositive ? "fast_exp_nonpositive" : "fast_exp");
    const double hi = nonpositive ? 0.0 : 89.0, lo = -110.0;
    const int steps = 2000000;
    std::vector<float> x;
    for (int i = 0; i <= steps; ++i) x.push_back(float(lo + (hi - lo) * i / steps));
    // zeros, tiny arguments, the ends of the reduction interval and of the subnormal range
    for (float v :
         {-0.0f, 0.0f, -1e-30f, -1e-7f, -0.3465736f, -0.3465737f, -87.33654f, -87.33655f,
          -103.2789f, -103.9721f, -103.9720f, -104.0f, -1e10f, -std::numeric_limits<float>::max()})
      x.push_back(v);
    const std::vector<float> e = fast_exp_of(x, nonpositive);
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double want = std::exp(double(x[i]));
      if (want > double(std::numeric_limits<float>::max())) {  // rounds to inf or to max
        EXPECT_GE(e[i], std::numeric_limits<float>::max()) << x[i];
        continue;
      }
      const double u = ulps_from(e[i], want);
      if (u > worst) worst = u, at = i;
    }
    RecordProperty(nonpositive ? "worst_ulps_nonpositive" : "worst_ulps", std::to_string(worst));
    EXPECT_LE(worst, 2.0) << "at x = " << x[at] << ": " << e[at] << " vs "
                          << std::exp(double(x[at]));
    const float inf = std::numeric_limits<float>::infinity();
    const std::vector<float> special = {0.0f,    -0.0f,   -inf,
                                        -104.0f, -200.0f, std::numeric_limits<float>::quiet_NaN()};
    const std::vector<float> es = fast_exp_of(special, nonpositive);
    EXPECT_EQ(es[0], 1.0f);
    EXPECT_EQ(es[1], 1.0f);
    EXPECT_EQ(es[2], 0.0f);
    EXPECT_EQ(es[3], 0.0f);
    EXPECT_EQ(es[4], 0.0f);
    EXPECT_TRUE(std::isnan(es[5]));
  }
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> big = fast_exp_of({88.7f, 88.8f, 89.0f, 1e10f, inf}, false);
  EXPECT_LE(ulps_from(big[0], std::exp(double(88.7f))), 2.0);
  for (size_t i = 1; i < big.size(); ++i) EXPECT_EQ(big[i], inf) << i;
}

/// f applied to x through whole registers of double (the remainder padded with p).
template <class F>
std::vector<double> double_lanes_of(const std::vector<double>& x, double p, F f) {
  using B = xsimd::batch<double, mixattn::detail::simd_arch>;
  const size_t w = B::size;
  std::vector<double> in(x), out((x.size() + w - 1) / w * w);
  in.resize(out.size(), p);
  for (size_t i = 0; i < in.size(); i += w)
    f(B::load_unaligned(in.data() + i)).store_unaligned(out.data() + i);
  out.resize(x.size());
  return out;
}

/// |got - want| / (|want| eps), want in long double.
double rel_eps(double got, long double want) {
  return static_cast<double>(std::fabs(static_cast<long double>(got) - want) /
                             (std::fabs(want) * std::numeric_limits<double>::epsilon()));
}

// The mixture constants' double exp and log1p (detail/common/fast_exp.hpp) against long double, on
// dense sweeps of their domains (exp: x in [-708, 0], the clamp below; log1p: u = 0 and normal u
// up to 1, both sides of the branch at sqrt 2 - 1, and tiny u where log1p(u) = u; softplus
// gives it u = exp(-|w|) >= exp(-708)). 2 eps relative: exp's
// polynomial is good to 5e-18 and its reduction and Horner steps round about 1 eps in all;
// log1p's s rounds twice (its sum and its quotient) and the series and ln 2 about once more.
TEST(FastExp, DoubleExpAndLog1pWithinTwoEps) {
  namespace d = mixattn::detail;
  std::vector<double> x;
  for (int i = 0; i <= 400000; ++i) x.push_back(-708.0 * i / 400000);
  for (double v : {-0.0, -1e-300, -1e-17, -0.34657359027997264, -0.34657359027997265, -707.9})
    x.push_back(v);
  const std::vector<double> e =
      double_lanes_of(x, 0.0, [](auto v) { return d::exp_nonpositive_double(v); });
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double err = rel_eps(e[i], std::exp(static_cast<long double>(x[i])));
    worst = std::max(worst, err);
    EXPECT_LE(err, 2.0) << "exp at " << x[i];
  }
  RecordProperty("worst_eps_exp", std::to_string(worst));
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> es =
      double_lanes_of({0.0, -709.0, -1e6, -inf, std::numeric_limits<double>::quiet_NaN()}, 0.0,
                      [](auto v) { return d::exp_nonpositive_double(v); });
  EXPECT_EQ(es[0], 1.0);
  for (size_t i = 1; i < 4; ++i) {  // clamped at -708: below the sums' resolution, never above
    EXPECT_GT(es[i], 0.0);
    EXPECT_LE(es[i], 3.4e-308);
  }
  EXPECT_TRUE(std::isnan(es[4]));
  std::vector<double> u;
  for (int i = 0; i <= 400000; ++i) u.push_back(1.0 * i / 400000);
  for (int k = 1; k <= 300; ++k) u.push_back(std::pow(10.0, -k));
  for (double v : {0.41421356237309503, 0.41421356237309504880, 0.41421356237309510, 0.5,
                   0.49999999999999994, 1.0, 2.2250738585072014e-308})
    u.push_back(v);
  const std::vector<double> l =
      double_lanes_of(u, 0.0, [](auto v) { return d::log1p_unit_double(v); });
  worst = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    const long double want = std::log1p(static_cast<long double>(u[i]));
    if (want == 0) {
      EXPECT_EQ(l[i], 0.0) << "log1p at " << u[i];
      continue;
    }
    const double err = rel_eps(l[i], want);
    worst = std::max(worst, err);
    EXPECT_LE(err, 2.0) << "log1p at " << u[i];
  }
  RecordProperty("worst_eps_log1p", std::to_string(worst));
  EXPECT_TRUE(std::isnan(double_lanes_of({std::numeric_limits<double>::quiet_NaN()}, 0.0,
                                         [](auto v) { return d::log1p_unit_double(v); })[0]));
}

/// The bits of fast_exp_in_range_many<N> (in_range) or fast_exp_nonpositive_many<N> on the
/// registers of x, N at a time, against the one-register functions on each register: the same
/// arithmetic in another order of instructions, so every result bit for bit, and NaN for NaN.
/// (Not a NaN's bits: where both operands of a multiply are NaN, x86 returns the first one's,
/// and the compiler may swap a commutative multiply's operands; the SSE2 build's 2^n scaling
/// does, for NaN inputs of either sign.)
template <int N>
void expect_many_matches_single(const std::vector<float>& x, bool in_range) {
  SCOPED_TRACE("N = " + std::to_string(N) + (in_range ? ", in range" : ", nonpositive"));
  using Arch = mixattn::detail::simd_arch;
  using B = xsimd::batch<float, Arch>;
  const size_t w = B::size, chunk = N * w;
  std::vector<float> in(x);
  in.resize((x.size() + chunk - 1) / chunk * chunk, -1.0f);
  std::vector<float> one(in.size()), many(in.size());
  for (size_t i = 0; i < in.size(); i += w) {
    const B v = B::load_unaligned(in.data() + i);
    (in_range ? mixattn::detail::fast_exp_in_range(v) : mixattn::detail::fast_exp_nonpositive(v))
        .store_unaligned(one.data() + i);
  }
  for (size_t i = 0; i < in.size(); i += chunk) {
    B v[N];
    for (int k = 0; k < N; ++k) v[k] = B::load_unaligned(in.data() + i + k * w);
    if (in_range)
      mixattn::detail::fast_exp_in_range_many<N, Arch>(v);
    else
      mixattn::detail::fast_exp_nonpositive_many<N, Arch>(v);
    for (int k = 0; k < N; ++k) v[k].store_unaligned(many.data() + i + k * w);
  }
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const bool same = std::isnan(one[i]) ? std::isnan(many[i])
                                         : std::memcmp(&one[i], &many[i], sizeof(float)) == 0;
    if (!same && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << "first at x = " << in[first] << ": " << many[first] << " vs "
                        << one[first];
}

/// fast_exp_nonpositive_flush_many<N> against fast_exp_nonpositive_many<N> on the registers of x:
/// the same bits, except that a result below 2^-127 may be 0 (the flush variant zeroes those below
/// about 2^-127.5; none with AVX-512, where both scale by scalef); with subnormals flushed
/// (FlushSubnormals, as the kernels run), the same bits everywhere. NaN for NaN.
template <int N>
void expect_flush_matches(const std::vector<float>& x) {
  SCOPED_TRACE("N = " + std::to_string(N));
  using Arch = mixattn::detail::simd_arch;
  using B = xsimd::batch<float, Arch>;
  const size_t w = B::size, chunk = N * w;
#if XSIMD_WITH_AVX512F
  constexpr bool scalef = std::is_base_of<xsimd::avx512f, Arch>::value;
#else
  constexpr bool scalef = false;
#endif
  std::vector<float> in(x);
  in.resize((x.size() + chunk - 1) / chunk * chunk, -1.0f);
  for (bool flushed : {false, true}) {
    SCOPED_TRACE(flushed ? "subnormals flushed" : "subnormals kept");
    std::vector<float> plain(in.size()), flush(in.size());
    {
      std::unique_ptr<mixattn::detail::FlushSubnormals> scope;
      if (flushed) scope = std::make_unique<mixattn::detail::FlushSubnormals>();
      for (size_t i = 0; i < in.size(); i += chunk) {
        B a[N], b[N];
        for (int k = 0; k < N; ++k) a[k] = b[k] = B::load_unaligned(in.data() + i + k * w);
        mixattn::detail::fast_exp_nonpositive_many<N, Arch>(a);
        mixattn::detail::fast_exp_nonpositive_flush_many<N, Arch>(b);
        for (int k = 0; k < N; ++k) {
          a[k].store_unaligned(plain.data() + i + k * w);
          b[k].store_unaligned(flush.data() + i + k * w);
        }
      }
    }
    size_t differ = 0, first = 0, zeroed = 0, tiny = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      tiny += plain[i] > 0.0f && plain[i] < std::ldexp(1.0f, -127);
      bool same = std::isnan(plain[i]) ? std::isnan(flush[i])
                                       : std::memcmp(&plain[i], &flush[i], sizeof(float)) == 0;
      if (!same && !flushed && flush[i] == 0.0f && !std::signbit(flush[i]) &&
          plain[i] < std::ldexp(1.0f, -127)) {
        same = true;
        ++zeroed;
      }
      if (!same && differ++ == 0) first = i;
    }
    EXPECT_EQ(differ, 0u) << "first at x = " << in[first] << ": " << flush[first] << " vs "
                          << plain[first];
    if (!flushed && std::numeric_limits<float>::has_denorm == std::denorm_present) {
      // the sweep reaches below 2^-127, and the flush variant zeroes results there (so the check
      // can tell); with scalef it is fast_exp_nonpositive_many itself and zeroes none
      EXPECT_GT(tiny, 0u);
      if (scalef)
        EXPECT_EQ(zeroed, 0u);
      else
        EXPECT_GT(zeroed, 0u);
    }
  }
}

// widened_halves_sum against add_wide into a zero accumulator (the same value, bit for bit),
// for float (two conversions and one add) and double (the register itself).
template <class T>
void check_widened_halves_sum() {
  using Arch = mixattn::detail::simd_arch;
  using B = xsimd::batch<T, Arch>;
  using W = mixattn::detail::wide_t<T>;
  using BW = xsimd::batch<W, Arch>;
  const Matrix<T> x = random_matrix<T>(40, B::size, 5, 1e3);
  std::vector<T> lanes(x.data(), x.data() + x.size());
  lanes[3] = std::numeric_limits<T>::quiet_NaN();
  lanes[B::size + 1] = std::numeric_limits<T>::infinity();
  lanes[2 * B::size] = -std::numeric_limits<T>::min();
  for (size_t i = 0; i + B::size <= lanes.size(); i += B::size) {
    const B v = B::load_unaligned(lanes.data() + i);
    BW want(W(0));
    mixattn::detail::add_wide<Arch, T>(want, v);
    const BW got = mixattn::detail::widened_halves_sum<Arch, T>(v);
    alignas(64) W a[BW::size], b[BW::size];
    want.store_aligned(a);
    got.store_aligned(b);
    EXPECT_EQ(std::memcmp(a, b, sizeof(a)), 0) << "register " << i / B::size;
  }
}

TEST(FastExp, WidenedHalvesSumMatchesAddWide) {
  check_widened_halves_sum<float>();
  check_widened_halves_sum<double>();
}

// GMA's softmax exp (2^n in one factor, results below about 2^-127.5 zero) against the
// multi-register exp, on the nonpositive sweep of the test below and its special values.
TEST(FastExp, FlushVariantIsTheExpOrZeroBelowTwoToMinus127) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x;
  const int steps = 400000;
  for (int i = 0; i <= steps; ++i) x.push_back(float(-110.0 * i / steps));
  for (float v :
       {0.0f, -0.0f, -1e-30f, -0.3465736f, -87.33654f, -87.33655f, -88.0297f, -88.0298f, -88.72284f,
        -88.72283f, -103.2789f, -103.9721f, -104.0f, -200.0f, -1e10f, -inf, nan, -nan})
    x.push_back(v);
  expect_flush_matches<1>(x);
  expect_flush_matches<3>(x);
  expect_flush_matches<4>(x);
  expect_flush_matches<8>(x);
}

// The multi-register exp of the softmax passes against the one-register exp, on the sweep of
// FastExp.MatchesExpWithinTwoUlps (both functions' ranges) and its special values.
TEST(FastExp, ManyRegistersMatchOneRegisterBitForBit) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> special = {0.0f,        -0.0f,      -1e-30f,    -1e-7f,     -0.3465736f,
                                      -0.3465737f, -87.33654f, -87.33655f, -103.2789f, -103.9721f,
                                      -103.9720f,  -104.0f,    -200.0f,    -1e10f,     -inf,
                                      88.7f,       89.0f,      nan,        -nan};
  const int steps = 400000;
  for (bool in_range : {false, true}) {
    // in range: [-104, 89]; nonpositive: [-110, 0] and below
    const double lo = in_range ? -104.0 : -110.0, hi = in_range ? 89.0 : 0.0;
    std::vector<float> x;
    for (int i = 0; i <= steps; ++i) x.push_back(float(lo + (hi - lo) * i / steps));
    for (float v : special)
      if (!in_range ? !(v > 0) : (std::isnan(v) || (v >= -104.0f && v <= 89.0f))) x.push_back(v);
    expect_many_matches_single<1>(x, in_range);
    expect_many_matches_single<2>(x, in_range);
    expect_many_matches_single<3>(x, in_range);
    expect_many_matches_single<4>(x, in_range);
    expect_many_matches_single<5>(x, in_range);
    expect_many_matches_single<8>(x, in_range);
    expect_many_matches_single<13>(x, in_range);
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// central differences in double, for q, k and v of both forms

enum class Form { naive, flash };

void check_gradients(Form form, const Shape& s, bool causal, double scale, std::uint64_t seed) {
  SCOPED_TRACE(describe(s, causal, seed) + (form == Form::naive ? " naive" : " flash"));
  Matrix<double> q = random_matrix<double>(s.n, s.r, seed);
  Matrix<double> k = random_matrix<double>(s.m, s.r, seed + 1000);
  Matrix<double> v = random_matrix<double>(s.m, s.dv, seed + 2000);
  const Matrix<double> w = random_matrix<double>(s.n, s.dv, seed + 3000);  // loss = sum(w o O)
  ref::Options opt;
  opt.causal = causal;
  opt.scale = scale;
  auto forward = [&](ref::Saved<double>* saved) {
    return form == Form::naive ? ref::naive_forward<double>(q, k, v, opt, saved)
                               : ref::flash_forward<double>(q, k, v, opt, saved);
  };
  auto loss = [&] { return forward(nullptr).cwiseProduct(w).sum(); };
  ref::Saved<double> saved;
  forward(&saved);
  const ref::Grad<double> g = form == Form::naive ? ref::naive_backward(q, k, v, w, saved, opt)
                                                  : ref::flash_backward(q, k, v, w, saved, opt);
  // h = 1e-6 central differences: truncation ~h^2 |f'''| ~ 1e-12, rounding ~eps |f| / h ~ 1e-10
  // for |loss| <= ~1e2; 1e-7 absolute plus 1e-6 relative is well above both, far below O(1e-2)
  // errors that any wrong term would produce.
  EXPECT_TRUE(mixattn::testing::all_close(g.q, numeric_gradient(q, loss), 1e-6, 1e-7)) << "dq";
  EXPECT_TRUE(mixattn::testing::all_close(g.k, numeric_gradient(k, loss), 1e-6, 1e-7)) << "dk";
  EXPECT_TRUE(mixattn::testing::all_close(g.v, numeric_gradient(v, loss), 1e-6, 1e-7)) << "dv";
}

TEST(ReferenceGradient, NaiveMatchesCentralDifferences) {
  check_gradients(Form::naive, {5, 7, 3, 4}, false, 0, 11);
  check_gradients(Form::naive, {6, 6, 3, 4}, true, 0, 12);
  check_gradients(Form::naive, {4, 9, 5, 2}, false, 1.3, 13);
}

TEST(ReferenceGradient, FlashMatchesCentralDifferences) {
  check_gradients(Form::flash, {5, 7, 3, 4}, false, 0, 21);
  check_gradients(Form::flash, {6, 6, 3, 4}, true, 0, 22);
  // Several public query tiles (64) and, bidirectionally, more than one key tile (256 / 128).
  check_gradients(Form::flash, {70, 70, 2, 2}, true, 0.8, 23);
  check_gradients(Form::flash, {66, 260, 2, 2}, false, 0, 24);
}

// ---------------------------------------------------------------------------------------------
// validation

template <class E, class F>
void expect_throw_naming(F&& f, const std::string& fn, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << fn << ": expected an exception mentioning '" << needle << "'";
  } catch (const E& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("mixattn::reference::" + fn), std::string::npos) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << "'" << needle << "' not in: " << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << fn << ": wrong exception type: " << e.what();
  }
}

template <class T>
struct Api {
  // Runs forward `which` (naive/flash) or its backward (with a matching Saved made internally
  // from `sq, sk, sv`, unless `saved` is given).
  static Matrix<T> forward(bool flash, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                           const ref::Options& opt, ref::Saved<T>* saved = nullptr) {
    return flash ? ref::flash_forward<T>(q, k, v, opt, saved)
                 : ref::naive_forward<T>(q, k, v, opt, saved);
  }
  static ref::Grad<T> backward(bool flash, const Matrix<T>& q, const Matrix<T>& k,
                               const Matrix<T>& v, const Matrix<T>& go, const ref::Saved<T>& s,
                               const ref::Options& opt) {
    return flash ? ref::flash_backward(q, k, v, go, s, opt)
                 : ref::naive_backward(q, k, v, go, s, opt);
  }
};

TYPED_TEST(Reference, BadShapesAndOptionsThrowInvalidArgument) {
  using T = TypeParam;
  using A = Api<T>;
  const Matrix<T> q = random_matrix<T>(4, 3, 1), k = random_matrix<T>(5, 3, 2);
  const Matrix<T> v = random_matrix<T>(5, 2, 3), go = random_matrix<T>(4, 2, 4);
  const Matrix<T> k_wide = random_matrix<T>(5, 4, 5), v_short = random_matrix<T>(4, 2, 6);
  const Matrix<T> q0(4, 0), k0(5, 0), k_empty(0, 3), v_empty(0, 2);
  ref::Options causal;
  causal.causal = true;
  ref::Options nan_scale, inf_scale;
  nan_scale.scale = std::numeric_limits<double>::quiet_NaN();
  inf_scale.scale = std::numeric_limits<double>::infinity();

  for (bool flash : {false, true}) {
    const std::string fwd = flash ? "flash_forward" : "naive_forward";
    const std::string bwd = flash ? "flash_backward" : "naive_backward";
    SCOPED_TRACE(fwd);
    using IA = std::invalid_argument;
    expect_throw_naming<IA>([&] { A::forward(flash, q, k_wide, v, {}); }, fwd, "k has 4 columns");
    expect_throw_naming<IA>([&] { A::forward(flash, q, k, v_short, {}); }, fwd, "v has 4 rows");
    expect_throw_naming<IA>([&] { A::forward(flash, q0, k0, v, {}); }, fwd, "q has 0 columns");
    expect_throw_naming<IA>([&] { A::forward(flash, q, k, v, causal); }, fwd, "causal");
    expect_throw_naming<IA>([&] { A::forward(flash, q, k_empty, v_empty, {}); }, fwd,
                            "k has 0 rows");
    expect_throw_naming<IA>([&] { A::forward(flash, q, k, v, nan_scale); }, fwd, "options.scale");
    expect_throw_naming<IA>([&] { A::forward(flash, q, k, v, inf_scale); }, fwd, "options.scale");

    ref::Saved<T> good;
    A::forward(flash, q, k, v, {}, &good);
    EXPECT_NO_THROW(A::backward(flash, q, k, v, go, good, {}));
    // Inputs are validated by backward too.
    expect_throw_naming<IA>([&] { A::backward(flash, q, k_wide, v, go, good, {}); }, bwd,
                            "k has 4 columns");
    const Matrix<T> go_bad = random_matrix<T>(4, 3, 7);
    expect_throw_naming<IA>([&] { A::backward(flash, q, k, v, go_bad, good, {}); }, bwd,
                            "grad_out is 4 x 3");
    const ref::Saved<T> empty;
    expect_throw_naming<IA>([&] { A::backward(flash, q, k, v, go, empty, {}); }, bwd, "saved");
    ref::Saved<T> other_form;
    A::forward(!flash, q, k, v, {}, &other_form);
    expect_throw_naming<IA>([&] { A::backward(flash, q, k, v, go, other_form, {}); }, bwd, "saved");
    ref::Saved<T> other_shape;
    const Matrix<T> k6 = random_matrix<T>(6, 3, 8), v6 = random_matrix<T>(6, 2, 9);
    A::forward(flash, q, k6, v6, {}, &other_shape);
    expect_throw_naming<IA>([&] { A::backward(flash, q, k, v, go, other_shape, {}); }, bwd,
                            "saved is for 4 queries, 6 keys");
    ref::Options other_scale;
    other_scale.scale = 2;
    expect_throw_naming<IA>([&] { A::backward(flash, q, k, v, go, good, other_scale); }, bwd,
                            "saved was made with");
  }
}

TYPED_TEST(Reference, NonFiniteInputsThrowDomainError) {
  using T = TypeParam;
  using A = Api<T>;
  const Matrix<T> q = random_matrix<T>(4, 3, 1), k = random_matrix<T>(4, 3, 2);
  const Matrix<T> v = random_matrix<T>(4, 2, 3), go = random_matrix<T>(4, 2, 4);
  const T nan = std::numeric_limits<T>::quiet_NaN(), inf = std::numeric_limits<T>::infinity();
  Matrix<T> q_bad = q, k_bad = k, v_bad = v, go_bad = go;
  q_bad(1, 2) = nan;
  k_bad(3, 0) = inf;
  v_bad(0, 1) = -inf;
  go_bad(2, 1) = nan;
  ref::Options unchecked;
  unchecked.check_finite = false;

  for (bool flash : {false, true}) {
    const std::string fwd = flash ? "flash_forward" : "naive_forward";
    const std::string bwd = flash ? "flash_backward" : "naive_backward";
    SCOPED_TRACE(fwd);
    using DE = std::domain_error;
    expect_throw_naming<DE>([&] { A::forward(flash, q_bad, k, v, {}); }, fwd, "q has a non-finite");
    expect_throw_naming<DE>([&] { A::forward(flash, q, k_bad, v, {}); }, fwd, "k has a non-finite");
    expect_throw_naming<DE>([&] { A::forward(flash, q, k, v_bad, {}); }, fwd, "v has a non-finite");
    ref::Saved<T> saved;
    A::forward(flash, q, k, v, {}, &saved);
    expect_throw_naming<DE>([&] { A::backward(flash, q_bad, k, v, go, saved, {}); }, bwd,
                            "q has a non-finite");
    expect_throw_naming<DE>([&] { A::backward(flash, q, k, v, go_bad, saved, {}); }, bwd,
                            "grad_out has a non-finite");
    // Unchecked: no throw, and the NaN reaches the output row of the bad query only.
    Matrix<T> out;
    EXPECT_NO_THROW(out = A::forward(flash, q_bad, k, v, unchecked));
    EXPECT_TRUE(out.row(1).hasNaN());
    EXPECT_TRUE(out.row(0).allFinite());
  }
}

// Unchecked NaN in one key, at every register and chunk position of a public key tile (whole key
// tiles take their row maxima in the score tiles' registers, masked ones from the stored scores;
// N = 768 has causal query tiles past a whole key tile): the NaN reaches exactly the output rows
// that see the key, and no other.
TYPED_TEST(Reference, UncheckedNaNKeyReachesTheRowsThatSeeIt) {
  using T = TypeParam;
  const Index n = 768, r = 8, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, 61), k = random_matrix<T>(n, r, 62);
  const Matrix<T> v = random_matrix<T>(n, dv, 63);
  for (bool causal : {false, true})
    for (Index j : {0, 5, 16, 47, 63, 64, 130, 255, 256, 300, 511, 512, 600, 767}) {
      SCOPED_TRACE("key " + std::to_string(j) + (causal ? " causal" : " bidirectional"));
      Matrix<T> k_bad = k;
      k_bad.row(j).setConstant(std::numeric_limits<T>::quiet_NaN());
      ref::Options opt;
      opt.causal = causal;
      opt.check_finite = false;
      const Matrix<T> out = ref::flash_forward<T>(q, k_bad, v, opt);
      Index wrong = 0;
      for (Index i = 0; i < n; ++i) wrong += out.row(i).hasNaN() != (!causal || j <= i);
      EXPECT_EQ(wrong, 0);
    }
}

// ---------------------------------------------------------------------------------------------
// edge cases

TYPED_TEST(Reference, EmptyQueriesGiveEmptyResults) {
  using T = TypeParam;
  using A = Api<T>;
  const Matrix<T> q(0, 3), go(0, 2);
  const Matrix<T> k = random_matrix<T>(5, 3, 1), v = random_matrix<T>(5, 2, 2);
  const Matrix<T> k0(0, 3), v0(0, 2);
  ref::Options causal;
  causal.causal = true;
  for (bool flash : {false, true}) {
    SCOPED_TRACE(flash ? "flash" : "naive");
    ref::Saved<T> saved;
    const Matrix<T> out = A::forward(flash, q, k, v, {}, &saved);
    EXPECT_EQ(out.rows(), 0);
    EXPECT_EQ(out.cols(), 2);
    const ref::Grad<T> g = A::backward(flash, q, k, v, go, saved, {});
    EXPECT_EQ(g.q.rows(), 0);
    EXPECT_EQ(g.q.cols(), 3);
    // No query reads the keys: their gradients exist and are exactly zero.
    ASSERT_EQ(g.k.rows(), 5);
    ASSERT_EQ(g.v.rows(), 5);
    EXPECT_EQ(g.k.cwiseAbs().maxCoeff(), T(0));
    EXPECT_EQ(g.v.cwiseAbs().maxCoeff(), T(0));

    ref::Saved<T> saved_causal;
    const Matrix<T> out_causal = A::forward(flash, q, k0, v0, causal, &saved_causal);
    EXPECT_EQ(out_causal.rows(), 0);
    EXPECT_EQ(out_causal.cols(), 2);
    const ref::Grad<T> gc = A::backward(flash, q, k0, v0, go, saved_causal, causal);
    EXPECT_EQ(gc.q.size() + gc.k.size() + gc.v.size(), 0);
  }
}

// |q|, |k| ~ 1e4 with scale 1: logits ~1e8, so softmax is an argmax and any implementation that
// skips the max subtraction (or subtracts a stale max) overflows. The output row must be the value
// of the key with the largest logit, and gradients must stay finite.
TYPED_TEST(Reference, ExtremeLogitsStayFinite) {
  using T = TypeParam;
  using A = Api<T>;
  const Index n = 70, r = 8, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, 31, 1e4), k = random_matrix<T>(n, r, 32, 1e4);
  const Matrix<T> v = random_matrix<T>(n, dv, 33), go = random_matrix<T>(n, dv, 34);
  for (bool causal : {false, true})
    for (bool flash : {false, true}) {
      SCOPED_TRACE(std::string(flash ? "flash" : "naive") + (causal ? " causal" : ""));
      ref::Options opt;
      opt.causal = causal;
      opt.scale = 1;
      ref::Saved<T> saved;
      const Matrix<T> out = A::forward(flash, q, k, v, opt, &saved);
      ASSERT_TRUE(out.allFinite());
      Matrix<double> expected(n, dv);
      for (Index i = 0; i < n; ++i) {
        const Index visible = causal ? i + 1 : n;
        Vector<double> logit = (k.topRows(visible).template cast<double>() *
                                q.row(i).transpose().template cast<double>());
        Index best = 0;
        const double top = logit.maxCoeff(&best);
        logit[best] = -std::numeric_limits<double>::infinity();
        // Precondition of the fixed seed: a margin far beyond float's logit rounding (~1e2),
        // so the hard argmax is the exact answer (the runner-up weighs exp(-1e3) = 0).
        if (visible > 1) {
          ASSERT_GT(top - logit.maxCoeff(), 1e3) << "row " << i;
        }
        expected.row(i) = v.row(best).template cast<double>();
      }
      EXPECT_TRUE(mixattn::testing::all_close(out, expected, Tol<T>::rtol, Tol<T>::atol));
      const ref::Grad<T> g = A::backward(flash, q, k, v, go, saved, opt);
      EXPECT_TRUE(g.q.allFinite());
      EXPECT_TRUE(g.k.allFinite());
      EXPECT_TRUE(g.v.allFinite());
    }
}

// Subnormal q with a huge scale: the logits scale * q . k are ordinary numbers, so the results
// must equal those of the rescaled problem q' = scale * q, scale' = 1 (then dK = dK' and
// dQ = scale * dQ'). Associating the scale after the products, (Q K^T) scale or (dS^T Q) scale,
// would round q . k ~ 1e-318 to a few subnormal digits first (relative error ~1e-5); both forms
// multiply Q by the scale before any product, so they agree with the rescaled problem to rounding.
TEST(ReferenceExtremeScale, SubnormalQueriesWithHugeScaleMatchRescaledProblem) {
  const Index n = 9, m = 11, r = 4, dv = 3;
  const Matrix<double> q = random_matrix<double>(n, r, 51, 1e-318);
  const Matrix<double> k = random_matrix<double>(m, r, 52);
  const Matrix<double> v = random_matrix<double>(m, dv, 53), go = random_matrix<double>(n, dv, 54);
  const double scale = 1e308;
  const Matrix<double> q1 = scale * q;  // normal numbers ~1e-10: exact enough to be the reference
  ASSERT_GT(q1.cwiseAbs().maxCoeff(), 1e-12);
  for (bool causal : {false, true}) {
    ref::Options opt, opt1;
    opt.causal = opt1.causal = causal;
    opt.scale = scale;
    opt1.scale = 1;
    for (bool flash : {false, true}) {
      SCOPED_TRACE(std::string(flash ? "flash" : "naive") + (causal ? " causal" : ""));
      using A = Api<double>;
      const Matrix<double> kk = causal ? Matrix<double>(k.topRows(n)) : k;  // causal: N == M
      const Matrix<double> vv = v.topRows(kk.rows());
      ref::Saved<double> s0, s1;
      const Matrix<double> out = A::forward(flash, q, kk, vv, opt, &s0);
      const Matrix<double> out1 = A::forward(flash, q1, kk, vv, opt1, &s1);
      // double rounding of O(1) values over sums of <= 11 terms: 1e-13 leaves a margin of ~100
      // and is 1e8 below the subnormal-rounding error this guards against. Gradients: relative
      // to their largest entry, as single entries may cancel to near zero.
      EXPECT_TRUE(mixattn::testing::all_close(out, out1, 1e-13, 1e-13)) << "out";
      // dq = scale (dS K) is ~1e308 times O(1) values: some entries overflow double. With checks
      // on that is a domain_error, never an infinite result; the comparison below reads the
      // unchecked values (infinities included) against the rescaled problem's.
      try {
        EXPECT_TRUE(A::backward(flash, q, kk, vv, go, s0, opt).q.allFinite());
      } catch (const std::domain_error& e) {
        EXPECT_NE(std::string(e.what()).find("the gradient of q overflows"), std::string::npos)
            << e.what();
      }
      ref::Options unchecked = opt;
      unchecked.check_finite = false;
      const ref::Grad<double> g = A::backward(flash, q, kk, vv, go, s0, unchecked);
      const ref::Grad<double> g1 = A::backward(flash, q1, kk, vv, go, s1, opt1);
      EXPECT_TRUE(mixattn::testing::all_close(g.k, g1.k, 1e-12, 1e-12 * g1.k.cwiseAbs().maxCoeff()))
          << "dk";
      const Matrix<double> dq1 = scale * g1.q;
      EXPECT_TRUE(mixattn::testing::all_close(g.q, dq1, 1e-12, 1e-12 * dq1.cwiseAbs().maxCoeff()))
          << "dq";
      EXPECT_TRUE(mixattn::testing::all_close(g.v, g1.v, 1e-13, 1e-13)) << "dv";
    }
  }
}

// Logits beyond the scalar type's range cannot be represented: reported, not returned as NaN.
TYPED_TEST(Reference, OverflowingLogitsAreReported) {
  using T = TypeParam;
  using A = Api<T>;
  const Matrix<T> q = random_matrix<T>(5, 4, 41, 1e4), k = random_matrix<T>(5, 4, 42, 1e4);
  const Matrix<T> v = random_matrix<T>(5, 2, 43);
  ref::Options opt;
  opt.scale = double(std::numeric_limits<T>::max());  // |q . k| ~ 1e8: scale * q . k overflows
  for (bool flash : {false, true})
    expect_throw_naming<std::domain_error>([&] { A::forward(flash, q, k, v, opt); },
                                           flash ? "flash_forward" : "naive_forward", "overflows");
}

}  // namespace

// ---- causal decoding over a key/value cache ---------------------------------------------------

namespace {

template <class T>
class KvCacheDecode : public ::testing::Test {};
TYPED_TEST_SUITE(KvCacheDecode, Scalars, ScalarName);

/// Any pieces (one token at a time, uneven pieces) give the rows of the causal naive forward.
TYPED_TEST(KvCacheDecode, PiecesMatchNaiveCausal) {
  using T = TypeParam;
  const Index n = 37, r = 5, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, 71), k = random_matrix<T>(n, r, 72);
  const Matrix<T> v = random_matrix<T>(n, dv, 73);
  ref::Options opt;
  opt.causal = true;
  const Matrix<T> expect = ref::naive_forward<T>(q, k, v, opt);
  const std::vector<std::vector<Index>> splits = {std::vector<Index>(n, 1), {n}, {3, 1, 20, 13}};
  for (const auto& sizes : splits) {
    ref::KvCache<T> cache(r, dv);  // no reserve: appends reallocate on the way
    Matrix<T> out(n, dv);
    Index at = 0;
    for (const Index p : sizes) {
      out.middleRows(at, p) =
          ref::decode<T>(cache, q.middleRows(at, p), k.middleRows(at, p), v.middleRows(at, p), opt);
      at += p;
    }
    EXPECT_EQ(cache.size(), n);
    EXPECT_TRUE(mixattn::testing::all_close(out, expect, Tol<T>::rtol, Tol<T>::atol))
        << sizes.size() << " pieces";
    EXPECT_TRUE(cache.keys() == k);
    EXPECT_TRUE(cache.values() == v);
  }
}

TYPED_TEST(KvCacheDecode, RejectsAndLeavesTheCacheUntouched) {
  using T = TypeParam;
  const Index r = 4, dv = 2;
  ref::KvCache<T> cache(r, dv, 8);
  ref::Options opt;
  opt.causal = true;
  const Matrix<T> q = random_matrix<T>(3, r, 81), v = random_matrix<T>(3, dv, 82);
  ref::decode<T>(cache, q, q, v, opt);
  ref::Options bidir;
  EXPECT_THROW(ref::decode<T>(cache, q, q, v, bidir), std::invalid_argument);
  EXPECT_THROW(ref::decode<T>(cache, q.leftCols(3), q.leftCols(3), v, opt), std::invalid_argument);
  EXPECT_THROW(ref::decode<T>(cache, q, q, random_matrix<T>(3, dv + 1, 83), opt),
               std::invalid_argument);
  EXPECT_THROW(ref::decode<T>(cache, q, q.topRows(2), v, opt), std::invalid_argument);
  Matrix<T> bad = q;
  bad(1, 2) = std::numeric_limits<T>::quiet_NaN();
  EXPECT_THROW(ref::decode<T>(cache, bad, q, v, opt), std::domain_error);
  // finite inputs whose logits overflow: reported, and the tokens are not kept
  ref::Options huge = opt;
  huge.scale = static_cast<double>(std::numeric_limits<T>::max());
  EXPECT_THROW(ref::decode<T>(cache, q, q, v, huge), std::domain_error);
  EXPECT_EQ(cache.size(), 3);
  EXPECT_THROW(ref::KvCache<T>(0, dv), std::invalid_argument);
  EXPECT_THROW(cache.truncate(4), std::invalid_argument);
  try {
    ref::decode<T>(cache, q, q, v, bidir);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mixattn::reference::decode"), std::string::npos);
  }
}

}  // namespace
