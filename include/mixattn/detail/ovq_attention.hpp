// mixattn/detail/ovq_attention.hpp — one query tile of OVQ attention, forward and backward
// (SPEC.md §2.2, §2.4). Internal: included by mixattn/ovq.hpp.
//
// A tile is m consecutive queries of one block, the first at block position p0, so query l sees
// the block's keys 0 .. p0 + l (causal) and the whole dictionary. The logits of a row are
//   s q_l . D_k[n] + log c[n]   (n < N)     and     s q_l . k_j   (j <= p0 + l),
// one joint max-subtracted softmax: the row's own key is always visible, so the max is finite
// and no row can be all -inf (no NaN, whatever the inputs' norms).
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
using CRef = Eigen::Ref<const Matrix<T>>;
template <class T>
using RowVec = Eigen::Matrix<T, 1, Eigen::Dynamic>;

/// Queries per tile: a 64 x (N + C) score tile stays in L2 at N = 1024 (float: 320 KiB) while
/// the GEMMs keep a full-width panel.
constexpr Index query_tile = 64;

/// Per-call scratch, sized once for the largest tile.
template <class T>
struct AttentionScratch {
  Matrix<T> pd, pb;    // tile x N, tile x C: scores, then probabilities
  Matrix<T> dpd, dpb;  // backward: dP, then dZ
  Matrix<T> g;         // backward: tile x r
  Vector<T> inv;       // 1 / row sums
  /// max_queries: the most queries of one call's block (a decoding call has one), so that a
  /// one-token call does not allocate a full tile.
  void reserve(Index dict_rows, Index block, Index key_dim, bool backward,
               Index max_queries = query_tile) {
    const Index tile = std::max<Index>(1, std::min({query_tile, block, max_queries}));
    pd.resize(tile, dict_rows);
    pb.resize(tile, block);
    inv.resize(tile);
    if (backward) {
      dpd.resize(tile, dict_rows);
      dpb.resize(tile, block);
      g.resize(tile, key_dim);
    }
  }
};

/// Fills sc.pd (m x N) and sc.pb (m x L) with exp(logit - row max), masked entries 0, and
/// sc.inv with 1 / row sum. The block's keys come in two parts, ko (the L_o keys the state
/// already held) then kn (L - L_o keys of this call), L = p0 + m; kept apart so that a decoding
/// call never copies the unfinished block. logc: log counts (N) or nullptr without the count
/// bias. With `check`, returns whether every logit was finite (a non-finite dictionary or
/// pending entry always makes one non-finite: x * inf and 0 * inf are never finite).
template <class T>
bool tile_weights(const CRef<T>& qh, const CRef<T>& dict_k, const T* logc, const CRef<T>& ko,
                  const CRef<T>& kn, Index p0, T s, AttentionScratch<T>& sc, bool check = false) {
  const Index m = qh.rows(), n = dict_k.rows(), lo = ko.rows(), l = lo + kn.rows();
  MIXATTN_ASSERT(l == p0 + m);
  Eigen::Ref<Matrix<T>> pd = sc.pd.topLeftCorner(m, n);
  Eigen::Ref<Matrix<T>> pb = sc.pb.topLeftCorner(m, l);
  if (n > 0) pd.noalias() = qh * dict_k.transpose();
  if (lo > 0) pb.leftCols(lo).noalias() = qh * ko.transpose();
  pb.rightCols(l - lo).noalias() = qh * kn.transpose();
  using W = mixattn::detail::wide_t<T>;
  const mixattn::detail::simd_arch arch{};
  T probe = 0;  // x * 0 is 0 for finite x, NaN otherwise
  for (Index i = 0; i < m; ++i) {
    const Index vis = p0 + i + 1;
    T mx = -std::numeric_limits<T>::infinity();
    if (n > 0) {
      if (logc != nullptr)
        pd.row(i) = pd.row(i) * s + Eigen::Map<const RowVec<T>>(logc, n);
      else
        pd.row(i) *= s;
      if (check) probe += (pd.row(i).array() * T(0)).sum();
      mx = row_max(arch, pd.row(i).data(), n);
    }
    pb.row(i).head(vis) *= s;
    if (check) probe += (pb.row(i).head(vis).array() * T(0)).sum();
    mx = mixattn::detail::max_keep_nan(mx, row_max(arch, pb.row(i).data(), vis));
    // one softmax over both parts: joint max, joint sum (sum >= 1: the max contributes exp(0))
    const W sum = exp_shifted_sum(arch, pd.row(i).data(), n, mx) +
                  exp_shifted_sum(arch, pb.row(i).data(), vis, mx);
    pb.row(i).tail(l - vis).setZero();
    sc.inv[i] = static_cast<T>(W(1) / sum);
  }
  return probe == T(0);
}

