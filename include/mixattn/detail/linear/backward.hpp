// mixattn/detail/linear/backward.hpp — the body of linear attention's backward (SPEC 4.3): the
// shared backward to the features, then through phi(x) = elu(x) + 1.
//
// Internal: part of mixattn/linear.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/linear_types.hpp"

#include <Eigen/Core>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// dL/dx = dL/dphi * phi'(x), with phi'(x) = 1 for x > 0 and e^x = phi(x) otherwise, i.e.
/// phi'(x) = min(phi(x), 1) (phi(x) > 1 exactly when x > 0). Scales dphi in place.
template <class T>
void linear_feature_backward(const Matrix<T>& phi, Matrix<T>& dphi) {
  dphi.array() *= phi.array().min(T(1));
}

/// backward_into's body (`fn` names the entry point in messages); the value-returning backward
/// runs it too.
template <class T>
void linear_backward_into(const char* fn, linear::Grad<T>& grad, const ConstMatrixRef<T>& q,
                          const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                          const ConstMatrixRef<T>& grad_out, const linear::Saved<T>& saved,
                          const linear::Options& opt) {
  feature_attention_check_backward<T>(fn, q, k, v, grad_out, saved, opt, q.cols());
  LinearScratch<T>& s = grad.scratch;
  feature_attention_backward<T>(fn, q.cols(), k.rows(), v, grad_out, saved, opt, grad.q, grad.k,
                                grad.v, s, [&] {
                                  grad.q = s.dphi_q;
                                  grad.k = s.dphi_k;
                                  linear_feature_backward<T>(saved.phi_q, grad.q);
                                  linear_feature_backward<T>(saved.phi_k, grad.k);
                                });
}

}  // namespace detail
MIXATTN_END_NAMESPACE
