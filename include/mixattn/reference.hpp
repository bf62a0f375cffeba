// mixattn/reference.hpp — O(N^2) softmax attention, the exact baseline (SPEC.md §3):
//
//     O = softmax(scale Q K^T + mask) V,   scale default 1/sqrt(r),   causal mask j <= i
//
// Sliding-window causal attention (SPEC.md §7) is the option `window`: query i sees keys
// i - window < j <= i, and the tiled form then skips the key tiles outside every window, O(N w).
//
// Two implementations of the same function, each with its backward:
//   naive_*  materialises the N x M probability matrix: the obvious form, the tests' oracle.
//   flash_*  tiles queries and keys with an online softmax (FlashAttention-2 schedule) and keeps
//            O(N) state: the output and one log-sum-exp per row. The honest speed baseline.
//
// Thread safety: every function is reentrant; distinct calls may run concurrently (the forwards'
// working memory is per thread). Each call is single-threaded (Eigen's own threading aside).
// The `_into` forms write into caller-owned outputs, Saved and Grad and reuse their capacity:
// a training step whose shapes repeat performs no heap allocation.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/reference/backward.hpp"
#include "mixattn/detail/reference/forward.hpp"
#include "mixattn/reference_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace reference {

/// Naive softmax attention (SPEC §3): forms S = (scale Q) K^T (N x M), masks it (causal: j > i is
/// -inf; with options.window w also j <= i - w, SPEC §7), applies a max-subtracted row softmax and
/// returns P V.
///   q: N x r, k: M x r, v: M x d_v (row-major, rows are tokens)  ->  N x d_v.
/// N == 0 gives a 0 x d_v result. `saved` (optional) receives P for naive_backward.
/// Throws std::invalid_argument on bad shapes/options, std::domain_error on non-finite input.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> naive_forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt = {},
                        Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::naive_forward_into<T>,
                                     "mixattn::reference::naive_forward", saved, q, k, v, opt);
}

/// naive_forward into a caller-owned `out` (resized to N x d_v); `saved` receives P. The working
/// memory is per thread and kept, so with a reused `out` and `saved` repeated shapes allocate
/// nothing.
template <class T, detail::enable_if_supported<T> = 0>
void naive_forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt,
                        Saved<detail::identity_t<T>>* saved) {
  detail::naive_forward_into<T>("mixattn::reference::naive_forward_into", out, q, k, v, opt, saved);
}

/// Backward of naive_forward, from the saved probabilities P (N x M):
///   dV = P^T dO,  dP = dO V^T,  dS_ij = P_ij (dP_ij - sum_l P_il dP_il),
///   dQ = scale (dS K),  dK = dS^T (scale Q)  (the association flash_backward uses).
///   q: N x r, k: M x r, v: M x d_v, grad_out: N x d_v; saved from naive_forward on the same
///   inputs and options.  ->  Grad {q: N x r, k: M x r, v: M x d_v}.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> naive_backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                       const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                       const Saved<T>& saved, const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(&detail::naive_backward_into<T>,
                                            "mixattn::reference::naive_backward", q, k, v, grad_out,
                                            saved, opt);
}

/// naive_backward into caller-owned gradients (resized; scratch kept in `grad`).
template <class T, detail::enable_if_supported<T> = 0>
void naive_backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                         const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                         const Saved<T>& saved, const Options& opt) {
  detail::naive_backward_into<T>("mixattn::reference::naive_backward_into", grad, q, k, v, grad_out,
                                 saved, opt);
}

/// Tiled softmax attention with an online softmax (SPEC §3; FlashAttention-2 forward): the same
/// function as naive_forward in O(N + tile) extra memory. Causal tiles wholly above the diagonal
/// are skipped and only diagonal tiles are masked; with options.window w (SPEC §7) so are the
/// tiles wholly before every row's window, so the cost is O(N w r), not O(N^2 r).
///   q: N x r, k: M x r, v: M x d_v (row-major, rows are tokens)  ->  N x d_v.
/// N == 0 gives a 0 x d_v result. `saved` (optional) receives the output and the per-row
/// log-sum-exp for flash_backward.
/// Throws std::invalid_argument on bad shapes/options, std::domain_error on non-finite input.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> flash_forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt = {},
                        Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::flash_forward_into<T>,
                                     "mixattn::reference::flash_forward", saved, q, k, v, opt);
}

