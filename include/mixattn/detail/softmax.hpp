// mixattn/detail/softmax.hpp — one softmax row and its backward, shared by every operator
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

#include "mixattn/core.hpp"
#include "mixattn/detail/simd.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

#if MIXATTN_HAS_SIMD
/// exp of a batch whose entries are <= 0 or -inf (the shifted logits), with NaN propagated.
/// Clamped at -800 (exp gives 0 in float and double) so xsimd's exp never converts an infinite
/// exponent to an integer; NaN still propagates (max returns the second operand when either is
/// NaN).
template <class Arch, class T>
inline xsimd::batch<T, Arch> exp_shifted(const xsimd::batch<T, Arch>& s,
                                         const xsimd::batch<T, Arch>& shift) {
  using B = xsimd::batch<T, Arch>;
  const B x = xsimd::max(B(T(-800)), s - shift);
  if constexpr (std::is_same<T, double>::value) {
    // xsimd 8.1's double exp converts its exponent to int64 through a scalar std::copy (its
    // generic batch_cast does not find the AVX-512DQ vector conversion, so this happens on
    // every target); a NaN there (check_finite = false) would be an out-of-range conversion, i.e.
    // undefined behaviour. Feed exp a 0 in NaN lanes and put the NaN back afterwards.
    const auto nan = xsimd::isnan(x);
    return xsimd::select(nan, x, xsimd::exp(xsimd::select(nan, B(T(0)), x)));
  } else {
    return xsimd::exp(x);  // float: the int32 conversion is a native instruction on every target
  }
}

/// acc += the W-typed values of the T-typed register stored at p (one T register is one or two
/// W registers: float to double widens each half).
template <class Arch, class T, class W>
inline void add_wide(const T* p, xsimd::batch<W, Arch>& acc) {
  using BW = xsimd::batch<W, Arch>;
  constexpr std::size_t n = xsimd::batch<T, Arch>::size;
  for (std::size_t h = 0; h < n; h += BW::size) acc += BW::load_unaligned(p + h);
}
#endif

/// Largest of s[0..n); -inf when n == 0.
template <class Arch, class T>
inline T row_max(Arch, const T* s, Index n) {
  T m = -std::numeric_limits<T>::infinity();
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    constexpr Index Wd = static_cast<Index>(B::size);
    if (n >= Wd) {
      B mx = B::load_unaligned(s);
      for (j = Wd; j + Wd <= n; j += Wd) mx = xsimd::max(mx, B::load_unaligned(s + j));
      alignas(64) T lanes[Wd];  // xsimd 8.1 has no horizontal max
      mx.store_aligned(lanes);
      for (Index l = 0; l < Wd; ++l) m = std::max(m, lanes[l]);
    }
  }
#endif
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

/// s[j] = exp(s[j] - shift) in place for j < n (-inf entries give 0); returns their sum in W.
/// shift is the row's max (finite), so every value is in [0, 1].
template <class Arch, class T>
inline wide_t<T> exp_shifted_sum(Arch, T* s, Index n, T shift) {
  using W = wide_t<T>;
  W sum = 0;
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    constexpr Index Wd = static_cast<Index>(B::size);
    const B shift_b(shift);
    xsimd::batch<W, Arch> acc(W(0));
    for (; j + Wd <= n; j += Wd) {
      exp_shifted(B::load_unaligned(s + j), shift_b).store_unaligned(s + j);
      add_wide(s + j, acc);
    }
    sum = xsimd::hadd(acc);
  }
#endif
  for (; j < n; ++j) {
    // clamped as the kernel does; std::max returns its first argument when either is NaN
    s[j] = std::exp(std::max(s[j] - shift, T(-800)));
    sum += static_cast<W>(s[j]);
  }
  return sum;
}

/// out[j] = factor * s[j] for j < n (out may be s).
template <class Arch, class T>
inline void scale_row(Arch, const T* s, Index n, T factor, T* out) {
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    constexpr Index Wd = static_cast<Index>(B::size);
    const B f(factor);
    for (; j + Wd <= n; j += Wd) (B::load_unaligned(s + j) * f).store_unaligned(out + j);
  }
#endif
  for (; j < n; ++j) out[j] = s[j] * factor;
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
  scale_row(arch, s, n_out, static_cast<T>(wide_t<T>(1) / sum), out);
  return true;
}

/// sum_j a[j] b[j] in W (the softmax backward's delta: terms of both signs).
template <class Arch, class T>
inline wide_t<T> row_dot(Arch, const T* a, const T* b, Index n) {
  using W = wide_t<T>;
  W sum = 0;
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using BW = xsimd::batch<W, Arch>;
    constexpr Index Wd = static_cast<Index>(BW::size);
    BW acc(W(0));
    for (; j + Wd <= n; j += Wd)
      acc = xsimd::fma(BW::load_unaligned(a + j), BW::load_unaligned(b + j), acc);
    sum = xsimd::hadd(acc);
  }
#endif
  for (; j < n; ++j) sum += static_cast<W>(a[j]) * static_cast<W>(b[j]);
  return sum;
}

/// ds[j] = p[j] (ds[j] - delta) in place for j < n: the softmax backward given its delta.
template <class Arch, class T>
inline void softmax_backward_apply(Arch, const T* p, T* ds, Index n, T delta) {
  Index j = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    using B = xsimd::batch<T, Arch>;
    constexpr Index Wd = static_cast<Index>(B::size);
    const B d(delta);
    for (; j + Wd <= n; j += Wd)
      (B::load_unaligned(p + j) * (B::load_unaligned(ds + j) - d)).store_unaligned(ds + j);
  }
#endif
  for (; j < n; ++j) ds[j] = p[j] * (ds[j] - delta);
}

/// Backward of one softmax row p[0..n): dp holds dL/dp on entry and dL/ds on exit,
///   ds_j = p_j (dp_j - sum_l p_l dp_l).
template <class Arch, class T>
inline void softmax_backward_row(Arch arch, const T* p, T* dp, Index n) {
  softmax_backward_apply(arch, p, dp, n, static_cast<T>(row_dot(arch, p, dp, n)));
}

}  // namespace detail
MIXATTN_END_NAMESPACE
