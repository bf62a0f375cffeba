// mixattn/detail/common/row_tiles.hpp — register-tiled rank updates and read-outs over a K x d_v
// memory, the write and read of the linear-attention family (SPEC 1.3, 1.4):
//
//   write:  M[k, :] += sum_i g_ik v_i           (M = Gamma_K^T V, a chunk's state update)
//   read:   out_i    = (sum_k g_ik M[k, :] + sum_j a_ij b_j) / den_i
//
// for a block of R tokens at a time, as their rows of g come out of the responsibilities kernel
// (still in L1) or a chunk of the causal scan. A tile keeps R x NV registers of the value side
// (the R value slices for the write, the R output slices for the read) while the K rows of M
// stream through, so M (K x d_v, 16 KiB at K = d_v = 64 in float) is read from L1 once per R
// tokens and nothing is packed. The read's second sum is the causal chunk's own
// lower-triangular block (a: R x J, b: J x d_v). Sums are in T and in k order, as a GEMM's are
// in some order; callers that carry a long sum (the causal state) widen it themselves.
//
// Internal: SIMD builds only (the scalar build uses Eigen's products instead).
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/detail/common/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// n rounded up to whole vectors of T (simd_arch): the lanes of an operand laid out transposed,
/// one lane per token, for the tiles below.
template <class T>
constexpr Index padded_to_vectors(Index n) {
  constexpr Index w = static_cast<Index>(simd_width<simd_arch, T>::value);
  return (n + w - 1) / w * w;
}

#if MIXATTN_HAS_SIMD && XSIMD_WITH_AVX512F
/// dst[c * ldd + i] = src[i * lds + c] for a 16 x 16 block of floats, in registers: three rounds
/// of interleaves (32-bit pairs, 64-bit pairs, 128-bit quarters), 64 shuffles instead of 256
/// scalar moves.
inline void transpose16x16(const float* src, Index lds, float* dst, Index ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {  // 32-bit interleave of row pairs, per 128-bit quarter
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit interleave: quarter q of r[i + m] = rows i..i+3,
    const __m512d a0 = _mm512_castps_pd(t[i]), a1 = _mm512_castps_pd(t[i + 1]);  // column 4q + m
    const __m512d a2 = _mm512_castps_pd(t[i + 2]), a3 = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int m = 0; m < 4; ++m) {  // gather the four quarters of each column
    // t[m]: quarters 0 and 2 of rows 0-3 and 4-7; t[4 + m]: quarters 1 and 3 (same rows)
    t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
    t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
    t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
  }
  for (int m = 0; m < 4; ++m)
    for (int h = 0; h < 2; ++h) {  // columns m, 8 + m (h = 0) and 4 + m, 12 + m (h = 1)
      const __m512 lo = t[4 * h + m], hi = t[8 + 4 * h + m];
      _mm512_storeu_ps(dst + (4 * h + m) * ldd, _mm512_shuffle_f32x4(lo, hi, 0x88));
      _mm512_storeu_ps(dst + (8 + 4 * h + m) * ldd, _mm512_shuffle_f32x4(lo, hi, 0xdd));
    }
}
#endif

#if MIXATTN_HAS_SIMD && XSIMD_WITH_AVX
/// dst[c * ldd + i] = src[i * lds + c] for an 8 x 8 block of floats, in registers (two rounds of
/// interleaves and one of 128-bit halves: 24 shuffles instead of 64 scalar moves), for builds
/// with 256-bit registers, where a chunk's transposes moved element by element.
inline void transpose8x8(const float* src, Index lds, float* dst, Index ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {  // rows i, i + 1 interleaved, per 128-bit half
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + m]: column m (and 4 + m) of rows i .. i + 3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    _mm256_storeu_ps(dst + m * ldd, _mm256_permute2f128_ps(r[m], r[4 + m], 0x20));
    _mm256_storeu_ps(dst + (4 + m) * ldd, _mm256_permute2f128_ps(r[m], r[4 + m], 0x31));
  }
}
#endif

