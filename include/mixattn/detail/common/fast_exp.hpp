// mixattn/detail/common/fast_exp.hpp — exp on registers of float for the softmax passes of the
// tiled kernels, where the arguments are shifted logits x = s - max <= 0.
//
// Internal: included by the kernels that need it.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/simd.hpp"

#include <cstdint>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

#if MIXATTN_HAS_SIMD
/// z - x y in one rounding. xsimd 8.1's fnma on AVX-512 computes (0 - x) y + z, one more
/// instruction (a vector subtract) for the same value: the negation is exact, and with x = +0 only
/// the sign of a zero result can differ, which the callers below never see (r = +-0 gives p = 1).
/// fast_exp_nonpositive over registers in L1 (Zen 5): 6.6 -> 6.3 cycles per register.
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<float, Arch> fnma_one_rounding(
    const xsimd::batch<float, Arch>& x, const xsimd::batch<float, Arch>& y,
    const xsimd::batch<float, Arch>& z) {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value)
    return xsimd::batch<float, Arch>(_mm512_fnmadd_ps(x, y, z));
#endif
  return xsimd::fnma(x, y, z);
}

/// 1.5 * 2^23 + 254. t = x log2(e) + exp_round_magic rounds x log2(e) to an integer n (|n| < 2^22;
/// the constant is even, so ties go to the same n as with 1.5 * 2^23 alone), and t's bits are then
/// 0x4B400000 + u with u = n + 254: the biased exponents of the two factors of 2^n below, in one
/// integer the FMA already made.
constexpr float exp_round_magic = 12583166.0f;

/// 1.5 * 2^23 + 128, for the one-factor scaling of fast_exp_nonpositive_flush_many: the same
/// rounding to n (even as well), and t's bits 0x4B400000 + u with u = n + 128, the biased
/// exponent of 2^(n + 1).
constexpr float exp_round_magic_flush = 12583040.0f;

/// p 2^n from t = n + exp_round_magic (n in [-150, 128]), without AVX-512's scalef: 2^n as two
/// normal factors 2^n1 2^n2, n1 = floor(n / 2) and n2 = n - n1 in [-75, 64], so that p 2^n1 is
/// exact and the second product rounds once (to a subnormal, or to inf). Their biased exponents
/// are n1 + 127 = u >> 1 and n2 + 127 = u - (u >> 1) for u = n + 254 in [104, 382]; the bits of t
/// and t >> 1 (arithmetic) carry them above 0x4B400000 and 0x25A00000, whose low 21 bits are zero
/// and which the shift by 23 into the exponent field drops. Four integer instructions (seven with
/// n itself rebiased twice; the same bits).
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<float, Arch> times_two_to_n(const xsimd::batch<float, Arch>& p,
                                                               const xsimd::batch<float, Arch>& t) {
  using B = xsimd::batch<float, Arch>;
  using I = xsimd::batch<std::int32_t, Arch>;
  const I bits = xsimd::bitwise_cast<I>(t);
  const I half = bits >> 1;  // arithmetic shift of a positive integer: floor
  const B s1 = xsimd::bitwise_cast<B>(half << 23);
  const B s2 = xsimd::bitwise_cast<B>((bits - half) << 23);
  return (p * s1) * s2;
}

