// GMA responsibilities and forward (SPEC 1.2-1.4, 1.6) against direct O(N^2) formulas in double.
#include <mixattn/gma.hpp>

#include "test_gma_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace mixattn;
using mixattn::testing::random_matrix;
using mixattn::testing::test_mixture;

/// all_close on any two Eigen expressions (mixed float/double included), compared in double.

template <class T>
struct Tol;
// float: s_k carries O(r |s| eps_f) ~ 1e-5 absolute error for r <= 64 and O(1) standardised
// distances, which moves gamma by the same relative amount.
template <>
struct Tol<float> {
  static constexpr double rtol = 2e-4, atol = 2e-6;
};
// double: the same terms with eps_d; 1e-11 leaves room for the log/exp of the softmax.
template <>
struct Tol<double> {
  static constexpr double rtol = 1e-11, atol = 1e-13;
};

/// SPEC 1.2 literally, in double, from the raw parameters (softplus, log_softmax, the sum).
template <class T>
Matrix<double> direct_gamma(const gma::Mixture<T>& mix, const Matrix<T>& x) {
  const Index K = mix.mean.rows(), r = mix.mean.cols(), n = x.rows();
  std::vector<double> log_pi(K);
  double lse = 0, amax = -1e300;
  for (Index k = 0; k < K; ++k) amax = std::max(amax, double(mix.prior_logit(k)));
  for (Index k = 0; k < K; ++k) lse += std::exp(double(mix.prior_logit(k)) - amax);
  for (Index k = 0; k < K; ++k) log_pi[k] = double(mix.prior_logit(k)) - amax - std::log(lse);
  Matrix<double> g(n, K);
  for (Index i = 0; i < n; ++i) {
    std::vector<double> s(K);
    double smax = -1e300;
    for (Index k = 0; k < K; ++k) {
      double acc = log_pi[k];
      for (Index m = 0; m < r; ++m) {
        const double var = std::log1p(std::exp(double(mix.var_raw(k, m)))) + double(mix.var_floor);
        const double d = double(x(i, m)) - double(mix.mean(k, m));
        acc -= 0.5 * std::log(var) + 0.5 * d * d / var;
      }
      s[k] = acc;
      smax = std::max(smax, acc);
    }
    double sum = 0;
    for (Index k = 0; k < K; ++k) sum += (s[k] = std::exp(s[k] - smax));
    for (Index k = 0; k < K; ++k) g(i, k) = s[k] / sum;
  }
  return g;
}

/// SPEC 1.4 oracle: O = diag(d)^-1 (mask . Gamma_Q Gamma_K^T) V, d = rowsum + eps.
Matrix<double> explicit_attention(const Matrix<double>& gq, const Matrix<double>& gk,
                                  const Matrix<double>& v, bool causal, double eps) {
  Matrix<double> a = gq * gk.transpose();
  if (causal)
    for (Index i = 0; i < a.rows(); ++i)
      for (Index j = i + 1; j < a.cols(); ++j) a(i, j) = 0;
  const Vector<double> d = a.rowwise().sum().array() + eps;
  Matrix<double> o = a * v;
  o.array().colwise() /= d.array();
  return o;
}

template <class T>
class GmaForward : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GmaForward, Scalars);

TYPED_TEST(GmaForward, ResponsibilitiesMatchDirectFormulaAndLieOnSimplex) {
  using T = TypeParam;
  // odd r, K below / at / above / not a multiple of every SIMD width (4, 8, 16 lanes)
  for (Index r : {1, 3, 5, 17, 64})
    for (Index K : {1, 3, 7, 16, 17, 33, 64}) {
      SCOPED_TRACE(::testing::Message() << "r " << r << " K " << K << " seed " << r * 100 + K);
      const gma::Mixture<T> mix = test_mixture<T>(K, r, r * 100 + K);
      const Matrix<T> x = random_matrix<T>(13, r, r * 1000 + K);  // 13: not a multiple of the tile
      const Matrix<T> g = gma::responsibilities(mix, x);
      ASSERT_EQ(g.rows(), 13);
      ASSERT_EQ(g.cols(), K);
      EXPECT_TRUE(mixattn::testing::all_close(g, direct_gamma(mix, x), Tol<T>::rtol, Tol<T>::atol));
      EXPECT_TRUE((g.array() >= 0).all());
      const Vector<double> ones = Vector<double>::Ones(13);
      EXPECT_TRUE(mixattn::testing::all_close(g.template cast<double>().rowwise().sum(), ones, 0,
                                              std::is_same<T, float>::value ? 1e-6 : 1e-14));
    }
}

TYPED_TEST(GmaForward, SimdKernelMatchesScalarKernel) {
  using T = TypeParam;
  for (Index K : {5, 16, 40, 64}) {
    const gma::Mixture<T> mix = test_mixture<T>(K, 9, 7 + K);
    const Matrix<T> x = random_matrix<T>(23, 9, 8 + K, 1.5);
    const Matrix<T> fast = gma::responsibilities(mix, x);
    const Matrix<T> slow = gma::responsibilities<T, detail::scalar_arch>(mix, x);
    EXPECT_TRUE(mixattn::testing::all_close(fast, slow, Tol<T>::rtol, Tol<T>::atol)) << "K " << K;
  }
}

