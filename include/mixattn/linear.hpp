// mixattn/linear.hpp — linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"),
// the baseline of SPEC.md section 4, forward and backward, bidirectional and causal.
//
// With the feature map phi(x) = elu(x) + 1 applied to each entry of q and k:
//   bidirectional  O_i = (phi(q_i)^T sum_j phi(k_j) v_j^T) / (phi(q_i) . sum_j phi(k_j) + eps)
//   causal         the same with the sums over j <= i, chunk-wise
// Causal GMA is this operator with the responsibilities gamma as features: both run the one
// causal scan of detail/common/causal_scan.hpp; Performer and VQ attention are it with their own
// features (detail/common/feature_attention.hpp). Cost O((N + M) r d_v); nothing N x M is formed.
//
// Thread safety: every function is reentrant and distinct calls may run concurrently. A forward
// without `saved` (forward, or forward_into with nullptr) works in this thread's own scratch
// record, and the value-returning forms in this thread's working memory, which stay allocated
// for the thread's lifetime. GEMMs use the threads Eigen is configured with.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/linear/backward.hpp"
#include "mixattn/detail/linear/forward.hpp"
#include "mixattn/linear_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace linear {

/// Linear attention forward (SPEC 4.2). q: N x r, k: M x r, v: M x d_v, row-major (M == N when
/// causal; M == 0 only with N == 0). Returns N x d_v. If `saved` is given it receives what
/// backward needs. T is not deduced: write linear::forward<float>(q, k, v).
/// Throws std::invalid_argument for bad shapes or options; with check_finite, std::domain_error
/// for non-finite q, k, v, or for an output that overflowed T (q, k, v near T's range).
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt = {}, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::linear_forward_into<T>, "mixattn::linear::forward",
                                     saved, q, k, v, opt);
}

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, opt, saved). With a reused `out` and `saved` (or none: this
/// thread's scratch record), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt,
                  Saved<detail::identity_t<T>>* saved) {
  detail::linear_forward_into<T>("mixattn::linear::forward_into", out, q, k, v, opt, saved);
}

/// Linear attention backward (SPEC 4.3): gradients of sum(grad_out . forward(q, k, v)) with
/// respect to q (N x r), k (M x r) and v (M x d_v). grad_out: N x d_v; saved: filled by forward
/// with the same q, k, v and options. With check_finite, non-finite grad_out or overflowed
/// gradients throw std::domain_error.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved,
                 const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(
      &detail::linear_backward_into<T>, "mixattn::linear::backward", q, k, v, grad_out, saved, opt);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, grad_out, saved, opt), allocating nothing when shapes repeat.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                   const Saved<T>& saved, const Options& opt) {
  detail::linear_backward_into<T>("mixattn::linear::backward_into", grad, q, k, v, grad_out, saved,
                                  opt);
}

}  // namespace linear

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_LINEAR_WORKERS(T)                                                        \
  MIXATTN_TEMPLATE_INSTANCE void linear_forward_into<T>(                                 \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,       \
      const ConstMatrixRef<T>&, const linear::Options&, linear::Saved<T>*);              \
  MIXATTN_TEMPLATE_INSTANCE void linear_backward_into<T>(                                \
      const char*, linear::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const linear::Saved<T>&,       \
      const linear::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_LINEAR_WORKERS)
#undef MIXATTN_LINEAR_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
