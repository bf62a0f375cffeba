// mixattn/detail/performer/features.hpp — Performer's random directions (SPEC 5.1): Gaussian draws
// that are the same on every platform, orthogonal blocks.
//
// Internal: part of mixattn/performer.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/performer_types.hpp"

#include <Eigen/Core>
#include <Eigen/QR>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// n standard normal draws in double (Box-Muller on 53-bit uniforms: platform-independent,
/// unlike std::normal_distribution).
inline void performer_gaussians(std::mt19937_64& rng, double* out, Index n) {
  const double two_pi = 6.283185307179586476925286766559;
  const auto unit = [&rng] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for (Index i = 0; i < n; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(unit())), angle = two_pi * unit();
    out[i] = radius * std::cos(angle);
    if (i + 1 < n) out[i + 1] = radius * std::sin(angle);
  }
}

}  // namespace detail

namespace performer {

template <class T>
Features<T> Features<T>::random(Index m, Index r, std::uint64_t seed, Draw draw) {
  detail::require(m > 0 && r > 0, "mixattn::performer::Features::random", "m is ", m, " and r is ",
                  r, "; both must be positive");
  std::mt19937_64 rng(seed);
  Matrix<double> w(m, r);
  if (draw == Draw::iid) {
    detail::performer_gaussians(rng, w.data(), w.size());
  } else {
    // Each block of r rows: a Haar-distributed orthogonal matrix (rows exactly orthonormal, each
    // uniform on the sphere), then row l scaled by the norm of an independent Gaussian r-vector, so
    // every row keeps the N(0, I) row's length distribution (the reference's scaling = 0).
    Matrix<double> g(r, r), norms(m, r);
    for (Index b = 0; b < m; b += r) {
      detail::performer_gaussians(rng, g.data(), g.size());
      const Eigen::HouseholderQR<Matrix<double>> qr(g);
      Matrix<double> qm = qr.householderQ();
      // Q diag(sign(R_cc)) is Haar-distributed; Householder's Q alone is not (its columns' signs
      // follow g's), which biases the directions and so the kernel estimate.
      for (Index c = 0; c < r; ++c)
        if (qr.matrixQR()(c, c) < 0) qm.col(c) *= -1.0;
      const Index rows = std::min(r, m - b);
      w.middleRows(b, rows) = qm.topRows(rows);
    }
    detail::performer_gaussians(rng, norms.data(), norms.size());
    w.array().colwise() *= norms.rowwise().norm().array();
  }
  Features f;
  f.w = w.cast<T>();
  f.draw = draw;
  return f;
}

}  // namespace performer
MIXATTN_END_NAMESPACE
