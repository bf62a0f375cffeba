// The log-density backward kernel (detail/log_density.hpp, SPEC 1.5) against a scalar twin in
// double that applies SPEC 1.5 literally (P = 1/var, r = x - mu), for the SIMD arch of this
// translation unit and for the scalar fallback; odd r and K not a multiple of the register width
// or of the kernel's component tile, so every tail path runs.
#include <mixattn/gma.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using namespace mixattn;
using mixattn::testing::random_matrix;

/// SPEC 1.5 through the log-density, written out in double from the raw parameters, with the
/// sum of the terms' absolute values beside each result (the scale rounding errors live on).
struct Direct {
  Matrix<double> dx, dmu, dvar, dx_abs, dmu_abs, dvar_abs;
};

Direct direct_density_backward(const Matrix<double>& mean, const Matrix<double>& var_raw,
                               double var_floor, const Matrix<double>& x, const Matrix<double>& w) {
  const Index n = x.rows(), K = mean.rows(), r = mean.cols();
  Direct d;
  d.dx = d.dx_abs = Matrix<double>::Zero(n, r);
  d.dmu = d.dmu_abs = d.dvar = d.dvar_abs = Matrix<double>::Zero(K, r);
  for (Index k = 0; k < K; ++k)
    for (Index m = 0; m < r; ++m) {
      const double var = std::log1p(std::exp(var_raw(k, m))) + var_floor, P = 1 / var;
      for (Index i = 0; i < n; ++i) {
        const double res = x(i, m) - mean(k, m);
        const double g = w(i, k) * P * res;
        d.dx(i, m) -= g;
        d.dx_abs(i, m) += std::abs(g);
        d.dmu(k, m) += g;
        d.dmu_abs(k, m) += std::abs(g);
        d.dvar(k, m) += w(i, k) * (0.5 * P * P * res * res - 0.5 * P);
        d.dvar_abs(k, m) += std::abs(w(i, k)) * (0.5 * P * P * res * res + 0.5 * P);
      }
    }
  return d;
}

/// max_ij |a - b| / scale_ij <= tol, reported with the worst entry.
::testing::AssertionResult within(const Matrix<double>& a, const Matrix<double>& b,
                                  const Matrix<double>& scale, double tol) {
  if (a.rows() != b.rows() || a.cols() != b.cols())
    return ::testing::AssertionFailure()
           << "shape " << a.rows() << "x" << a.cols() << " vs " << b.rows() << "x" << b.cols();
  double worst = 0;
  Index wi = 0, wj = 0;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j) {
      const double e = std::abs(a(i, j) - b(i, j)) / std::max(scale(i, j), 1e-300);
      if (!(e <= worst)) {
        worst = e;
        wi = i;
        wj = j;
      }
    }
  if (worst <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "worst entry (" << wi << ", " << wj << "): " << a(wi, wj) << " vs " << b(wi, wj)
         << ", error / scale " << worst << " > " << tol;
}

struct Shape {
  Index n, r, K;
};

template <class T>
class GmaBackwardKernel : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GmaBackwardKernel, Scalars);

