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
#include "mixattn/detail/rope/rotate.hpp"
#include "mixattn/rope_types.hpp"

MIXATTN_BEGIN_NAMESPACE
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
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_ROPE_WORKERS(T)                  \
  MIXATTN_TEMPLATE_INSTANCE void rope_rotate<T>( \
      const char*, const ConstMatrixRef<T>&, MatrixRef<T>, Index, const rope::Options&, double);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_ROPE_WORKERS)
#undef MIXATTN_ROPE_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
