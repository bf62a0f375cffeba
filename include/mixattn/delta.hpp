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
// kept for the thread's lifetime. GEMMs use the threads Eigen is configured with.
//
// Training loops: forward_into / backward_into write into caller-owned outputs and keep their
// working memory in Saved and Grad (GEMM packing buffers included): a step whose shapes repeat
// performs no heap allocation. forward / backward return fresh results and run the same bodies.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/delta_types.hpp"
#include "mixattn/detail/checks.hpp"
#include "mixattn/detail/delta/backward.hpp"
#include "mixattn/detail/delta/checks.hpp"
#include "mixattn/detail/delta/chunk.hpp"
#include "mixattn/detail/delta/forward.hpp"
#include "mixattn/detail/fingerprint.hpp"
#include "mixattn/detail/refuse.hpp"
#include "mixattn/detail/value_form_scratch.hpp"

#include <Eigen/Core>

#include <type_traits>
#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Whether A is an Eigen object (a VectorBlock's EigenBase is its Block's, which
/// detail::is_eigen, an is_base_of test on EigenBase<A>, does not see).
template <class D>
std::true_type delta_eigen_test(const Eigen::EigenBase<D>*);
std::false_type delta_eigen_test(...);
template <class A>
constexpr bool delta_is_eigen = decltype(delta_eigen_test(std::declval<const A*>()))::value;
/// The type Eigen binds A as (its EigenBase's Derived: a VectorBlock binds as its Block).
template <class D>
D delta_eigen_derived(const Eigen::EigenBase<D>*);

/// True when A would bind to Eigen::Ref<const Vector<T>> only through a hidden copy: stored data
/// of scalar T that is strided (a column of a row-major matrix, a row of a column-major one).
template <class T, class A, class = void>
struct delta_vector_copied : std::false_type {};
template <class T, class A>
struct delta_vector_copied<T, A, std::enable_if_t<delta_is_eigen<A>>> {
  using D = decltype(delta_eigen_derived(std::declval<const A*>()));
  static constexpr bool value =
      std::is_same<typename D::Scalar, T>::value && bool(int(D::Flags) & Eigen::DirectAccessBit) &&
      !bool(Eigen::internal::traits<Eigen::Ref<const Vector<T>>>::template match<
            D>::MatchAtCompileTime);
};

/// The type of g and beta (delta::ConstVectorArg<T>): an Eigen::Ref<const Vector<T>> whose
/// converting constructor refuses, where the argument binds, a strided vector (copied on every
/// call). A Vector<T>, a segment of one, a Map or a row of a row-major matrix bind in place.
template <class T>
class DeltaVectorRef : public Eigen::Ref<const Vector<T>> {
  using Base = Eigen::Ref<const Vector<T>>;

 public:
  DeltaVectorRef(const Base& ref) : Base(ref) {}  // NOLINT(google-explicit-constructor)
  template <class A, std::enable_if_t<delta_is_eigen<A>, int> = 0>
  DeltaVectorRef(const A& arg) : Base(arg) {  // NOLINT(google-explicit-constructor)
    static_assert(!delta_vector_copied<T, A>::value,
                  "mixattn reads g and beta in place; this vector is strided (a column of a "
                  "row-major matrix or a row of a column-major one) and would be copied on every "
                  "call. Pass a contiguous vector: a Vector<T>, a segment of one, a Map, or a row "
                  "of a row-major matrix");
  }
};

/// Pieces of up to this many rows continuing a State without a record run the recurrence token
/// by token on the wide state (SPEC 9.1) instead of the chunked form.
constexpr Index delta_recurrent_rows = 16;