/// dst = a^T (a.cols() rows of stride ld >= a.rows()), each row zero-padded from a.rows() to ld:
/// a small block of tokens laid out one lane per token. In panels of 16 tokens, so that the
/// panel's rows of a stay in L1 while its columns are read (a 256 x 64 float block is 64 KiB);
/// whole 16 x 16 float blocks go through registers where the ISA has them (transpose16x16).
template <class T>
inline void transpose_padded(const Eigen::Ref<const Matrix<T>>& a, T* dst, Index ld) {
  const Index rows = a.rows(), cols = a.cols();
  MIXATTN_ASSERT(ld >= rows);
  constexpr Index panel = 16;
  for (Index i0 = 0; i0 < rows; i0 += panel) {
    const Index i1 = std::min(rows, i0 + panel);
    Index c0 = 0;
#if MIXATTN_HAS_SIMD && XSIMD_WITH_AVX512F
    if constexpr (std::is_same<T, float>::value &&
                  std::is_base_of<xsimd::avx512f, simd_arch>::value)
      if (i1 - i0 == panel)
        for (; c0 + panel <= cols; c0 += panel)
          transpose16x16(a.data() + i0 * a.outerStride() + c0, a.outerStride(), dst + c0 * ld + i0,
                         ld);
#endif
#if MIXATTN_HAS_SIMD && XSIMD_WITH_AVX
    if constexpr (std::is_same<T, float>::value) {
      const Index rows8 = (i1 - i0) / 8 * 8;  // the panel's whole 8 x 8 blocks
      if (rows8 > 0) {
        Index c8 = c0;
        for (; c8 + 8 <= cols; c8 += 8)
          for (Index i = i0; i < i0 + rows8; i += 8)
            transpose8x8(a.data() + i * a.outerStride() + c8, a.outerStride(), dst + c8 * ld + i,
                         ld);
        for (Index c = c0; c < c8; ++c)
          for (Index i = i0 + rows8; i < i1; ++i) dst[c * ld + i] = a(i, c);
        c0 = c8;
      }
    }
#endif
    for (Index c = c0; c < cols; ++c)
      for (Index i = i0; i < i1; ++i) dst[c * ld + i] = a(i, c);
  }
  for (Index c = 0; c < cols; ++c)
    for (Index i = rows; i < ld; ++i) dst[c * ld + i] = T(0);
}

#if MIXATTN_HAS_SIMD
/// Value-side registers of one tile: R x NV accumulators or slices, plus NV for the memory row
/// and a broadcast (R = 5, NV = 4: 25 of AVX-512's 32 registers; NV = 2: 13 of 16).
template <class Arch>
constexpr int row_tile_vectors() {
  return simd_registers<Arch>() >= 32 ? 4 : 2;
}

/// Tokens per tile: as many as the density kernel's tile (DensityTile::tokens), and a divisor of
/// the bidirectional forward's block of Gamma rows (gma_gamma_block), so that a block is whole
/// tiles.
template <class Arch>
constexpr int row_tile_tokens() {
  return 5;
}

/// Rows of a tile that keeps no other vectors live (OVQ's score and read-out tiles, the
/// nearest-centroid search): R x NV accumulators, NV loaded vectors and a broadcast (AVX-512:
/// 6 x 4 + 4 + 1 = 29 of 32 registers; 16 registers: 6 x 2 + 2 + 1 = 15, where 3 x 2 left six
/// FMA chains for two pipes of latency 4: bench/results/tuning.md, "Register tiles on 16
/// registers").
template <class Arch>
constexpr int plain_tile_rows() {
  return 6;
}

/// Write for R tokens and the NV registers of value columns from c0:
///   m[k, c0 ..] += sum_i g_ik v_i[c0 ..]   for every k < K.
/// g: R x K (stride ldg), v: R rows (stride ldv), m: K rows (stride ldm).
template <int R, int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void write_tile(const T* g, Index ldg, const T* v, Index ldv, Index K,
                                      Index c0, T* m, Index ldm) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B vr[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) vr[i][j] = B::load_unaligned(v + i * ldv + c0 + j * Wd);
  for (Index k = 0; k < K; ++k) {
    T* row = m + k * ldm + c0;
    B acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = B::load_unaligned(row + j * Wd);
    for (int i = 0; i < R; ++i) {
      const B gik(g[i * ldg + k]);
      for (int j = 0; j < NV; ++j) acc[j] = xsimd::fma(gik, vr[i][j], acc[j]);
    }
    for (int j = 0; j < NV; ++j) acc[j].store_unaligned(row + j * Wd);
  }
}