TYPED_TEST(GmaForward, ResponsibilitiesOfRowBlockAndMap) {
  using T = TypeParam;
  // K = 6: one register of components; 40 and 64: three and four (AVX-512 float), whose
  // exponentials the fused softmax takes several registers at a time across the tile's tokens
  for (Index K : {6, 40, 64}) {
    SCOPED_TRACE(::testing::Message() << "K " << K);
    const gma::Mixture<T> mix = test_mixture<T>(K, 4, 3 + K);
    const Matrix<T> x = random_matrix<T>(20, 4, 4 + K);
    const Matrix<T> whole = gma::responsibilities(mix, x);
    const Matrix<T> block = gma::responsibilities(mix, x.middleRows(5, 7));  // outer stride 4
    // the per-token arithmetic does not depend on the tile a token falls in: bitwise equal
    EXPECT_TRUE(block == whole.middleRows(5, 7));
    Eigen::Map<const Matrix<T>> map(x.data() + 4, 10, 4);
    EXPECT_TRUE(gma::responsibilities(mix, map) == whole.middleRows(1, 10));
  }
}

struct Shape {
  Index n, m, r, K, dv;
};

TYPED_TEST(GmaForward, BidirectionalMatchesExplicitFormula) {
  using T = TypeParam;
  for (const Shape s : {Shape{9, 9, 3, 4, 2}, Shape{5, 11, 2, 7, 3}, Shape{17, 6, 8, 17, 5},
                        Shape{33, 33, 16, 33, 16}}) {
    const std::uint64_t seed = s.n * 7 + s.m * 11 + s.K;
    SCOPED_TRACE(::testing::Message() << "N " << s.n << " M " << s.m << " seed " << seed);
    const gma::Mixture<T> mix = test_mixture<T>(s.K, s.r, seed);
    const Matrix<T> q = random_matrix<T>(s.n, s.r, seed + 1),
                    k = random_matrix<T>(s.m, s.r, seed + 2);
    const Matrix<T> v = random_matrix<T>(s.m, s.dv, seed + 3);
    const Matrix<T> o = gma::forward(mix, q, k, v);
    const Matrix<double> ref = explicit_attention(direct_gamma(mix, q), direct_gamma(mix, k),
                                                  v.template cast<double>(), false, 1e-6);
    EXPECT_TRUE(mixattn::testing::all_close(o, ref, Tol<T>::rtol * 5, Tol<T>::atol * 10));
  }
}

// The bidirectional forward writes each block of Gamma_K rows into [Vt | z] and reads each block
// of Gamma_Q rows out while they are in L1 (detail::gma_bidirectional_fused); the scalar build
// takes the GEMM path. Shapes that reach every branch of the fused tiles: value widths with full
// 4-register tiles, single registers and a scalar tail, token counts off the 5-row tile, K whose
// row fits the density tile (the fused softmax) and K that does not (the scores path).
TYPED_TEST(GmaForward, FusedReadWriteMatchesGemmPathAndExplicitFormula) {
  using T = TypeParam;
  // (the last two: more rows than the block a forward without a record streams Gamma through)
  for (const Shape s : {Shape{23, 37, 9, 64, 83}, Shape{12, 8, 5, 70, 64}, Shape{7, 11, 3, 20, 35},
                        Shape{6, 1, 4, 33, 131}, Shape{1, 5, 2, 1, 17}, Shape{131, 149, 7, 64, 37},
                        Shape{61, 180, 4, 13, 16}}) {
    const std::uint64_t seed = s.n * 13 + s.m * 17 + s.K + s.dv;
    SCOPED_TRACE(::testing::Message() << "N " << s.n << " M " << s.m << " K " << s.K << " d_v "
                                      << s.dv << " seed " << seed);
    const gma::Mixture<T> mix = test_mixture<T>(s.K, s.r, seed);
    const Matrix<T> q = random_matrix<T>(s.n, s.r, seed + 1),
                    k = random_matrix<T>(s.m, s.r, seed + 2);
    const Matrix<T> v = random_matrix<T>(s.m, s.dv, seed + 3);
    gma::Saved<T> fast_saved, slow_saved;
    const Matrix<T> fast = gma::forward(mix, q, k, v, {}, &fast_saved);
    const Matrix<T> slow = gma::forward<T, detail::scalar_arch>(mix, q, k, v, {}, &slow_saved);
    const Matrix<double> ref = explicit_attention(direct_gamma(mix, q), direct_gamma(mix, k),
                                                  v.template cast<double>(), false, 1e-6);
    // the same tolerance as BidirectionalMatchesExplicitFormula: Gamma's error, then sums of
    // M <= 37 products in T
    EXPECT_TRUE(mixattn::testing::all_close(fast, ref, Tol<T>::rtol * 5, Tol<T>::atol * 10));
    EXPECT_TRUE(mixattn::testing::all_close(fast, slow, Tol<T>::rtol * 5, Tol<T>::atol * 10));
    // without a record Gamma passes through a small block buffer: the same arithmetic per row
    EXPECT_TRUE(gma::forward(mix, q, k, v) == fast);
    // what backward reads from the record: Vt, z and the denominators
    EXPECT_TRUE(mixattn::testing::all_close(fast_saved.vt, slow_saved.vt, Tol<T>::rtol * 5,
                                            Tol<T>::atol * 10));
    EXPECT_TRUE(mixattn::testing::all_close(fast_saved.z, slow_saved.z, Tol<T>::rtol * 5,
                                            Tol<T>::atol * 10));
    EXPECT_TRUE(mixattn::testing::all_close(fast_saved.den, slow_saved.den, Tol<T>::rtol * 5,
                                            Tol<T>::atol * 10));
  }
}

