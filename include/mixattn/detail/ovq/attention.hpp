// mixattn/detail/ovq/attention.hpp — one query tile of OVQ attention, forward and backward
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
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/row_tiles.hpp"
#include "mixattn/detail/common/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// ConstMatrixRef under its old name, for the OVQ headers that still spell it so.
template <class T>
using CRef = ConstMatrixRef<T>;
template <class T>
using RowVec = Eigen::Matrix<T, 1, Eigen::Dynamic>;

/// Queries per tile: a 64 x (N + C) score tile stays in L2 at N = 1024 (float: 320 KiB) while
/// the GEMMs keep a full-width panel.
constexpr Index query_tile = 64;

/// Whether a forward tile of m queries runs on register tiles (tile_forward_tiled): SIMD builds,
/// and at least one vector of queries (a decoding call's single query keeps the GEMV path, which
/// transposes nothing).
template <class T>
constexpr bool uses_tiled_forward(Index m) {
  return MIXATTN_HAS_SIMD != 0 && m >= static_cast<Index>(simd_width<simd_arch, T>::value);
}

/// Per-call scratch, sized once for the largest tile.
template <class T>
struct AttentionScratch {
  Matrix<T> pd, pb;    // tile x N, tile x C: scores, then probabilities
  Matrix<T> dpd, dpb;  // backward: dP, then dZ
  Matrix<T> g;         // backward: tile x r
  Vector<T> inv;       // 1 / row sums
  // forward on register tiles (tile_forward_tiled): the tile's queries transposed (r x m',
  // m' = m rounded up to whole vectors) and its logits, then weights, transposed ((N + L) x m')
  Matrix<T> qt, st;
  // Eigen's GEMM mallocs its packing buffers above 128 KiB (a 64 x 1024 score tile at r = 64):
  // every product of a tile runs on these instead (gemm.hpp)
  GemmSpace<T> gemm;
  /// max_queries: the most queries of one call's block (a decoding call has one), so that a
  /// one-token call does not allocate a full tile.
  void reserve(Index dict_rows, Index block, Index key_dim, bool backward,
               Index max_queries = query_tile) {
    const Index tile = std::max<Index>(1, std::min({query_tile, block, max_queries}));
    pd.resize(tile, dict_rows);
    pb.resize(tile, block);
    inv.resize(tile);
    if (!backward && uses_tiled_forward<T>(tile)) {
      const Index padded = padded_to_vectors<T>(tile);
      qt.resize(key_dim, padded);
      st.resize(dict_rows + block, padded);
    }
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
bool tile_weights(const ConstMatrixRef<T>& qh, const ConstMatrixRef<T>& dict_k, const T* logc,
                  const ConstMatrixRef<T>& ko, const ConstMatrixRef<T>& kn, Index p0, T s,
                  AttentionScratch<T>& sc, bool check = false) {
  const Index m = qh.rows(), n = dict_k.rows(), lo = ko.rows(), l = lo + kn.rows();
  MIXATTN_ASSERT(l == p0 + m);
  Eigen::Ref<Matrix<T>> pd = sc.pd.topLeftCorner(m, n);
  Eigen::Ref<Matrix<T>> pb = sc.pb.topLeftCorner(m, l);
  if (n > 0) product_into<T>(pd, plain<T>(qh), transposed<T>(dict_k), T(1), false, sc.gemm);
  if (lo > 0)
    product_into<T>(pb.leftCols(lo), plain<T>(qh), transposed<T>(ko), T(1), false, sc.gemm);
  product_into<T>(pb.rightCols(l - lo), plain<T>(qh), transposed<T>(kn), T(1), false, sc.gemm);
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
void tile_weights(const ConstMatrixRef<T>& qh, const ConstMatrixRef<T>& dict_k, const T* logc,
                  const ConstMatrixRef<T>& kb, Index p0, T s, AttentionScratch<T>& sc) {
  tile_weights<T>(qh, dict_k, logc, kb.topRows(0), kb, p0, s, sc);
}

/// out (m x d_v) = softmax-weighted dictionary values plus block values (SPEC 2.2); the block in
/// two parts as in tile_weights (ko, vo: the state's pending keys and values; kn, vn: this
/// call's). Returns tile_weights' finiteness verdict. Eigen's products; tile_forward_tiled is
/// the same on register tiles.
template <class T>
bool tile_forward_gemm(const ConstMatrixRef<T>& qh, const ConstMatrixRef<T>& dict_k,
                       const ConstMatrixRef<T>& dict_v, const T* logc, const ConstMatrixRef<T>& ko,
                       const ConstMatrixRef<T>& vo, const ConstMatrixRef<T>& kn,
                       const ConstMatrixRef<T>& vn, Index p0, T s, AttentionScratch<T>& sc,
                       Eigen::Ref<Matrix<T>> out, bool check = false) {
  const Index m = qh.rows(), n = dict_k.rows(), lo = ko.rows(), l = lo + kn.rows();
  const bool finite = tile_weights<T>(qh, dict_k, logc, ko, kn, p0, s, sc, check);
  product_into<T>(out, plain<T>(sc.pb.topLeftCorner(m, l).rightCols(l - lo)), plain<T>(vn), T(1),
                  false, sc.gemm);
  if (lo > 0)
    product_into<T>(out, plain<T>(sc.pb.topLeftCorner(m, lo)), plain<T>(vo), T(1), true, sc.gemm);
  if (n > 0)
    product_into<T>(out, plain<T>(sc.pd.topLeftCorner(m, n)), plain<T>(dict_v), T(1), true,
                    sc.gemm);
  out.array().colwise() *= sc.inv.head(m).array();
  return finite;
}

#if MIXATTN_HAS_SIMD
/// One part of a tile's keys or values: `rows` rows of stride ld from p; for keys, the logit
/// bias (log counts, or null) and, for the block's keys, the block position of the first row
/// (causal mask; -1 for the dictionary).
template <class T>
struct TileRows {
  const T* p;
  Index ld, rows;
  const T* bias = nullptr;
  Index block_pos = -1;
};

/// tile_forward_tiled's logits: S^T = [D_k; K_o; K_n] Q_hat^T into st ((n + l) x mp, stride mp)
/// over panels of NV query vectors, each tile of R key rows scaled by s, given the count bias
/// and the block's causal mask, and each query's running max kept in colmax; with `check`,
/// probe collects x * 0 of every logit. qt: Q_hat^T (r x mp).
template <class T, class Arch>
MIXATTN_ALWAYS_INLINE void tile_logits_tiled(const TileRows<T> (&keys)[3], const T* qt, Index r,
                                             Index mp, Index p0, T s, T* st, T* colmax,
                                             xsimd::batch<T, Arch>& probe, bool check) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  constexpr int R = plain_tile_rows<Arch>(), NV = row_tile_vectors<Arch>();
  alignas(64) T lane[64];
  for (Index i = 0; i < Wd; ++i) lane[i] = static_cast<T>(i);
  const B neg_inf(-std::numeric_limits<T>::infinity()), scale(s), lanes = B::load_aligned(lane);
  Index row0 = 0;  // first row of the part in S^T
  for (const TileRows<T>& part : keys) {
    for (Index x0 = 0; x0 < part.rows; x0 += R)
      with_rows<R>(std::min<Index>(R, part.rows - x0), [&](auto rows_c) {
        constexpr int RR = decltype(rows_c)::value;
        over_column_tiles<NV, Arch, T>(mp, [&](Index c0, auto nv_c) {
          constexpr int NVp = decltype(nv_c)::value;
          B acc[RR][NVp];
          for (int i = 0; i < RR; ++i)
            for (int j = 0; j < NVp; ++j) acc[i][j] = B(T(0));
          read_accumulate<RR, NVp, Arch>(acc, part.p + x0 * part.ld, part.ld, qt, mp, r, c0);
          B mx[NVp];
          for (int j = 0; j < NVp; ++j) mx[j] = B::load_aligned(colmax + c0 + j * Wd);
          for (int i = 0; i < RR; ++i) {
            const B bias(part.bias != nullptr ? part.bias[x0 + i] : T(0));
            for (int j = 0; j < NVp; ++j) {
              B x = part.bias != nullptr ? xsimd::fma(acc[i][j], scale, bias) : acc[i][j] * scale;
              if (check) probe += x * B(T(0));
              if (part.block_pos >= 0) {
                // block key at position jp is visible to query i iff jp <= p0 + i
                const Index first = part.block_pos + x0 + i - p0 - c0 - j * Wd;
                if (first > 0) x = xsimd::select(lanes < B(static_cast<T>(first)), neg_inf, x);
              }
              x.store_unaligned(st + (row0 + x0 + i) * mp + c0 + j * Wd);
              // x first: the vector max returns its second operand when either is NaN, so a
              // NaN logit is passed over (its weight is NaN anyway) and the max stays the exact
              // max of the others; with NaN in the max, a later +inf could be missed and its
              // shifted logit be +inf, which double's exp converts to an out-of-range integer
              mx[j] = xsimd::max(x, mx[j]);
            }
          }
          for (int j = 0; j < NVp; ++j) mx[j].store_aligned(colmax + c0 + j * Wd);
        });
      });
    row0 += part.rows;
  }
}

/// tile_forward_tiled's weights: exp(S^T - column max) in place over the `rows` rows of st, the
/// column sums in W (lanes 0 .. W-lanes to lo, the rest to hi: add_wide keeps the lanes apart),
/// and the inverses of the first m sums into inv. In float, four rows are added in float before
/// one widening (as flash_exp_sum does): each group's sum of four weights in [0, 1] is within
/// 2 eps of exact, whatever the number of rows; widening was a quarter of the pass.
template <class T, class Arch>
MIXATTN_ALWAYS_INLINE void tile_weights_tiled(T* st, Index rows, Index mp, Index m, const T* colmax,
                                              T* inv) {
  using B = xsimd::batch<T, Arch>;
  using W = wide_t<T>;
  using BW = xsimd::batch<W, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size), WW = static_cast<Index>(BW::size);
  constexpr int NV = row_tile_vectors<Arch>();
  over_column_tiles<NV, Arch, T>(mp, [&](Index c0, auto nv_c) {
    constexpr int NVp = decltype(nv_c)::value;
    B mx[NVp];
    BW sum_lo[NVp], sum_hi[NVp];
    for (int j = 0; j < NVp; ++j) {
      mx[j] = B::load_aligned(colmax + c0 + j * Wd);
      sum_lo[j] = BW(W(0));
      sum_hi[j] = BW(W(0));
    }
    const auto weight = [&](Index x, int j) {
      T* at = st + x * mp + c0 + j * Wd;
      const B p = exp_shifted(B::load_unaligned(at), mx[j]);
      p.store_unaligned(at);
      return p;
    };
    Index x = 0;
    if constexpr (std::is_same<T, float>::value)
      for (; x + 4 <= rows; x += 4) {
        // the 4 x NVp weights' exponentials stage by stage, exp_interleave registers at a time
        // (fast_exp_nonpositive_many: exp_shifted's bits); the forward at T = 65536 3-5% faster
        // than with exp_shifted register by register (paired timings)
        B e[4 * NVp];
#pragma GCC unroll 16
        for (int k = 0; k < 4 * NVp; ++k)
          e[k] = B::load_unaligned(st + (x + k / NVp) * mp + c0 + (k % NVp) * Wd) - mx[k % NVp];
        constexpr int G = std::min(exp_interleave<Arch>(), 4 * NVp);
#pragma GCC unroll 16
        for (int g = 0; g + G <= 4 * NVp; g += G) fast_exp_nonpositive_many<G, Arch>(e + g);
        if constexpr ((4 * NVp) % G != 0)
          fast_exp_nonpositive_many<(4 * NVp) % G, Arch>(e + (4 * NVp) / G * G);
#pragma GCC unroll 16
        for (int k = 0; k < 4 * NVp; ++k)
          e[k].store_unaligned(st + (x + k / NVp) * mp + c0 + (k % NVp) * Wd);
#pragma GCC unroll 16
        for (int j = 0; j < NVp; ++j)
          add_wide<Arch, T>(sum_lo[j], sum_hi[j],
                            (e[j] + e[NVp + j]) + (e[2 * NVp + j] + e[3 * NVp + j]));
      }
    for (; x < rows; ++x)
#pragma GCC unroll 16
      for (int j = 0; j < NVp; ++j) add_wide<Arch, T>(sum_lo[j], sum_hi[j], weight(x, j));
    alignas(64) W sums[2 * 64];
    for (int j = 0; j < NVp; ++j) {
      sum_lo[j].store_aligned(sums);
      if (Wd > WW) sum_hi[j].store_aligned(sums + WW);
      for (Index e = 0; e < Wd; ++e) {
        const Index i = c0 + j * Wd + e;
        if (i < m) inv[i] = static_cast<T>(W(1) / sums[e]);
      }
    }
  });
}

/// tile_forward_tiled's read-out: o (m x d_v, stride ldo) = P [D_v; V_o; V_n], unscaled, over
/// chunks of value rows that stay in L1 (64 rows: 16 KiB at d_v = 64 in float), the weights
/// broadcast from the transposed tile st (stride mp).
template <class T, class Arch>
MIXATTN_ALWAYS_INLINE void tile_readout_tiled(const TileRows<T> (&vals)[3], const T* st, Index mp,
                                              Index m, Index d_v, T* o, Index ldo) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  constexpr int R = plain_tile_rows<Arch>(), NV = row_tile_vectors<Arch>();
  constexpr Index chunk = 64;
  bool first = true;
  Index row0 = 0;
  for (const TileRows<T>& part : vals) {
    for (Index x0 = 0; x0 < part.rows; x0 += chunk) {
      const Index depth = std::min(chunk, part.rows - x0);
      const T* v = part.p + x0 * part.ld;
      const T* w = st + (row0 + x0) * mp;
      for (Index i0 = 0; i0 < m; i0 += R)
        with_rows<R>(std::min<Index>(R, m - i0), [&](auto rows_c) {
          constexpr int RR = decltype(rows_c)::value;
          const Index tail = over_column_tiles<NV, Arch, T>(d_v, [&](Index c0, auto nv_c) {
            constexpr int NVp = decltype(nv_c)::value;
            B acc[RR][NVp];
            for (int i = 0; i < RR; ++i)
              for (int j = 0; j < NVp; ++j)
                acc[i][j] = first ? B(T(0)) : B::load_unaligned(o + (i0 + i) * ldo + c0 + j * Wd);
            read_accumulate<RR, NVp, Arch>(acc, w + i0, 1, v, part.ld, depth, c0, mp);
            for (int i = 0; i < RR; ++i)
              for (int j = 0; j < NVp; ++j)
                acc[i][j].store_unaligned(o + (i0 + i) * ldo + c0 + j * Wd);
          });
          for (Index c = tail; c < d_v; ++c)
            for (int i = 0; i < RR; ++i) {
              T sum = first ? T(0) : o[(i0 + i) * ldo + c];
              for (Index k = 0; k < depth; ++k)
                sum = std::fma(w[k * mp + i0 + i], v[k * part.ld + c], sum);
              o[(i0 + i) * ldo + c] = sum;
            }
        });
      first = false;
    }
    row0 += part.rows;
  }
}