/// exp(x) lane by lane, float, for x in [-104, 89] or NaN, within ~1 ulp of the correctly
/// rounded value (the unit test sweeps the range densely; subnormal results are rounded once,
/// from a normal number), in about half the instructions of xsimd::exp:
///   n = round(x log2 e),  r = x - n ln2 (two constants, Cody-Waite: n ln2_hi is exact),
///   exp(r) = 1 + r + r^2 P(r) on |r| <= ln2 / 2, P of degree 4 (near-minimax: Chebyshev
///   interpolation of (e^r - 1 - r) / r^2; 0.2 ulp before rounding),
///   exp(x) = 2^n exp(r).
/// The round is one FMA against exp_round_magic, whose low mantissa bits then hold n + 254.
/// NaN stays NaN. Callers clamp: fast_exp and fast_exp_nonpositive below.
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<float, Arch> fast_exp_in_range(
    const xsimd::batch<float, Arch>& x) {
  using B = xsimd::batch<float, Arch>;
  const B magic(exp_round_magic);
  const B t = xsimd::fma(x, B(1.44269504088896341f), magic);
  const B n = t - magic;
  B r = fnma_one_rounding<Arch>(n, B(0.693359375f), x);   // ln2_hi: 9 bits: n ln2_hi is exact
  r = fnma_one_rounding<Arch>(n, B(-2.12194440e-4f), r);  // ln2_lo = ln 2 - ln2_hi
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
  return times_two_to_n<Arch>(p, t);
}

/// fast_exp_in_range's stages before its scaling, for x[0 .. N) stage by stage across the N
/// registers (every t, then every n, every r, each Horner step): t = x log2 e + magic, n = t -
/// magic, r = x - n ln2, and p = c (1 + r + r^2 P(r)), the Horner steps on coefficients times c
/// (c = 1, or 1/2: halving commutes with rounding, so c p exactly). One register's exp is a chain
/// of ~10 dependent FMAs (4 cycles each), and the compiler keeps source order: in a loop over
/// registers the core does not overlap enough of the chains. Zen 5, a pass over 256 registers in
/// L1: fast_exp_nonpositive register by register 6.3-6.6 cycles per register, 4 or 8 registers
/// in lockstep 5.6-6.0, 16 (spilled) 8.1; the FMA ports' bound is 4.5 (9 FMAs).
template <int N, class Arch>
MIXATTN_ALWAYS_INLINE void fast_exp_poly_many(const xsimd::batch<float, Arch>* x, float magic_value,
                                              float c, xsimd::batch<float, Arch>* t,
                                              xsimd::batch<float, Arch>* n,
                                              xsimd::batch<float, Arch>* p) {
  using B = xsimd::batch<float, Arch>;
  const B magic(magic_value);
  B r[N];
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) t[k] = xsimd::fma(x[k], B(1.44269504088896341f), magic);
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) n[k] = t[k] - magic;
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) r[k] = fnma_one_rounding<Arch>(n[k], B(0.693359375f), x[k]);
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) r[k] = fnma_one_rounding<Arch>(n[k], B(-2.12194440e-4f), r[k]);
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k)
    p[k] = xsimd::fma(B(c * 1.3927690538e-3f), r[k], B(c * 8.3643854334e-3f));
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) p[k] = xsimd::fma(p[k], r[k], B(c * 4.1666545384e-2f));
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) p[k] = xsimd::fma(p[k], r[k], B(c * 1.6666569599e-1f));
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) p[k] = xsimd::fma(p[k], r[k], B(c * 0.5f));
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) p[k] = xsimd::fma(p[k], r[k], B(c));
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) p[k] = xsimd::fma(p[k], r[k], B(c));
}

/// fast_exp_in_range of x[0 .. N) in place, bit for bit, stage by stage (fast_exp_poly_many,
/// then every scaling).
template <int N, class Arch>
MIXATTN_ALWAYS_INLINE void fast_exp_in_range_many(xsimd::batch<float, Arch>* x) {
  using B = xsimd::batch<float, Arch>;
  B t[N], n[N], p[N];
  fast_exp_poly_many<N, Arch>(x, exp_round_magic, 1.0f, t, n, p);
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
#pragma GCC unroll 32
    for (int k = 0; k < N; ++k) x[k] = B(_mm512_scalef_ps(p[k], n[k]));
    return;
  }
#endif
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) x[k] = times_two_to_n<Arch>(p[k], t[k]);
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

