// mixattn/detail/linear/forward.hpp — linear attention's feature map phi(x) = elu(x) + 1 and the
// body of its forward (SPEC 4.1, 4.2).
//
// Internal: part of mixattn/linear.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/linear_types.hpp"

#include <Eigen/Core>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// phi(x) = elu(x) + 1 = max(x, 0) + exp(min(x, 0)) entrywise: x + 1 for x > 0, e^x otherwise.
/// e^x is evaluated directly (not as expm1(x) + 1, which is 0 in float below x = -17), so phi
/// stays positive down to T's underflow, and no e^x of a large positive x is ever formed.
template <class T>
void linear_features(const ConstMatrixRef<T>& x, Matrix<T>& phi) {
  phi.resize(x.rows(), x.cols());
  phi.array() = x.array().max(T(0)) + x.array().min(T(0)).exp();
}

/// forward_into's body (`fn` names the entry point in messages); the value-returning forward runs
/// it too. Without `saved`, the record is this thread's.
template <class T>
void linear_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                         const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                         const linear::Options& opt, linear::Saved<T>* saved) {
  feature_attention_check_inputs<T>(fn, q, k, v, opt);
  linear::Saved<T>& rec = saved ? *saved : thread_scratch<linear::Saved<T>>();
  rec.valid = false;  // until this call has filled it
  linear_features<T>(q, rec.phi_q);
  linear_features<T>(k, rec.phi_k);
  feature_attention_forward<T>(fn, out, q, k, v, opt, rec, saved != nullptr);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
