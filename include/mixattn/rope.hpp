// mixattn/rope.hpp — rotary position embedding (Su et al., "RoFormer: Enhanced Transformer with
// Rotary Position Embedding", 2021), SPEC.md §8: forward and backward.
//
// Row n of an N x r matrix x (r even) is the token at position p = start + n. Each pair of
// adjacent columns (2i, 2i + 1), i < r/2, is rotated by the angle p theta_i,
// theta_i = base^(-2i/r) (base 10000 by default):
//
//     y_{n,2i}   = x_{n,2i} cos(p theta_i) - x_{n,2i+1} sin(p theta_i)
//     y_{n,2i+1} = x_{n,2i} sin(p theta_i) + x_{n,2i+1} cos(p theta_i)
//
// Applied to queries and keys before attention, q_m . k_n then depends on the positions only
// through m - n. The map is linear and orthogonal in x, so the backward is the inverse rotation
// of the incoming gradient (angle -p theta_i). Positions and base are constants (no gradient).
// Cost O(N r): r/2 sine-cosine pairs per row, angles and trigonometry in double.
//
// Thread safety: every function is reentrant; distinct calls may run concurrently (the table of
// theta_i is per thread).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace rope {

struct Options {
  /// theta_i = base^(-2i/r): finite and > 0. 10000 as in RoFormer.
  double base = 10000;
  /// Reject NaN/Inf in x (or grad_out) with std::domain_error, and report a result that
  /// overflows T (inputs near T's largest value) rather than return it.
  bool check_finite = true;
};

}  // namespace rope

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

namespace rope {

/// RoPE forward (SPEC §8): x: N x r (r even, >= 2), row-major, row n at position start + n (any
/// integer start, e.g. the number of tokens already decoded).  ->  N x r. T is not deduced:
/// write rope::apply<float>(x, start).
/// Throws std::invalid_argument for odd or zero r, a bad base, a last position start + N - 1
/// beyond the largest Index, or an angle p theta_i that overflows double (a subnormal base);
/// with check_finite,
/// std::domain_error for non-finite x or an output that overflows T.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> apply(const ConstMatrixArg<T>& x, Index start = 0, const Options& opt = {}) {
  static constexpr const char* fn = "mixattn::rope::apply";
  detail::rope_check<T>(fn, "x", x, start, opt);
  Matrix<T> out(x.rows(), x.cols());
  detail::rope_rotate<T>(fn, x, out, start, opt, 1.0);
  return out;
}

/// apply into a caller-owned `out` (resized to N x r; `out` may be x itself). Repeated shapes
/// allocate nothing.
template <class T, detail::enable_if_supported<T> = 0>
void apply_into(Matrix<T>& out, const ConstMatrixArg<T>& x, Index start, const Options& opt) {
  static constexpr const char* fn = "mixattn::rope::apply_into";
  detail::rope_check<T>(fn, "x", x, start, opt);
  out.resize(x.rows(), x.cols());
  detail::rope_rotate<T>(fn, x, out, start, opt, 1.0);
}

/// apply in place: x (N x r, a Matrix, row-major Map or row block) is overwritten by its
/// rotation. Validation happens before any write; an output that overflows T (with
/// check_finite) throws after x was written.
template <class T, detail::enable_if_supported<T> = 0>
void apply_in_place(MatrixRef<T> x, Index start = 0, const Options& opt = {}) {
  static constexpr const char* fn = "mixattn::rope::apply_in_place";
  detail::rope_check<T>(fn, "x", x, start, opt);
  detail::rope_rotate<T>(fn, x, x, start, opt, 1.0);
}

/// RoPE backward (SPEC §8): the gradient with respect to x of a loss whose gradient with
/// respect to apply(x, start, opt) is grad_out (N x r): the inverse rotation, angle -p theta_i.
/// Positions and base get no gradient. Throws as apply does (grad_out in place of x).
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> backward(const ConstMatrixArg<T>& grad_out, Index start = 0, const Options& opt = {}) {
  static constexpr const char* fn = "mixattn::rope::backward";
  detail::rope_check<T>(fn, "grad_out", grad_out, start, opt);
  Matrix<T> grad(grad_out.rows(), grad_out.cols());
  detail::rope_rotate<T>(fn, grad_out, grad, start, opt, -1.0);
  return grad;
}

/// backward into a caller-owned `grad` (resized to N x r; may be grad_out itself).
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Matrix<T>& grad, const ConstMatrixArg<T>& grad_out, Index start,
                   const Options& opt) {
  static constexpr const char* fn = "mixattn::rope::backward_into";
  detail::rope_check<T>(fn, "grad_out", grad_out, start, opt);
  grad.resize(grad_out.rows(), grad_out.cols());
  detail::rope_rotate<T>(fn, grad_out, grad, start, opt, -1.0);
}

/// backward in place: grad (N x r) holds dL/dy on entry and dL/dx on return.
template <class T, detail::enable_if_supported<T> = 0>
void backward_in_place(MatrixRef<T> grad, Index start = 0, const Options& opt = {}) {
  static constexpr const char* fn = "mixattn::rope::backward_in_place";
  detail::rope_check<T>(fn, "grad_out", grad, start, opt);
  detail::rope_rotate<T>(fn, grad, grad, start, opt, -1.0);
}

}  // namespace rope

#ifdef MIXATTN_TEMPLATE_INSTANCE
// core.hpp: compiling the operators once.
namespace detail {
#define MIXATTN_ROPE_INSTANCES(T)                \
  MIXATTN_TEMPLATE_INSTANCE void rope_rotate<T>( \
      const char*, const ConstMatrixRef<T>&, MatrixRef<T>, Index, const rope::Options&, double);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_ROPE_INSTANCES)
#undef MIXATTN_ROPE_INSTANCES
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