#if MIXATTN_HAS_SIMD
// The fused bidirectional forward shows its output finite from Vt and den alone
// (detail::gma_bidirectional_output_bounded) instead of reading it: whenever the bound holds, the
// output must be finite (the slow twin: reading it). Values from ordinary to float's limit, and
// eps down to 1e-30, where Vt or the bound overflow and the forward reads its output instead: it
// then returns a finite output or throws domain_error, with and without a record alike. Ordinary
// values must take the bound (else the fast path would never run).
TEST(GmaForwardOutputBound, HoldsOnlyForFiniteOutputs) {
  const gma::Mixture<float> mix = test_mixture<float>(6, 5, 81);
  const Matrix<float> q = random_matrix<float>(40, 5, 82), k = random_matrix<float>(33, 5, 83);
  int bounded_cases = 0;
  for (const double scale : {1.0, 1e30, 1e36, 3e37, 1e38, 3e38})
    for (const double eps : {1e-6, 1e-30}) {
      SCOPED_TRACE(::testing::Message() << "v scale " << scale << " eps " << eps);
      const Matrix<float> v = random_matrix<float>(33, 7, 84, scale);
      gma::Options opt;
      opt.eps = eps;
      gma::Saved<float> saved;
      bool returned = false;
      Matrix<float> out;
      try {
        out = gma::forward(mix, q, k, v, opt, &saved);
        returned = true;
      } catch (const std::domain_error&) {
      }
      if (returned) {
        EXPECT_TRUE(out.allFinite());
        const bool bounded = detail::gma_bidirectional_output_bounded(saved.vt, saved.den);
        if (bounded) ++bounded_cases;
        if (scale == 1.0) {
          EXPECT_TRUE(bounded);
        }
        // the same call without a record: the same outcome and bits
        EXPECT_TRUE(gma::forward(mix, q, k, v, opt) == out);
      } else {
        EXPECT_THROW(gma::forward(mix, q, k, v, opt), std::domain_error);
      }
    }
  EXPECT_GE(bounded_cases, 2);
  // the bound at its edge: max|Vt| / min den at exactly half the largest float holds, beyond it
  // does not; a NaN or inf in Vt or den, or a denominator that is not positive, never holds
  const float big = std::numeric_limits<float>::max() / 4;
  Matrix<float> vt = Matrix<float>::Ones(6, 7);
  Vector<float> den = Vector<float>::Constant(40, 0.5f);
  vt(2, 3) = -big;
  EXPECT_TRUE(detail::gma_bidirectional_output_bounded(vt, den));
  den(7) = 0.25f;
  EXPECT_FALSE(detail::gma_bidirectional_output_bounded(vt, den));
  den(7) = 0.5f;
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    Matrix<float> vb = vt;
    vb(5, 6) = bad;
    EXPECT_FALSE(detail::gma_bidirectional_output_bounded(vb, den));
    Vector<float> db = den;
    db(0) = bad;
    EXPECT_FALSE(detail::gma_bidirectional_output_bounded(vt, db));
  }
  for (const float nonpositive : {0.0f, -1.0f}) {
    Vector<float> db = den;
    db(39) = nonpositive;
    EXPECT_FALSE(detail::gma_bidirectional_output_bounded(vt, db));
  }
}

