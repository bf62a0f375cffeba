// mixattn/delta.hpp — the gated delta rule (Gated DeltaNet; Yang, Kautz & Hatamizadeh 2024),
// SPEC.md section 9, forward and backward, with a state continued over pieces of a sequence.
//
// Per head, a state S (d_k x d_v) is decayed, corrected towards each key's value and read:
//   S_t = e^(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T,   o_t = S_t^T q_t * scale
// with q and k L2-normalised inside (Options::normalize). Computed chunk-wise (SPEC 9.2): inside
// a chunk of C rows the WY form, T = (I + A)^-1 by forward substitution and matrix products;
// across chunks the state. O(N (C + d_v) d_k) work, nothing N x N is formed. A short piece
// continuing a State without a record runs the recurrence token by token (decoding).
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
#include "mixattn/delta_types.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/vector_arg.hpp"
#include "mixattn/detail/delta/backward.hpp"
#include "mixattn/detail/delta/forward.hpp"

#include <Eigen/Core>

MIXATTN_BEGIN_NAMESPACE
namespace delta {

/// g and beta: N-vectors read in place (Vector<T>, a segment, a Map, a row of a row-major
/// matrix); a strided vector is refused at compile time.
template <class T>
using ConstVectorArg = detail::ConstVectorArgRef<typename detail::identity<T>::type>;

/// Gated delta rule forward (SPEC 9.1, 9.2). q, k: N x d_k; v: N x d_v (row-major); g (log decay,
/// <= 0) and beta (in [0, 1]): N. Returns N x d_v. state: when given (d_k x d_v,
/// State<T>::empty(d_k, d_v) for a fresh sequence), the call starts from state->S and leaves the
/// end state there (tokens_seen advances by N): any split of a sequence gives the one-call
/// outputs up to rounding; without it the start state is zero. saved: when given, receives what
/// backward needs. T is not deduced from the matrices: delta::forward<float>(q, k, v, g, beta).
/// Throws std::invalid_argument for bad shapes or options; std::domain_error for g > 0 or beta
/// outside [0, 1], and with check_finite for non-finite inputs or state or an output that
/// overflows T. On a throw the state is untouched.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstVectorArg<T>& g,
                  const ConstVectorArg<T>& beta, const Options& opt = {}, State<T>* state = nullptr,
                  Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::delta_forward_into<T>, "mixattn::delta::forward",
                                     saved, q, k, v, g, beta, opt, state);
}

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, g, beta, opt, state, saved). With a reused `out` and `saved` (or none: this
/// thread's scratch), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstVectorArg<T>& g,
                  const ConstVectorArg<T>& beta, const Options& opt,
                  State<typename detail::identity<T>::type>* state,
                  Saved<typename detail::identity<T>::type>* saved) {
  detail::delta_forward_into<T>("mixattn::delta::forward_into", out, q, k, v, g, beta, opt, state,
                                saved);
}

/// Gated delta rule backward (SPEC 9.3): the gradients of sum(grad_out o forward(...)) +
/// <grad_state_out, end state> with respect to q, k (N x d_k), v (N x d_v), g and beta (N), and,
/// when saved comes from a forward that continued a State, its start state (grad.state,
/// d_k x d_v; else empty). grad_out: N x d_v. saved: filled by forward with the same inputs and
/// options. grad_state_out (optional, d_k x d_v): dL/d(end state), the next piece's grad.state.
/// Running the pieces' backwards in reverse, each given its successor's grad.state, gives the
/// gradients of one call over the sequence.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstVectorArg<T>& g, const ConstVectorArg<T>& beta,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt = {},
                 const StateGrad<typename detail::identity<T>::type>* grad_state_out = nullptr) {
  return detail::returned_backward<Grad<T>>(&detail::delta_backward_into<T>,
                                            "mixattn::delta::backward", q, k, v, g, beta, grad_out,
                                            saved, opt, grad_state_out);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, g, beta, grad_out, saved, opt, grad_state_out), allocating nothing when
/// shapes repeat. grad_state_out may be grad.state itself.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstVectorArg<T>& g,
                   const ConstVectorArg<T>& beta, const ConstMatrixArg<T>& grad_out,
                   const Saved<typename detail::identity<T>::type>& saved, const Options& opt,
                   const StateGrad<typename detail::identity<T>::type>* grad_state_out = nullptr) {
  detail::delta_backward_into<T>("mixattn::delta::backward_into", grad, q, k, v, g, beta, grad_out,
                                 saved, opt, grad_state_out);
}

}  // namespace delta

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_DELTA_WORKERS(T)                                                        \
  MIXATTN_TEMPLATE_INSTANCE void delta_forward_into<T>(                                 \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,      \
      const ConstMatrixRef<T>&, const ConstVectorRef<T>&, const ConstVectorRef<T>&,     \
      const delta::Options&, delta::State<T>*, delta::Saved<T>*);                       \
  MIXATTN_TEMPLATE_INSTANCE void delta_backward_into<T>(                                \
      const char*, delta::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const ConstVectorRef<T>&, const ConstVectorRef<T>&,     \
      const ConstMatrixRef<T>&, const delta::Saved<T>&, const delta::Options&,          \
      const delta::StateGrad<T>*);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_DELTA_WORKERS)
#undef MIXATTN_DELTA_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