/// forward's body (`fn` names the entry point in messages).
template <class T>
void delta_forward(const char* fn, Matrix<T>& out, const DeltaInputs<T>& in,
                   const delta::Options& opt, delta::State<T>* state, delta::Saved<T>* saved) {
  using W = wide_t<T>;
  delta_check_inputs<T>(fn, in, opt);
  const Index N = in.q.rows(), dk = in.q.cols(), dv = in.v.cols();
  if (state) delta_check_state<T>(fn, *state, dk, dv, N, opt);
  const DeltaConfig cfg = delta_config(opt, dk);
  if (saved) saved->valid = false;  // until this call has filled it
  DeltaScratch<T>& s = saved ? saved->scratch : value_form_scratch<DeltaScratch<T>>();
  out.resize(N, dv);
  if (state)
    s.sw = state->S;
  else
    s.sw.setZero(dk, dv);
  if (!saved && state && N <= delta_recurrent_rows) {
    delta_recurrent_forward<T>(in, cfg, out, s.sw, s.rows);
  } else if (N > 0) {
    Vector<T>& inv_q = saved ? saved->inv_norm_q : s.inv_q;
    Vector<T>& inv_k = saved ? saved->inv_norm_k : s.inv_k;
    if (cfg.normalize) {
      delta_inverse_norms<T>(in.q, cfg.norm_eps, inv_q);
      delta_inverse_norms<T>(in.k, cfg.norm_eps, inv_k);
    } else {
      inv_q.resize(0);
      inv_k.resize(0);
    }
    if (saved) saved->delta.resize(N, dv);
    if (saved && state) saved->start_S = state->S;  // before the sweep overwrites nothing of it
    delta_forward_sweep<T>(in, cfg, inv_q, inv_k, out, saved ? &saved->delta : nullptr,
                           saved && opt.keep_states ? &saved->states : nullptr, s);
  }
  if (opt.check_finite) {
    require_finite_result(out, fn, "the output", "q, k, v or the state is");
    if (state) require_finite_result(s.sw, fn, "the end state", "q, k, v or the state is");
  }
  if (saved) {
    delta::Saved<T>& rec = *saved;
    if (N == 0) rec.delta.resize(0, dv);
    if (N == 0 || !cfg.normalize) {
      rec.inv_norm_q.resize(cfg.normalize ? N : 0);
      rec.inv_norm_k.resize(cfg.normalize ? N : 0);
    }
    if (!opt.keep_states) rec.states.resize(0, dv);
    rec.chunk = cfg.chunk;
    rec.scale = cfg.scale;
    rec.normalize = cfg.normalize;
    rec.norm_eps = cfg.norm_eps;
    rec.keep_states = opt.keep_states;
    delta_fingerprint_inputs<T>(in, rec.fingerprint);
    rec.continued = state != nullptr;
    if (state) {
      if (N == 0) rec.start_S = state->S;
      rec.fingerprint.start_state = fingerprint(rec.start_S);
      rec.end_fingerprint = fingerprint(s.sw);
    } else {
      rec.start_S.resize(0, 0);
      rec.fingerprint.start_state = 0;
      rec.end_fingerprint = 0;
    }
    rec.valid = true;
  }
  if (state) {
    state->S = s.sw;
    state->tokens_seen += N;
  }
  static_cast<void>(sizeof(W));
}

/// backward's body (`fn` names the entry point in messages).
template <class T>
void delta_backward(const char* fn, delta::Grad<T>& grad, const DeltaInputs<T>& in,
                    const ConstMatrixRef<T>& grad_out, const delta::Saved<T>& saved,
                    const delta::Options& opt, const delta::StateGrad<T>* grad_state_out) {
  delta_check_backward<T>(fn, in, grad_out, saved, opt, grad_state_out);
  const Index N = in.q.rows(), dk = in.q.cols(), dv = in.v.cols();
  const DeltaConfig cfg = delta_config(opt, dk);
  DeltaScratch<T>& s = grad.scratch;
  if (grad_state_out)
    s.dsw = grad_state_out->S;  // first: it may be grad.state itself
  else
    s.dsw.setZero(dk, dv);
  grad.q.resize(N, dk);
  grad.k.resize(N, dk);
  grad.v.resize(N, dv);
  grad.g.resize(N);
  grad.beta.resize(N);
  if (N > 0) {
    const Matrix<T>* states = &saved.states;
    if (!saved.keep_states) {
      delta_size_chunk_buffers<T>(s, std::min(cfg.chunk, N), dk, dv);
      if (saved.continued)
        s.sw = saved.start_S;
      else
        s.sw.setZero(dk, dv);
      delta_recompute_states<T>(in, cfg, saved.inv_norm_q, saved.inv_norm_k, saved.delta, s.states,
                                s);
      states = &s.states;
    }
    delta_backward_sweep<T>(in, cfg, saved.inv_norm_q, saved.inv_norm_k, grad_out, saved.delta,
                            *states, grad, s);
    delta_normalize_backward<T>(in.q, cfg.normalize ? &saved.inv_norm_q : nullptr,
                                static_cast<T>(cfg.scale), grad.q);
    delta_normalize_backward<T>(in.k, cfg.normalize ? &saved.inv_norm_k : nullptr, T(1), grad.k);
  }
  if (saved.continued) {
    grad.state.S = s.dsw;
    grad.state.state_fingerprint = saved.fingerprint.start_state;
  } else {
    grad.state.S.resize(0, 0);
    grad.state.state_fingerprint = 0;
  }
  if (opt.check_finite) {
    const char* culprit = "q, k, v, grad_out or the state is";
    require_finite_result(grad.q, fn, "the gradient of q", culprit);
    require_finite_result(grad.k, fn, "the gradient of k", culprit);
    require_finite_result(grad.v, fn, "the gradient of v", culprit);
    require_finite_result(grad.g, fn, "the gradient of g", culprit);
    require_finite_result(grad.beta, fn, "the gradient of beta", culprit);
    require_finite_result(grad.state.S, fn, "the gradient of the start state", culprit);
  }
}

}  // namespace detail