// The responsibilities' softmax over score rows too long for registers
// (detail::softmax_score_rows) against the softmax in double, and its failures: a NaN
// anywhere in a row (the maxima pass does not look for one: the sum finds it, whichever lane it
// is in) or a row of -inf fails that row alone, which is then not written.
TEST(GmaSoftmaxScoreRows, MatchesSoftmaxRowAndFailsOnNanAnywhere) {
  using B = xsimd::batch<float, detail::simd_arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  constexpr int TI = 3;
  const Index K = 70, kv = (K + Wd - 1) / Wd, lds = kv * Wd;
  std::mt19937 gen(91);
  std::normal_distribution<float> normal(0.0f, 8.0f);
  Matrix<float> scores(TI, lds);
  for (Index i = 0; i < TI; ++i)
    for (Index j = 0; j < lds; ++j)
      scores(i, j) = j < K ? normal(gen) - 40.0f : -std::numeric_limits<float>::infinity();
  const auto run = [&](Matrix<float> s, Matrix<float>& out) {
    out.setConstant(TI, K, -7.0f);  // rows a failure leaves alone keep this
    return detail::softmax_score_rows<TI>(detail::simd_arch{}, s.data(), lds, kv, K, out.data(), K);
  };
  Matrix<float> out, clean;
  ASSERT_EQ(run(scores, clean), 0u);
  out = clean;
  for (Index i = 0; i < TI; ++i) {  // the softmax in double
    const Eigen::ArrayXd row = scores.row(i).head(K).transpose().cast<double>();
    const Eigen::ArrayXd e = (row - row.maxCoeff()).exp();
    const Eigen::ArrayXd expect = e / e.sum();
    // relative: the rounding of x = s - max in float (|x| u, as exp turns absolute error into
    // relative), exp's ~1 ulp, the sum's and the scaling's: (|x| + 4) 2u with u = 2^-24
    for (Index j = 0; j < K; ++j) {
      const double x = std::abs(row(j) - row.maxCoeff());
      EXPECT_NEAR(clean(i, j), expect(j), (x + 4) * 0x1p-23 * expect(j)) << i << " " << j;
    }
  }
  for (Index i = 0; i < TI; ++i)
    for (Index j = 0; j < lds; ++j) {
      Matrix<float> bad = scores;
      bad(i, j) = std::numeric_limits<float>::quiet_NaN();
      ASSERT_EQ(run(bad, out), 1u << i) << "NaN at " << i << ", " << j;
      EXPECT_TRUE((out.row(i).array() == -7.0f).all()) << "NaN at " << i << ", " << j;
      for (Index t = 0; t < TI; ++t) {  // the other rows as without the NaN, bit for bit
        if (t != i) {
          EXPECT_TRUE(out.row(t) == clean.row(t)) << "NaN at " << i << ", " << j;
        }
      }
    }
  Matrix<float> dead = scores;
  dead.row(1).setConstant(-std::numeric_limits<float>::infinity());
  EXPECT_EQ(run(dead, out), 2u);
  EXPECT_TRUE((out.row(1).array() == -7.0f).all());
}
#endif

// The fused forward's column sums of Gamma_K (detail::add_rows: up to 8 registers of z side by
// side) against the plain loop, which adds the rows in the same order: the same bits. Its
// denominators (detail::dot_rows: 8 rows side by side) against the same dot product a row at a
// time (dot_rows_tile<1>), whose arithmetic a row's is whatever the tile: the same bits. Widths
// around the register counts, and row counts off the tiles.
TYPED_TEST(GmaForward, ColumnSumsAndRowDotsMatchTheirLoops) {
  using T = TypeParam;
  using Arch = detail::simd_arch;
  for (const Index K : {1, 3, 8, 15, 16, 17, 63, 64, 65, 130, 200})
    for (const Index n : {1, 7, 8, 9, 60}) {
      SCOPED_TRACE(::testing::Message() << "K " << K << " n " << n);
      const Index ldg = K + 3;
      const Matrix<T> g = random_matrix<T>(n, ldg, 300 + K * 7 + n);
      const Matrix<T> z0 = random_matrix<T>(1, K, 400 + K);
      Matrix<T> fast = z0, slow = z0;
      detail::add_rows(Arch{}, g.data(), ldg, n, K, fast.data());
      for (Index j = 0; j < K; ++j)
        for (Index i = 0; i < n; ++i) slow(0, j) += g(i, j);
      EXPECT_TRUE(fast == slow) << "add_rows";
      Vector<T> dots(n), one(n);
      detail::dot_rows(Arch{}, g.data(), ldg, n, K, z0.data(), T(0.25), dots.data());
      for (Index i = 0; i < n; ++i)
        detail::dot_rows_tile<1>(Arch{}, g.data() + i * ldg, ldg, K, z0.data(), T(0.25),
                                 one.data() + i);
      EXPECT_TRUE(dots == one) << "dot_rows";
      // and a dot product in T at all: within the bound of K + 1 roundings on the terms' sizes
      const auto terms = (g.row(n - 1).leftCols(K).template cast<double>().array() *
                          z0.template cast<double>().array())
                             .eval();
      const double eps = static_cast<double>(std::numeric_limits<T>::epsilon());
      EXPECT_NEAR(static_cast<double>(dots(n - 1)), terms.sum() + 0.25,
                  static_cast<double>(K + 1) * eps * (terms.abs().sum() + 0.25));
    }
}

#if defined(__SSE2__)
// The kernels flush subnormals while they run (detail::FlushSubnormals) and give the caller's
// floating-point mode back, after a return and after a throw alike.
TEST(GmaForwardFloatingPointMode, CallersModeIsRestored) {
  const gma::Mixture<float> mix = test_mixture<float>(8, 4, 5);
  const Matrix<float> x = random_matrix<float>(12, 4, 6), v = random_matrix<float>(12, 3, 7);
  const unsigned original = _mm_getcsr();
  for (const unsigned mode : {original & ~0x8040u, original | 0x8040u}) {
    _mm_setcsr(mode);
    gma::Options opt;
    for (const bool causal : {false, true}) {
      opt.causal = causal;
      gma::Saved<float> saved;
      const Matrix<float> o = gma::forward(mix, x, x, v, opt, &saved);
      EXPECT_EQ(_mm_getcsr(), mode) << "forward, causal " << causal;
      gma::backward(mix, x, x, v, Matrix<float>::Ones(12, 3), saved, opt);
      EXPECT_EQ(_mm_getcsr(), mode) << "backward, causal " << causal;
    }
    gma::State<float> st = gma::State<float>::empty(8, 3);
    opt.causal = true;
    gma::forward(mix, x, x, v, opt, st);
    EXPECT_EQ(_mm_getcsr(), mode) << "continued forward";
    // finite values whose sums over 12 keys overflow float: the output check throws after the
    // kernels ran
    const Matrix<float> huge = Matrix<float>::Constant(12, 3, 3e38f);
    opt.causal = false;
    EXPECT_THROW(gma::forward(mix, x, x, huge, opt), std::domain_error);
    EXPECT_EQ(_mm_getcsr(), mode) << "forward that threw";
  }
  _mm_setcsr(original);
}
#endif

