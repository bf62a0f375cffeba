// mixattn/detail/vq/codes.hpp — VQ attention's codes (SPEC 6.1): the nearest code of every key.
//
// Internal: part of mixattn/vq.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/linear_types.hpp"

#include <Eigen/Core>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

using CodeVector = Eigen::Matrix<Index, Eigen::Dynamic, 1>;

/// z_j = argmin_s |k_j - C_s|^2 = argmax_s (k_j . C_s - |C_s|^2 / 2), ties to the lowest s.
template <class T>
CodeVector vq_codes(const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& codebook) {
  CodeVector z(k.rows());
  if (k.rows() == 0) return z;
  Matrix<T> score(k.rows(), codebook.rows());
  score.noalias() = k * codebook.transpose();
  score.rowwise() -= (codebook.rowwise().squaredNorm() / T(2)).transpose();
  for (Index j = 0; j < k.rows(); ++j) {
    Index s = 0;
    T best = score(j, 0);
    for (Index c = 1; c < score.cols(); ++c)
      if (score(j, c) > best) {
        best = score(j, c);
        s = c;
      }
    z[j] = s;
  }
  return z;
}

/// vq_codes into z (M) with the scores and the halved code norms in `s`.
template <class T>
void vq_codes_into(const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& codebook, CodeVector& z,
                   LinearScratch<T>& s) {
  z.resize(k.rows());
  if (k.rows() == 0) return;
  s.score.resize(k.rows(), codebook.rows());
  product_into<T>(s.score, plain<T>(k), transposed<T>(codebook), T(1), false, s.gemm);
  s.norms = codebook.rowwise().squaredNorm() / T(2);
  s.score.rowwise() -= s.norms.transpose();
  for (Index j = 0; j < k.rows(); ++j) {
    Index c_best = 0;
    T best = s.score(j, 0);
    for (Index c = 1; c < s.score.cols(); ++c)
      if (s.score(j, c) > best) {
        best = s.score(j, c);
        c_best = c;
      }
    z[j] = c_best;
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
