// mixattn/ovq.hpp — Online Vector-Quantized attention (SPEC.md §2), forward and backward.
//
// One head keeps a constant-size memory: a dictionary of at most N_max centroids (running means
// of unit-norm keys and of the same tokens' values, with counts) plus the keys and values of the
// block that is not complete yet. Queries of block b attend, in one joint softmax, to the
// dictionary as it stood before block b (with a log-count bias) and causally to the block's own
// raw keys; each complete block is then absorbed by one online k-means step (SPEC 2.3).
//
// Token positions are global (state.tokens_seen + row) and blocks are aligned to multiples of
// options.block, so a call may start or end mid-block: the unfinished block is carried in the
// state. Splitting a sequence into any pieces gives the same outputs up to rounding and the
// same final state, bit for bit (the absorption of a block reads only that block and the
// dictionary, always with the same shapes). backward differentiates a call with respect to its
// start state too (Grad::state, a StateGrad) and takes the end state's gradient, so a sequence
// also trains piecewise, the pieces' backwards run in reverse (SPEC 2.4, across pieces).
//
// Cost per token: O((N_max + C) (r + d_v)) flops, all of it GEMMs; memory O(N_max (r + d_v)).
//
// Thread safety: calls on distinct states may run concurrently; a State must not be shared by
// concurrent calls. Each call is single-threaded (Eigen's own threading aside).
// The `_into` forms write into caller-owned outputs, states, Saved and Grad and keep their
// working memory there: a training step from a constant start state (forward_into with start and
// next) whose shapes repeat performs no heap allocation.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/ovq/backward.hpp"
#include "mixattn/detail/ovq/forward.hpp"
#include "mixattn/ovq_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace ovq {

/// OVQ attention over q, k, v as the continuation of `state` (SPEC 2.2-2.3), which it updates.
///   q: T x r, k: T x r, v: T x d_v (row-major, rows are tokens; r, d_v fixed by the state)
///   beta: scale factor (> 0), logits use s = beta sqrt(r)
///   returns T x d_v.
/// `saved` (optional) receives what backward needs: O(N_max (r + d_v) + T) memory.
/// Throws std::invalid_argument on bad shapes, options or an inconsistent state, and
/// std::domain_error on non-finite input (options.check_finite); `state` is untouched then.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, detail::identity_t<T> beta, const Options& opt,
                  State<T>& state, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::ovq_forward_into<T>, "mixattn::ovq::forward", saved,
                                     q, k, v, beta, opt, state, state);
}

/// forward into a caller-owned `out` (resized to T x d_v); `state` is continued and updated as
/// in forward, and `saved` keeps the call's working memory, so calls whose shapes repeat reuse
/// it. Without `saved`, per-thread scratch is used.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, detail::identity_t<T> beta, const Options& opt,
                  State<T>& state, Saved<detail::identity_t<T>>* saved) {
  detail::ovq_forward_into<T>("mixattn::ovq::forward_into", out, q, k, v, beta, opt, state, state,
                              saved);
}

/// forward_into from a constant `start` state, writing the final state into `next` (its capacity
/// kept when its shapes repeat). The training-loop form: every step starts from the same state
/// (usually State::empty) and, with reused out, next and saved, allocates nothing in steady
/// state. `next` may be `start`.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, detail::identity_t<T> beta, const Options& opt,
                  const State<T>& start, State<T>& next, Saved<detail::identity_t<T>>* saved) {
  detail::ovq_forward_into<T>("mixattn::ovq::forward_into", out, q, k, v, beta, opt, start, next,
                              saved);
}

