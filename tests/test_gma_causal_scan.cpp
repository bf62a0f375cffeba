// The causal scan's backward (detail/common/causal_scan.hpp, SPEC 1.5): the register-tiled SIMD
// path and its Eigen twin (Arch = scalar_arch) against the direct O(N^2) formula in long double, on
// shapes with ragged chunk tails, N below or not a multiple of the chunk, K and d_v not multiples
// of the register width, a chunk that is not one either, and a continued state (start state S0, z0
// and the gradient of the end state), float and double.
#include <mixattn/gma.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using namespace mixattn;
using mixattn::testing::random_matrix;
using LD = long double;
using MatL = Eigen::Matrix<LD, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// The scan's inputs in T, the state ones in wide_t<T>.
template <class T>
struct ScanCase {
  using W = detail::wide_t<T>;
  Matrix<T> gq, gk, v, g;
  Vector<T> h;
  Matrix<W> S0, G_end;  // K x d_v
  Vector<W> z0, u_end;  // K
  bool continued;
  ScanCase(Index n, Index K, Index dv, bool cont, std::uint64_t seed) : continued(cont) {
    // responsibilities are non-negative: |normal|, some rows with large and tiny entries
    gq = random_matrix<T>(n, K, seed).cwiseAbs();
    gk = random_matrix<T>(n, K, seed + 1).cwiseAbs();
    v = random_matrix<T>(n, dv, seed + 2);
    g = random_matrix<T>(n, dv, seed + 3, 0.5);
    h = random_matrix<T>(n, 1, seed + 4, 0.5);
    S0 = random_matrix<W>(K, dv, seed + 5, 3.0);
    z0 = random_matrix<W>(K, 1, seed + 6, 3.0).cwiseAbs();
    G_end = random_matrix<W>(K, dv, seed + 7, 2.0);
    u_end = random_matrix<W>(K, 1, seed + 8, 2.0);
  }
};

/// The five results of the backward: dGamma_Q, dGamma_K, dV, and the start state's gradient.
struct ScanGrads {
  MatL dq, dk, dv, dS0, dz0;
};

/// SPEC 1.5 written out: with B_ij = g_i . v_j + h_i and A_ij = gamma_q,i . gamma_k,j,
///   dgamma_q,i = S0 g_i + h_i z0 + sum_{j <= i} B_ij gamma_k,j
///   dgamma_k,j = G v_j + u + sum_{i >= j} B_ij gamma_q,i
///   dv_j = G^T gamma_k,j + sum_{i >= j} A_ij g_i
///   dS0 = G + sum_i gamma_q,i g_i^T,   dz0 = u + sum_i h_i gamma_q,i
/// (G, u: the end state's gradient). With absolute = true every factor enters by its absolute
/// value: the sums of |terms| the rounding errors scale with.
template <class T>
ScanGrads direct_backward(const ScanCase<T>& c, bool absolute) {
  const auto L = [&](const auto& m) {
    MatL x = m.template cast<LD>();
    return absolute ? MatL(x.cwiseAbs()) : x;
  };
  const MatL gq = L(c.gq), gk = L(c.gk), v = L(c.v), g = L(c.g), h = L(Matrix<T>(c.h));
  const Index n = gq.rows(), K = gq.cols(), dv = v.cols();
  MatL S0 = MatL::Zero(K, dv), z0 = MatL::Zero(K, 1), G = S0, u = z0;
  if (c.continued) {
    S0 = L(c.S0);
    z0 = L(Matrix<detail::wide_t<T>>(c.z0));
    G = L(c.G_end);
    u = L(Matrix<detail::wide_t<T>>(c.u_end));
  }
  ScanGrads r{MatL::Zero(n, K), MatL::Zero(n, K), MatL::Zero(n, dv), G, u};
  for (Index i = 0; i < n; ++i) {
    r.dq.row(i) = g.row(i) * S0.transpose() + h(i, 0) * z0.transpose();
    r.dk.row(i) = v.row(i) * G.transpose() + u.transpose();
    r.dv.row(i) = gk.row(i) * G;
    r.dS0 += gq.row(i).transpose() * g.row(i);
    r.dz0 += h(i, 0) * gq.row(i).transpose();
  }
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j <= i; ++j) {
      const LD gv = g.row(i).dot(v.row(j));
      const LD b = gv + h(i, 0);
      const LD a = gq.row(i).dot(gk.row(j));
      r.dq.row(i) += b * gk.row(j);
      r.dk.row(j) += b * gq.row(i);
      r.dv.row(j) += a * g.row(i);
    }
  return r;
}

