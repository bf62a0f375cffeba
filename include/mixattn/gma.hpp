// mixattn/gma.hpp — Gaussian Mixture Attention (SPEC.md section 1), forward and backward.
//
// Queries and keys are routed through one shared diagonal Gaussian mixture of K components;
// the attention is Gamma_Q Gamma_K^T, a rank-K factorisation that is never formed:
//   bidirectional  O = (Gamma_Q (Gamma_K^T V)) / (Gamma_Q (Gamma_K^T 1) + eps)     O((N+M) K)
//   causal         the same with prefix sums, chunk-wise (SPEC 1.4)
// Thread safety: every function is reentrant and may run concurrently on different threads
// (each with its own Saved and Grad). forward without `saved` reuses per-thread (thread_local)
// scratch, which stays allocated for the thread's lifetime. The State overloads of forward
// (decoding) also keep one small per-thread wide scratch (d_v + 2K) and write only the State
// they are given: distinct States may be continued concurrently. GEMMs use the threads Eigen
// is configured with.
//
// Training loops: forward_into / backward_into write into caller-owned outputs and keep their
// working memory in Saved and Grad (GEMM packing buffers included), so a step whose shapes
// repeat performs no heap allocation, the State overloads (continued causal pieces, grad_state_out)
// included; forward / backward return fresh objects and call them.
//
// Every entry point has a defaulted template parameter Arch (the SIMD instruction set the
// translation unit is compiled for, detail/common/simd.hpp); callers never write it.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/detail/gma/backward.hpp"
#include "mixattn/detail/gma/common.hpp"
#include "mixattn/detail/gma/forward.hpp"
#include "mixattn/detail/gma/log_density.hpp"
#include "mixattn/gma_types.hpp"

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace gma {

/// A mixture reduced once to what every evaluation of its responsibilities needs: variances,
/// log-priors and offsets (in the wide type) and the SIMD kernel's packed coefficients for Arch.
/// Build it once and call responsibilities(prepared, x) or the decoding forward(prepared, ...,
/// state) many times, e.g. one token at a time: each call then costs O(K r) per row instead of
/// also rebuilding the O(K r) constants (K r softplus and logs, more than the token itself).
/// It is a snapshot: after changing the mixture, prepare it again (backward compares the mixture
/// it is given against mixture_fingerprint()). Immutable, so one Prepared may serve concurrent
/// calls. Arch is the SIMD instruction set (never written by callers), so a prepared mixture
/// cannot meet another instruction set's kernel.
template <class T, class Arch = detail::simd_arch>
class Prepared {
  static_assert(detail::refuse_arguments<T>(), "see the message above");

 public:
  using W = detail::wide_t<T>;
  /// Validates the mixture (shapes; finite values unless check_finite is false) and reduces it.
  explicit Prepared(const Mixture<T>& mix, bool check_finite = true);
  Index components() const { return packed_.components; }  // K
  Index dim() const { return packed_.dim; }                // r
  const detail::MixtureConstants<W>& constants() const { return constants_; }
  const detail::PackedDensity<T>& packed() const { return packed_; }
  /// Position-sensitive fingerprint of the mixture it was prepared from (detail::Fingerprint).
  std::uint64_t mixture_fingerprint() const { return mixture_fingerprint_; }

 private:
  detail::MixtureConstants<W> constants_;
  detail::PackedDensity<T> packed_;
  std::uint64_t mixture_fingerprint_ = 0;
};

template <class T, class Arch>
Prepared<T, Arch>::Prepared(const Mixture<T>& mix, bool check_finite) {
  detail::gma_check_mixture(mix, "mixattn::gma::Prepared", check_finite);
  constants_ = detail::mixture_constants<W>(mix.mean, mix.var_raw, mix.prior_logit, mix.var_floor);
  packed_ = detail::pack_density<Arch, T>(mix.mean, constants_);
  mixture_fingerprint_ = detail::mixture_fingerprint(mix);
}

/// Responsibilities Gamma (SPEC 1.2) of the rows of x under a prepared mixture: N x K, every
/// row on the simplex. x: N x r, row-major (r = prepared.dim()). Rows far from every component
/// (log-densities beyond T's range) are computed in a wider type; with check_finite, a row that
/// overflows even there throws std::domain_error naming x.
template <class T, class Arch>
Matrix<T> responsibilities(const Prepared<T, Arch>& prepared, const ConstMatrixArg<T>& x,
                           bool check_finite = true) {
  static constexpr const char* fn = "mixattn::gma::responsibilities";
  detail::require(x.cols() == prepared.dim(), fn, "x is ", detail::shape_str(x),
                  " but the mixture has dimension ", prepared.dim(), " (its r: x must have ",
                  prepared.dim(), " columns)");
  if (check_finite) detail::require_finite(x, fn, "x");
  Matrix<T> out(x.rows(), prepared.components());
  detail::gma_gamma_into<Arch, T>(prepared.packed(), x, out.data(), check_finite, fn, "x");
  return out;
}

/// Responsibilities Gamma (SPEC 1.2) of the rows of x: N x K, every row on the simplex.
/// mix: K components of dimension r; x: N x r, row-major. Prepares the mixture on every call:
/// for many small calls, prepare it once (Prepared) and use the overload above.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> responsibilities(const Mixture<T>& mix, const ConstMatrixArg<T>& x,
                           bool check_finite = true) {
  static constexpr const char* fn = "mixattn::gma::responsibilities";
  detail::gma_check_mixture(mix, fn, check_finite);
  detail::require(x.cols() == mix.dim(), fn, "x is ", detail::shape_str(x),
                  " but the mixture has dimension ", mix.dim(), " (its r: x must have ", mix.dim(),
                  " columns)");
  return responsibilities<T, Arch>(Prepared<T, Arch>(mix, false), x, check_finite);
}

