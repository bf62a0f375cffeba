// mixattn/detail/reference/flash.hpp — tiled softmax attention with an online softmax
// (FlashAttention-2 schedule), forward and backward. SPEC.md §3.
//
// Internal: included by mixattn/reference.hpp, which validates every argument first. The kernels
// assume valid shapes, finite inputs, M >= 1 whenever N >= 1, and N == M when causal.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/fast_exp.hpp"
#include "mixattn/detail/common/softmax.hpp"
#include "mixattn/reference_types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Tile sizes, fixed at compile time. A query tile of `queries` rows meets a key tile of `keys`
/// rows; the score tile (queries x keys) and its operand tiles stay in L2. The forward's query
/// tile is a whole number of its register tiles (6 rows with AVX-512, 4 otherwise). Each query
/// tile streams all of K^T and V once (2 MiB at N = 4096, r = d_v = 64, float), so a taller
/// query tile pays off, up to about 200 rows (at N = 16384, 96 rows lose 2-4% to 192); beyond,
/// the rate is flat and only the causal diagonal tiles' masked work grows. The forward's key
/// tile is 384 KiB of scores (float 192 x 512, double 192 x 256, within a 1 MiB L2): each key
/// tile costs every row a max, a rescale and the start of an exp pass: in float, 512 keys beat
/// 256 by 1-2% at N = 4096 (paired timings) and by 10% with a sliding window of 256 keys, where
/// a query tile's keys then fit one key tile. The backward's tile products are Eigen GEMMs, each
/// large enough (>= 64 on each side) to run near their peak; double's backward prefers the
/// shorter key tile, whose dK/dV accumulators stay resident (the sweeps: bench/results/tuning.md,
/// "Flash attention tiles").
template <class T>
struct FlashTiles {
  static constexpr Index forward_queries = 192;
  static constexpr Index forward_keys = std::is_same<T, double>::value ? 256 : 512;
  static constexpr Index backward_queries = 64;
  static constexpr Index backward_keys = std::is_same<T, double>::value ? 128 : 256;
};

/// Columns c of a score tile whose key j0 + c lies after query i (causal mask, inclusive j <= i)
/// start at c = i - j0 + 1. Returns how many leading columns of the row are visible, in [0, bc].
inline Index visible_columns(Index i, Index j0, Index bc) {
  return std::clamp<Index>(i - j0 + 1, 0, bc);
}

/// Sliding window of w keys (SPEC §7: query i sees i - w < j <= i): the first column of a score
/// tile whose key j0 + c is inside query i's window, c = i - w + 1 - j0, clamped to [0, visible]
/// (visible: the row's count from visible_columns). Columns [first, visible) are the row's keys.
inline Index window_first_column(Index i, Index j0, Index window, Index visible) {
  return std::clamp<Index>(i - window + 1 - j0, 0, visible);
}

/// One key tile of one query tile, keys [j0, j0 + bc) for queries [i0, i0 + br), and the masks
/// its rows need: with causal tiles cut at the query tile's last query only a diagonal tile is
/// masked, and with a window (SPEC §7) only a trailing tile, one that holds keys before the
/// window of the query tile's last query. Every tiled kernel, forward and backward, reads its
/// rows' visible keys from here.
struct FlashTile {
  Index i0, br, j0, bc, window;
  bool diagonal, trailing;
  FlashTile(Index i0_, Index br_, Index j0_, Index bc_, bool causal, Index window_)
      : i0(i0_),
        br(br_),
        j0(j0_),
        bc(bc_),
        window(window_),
        diagonal(causal && j0_ + bc_ - 1 > i0_),
        trailing(window_ > 0 && j0_ < i0_ + br_ - window_) {}
  /// Row t's visible keys are the tile's columns [first(t, visible(t)), visible(t)).
  Index visible(Index t) const { return diagonal ? visible_columns(i0 + t, j0, bc) : bc; }
  Index first(Index t, Index visible) const {
    return trailing ? window_first_column(i0 + t, j0, window, visible) : 0;
  }
};

/// The keys [begin, end) the forwards visit for a query tile [i0, i0 + br): causal, key tiles
/// wholly after the tile's last query are skipped (the last one is cut at it); with a window,
/// the keys before the window of the tile's first query.
struct FlashKeyRange {
  Index i0, br, begin, end, window;
  bool causal;
  FlashKeyRange(Index i0_, Index br_, Index m_keys, bool causal_, Index window_)
      : i0(i0_),
        br(br_),
        begin(window_ > 0 ? std::max<Index>(0, i0_ - window_ + 1) : 0),
        end(causal_ ? i0_ + br_ : m_keys),
        window(window_),
        causal(causal_) {}
  /// The key tile from j0, at most `width` keys.
  FlashTile tile(Index j0, Index width) const {
    return FlashTile(i0, br, j0, std::min(width, end - j0), causal, window);
  }
};

