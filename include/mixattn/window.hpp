// mixattn/window.hpp — sliding-window causal softmax attention (SPEC.md §7): query i attends to
// the keys i - w < j <= i, the local layers of OVQ's hybrid models. The reference's tiled form
// with options.causal and options.window, its records and bodies (detail/window/bodies.hpp),
// whose kernels skip every key tile outside the window: O(N w (r + d_v)) time and O(N) memory
// besides the output. Positions, if wanted, come from rope.hpp applied to q and k first.
//
// Thread safety and allocation as reference.hpp's tiled form: every function is reentrant, and
// the `_into` forms reuse the caller's outputs, Saved and Grad (no allocation when shapes repeat).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/window/bodies.hpp"
#include "mixattn/window_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace window {

/// Sliding-window attention (SPEC §7). q, k: N x r, v: N x d_v, row-major (as many keys as
/// queries: it is causal). Returns N x d_v. `saved` (optional) receives what backward needs.
/// T is not deduced: write window::forward<float>(q, k, v, opt).
/// Throws std::invalid_argument on bad shapes or options, std::domain_error on non-finite input
/// or an output that overflowed T (with check_finite).
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt = {}, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::window_forward_into<T>, "mixattn::window::forward",
                                     saved, q, k, v, opt);
}

/// forward into a caller-owned `out` (resized to N x d_v).
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt,
                  Saved<detail::identity_t<T>>* saved) {
  detail::window_forward_into<T>("mixattn::window::forward_into", out, q, k, v, opt, saved);
}

/// Gradients of sum(grad_out . forward(q, k, v)) with respect to q (N x r), k (N x r) and
/// v (N x d_v). grad_out: N x d_v; saved: filled by forward with the same inputs and options
/// (a record made with another window is refused).
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved,
                 const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(
      &detail::window_backward_into<T>, "mixattn::window::backward", q, k, v, grad_out, saved, opt);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`).
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                   const Saved<detail::identity_t<T>>& saved, const Options& opt) {
  detail::window_backward_into<T>("mixattn::window::backward_into", grad, q, k, v, grad_out, saved,
                                  opt);
}

}  // namespace window
// Its bodies are the reference's (reference.hpp lists them), called through one-line wrappers.
MIXATTN_END_NAMESPACE