// The SIMD causal scan works on register tiles: Gamma_K^T per chunk (whole 16 x 16 float blocks in
// registers), the chunk's read, and the state update folded into the wide state register by
// register (detail::state_update). The larger shapes have chunks with whole and partial transpose
// blocks, value widths with full register tiles, single registers and scalar tails, and K off the
// state tile's 5 rows; against the explicit formula and the scalar build's Eigen path.
TYPED_TEST(GmaForward, CausalMatchesExplicitFormulaForEveryChunkLength) {
  using T = TypeParam;
  for (const Shape s :
       {Shape{1, 1, 2, 3, 2}, Shape{13, 13, 3, 5, 2}, Shape{40, 40, 6, 17, 7},
        Shape{70, 70, 5, 13, 37}, Shape{96, 96, 9, 64, 64}, Shape{33, 33, 3, 7, 83}}) {
    const std::uint64_t seed = s.n * 13 + s.K + s.dv;
    const gma::Mixture<T> mix = test_mixture<T>(s.K, s.r, seed);
    const Matrix<T> q = random_matrix<T>(s.n, s.r, seed + 1),
                    k = random_matrix<T>(s.n, s.r, seed + 2);
    const Matrix<T> v = random_matrix<T>(s.n, s.dv, seed + 3);
    const Matrix<double> ref = explicit_attention(direct_gamma(mix, q), direct_gamma(mix, k),
                                                  v.template cast<double>(), true, 1e-6);
    for (Index chunk : {0, 1, 3, 4, 16, 32, 48, 64, 1000}) {
      SCOPED_TRACE(::testing::Message() << "N " << s.n << " K " << s.K << " d_v " << s.dv
                                        << " chunk " << chunk << " seed " << seed);
      gma::Options opt;
      opt.causal = true;
      opt.chunk = chunk;
      const Matrix<T> fast = gma::forward(mix, q, k, v, opt);
      const Matrix<T> slow = gma::forward<T, detail::scalar_arch>(mix, q, k, v, opt);
      EXPECT_TRUE(mixattn::testing::all_close(fast, ref, Tol<T>::rtol * 5, Tol<T>::atol * 10));
      EXPECT_TRUE(mixattn::testing::all_close(fast, slow, Tol<T>::rtol * 5, Tol<T>::atol * 10));
    }
  }
}

// Without a record the causal forward computes Gamma in blocks of whole chunks and continues the
// scan's state from block to block: the chunks and sums of one pass, so the outputs are the
// recorded forward's bit for bit (N over several blocks, chunks that divide the block or not).
TYPED_TEST(GmaForward, CausalWithoutRecordIsTheRecordedForward) {
  using T = TypeParam;
  const Index n = 601, r = 6, K = 11, dv = 19;
  const gma::Mixture<T> mix = test_mixture<T>(K, r, 71);
  const Matrix<T> q = random_matrix<T>(n, r, 72), k = random_matrix<T>(n, r, 73);
  const Matrix<T> v = random_matrix<T>(n, dv, 74);
  for (Index chunk : {0, 7, 48, 100}) {
    gma::Options opt;
    opt.causal = true;
    opt.chunk = chunk;
    gma::Saved<T> saved;
    const Matrix<T> recorded = gma::forward(mix, q, k, v, opt, &saved);
    EXPECT_TRUE(gma::forward(mix, q, k, v, opt) == recorded) << "chunk " << chunk;
    EXPECT_TRUE((gma::forward<T, detail::scalar_arch>(mix, q, k, v, opt) ==
                 gma::forward<T, detail::scalar_arch>(mix, q, k, v, opt, &saved)))
        << "scalar build, chunk " << chunk;
  }
}

// transpose_padded (16 x 16 float blocks through registers where the ISA has them) against the
// obvious loop, with the zero padding of each row, for block and partial-block shapes.
TYPED_TEST(GmaForward, TransposePaddedMatchesLoop) {
  using T = TypeParam;
  for (Index rows : {1, 15, 16, 17, 32, 47, 64})
    for (Index cols : {1, 16, 31, 32, 65}) {
      const Matrix<T> a = random_matrix<T>(rows, cols + 3, rows * 100 + cols);
      const Index ld = rows + 5;
      std::vector<T> dst(static_cast<std::size_t>(cols * ld), T(7));
      detail::transpose_padded<T>(a.leftCols(cols), dst.data(), ld);  // outer stride cols + 3
      bool same = true;
      for (Index c = 0; c < cols; ++c)
        for (Index i = 0; i < ld; ++i)
          same = same && dst[static_cast<std::size_t>(c * ld + i)] == (i < rows ? a(i, c) : T(0));
      EXPECT_TRUE(same) << rows << " x " << cols;
    }
}

