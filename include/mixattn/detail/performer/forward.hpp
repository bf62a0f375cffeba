// mixattn/detail/performer/forward.hpp — Performer's checks and the body of its forward (SPEC 5.2):
// the exponential features of q and k on the random directions, then linear attention's read-out.
//
// Internal: part of mixattn/performer.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/exp_features.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/performer_types.hpp"

#include <Eigen/Core>

#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// The resolved scale s (options.scale, or r^(-1/4) for 0).
template <class T>
T performer_scale(const performer::Options& opt, Index r) {
  return static_cast<T>(opt.scale > 0 ? opt.scale : std::pow(static_cast<double>(r), -0.25));
}

template <class T>
void performer_check(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                     const ConstMatrixRef<T>& v, const performer::Features<T>& f,
                     const performer::Options& opt) {
  feature_attention_check_inputs<T>(fn, q, k, v, opt);
  require(f.w.rows() > 0 && f.w.cols() == q.cols(), fn, "features.w is ", shape_str(f.w),
          " but q is ", shape_str(q), ": it must be m x ", q.cols(), " with m >= 1");
  require(opt.scale >= 0 && std::isfinite(opt.scale) && std::isfinite(static_cast<T>(opt.scale)),
          fn, "options.scale is ", opt.scale, "; it must be >= 0 and finite (0: r^(-1/4))");
  if (opt.check_finite) require_finite(f.w, fn, "features.w");
}

/// forward_into's body (`fn` names the entry point in messages); the value-returning forward runs
/// it too.
template <class T>
void performer_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                            const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                            const performer::Features<T>& features, const performer::Options& opt,
                            performer::Saved<T>* saved) {
  performer_check<T>(fn, q, k, v, features, opt);
  const T s = performer_scale<T>(opt, q.cols());
  performer::Saved<T>& rec = saved ? *saved : thread_scratch<performer::Saved<T>>();
  rec.attn.valid = false;  // until this call has filled it
  exp_features_into<T>(q, features.w, s, true, rec.attn.phi_q, &rec.q_at, nullptr, nullptr,
                       rec.attn.scratch);
  exp_features_into<T>(k, features.w, s, false, rec.attn.phi_k, nullptr, &rec.k_row, &rec.k_col,
                       rec.attn.scratch);
  feature_attention_forward<T>(fn, out, q, k, v, opt, rec.attn, saved != nullptr);
  rec.scale = opt.scale;
  if (saved) rec.w_fingerprint = fingerprint(features.w);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
