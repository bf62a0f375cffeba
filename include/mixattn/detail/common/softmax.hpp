// mixattn/detail/common/softmax.hpp — one softmax row and its backward, shared by every operator
// (SPEC 1.2's responsibilities, 2.2's OVQ tile, 3's naive, flash and decoding reference).
//
//   p_j = exp(s_j - max_l s_l) / sum_l exp(s_l - max_l s_l)
//   ds_j = p_j (dp_j - delta),  delta = sum_l p_l dp_l
//
// softmax_row and softmax_backward_row are the whole rows. Their stages are exposed for the
// operators whose row is not one contiguous array: OVQ's row is a dictionary part and a block
// part with one joint max and sum, flash attention's is split across key tiles (online softmax,
// and a delta taken as dO . O since P . dP is never whole).
//
// Accumulation rule: every sum here (the softmax denominator, the backward's delta) is taken in
// the wide type W = wide_t<T> (double for float). The denominator has as many terms as the row
// has keys (N up to 1e5 and more), and the delta's terms have both signs and cancel, since
// sum_j dS_j = 0; float lane sums would lose digits that the wide sum keeps for the price of
// one conversion per element.
//
// Each kernel is a template on (Arch, T) over xsimd::batch<T, Arch> with a scalar tail; with
// Arch = scalar_arch (no SIMD) the tail loop does the whole row.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/fast_exp.hpp"
#include "mixattn/detail/common/simd.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

#if MIXATTN_HAS_SIMD
/// exp of a batch whose entries are <= 0 or -inf (the shifted logits), with NaN propagated.
/// float: fast_exp_nonpositive (fast_exp.hpp: about half of xsimd::exp's instructions, every one
/// of which competes with the kernels' FMAs for the same two ports on AVX-512; within ~1 ulp,
/// clamped below, so -inf gives 0; s <= shift gives s - shift <= 0 after rounding too). double:
/// xsimd's exp on the entries clamped at -800 (exp gives 0), so that it never converts an infinite
/// exponent to an integer; NaN still propagates (max returns the second operand when either is
/// NaN).
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE xsimd::batch<T, Arch> exp_shifted(const xsimd::batch<T, Arch>& s,
                                                        const xsimd::batch<T, Arch>& shift) {
  using B = xsimd::batch<T, Arch>;
  if constexpr (std::is_same<T, double>::value) {
    const B x = xsimd::max(B(T(-800)), s - shift);
    // xsimd 8.1's double exp converts its exponent to int64 through a scalar std::copy (its
    // generic batch_cast does not find the AVX-512DQ vector conversion, so this happens on
    // every target); a NaN there (check_finite = false) would be an out-of-range conversion, i.e.
    // undefined behaviour. Feed exp a 0 in NaN lanes and put the NaN back afterwards.
    const auto nan = xsimd::isnan(x);
    return xsimd::select(nan, x, xsimd::exp(xsimd::select(nan, B(T(0)), x)));
  } else {
    return fast_exp_nonpositive<Arch>(s - shift);
  }
}
#endif

#if MIXATTN_HAS_SIMD
/// Largest lane of v, exactly (a max is exact in any order); a NaN lane may or may not win, so
/// callers test for NaN themselves. In-register reductions where the ISA has them (xsimd 8.1 has
/// no horizontal max), else through memory.
template <class Arch, class T>
inline T reduce_max(const xsimd::batch<T, Arch>& v) {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    if constexpr (std::is_same<T, float>::value)
      return _mm512_reduce_max_ps(v);
    else
      return _mm512_reduce_max_pd(v);
  }
#endif
#if XSIMD_WITH_AVX
  if constexpr (std::is_base_of<xsimd::avx, Arch>::value) {
    if constexpr (std::is_same<T, float>::value) {
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    } else {
      const __m128d m = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
      return _mm_cvtsd_f64(_mm_max_sd(m, _mm_unpackhi_pd(m, m)));
    }
  }