/// Runs the kernel of Arch on (mean, var_raw, x, w) split into two panels at `split` (so the
/// accumulation across calls is exercised) and checks it against the direct formula.
/// `tol` bounds the error relative to the sum of the terms' magnitudes.
template <class Arch, class T>
void check_kernel(const Matrix<T>& mean, const Matrix<T>& var_raw, T var_floor, const Matrix<T>& x,
                  const Matrix<T>& w, Index split, double tol) {
  using W = detail::wide_t<T>;
  const Index n = x.rows(), K = mean.rows(), r = mean.cols();
  const Vector<T> prior = Vector<T>::Zero(K);
  const detail::MixtureConstants<W> c =
      detail::mixture_constants<W>(mean, var_raw, prior, var_floor);
  const detail::PackedDensityDims<T> p = detail::pack_density_dims<Arch, T>(mean, c);
  ASSERT_EQ(p.padded_dim % static_cast<Index>(detail::simd_width<Arch, T>::value), 0);
  ASSERT_GE(p.padded_dim, r);
  // padded x with garbage-free zero padding, as the kernel requires; acc is written, never read:
  // NaN where the kernel writes dx, zero padding
  Matrix<T> xpad = Matrix<T>::Zero(n, p.padded_dim), acc = Matrix<T>::Zero(n, p.padded_dim);
  xpad.leftCols(r) = x;
  acc.leftCols(r).setConstant(std::numeric_limits<T>::quiet_NaN());
  detail::DensityGradSums<T> sums;
  sums.reset(K, p.padded_dim);
  for (Index i = 0; i < n; ++i)
    for (Index k = 0; k < K; ++k) sums.w(k) += static_cast<W>(w(i, k));
  const Index ld = p.padded_dim;
  detail::density_grad_into(Arch{}, p, xpad.data(), ld, w.data(), K, split, acc.data(), ld, sums,
                            T(-2));
  detail::density_grad_into(Arch{}, p, xpad.data() + split * ld, ld, w.data() + split * K, K,
                            n - split, acc.data() + split * ld, ld, sums, T(-2));
  Matrix<W> dmu, dvar;
  detail::density_grad_finish(c, sums, dmu, dvar);
  const Matrix<double> dx = acc.leftCols(r).template cast<double>();

  const Direct d = direct_density_backward(
      mean.template cast<double>(), var_raw.template cast<double>(), static_cast<double>(var_floor),
      x.template cast<double>(), w.template cast<double>());
  // padded dims must stay untouched (zero) in acc: they would leak into nothing, but a kernel
  // that writes past r is reading or writing the wrong lanes
  EXPECT_TRUE(acc.rightCols(p.padded_dim - r).isZero(0)) << "padding of acc was written";
  EXPECT_TRUE(within(dx, d.dx, d.dx_abs, tol)) << "dx";
  EXPECT_TRUE(within(dmu.template cast<double>(), d.dmu, d.dmu_abs, tol)) << "dmu";
  EXPECT_TRUE(within(dvar.template cast<double>(), d.dvar, d.dvar_abs, tol)) << "dvar";
  // a check on the check: the results are not trivially zero
  EXPECT_GT(d.dx.norm(), 1e-3);
  EXPECT_GT(d.dvar.norm(), 1e-3);
}

template <class T>
struct KernelTol;
// float: t = x a - b carries ~2 eps_f |x a| absolute error with |x a| = O(few) here, and the
// float in-panel sums add O(n eps_f) relative to the sum of magnitudes; 2e-5 covers n <= 300.
template <>
struct KernelTol<float> {
  static constexpr double near = 2e-5;
  // |x a| ~ 200 at the far shape: t has ~200 * 1.2e-7 = 2.4e-5 absolute error on O(1) values,
  // doubled in t^2. The expanded form (x^2, -2 x mu, mu^2 summed separately) would be off by
  // ~(x a)^2 eps_f ~ 2.4e-3 of the result's scale, so 3e-4 still tells the two apart.
  static constexpr double far = 3e-4;
};
// double: the same error terms with eps_d.
template <>
struct KernelTol<double> {
  static constexpr double near = 1e-12;
  static constexpr double far = 1e-10;
};