/// Registers a kernel hands to one fast_exp_*_many call: 8 in lockstep keep ~24 values live, which
/// 32 registers hold beside a kernel's own; 16 registers take 4.
template <class Arch>
constexpr int exp_interleave() {
  return simd_registers<Arch>() >= 32 ? 8 : 4;
}

/// fast_exp_nonpositive of x[0 .. N) in place, bit for bit: fast_exp_in_range_many after the
/// clamp.
template <int N, class Arch>
MIXATTN_ALWAYS_INLINE void fast_exp_nonpositive_many(xsimd::batch<float, Arch>* x) {
  using B = xsimd::batch<float, Arch>;
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) x[k] = xsimd::max(B(-104.0f), x[k]);
  fast_exp_in_range_many<N, Arch>(x);
}

/// fast_exp_nonpositive_many's results, bit for bit, except that those with n <= -128 are 0 (the
/// results below about 2^-127.5; the subnormal ones above that keep their bits): where the
/// kernel runs with subnormals flushed (FlushSubnormals), those results are 0 there too, and this
/// is its bits everywhere. 2^n as one factor, 2^(n + 1) = 2^(u - 127) built from the
/// biased exponent u = n + 128 that t's low bits carry (against exp_round_magic_flush), clamped
/// at 0 (then the factor is +0, and so is the result; NaN stays NaN), times p / 2 (the Horner
/// steps on halved coefficients: p / 2 exactly, since halving commutes with rounding): one
/// rounding of the exact p 2^n, as the two factors' second product makes, in three instructions
/// instead of six. GMA's softmax passes (N = 4 in lockstep over L1 data with their sums, Zen 3:
/// ~8.0 against ~8.8 cycles a register). With AVX-512's scalef, fast_exp_nonpositive_many itself.
template <int N, class Arch>
MIXATTN_ALWAYS_INLINE void fast_exp_nonpositive_flush_many(xsimd::batch<float, Arch>* x) {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    fast_exp_nonpositive_many<N, Arch>(x);
    return;
  }
#endif
  using B = xsimd::batch<float, Arch>;
  using I = xsimd::batch<std::int32_t, Arch>;
  B t[N], n[N], p[N];
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k) x[k] = xsimd::max(B(-104.0f), x[k]);
  fast_exp_poly_many<N, Arch>(x, exp_round_magic_flush, 0.5f, t, n, p);  // p / 2
  // t's bits are 0x4B400000 + u, u = n + 128 in [-22, 128]; below 0x4B400000 the clamp makes
  // u = 0; the shift by 23 drops the constant's bits (its low 22 are zero, bit 22 goes past 31)
  const I base(0x4B400000);
#pragma GCC unroll 32
  for (int k = 0; k < N; ++k)
    x[k] = p[k] * xsimd::bitwise_cast<B>(xsimd::max(xsimd::bitwise_cast<I>(t[k]), base) << 23);
}