#endif
  constexpr std::size_t Wd = xsimd::batch<T, Arch>::size;
  alignas(64) T lanes[Wd];
  v.store_aligned(lanes);
  T m = lanes[0];
  for (std::size_t l = 1; l < Wd; ++l) m = std::max(m, lanes[l]);
  return m;
}

/// The batch of wide_t<T> holding p[0 .. size) converted: the same values as
/// batch<W>::load_unaligned(p), whose float-to-double form in xsimd 8.1 converts lane by lane
/// through memory; here one conversion instruction where the ISA has it.
template <class Arch, class T>
inline xsimd::batch<wide_t<T>, Arch> load_wide(const T* p) {
  using BW = xsimd::batch<wide_t<T>, Arch>;
  if constexpr (std::is_same<T, float>::value) {
#if XSIMD_WITH_AVX512F
    if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value)
      return BW(_mm512_cvtps_pd(_mm256_loadu_ps(p)));
#endif
#if XSIMD_WITH_AVX
    if constexpr (std::is_base_of<xsimd::avx, Arch>::value)
      return BW(_mm256_cvtps_pd(_mm_loadu_ps(p)));
#endif
#if XSIMD_WITH_SSE2
    if constexpr (std::is_base_of<xsimd::sse2, Arch>::value)
      return BW(
          _mm_cvtps_pd(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
  }
  return BW::load_unaligned(p);
}

/// lo += the lanes of x widened to wide_t<T>: for float the low and high halves of x go to lo
/// and hi, as doubles (one conversion instruction each where the ISA has it); for double, all of
/// x goes to lo. Two accumulators let a long sum overlap its adds; one (add_wide(acc, x)) keeps
/// a short sum in lane order.
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void add_wide(xsimd::batch<wide_t<T>, Arch>& lo,
                                    xsimd::batch<wide_t<T>, Arch>& hi,
                                    const xsimd::batch<T, Arch>& x) {
  if constexpr (std::is_same<T, wide_t<T>>::value) {
    (void)hi;
    lo += x;
  } else {
    using BW = xsimd::batch<wide_t<T>, Arch>;
#if XSIMD_WITH_AVX512F
    if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
      const __m512 v = x;
      lo += BW(_mm512_cvtps_pd(_mm512_castps512_ps256(v)));
      hi += BW(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
      return;
    }
#endif
#if XSIMD_WITH_AVX
    if constexpr (std::is_base_of<xsimd::avx, Arch>::value) {
      const __m256 v = x;
      lo += BW(_mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      hi += BW(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
      return;
    }
#endif
#if XSIMD_WITH_SSE2
    if constexpr (std::is_base_of<xsimd::sse2, Arch>::value) {
      const __m128 v = x;
      lo += BW(_mm_cvtps_pd(v));
      hi += BW(_mm_cvtps_pd(_mm_movehl_ps(v, v)));
      return;
    }
#endif
    constexpr std::size_t Wd = xsimd::batch<T, Arch>::size, WW = BW::size;
    alignas(64) T lanes[Wd];
    x.store_aligned(lanes);
    for (std::size_t h = 0; h < Wd; h += WW)
      ((h / WW) % 2 == 0 ? lo : hi) += load_wide<Arch>(lanes + h);
  }
}

template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void add_wide(xsimd::batch<wide_t<T>, Arch>& acc,
                                    const xsimd::batch<T, Arch>& x) {
  add_wide<Arch, T>(acc, acc, x);
}

/// The lanes of x widened to wide_t<T>, low half plus high half (for double, x itself): what
/// add_wide(acc, x) leaves in a zero acc (the sign of a lane whose halves are both -0 aside),
/// without its two adds to zero.
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE xsimd::batch<wide_t<T>, Arch> widened_halves_sum(
    const xsimd::batch<T, Arch>& x) {
  using BW = xsimd::batch<wide_t<T>, Arch>;
  if constexpr (std::is_same<T, wide_t<T>>::value) {
    return x;
  } else {
#if XSIMD_WITH_AVX512F
    if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
      const __m512 v = x;
      return BW(_mm512_cvtps_pd(_mm512_castps512_ps256(v))) +
             BW(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
    }
#endif
#if XSIMD_WITH_AVX
    if constexpr (std::is_base_of<xsimd::avx, Arch>::value) {
      const __m256 v = x;
      return BW(_mm256_cvtps_pd(_mm256_castps256_ps128(v))) +
             BW(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
#endif
#if XSIMD_WITH_SSE2
    if constexpr (std::is_base_of<xsimd::sse2, Arch>::value) {
      const __m128 v = x;
      return BW(_mm_cvtps_pd(v)) + BW(_mm_cvtps_pd(_mm_movehl_ps(v, v)));
    }
#endif
    BW acc(wide_t<T>(0));
    add_wide<Arch, T>(acc, x);
    return acc;
  }
}
#endif

/// Largest of s[0..n); -inf when n == 0; NaN when any entry is NaN. (A max that skipped a NaN
/// could also skip the true max, since the vector max returns its second operand when either is
/// NaN: the shifted logits would then be positive and exp's exponent out of range.)
template <class Arch, class T>
inline T row_max(Arch, const T* s, Index n) {
  T m = -std::numeric_limits<T>::infinity();
  bool nan = false;
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    constexpr Index Wd = static_cast<Index>(B::size);
    if (n >= Wd) {
      B mx = B::load_unaligned(s);
      auto bad = xsimd::isnan(mx);
      for (j = Wd; j + Wd <= n; j += Wd) {
        const B v = B::load_unaligned(s + j);
        bad = bad | xsimd::isnan(v);
        mx = xsimd::max(mx, v);
      }
      nan = xsimd::any(bad);
      m = reduce_max(mx);
    }
  }
#endif
  for (; j < n; ++j) {
    nan = nan || std::isnan(s[j]);
    m = std::max(m, s[j]);
  }
  return nan ? std::numeric_limits<T>::quiet_NaN() : m;
}

/// max(a, b) that keeps a NaN from either side (std::max drops a NaN second argument), for
/// joining row maxima: a shift below some logit would make exp's exponent out of range.
template <class T>
inline T max_keep_nan(T a, T b) {
  return std::isnan(b) ? b : std::max(a, b);
}

/// out[j] = f(a[j], b[j]) for j < n (out may alias a or b); f is called on registers and on
/// scalars alike, so write it generic: [](auto x, auto y) { return x * y; }.
template <class Arch, class T, class F>
inline void zip_rows(Arch, const T* a, const T* b, T* out, Index n, F f) {
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    for (; j + static_cast<Index>(B::size) <= n; j += static_cast<Index>(B::size))
      f(B::load_unaligned(a + j), B::load_unaligned(b + j)).store_unaligned(out + j);
  }
#endif
  for (; j < n; ++j) out[j] = f(a[j], b[j]);
}

#if MIXATTN_HAS_SIMD
/// w[0 .. size) += the lanes of x widened to wide_t<T> (two registers of W for float).
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void add_to_wide(const xsimd::batch<T, Arch>& x, wide_t<T>* w) {
  using BW = xsimd::batch<wide_t<T>, Arch>;
  constexpr Index WW = static_cast<Index>(BW::size);
  if constexpr (std::is_same<T, wide_t<T>>::value) {
    (BW::load_unaligned(w) + x).store_unaligned(w);
  } else {
    BW lo = BW::load_unaligned(w), hi = BW::load_unaligned(w + WW);
    add_wide<Arch, T>(lo, hi, x);
    lo.store_unaligned(w);
    hi.store_unaligned(w + WW);
  }
}
#endif

#if MIXATTN_HAS_SIMD
/// z[0 .. NV registers) += sum_i g[i * ldg + ...] over n rows: NV independent sums, row by row.
template <int NV, class Arch, class T>
MIXATTN_ALWAYS_INLINE void add_rows_tile(const T* g, Index ldg, Index n, T* z) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B acc[NV];
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) acc[j] = B::load_unaligned(z + j * Wd);
  for (Index i = 0; i < n; ++i, g += ldg)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[j] += B::load_unaligned(g + j * Wd);
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) acc[j].store_unaligned(z + j * Wd);
}
#endif