/// The forward's schedule and masks, with Eigen products on every tile: the kernel of builds
/// without SIMD (scalar_arch). Same contract as flash_forward_tiles below.
template <class T, Index BlockQ, Index BlockK>
void flash_forward_tiles_eigen(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                               const ConstMatrixRef<T>& v, T scale, bool causal, Matrix<T>& out,
                               Vector<T>& lse, FlashScratch<T>& scratch, Index window = 0) {
  const Index n = q.rows(), m_keys = k.rows(), r = q.cols();
  const T neg_inf = -std::numeric_limits<T>::infinity();
  MIXATTN_ASSERT(out.rows() == n && out.cols() == v.cols() && lse.size() == n);
  MIXATTN_ASSERT(!causal || n == m_keys);
  MIXATTN_ASSERT(window >= 0 && (window == 0 || causal));

  using RowMap = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>;
  using W = mixattn::detail::wide_t<T>;
  const mixattn::detail::simd_arch arch{};
  Matrix<T>& qs = scratch.qs;  // scale * query tile, so the score GEMM needs no rescale
  Matrix<T>& s = scratch.s;    // scores, then probabilities, of one tile
  Vector<T>& row_max = scratch.row_max;
  Vector<W>& row_sum = scratch.row_sum;
  qs.resize(BlockQ, r);
  s.resize(BlockQ, BlockK);
  row_max.resize(BlockQ);
  row_sum.resize(BlockQ);

  for (Index i0 = 0; i0 < n; i0 += BlockQ) {
    const Index br = std::min(BlockQ, n - i0);
    qs.topRows(br) = scale * q.middleRows(i0, br);
    row_max.head(br).setConstant(neg_inf);
    row_sum.head(br).setZero();
    MatrixRef<T> o = out.middleRows(i0, br);
    o.setZero();

    const FlashKeyRange keys(i0, br, m_keys, causal, window);
    for (Index j0 = keys.begin; j0 < keys.end; j0 += BlockK) {
      const FlashTile tile = keys.tile(j0, BlockK);
      const Index bc = tile.bc;
      MatrixRef<T> st = s.topLeftCorner(br, bc);
      st.noalias() = qs.topRows(br) * k.middleRows(j0, bc).transpose();
      for (Index t = 0; t < br; ++t) {
        const Index visible = tile.visible(t), first = tile.first(t, visible);
        // Masked keys get probability 0 in the tile that feeds the P V product (set, not
        // computed: Eigen's vectorised exp clamps its argument, exp(-inf) is a denormal).
        RowMap(&st(t, 0) + visible, bc - visible).setZero();
        if (first > 0) RowMap(&st(t, 0), first).setZero();
        if (visible == first) continue;  // nothing visible in this tile: state unchanged
        T* seen = &st(t, first);
        const Index count = visible - first;
        const T new_max =
            mixattn::detail::max_keep_nan(row_max[t], mixattn::detail::row_max(arch, seen, count));
        // new_max is finite (finite scores); the old max may still be -inf on the first visible
        // tile, where exp(-inf - finite) = 0 correctly discards the empty history and no
        // -inf - -inf can arise.
        const T alpha = std::exp(row_max[t] - new_max);
        row_sum[t] =
            static_cast<W>(alpha) * row_sum[t] + exp_shifted_sum(arch, seen, count, new_max);
        if (alpha != T(1)) o.row(t) *= alpha;
        row_max[t] = new_max;
      }
      o.noalias() += st * v.middleRows(j0, bc);
    }

    for (Index t = 0; t < br; ++t) {
      // row_sum >= 1 (the max term contributes exp(0)) whenever a key was visible; NaN only
      // from non-finite input the caller chose not to check.
      MIXATTN_ASSERT(!(row_sum[t] < W(1)));
      o.row(t) *= static_cast<T>(W(1) / row_sum[t]);
      lse[i0 + t] = static_cast<T>(static_cast<W>(row_max[t]) + std::log(row_sum[t]));
    }
  }
}

#if MIXATTN_HAS_SIMD
/// Register tile of the forward's two tile products for Arch: `rows` query rows by `vectors`
/// registers of columns (keys for S, output dims for P V) of accumulators, plus `vectors` loads
/// and a broadcast, must fit the register file (AVX-512: 6 x 4 + 5 of 32; AVX2/SSE: 6 x 2 + 3
/// of 16, which ran 1.3x faster than 4 x 3 + 4 on Zen 3: bench/results/tuning.md, "Register
/// tiles on 16 registers").
template <class Arch>
struct FlashRegisterTile {
  static constexpr int rows = 6;
  static constexpr int vectors = simd_registers<Arch>() >= 32 ? 4 : 2;
};

