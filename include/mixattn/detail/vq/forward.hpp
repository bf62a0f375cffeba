// mixattn/detail/vq/forward.hpp — VQ attention's checks and the body of its forward (SPEC 6.2): the
// keys' one-hot code features and the queries' exponential features on the codebook, then linear
// attention's read-out.
//
// Internal: part of mixattn/vq.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/exp_features.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/vq/codes.hpp"
#include "mixattn/vq_types.hpp"

#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
T vq_scale(const vq::Options& opt, Index r) {
  return static_cast<T>(opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(r)));
}

template <class T>
void vq_check(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
              const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& codebook,
              const vq::Options& opt) {
  feature_attention_check_inputs<T>(fn, q, k, v, opt);
  require(codebook.rows() > 0 && codebook.cols() == q.cols(), fn, "codebook is ",
          shape_str(codebook), " but q is ", shape_str(q), ": it must be S x ", q.cols(),
          " with S >= 1");
  require(opt.scale >= 0 && std::isfinite(opt.scale) && std::isfinite(static_cast<T>(opt.scale)),
          fn, "options.scale is ", opt.scale, "; it must be >= 0 and finite (0: 1/sqrt(r))");
  if (opt.check_finite) require_finite(codebook, fn, "codebook");
}

/// forward_into's body (`fn` names the entry point in messages); the value-returning forward runs
/// it too.
template <class T>
void vq_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                     const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                     const ConstMatrixRef<T>& codebook, const vq::Options& opt,
                     vq::Saved<T>* saved) {
  vq_check<T>(fn, q, k, v, codebook, opt);
  const T tau = vq_scale<T>(opt, q.cols());
  vq::Saved<T>& rec = saved ? *saved : thread_scratch<vq::Saved<T>>();
  linear::Saved<T>& a = rec.attn;
  a.valid = false;  // until this call has filled it
  a.scratch.w = codebook;
  vq_codes_into<T>(k, codebook, rec.codes, a.scratch);
  exp_features_into<T>(q, a.scratch.w, tau, true, a.phi_q, &rec.q_at, nullptr, nullptr, a.scratch);
  a.phi_k.setZero(k.rows(), codebook.rows());
  for (Index j = 0; j < k.rows(); ++j) a.phi_k(j, rec.codes[j]) = T(1);
  feature_attention_forward<T>(fn, out, q, k, v, opt, a, saved != nullptr);
  rec.scale = opt.scale;
  if (saved) rec.codebook_fingerprint = fingerprint(codebook);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
