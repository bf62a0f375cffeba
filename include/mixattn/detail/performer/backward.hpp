// mixattn/detail/performer/backward.hpp — the body of Performer's backward (SPEC 5.3): linear
// attention's backward to the features, then through the exponential feature map.
//
// Internal: part of mixattn/performer.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/exp_features.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/performer/forward.hpp"
#include "mixattn/performer_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// backward_into's body (`fn` names the entry point in messages); the value-returning backward runs
/// it too.
template <class T>
void performer_backward_into(const char* fn, performer::Grad<T>& grad, const ConstMatrixRef<T>& q,
                             const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                             const performer::Features<T>& features,
                             const ConstMatrixRef<T>& grad_out, const performer::Saved<T>& saved,
                             const performer::Options& opt) {
  performer_check<T>(fn, q, k, v, features, opt);
  feature_attention_check_backward<T>(fn, q, k, v, grad_out, saved.attn, opt, features.count());
  require(saved.scale == opt.scale, fn, "saved was made with scale = ", saved.scale,
          " but options give scale = ", opt.scale);
  require(saved.q_at.size() == q.rows(), fn, "saved holds ", saved.q_at.size(),
          " query positions but q has ", q.rows(), " rows");
  if (fingerprint(features.w) != saved.w_fingerprint) raise_other_data(fn, "saved", "features.w");
  const T s = performer_scale<T>(opt, q.cols());
  LinearScratch<T>& x = grad.scratch;
  feature_attention_backward<T>(
      fn, q.cols(), k.rows(), v, grad_out, saved.attn, opt, grad.q, grad.k, grad.v, x, [&] {
        exp_feature_backward_into<T>(q, features.w, s, saved.attn.phi_q, x.dphi_q, grad.q, x.e,
                                     &saved.q_at, 0, 0, x.gemm);
        exp_feature_backward_into<T>(k, features.w, s, saved.attn.phi_k, x.dphi_k, grad.k, x.e,
                                     nullptr, saved.k_row, saved.k_col, x.gemm);
      });
}

}  // namespace detail
MIXATTN_END_NAMESPACE
