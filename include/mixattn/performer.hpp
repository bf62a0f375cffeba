// mixattn/performer.hpp — Performer attention with FAVOR+ positive random features (Choromanski
// et al. 2021, "Rethinking Attention with Performers"), the baseline of SPEC.md section 5,
// forward and backward, bidirectional and causal.
//
// With m random directions w_l (the rows of a constant m x r matrix W, drawn from a seed) and the
// scale s (default r^(-1/4)), every row x of q and k gets the m features
//   phi(x)_l = exp(s w_l . x - s^2 |x|^2 / 2 - c) / sqrt(m),
// whose products estimate the softmax kernel: E[phi(q) . phi(k)] = exp(s^2 q . k) e^(-c_q - c_k).
// c is the stabiliser (SPEC 5.2), as in the FAVOR+ reference: per query row the row's largest
// exponent, for keys one largest exponent over the whole call; it changes the result only
// through eps. Then it is linear attention (SPEC 4.2)
// with these features: the read-out, the causal chunked scan (detail/common/causal_scan.hpp) and
// the backward to the features are linear.hpp's, shared, not copied. Cost O((N + M) m (r + d_v)).
//
// Thread safety: every function is reentrant; distinct calls may run concurrently. A forward
// without `saved` works in this thread's own scratch record (kept for the thread's lifetime).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/performer/backward.hpp"
#include "mixattn/detail/performer/features.hpp"
#include "mixattn/detail/performer/forward.hpp"
#include "mixattn/performer_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace performer {

/// Performer forward (SPEC 5.2). q: N x r, k: M x r, v: M x d_v, row-major (M == N when causal;
/// M == 0 only with N == 0); features.w: m x r. Returns N x d_v. If `saved` is given it receives
/// what backward needs. T is not deduced: write performer::forward<float>(q, k, v, features).
/// Throws std::invalid_argument for bad shapes or options; with check_finite, std::domain_error
/// for non-finite q, k, v or W, or for an output that overflowed T.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Features<T>& features, const Options& opt = {},
                  Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::performer_forward_into<T>,
                                     "mixattn::performer::forward", saved, q, k, v, features, opt);
}

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, features, opt, saved); with a reused `out` and `saved` (or
/// none), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Features<T>& features, const Options& opt,
                  Saved<detail::identity_t<T>>* saved) {
  detail::performer_forward_into<T>("mixattn::performer::forward_into", out, q, k, v, features, opt,
                                    saved);
}

/// Performer backward (SPEC 5.3): gradients of sum(grad_out . forward(q, k, v, features)) with
/// respect to q (N x r), k (M x r) and v (M x d_v); W is a constant. grad_out: N x d_v; saved:
/// filled by forward with the same q, k, v, features and options. With check_finite,
/// non-finite grad_out or overflowed gradients throw std::domain_error.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const Features<T>& features, const ConstMatrixArg<T>& grad_out,
                 const Saved<T>& saved, const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(&detail::performer_backward_into<T>,
                                            "mixattn::performer::backward", q, k, v, features,
                                            grad_out, saved, opt);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, features, grad_out, saved, opt), allocating nothing when shapes repeat.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const Features<T>& features,
                   const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::performer_backward_into<T>("mixattn::performer::backward_into", grad, q, k, v, features,
                                     grad_out, saved, opt);
}

/// The earlier order of backward's arguments, features after grad_out; kept for one release.
template <class T, detail::enable_if_supported<T> = 0>
[[deprecated(
    "pass features before grad_out, in forward's order: backward(q, k, v, features, "
    "grad_out, saved, opt)")]] Grad<T>
backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
         const ConstMatrixArg<T>& grad_out, const Features<T>& features, const Saved<T>& saved,
         const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(&detail::performer_backward_into<T>,
                                            "mixattn::performer::backward", q, k, v, features,
                                            grad_out, saved, opt);
}

/// The earlier order of backward_into's arguments, features after grad_out; kept for one
/// release.
template <class T, detail::enable_if_supported<T> = 0>
[[deprecated(
    "pass features before grad_out, in forward's order: backward_into(grad, q, k, v, "
    "features, grad_out, saved, opt)")]] void
backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
              const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
              const Features<T>& features, const Saved<T>& saved, const Options& opt) {
  detail::performer_backward_into<T>("mixattn::performer::backward_into", grad, q, k, v, features,
                                     grad_out, saved, opt);
}

}  // namespace performer

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_PERFORMER_WORKERS(T)                                                        \
  MIXATTN_TEMPLATE_INSTANCE void performer_forward_into<T>(                                 \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,          \
      const ConstMatrixRef<T>&, const performer::Features<T>&, const performer::Options&,   \
      performer::Saved<T>*);                                                                \
  MIXATTN_TEMPLATE_INSTANCE void performer_backward_into<T>(                                \
      const char*, performer::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const performer::Features<T>&, const ConstMatrixRef<T>&,    \
      const performer::Saved<T>&, const performer::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_PERFORMER_WORKERS)
#undef MIXATTN_PERFORMER_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