TYPED_TEST(GmaBackwardKernel, MatchesDirectFormula) {
  using T = TypeParam;
  // odd r; K below, between and above the register widths (8, 16) and not a multiple of the
  // component tile; r a multiple of the width once, and a lone token at the end of a panel
  const Shape shapes[] = {{37, 7, 19},  {5, 1, 3},  {300, 13, 17},
                          {64, 16, 12}, {9, 33, 6}, {2, 3, 1}};
  for (const Shape& s : shapes) {
    const std::uint64_t seed = static_cast<std::uint64_t>(s.n * 131 + s.r * 17 + s.K);
    SCOPED_TRACE(::testing::Message()
                 << "n " << s.n << " r " << s.r << " K " << s.K << " seed " << seed);
    const Matrix<T> mean = random_matrix<T>(s.K, s.r, seed);
    const Matrix<T> var_raw = random_matrix<T>(s.K, s.r, seed + 1, 0.7);
    const Matrix<T> x = random_matrix<T>(s.n, s.r, seed + 2);
    const Matrix<T> w = random_matrix<T>(s.n, s.K, seed + 3);  // any weights, not only dS
    const Index split = s.n / 3;
    check_kernel<detail::simd_arch, T>(mean, var_raw, T(1e-4), x, w, split, KernelTol<T>::near);
    check_kernel<detail::scalar_arch, T>(mean, var_raw, T(1e-4), x, w, split, KernelTol<T>::near);
  }
}

TYPED_TEST(GmaBackwardKernel, FarFromOriginDoesNotCancel) {
  using T = TypeParam;
  // means at |mu| ~ 100, sigma^2 ~ 0.13, tokens within a few sigma of them
  const Index n = 150, r = 5, K = 11;
  const Matrix<double> base = random_matrix<double>(1, r, 91, 100.0);
  Matrix<T> mean = random_matrix<T>(K, r, 92, 0.3);
  for (Index k = 0; k < K; ++k) mean.row(k) += base.row(0).template cast<T>();
  const Matrix<T> var_raw = Matrix<T>::Constant(K, r, T(-2));
  Matrix<T> x = random_matrix<T>(n, r, 93, 0.3);
  for (Index i = 0; i < n; ++i) x.row(i) += mean.row(i % K);
  const Matrix<T> w = random_matrix<T>(n, K, 94);
  check_kernel<detail::simd_arch, T>(mean, var_raw, T(1e-4), x, w, 100, KernelTol<T>::far);
  check_kernel<detail::scalar_arch, T>(mean, var_raw, T(1e-4), x, w, 100, KernelTol<T>::far);
}

#if MIXATTN_HAS_SIMD
/// Whether xsimd's fma rounds once on Arch, as std::fma does (not on a build without FMA
/// instructions, where it is a product and a sum): with h = ceil(digits / 2),
/// (1 + 2^-h)^2 - (1 + 2^(1-h)) is 2^-2h, which the product alone rounds away (2^-24 in float).
template <class T, class Arch>
bool vector_fma_is_fused() {
  using B = xsimd::batch<T, Arch>;
  const int h = (std::numeric_limits<T>::digits + 1) / 2;
  const T a = T(1) + std::ldexp(T(1), -h), c = T(1) + std::ldexp(T(1), 1 - h);
  return xsimd::fma(B(a), B(a), B(-c)).get(0) == std::fma(a, a, -c);
}

