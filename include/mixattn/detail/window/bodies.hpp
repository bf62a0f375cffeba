// mixattn/detail/window/bodies.hpp — the sliding window's bodies (SPEC §7): its options checked and
// turned into the reference's (causal, with the window), then the reference's tiled bodies, whose
// kernels skip every key tile outside the window.
//
// Internal: part of mixattn/window.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/reference/backward.hpp"
#include "mixattn/detail/reference/forward.hpp"
#include "mixattn/window_types.hpp"

MIXATTN_BEGIN_NAMESPACE
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

/// forward_into's body (`fn` names the entry point in messages).
template <class T>
void window_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                         const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                         const window::Options& opt, window::Saved<T>* saved) {
  flash_forward_into<T>(fn, out, q, k, v, window_options(opt, fn), saved);
}

/// backward_into's body.
template <class T>
void window_backward_into(const char* fn, window::Grad<T>& grad, const ConstMatrixRef<T>& q,
                          const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                          const ConstMatrixRef<T>& grad_out, const window::Saved<T>& saved,
                          const window::Options& opt) {
  flash_backward_into<T>(fn, grad, q, k, v, grad_out, saved, window_options(opt, fn));
}

}  // namespace detail
MIXATTN_END_NAMESPACE