/// The scan's backward for Arch: the same outputs as direct_backward.
template <class T, class Arch>
ScanGrads scan_backward(const ScanCase<T>& c, Index chunk) {
  using W = detail::wide_t<T>;
  const Index n = c.gq.rows(), K = c.gq.cols(), dv = c.v.cols();
  Matrix<T> dq(n, K), dk(n, K), dvv(n, dv);
  Matrix<W> G = c.continued ? c.G_end : Matrix<W>(Matrix<W>::Zero(K, dv));
  Vector<W> u = c.continued ? c.u_end : Vector<W>(Vector<W>::Zero(K));
  detail::ScanScratch<T> scratch;
  for (int rep = 0; rep < 2; ++rep) {  // a second call on the used scratch gives the same
    G = c.continued ? c.G_end : Matrix<W>(Matrix<W>::Zero(K, dv));
    u = c.continued ? c.u_end : Vector<W>(Vector<W>::Zero(K));
    detail::causal_scan_backward<T, Arch>(c.gq, c.gk, c.v, c.g, c.h, chunk, dq, dk, dvv,
                                          c.continued ? &c.S0 : nullptr,
                                          c.continued ? &c.z0 : nullptr, G, u, scratch);
  }
  return ScanGrads{dq.template cast<LD>(), dk.template cast<LD>(), dvv.template cast<LD>(),
                   G.template cast<LD>(), MatL(u.template cast<LD>())};
}

/// |a - ref| <= tol * scale entry by entry, reported with the worst entry.
::testing::AssertionResult within(const MatL& a, const MatL& ref, const MatL& scale, double tol) {
  if (a.rows() != ref.rows() || a.cols() != ref.cols())
    return ::testing::AssertionFailure()
           << "shape " << a.rows() << "x" << a.cols() << " vs " << ref.rows() << "x" << ref.cols();
  double worst = 0;
  Index wi = 0, wj = 0;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j) {
      const double e =
          static_cast<double>(std::abs(a(i, j) - ref(i, j)) / std::max<LD>(scale(i, j), 1e-300L));
      if (!(e <= worst)) {
        worst = e;
        wi = i;
        wj = j;
      }
    }
  if (worst <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "worst entry (" << wi << ", " << wj << "): " << static_cast<double>(a(wi, wj)) << " vs "
         << static_cast<double>(ref(wi, wj)) << ", error / scale " << worst << " > " << tol;
}

struct Shape {
  Index n, K, dv, chunk;
  bool continued;
};

template <class T>
class GmaCausalScan : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GmaCausalScan, Scalars);

TYPED_TEST(GmaCausalScan, TilesAndEigenTwinMatchTheDirectFormula) {
  using T = TypeParam;
  const Shape shapes[] = {
      {100, 64, 64, 32, true},  // the library's shape, a ragged last chunk of 4
      {64, 64, 64, 32, false},  // whole chunks
      {37, 13, 11, 8, true},    // K, d_v below and not multiples of a register
      {5, 9, 7, 32, true},      // N below one chunk
      {129, 20, 70, 30, true},  // a chunk that is not whole registers, d_v past a column tile
      {61, 33, 17, 16, false},  // K one past whole registers
      {96, 1, 1, 32, true},     // one component, one value column: scalar tails only
  };
  std::uint64_t seed = 500;
  for (const Shape& s : shapes) {
    seed += 10;
    SCOPED_TRACE(::testing::Message()
                 << "N " << s.n << " K " << s.K << " d_v " << s.dv << " chunk " << s.chunk
                 << " continued " << s.continued << " seed " << seed);
    const ScanCase<T> c(s.n, s.K, s.dv, s.continued, seed);
    const ScanGrads ref = direct_backward(c, false), scale = direct_backward(c, true);
    // Both paths sum each result in T over at most d_v + K + chunk + 1 products inside a chunk
    // (the state's term, h z or u, the chunk's block), from a state rounded once to T: each
    // rounding is at most eps of the running sum of |terms|, so the error is within
    // (d_v + K + chunk + 2) eps of the sum of |terms| (gamma_n); the state's wide sums add
    // O(N eps_wide). One unit of slack for the block's own product g_i . v_j + h_i.
    const double tol =
        static_cast<double>(s.dv + s.K + s.chunk + 3) * std::numeric_limits<T>::epsilon();
    const ScanGrads tiles = scan_backward<T, detail::simd_arch>(c, s.chunk);
    const ScanGrads twin = scan_backward<T, detail::scalar_arch>(c, s.chunk);
    for (const ScanGrads* got : {&tiles, &twin}) {
      SCOPED_TRACE(got == &tiles ? "tiles" : "Eigen twin");
      EXPECT_TRUE(within(got->dq, ref.dq, scale.dq, tol)) << "dGamma_Q";
      EXPECT_TRUE(within(got->dk, ref.dk, scale.dk, tol)) << "dGamma_K";
      EXPECT_TRUE(within(got->dv, ref.dv, scale.dv, tol)) << "dV";
      EXPECT_TRUE(within(got->dS0, ref.dS0, scale.dS0, tol)) << "dS0";
      EXPECT_TRUE(within(got->dz0, ref.dz0, scale.dz0, tol)) << "dz0";
    }
    // and each other, within both errors
    EXPECT_TRUE(within(tiles.dq, twin.dq, scale.dq, 2 * tol)) << "dGamma_Q, tiles vs twin";
    EXPECT_TRUE(within(tiles.dk, twin.dk, scale.dk, 2 * tol)) << "dGamma_K, tiles vs twin";
    EXPECT_TRUE(within(tiles.dv, twin.dv, scale.dv, 2 * tol)) << "dV, tiles vs twin";
    EXPECT_GT(ref.dq.cwiseAbs().maxCoeff(), 1e-3L);  // not trivially zero
  }
}

}  // namespace
