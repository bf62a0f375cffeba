// mixattn/vq.hpp — static-codebook vector-quantised attention (Transformer-VQ style: Lingle 2023,
// "Transformer-VQ: Linear-Time Transformers via Vector Quantization"), the baseline of SPEC.md
// section 6 that OVQ's online dictionary is compared against; forward and backward,
// bidirectional and causal.
//
// A learned codebook C (S x r). Every key is replaced by its nearest code, k^_j = C_{z_j},
// z_j = argmin_s |k_j - C_s|^2, and every query attends over the quantised keys with softmax
// weights e^(tau q_i . k^_j). Grouping the keys by code, that is attention over the S codes with
// a log-count bias (log of how many visible keys map to each code) and per-code value sums:
//   O_i = sum_s e^(tau q_i . C_s) U_s / (sum_s e^(tau q_i . C_s) n_s + guard),
// U_s, n_s the sum of the values and the number of the visible keys in code s: linear
// attention (SPEC 4.2) with query features e^(tau q_i . C_s - m_i) / sqrt(S) (Performer's
// query features with W = C, performer.hpp) and one-hot key features, on the same read-out and
// causal scan (prefix counts and sums, chunk-wise). Cost O((N + M) S (r + d_v)) forward; the
// straight-through key gradient costs O(N S r d_v) (SPEC 6.3).
//
// Thread safety: every function is reentrant; distinct calls may run concurrently. A forward
// without `saved` works in this thread's own scratch record (kept for the thread's lifetime).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/vq/backward.hpp"
#include "mixattn/detail/vq/codes.hpp"
#include "mixattn/detail/vq/forward.hpp"
#include "mixattn/vq_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace vq {

/// The code of every key (SPEC 6.1): z_j = argmin_s |k_j - C_s|^2, ties to the lowest s.
/// k: M x r, codebook: S x r. Returns M indices in [0, S).
template <class T, detail::enable_if_supported<T> = 0>
Eigen::Matrix<Index, Eigen::Dynamic, 1> assign(const ConstMatrixArg<T>& k,
                                               const ConstMatrixArg<T>& codebook) {
  detail::require(codebook.rows() > 0 && codebook.cols() == k.cols(), "mixattn::vq::assign",
                  "codebook is ", detail::shape_str(codebook), " but k is ", detail::shape_str(k),
                  ": it must be S x ", k.cols(), " with S >= 1");
  return detail::vq_codes<T>(k, codebook);
}

/// VQ attention forward (SPEC 6.2). q: N x r, k: M x r, v: M x d_v, codebook: S x r, row-major
/// (M == N when causal; M == 0 only with N == 0). Returns N x d_v. If `saved` is given it
/// receives what backward needs. T is not deduced: write vq::forward<float>(...).
/// Throws std::invalid_argument for bad shapes or options; with check_finite, std::domain_error
/// for non-finite q, k, v or codebook, or for an output that overflowed T.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& codebook,
                  const Options& opt = {}, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::vq_forward_into<T>, "mixattn::vq::forward", saved, q,
                                     k, v, codebook, opt);
}

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, codebook, opt, saved); with a reused `out` and `saved` (or
/// none), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& codebook, const Options& opt,
                  Saved<detail::identity_t<T>>* saved) {
  detail::vq_forward_into<T>("mixattn::vq::forward_into", out, q, k, v, codebook, opt, saved);
}

/// VQ attention backward (SPEC 6.3): gradients of sum(grad_out . forward(q, k, v, codebook))
/// with respect to q (N x r), k (M x r, straight-through: the gradient of the quantised key),
/// v (M x d_v) and the codebook (S x r). grad_out: N x d_v; saved: filled by forward with the
/// same inputs and options. With check_finite, non-finite grad_out or overflowed gradients
/// throw std::domain_error.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& codebook, const ConstMatrixArg<T>& grad_out,
                 const Saved<T>& saved, const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(&detail::vq_backward_into<T>, "mixattn::vq::backward",
                                            q, k, v, codebook, grad_out, saved, opt);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, codebook, grad_out, saved, opt), allocating nothing when
/// shapes (and the set of codes the keys use) repeat.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& codebook,
                   const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::vq_backward_into<T>("mixattn::vq::backward_into", grad, q, k, v, codebook, grad_out,
                              saved, opt);
}

}  // namespace vq

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_VQ_WORKERS(T)                                                                     \
  MIXATTN_TEMPLATE_INSTANCE void vq_forward_into<T>(                                              \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,                \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const vq::Options&, vq::Saved<T>*);     \
  MIXATTN_TEMPLATE_INSTANCE void vq_backward_into<T>(                                             \
      const char*, vq::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,              \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,              \
      const vq::Saved<T>&, const vq::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_VQ_WORKERS)
#undef MIXATTN_VQ_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