// With one component per register tile (16-register builds) each dx entry takes the components'
// FMAs in order from +0, as the scalar twin (detail::density_grad_scalar) does, and within one
// call the token sums in T go into the wide sums once, as the twin's do: the same bits for dx,
// sum w t and sum w t^2, where the vector FMA rounds once as the twin's std::fma does. Shapes
// with a lone dims register beside the two-register tiles, and with dims padded to whole
// registers.
TYPED_TEST(GmaBackwardKernel, OneComponentTileHasTheScalarTwinsBits) {
  using T = TypeParam;
  using Arch = detail::simd_arch;
  if (detail::DensityGradTile<Arch>::components != 1) GTEST_SKIP() << "a multi-component tile";
  if (!vector_fma_is_fused<T, Arch>()) GTEST_SKIP() << "xsimd's fma is not fused here";
  using W = detail::wide_t<T>;
  const Index width = static_cast<Index>(detail::simd_width<Arch, T>::value);
  for (const Shape s : {Shape{45, 3 * width, 7}, Shape{32, 2 * width - 3, 5}, Shape{9, 5, 2}}) {
    SCOPED_TRACE(::testing::Message() << "n " << s.n << " r " << s.r << " K " << s.K);
    const std::uint64_t seed = static_cast<std::uint64_t>(s.n * 7 + s.r * 3 + s.K);
    const Matrix<T> mean = random_matrix<T>(s.K, s.r, seed);
    const Matrix<T> var_raw = random_matrix<T>(s.K, s.r, seed + 1, 0.7);
    const detail::MixtureConstants<W> c =
        detail::mixture_constants<W>(mean, var_raw, Vector<T>(Vector<T>::Zero(s.K)), T(1e-4));
    const detail::PackedDensityDims<T> p = detail::pack_density_dims<Arch, T>(mean, c);
    const Index ld = p.padded_dim;
    Matrix<T> x = Matrix<T>::Zero(s.n, ld);
    x.leftCols(s.r) = random_matrix<T>(s.n, s.r, seed + 2);
    const Matrix<T> w = random_matrix<T>(s.n, s.K, seed + 3);
    Matrix<T> fast = Matrix<T>::Zero(s.n, ld), slow = Matrix<T>::Zero(s.n, ld);
    detail::DensityGradSums<T> fast_sums, slow_sums;
    fast_sums.reset(s.K, ld);
    slow_sums.reset(s.K, ld);
    detail::density_grad_into(Arch{}, p, x.data(), ld, w.data(), s.K, s.n, fast.data(), ld,
                              fast_sums, T(-2));
    fast_sums.fold();
    detail::density_grad_into(detail::scalar_arch{}, p, x.data(), ld, w.data(), s.K, s.n,
                              slow.data(), ld, slow_sums, T(-2));
    EXPECT_TRUE(fast.leftCols(s.r) == slow.leftCols(s.r));
    EXPECT_TRUE(fast_sums.wt.leftCols(s.r) == slow_sums.wt.leftCols(s.r));
    EXPECT_TRUE(fast_sums.wtt.leftCols(s.r) == slow_sums.wtt.leftCols(s.r));
    EXPECT_GT(slow.norm(), 1e-3);  // not trivially zero
  }
}

// Over many short panels the kernel keeps its token sums in T for at most
// density_grad_fold_tokens tokens, then folds them into the wide sums: after every call the T
// sums hold no more than that, and the result is the direct formula's within the error of sums
// in T of that length (KernelTol's near bound covers 300 terms).
TYPED_TEST(GmaBackwardKernel, ShortPanelsFoldTheirSumsInTime) {
  using T = TypeParam;
  using W = detail::wide_t<T>;
  using Arch = detail::simd_arch;
  const Index n = 1000, r = 11, K = 6, panel = 32;
  const Matrix<T> mean = random_matrix<T>(K, r, 201);
  const Matrix<T> var_raw = random_matrix<T>(K, r, 202, 0.7);
  const Matrix<T> x = random_matrix<T>(n, r, 203);
  const Matrix<T> w = random_matrix<T>(n, K, 204);
  const detail::MixtureConstants<W> c =
      detail::mixture_constants<W>(mean, var_raw, Vector<T>(Vector<T>::Zero(K)), T(1e-4));
  const detail::PackedDensityDims<T> p = detail::pack_density_dims<Arch, T>(mean, c);
  const Index ld = p.padded_dim;
  Matrix<T> xpad = Matrix<T>::Zero(n, ld), acc = Matrix<T>::Zero(n, ld);
  xpad.leftCols(r) = x;
  detail::DensityGradSums<T> sums;
  sums.reset(K, ld);
  for (Index i = 0; i < n; ++i)
    for (Index k = 0; k < K; ++k) sums.w(k) += static_cast<W>(w(i, k));
  Index folds = 0;
  for (Index i0 = 0; i0 < n; i0 += panel) {
    const Index rows = std::min(panel, n - i0), before = sums.part_tokens;
    detail::density_grad_into(Arch{}, p, xpad.data() + i0 * ld, ld, w.data() + i0 * K, K, rows,
                              acc.data() + i0 * ld, ld, sums, T(-2));
    EXPECT_LE(sums.part_tokens, detail::density_grad_fold_tokens);
    if (sums.part_tokens < before + rows) ++folds;
  }
  EXPECT_GE(folds, 3);  // 1000 tokens in sums of at most 256
  Matrix<W> dmu, dvar;
  detail::density_grad_finish(c, sums, dmu, dvar);
  EXPECT_EQ(sums.part_tokens, 0);
  const Direct d =
      direct_density_backward(mean.template cast<double>(), var_raw.template cast<double>(), 1e-4,
                              x.template cast<double>(), w.template cast<double>());
  EXPECT_TRUE(within(acc.leftCols(r).template cast<double>(), d.dx, d.dx_abs, KernelTol<T>::near))
      << "dx";
  EXPECT_TRUE(within(dmu.template cast<double>(), d.dmu, d.dmu_abs, KernelTol<T>::near)) << "dmu";
  EXPECT_TRUE(within(dvar.template cast<double>(), d.dvar, d.dvar_abs, KernelTol<T>::near))
      << "dvar";
}
#endif