/// The two operands of a read: out_i = (sum_k g_ik m[k] + sum_j a_ij b[j]) / den_i. Without the
/// second sum, J = 0.
template <class T>
struct ReadSources {
  const T* g;
  Index ldg;
  const T* m;
  Index ldm, K;
  const T* a = nullptr;
  Index lda = 0;
  const T* b = nullptr;
  Index ldb = 0, J = 0;
};

/// acc[i][:] += sum_k w_ik src[k, c0 ..] for R rows of w over `depth` rows of src; w_ik is
/// w[i * ldw + k * ldk] (ldk = 1: w row-major; ldw = 1: w stored transposed).
template <int R, int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void read_accumulate(xsimd::batch<T, Arch> (&acc)[R][NV], const T* w,
                                           Index ldw, const T* src, Index lds, Index depth,
                                           Index c0, Index ldk = 1) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  // The i and j loops are unrolled in full, so that the accumulators stay in registers (with
  // ldw = 1, GCC otherwise keeps the i loop and the tile in memory).
  for (Index k = 0; k < depth; ++k) {
    B m[NV];
    for (int j = 0; j < NV; ++j) m[j] = B::load_unaligned(src + k * lds + c0 + j * Wd);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const B wik(w[i * ldw + k * ldk]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] = xsimd::fma(wik, m[j], acc[i][j]);
    }
  }
}

/// Read for R tokens and the NV registers of value columns from c0 (out: stride ldo). With
/// den == nullptr the sums are stored undivided (a plain product).
template <int R, int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void read_tile(const ReadSources<T>& s, Index c0, const T* den, T* out,
                                     Index ldo) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = B(T(0));
  read_accumulate<R, NV, Arch>(acc, s.g, s.ldg, s.m, s.ldm, s.K, c0);
  if (s.J > 0) read_accumulate<R, NV, Arch>(acc, s.a, s.lda, s.b, s.ldb, s.J, c0);
  if (den == nullptr) {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j].store_unaligned(out + i * ldo + c0 + j * Wd);
    return;
  }
  // one division per token, then products: a register division holds an FMA port for about a
  // cycle (measured on AVX-512: two per 16 FMAs cost 1.8 cycles), ~3% of a 5 x 4 tile's time
  for (int i = 0; i < R; ++i) {
    const B inv(T(1) / den[i]);
    for (int j = 0; j < NV; ++j) (acc[i][j] * inv).store_unaligned(out + i * ldo + c0 + j * Wd);
  }
}

/// Runs tile(c0, nv) over the d_v value columns: tiles of NV registers, then one of 2 (a row of
/// 2 registers, such as a causal chunk's 32 float columns, is one tile), then single registers;
/// returns the first column left for the scalar tail.
template <int NV, class Arch, class T, class Tile>
inline Index over_column_tiles(Index d_v, Tile&& tile) {
  constexpr Index Wd = static_cast<Index>(simd_width<Arch, T>::value);
  Index c0 = 0;
  for (; c0 + NV * Wd <= d_v; c0 += NV * Wd) tile(c0, std::integral_constant<int, NV>{});
  if constexpr (NV > 2)
    if (c0 + 2 * Wd <= d_v) {
      tile(c0, std::integral_constant<int, 2>{});
      c0 += 2 * Wd;
    }
  if constexpr (NV > 1)
    for (; c0 + Wd <= d_v; c0 += Wd) tile(c0, std::integral_constant<int, 1>{});
  return c0;
}

/// Write for R tokens over all d_v columns of m (stride ldm).
template <int R, class Arch, class T>
inline void write_rows(const T* g, Index ldg, const T* v, Index ldv, Index K, Index d_v, T* m,
                       Index ldm) {
  constexpr int NV = row_tile_vectors<Arch>();
  const Index tail = over_column_tiles<NV, Arch, T>(d_v, [&](Index c0, auto nv) {
    write_tile<R, decltype(nv)::value, Arch>(g, ldg, v, ldv, K, c0, m, ldm);
  });
  for (Index c = tail; c < d_v; ++c)
    for (int i = 0; i < R; ++i)
      for (Index k = 0; k < K; ++k) m[k * ldm + c] += g[i * ldg + k] * v[i * ldv + c];
}