/// The same with the block's keys in one piece (kb: L x r).
template <class T>
void tile_weights(const CRef<T>& qh, const CRef<T>& dict_k, const T* logc, const CRef<T>& kb,
                  Index p0, T s, AttentionScratch<T>& sc) {
  tile_weights<T>(qh, dict_k, logc, kb.topRows(0), kb, p0, s, sc);
}

/// out (m x d_v) = softmax-weighted dictionary values plus block values (SPEC 2.2); the block in
/// two parts as in tile_weights (ko, vo: the state's pending keys and values; kn, vn: this
/// call's). Returns tile_weights' finiteness verdict.
template <class T>
bool tile_forward(const CRef<T>& qh, const CRef<T>& dict_k, const CRef<T>& dict_v, const T* logc,
                  const CRef<T>& ko, const CRef<T>& vo, const CRef<T>& kn, const CRef<T>& vn,
                  Index p0, T s, AttentionScratch<T>& sc, Eigen::Ref<Matrix<T>> out,
                  bool check = false) {
  const Index m = qh.rows(), n = dict_k.rows(), lo = ko.rows(), l = lo + kn.rows();
  const bool finite = tile_weights<T>(qh, dict_k, logc, ko, kn, p0, s, sc, check);
  out.noalias() = sc.pb.topLeftCorner(m, l).rightCols(l - lo) * vn;
  if (lo > 0) out.noalias() += sc.pb.topLeftCorner(m, lo) * vo;
  if (n > 0) out.noalias() += sc.pd.topLeftCorner(m, n) * dict_v;
  out.array().colwise() *= sc.inv.head(m).array();
  return finite;
}

/// Backward of one tile given dO (m x d_v): with P the probabilities, dP = dO V^T,
/// dZ = P o (dP - rowsum(P o dP)), G = dZ_dict D_k + dZ_block K:
///   dq_hat = s G,  ds += sum_l q_hat_l . G_l,  dK_block += s dZ_block^T Q_hat,
///   dV_block += P_block^T dO,  and, when `dict_grad`, dD_k += s dZ_dict^T Q_hat,
///   dD_v += P_dict^T dO.
/// dkb, dvb: L x r, L x d_v accumulators (rows of the block); ddk, ddv: N x r, N x d_v.
template <class T>
void tile_backward(const CRef<T>& qh, const CRef<T>& dict_k, const CRef<T>& dict_v, const T* logc,
                   const CRef<T>& kb, const CRef<T>& vb, Index p0, T s, const CRef<T>& dout,
                   AttentionScratch<T>& sc, Eigen::Ref<Matrix<T>> dqh,
                   mixattn::detail::wide_t<T>& ds, Eigen::Ref<Matrix<T>> dkb,
                   Eigen::Ref<Matrix<T>> dvb, bool dict_grad, Eigen::Ref<Matrix<T>> ddk,
                   Eigen::Ref<Matrix<T>> ddv) {
  const Index m = qh.rows(), n = dict_k.rows(), l = kb.rows();
  tile_weights<T>(qh, dict_k, logc, kb, p0, s, sc);
  Eigen::Ref<Matrix<T>> pd = sc.pd.topLeftCorner(m, n);
  Eigen::Ref<Matrix<T>> pb = sc.pb.topLeftCorner(m, l);
  Eigen::Ref<Matrix<T>> dpd = sc.dpd.topLeftCorner(m, n);
  Eigen::Ref<Matrix<T>> dpb = sc.dpb.topLeftCorner(m, l);
  Eigen::Ref<Matrix<T>> g = sc.g.topLeftCorner(m, qh.cols());
  pb = sc.inv.head(m).asDiagonal() * pb;
  dpb.noalias() = dout * vb.transpose();
  if (n > 0) {
    pd = sc.inv.head(m).asDiagonal() * pd;
    dpd.noalias() = dout * dict_v.transpose();
  }
  const mixattn::detail::simd_arch arch{};
  for (Index i = 0; i < m; ++i) {
    // delta_i = sum_j P_ij dP_ij over both parts; masked entries have P = 0.
    const T delta = static_cast<T>(row_dot(arch, pb.row(i).data(), dpb.row(i).data(), l) +
                                   row_dot(arch, pd.row(i).data(), dpd.row(i).data(), n));
    softmax_backward_apply(arch, pb.row(i).data(), dpb.row(i).data(), l, delta);
    softmax_backward_apply(arch, pd.row(i).data(), dpd.row(i).data(), n, delta);
  }
  g.noalias() = dpb * kb;
  if (n > 0) g.noalias() += dpd * dict_k;
  dqh += s * g;
  for (Index i = 0; i < m; ++i)
    ds += static_cast<mixattn::detail::wide_t<T>>(qh.row(i).dot(g.row(i)));
  dkb.noalias() += s * (dpb.transpose() * qh);
  dvb.noalias() += pb.transpose() * dout;
  if (dict_grad && n > 0) {
    ddk.noalias() += s * (dpd.transpose() * qh);
    ddv.noalias() += pd.transpose() * dout;
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