/// GMA forward (SPEC 1.3 bidirectional, 1.4 causal).
/// q: N x r, k: M x r, v: M x d_v (M == N when causal). Returns N x d_v.
/// If `saved` is given it receives what backward needs (O((N + M) K + N d_v)).
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const Mixture<T>& mix, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt = {}, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::gma_forward_into<Arch, T>, "mixattn::gma::forward",
                                     saved, mix, q, k, v, opt);
}

/// GMA forward (SPEC 1.3 bidirectional, 1.4 causal) into caller-owned memory.
/// q: N x r, k: M x r, v: M x d_v (M == N when causal); out is resized to N x d_v.
/// If `saved` is given it receives what backward needs (O((N + M) K + N d_v)) and keeps the
/// call's working memory: with a reused `out` and `saved`, a call whose shapes repeat performs
/// no heap allocation. Without `saved`, this thread's scratch (kept for the thread's lifetime)
/// is used instead.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const Mixture<T>& mix, const ConstMatrixArg<T>& q,
                  const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v, const Options& opt,
                  Saved<detail::identity_t<T>>* saved) {
  detail::gma_forward_into<Arch, T>("mixattn::gma::forward_into", out, mix, q, k, v, opt, saved);
}

/// The value-returning form of the above. Returns n x d_v.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const Mixture<T>& mix, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt, State<T>& state,
                  Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::gma_forward_state_into<Arch, T>,
                                     "mixattn::gma::forward", saved, mix, q, k, v, opt, state);
}

/// Causal GMA forward continuing `state` (SPEC 1.4) into caller-owned memory: q, k (n x r) and
/// v (n x d_v) are the next n tokens after state.tokens_seen; out is resized to n x d_v and
/// `state` advances past them. Feeding a sequence in any pieces (down to one token) gives the
/// one-call outputs up to rounding. opt.causal must be true; state must be K x d_v
/// (State<T>::empty(K, d_v)). `saved` receives what backward needs, the start state included
/// (O(n K + n d_v + K d_v)), and keeps the working memory: with a reused `out` and `saved`, a
/// call whose shapes repeat performs no heap allocation. The mixture is prepared once and kept
/// in `state` (State::prepared_mixture) while it stays the same bit for bit, so decoding token by
/// token through this overload costs about what the Prepared overload costs; a changed mixture is
/// prepared again. On a throw (bad shapes or options: invalid_argument; non-finite q, k, v or
/// state: domain_error) `state`'s value is untouched.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const Mixture<T>& mix, const ConstMatrixArg<T>& q,
                  const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v, const Options& opt,
                  State<T>& state, Saved<detail::identity_t<T>>* saved) {
  detail::gma_forward_state_into<Arch, T>("mixattn::gma::forward_into", out, mix, q, k, v, opt,
                                          state, saved);
}

/// The value-returning form of the above. Returns n x d_v.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const Prepared<T, Arch>& prep, const ConstMatrixArg<T>& q,
                  const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v, const Options& opt,
                  State<T>& state, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::gma_forward_prepared_into<Arch, T, Prepared<T, Arch>>,
                                     "mixattn::gma::forward", saved, prep, q, k, v, opt, state);
}

