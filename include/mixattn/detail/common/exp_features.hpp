// mixattn/detail/common/exp_features.hpp — the positive exponential feature map of Performer
// (SPEC 5.2, W its random directions) and of VQ attention's queries (SPEC 6.2, W the codebook),
// and its backward.
//
// Internal.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/linear_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// phi = exp(s X W^T - s^2 |x|^2 / 2 - c) / sqrt(m) (SPEC 5.2); x: n x r, phi: n x m. The
/// stabiliser c is the largest exponent: per_row (queries) c_i = max_l (s w_l . x_i -
/// s^2 |x_i|^2 / 2), its l in at[i] (the |x_i|^2 term cancels: the exponents are s (w_l -
/// w_l*) . x_i); otherwise (keys) one c over all (j, l), its (j, l) in (row, col). Every
/// exponent is <= 0, so phi <= 1/sqrt(m), and every query row has one feature equal to it.
/// The product's buffers and the keys' squared norms are in `scratch`.
template <class T>
void exp_features_into(const ConstMatrixRef<T>& x, const Matrix<T>& w, T s, bool per_row,
                       Matrix<T>& phi, Eigen::Matrix<Index, Eigen::Dynamic, 1>* at, Index* row,
                       Index* col, LinearScratch<T>& scratch) {
  const Index n = x.rows(), m = w.rows();
  phi.resize(n, m);
  // The per-row positions are sized even for no rows: a record reused from a longer call must
  // not keep its old positions, which the backward checks against the queries.
  if (per_row) at->resize(n);
  if (n == 0) return;
  product_into<T>(phi, plain<T>(x), transposed<T>(w), T(1), false, scratch.gemm);
  phi *= s;
  // The maxima by Eigen's vectorised reduction, then their first position by a scan in storage
  // order: maxCoeff(&index) is a scalar visitor, which walks a row-major matrix column by column
  // (a cache line per coefficient), most of the forward's time. The positions are those the
  // visitor gives: the first maximum of a row; over all of phi the first in column-major order
  // (least column, then least row). When the scan finds no entry equal to the maximum (a NaN,
  // possible only with check_finite off), the visitor decides, as before: the positions are
  // then always in range.
  if (per_row) {
    for (Index i = 0; i < n; ++i) {
      const T* p = phi.row(i).data();
      T c = phi.row(i).maxCoeff();
      Index l = static_cast<Index>(std::find(p, p + m, c) - p);
      if (l == m) c = phi.row(i).maxCoeff(&l);
      (*at)[i] = l;
      phi.row(i).array() -= c;
    }
  } else {
    scratch.norms = (s * s / T(2)) * x.rowwise().squaredNorm();
    phi.array().colwise() -= scratch.norms.array();
    T c = phi.maxCoeff();
    *row = 0;
    *col = m;
    for (Index i = 0; i<n&& * col> 0; ++i) {
      const T* p = phi.row(i).data();
      const Index j = static_cast<Index>(std::find(p, p + *col, c) - p);
      if (j < *col) {
        *row = i;
        *col = j;
      }
    }
    if (*col == m) c = phi.maxCoeff(row, col);
    phi.array() -= c;
  }
  phi = phi.array().exp() * static_cast<T>(1.0 / std::sqrt(static_cast<double>(m)));
}

/// Through the feature map (SPEC 5.3), with E = dphi o phi (the gradient of the exponents)
/// and e_i = sum_l E_il. Queries (exponents s (w_l - w_at[i]) . x_i):
///   dx_i = s E_i W - s e_i w_at[i].
/// Keys (exponents s w_l . x_j - s^2 |x_j|^2 / 2 - c, c that of (row, col)):
///   dx_j = s E_j W - s^2 e_j x_j,  and  dx_row -= (sum_j e_j) (s w_col - s^2 x_row).
/// dphi: n x m on entry (overwritten with E); dx: n x r; e_i in `e`, the product's buffers in
/// `space`.
template <class T>
void exp_feature_backward_into(const ConstMatrixRef<T>& x, const Matrix<T>& w, T s,
                               const Matrix<T>& phi, Matrix<T>& dphi, Matrix<T>& dx, Vector<T>& e,
                               const Eigen::Matrix<Index, Eigen::Dynamic, 1>* at, Index row,
                               Index col, GemmSpace<T>& space) {
  const Index n = x.rows();
  dx.resize(n, w.cols());
  if (n == 0) return;
  dphi.array() *= phi.array();
  e = dphi.rowwise().sum();
  product_into<T>(dx, plain<T>(dphi), plain<T>(w), s, false, space);
  if (at != nullptr) {
    for (Index i = 0; i < n; ++i) dx.row(i) -= (s * e[i]) * w.row((*at)[i]);
  } else {
    dx.array() -= (s * s) * (x.array().colwise() * e.array());
    dx.row(row) -= e.sum() * (s * w.row(col) - (s * s) * x.row(row));
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
