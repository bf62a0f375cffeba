// mixattn/ssd.hpp — Mamba2's state-space duality layer (SSD; Dao & Gu 2024), SPEC.md section 10,
// forward and backward, with a state continued over pieces of a sequence.
//
// Per head, a state h (d_state x d_head) is decayed and written by each token, and read:
//   Delta_t = softplus(dt_t + dt_bias),  h_t = e^(Delta_t A) h_(t-1) + B_t (Delta_t x_t)^T,
//   y_t = h_t^T C_t + D x_t,
// with A <= 0 and D scalars of the head. Computed chunk-wise (SPEC 10.2): inside a chunk of C
// rows the dual, attention-like form Y = (C B^T o L) U + diag(e^gamma) C H + D X in matrix
// products; across chunks the state. O(N (C (d_state + d_head) + 2 d_state d_head)) work,
// nothing N x N is formed. A short piece continuing a State without a record runs the recurrence
// token by token (decoding).
//
// Thread safety: every function is reentrant and distinct calls may run concurrently on
// distinct records and States. A forward without `saved` works in this thread's own scratch,
// and the value-returning forms in this thread's working memory, kept for the thread's lifetime.
// GEMMs use the threads Eigen is configured with.
//
// Training loops: forward_into / backward_into write into caller-owned outputs and keep their
// working memory in Saved and Grad (GEMM packing buffers included): a step whose shapes repeat
// performs no heap allocation. forward / backward return fresh results and run the same bodies.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/vector_arg.hpp"
#include "mixattn/detail/ssd/backward.hpp"
#include "mixattn/detail/ssd/forward.hpp"
#include "mixattn/ssd_types.hpp"

#include <Eigen/Core>

MIXATTN_BEGIN_NAMESPACE
namespace ssd {

/// dt: an N-vector read in place (Vector<T>, a segment, a Map, a row of a row-major matrix); a
/// strided vector is refused at compile time.
template <class T>
using ConstVectorArg = detail::ConstVectorArgRef<typename detail::identity<T>::type>;

/// SSD forward (SPEC 10.1, 10.2). x: N x d_head; dt (the raw step, before dt_bias and the
/// softplus): N; A (<= 0) and D: the head's scalars; B, C: N x d_state (row-major). Returns
/// N x d_head. state: when given (d_state x d_head, State<T>::empty(d_state, d_head) for a fresh
/// sequence), the call starts from state->h and leaves the end state there (tokens_seen advances
/// by N): any split of a sequence gives the one-call outputs up to rounding; without it the start
/// state is zero. saved: when given, receives what backward needs. T is not deduced from the
/// matrices: ssd::forward<float>(x, dt, A, B, C, D). Throws std::invalid_argument for bad shapes
/// or options; std::domain_error for A > 0 or, without the softplus, dt + dt_bias < 0, and with
/// check_finite for non-finite inputs or state or an output that overflows T. On a throw the
/// state is untouched.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& x, const ConstVectorArg<T>& dt, detail::identity_t<T> A,
                  const ConstMatrixArg<T>& B, const ConstMatrixArg<T>& C, detail::identity_t<T> D,
                  const Options& opt = {}, State<T>* state = nullptr, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::ssd_forward_into<T>, "mixattn::ssd::forward", saved,
                                     x, dt, A, B, C, D, opt, state);
}

/// forward into a caller-owned `out` (resized to N x d_head) and record: the result of
/// forward(x, dt, A, B, C, D, opt, state, saved). With a reused `out` and `saved` (or none: this
/// thread's scratch), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& x, const ConstVectorArg<T>& dt,
                  detail::identity_t<T> A, const ConstMatrixArg<T>& B, const ConstMatrixArg<T>& C,
                  detail::identity_t<T> D, const Options& opt, State<detail::identity_t<T>>* state,
                  Saved<detail::identity_t<T>>* saved) {
  detail::ssd_forward_into<T>("mixattn::ssd::forward_into", out, x, dt, A, B, C, D, opt, state,
                              saved);
}

/// SSD backward (SPEC 10.3): the gradients of sum(grad_out o forward(...)) + <grad_state_out,
/// end state> with respect to x (N x d_head), dt (N, through dt_bias and the softplus), A, B, C
/// (N x d_state), D, dt_bias (the sum of dt's gradient) and, when saved comes from a forward
/// that continued a State, its start state (grad.state, d_state x d_head; else empty). grad_out:
/// N x d_head. saved: filled by forward with the same inputs and options. grad_state_out
/// (optional, d_state x d_head): dL/d(end state), the next piece's grad.state. Running the
/// pieces' backwards in reverse, each given its successor's grad.state, gives the gradients of
/// one call over the sequence.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& x, const ConstVectorArg<T>& dt, detail::identity_t<T> A,
                 const ConstMatrixArg<T>& B, const ConstMatrixArg<T>& C, detail::identity_t<T> D,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt = {},
                 const StateGrad<detail::identity_t<T>>* grad_state_out = nullptr) {
  return detail::returned_backward<Grad<T>>(&detail::ssd_backward_into<T>, "mixattn::ssd::backward",
                                            x, dt, A, B, C, D, grad_out, saved, opt,
                                            grad_state_out);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(x, dt, A, B, C, D, grad_out, saved, opt, grad_state_out), allocating nothing when
/// shapes repeat. grad_state_out may be grad.state itself.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& x, const ConstVectorArg<T>& dt,
                   detail::identity_t<T> A, const ConstMatrixArg<T>& B, const ConstMatrixArg<T>& C,
                   detail::identity_t<T> D, const ConstMatrixArg<T>& grad_out,
                   const Saved<detail::identity_t<T>>& saved, const Options& opt,
                   const StateGrad<detail::identity_t<T>>* grad_state_out = nullptr) {
  detail::ssd_backward_into<T>("mixattn::ssd::backward_into", grad, x, dt, A, B, C, D, grad_out,
                               saved, opt, grad_state_out);
}

}  // namespace ssd

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_SSD_WORKERS(T)                                                                    \
  MIXATTN_TEMPLATE_INSTANCE void ssd_forward_into<T>(                                             \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstVectorRef<T>&, T,             \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, T, const ssd::Options&, ssd::State<T>*, \
      ssd::Saved<T>*);                                                                            \
  MIXATTN_TEMPLATE_INSTANCE void ssd_backward_into<T>(                                            \
      const char*, ssd::Grad<T>&, const ConstMatrixRef<T>&, const ConstVectorRef<T>&, T,          \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, T, const ConstMatrixRef<T>&,            \
      const ssd::Saved<T>&, const ssd::Options&, const ssd::StateGrad<T>*);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_SSD_WORKERS)
#undef MIXATTN_SSD_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