/// Read for R tokens over all d_v columns (den: R entries, out: stride ldo).
template <int R, class Arch, class T>
inline void read_rows(const ReadSources<T>& s, Index d_v, const T* den, T* out, Index ldo) {
  constexpr int NV = row_tile_vectors<Arch>();
  const Index tail = over_column_tiles<NV, Arch, T>(d_v, [&](Index c0, auto nv) {
    read_tile<R, decltype(nv)::value, Arch>(s, c0, den, out, ldo);
  });
  for (Index c = tail; c < d_v; ++c)
    for (int i = 0; i < R; ++i) {
      T sum = 0;
      for (Index k = 0; k < s.K; ++k) sum = std::fma(s.g[i * s.ldg + k], s.m[k * s.ldm + c], sum);
      for (Index j = 0; j < s.J; ++j) sum = std::fma(s.a[i * s.lda + j], s.b[j * s.ldb + c], sum);
      out[i * ldo + c] = den != nullptr ? sum * (T(1) / den[i]) : sum;
    }
}

/// s[0 .. W) += the lanes of x widened to wide_t<T>, and t[0 .. W) = the new values of s in T:
/// one register of a chunk's update folded into a wide running state and its T copy.
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void fold_wide(const xsimd::batch<T, Arch>& x, wide_t<T>* s, T* t) {
  constexpr Index Wd = static_cast<Index>(xsimd::batch<T, Arch>::size);
  add_to_wide<Arch>(x, s);
  for (Index l = 0; l < Wd; ++l) t[l] = static_cast<T>(s[l]);  // a vector conversion or two
}

/// body(i0, rows, c0, nv) for the register tiles of m output rows by d_v columns: tiles of R
/// rows (rows = std::integral_constant<int, r>, the last tile r <= R) by over_column_tiles'
/// NV-register column tiles (nv likewise); returns the first column left for a scalar tail.
template <int R, int NV, class Arch, class T, class Body>
inline Index over_row_column_tiles(Index m, Index d_v, Body&& body) {
  Index tail = 0;
  for (Index i0 = 0; i0 < m; i0 += R)
    with_rows<R>(std::min<Index>(R, m - i0), [&](auto rows) {
      tail =
          over_column_tiles<NV, Arch, T>(d_v, [&](Index c0, auto nv) { body(i0, rows, c0, nv); });
    });
  return tail;
}

/// A chunk's state update S[k, :] += sum_i g_ik v_i over its n tokens (g: n x K, stride ldg; v:
/// n rows, stride ldv), into the wide state S (K x d_v, stride d_v) and its T copy s_t (the same
/// shape): register tiles of R rows of S by NV registers accumulate over the chunk's tokens in T
/// (a read over g^T), then fold into S once. No update buffer to clear, S and s_t touched once.
template <class Arch, class T>
inline void state_update(const T* g, Index ldg, const T* v, Index ldv, Index n, Index K, Index d_v,
                         wide_t<T>* S, T* s_t) {
  using B = xsimd::batch<T, Arch>;
  using W = wide_t<T>;
  constexpr Index Wd = static_cast<Index>(B::size);
  const Index tail =
      over_row_column_tiles<row_tile_tokens<Arch>(), row_tile_vectors<Arch>(), Arch, T>(
          K, d_v, [&](Index k0, auto rows, Index c0, auto nv) {
            constexpr int RR = decltype(rows)::value, NN = decltype(nv)::value;
            B acc[RR][NN];
            for (int i = 0; i < RR; ++i)
              for (int j = 0; j < NN; ++j) acc[i][j] = B(T(0));
            // w_(kk, i) = g[i * ldg + k0 + kk]: ldw = 1 over the rows of S, ldk = ldg over tokens
            read_accumulate<RR, NN, Arch>(acc, g + k0, 1, v, ldv, n, c0, ldg);
            for (int i = 0; i < RR; ++i)
              for (int j = 0; j < NN; ++j)
                fold_wide<Arch, T>(acc[i][j], S + (k0 + i) * d_v + c0 + j * Wd,
                                   s_t + (k0 + i) * d_v + c0 + j * Wd);
          });
  for (Index c = tail; c < d_v; ++c)
    for (Index k = 0; k < K; ++k) {
      T sum = 0;
      for (Index t = 0; t < n; ++t) sum = std::fma(g[t * ldg + k], v[t * ldv + c], sum);
      const W x = S[k * d_v + c] + static_cast<W>(sum);
      S[k * d_v + c] = x;
      s_t[k * d_v + c] = static_cast<T>(x);
    }
}

