// mixattn/window.hpp — sliding-window causal softmax attention (SPEC.md §7): query i attends to
// the keys i - w < j <= i, the local layers of OVQ's hybrid models. A thin public face over the
// tiled softmax kernels of reference.hpp (flash_forward / flash_backward with options.causal and
// options.window), which skip every key tile outside the window: O(N w (r + d_v)) time and O(N)
// memory besides the output. Positions, if wanted, come from rope.hpp applied to q and k first.
//
// Thread safety and allocation as reference.hpp's tiled form: every function is reentrant, and
// the `_into` forms reuse the caller's outputs, Saved and Grad (no allocation when shapes repeat).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/reference.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace window {

/// Options of a sliding-window call.
struct Options {
  Index window = 256;        ///< w >= 1: keys i - w < j <= i; w >= N is causal softmax attention
  double scale = 0;          ///< logit scale; 0: 1/sqrt(r)
  bool check_finite = true;  ///< reject NaN/Inf inputs and report overflowed results
};

/// What forward keeps for backward (the output and N log-sum-exps), and the gradients: the
/// tiled reference's own records.
template <class T>
using Saved = reference::Saved<T>;
template <class T>
using Grad = reference::Grad<T>;

}  // namespace window

namespace detail {

/// The reference options of a window call, after checking the window itself.
inline reference::Options window_options(const window::Options& opt, const char* fn) {
  require(opt.window >= 1, fn, "options.window is ", opt.window, ", must be >= 1");
  reference::Options ro;
  ro.causal = true;
  ro.window = opt.window;
  ro.scale = opt.scale;
  ro.check_finite = opt.check_finite;
  return ro;
}

}  // namespace detail

namespace window {

/// Sliding-window attention (SPEC §7). q, k: N x r, v: N x d_v, row-major (as many keys as
/// queries: it is causal). Returns N x d_v. `saved` (optional) receives what backward needs.
/// T is not deduced: write window::forward<float>(q, k, v, opt).
/// Throws std::invalid_argument on bad shapes or options, std::domain_error on non-finite input
/// or an output that overflowed T (with check_finite).
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt = {}, Saved<T>* saved = nullptr) {
  static constexpr const char* fn = "mixattn::window::forward";
  Matrix<T> out;
  detail::flash_forward<T>(fn, out, q, k, v, detail::window_options(opt, fn), saved);
  return out;
}

/// forward into a caller-owned `out` (resized to N x d_v).
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt,
                  Saved<typename detail::identity<T>::type>* saved) {
  static constexpr const char* fn = "mixattn::window::forward_into";
  detail::flash_forward<T>(fn, out, q, k, v, detail::window_options(opt, fn), saved);
}

/// Gradients of sum(grad_out . forward(q, k, v)) with respect to q (N x r), k (N x r) and
/// v (N x d_v). grad_out: N x d_v; saved: filled by forward with the same inputs and options
/// (a record made with another window is refused).
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved,
                 const Options& opt = {}) {
  static constexpr const char* fn = "mixattn::window::backward";
  Grad<T> g;
  detail::flash_backward<T>(fn, g, q, k, v, grad_out, saved, detail::window_options(opt, fn));
  return g;
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`).
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                   const Saved<typename detail::identity<T>::type>& saved, const Options& opt) {
  static constexpr const char* fn = "mixattn::window::backward_into";
  detail::flash_backward<T>(fn, grad, q, k, v, grad_out, saved, detail::window_options(opt, fn));
}

}  // namespace window
MIXATTN_END_NAMESPACE
