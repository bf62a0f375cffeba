// mixattn/detail/rope/rotate.hpp — the rotary position embedding's checks (the positions, the
// base, the angles) and the rotation itself, forward and inverse (SPEC §8).
//
// Internal: part of mixattn/rope.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/rope_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Validates a base of the angles theta_i = base^(-2i/r); `field` names it in the message
/// ("options.base", or the field of a caller's own configuration).
inline void rope_check_base(const char* fn, const char* field, double base) {
  require(std::isfinite(base) && base > 0, fn, field, " is ", base, ", must be finite and > 0");
}

/// Validates the angles p theta_i of positions |p| <= p_max in double, for a valid base and r
/// (even, >= 2). The largest theta_i = base^(-2i/r), i < r/2, is base^(-(r - 2)/r) when base < 1
/// (1 otherwise): a subnormal base makes it overflow for large r, and p_max theta_max may
/// overflow where theta_max does not. Either would rotate by an infinite angle (a NaN sine and
/// cosine, and 0 x inf at p = 0), so both are refused, naming `field`.
inline void rope_check_angles(const char* fn, const char* field, double base, Index r,
                              double p_max) {
  const double theta_max =
      base >= 1 ? 1.0 : std::pow(base, -static_cast<double>(r - 2) / static_cast<double>(r));
  require(std::isfinite(theta_max), fn, field, " is ", base, ": theta_i = base^(-2i/r) overflows ",
          "double for r = ", r, " (i up to ", r / 2 - 1, ")");
  require(std::isfinite(p_max * theta_max), fn, field, " is ", base, ": the angle p theta_i at ",
          "position |p| = ", p_max, " overflows double (r = ", r, ")");
}

/// Validates x (N x r, r even and >= 2), the positions start ... start + N - 1 (all of them
/// Index values, their angles finite in double) and the options, once at the API boundary.
template <class T>
void rope_check(const char* fn, const char* arg, const ConstMatrixRef<T>& x, Index start,
                const rope::Options& opt) {
  require(x.cols() >= 2 && x.cols() % 2 == 0, fn, arg, " is ", shape_str(x),
          ": r must be even and >= 2 (column pairs (2i, 2i + 1) are rotated)");
  require(x.rows() == 0 || start <= std::numeric_limits<Index>::max() - (x.rows() - 1), fn,
          "start is ", start, ": the last position start + N - 1 (N = ", x.rows(),
          ") exceeds the largest Index");
  rope_check_base(fn, "options.base", opt.base);
  if (x.rows() > 0) {  // the largest |p| is at the first or the last row
    const double first = static_cast<double>(start);
    const double last = static_cast<double>(start + (x.rows() - 1));
    rope_check_angles(fn, "options.base", opt.base, x.cols(),
                      std::max(std::abs(first), std::abs(last)));
  }
  if (opt.check_finite) require_finite(x, fn, arg);
}

/// v rounded to T as IEEE round-to-nearest does, without the undefined behaviour of converting a
/// double beyond float's range: a magnitude at or past the largest float plus half its last
/// step becomes an infinity (which check_finite then reports), anything smaller converts.
template <class T>
T rope_round(double v) {
  if constexpr (std::is_same<T, float>::value) {
    constexpr double overflow = 0x1.ffffffp+127;  // FLT_MAX + half an ulp: rounds away to inf
    if (v >= overflow) return std::numeric_limits<float>::infinity();
    if (v <= -overflow) return -std::numeric_limits<float>::infinity();
  }
  return static_cast<T>(v);
}

/// out = R(sign p theta) x row by row, p = start + n (sign +1: forward, -1: backward). out has
/// x's shape and may be x itself (each pair is read before it is written).
template <class T>
void rope_rotate(const char* fn, const ConstMatrixRef<T>& x, MatrixRef<T> out, Index start,
                 const rope::Options& opt, double sign) {
  const Index n = x.rows(), pairs = x.cols() / 2;
  MIXATTN_ASSERT(out.rows() == n && out.cols() == x.cols());
  thread_local Vector<double> theta;  // capacity kept: repeated shapes allocate nothing
  theta.resize(pairs);
  const double r = static_cast<double>(x.cols());
  for (Index i = 0; i < pairs; ++i)
    theta[i] = std::pow(opt.base, -2.0 * static_cast<double>(i) / r);
  for (Index row = 0; row < n; ++row) {
    // p theta_i in double: exact positions up to 2^53, and float inputs are rotated with a
    // cosine and sine correct to double before the one rounding to T.
    const double p = static_cast<double>(start + row);
    const T* xr = x.row(row).data();
    T* yr = out.row(row).data();
    for (Index i = 0; i < pairs; ++i) {
      const double a = p * theta[i];
      const double c = std::cos(a), s = sign * std::sin(a);
      const double x0 = static_cast<double>(xr[2 * i]), x1 = static_cast<double>(xr[2 * i + 1]);
      yr[2 * i] = rope_round<T>(x0 * c - x1 * s);
      yr[2 * i + 1] = rope_round<T>(x0 * s + x1 * c);
    }
  }
  // A rotation keeps each pair's norm, but a norm above T's largest value has no representation.
  if (opt.check_finite) require_finite_result(out, fn, "the output", "x is");
}

}  // namespace detail
MIXATTN_END_NAMESPACE