/// The same with the mixture prepared once (Prepared): the decode path, which spends per token
/// only the responsibilities of q and k and one pass over the state (O(K (r + d_v))).
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const Prepared<T, Arch>& prep, const ConstMatrixArg<T>& q,
                  const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v, const Options& opt,
                  State<T>& state, Saved<detail::identity_t<T>>* saved) {
  detail::gma_forward_prepared_into<Arch, T>("mixattn::gma::forward_into", out, prep, q, k, v, opt,
                                             state, saved);
}

/// GMA backward (SPEC 1.5): gradients of sum(grad_out . forward(mix, q, k, v)) with respect to
/// q (N x r), k (M x r), v (M x d_v) and the mixture's mean, var_raw, prior_logit.
/// grad_out: N x d_v; saved: filled by forward with the same inputs and options.
/// When saved comes from the State overload of forward, grad.state also receives the gradient
/// with respect to the state that call continued (dS0, dz0); the end state is taken to have
/// no further use (see the overload with grad_state_out for pieces of a longer sequence).
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Grad<T> backward(const Mixture<T>& mix, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                 const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                 const Saved<T>& saved, const Options& opt = {}) {
  return backward<T, Arch>(mix, q, k, v, grad_out, saved, opt,
                           static_cast<const StateGrad<T>*>(nullptr));
}

/// Backward of a piece of a longer sequence (SPEC 1.5, pieces): saved comes from the State
/// overload of forward; grad_state_out (optional, K x d_v and K) is dL/d(end state), which the
/// next piece's backward returned as its grad.state. Adds the end state's use to the keys and
/// values of this piece and writes grad.state = dL/d(start state). Running the pieces' backwards
/// in reverse, each fed its successor's grad.state, gives the gradients of one call over the
/// whole sequence.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Grad<T> backward(const Mixture<T>& mix, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                 const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                 const Saved<T>& saved, const Options& opt, const StateGrad<T>* grad_state_out) {
  return detail::returned_backward<Grad<T>>(&detail::gma_backward_into<Arch, T>,
                                            "mixattn::gma::backward", mix, q, k, v, grad_out, saved,
                                            opt, grad_state_out);
}

/// GMA backward (SPEC 1.5) into caller-owned gradients: the same as backward, with grad's
/// matrices resized (no-op when shapes repeat) and its scratch reused, so a call whose shapes
/// repeat performs no heap allocation.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const Mixture<T>& mix, const ConstMatrixArg<T>& q,
                   const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                   const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::gma_backward_into<Arch, T>("mixattn::gma::backward_into", grad, mix, q, k, v, grad_out,
                                     saved, opt, static_cast<const StateGrad<T>*>(nullptr));
}

/// Backward of a piece of a longer sequence into caller-owned gradients (see the backward
/// overload with grad_state_out); grad_state_out may be grad.state itself, so one Grad can run
/// the pieces' backwards in reverse, each fed the grad.state its successor left.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const Mixture<T>& mix, const ConstMatrixArg<T>& q,
                   const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                   const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt,
                   const StateGrad<detail::identity_t<T>>* grad_state_out) {
  detail::gma_backward_into<Arch, T>("mixattn::gma::backward_into", grad, mix, q, k, v, grad_out,
                                     saved, opt, grad_state_out);
}

}  // namespace gma

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_GMA_WORKERS(T)                                                                  \
  MIXATTN_TEMPLATE_INSTANCE void gma_forward_into<simd_arch, T>(                                \
      const char*, Matrix<T>&, const gma::Mixture<T>&, const ConstMatrixRef<T>&,                \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const gma::Options&, gma::Saved<T>*); \
  MIXATTN_TEMPLATE_INSTANCE void gma_forward_continued<simd_arch, T>(                           \
      const char*, Matrix<T>&, const PackedDensity<T>&, const ConstMatrixRef<T>&,               \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const gma::Options&, gma::State<T>&,  \
      gma::Saved<T>*, std::uint64_t);                                                           \
  MIXATTN_TEMPLATE_INSTANCE void gma_backward_into<simd_arch, T>(                               \
      const char*, gma::Grad<T>&, const gma::Mixture<T>&, const ConstMatrixRef<T>&,             \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,             \
      const gma::Saved<T>&, const gma::Options&, const gma::StateGrad<T>*);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_GMA_WORKERS)
#undef MIXATTN_GMA_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