/// Gradients of a scalar loss L through forward (SPEC 2.4), given grad_out = dL/d(output).
///   q, k, v: the forward's inputs (T x r, T x r, T x d_v); beta as in forward;
///   grad_out: T x d_v; saved: filled by that forward call; opt: its options (block,
///   count_bias and norm_eps must match; grad_through_dictionary chooses the mode).
/// Assignments, seeds, counts and the count bias are constants. With grad_through_dictionary the
/// gradient also flows through the running means into earlier tokens of the call:
///   dD_old[n] += (c_old / c_new) dD_new[n],   dk_hat_j += dD_k,new[n] / c_new  (j -> n);
/// otherwise nothing passes a block's update (each block reads its dictionary as constant keys
/// and values, except that block 0 reads the start state's).
/// grad.state receives dL/d(the state the call started from) (its keys, values, pending_keys
/// and pending_values; zero-size parts for State::empty); the end state is taken to have no
/// further use (see the overload with grad_state_out for pieces of a longer sequence).
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 detail::identity_t<T> beta, const ConstMatrixArg<T>& grad_out,
                 const Saved<T>& saved, const Options& opt) {
  return detail::returned_backward<Grad<T>>(&detail::ovq_backward_into<T>, "mixattn::ovq::backward",
                                            q, k, v, beta, grad_out, saved, opt,
                                            static_cast<const StateGrad<T>*>(nullptr));
}

/// Backward of a piece of a longer sequence (SPEC 2.4, across pieces): as backward, with
/// grad_state_out (optional) = dL/d(the state the call ended in), which the next piece's
/// backward returned as its grad.state: keys and values N_end x r and N_end x d_v, pending_keys
/// and pending_values P_end x r and P_end x d_v, the end state's shapes. Its dictionary part
/// flows back through the running means (only when no block completed in the call if the
/// gradient is stopped at the dictionary), its pending part into the tokens those rows copy.
/// Running the pieces' backwards in reverse, each fed its successor's grad.state, gives the
/// gradients of one call over the whole sequence. Throws std::invalid_argument on other shapes
/// or when grad_state_out is the gradient of another state than this call's end state.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 detail::identity_t<T> beta, const ConstMatrixArg<T>& grad_out,
                 const Saved<T>& saved, const Options& opt,
                 const StateGrad<detail::identity_t<T>>* grad_state_out) {
  return detail::returned_backward<Grad<T>>(&detail::ovq_backward_into<T>, "mixattn::ovq::backward",
                                            q, k, v, beta, grad_out, saved, opt, grad_state_out);
}

/// backward into caller-owned gradients (resized; the working memory is kept in `grad`, so calls
/// whose shapes repeat allocate nothing).
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, detail::identity_t<T> beta,
                   const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::ovq_backward_into<T>("mixattn::ovq::backward_into", grad, q, k, v, beta, grad_out, saved,
                               opt, static_cast<const StateGrad<T>*>(nullptr));
}

/// Backward of a piece into caller-owned gradients (see the backward overload with
/// grad_state_out); grad_state_out may be grad.state itself, so one Grad can run the pieces'
/// backwards in reverse, each fed the grad.state its successor left.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, detail::identity_t<T> beta,
                   const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt,
                   const StateGrad<detail::identity_t<T>>* grad_state_out) {
  detail::ovq_backward_into<T>("mixattn::ovq::backward_into", grad, q, k, v, beta, grad_out, saved,
                               opt, grad_state_out);
}

}  // namespace ovq

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_OVQ_WORKERS(T)                                                                \
  MIXATTN_TEMPLATE_INSTANCE void ovq_forward_into<T>(                                         \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,            \
      const ConstMatrixRef<T>&, T, const ovq::Options&, const ovq::State<T>&, ovq::State<T>&, \
      ovq::Saved<T>*);                                                                        \
  MIXATTN_TEMPLATE_INSTANCE void ovq_backward_into<T>(                                        \
      const char*, ovq::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,         \
      const ConstMatrixRef<T>&, T, const ConstMatrixRef<T>&, const ovq::Saved<T>&,            \
      const ovq::Options&, const ovq::StateGrad<T>*);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_OVQ_WORKERS)
#undef MIXATTN_OVQ_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