TYPED_TEST(GmaForward, SingleComponentAveragesVisibleValues) {
  using T = TypeParam;
  const Index n = 21, dv = 3;
  const gma::Mixture<T> mix = test_mixture<T>(1, 4, 5);
  const Matrix<T> q = random_matrix<T>(n, 4, 6), k = random_matrix<T>(n, 4, 7);
  const Matrix<T> v = random_matrix<T>(n, dv, 8);
  const double eps = 1e-6;
  // gamma == 1 everywhere, so O_i = (sum of visible v) / (count + eps)
  Matrix<double> bidir(n, dv), causal(n, dv);
  const Eigen::RowVectorXd total = v.template cast<double>().colwise().sum();
  Eigen::RowVectorXd prefix = Eigen::RowVectorXd::Zero(dv);
  for (Index i = 0; i < n; ++i) {
    prefix += v.row(i).template cast<double>();
    bidir.row(i) = total / (n + eps);
    causal.row(i) = prefix / (i + 1 + eps);
  }
  const double rtol = std::is_same<T, float>::value ? 1e-5 : 1e-13;  // sums of 21 values
  EXPECT_TRUE(mixattn::testing::all_close(gma::forward(mix, q, k, v), bidir, rtol, rtol));
  gma::Options opt;
  opt.causal = true;
  opt.chunk = 4;
  EXPECT_TRUE(mixattn::testing::all_close(gma::forward(mix, q, k, v, opt), causal, rtol, rtol));
}

TYPED_TEST(GmaForward, OutputRowsAreConvexCombinations) {
  using T = TypeParam;
  const Index n = 50, dv = 6;
  const gma::Mixture<T> mix = test_mixture<T>(8, 5, 9);
  const Matrix<T> q = random_matrix<T>(n, 5, 10), k = random_matrix<T>(n, 5, 11);
  const Matrix<T> v = random_matrix<T>(n, dv, 12, 3.0);
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    opt.chunk = 7;
    const Matrix<T> o = gma::forward(mix, q, k, v, opt);
    // each coordinate lies within [min_j v_jd, max_j v_jd] over the visible j
    for (Index i = 0; i < n; ++i) {
      const Index visible = causal ? i + 1 : n;
      const Matrix<T> vis = v.topRows(visible);
      for (Index d = 0; d < dv; ++d) {
        const double slack = 1e-5 * std::abs(double(vis.col(d).cwiseAbs().maxCoeff()));
        EXPECT_LE(double(o(i, d)), double(vis.col(d).maxCoeff()) + slack) << i << "," << d;
        EXPECT_GE(double(o(i, d)), double(vis.col(d).minCoeff()) - slack) << i << "," << d;
      }
      EXPECT_LE(double(o.row(i).norm()), double(vis.rowwise().norm().maxCoeff()) * (1 + 1e-5));
    }
  }
}

TEST(GmaForwardPrecision, FloatAgreesWithDouble) {
  const Index n = 300, r = 16, K = 24, dv = 8;
  const gma::Mixture<double> md = test_mixture<double>(K, r, 21);
  gma::Mixture<float> mf;
  mf.mean = md.mean.cast<float>();
  mf.var_raw = md.var_raw.cast<float>();
  mf.prior_logit = md.prior_logit.cast<float>();
  const Matrix<float> q = random_matrix<float>(n, r, 22), k = random_matrix<float>(n, r, 23);
  const Matrix<float> v = random_matrix<float>(n, dv, 24);
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    const Matrix<float> of = gma::forward(mf, q, k, v, opt);
    const Matrix<double> od =
        gma::forward(md, q.cast<double>(), k.cast<double>(), v.cast<double>(), opt);
    // gamma is good to ~1e-5 relative in float (see Tol<float>); outputs average O(1) values.
    EXPECT_TRUE(mixattn::testing::all_close(of, od, 1e-4, 1e-5)) << "causal " << causal;
  }
}

TEST(GmaForwardPrecision, LongCausalSequenceInFloatStaysOnDouble) {
  // the running state sums N terms; kept in double it does not drift with the sequence length
  const Index n = 6000, r = 8, K = 16, dv = 4;
  const gma::Mixture<double> md = test_mixture<double>(K, r, 31);
  gma::Mixture<float> mf;
  mf.mean = md.mean.cast<float>();
  mf.var_raw = md.var_raw.cast<float>();
  mf.prior_logit = md.prior_logit.cast<float>();
  const Matrix<float> q = random_matrix<float>(n, r, 32), k = random_matrix<float>(n, r, 33);
  const Matrix<float> v = random_matrix<float>(n, dv, 34);
  gma::Options opt;
  opt.causal = true;
  const Matrix<float> of = gma::forward(mf, q, k, v, opt);
  const Matrix<double> od =
      gma::forward(md, q.cast<double>(), k.cast<double>(), v.cast<double>(), opt);
  EXPECT_TRUE(mixattn::testing::all_close(of.bottomRows(100), od.bottomRows(100), 1e-4, 1e-5));
}