// The whole backward with the SIMD kernel against the same backward on the scalar fallback
// (Arch = scalar_arch, plain loops), across several panels (N, M > gma_backward_panel, not
// multiples of it), bidirectional with M != N and causal.
template <class T>
struct ArchTol;
// float: the two paths sum the same terms in different orders and groupings (in-panel float
// sums of up to 256 terms, tiles of 6 components) on responsibilities that already differ by
// rounding (~1e-6 relative): O(256 eps_f) = 3e-5 of the gradient's scale.
template <>
struct ArchTol<float> {
  static constexpr double tol = 1e-4;
};
// double: the same with eps_d.
template <>
struct ArchTol<double> {
  static constexpr double tol = 1e-12;
};

TYPED_TEST(GmaBackwardKernel, SimdBackwardMatchesScalarFallback) {
  using T = TypeParam;
  const Index r = 9, K = 13, dv = 5;
  for (bool causal : {false, true}) {
    const Index n = 600, m = causal ? n : 530;
    SCOPED_TRACE(::testing::Message() << "causal " << causal << " seed 101");
    gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 101);
    mix.var_raw = random_matrix<T>(K, r, 102, 0.7);
    mix.prior_logit = random_matrix<T>(K, 1, 103, 0.5);
    const Matrix<T> q = random_matrix<T>(n, r, 104, 0.8), k = random_matrix<T>(m, r, 105, 0.8);
    const Matrix<T> v = random_matrix<T>(m, dv, 106), w = random_matrix<T>(n, dv, 107);
    gma::Options opt;
    opt.causal = causal;
    gma::Saved<T> s_simd, s_scalar;
    gma::forward<T, detail::simd_arch>(mix, q, k, v, opt, &s_simd);
    gma::forward<T, detail::scalar_arch>(mix, q, k, v, opt, &s_scalar);
    const gma::Grad<T> a = gma::backward<T, detail::simd_arch>(mix, q, k, v, w, s_simd, opt);
    const gma::Grad<T> b = gma::backward<T, detail::scalar_arch>(mix, q, k, v, w, s_scalar, opt);
    auto check = [](const auto& x, const auto& y, const char* what) {
      const Matrix<double> xd = x.template cast<double>(), yd = y.template cast<double>();
      const double scale = yd.cwiseAbs().maxCoeff();
      EXPECT_GT(scale, 1e-3) << what;  // not trivially zero
      EXPECT_TRUE(mixattn::testing::all_close(xd, yd, 0.0, ArchTol<T>::tol * scale)) << what;
    };
    check(a.q, b.q, "q");
    check(a.k, b.k, "k");
    check(a.v, b.v, "v");
    check(a.mixture.mean, b.mixture.mean, "mean");
    check(a.mixture.var_raw, b.mixture.var_raw, "var_raw");
    check(Matrix<T>(a.mixture.prior_logit), Matrix<T>(b.mixture.prior_logit), "prior_logit");
  }
}

}  // namespace