/// tile_forward on register tiles, for m >= one vector of queries. The logits are computed
/// transposed, S^T = [D_k; K_o; K_n] Q_hat^T ((N + L) x m'), as row_tiles' read: each key row
/// broadcast against vectors of queries, so that a tile of R keys x NV query vectors stays in
/// registers over the r products and nothing of the dictionary is packed or transposed (only
/// the tile's m x r queries are). The epilogue scales, adds the count bias, masks the block's
/// future keys to -inf and keeps each query's running max in a vector lane; exp and the wide
/// row sums then run down the columns; the read-out O = P [D_v; V_o; V_n] broadcasts weights
/// from the transposed tile over chunks of value rows that stay in L1.
template <class T, class Arch = simd_arch>
bool tile_forward_tiled(const ConstMatrixRef<T>& qh, const ConstMatrixRef<T>& dict_k,
                        const ConstMatrixRef<T>& dict_v, const T* logc, const ConstMatrixRef<T>& ko,
                        const ConstMatrixRef<T>& vo, const ConstMatrixRef<T>& kn,
                        const ConstMatrixRef<T>& vn, Index p0, T s, AttentionScratch<T>& sc,
                        Eigen::Ref<Matrix<T>> out, bool check = false) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  const Index m = qh.rows(), r = qh.cols(), n = dict_k.rows(), lo = ko.rows(), l = lo + kn.rows();
  const Index mp = padded_to_vectors<T>(m);
  MIXATTN_ASSERT(l == p0 + m && m >= Wd && mp <= sc.st.cols() && n + l <= sc.st.rows());
  MIXATTN_ASSERT(sc.qt.rows() >= r && sc.qt.cols() >= mp);
  T* const qt = sc.qt.data();  // r x mp, stride mp
  T* const st = sc.st.data();  // (n + l) x mp, stride mp
  transpose_padded<T>(qh, qt, mp);
  alignas(64) T colmax[query_tile + 64];
  for (Index i = 0; i < mp; ++i) colmax[i] = -std::numeric_limits<T>::infinity();
  B probe(T(0));  // x * 0 is 0 for finite x, NaN otherwise
  const TileRows<T> keys[3] = {{dict_k.data(), dict_k.outerStride(), n, logc, -1},
                               {ko.data(), ko.outerStride(), lo, nullptr, 0},
                               {kn.data(), kn.outerStride(), l - lo, nullptr, lo}};
  tile_logits_tiled<T, Arch>(keys, qt, r, mp, p0, s, st, colmax, probe, check);
  tile_weights_tiled<T, Arch>(st, n + l, mp, m, colmax, sc.inv.data());
  const TileRows<T> vals[3] = {{dict_v.data(), dict_v.outerStride(), n},
                               {vo.data(), vo.outerStride(), lo},
                               {vn.data(), vn.outerStride(), l - lo}};
  tile_readout_tiled<T, Arch>(vals, st, mp, m, out.cols(), out.data(), out.outerStride());
  out.array().colwise() *= sc.inv.head(m).array();
  if (!check) return true;
  alignas(64) T pr[64];
  probe.store_aligned(pr);
  T total = 0;
  for (Index e = 0; e < Wd; ++e) total += pr[e];
  return total == T(0);
}
#endif