/// flash_forward into a caller-owned `out` (resized to N x d_v); `saved` receives the output and
/// the log-sum-exps. The working memory is per thread and kept, so with a reused `out` and
/// `saved` repeated shapes allocate nothing.
template <class T, detail::enable_if_supported<T> = 0>
void flash_forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt,
                        Saved<detail::identity_t<T>>* saved) {
  detail::flash_forward_into<T>("mixattn::reference::flash_forward_into", out, q, k, v, opt, saved);
}

/// Backward of flash_forward (FlashAttention-2 backward): recomputes each probability tile from
/// the saved log-sum-exp, P = exp(scale Q K^T - lse), and accumulates
///   dV += P^T dO,  dS = P o (dP - D) with dP = dO V^T and D_i = dO_i . O_i,
///   dQ += scale dS K,  dK += scale dS^T Q,
/// in O(N + M + tile) extra memory; with options.window, over the forward's tiles only (SPEC §7).
///   q: N x r, k: M x r, v: M x d_v, grad_out: N x d_v; saved from flash_forward on the same
///   inputs and options.  ->  Grad {q: N x r, k: M x r, v: M x d_v}.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> flash_backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                       const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                       const Saved<T>& saved, const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(&detail::flash_backward_into<T>,
                                            "mixattn::reference::flash_backward", q, k, v, grad_out,
                                            saved, opt);
}

/// flash_backward into caller-owned gradients (resized; scratch kept in `grad`).
template <class T, detail::enable_if_supported<T> = 0>
void flash_backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                         const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                         const Saved<T>& saved, const Options& opt) {
  detail::flash_backward_into<T>("mixattn::reference::flash_backward_into", grad, q, k, v, grad_out,
                                 saved, opt);
}

/// Causal softmax decoding: appends the n new tokens' k (n x r) and v (n x d_v) to `cache` and
/// returns their outputs (n x d_v) for q (n x r): new token i attends to every cached token and
/// to the new ones up to itself (with options.window w, to the last w of those, itself
/// included). Over any pieces of a sequence, the rows of
/// naive_forward(q, k, v, causal) up to rounding. options.causal must be true (decoding is
/// causal); options.scale as for the forwards. O(n (size + n) (r + d_v)) time, O(size + n)
/// scratch. On a throw (invalid_argument for shapes or options, domain_error for non-finite
/// input) the cache is untouched.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> decode(KvCache<T>& cache, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                 const ConstMatrixArg<T>& v, const Options& opt) {
  Matrix<T> out;
  detail::reference_decode_into<T>("mixattn::reference::decode", out, cache, q, k, v, opt);
  return out;
}

// Deduced calls: naive_forward(q, k, v) with plain matrices takes T from q (the forms above take
// it written, naive_forward<float>(q, k, v); the backwards take it from `saved`). The arguments
// then bind to the ConstMatrixArg<T> parameters above, which refuse what they would copy.
template <class Q, class K, class V, detail::enable_if_deduced<Q, K, V> = 0>
Matrix<typename Q::Scalar> naive_forward(const Q& q, const K& k, const V& v,
                                         const Options& opt = {},
                                         Saved<typename Q::Scalar>* saved = nullptr) {
  return naive_forward<typename Q::Scalar>(q, k, v, opt, saved);
}
template <class Q, class K, class V, detail::enable_if_deduced<Q, K, V> = 0>
Matrix<typename Q::Scalar> flash_forward(const Q& q, const K& k, const V& v,
                                         const Options& opt = {},
                                         Saved<typename Q::Scalar>* saved = nullptr) {
  return flash_forward<typename Q::Scalar>(q, k, v, opt, saved);
}

}  // namespace reference

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_REFERENCE_WORKERS(T)                                                        \
  MIXATTN_TEMPLATE_INSTANCE void naive_forward_into<T>(                                     \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,          \
      const ConstMatrixRef<T>&, const reference::Options&, reference::Saved<T>*);           \
  MIXATTN_TEMPLATE_INSTANCE void flash_forward_into<T>(                                     \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,          \
      const ConstMatrixRef<T>&, const reference::Options&, reference::Saved<T>*);           \
  MIXATTN_TEMPLATE_INSTANCE void naive_backward_into<T>(                                    \
      const char*, reference::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const reference::Saved<T>&,       \
      const reference::Options&);                                                           \
  MIXATTN_TEMPLATE_INSTANCE void flash_backward_into<T>(                                    \
      const char*, reference::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const reference::Saved<T>&,       \
      const reference::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_REFERENCE_WORKERS)
#undef MIXATTN_REFERENCE_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