/// z[j] += sum_i g[i * ldg + j] for j < K over n rows, each in row order: each register of z
/// loaded and stored once. Up to 8 registers of z at a time, row by row, so that their sums are
/// independent chains (one register's sum over all n rows before the next was a chain of n
/// dependent adds: 4096 rows of K = 64 in blocks of 60, AVX2, 25 -> 5 us alone; inside the
/// fused forward other work had hidden most of that latency).
template <class Arch, class T>
inline void add_rows(Arch, const T* g, Index ldg, Index n, Index K, T* z) {
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    constexpr Index Wd = static_cast<Index>(simd_width<Arch, T>::value), NV = 8;
    for (; j + NV * Wd <= K; j += NV * Wd) add_rows_tile<NV, Arch>(g + j, ldg, n, z + j);
    if (j + Wd <= K) {
      const Index regs = (K - j) / Wd;
      with_rows<NV - 1>(
          regs, [&](auto nv) { add_rows_tile<decltype(nv)::value, Arch>(g + j, ldg, n, z + j); });
      j += regs * Wd;
    }
  }
#endif
  for (; j < K; ++j)
    for (Index i = 0; i < n; ++i) z[j] += g[i * ldg + j];
}

/// out[i] = g_i . z + add for R rows g_i (stride ldg) of K entries, in T, side by side so that
/// their horizontal sums overlap; each row's arithmetic is the same whatever R.
template <int R, class Arch, class T>
inline void dot_rows_tile(Arch, const T* g, Index ldg, Index K, const T* z, T add, T* out) {
  Index vec = 0;
  T sum[R] = {};
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    constexpr Index Wd = static_cast<Index>(B::size);
    vec = K / Wd * Wd;
    B acc[R];
    for (int t = 0; t < R; ++t) acc[t] = B(T(0));
    for (Index j = 0; j < vec; j += Wd) {
      const B zj = B::load_unaligned(z + j);
      for (int t = 0; t < R; ++t)
        acc[t] = xsimd::fma(B::load_unaligned(g + t * ldg + j), zj, acc[t]);
    }
    for (int t = 0; t < R; ++t) sum[t] = xsimd::hadd(acc[t]);
  }