TEST(GmaForwardPrecision, CancellationFreeWhereExpandedFormFails) {
  // |mu| ~ 1e3 and sigma at the floor (var_raw = -30: sigma^2 = 1e-4): standardised distances
  // are O(1) but x^2 / sigma^2 ~ 1e10. Components sit a few sigma apart so gamma is not one-hot.
  const Index K = 4, r = 3, n = 64;
  gma::Mixture<float> mix;
  const Matrix<double> base = random_matrix<double>(1, r, 41, 1000.0);
  const Matrix<double> spread = random_matrix<double>(K, r, 42, 0.01);
  mix.mean = (spread.rowwise() + base.row(0)).cast<float>();
  mix.var_raw = Matrix<float>::Constant(K, r, -30.0f);
  mix.prior_logit = Vector<float>::Zero(K);
  Matrix<float> x(n, r);
  const Matrix<double> offsets = random_matrix<double>(n, r, 43, 0.01);
  for (Index i = 0; i < n; ++i)
    x.row(i) = (mix.mean.row(i % K).cast<double>() + offsets.row(i)).cast<float>();

  const Matrix<double> exact = direct_gamma(mix, x);  // same float inputs, double arithmetic
  const Matrix<float> ours = gma::responsibilities(mix, x);

  // the expanded form in float: (X.X) L^T - 2 X (L.mu)^T + sum_m L mu^2, L = 1/sigma^2
  const float var = float(std::log1p(std::exp(-30.0)) + 1e-4);
  Matrix<float> expanded(n, K);
  for (Index i = 0; i < n; ++i) {
    Vector<float> s(K);
    for (Index k = 0; k < K; ++k) {
      float xx = 0, xm = 0, mm = 0;
      for (Index m = 0; m < r; ++m) {
        xx += x(i, m) * x(i, m) / var;
        xm += x(i, m) * mix.mean(k, m) / var;
        mm += mix.mean(k, m) * mix.mean(k, m) / var;
      }
      s(k) = -0.5f * (xx - 2 * xm + mm);
    }
    s.array() -= s.maxCoeff();
    s = s.array().exp();
    expanded.row(i) = s.transpose() / s.sum();
  }
  const double ours_err = (ours.cast<double>() - exact).cwiseAbs().maxCoeff();
  const double expanded_err = (expanded.cast<double>() - exact).cwiseAbs().maxCoeff();
  // a and b = mu a are rounded separately: |t| error ~ (|mu| / sigma) eps_f ~ 1e5 * 6e-8 per
  // dimension, so gamma moves by ~1e-2 at most here, against O(1) for the expanded form.
  EXPECT_LT(ours_err, 3e-2) << "expanded form error " << expanded_err;
  EXPECT_GT(expanded_err, 0.3) << "the test no longer exercises cancellation";
  // gamma is non-trivial, so the comparison above measured something
  EXPECT_GT((exact.array() > 0.05 && exact.array() < 0.95).count(), n / 4);
}

TYPED_TEST(GmaForward, EmptySequence) {
  using T = TypeParam;
  const gma::Mixture<T> mix = test_mixture<T>(3, 2, 1);
  const Matrix<T> q(0, 2), k(0, 2), v(0, 5);
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    const Matrix<T> o = gma::forward(mix, q, k, v, opt);
    EXPECT_EQ(o.rows(), 0);
    EXPECT_EQ(o.cols(), 5);
  }
  EXPECT_EQ(gma::responsibilities(mix, q).rows(), 0);
}

TEST(GmaMixture, RandomIsReproducibleAndFollowsSpec) {
  const gma::Mixture<double> a = gma::Mixture<double>::random(32, 16, 99, 2.0);
  const gma::Mixture<double> b = gma::Mixture<double>::random(32, 16, 99, 2.0);
  const gma::Mixture<double> c = gma::Mixture<double>::random(32, 16, 100, 2.0);
  EXPECT_TRUE(a.mean == b.mean);
  EXPECT_FALSE(a.mean == c.mean);
  EXPECT_TRUE(a.var_raw.isZero(0));
  EXPECT_TRUE(a.prior_logit.isZero(0));
  EXPECT_EQ(a.var_floor, 1e-4);
  // 512 draws of N(0, 2^2): sample mean within 4 standard errors, sample sd within 10%
  const double mean = a.mean.mean();
  const double sd = std::sqrt((a.mean.array() - mean).square().sum() / (a.mean.size() - 1));
  EXPECT_LT(std::abs(mean), 4 * 2.0 / std::sqrt(512.0));
  EXPECT_NEAR(sd, 2.0, 0.2);
}