namespace delta {

/// g and beta: N-vectors read in place (Vector<T>, a segment, a Map, a row of a row-major
/// matrix); a strided vector is refused at compile time.
template <class T>
using ConstVectorArg = detail::DeltaVectorRef<typename detail::identity<T>::type>;

/// Gated delta rule forward (SPEC 9.1, 9.2) into caller-owned memory: out is resized to N x d_v.
/// q, k: N x d_k; v: N x d_v (row-major); g (log decay, <= 0) and beta (in [0, 1]): N.
/// state: when given (d_k x d_v, State<T>::empty(d_k, d_v) for a fresh sequence), the call starts
/// from state->S and leaves the end state there (tokens_seen advances by N): any split of a
/// sequence gives the one-call outputs up to rounding; without it the start state is zero.
/// saved: when given, receives what backward needs and keeps the working memory, so a call whose
/// shapes repeat performs no heap allocation; without it this thread's scratch is used.
/// Throws std::invalid_argument for bad shapes or options; std::domain_error for g > 0 or beta
/// outside [0, 1], and with check_finite for non-finite inputs or state or an output that
/// overflows T. On a throw the state is untouched.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstVectorArg<T>& g,
                  const ConstVectorArg<T>& beta, const Options& opt,
                  State<typename detail::identity<T>::type>* state,
                  Saved<typename detail::identity<T>::type>* saved) {
  detail::delta_forward<T>("mixattn::delta::forward_into", out, {q, k, v, g, beta}, opt, state,
                           saved);
}

/// Gated delta rule forward (SPEC 9.1, 9.2), as forward_into. Returns N x d_v. T is not deduced:
/// write delta::forward<float>(q, k, v, g, beta, opt, &state, &saved).
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstVectorArg<T>& g,
                  const ConstVectorArg<T>& beta, const Options& opt = {}, State<T>* state = nullptr,
                  Saved<T>* saved = nullptr) {
  Matrix<T> out;
  const detail::LentScratch<detail::DeltaScratch<T>> lent(saved ? &saved->scratch : nullptr);
  detail::delta_forward<T>("mixattn::delta::forward", out, {q, k, v, g, beta}, opt, state, saved);
  return out;
}

/// Gated delta rule backward (SPEC 9.3) into caller-owned gradients (resized; scratch kept in
/// grad, so a call whose shapes repeat allocates nothing): the gradients of
/// sum(grad_out o forward(...)) + <grad_state_out, end state> with respect to q, k (N x d_k),
/// v (N x d_v), g and beta (N), and, when saved comes from a forward that continued a State, its
/// start state (grad.state, d_k x d_v; else empty). grad_out: N x d_v. saved: filled by forward
/// with the same inputs and options. grad_state_out (optional, d_k x d_v): dL/d(end state), the
/// next piece's grad.state; it may be grad.state itself. Running the pieces' backwards in reverse,
/// each given its successor's grad.state, gives the gradients of one call over the sequence.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstVectorArg<T>& g,
                   const ConstVectorArg<T>& beta, const ConstMatrixArg<T>& grad_out,
                   const Saved<typename detail::identity<T>::type>& saved, const Options& opt,
                   const StateGrad<typename detail::identity<T>::type>* grad_state_out = nullptr) {
  detail::delta_backward<T>("mixattn::delta::backward_into", grad, {q, k, v, g, beta}, grad_out,
                            saved, opt, grad_state_out);
}

/// Gated delta rule backward (SPEC 9.3), as backward_into. Returns fresh gradients.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstVectorArg<T>& g, const ConstVectorArg<T>& beta,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt = {},
                 const StateGrad<typename detail::identity<T>::type>* grad_state_out = nullptr) {
  Grad<T> grad;
  {  // the working memory is this thread's: the returned gradient carries none
    const detail::LentScratch<detail::DeltaScratch<T>> lent(&grad.scratch);
    detail::delta_backward<T>("mixattn::delta::backward", grad, {q, k, v, g, beta}, grad_out, saved,
                              opt, grad_state_out);
  }
  return grad;
}

}  // namespace delta

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form (core.hpp: compiling the operators once).
namespace detail {
#define MIXATTN_DELTA_WORKERS(T)                                                                  \
  MIXATTN_TEMPLATE_INSTANCE void delta_forward<T>(const char*, Matrix<T>&, const DeltaInputs<T>&, \
                                                  const delta::Options&, delta::State<T>*,        \
                                                  delta::Saved<T>*);                              \
  MIXATTN_TEMPLATE_INSTANCE void delta_backward<T>(                                               \
      const char*, delta::Grad<T>&, const DeltaInputs<T>&, const ConstMatrixRef<T>&,              \
      const delta::Saved<T>&, const delta::Options&, const delta::StateGrad<T>*);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_DELTA_WORKERS)
#undef MIXATTN_DELTA_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