#endif
  for (int t = 0; t < R; ++t) {
    for (Index j = vec; j < K; ++j) sum[t] += g[t * ldg + j] * z[j];
    out[t] = sum[t] + add;
  }
}

/// dot_rows_tile over n rows: tiles of 8 (8 independent chains of FMAs; with tiles of 4, 4096
/// rows of K = 64 took 10.8 us instead of 9.5 alone, AVX2), then single rows.
template <class Arch, class T>
inline void dot_rows(Arch arch, const T* g, Index ldg, Index n, Index K, const T* z, T add,
                     T* out) {
  Index i = 0;
  for (; i + 8 <= n; i += 8) dot_rows_tile<8>(arch, g + i * ldg, ldg, K, z, add, out + i);
  for (; i < n; ++i) dot_rows_tile<1>(arch, g + i * ldg, ldg, K, z, add, out + i);
}

/// sum_j f(a[j], b[j]) accumulated in W, with f applied to the entries widened to W (registers
/// of W, or scalars of W, so write it generic as for zip_rows).
template <class Arch, class T, class F>
inline wide_t<T> wide_sum(Arch, const T* a, const T* b, Index n, F f) {
  using W = wide_t<T>;
  W sum = 0;
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using BW = xsimd::batch<W, Arch>;  // float: half a register of T per register of W
    constexpr Index S = static_cast<Index>(BW::size);
    // Four independent sums: one would be a chain of dependent adds, the latency of a 64-entry
    // row's 8 registers of double several times over.
    BW acc0(W(0)), acc1(W(0)), acc2(W(0)), acc3(W(0));
    for (; j + 4 * S <= n; j += 4 * S) {
      acc0 += f(load_wide<Arch>(a + j), load_wide<Arch>(b + j));
      acc1 += f(load_wide<Arch>(a + j + S), load_wide<Arch>(b + j + S));
      acc2 += f(load_wide<Arch>(a + j + 2 * S), load_wide<Arch>(b + j + 2 * S));
      acc3 += f(load_wide<Arch>(a + j + 3 * S), load_wide<Arch>(b + j + 3 * S));
    }
    for (; j + S <= n; j += S) acc0 += f(load_wide<Arch>(a + j), load_wide<Arch>(b + j));
    sum = xsimd::hadd((acc0 + acc1) + (acc2 + acc3));
  }