/// One product of a sum that sum_block reads: out_i += sum_{k < depth} w_ik src[k, :], with
/// w_ik = w[i * ldw + k * ldk] (read_accumulate's strides: ldk = 1 reads w by rows, ldw = 1 by
/// columns, both 0 a constant) and src's rows of stride lds. depth = 0: no product.
template <class T>
struct Term {
  const T* w = nullptr;
  Index ldw = 0, ldk = 1;
  const T* src = nullptr;
  Index lds = 0, depth = 0;
};

/// Up to three products summed in one tile, R rows by the NV registers of columns from c0, in
/// T and in term order, then stored (not added) to out (stride ldo).
template <int R, int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void sum_tile(const Term<T> (&t)[3], Index c0, T* out, Index ldo) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = B(T(0));
#pragma GCC unroll 3
  for (int n = 0; n < 3; ++n)
    read_accumulate<R, NV, Arch>(acc, t[n].w, t[n].ldw, t[n].src, t[n].lds, t[n].depth, c0,
                                 t[n].ldk);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j].store_unaligned(out + i * ldo + c0 + j * Wd);
}

/// sum_tile for R rows over `width` columns, the columns past the last register scalar.
template <int R, class Arch, class T>
inline void sum_rows(const Term<T> (&t)[3], Index width, T* out, Index ldo) {
  constexpr int NV = row_tile_vectors<Arch>();
  const Index tail = over_column_tiles<NV, Arch, T>(
      width, [&](Index c0, auto nv) { sum_tile<R, decltype(nv)::value, Arch>(t, c0, out, ldo); });
  for (Index c = tail; c < width; ++c)
    for (int i = 0; i < R; ++i) {
      T sum = 0;
      for (const Term<T>& e : t)
        for (Index k = 0; k < e.depth; ++k)
          sum = std::fma(e.w[i * e.ldw + k * e.ldk], e.src[k * e.lds + c], sum);
      out[i * ldo + c] = sum;
    }
}

/// A sum of up to three products for n rows, in tiles of row_tile_tokens rows: for the tile of
/// rows [i0, i0 + rows), terms(i0, rows, t) fills t (pointers at the tile's first row) and
/// returns the columns to compute (at most the block's), written to out (stride ldo).
template <class Arch, class T, class Terms>
inline void sum_block(Index n, T* out, Index ldo, Terms&& terms) {
  constexpr int R = row_tile_tokens<Arch>();
  for (Index i0 = 0; i0 < n; i0 += R)
    with_rows<R>(std::min<Index>(R, n - i0), [&](auto rows) {
      constexpr int RR = decltype(rows)::value;
      Term<T> t[3];
      const Index width = terms(i0, static_cast<Index>(RR), t);
      sum_rows<RR, Arch>(t, width, out + i0 * ldo, ldo);
    });
}

/// The write for n tokens: tiles of row_tile_tokens rows, then one tile of the rest.
template <class Arch, class T>
inline void write_block(const T* g, Index ldg, const T* v, Index ldv, Index n, Index K, Index d_v,
                        T* m, Index ldm) {
  constexpr int R = row_tile_tokens<Arch>();
  for (Index i = 0; i < n; i += R)
    with_rows<R>(std::min<Index>(R, n - i), [&](auto rows) {
      write_rows<decltype(rows)::value, Arch>(g + i * ldg, ldg, v + i * ldv, ldv, K, d_v, m, ldm);
    });
}

/// The read for n tokens: tiles of row_tile_tokens rows, then one tile of the rest (the rows of
/// s.g, s.a, den and out advance together; den may be null, read_tile).
template <class Arch, class T>
inline void read_block(ReadSources<T> s, Index n, Index d_v, const T* den, T* out, Index ldo) {
  constexpr int R = row_tile_tokens<Arch>();
  for (Index i = 0; i < n; i += R) {
    with_rows<R>(std::min<Index>(R, n - i), [&](auto rows) {
      read_rows<decltype(rows)::value, Arch>(s, d_v, den != nullptr ? den + i : nullptr,
                                             out + i * ldo, ldo);
    });
    s.g += R * s.ldg;
    if (s.J > 0) s.a += R * s.lda;
  }
}
#endif

}  // namespace detail
MIXATTN_END_NAMESPACE