/// s[m][c] = sum_l qs[m][l] k[c][l] for m < MR, c < NV registers of keys: one register tile of
/// S = Qs K^T, the reduction over l < r kept in registers. qs: MR rows of stride ldq; kt: NV
/// consecutive key blocks of flash_forward_tiles_simd's K^T layout (block c, lane e, dim l at
/// kt[(c r + l) Wd + e]); s: stride lds.
///
/// vmax (unless nullptr): one register of lanes per row m, at vmax + m Wd, that takes the lane
/// max of the row's new scores, the row max taken while they are in registers instead of in a
/// pass that reads the score tile again. A lane that has seen a NaN score stays NaN (the vector
/// max alone could drop it, and with it the true max).
template <int MR, int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void flash_score_tile(Arch, const T* qs, Index ldq, const T* kt, Index r,
                                            T* s, Index lds, T* vmax) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NV; ++c) acc[m][c] = B(T(0));
  const Index block = r * Wd;
  for (Index l = 0; l < r; ++l) {
    B b[NV];
    for (int c = 0; c < NV; ++c) b[c] = B::load_unaligned(kt + c * block + l * Wd);
    for (int m = 0; m < MR; ++m) {
      const B a(qs[m * ldq + l]);
      for (int c = 0; c < NV; ++c) acc[m][c] = xsimd::fma(a, b[c], acc[m][c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NV; ++c) acc[m][c].store_unaligned(s + m * lds + c * Wd);
  if (vmax != nullptr)
    for (int m = 0; m < MR; ++m) {
      // The vector max returns its second operand when either is NaN: the running lanes, second,
      // keep a NaN once they hold one, and a NaN among the new scores is found by a compare.
      // On Zen 5 a compare takes an FMA port and a max or an add does not: with a compare per
      // register this epilogue cost 5% of the tile's time, with one per pair of registers
      // (through their sum: NaN exactly when either is NaN or they hold infinities of both
      // signs, i.e. a row with a +inf score, whose result is NaN anyway) 1.5%.
      const B* a = acc[m];
      const auto nan_in = [a](int c) { return xsimd::isnan(c + 1 < NV ? a[c] + a[c + 1] : a[c]); };
      B mx = a[0];
      for (int c = 1; c < NV; ++c) mx = xsimd::max(mx, a[c]);
      auto bad = nan_in(0);
      for (int c = 2; c < NV; c += 2) bad = bad | nan_in(c);
      const B running = xsimd::max(mx, B::load_unaligned(vmax + m * Wd));
      xsimd::select(bad, B(std::numeric_limits<T>::quiet_NaN()), running)
          .store_unaligned(vmax + m * Wd);
    }
}

/// o[m][d] = alpha[m] o[m][d] + sum_{j < kc} p[m][j] v[j][d] for m < MR, d < NV registers of
/// dims (alpha == nullptr: no rescale): one register tile of O = diag(alpha) O + P V. p: stride
/// ldp; v: rows of stride ldv (dims contiguous); o: stride ldo.
template <int MR, int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void flash_pv_tile(Arch, const T* p, Index ldp, const T* v, Index ldv,
                                         Index kc, T* o, Index ldo, const T* alpha) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int d = 0; d < NV; ++d) acc[m][d] = B::load_unaligned(o + m * ldo + d * Wd);
  if (alpha != nullptr)
    for (int m = 0; m < MR; ++m) {
      const B a(alpha[m]);
      for (int d = 0; d < NV; ++d) acc[m][d] *= a;
    }
  for (Index j = 0; j < kc; ++j) {
    B b[NV];
    for (int d = 0; d < NV; ++d) b[d] = B::load_unaligned(v + j * ldv + d * Wd);
    for (int m = 0; m < MR; ++m) {
      const B a(p[m * ldp + j]);
      for (int d = 0; d < NV; ++d) acc[m][d] = xsimd::fma(a, b[d], acc[m][d]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int d = 0; d < NV; ++d) acc[m][d].store_unaligned(o + m * ldo + d * Wd);
}

/// s[j] = exp(s[j] - shift) in place for j < n, and their sum in wide_t<T>: softmax.hpp's
/// exp_shifted_sum in one pass. double: each exponential widened from its register as it is
/// made. float: fast_exp_nonpositive_many over exp_interleave registers in lockstep (the shifted
/// logits are <= 0, or NaN; 8 registers: the forward 3% faster than register by register, 1%
/// faster than 4 at a time, paired timings at N = 4096), and each group of four registers is
/// added in float, pairwise, before one widening: two roundings, at most 2^-23 of the group's
/// sum (4 positive terms per lane), a bound independent of n; the sum across groups, where float
/// would drift with n, stays wide. The widening (two conversions, an extract and two adds) was
/// otherwise a third of this pass's instructions.
template <class Arch, class T>
inline wide_t<T> flash_exp_sum(Arch, T* s, Index n, T shift) {
  using W = wide_t<T>;
  using B = xsimd::batch<T, Arch>;
  using BW = xsimd::batch<W, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  const B sh(shift);
  BW lo(W(0)), hi(W(0));
  Index j = 0;
  if constexpr (std::is_same<T, float>::value) {
    // G registers' exponentials stage by stage (the same bits as one by one), then their sums
    // in groups of four
    constexpr int G = exp_interleave<Arch>();
    const auto exp_group = [&](auto g_c) {
      constexpr int NG = decltype(g_c)::value;
      B e[NG];
#pragma GCC unroll 16
      for (int k = 0; k < NG; ++k) e[k] = B::load_unaligned(s + j + k * Wd) - sh;
      fast_exp_nonpositive_many<NG, Arch>(e);
#pragma GCC unroll 16
      for (int k = 0; k < NG; ++k) e[k].store_unaligned(s + j + k * Wd);
#pragma GCC unroll 4
      for (int k = 0; k + 4 <= NG; k += 4)
        add_wide<Arch, T>(lo, hi, (e[k] + e[k + 1]) + (e[k + 2] + e[k + 3]));
      if constexpr (NG == 1) add_wide<Arch, T>(lo, hi, e[0]);
      j += NG * Wd;
    };
    while (j + G * Wd <= n) exp_group(std::integral_constant<int, G>{});
    if constexpr (G > 4)
      if (j + 4 * Wd <= n) exp_group(std::integral_constant<int, 4>{});
    while (j + Wd <= n) exp_group(std::integral_constant<int, 1>{});
  } else {
    for (; j + Wd <= n; j += Wd) {
      const B e = exp_shifted(B::load_unaligned(s + j), sh);
      e.store_unaligned(s + j);
      add_wide<Arch, T>(lo, hi, e);
    }
  }
  W sum = xsimd::hadd(lo + hi);
  for (; j < n; ++j) {
    s[j] = std::exp(std::max(s[j] - shift, T(-800)));  // clamped as exp_shifted is
    sum += static_cast<W>(s[j]);
  }
  return sum;
}

/// The SIMD forward's compile-time shape for (Arch, T) and its tile sizes.
template <class Arch, class T, Index BlockQ, Index BlockK>
struct FlashSimdShape {
  using B = xsimd::batch<T, Arch>;
  static constexpr Index Wd = static_cast<Index>(B::size);
  static constexpr int MR = FlashRegisterTile<Arch>::rows, NV = FlashRegisterTile<Arch>::vectors;
  /// Columns of one register tile: keys of a score tile, output dims of a P V tile.
  static constexpr Index TileCols = NV * Wd;
  static constexpr Index BQp = (BlockQ + MR - 1) / MR * MR;  // query tile in whole register tiles
  /// Key tile in whole register tiles, from the register block of its first key (up to Wd - 1
  /// keys before it, when the tile starts off a block: windows and small tiles).
  static constexpr Index BKp = (BlockK + Wd - 1 + TileCols - 1) / TileCols * TileCols;
};

/// K^T in key blocks of one register: block b holds keys [b Wd, (b + 1) Wd) as r rows of Wd lanes
/// (r Wd contiguous values), zero beyond M. A score register tile's NV blocks are then one
/// contiguous stretch of NV r Wd values, streamed in order (no 4 KiB strides, few pages). A tile
/// of keys from j0 reads blocks from j0 / Wd up to column j0 + bc - 1 + TileCols - 1
/// <= M + TileCols - 2.
template <Index Wd, Index TileCols, class T>
MIXATTN_ALWAYS_INLINE void flash_layout_keys(const ConstMatrixRef<T>& k, Index r, Matrix<T>& kt) {
  const Index m_keys = k.rows();
  const Index key_blocks = (m_keys + TileCols + Wd - 1) / Wd;
  kt.resize(key_blocks, r * Wd);
  for (Index b = 0; b < key_blocks; ++b) {
    T* dst = kt.data() + b * r * Wd;
    const Index lanes = std::clamp<Index>(m_keys - b * Wd, 0, Wd);
    for (Index c = 0; c < lanes; ++c) {
      const T* src = k.data() + (b * Wd + c) * k.outerStride();
      for (Index l = 0; l < r; ++l) dst[l * Wd + c] = src[l];
    }
    for (Index c = lanes; c < Wd; ++c)
      for (Index l = 0; l < r; ++l) dst[l * Wd + c] = T(0);
  }
}

/// V as the P V tiles read it (dvp columns, ldv apart): v itself when d_v is a whole number of
/// registers (dvp == d_v), else a copy padded with zero dims.
template <class T>
MIXATTN_ALWAYS_INLINE const T* flash_padded_values(const ConstMatrixRef<T>& v, Index dvp,
                                                   Matrix<T>& padded, Index& ldv) {
  ldv = v.outerStride();
  if (v.cols() == dvp) return v.data();
  const Index dv = v.cols();
  padded.resize(v.rows(), dvp);
  padded.leftCols(dv) = v;
  padded.rightCols(dvp - dv).setZero();
  ldv = dvp;
  return padded.data();
}

/// O[:, d0 .. d0 + nb registers) (+)= P V over one chunk of kc keys for the brp rows of a query
/// tile, nb <= NV dispatched to a register tile of that width; al: the rows' rescale exp(m - m')
/// (the first chunk of a key tile) or null. o, vc: already offset to column d0.
template <int MR, int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void flash_pv_rows(Arch arch, Index brp, const T* p, Index ldp, const T* vc,
                                         Index ldv, Index kc, T* o, Index ldo, Index nb,
                                         const T* al) {
  for (Index m0 = 0; m0 < brp; m0 += MR) {
    const T* pm = p + m0 * ldp;
    T* om = o + m0 * ldo;
    const T* am = al != nullptr ? al + m0 : nullptr;
    if (nb == NV)
      flash_pv_tile<MR, NV>(arch, pm, ldp, vc, ldv, kc, om, ldo, am);
    else if (NV > 2 && nb == 2)
      flash_pv_tile<MR, (NV > 2 ? 2 : NV)>(arch, pm, ldp, vc, ldv, kc, om, ldo, am);
    else if (NV > 3 && nb == 3)
      flash_pv_tile<MR, (NV > 3 ? 3 : NV)>(arch, pm, ldp, vc, ldv, kc, om, ldo, am);
    else
      flash_pv_tile<MR, 1>(arch, pm, ldp, vc, ldv, kc, om, ldo, am);
  }
}

/// The rows' maxima over one key tile, into next_max (max with the running max row_max): from
/// the score tiles' registers (vmax, lane maxima of each row) when every computed score is a
/// visible key's, else over each row's visible keys, whose masked keys get probability 0 in the
/// tile that feeds the P V product (set, not computed: exp(-inf) must not reach the vectorised
/// exp). s: the tile's scores from column off (the tile's first key), ldp apart.
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void flash_tile_maxima(Arch arch, const FlashTile& tile, T* s, Index ldp,
                                             const T* vmax, const T* row_max, T* next_max) {
  using B = xsimd::batch<T, Arch>;
  using RowMap = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>;
  constexpr Index Wd = static_cast<Index>(B::size);
  for (Index t = 0; t < tile.br; ++t) {
    T tile_max;
    if (vmax != nullptr) {
      const B lanes = B::load_unaligned(vmax + t * Wd);
      tile_max = xsimd::any(xsimd::isnan(lanes)) ? std::numeric_limits<T>::quiet_NaN()
                                                 : mixattn::detail::reduce_max(lanes);
    } else {
      const Index visible = tile.visible(t), first = tile.first(t, visible);
      T* st = s + t * ldp;
      RowMap(st + visible, tile.bc - visible).setZero();
      if (first > 0) RowMap(st, first).setZero();
      // nothing visible in this tile: -inf, the state is left unchanged below
      tile_max = mixattn::detail::row_max(arch, st + first, visible - first);
    }
    next_max[t] = mixattn::detail::max_keep_nan(row_max[t], tile_max);
  }
}

/// The online softmax's step over one key tile, after its maxima: the rows' rescales
/// alpha = exp(m - m') in registers of rows, then their exp passes, which depend on no other
/// row's and overlap (with the maxima from the score tiles this gained 2-4% at N = 4096 over a
/// max pass, a scalar exp and the exp pass row by row). next_max is finite (finite scores) on a
/// row that saw a key; the old max may still be -inf on the first visible tile, where
/// exp(-inf - finite) = 0 correctly discards the empty history. A row that has seen no key yet
/// gives -inf - -inf here, replaced by 1 below.
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void flash_tile_rescale(Arch arch, const FlashTile& tile, T* s, Index ldp,
                                              const T* next_max, T* row_max, wide_t<T>* row_sum,
                                              T* alpha) {
  using B = xsimd::batch<T, Arch>;
  using W = wide_t<T>;
  constexpr Index Wd = static_cast<Index>(B::size);
  const Index br = tile.br;
  Index t = 0;
  for (; t + Wd <= br; t += Wd)
    exp_shifted(B::load_unaligned(row_max + t), B::load_unaligned(next_max + t))
        .store_unaligned(alpha + t);
  for (; t < br; ++t) alpha[t] = std::exp(row_max[t] - next_max[t]);
  for (t = 0; t < br; ++t) {
    const Index visible = tile.visible(t), first = tile.first(t, visible);
    if (visible == first) {  // nothing visible in this tile: state unchanged
      alpha[t] = T(1);
      continue;
    }
    T* seen = s + t * ldp + first;
    row_sum[t] = static_cast<W>(alpha[t]) * row_sum[t] +
                 flash_exp_sum(arch, seen, visible - first, next_max[t]);
    row_max[t] = next_max[t];
  }
}

/// One key tile of the SIMD forward for the brp (padded) rows of a query tile: its scores on
/// register tiles, the rows' maxima, the online-softmax step and O = diag(alpha) O + P V, the
/// rescale riding on the first chunk of keys. KC: keys per chunk of the P V product, whose V
/// rows (KC x d_v) stay in L1 across the row tiles; 128 beat 64 and 256 by ~5% at d_v = 64.
template <class Shape, Index KC, class Arch, class T>
MIXATTN_ALWAYS_INLINE void flash_forward_key_tile(Arch arch, const FlashTile& tile, Index brp,
                                                  Index r, const T* vp, Index ldv, Index dvp,
                                                  FlashScratch<T>& scratch) {
  constexpr Index Wd = Shape::Wd, TileCols = Shape::TileCols, BKp = Shape::BKp;
  constexpr int MR = Shape::MR, NV = Shape::NV;
  const Index j0 = tile.j0, bc = tile.bc;
  const Index off = j0 % Wd;  // score column c is key j0 - off + c
  const T* ktb = scratch.kt.data() + (j0 - off) * r;
  T* const s = scratch.s.data();
  // Every score the register tiles compute is a visible key's: the row maxima are taken in the
  // score tiles' registers. Otherwise a row's max is taken over its visible keys only.
  const bool whole = !tile.diagonal && !tile.trailing && off == 0 && bc % TileCols == 0;
  T* const vmax = whole ? scratch.lane_max.data() : nullptr;
  if (whole) scratch.lane_max.topRows(brp).setConstant(-std::numeric_limits<T>::infinity());
  for (Index c0 = 0; c0 < off + bc; c0 += TileCols)
    for (Index m0 = 0; m0 < brp; m0 += MR)
      flash_score_tile<MR, NV>(arch, scratch.qs.data() + m0 * r, r, ktb + c0 * r, r,
                               s + m0 * BKp + c0, BKp, whole ? vmax + m0 * Wd : nullptr);
  flash_tile_maxima(arch, tile, s + off, BKp, vmax, scratch.row_max.data(),
                    scratch.next_max.data());
  flash_tile_rescale(arch, tile, s + off, BKp, scratch.next_max.data(), scratch.row_max.data(),
                     scratch.row_sum.data(), scratch.alpha.data());
  for (Index d0 = 0; d0 < dvp; d0 += TileCols) {
    const Index nb = std::min<Index>(NV, (dvp - d0) / Wd);
    for (Index c0 = 0; c0 < bc; c0 += KC)
      flash_pv_rows<MR, NV>(arch, brp, s + off + c0, BKp, vp + (j0 + c0) * ldv + d0, ldv,
                            std::min(KC, bc - c0), scratch.o.data() + d0, dvp, nb,
                            c0 == 0 ? scratch.alpha.data() : nullptr);
  }
}

/// The SIMD forward (flash_forward_tiles' contract). Both tile products run on register tiles
/// (flash_score_tile, flash_pv_tile) over operands laid out once per call, instead of a GEMM
/// call per tile that packs its operands again each time (K and V are re-read by every query
/// tile):
/// - K^T in key blocks of one register width (flash_layout_keys): a score tile's columns are one
///   load per register for any first key (a tile starting off a block computes up to Wd - 1 keys
///   before it, never read: windows and small tiles).
/// - V as given when d_v is a multiple of the register width, else a copy padded with zero dims.
/// - The row maxima of a key tile whose computed scores are all visible (no mask, no keys before
///   or after the tile) are taken in the score tiles' registers (flash_score_tile's vmax); the
///   masked tiles take them from the stored scores of the visible keys.
/// The query tile (scaled, padded with zero rows to a multiple of the register tile) and its
/// score tile (padded to whole register tiles of keys) live in scratch; the output tile is
/// accumulated in scratch and rescaled by exp(m - m') inside the P V tile, on its first chunk
/// of keys. Keys beyond a tile's bc are computed in S but never read (max, exp and P V stop at
/// bc); padded query rows get zero scores and are never written out.
template <class Arch, class T, Index BlockQ, Index BlockK, Index KC = 128>
void flash_forward_tiles_simd(Arch arch, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                              const ConstMatrixRef<T>& v, T scale, bool causal, Matrix<T>& out,
                              Vector<T>& lse, FlashScratch<T>& scratch, Index window) {
  using Shape = FlashSimdShape<Arch, T, BlockQ, BlockK>;
  using W = mixattn::detail::wide_t<T>;
  constexpr Index Wd = Shape::Wd, BQp = Shape::BQp, MR = Shape::MR;
  const Index n = q.rows(), m_keys = k.rows(), r = q.cols(), dv = v.cols();
  const Index dvp = (dv + Wd - 1) / Wd * Wd;
  if (n == 0) return;  // nothing to compute (and no keys to lay out: M = N = 0 when causal)
  flash_layout_keys<Wd, Shape::TileCols>(k, r, scratch.kt);
  Index ldv = 0;
  const T* vp = flash_padded_values(v, dvp, scratch.vp, ldv);
  // scale * query tile (the score tile needs no rescale); scores, then probabilities, of one
  // tile; the unnormalised output of one query tile; per row: the running max and sum, the
  // rescale exp(m - m') and new max m' of the current key tile, one register of lane maxima.
  scratch.qs.resize(BQp, r);
  scratch.next_max.resize(BQp);
  scratch.lane_max.resize(BQp, Wd);
  scratch.s.resize(BQp, Shape::BKp);
  scratch.o.resize(BQp, dvp);
  scratch.row_max.resize(BQp);
  scratch.row_sum.resize(BQp);
  scratch.alpha.resize(BQp);
  for (Index i0 = 0; i0 < n; i0 += BlockQ) {
    const Index br = std::min(BlockQ, n - i0);
    const Index brp = (br + MR - 1) / MR * MR;
    scratch.qs.topRows(br) = scale * q.middleRows(i0, br);
    scratch.qs.middleRows(br, brp - br).setZero();
    scratch.row_max.head(br).setConstant(-std::numeric_limits<T>::infinity());
    scratch.row_sum.head(br).setZero();
    scratch.alpha.segment(br, brp - br).setOnes();  // padded rows: zero scores, never read
    scratch.o.topRows(brp).setZero();
    const FlashKeyRange keys(i0, br, m_keys, causal, window);
    for (Index j0 = keys.begin; j0 < keys.end; j0 += BlockK)
      flash_forward_key_tile<Shape, KC>(arch, keys.tile(j0, BlockK), brp, r, vp, ldv, dvp, scratch);
    for (Index t = 0; t < br; ++t) {
      // row_sum >= 1 (the max term contributes exp(0)) whenever a key was visible; NaN only
      // from non-finite input the caller chose not to check.
      MIXATTN_ASSERT(!(scratch.row_sum[t] < W(1)));
      out.row(i0 + t) = scratch.o.row(t).head(dv) * static_cast<T>(W(1) / scratch.row_sum[t]);
      lse[i0 + t] =
          static_cast<T>(static_cast<W>(scratch.row_max[t]) + std::log(scratch.row_sum[t]));
    }
  }
}
#endif

/// Forward over all query tiles. q: N x r, k: M x r, v: M x d_v; out: N x d_v and lse: N are
/// sized by the caller and overwritten. out = softmax(scale q k^T + mask) v, lse_i = log sum_j
/// exp(scale q_i . k_j) over the visible j.
///
/// Per query tile, a running max m and running sum l per row (online softmax): when a key tile
/// raises the max from m to m', the earlier sum and output row are rescaled by exp(m - m'), so
/// the N x M score matrix is never formed. Scratch is allocated once per call.
///
/// window > 0 (causal only, SPEC §7): query i sees keys i - window < j <= i. Key tiles start at
/// the query tile's first window key, so keys before it cost nothing (O(N (window + tiles)) work);
/// the rows of a tile that reaches before a later row's window are masked there as well.
/// window == 0 runs the plain causal or bidirectional schedule unchanged, and so does any
/// window >= N (it starts every key range at 0 and masks nothing more): the same bits.
template <class T, Index BlockQ, Index BlockK>
void flash_forward_tiles(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                         const ConstMatrixRef<T>& v, T scale, bool causal, Matrix<T>& out,
                         Vector<T>& lse, FlashScratch<T>& scratch, Index window = 0) {
  MIXATTN_ASSERT(out.rows() == q.rows() && out.cols() == v.cols() && lse.size() == q.rows());
  MIXATTN_ASSERT(!causal || q.rows() == k.rows());
  MIXATTN_ASSERT(window >= 0 && (window == 0 || causal));
#if MIXATTN_HAS_SIMD
  flash_forward_tiles_simd<simd_arch, T, BlockQ, BlockK>(simd_arch{}, q, k, v, scale, causal, out,
                                                         lse, scratch, window);
#else
  flash_forward_tiles_eigen<T, BlockQ, BlockK>(q, k, v, scale, causal, out, lse, scratch, window);
#endif
}

/// Backward over all key tiles (outer) and query tiles (inner), recomputing every probability
/// tile from the saved log-sum-exp instead of storing it. q: N x r, k: M x r, v: M x d_v,
/// out (the forward's output) and grad_out: N x d_v, lse: N. dq: N x r, dk: M x r, dv: M x d_v
/// are sized by the caller and overwritten.
///
///   D_i = rowsum(dO o O)_i,  P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,
///   dS = P o (dP - D),  dQ += scale dS K,  dK += scale dS^T Q
/// with S = scale Q K^T. The scale is folded into a scaled copy Qs = scale Q: S = Qs K^T and
/// dK += dS^T Qs need no rescale, and dQ is scaled once at the end.
///
/// window > 0 (causal only): the forward's mask (SPEC §7). A key tile meets only the query tiles
/// up to its last key's window, and each meeting starts at the query tile's first window key;
/// window == 0 and window >= N run the unwindowed schedule, bit for bit.
template <class T, Index BlockQ, Index BlockK>
void flash_backward_tiles(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                          const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& out,
                          const ConstMatrixRef<T>& grad_out, const Vector<T>& lse, T scale,
                          bool causal, Matrix<T>& dq, Matrix<T>& dk, Matrix<T>& dv,
                          FlashScratch<T>& scratch, Index window = 0) {
  const Index n = q.rows(), m_keys = k.rows();
  MIXATTN_ASSERT(!causal || n == m_keys);
  MIXATTN_ASSERT(window >= 0 && (window == 0 || causal));
  dq.setZero();
  dk.setZero();
  dv.setZero();

  Matrix<T>& qs = scratch.qs;  // scale * q: O(N r), once per call
  qs = scale * q;
  // D_i = rowsum(P o dP)_i = dO_i . O_i: P . dP is never whole here (one key tile at a time)
  const mixattn::detail::simd_arch arch{};
  Vector<T>& delta = scratch.delta;
  delta.resize(n);
  for (Index i = 0; i < n; ++i)
    delta[i] = static_cast<T>(row_dot(arch, grad_out.row(i).data(), out.row(i).data(), out.cols()));

  using RowMap = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>;
  Matrix<T>& p = scratch.s;
  Matrix<T>& dp = scratch.dp;
  p.resize(BlockQ, BlockK);
  dp.resize(BlockQ, BlockK);

  for (Index j0 = 0; j0 < m_keys; j0 += BlockK) {
    const Index bc = std::min(BlockK, m_keys - j0);
    // Sliding window: queries from j0 + bc - 1 + window on see none of these keys.
    const Index query_end = window > 0 ? std::min(n, j0 + bc + window - 1) : n;
    // Causal: queries before j0 see none of these keys.
    for (Index i0 = causal ? j0 : 0; i0 < query_end; i0 += BlockQ) {
      const Index br = std::min(BlockQ, n - i0);
      // Sliding window: keys before the window of the tile's first query are masked for every
      // row of the tile, so the tile starts at key jb.
      const Index jb = window > 0 ? std::max(j0, i0 - window + 1) : j0;
      // Causal: keys after the tile's last query are masked for every row of the tile.
      const Index bcc = (causal ? std::min(bc, i0 + br - j0) : bc) - (jb - j0);
      const FlashTile tile(i0, br, jb, bcc, causal, window);
      const ConstMatrixRef<T> kb = k.middleRows(jb, bcc);
      const ConstMatrixRef<T> vb = v.middleRows(jb, bcc);
      const ConstMatrixRef<T> gb = grad_out.middleRows(i0, br);
      const ConstMatrixRef<T> qsb = qs.middleRows(i0, br);
      MatrixRef<T> pt = p.topLeftCorner(br, bcc);
      MatrixRef<T> dpt = dp.topLeftCorner(br, bcc);

      pt.noalias() = qsb * kb.transpose();
      for (Index t = 0; t < br; ++t) {
        const Index visible = tile.visible(t), first = tile.first(t, visible);
        // P <= 1 exactly; the clamp keeps it so when this S differs from the forward's by
        // rounding and logits are huge (|S| ~ 1e8 in float: a few ulps would be exp(+8)).
        RowMap seen(&pt(t, 0) + first, visible - first);
        seen = (seen - lse[i0 + t]).min(T(0)).exp();
        RowMap(&pt(t, 0) + visible, bcc - visible).setZero();
        if (first > 0) RowMap(&pt(t, 0), first).setZero();
      }
      dv.middleRows(jb, bcc).noalias() += pt.transpose() * gb;

      dpt.noalias() = gb * vb.transpose();
      for (Index t = 0; t < br; ++t)
        softmax_backward_apply(arch, &pt(t, 0), &dpt(t, 0), bcc, delta[i0 + t]);
      dq.middleRows(i0, br).noalias() += dpt * kb;
      dk.middleRows(jb, bcc).noalias() += dpt.transpose() * qsb;
    }
  }
  dq *= scale;
}

/// flash_forward_tiles with scratch of its own (allocated per call).
template <class T, Index BlockQ, Index BlockK>
void flash_forward_tiles(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                         const ConstMatrixRef<T>& v, T scale, bool causal, Matrix<T>& out,
                         Vector<T>& lse, Index window = 0) {
  FlashScratch<T> scratch;
  flash_forward_tiles<T, BlockQ, BlockK>(q, k, v, scale, causal, out, lse, scratch, window);
}

/// flash_backward_tiles with scratch of its own (allocated per call).
template <class T, Index BlockQ, Index BlockK>
void flash_backward_tiles(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                          const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& out,
                          const ConstMatrixRef<T>& grad_out, const Vector<T>& lse, T scale,
                          bool causal, Matrix<T>& dq, Matrix<T>& dk, Matrix<T>& dv,
                          Index window = 0) {
  FlashScratch<T> scratch;
  flash_backward_tiles<T, BlockQ, BlockK>(q, k, v, out, grad_out, lse, scale, causal, dq, dk, dv,
                                          scratch, window);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