/// exp(x) lane by lane, double, for x <= 0 or NaN, within ~1 ulp: x clamped at -708 (exp(-708)
/// is near the smallest normal double; below, the callers' sums cannot tell it from the true
/// value), n = round(x log2 e) by one FMA against 1.5 * 2^52 (whose low bits then hold n),
/// r = x - n ln2 in two steps (n ln2_hi exact: ln2_hi has 21 trailing zero bits), exp(r) by its
/// Taylor polynomial of degree 13 (the remainder below 5e-18 relative on |r| <= ln2 / 2), and
/// 2^n built in the exponent field from the same low bits. For the mixture constants (softplus
/// of K r raw variances on every call): xsimd 8.1's double exp converts its exponent through
/// memory, and took ~4x as long on AVX2.
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<double, Arch> exp_nonpositive_double(
    const xsimd::batch<double, Arch>& x_in) {
  using B = xsimd::batch<double, Arch>;
  using I = xsimd::batch<std::int64_t, Arch>;
  const B magic(6755399441055744.0);        // 1.5 * 2^52
  const B x = xsimd::max(B(-708.0), x_in);  // NaN stays: max returns its second operand
  const B t = xsimd::fma(x, B(1.4426950408889634074), magic);
  const B n = t - magic;
  B r = xsimd::fnma(n, B(6.93147180369123816490e-01), x);  // ln2_hi
  r = xsimd::fnma(n, B(1.90821492927058770002e-10), r);    // ln2_lo = ln 2 - ln2_hi
  B p(1.0 / 6227020800.0);                                 // 1 / 13!
  p = xsimd::fma(p, r, B(1.0 / 479001600.0));
  p = xsimd::fma(p, r, B(1.0 / 39916800.0));
  p = xsimd::fma(p, r, B(1.0 / 3628800.0));
  p = xsimd::fma(p, r, B(1.0 / 362880.0));
  p = xsimd::fma(p, r, B(1.0 / 40320.0));
  p = xsimd::fma(p, r, B(1.0 / 5040.0));
  p = xsimd::fma(p, r, B(1.0 / 720.0));
  p = xsimd::fma(p, r, B(1.0 / 120.0));
  p = xsimd::fma(p, r, B(1.0 / 24.0));
  p = xsimd::fma(p, r, B(1.0 / 6.0));
  p = xsimd::fma(p, r, B(0.5));
  p = xsimd::fma(p, r, B(1.0));
  p = xsimd::fma(p, r, B(1.0));
  // t's bits are those of 1.5 * 2^52 plus n (n in [-1022, 0]); the constant's low 12 bits are
  // zero, so (bits + 1023) << 52 is the biased exponent n + 1023 alone: 2^n
  const I bits = xsimd::bitwise_cast<I>(t);
  return p * xsimd::bitwise_cast<B>((bits + I(1023)) << 52);
}

/// log1p(u) lane by lane, double, for u in [0, 1] or NaN, within ~1.5 ulp: with m = 1 + u (or
/// (1 + u) / 2 above sqrt 2 - 1, adding ln 2) in [0.707, 1.414], s = (m - 1) / (m + 1) formed
/// from u directly (u / (u + 2), or (u - 1) / (u + 3)), |s| <= 0.1716, and
/// log m = 2 s (1 + z / 3 + z^2 / 5 + ... + z^11 / 23), z = s^2 (the series' tail below 1e-18).
/// The second half of softplus(w) = max(w, 0) + log1p(exp(-|w|)); xsimd 8.1's log1p took ~5x as
/// long on AVX2.
template <class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<double, Arch> log1p_unit_double(
    const xsimd::batch<double, Arch>& u) {
  using B = xsimd::batch<double, Arch>;
  const auto big = u > B(0.41421356237309504880);
  const B s = xsimd::select(big, u - B(1.0), u) / (u + xsimd::select(big, B(3.0), B(2.0)));
  const B z = s * s, two_s = s + s;
  B q(1.0 / 23.0);
  q = xsimd::fma(q, z, B(1.0 / 21.0));
  q = xsimd::fma(q, z, B(1.0 / 19.0));
  q = xsimd::fma(q, z, B(1.0 / 17.0));
  q = xsimd::fma(q, z, B(1.0 / 15.0));
  q = xsimd::fma(q, z, B(1.0 / 13.0));
  q = xsimd::fma(q, z, B(1.0 / 11.0));
  q = xsimd::fma(q, z, B(1.0 / 9.0));
  q = xsimd::fma(q, z, B(1.0 / 7.0));
  q = xsimd::fma(q, z, B(1.0 / 5.0));
  q = xsimd::fma(q, z, B(1.0 / 3.0));
  const B log_m = xsimd::fma(two_s * z, q, two_s);
  // ln 2 in two parts, the small one first: their sum with log_m rounds once at the end
  return xsimd::select(big, (log_m + B(2.3190468138462996154e-17)) + B(6.9314718055994528623e-01),
                       log_m);
}
#endif

}  // namespace detail
MIXATTN_END_NAMESPACE