#endif
  for (; j < n; ++j) sum += f(static_cast<W>(a[j]), static_cast<W>(b[j]));
  return sum;
}

/// s[j] = exp(s[j] - shift) in place for j < n (-inf entries give 0); returns their sum in W.
/// shift is the row's max (finite), so every value is in [0, 1].
template <class Arch, class T>
inline wide_t<T> exp_shifted_sum(Arch arch, T* s, Index n, T shift) {
  zip_rows(arch, s, s, s, n, [shift](auto x, auto) {
    if constexpr (std::is_same<decltype(x), T>::value)
      // clamped as the kernel is; std::max returns its first argument when either is NaN
      return std::exp(std::max(x - shift, T(-800)));
#if MIXATTN_HAS_SIMD
    else
      return exp_shifted(x, decltype(x)(shift));
#endif
  });
  return wide_sum(arch, s, s, n, [](auto x, auto) { return x; });
}

/// In-place max-subtracted softmax of the row s[0..n), whose first n_out <= n probabilities go
/// to out (out may be s; the entries past n_out are padding, e.g. -inf lanes). Returns false,
/// with s and out to be rewritten, when every logit is -inf (no finite max); NaN propagates.
template <class Arch, class T>
inline bool softmax_row(Arch arch, T* s, Index n, Index n_out, T* out) {
  const T m = row_max(arch, s, n);
  if (m == -std::numeric_limits<T>::infinity()) return false;
  // sum >= 1 (the max contributes exp(0)); NaN only from non-finite logits
  const wide_t<T> sum = exp_shifted_sum(arch, s, n, m);
  const T inv = static_cast<T>(wide_t<T>(1) / sum);
  zip_rows(arch, s, s, out, n_out, [inv](auto x, auto) { return x * decltype(x)(inv); });
  return true;
}

/// sum_j a[j] b[j] in W (the softmax backward's delta: terms of both signs).
template <class Arch, class T>
inline wide_t<T> row_dot(Arch arch, const T* a, const T* b, Index n) {
  return wide_sum(arch, a, b, n, [](auto x, auto y) { return x * y; });
}

/// ds[j] = p[j] (ds[j] - delta) in place for j < n: the softmax backward given its delta.
template <class Arch, class T>
inline void softmax_backward_apply(Arch arch, const T* p, T* ds, Index n, T delta) {
  zip_rows(arch, p, ds, ds, n,
           [delta](auto pj, auto dj) { return pj * (dj - decltype(dj)(delta)); });
}

/// Backward of one softmax row p[0..n): dp holds dL/dp on entry and dL/ds on exit,
///   ds_j = p_j (dp_j - sum_l p_l dp_l).
template <class Arch, class T>
inline void softmax_backward_row(Arch arch, const T* p, T* dp, Index n) {
  softmax_backward_apply(arch, p, dp, n, static_cast<T>(row_dot(arch, p, dp, n)));
}

}  // namespace detail
MIXATTN_END_NAMESPACE