// The mixture's variances in vectors of double (xsimd's exp and log1p) against the scalar
// softplus they replace, over the whole range a raw variance can take: both branches of the
// stable form, the crossover at 0, arguments whose exp underflows (clamped, so no out-of-range
// exponent), huge magnitudes and NaN. The bound: 4 ulp of double relative to the result, or, where
// softplus(w) = e^w is below double's normal range, 1e-300 absolute (the variance floor added to
// it is 1e-4 or more).
template <class T>
void check_vector_softplus() {
  std::vector<T> x;
  for (int i = -3000; i <= 3000; ++i) x.push_back(static_cast<T>(i * 0.01));
  for (int i = -800; i <= 800; i += 7) x.push_back(static_cast<T>(i));
  for (T v : {T(0), T(-0.0), T(1e-30), T(-1e-30), T(1e30), T(-1e30), std::numeric_limits<T>::max(),
              std::numeric_limits<T>::lowest(), std::numeric_limits<T>::min()})
    x.push_back(v);
  x.push_back(std::numeric_limits<T>::quiet_NaN());
  const Index n = static_cast<Index>(x.size());
  for (double add : {0.0, 1e-4}) {
    std::vector<double> got(x.size());
    detail::softplus_into<double>(x.data(), n, add, got.data());
    double worst = 0;
    for (Index i = 0; i < n; ++i) {
      const double want = detail::softplus(static_cast<double>(x[i])) + add;
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got[i])) << "at " << x[i];
        continue;
      }
      const double err = std::abs(got[i] - want);
      if (want < 1e-300 && add == 0) {
        EXPECT_LE(err, 1e-300) << "at " << x[i];
        continue;
      }
      const double ulps = err / (std::abs(want) * std::numeric_limits<double>::epsilon());
      worst = std::max(worst, ulps);
      EXPECT_LE(ulps, 4.0) << "at " << x[i] << ": " << got[i] << " vs " << want;
    }
    ::testing::Test::RecordProperty(add == 0 ? "worst_ulps" : "worst_ulps_with_floor",
                                    std::to_string(worst));
  }
}

TEST(MixtureConstants, VectorSoftplusMatchesScalar) {
  check_vector_softplus<float>();
  check_vector_softplus<double>();
}

// The offsets' sum of log variances (log_sum: exponents summed, mantissas multiplied, one log)
// against the sum of long double logs, for rows with vector tails, variances from subnormal to
// huge (lanes that are not normal take scalar logs), and rows longer than one fold (16 vectors
// a lane). Bound: the product's n roundings (n eps / 2 in the log) and the final additions and
// the scalar logs' rounding (eps each, of at most max |log x|): n eps + (n + 2) eps max |log x|.
TEST(MixtureConstants, LogSumMatchesLongDoubleSum) {
  const double eps = std::numeric_limits<double>::epsilon();
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> expo(-30.0, 30.0);
  for (Index n : {Index(1), Index(7), Index(8), Index(61), Index(64), Index(200), Index(1000)})
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<double> x(static_cast<std::size_t>(n));
      for (double& e : x) e = std::pow(10.0, expo(rng));
      if (kind == 1) x[static_cast<std::size_t>(n / 2)] = 4e-320;  // a subnormal floor
      if (kind == 2) x[0] = std::numeric_limits<double>::max();
      if (kind == 3)
        for (double& e : x) e = 1e-4;  // every variance at the default floor
      long double exact = 0;
      double worst_log = 1;
      for (double e : x) {
        exact += std::log(static_cast<long double>(e));
        worst_log = std::max(worst_log, std::abs(std::log(e)));
      }
      const double got = detail::log_sum(x.data(), n);
      const double bound = static_cast<double>(n) * eps + (static_cast<double>(n) + 2) * eps * worst_log;
      EXPECT_LE(std::abs(static_cast<long double>(got) - exact), bound)
          << "n " << n << " kind " << kind << ": " << got << " vs " << static_cast<double>(exact);
    }
  // not a positive number: the scalar logs' NaN and -inf
  std::vector<double> z(16, 2.0);
  z[3] = 0;
  EXPECT_EQ(detail::log_sum(z.data(), 16), -std::numeric_limits<double>::infinity());
  z[3] = -1;
  EXPECT_TRUE(std::isnan(detail::log_sum(z.data(), 16)));
}

// The kernels' a = 1 / sqrt(2 var) is computed in vectors (MixtureConstants::scale); square root
// and division are correctly rounded in any width, so it must equal the scalar formula bit for
// bit, for every variance from the floor up (var_raw from -30 to 30).
template <class T>
void check_scale() {
  using W = detail::wide_t<T>;
  const Index K = 7, r = 61;  // a vector tail in every row
  Matrix<T> var_raw(K, r);
  for (Index i = 0; i < var_raw.size(); ++i)
    var_raw.data()[i] = static_cast<T>(-30.0 + 60.0 * static_cast<double>(i) / (K * r - 1));
  const Vector<T> prior = Vector<T>::Zero(K);
  for (T floor : {T(1e-4), T(1e-30), T(3)}) {
    const detail::MixtureConstants<W> c =
        detail::mixture_constants<W>(Matrix<T>(Matrix<T>::Zero(K, r)), var_raw, prior, floor);
    bool same = true;
    for (Index k = 0; k < K; ++k)
      for (Index m = 0; m < r; ++m)
        same = same && c.scale(k, m) == W(1) / std::sqrt(W(2)) / std::sqrt(c.var(k, m));
    EXPECT_TRUE(same) << "floor " << floor;
  }
}

TEST(MixtureConstants, VectorScaleIsTheScalarFormula) {
  check_scale<float>();
  check_scale<double>();
}

}  // namespace
