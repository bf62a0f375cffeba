// mixattn/detail/fast_exp.hpp — exp on registers of float for the softmax passes of the tiled
// kernels, where the arguments are shifted logits x = s - max <= 0.
//
// Internal: included by the kernels that need it.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/simd.hpp"

#include <cstdint>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

#if MIXATTN_HAS_SIMD
/// exp(x) lane by lane, float, for x in [-104, 89] or NaN, within ~1 ulp of the correctly
/// rounded value (the unit test sweeps the range densely; subnormal results are rounded once,
/// from a normal number), in about half the instructions of xsimd::exp:
///   n = round(x log2 e),  r = x - n ln2 (two constants, Cody-Waite: n ln2_hi is exact),
///   exp(r) = 1 + r + r^2 P(r) on |r| <= ln2 / 2, P of degree 4 (near-minimax: Chebyshev
///   interpolation of (e^r - 1 - r) / r^2; 0.2 ulp before rounding),
///   exp(x) = 2^n exp(r).
/// The round is one FMA against 1.5 * 2^23, whose low mantissa bits then hold n as an integer.
/// NaN stays NaN. Callers clamp: fast_exp and fast_exp_nonpositive below.
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<float, Arch> fast_exp_in_range(
    const xsimd::batch<float, Arch>& x) {
  using B = xsimd::batch<float, Arch>;
  const B magic(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer (|n| < 2^22)
  const B t = xsimd::fma(x, B(1.44269504088896341f), magic);
  const B n = t - magic;
  B r = xsimd::fnma(n, B(0.693359375f), x);   // ln2_hi: 9 bits, so n ln2_hi is exact
  r = xsimd::fnma(n, B(-2.12194440e-4f), r);  // ln2_lo = ln 2 - ln2_hi
  B p(1.3927690538e-3f);
  p = xsimd::fma(p, r, B(8.3643854334e-3f));
  p = xsimd::fma(p, r, B(4.1666545384e-2f));
  p = xsimd::fma(p, r, B(1.6666569599e-1f));
  p = xsimd::fma(p, r, B(0.5f));
  p = xsimd::fma(p, r, B(1.0f));
  p = xsimd::fma(p, r, B(1.0f));  // 1 + r + r^2 P(r), in [0.7, 1.42]
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    // p 2^n in one rounding, gradual underflow and overflow included
    return B(_mm512_scalef_ps(p, n));
  }
#endif
  // 2^n as two normal factors 2^n1 2^n2, n1 = floor(n / 2) and n2 = n - n1 in [-75, 64] for n
  // in [-150, 128]: p 2^n1 is exact, the second product rounds once (to a subnormal, or to inf).
  using I = xsimd::batch<std::int32_t, Arch>;
  const I ni = xsimd::bitwise_cast<I>(t) - I(0x4B400000);  // the bits of magic
  const I n1 = ni >> 1;                                    // arithmetic shift: floor
  const I n2 = ni - n1;
  const B s1 = xsimd::bitwise_cast<B>((n1 + I(127)) << 23);
  const B s2 = xsimd::bitwise_cast<B>((n2 + I(127)) << 23);
  return (p * s1) * s2;
}

/// exp(x) for any x, float (fast_exp_in_range's accuracy). x is clamped to [-104, 89] first:
/// exp(-104) is below half the smallest subnormal (rounds to 0, as does -inf), exp(89) overflows
/// to +inf (as does +inf). NaN stays NaN: the vector max and min return their second operand,
/// x, when either is NaN.
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<float, Arch> fast_exp(const xsimd::batch<float, Arch>& x) {
  using B = xsimd::batch<float, Arch>;
  return fast_exp_in_range(xsimd::min(B(89.0f), xsimd::max(B(-104.0f), x)));
}

/// exp(x) for x <= 0 or NaN (shifted logits x = s - max), clamped below only: fast_exp without
/// one instruction. -inf gives 0.
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<float, Arch> fast_exp_nonpositive(
    const xsimd::batch<float, Arch>& x) {
  using B = xsimd::batch<float, Arch>;
  return fast_exp_in_range(xsimd::max(B(-104.0f), x));
}
#endif

}  // namespace detail
MIXATTN_END_NAMESPACE
