// mixattn/linformer.hpp — Linformer (Wang, Li, Khabsa, Fang & Ma 2020, "Linformer: Self-Attention
// with Linear Complexity"), SPEC.md section 11, forward and backward.
//
// Per head, learned projections E, F (k_proj x N) shorten the keys and values along the
// sequence, and every query attends to the k_proj projected keys:
//   K' = E k,  V' = F v,  O = softmax(scale q K'^T) V'   (softmax over each row's k_proj logits)
// O(N k_proj (d + d_v)) work and O(N k_proj) memory (the probabilities kept for backward);
// nothing N x N is formed. Bidirectional only (every projected row mixes every position), and a
// sequence must have the length E and F were made for.
//
// Thread safety: every function is reentrant and distinct calls may run concurrently on
// distinct records. A forward without `saved` works in this thread's own record, and the
// value-returning forms in this thread's working memory, kept for the thread's lifetime. GEMMs
// use the threads Eigen is configured with.
//
// Training loops: forward_into / backward_into write into caller-owned outputs and keep their
// working memory in Saved and Grad (GEMM packing buffers included): a step whose shapes repeat
// performs no heap allocation. forward / backward return fresh results and run the same bodies.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/linformer/backward.hpp"
#include "mixattn/detail/linformer/forward.hpp"
#include "mixattn/linformer_types.hpp"

#include <Eigen/Core>

MIXATTN_BEGIN_NAMESPACE
namespace linformer {

/// Linformer forward (SPEC 11.1). q, k: N x d; v: N x d_v; E, F: k_proj x N (row-major).
/// Returns N x d_v. saved: when given, receives what backward needs. T is not deduced from the
/// matrices: linformer::forward<float>(q, k, v, E, F). Throws std::invalid_argument for bad
/// shapes (a sequence whose length is not E.cols()) or options (causal); with check_finite,
/// std::domain_error for non-finite inputs or an output that overflows T.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& E,
                  const ConstMatrixArg<T>& F, const Options& opt = {}, Saved<T>* saved = nullptr) {
  return detail::returned_forward<T>(&detail::linformer_forward_into<T>,
                                     "mixattn::linformer::forward", saved, q, k, v, E, F, opt);
}

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, E, F, opt, saved). With a reused `out` and `saved` (or none: this thread's
/// record), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& E,
                  const ConstMatrixArg<T>& F, const Options& opt,
                  Saved<typename detail::identity<T>::type>* saved) {
  detail::linformer_forward_into<T>("mixattn::linformer::forward_into", out, q, k, v, E, F, opt,
                                    saved);
}

/// Linformer backward (SPEC 11.2): the gradients of sum(grad_out o forward(...)) with respect
/// to q, k (N x d), v (N x d_v), E and F (k_proj x N). grad_out: N x d_v. saved: filled by
/// forward with the same inputs and options.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& E, const ConstMatrixArg<T>& F,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved,
                 const Options& opt = {}) {
  return detail::returned_backward<Grad<T>>(&detail::linformer_backward_into<T>,
                                            "mixattn::linformer::backward", q, k, v, E, F, grad_out,
                                            saved, opt);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, E, F, grad_out, saved, opt), allocating nothing when shapes repeat.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& E,
                   const ConstMatrixArg<T>& F, const ConstMatrixArg<T>& grad_out,
                   const Saved<typename detail::identity<T>::type>& saved, const Options& opt) {
  detail::linformer_backward_into<T>("mixattn::linformer::backward_into", grad, q, k, v, E, F,
                                     grad_out, saved, opt);
}

}  // namespace linformer

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every form, at the default instruction set (core.hpp: compiling the
// operators once).
namespace detail {
#define MIXATTN_LINFORMER_WORKERS(T)                                                        \
  MIXATTN_TEMPLATE_INSTANCE void linformer_forward_into<T>(                                 \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,          \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,         \
      const linformer::Options&, linformer::Saved<T>*);                                     \
  MIXATTN_TEMPLATE_INSTANCE void linformer_backward_into<T>(                                \
      const char*, linformer::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,         \
      const ConstMatrixRef<T>&, const linformer::Saved<T>&, const linformer::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_LINFORMER_WORKERS)
#undef MIXATTN_LINFORMER_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