/// out (m x d_v) as tile_forward_gemm, on register tiles when the tile has a vector of queries.
template <class T>
bool tile_forward(const ConstMatrixRef<T>& qh, const ConstMatrixRef<T>& dict_k,
                  const ConstMatrixRef<T>& dict_v, const T* logc, const ConstMatrixRef<T>& ko,
                  const ConstMatrixRef<T>& vo, const ConstMatrixRef<T>& kn,
                  const ConstMatrixRef<T>& vn, Index p0, T s, AttentionScratch<T>& sc,
                  Eigen::Ref<Matrix<T>> out, bool check = false) {
#if MIXATTN_HAS_SIMD
  if (uses_tiled_forward<T>(qh.rows()) && sc.st.cols() >= padded_to_vectors<T>(qh.rows()) &&
      sc.st.rows() >= dict_k.rows() + ko.rows() + kn.rows() && sc.qt.rows() >= qh.cols())
    return tile_forward_tiled<T>(qh, dict_k, dict_v, logc, ko, vo, kn, vn, p0, s, sc, out, check);
#endif
  return tile_forward_gemm<T>(qh, dict_k, dict_v, logc, ko, vo, kn, vn, p0, s, sc, out, check);
}

/// Backward of one tile given dO (m x d_v): with P the probabilities, dP = dO V^T,
/// dZ = P o (dP - rowsum(P o dP)), G = dZ_dict D_k + dZ_block K:
///   dq_hat = s G,  ds += sum_l q_hat_l . G_l,  dK_block += s dZ_block^T Q_hat,
///   dV_block += P_block^T dO,  and, when `dict_grad`, dD_k += s dZ_dict^T Q_hat,
///   dD_v += P_dict^T dO.
/// dkb, dvb: L x r, L x d_v accumulators (rows of the block); ddk, ddv: N x r, N x d_v.
template <class T>
void tile_backward(const ConstMatrixRef<T>& qh, const ConstMatrixRef<T>& dict_k,
                   const ConstMatrixRef<T>& dict_v, const T* logc, const ConstMatrixRef<T>& kb,
                   const ConstMatrixRef<T>& vb, Index p0, T s, const ConstMatrixRef<T>& dout,
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
  GemmSpace<T>& space = sc.gemm;
  product_into<T>(dpb, plain<T>(dout), transposed<T>(vb), T(1), false, space);
  if (n > 0) {
    pd = sc.inv.head(m).asDiagonal() * pd;
    product_into<T>(dpd, plain<T>(dout), transposed<T>(dict_v), T(1), false, space);
  }
  const mixattn::detail::simd_arch arch{};
  for (Index i = 0; i < m; ++i) {
    // delta_i = sum_j P_ij dP_ij over both parts; masked entries have P = 0.
    const T delta = static_cast<T>(row_dot(arch, pb.row(i).data(), dpb.row(i).data(), l) +
                                   row_dot(arch, pd.row(i).data(), dpd.row(i).data(), n));
    softmax_backward_apply(arch, pb.row(i).data(), dpb.row(i).data(), l, delta);
    softmax_backward_apply(arch, pd.row(i).data(), dpd.row(i).data(), n, delta);
  }
  product_into<T>(g, plain<T>(dpb), plain<T>(kb), T(1), false, space);
  if (n > 0) product_into<T>(g, plain<T>(dpd), plain<T>(dict_k), T(1), true, space);
  dqh += s * g;
  for (Index i = 0; i < m; ++i)
    ds += static_cast<mixattn::detail::wide_t<T>>(qh.row(i).dot(g.row(i)));
  product_into<T>(dkb, transposed<T>(dpb), plain<T>(qh), s, true, space);
  product_into<T>(dvb, transposed<T>(pb), plain<T>(dout), T(1), true, space);
  if (dict_grad && n > 0) {
    product_into<T>(ddk, transposed<T>(dpd), plain<T>(qh), s, true, space);
    product_into<T>(ddv, transposed<T>(pd), plain<T>(dout), T(1), true, space);
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
