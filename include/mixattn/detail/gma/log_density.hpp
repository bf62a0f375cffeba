// mixattn/detail/gma/log_density.hpp — Gaussian log-densities and responsibilities (SPEC 1.2).
//
//   s_k(x) = log pi_k - 1/2 sum_m log var_km - 1/2 sum_m (x_m - mu_km)^2 / var_km,  gamma = softmax
//   s
//
// Computed in the cancellation-free form sum_m (x_m a_km - b_km)^2 with a = 1/(sigma sqrt 2),
// b = mu a (the 1/2 is folded into a and b): two FMAs per (token, component, dim), no term ever
// larger than the result's own scale. The expanded (X.X) L^T - 2 X (L.mu)^T + c form would lose
// every digit in float once |mu| / sigma is large.
//
// The kernel vectorises over components: A^T and B^T are packed so that for a fixed dim m the
// a_km of W consecutive components sit in one register; x_im is broadcast. A tile of TI tokens by
// TK component-vectors keeps TI*TK accumulators in registers (a GEMM micro-kernel with a square
// instead of a product), so no horizontal reduction is needed and the loads are amortised.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/detail/common/softmax.hpp"
#include "mixattn/gma_types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// softplus(w) = log(1 + e^w), stable everywhere: w for large w, e^w for very negative w.
template <class W>
inline W softplus(W w) {
  using std::abs, std::exp, std::log1p;
  return std::max(w, W(0)) + log1p(exp(-abs(w)));
}

/// out[i] = softplus(x[i]) + add for i < n, in W: in vectors of double where the build has them
/// (fast_exp.hpp's exp_nonpositive_double and log1p_unit_double, a few ulp of double from the
/// scalar twin softplus, which the test MixtureConstants.VectorSoftplusMatchesScalar bounds), the
/// tail and other builds scalar. A mixture's K x r variances are computed on every call: at
/// K = r = 64 the scalar libm calls alone took longer than the responsibilities of 300 tokens,
/// and xsimd's double exp and log1p still ~1% of a forward at N = 4096 (AVX2).
template <class W, class T>
inline void softplus_into(const T* x, Index n, W add, W* out) {
  Index i = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<simd_arch, scalar_arch>::value && std::is_same<W, double>::value &&
                std::is_same<W, wide_t<T>>::value) {
    using BW = xsimd::batch<W, simd_arch>;
    constexpr Index WW = static_cast<Index>(BW::size);
    const Index whole = n / WW * WW;
    // Two passes, e = exp(-|w|) into out and then the rest: in one, each register's exp and
    // log1p form one long dependent chain and the loop took 40% longer (K = r = 64, AVX-512).
    for (; i < whole; i += WW)
      exp_nonpositive_double(-xsimd::abs(load_wide<simd_arch>(x + i))).store_unaligned(out + i);
    for (i = 0; i < whole; i += WW) {
      const BW w = load_wide<simd_arch>(x + i);
      (xsimd::max(w, BW(W(0))) + log1p_unit_double(BW::load_unaligned(out + i)) + BW(add))
          .store_unaligned(out + i);
    }
  }
#endif
  for (; i < n; ++i) out[i] = softplus(static_cast<W>(x[i])) + add;
}

/// out[i] = (1 / sqrt 2) / sqrt(var[i]) for i < n, in vectors of W where the build has them: the
/// hardware's square root and division are correctly rounded in any width, so these are the
/// scalar formula's bits (K r scalar square roots and divisions took longer than packing the
/// coefficients). Not Eigen's array sqrt: with EIGEN_FAST_MATH (its default) that one is an
/// approximation refined by Newton steps, off in the last bit.
template <class W>
inline void density_scale_into(const W* var, Index n, W* out) {
  const W c = W(1) / std::sqrt(W(2));
  Index i = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<simd_arch, scalar_arch>::value) {
    using BW = xsimd::batch<W, simd_arch>;
    constexpr Index WW = static_cast<Index>(BW::size);
    for (; i + WW <= n; i += WW)
      (BW(c) / xsimd::sqrt(BW::load_unaligned(var + i))).store_unaligned(out + i);
  }
#endif
  for (; i < n; ++i) out[i] = c / std::sqrt(var[i]);
}

/// sum_i log x[i] for i < n, x > 0 (a row of variances), in double: each x = 2^e m (m in
/// [1, 2), from its bits) in vectors where the build has them, the exponents summed as
/// integers and the mantissas multiplied (16 per lane at a time: below 2^16, then folded into
/// one renormalised scalar), so that one log per call replaces n (K r scalar logs took longer
/// than the responsibilities of 50 tokens). Error: the product's n roundings, n eps / 2
/// relative, i.e. n eps / 2 in the log, and e log 2 in two parts (ln2_hi e exact); the sum of
/// n logs rounds as much. A vector with a lane that is not a positive normal number
/// (subnormal, zero, negative, inf or NaN) and the tail take scalar logs.
template <class W>
inline W log_sum(const W* x, Index n) {
  W mant = W(1), tail = W(0);
  std::int64_t e2 = 0;
  Index i = 0;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<simd_arch, scalar_arch>::value && std::is_same<W, double>::value) {
    using B = xsimd::batch<double, simd_arch>;
    using I = xsimd::batch<std::int64_t, simd_arch>;
    constexpr Index L = static_cast<Index>(B::size);
    const I expo(0x7ff0000000000000), frac(0x000fffffffffffff), one(0x3ff0000000000000);
    while (i + L <= n) {
      B p(1.0);
      I e(0);
      std::int64_t steps = 0;
      for (int s = 0; s < 16 && i + L <= n; ++s, i += L) {
        const I bits = xsimd::bitwise_cast<I>(B::load_unaligned(x + i));
        const I field = bits & expo;
        if (xsimd::any((field == I(0)) | (field == expo) | (bits < I(0)))) {
          for (Index j = 0; j < L; ++j) tail += std::log(x[i + j]);
          continue;
        }
        e += field >> 52;
        p *= xsimd::bitwise_cast<B>((bits & frac) | one);
        ++steps;
      }
      alignas(64) double lanes[L];
      alignas(64) std::int64_t exps[L];
      p.store_aligned(lanes);
      e.store_aligned(exps);
      for (Index j = 0; j < L; ++j) {
        mant *= lanes[j];  // mant < 1 times L factors below 2^16
        e2 += exps[j] - 1023 * steps;
      }
      int k = 0;
      mant = std::frexp(mant, &k);
      e2 += k;
    }
  }
#endif
  for (; i < n; ++i) tail += std::log(x[i]);
  // log 2 = ln2_hi + ln2_lo, ln2_hi with 32 significant bits: ln2_hi e2 is exact for |e2| < 2^21
  const W e = static_cast<W>(e2);
  return (std::log(mant) + e * W(1.90821492927058770002e-10)) + e * W(6.93147180369123816490e-01) +
         tail;
}

/// Fills c in place (its capacity is reused when the mixture's shape repeats).
template <class W, class T>
void mixture_constants_into(MixtureConstants<W>& c, const Matrix<T>& var_raw,
                            const Vector<T>& prior_logit, T var_floor) {
  const Index K = var_raw.rows(), r = var_raw.cols();
  c.var.resize(K, r);
  softplus_into<W>(var_raw.data(), K * r, static_cast<W>(var_floor), c.var.data());
  // prior_logit cast to W as expressions (no temporary vector)
  const W amax = prior_logit.template cast<W>().maxCoeff();
  const W lse = amax + std::log((prior_logit.template cast<W>().array() - amax).exp().sum());
  c.log_pi = prior_logit.template cast<W>().array() - lse;
  c.offset.resize(K);
  for (Index k = 0; k < K; ++k)
    c.offset(k) = c.log_pi(k) - W(0.5) * log_sum(c.var.data() + k * r, r);
  c.scale.resize(K, r);
  density_scale_into(c.var.data(), K * r, c.scale.data());
}

template <class W, class T>
MixtureConstants<W> mixture_constants(const Matrix<T>& mean, const Matrix<T>& var_raw,
                                      const Vector<T>& prior_logit, T var_floor) {
  (void)mean;
  MixtureConstants<W> c;
  mixture_constants_into(c, var_raw, prior_logit, var_floor);
  return c;
}

/// The kernel's coefficients of component k, dimension m: a = 1/sqrt(2 var), b = mean a, so that
/// (x a - b)^2 = (x - mean)^2 / (2 var). One definition for pack_density and pack_density_dims:
/// forward and backward must see the same t = x a - b, bit for bit.
template <class T, class W>
inline void density_coefficients(const Matrix<T>& mean, const MixtureConstants<W>& c, Index k,
                                 Index m, T& a, T& b) {
  const W aw = c.scale(k, m);  // W(1) / sqrt(W(2)) / sqrt(var(k, m))
  a = static_cast<T>(aw);
  b = static_cast<T>(static_cast<W>(mean(k, m)) * aw);
}

/// Packs into p, reusing its capacity.
template <class Arch, class T, class W>
void pack_density_into(PackedDensity<T>& p, const Matrix<T>& mean, const MixtureConstants<W>& c) {
  const Index K = mean.rows(), r = mean.cols();
  const Index width = static_cast<Index>(simd_width<Arch, T>::value);
  p.components = K;
  p.dim = r;
  p.width = width;
  p.padded = (K + width - 1) / width * width;
  const Index kv = p.padded / width;
  p.ab.assign(static_cast<std::size_t>(r * kv * 2 * width), T(0));
  p.offset.assign(static_cast<std::size_t>(p.padded), -std::numeric_limits<T>::infinity());
  for (Index k = 0; k < K; ++k) {
    p.offset[k] = static_cast<T>(c.offset(k));
    const Index v = k / width, lane = k % width;
    for (Index m = 0; m < r; ++m) {
      T* slot = p.ab.data() + (m * kv + v) * 2 * width;
      density_coefficients(mean, c, k, m, slot[lane], slot[width + lane]);
    }
  }
}

template <class Arch, class T, class W>
PackedDensity<T> pack_density(const Matrix<T>& mean, const MixtureConstants<W>& c) {
  PackedDensity<T> p;
  pack_density_into<Arch>(p, mean, c);
  return p;
}

#if MIXATTN_HAS_SIMD
/// acc[i][j] = sum_m (x_im a - b)^2 for TI tokens (rows of x, stride ldx) and TK component
/// vectors starting at vector kv0: the register tile the log-density and the fused
/// responsibilities share.
template <int TI, int TK, class Arch, class T>
MIXATTN_ALWAYS_INLINE void log_density_acc(const PackedDensity<T>& p, const T* x, Index ldx,
                                           Index kv0, xsimd::batch<T, Arch> (&acc)[TI][TK]) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  const Index r = p.dim, kv = p.padded / Wd;
  for (int i = 0; i < TI; ++i)
    for (int j = 0; j < TK; ++j) acc[i][j] = B(T(0));
  const T* ab = p.ab.data() + kv0 * 2 * Wd;
  for (Index m = 0; m < r; ++m, ab += kv * 2 * Wd) {
    B a[TK], b[TK];
    for (int j = 0; j < TK; ++j) {
      a[j] = B::load_unaligned(ab + j * 2 * Wd);
      b[j] = B::load_unaligned(ab + j * 2 * Wd + Wd);
    }
    for (int i = 0; i < TI; ++i) {
      const B xb(x[i * ldx + m]);
      for (int j = 0; j < TK; ++j) {
        const B t = xsimd::fms(xb, a[j], b[j]);
        acc[i][j] = xsimd::fma(t, t, acc[i][j]);
      }
    }
  }
}

/// s = offset - sum_m (x_m a - b)^2 for TI tokens (rows of x, stride ldx) and TK component
/// vectors starting at vector kv0; writes rows of `s` (stride lds, padded component index).
template <int TI, int TK, class Arch, class T>
inline void log_density_tile(Arch, const PackedDensity<T>& p, const T* x, Index ldx, Index kv0,
                             T* s, Index lds) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B acc[TI][TK];
  log_density_acc<TI, TK, Arch>(p, x, ldx, kv0, acc);
  for (int j = 0; j < TK; ++j) {
    const B off = B::load_unaligned(p.offset.data() + (kv0 + j) * Wd);
    for (int i = 0; i < TI; ++i) (off - acc[i][j]).store_unaligned(s + i * lds + (kv0 + j) * Wd);
  }
}

/// The component vectors from v0 on for TI tokens: full TK groups, then the rest in groups of
/// TK / 2, TK / 4, ... (a token's arithmetic does not depend on the group it falls in: bitwise).
template <int TI, int TK, class Arch, class T>
inline void log_density_rows(Arch arch, const PackedDensity<T>& p, const T* x, Index ldx, T* s,
                             Index lds, Index v0 = 0) {
  const Index kv = p.padded / p.width;
  Index v = v0;
  for (; v + TK <= kv; v += TK) log_density_tile<TI, TK>(arch, p, x, ldx, v, s, lds);
  if constexpr (TK > 1)
    if (v < kv) log_density_rows<TI, TK / 2>(arch, p, x, ldx, s, lds, v);
}

/// a[0] + ... + a[R-1] in float, pairwise: a token's exponentials, each lane's group of at most 4
/// terms in [0, 1] within 2 eps of its exact sum, before one widening.
template <int R, class Arch>
MIXATTN_ALWAYS_INLINE xsimd::batch<float, Arch> pairwise_sum(const xsimd::batch<float, Arch>* a) {
  static_assert(R >= 1 && R <= 4, "four registers at most in a token's float sum");
  if constexpr (R == 4)
    return (a[0] + a[1]) + (a[2] + a[3]);
  else if constexpr (R == 3)
    return (a[0] + a[1]) + a[2];
  else if constexpr (R == 2)
    return a[0] + a[1];
  else
    return a[0];
}

/// responsibilities_tile's maxima: each token's exact max over its logits (acc), as the shift of
/// its exponentials. A token whose max is not finite or that has a NaN logit (padding included)
/// fails: its shift is +inf, so that every lane of its stages below is -inf or NaN (exp_shifted
/// gives 0 or NaN, with no out-of-range exponent: with a NaN lane, the vector max may miss the
/// true maximum, and s - m would then be large and positive). Returns the failed tokens' mask.
template <int TI, int TK, class Arch, class T>
MIXATTN_ALWAYS_INLINE unsigned tile_softmax_shifts(const xsimd::batch<T, Arch> (&acc)[TI][TK],
                                                   xsimd::batch<T, Arch> (&shift)[TI]) {
  using B = xsimd::batch<T, Arch>;
  unsigned failed = 0;
#pragma GCC unroll 32
  for (int i = 0; i < TI; ++i) {
    B mx = acc[i][0];
    auto bad = xsimd::isnan(acc[i][0]);
#pragma GCC unroll 8
    for (int j = 1; j < TK; ++j) {
      mx = xsimd::max(mx, acc[i][j]);
      bad = bad | xsimd::isnan(acc[i][j]);
    }
    const T m = reduce_max(mx);
    const bool bad_row = xsimd::any(bad) || m == -std::numeric_limits<T>::infinity();
    failed |= unsigned(bad_row) << i;
    shift[i] = B(bad_row ? std::numeric_limits<T>::infinity() : m);
  }
  return failed;
}

/// responsibilities_tile's exponentials: acc = exp(acc - shift) in place and each token's sum in
/// W. In float, exp_shifted of the whole tile (its bits, but 0 below about 2^-127.5: the forward
/// flushes those anyway), exp_interleave registers in lockstep; each token's registers are then
/// added in float, pairwise, before one widening: each lane's group of at most 4 terms in [0, 1]
/// is within 2 eps of its exact sum, and the sum over lanes is wide. Against exp_shifted and
/// add_wide register by register, the epilogue went from ~300 to ~190 cycles per 5 x 4 tile
/// (Zen 5; the tile's FMA loop alone ~1350); with 4, 8 or 20 registers in lockstep alike.
template <int TI, int TK, class Arch, class T>
MIXATTN_ALWAYS_INLINE void tile_exp_sums(xsimd::batch<T, Arch> (&acc)[TI][TK],
                                         const xsimd::batch<T, Arch> (&shift)[TI],
                                         xsimd::batch<wide_t<T>, Arch> (&sum)[TI]) {
  using W = wide_t<T>;
  using BW = xsimd::batch<W, Arch>;
  if constexpr (std::is_same<T, float>::value) {
#pragma GCC unroll 32
    for (int i = 0; i < TI; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < TK; ++j) acc[i][j] = acc[i][j] - shift[i];
    constexpr int N = TI * TK, G = std::min(exp_interleave<Arch>(), N);
#pragma GCC unroll 32
    for (int g = 0; g + G <= N; g += G) fast_exp_nonpositive_flush_many<G, Arch>(&acc[0][0] + g);
    if constexpr (N % G != 0) fast_exp_nonpositive_flush_many<N % G, Arch>(&acc[0][0] + N / G * G);
#pragma GCC unroll 32
    for (int i = 0; i < TI; ++i) {
      sum[i] = widened_halves_sum<Arch, T>(pairwise_sum<TK, Arch>(acc[i]));
    }
  } else {
    for (int i = 0; i < TI; ++i) {
      sum[i] = BW(W(0));
      for (int j = 0; j < TK; ++j) {
        acc[i][j] = exp_shifted(acc[i][j], shift[i]);
        add_wide(sum[i], acc[i][j]);
      }
    }
  }
}

/// Responsibilities of TI tokens when the whole padded row is TK registers (K <= TK lanes): the
/// log-density tile's accumulators go through the softmax (softmax.hpp's row: same exact max,
/// the same exp in float but for results below about 2^-127.5, which are 0 here as when
/// subnormals are flushed (fast_exp_nonpositive_flush_many); the sum in W, each lane's registers
/// added in float first) without leaving registers, and gamma goes straight to out (stride ldo, K
/// entries a row). The arithmetic of a token does not depend on TI (bitwise), so the tile a token
/// falls in does not matter. Returns a bit mask of the tokens whose softmax failed (no finite max,
/// or a NaN logit, padding included), for the caller's retry in a wider type; their rows of out are
/// not written.
template <int TI, int TK, class Arch, class T>
inline unsigned responsibilities_tile(Arch, const PackedDensity<T>& p, const T* x, Index ldx,
                                      T* out, Index ldo) {
  using B = xsimd::batch<T, Arch>;
  using W = wide_t<T>;
  using BW = xsimd::batch<W, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  static_assert(TI <= 32, "the failure mask has 32 bits");
  const Index K = p.components;
  B acc[TI][TK];
  log_density_acc<TI, TK, Arch>(p, x, ldx, 0, acc);
  // Stage by stage over the TI tokens, so that their reductions' latency chains overlap; acc
  // becomes the logits, then the exponentials. (Token by token, the epilogue took 40% longer.)
#pragma GCC unroll 8
  for (int j = 0; j < TK; ++j) {
    const B off = B::load_unaligned(p.offset.data() + j * Wd);
#pragma GCC unroll 32
    for (int i = 0; i < TI; ++i) acc[i][j] = off - acc[i][j];
  }
  B shift[TI];
  const unsigned failed = tile_softmax_shifts<TI, TK, Arch, T>(acc, shift);
  BW sum[TI];
  tile_exp_sums<TI, TK, Arch, T>(acc, shift, sum);
  alignas(64) T lanes[Wd];
#pragma GCC unroll 32
  for (int i = 0; i < TI; ++i) {
    if (failed & (1u << i)) continue;
    // sum >= 1: the max contributes exp(0)
    const B inv(static_cast<T>(W(1) / xsimd::hadd(sum[i])));
    T* o = out + i * ldo;
#pragma GCC unroll 8
    for (int j = 0; j < TK; ++j) {
      const B g = acc[i][j] * inv;
      if ((j + 1) * Wd <= K) {
        g.store_unaligned(o + j * Wd);
      } else {  // the last, partial register: padding lanes are not written
        g.store_aligned(lanes);
        std::copy(lanes, lanes + (K - j * Wd), o + j * Wd);
      }
    }
  }
  return failed;
}

/// e[0 .. R) = exp(e - shift) in place, stored back to s (R registers from s), and their float
/// pairwise sum widened into sum: one group of a token's exp pass (results below about 2^-127.5 are
/// 0: fast_exp_nonpositive_flush_many).
template <int R, class Arch>
MIXATTN_ALWAYS_INLINE void exp_group(float* s, const xsimd::batch<float, Arch>& shift,
                                     xsimd::batch<double, Arch>& sum) {
  using B = xsimd::batch<float, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B e[R];
#pragma GCC unroll 4
  for (int g = 0; g < R; ++g) e[g] = B::load_unaligned(s + g * Wd) - shift;
  fast_exp_nonpositive_flush_many<R, Arch>(e);
#pragma GCC unroll 4
  for (int g = 0; g < R; ++g) e[g].store_unaligned(s + g * Wd);
  sum += widened_halves_sum<Arch, float>(pairwise_sum<R, Arch>(e));
}

/// Softmax of TI rows of float scores s (stride lds, kv registers each, as log_density_rows
/// leaves them) into out (stride ldo, K entries a row): responsibilities_tile's epilogue for rows
/// too long to stay in registers. The same max and exp; each token's exponentials are added in
/// float in groups of at most 4 registers (pairwise: each lane's group within 2 eps of its exact
/// sum), each group widened, the sum over groups and lanes wide. One pass for the maxima, one
/// for the exponentials and their sum, one for the scaling, where softmax_row made four. The
/// maxima pass does not look for NaN (a compare and an or per register, ~1% of the forward):
/// exp keeps NaN, so a NaN score makes its token's sum NaN, whatever the vector max made of it
/// (with a NaN lane the max may miss the true maximum; the other lanes' exponentials are then
/// meaningless, but lane arithmetic without undefined behaviour, and the row is not written).
/// Returns a bit mask of the tokens whose softmax failed (no finite max, or a NaN score, padding
/// included); their rows of out are not written.
template <int TI, class Arch>
inline unsigned softmax_score_rows(Arch arch, float* s, Index lds, Index kv, Index K, float* out,
                                   Index ldo) {
  using B = xsimd::batch<float, Arch>;
  using BW = xsimd::batch<double, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  constexpr int G = 4;  // registers per group, and in lockstep through the exp
  static_assert(TI <= 32, "the failure mask has 32 bits");
  unsigned failed = 0;
  float shift[TI];
  for (int i = 0; i < TI; ++i) {
    // the vector max in two chains; a max of -inf or NaN fails the row now, a NaN the max missed
    // fails it after the sum
    const float* row = s + i * lds;
    B m0 = B::load_unaligned(row), m1 = m0;
    Index j = 1;
    for (; j + 2 <= kv; j += 2) {
      m0 = xsimd::max(m0, B::load_unaligned(row + j * Wd));
      m1 = xsimd::max(m1, B::load_unaligned(row + (j + 1) * Wd));
    }
    if (j < kv) m0 = xsimd::max(m0, B::load_unaligned(row + j * Wd));
    shift[i] = reduce_max(xsimd::max(m0, m1));
    if (!(shift[i] > -std::numeric_limits<float>::infinity())) failed |= 1u << i;
  }
  // Stage by stage over the tokens (exponentials and sums, then reciprocals, then scalings):
  // token by token, each token's reciprocal and scaling waited on its sum, and the
  // responsibilities took ~5% longer (Zen 3). The exponentials go group by group across the
  // tokens (group j of every token, then group j + 1), so that consecutive groups are
  // independent chains (~1% of the forward, Zen 3). A failed token's row is not exponentiated
  // nor written.
  BW sum[TI];
  for (int i = 0; i < TI; ++i) sum[i] = BW(failed & (1u << i) ? 1.0 : 0.0);
  Index j = 0;
  for (; j + G <= kv; j += G)
    for (int i = 0; i < TI; ++i)
      if (!(failed & (1u << i))) exp_group<G, Arch>(s + i * lds + j * Wd, B(shift[i]), sum[i]);
  const Index rest = kv - j;  // the last group, of fewer than G registers
  for (int i = 0; i < TI; ++i) {
    if (failed & (1u << i)) continue;
    float* row = s + i * lds + j * Wd;
    if (rest == 3)
      exp_group<3, Arch>(row, B(shift[i]), sum[i]);
    else if (rest == 2)
      exp_group<2, Arch>(row, B(shift[i]), sum[i]);
    else if (rest == 1)
      exp_group<1, Arch>(row, B(shift[i]), sum[i]);
  }
  // sum >= 1 (the max contributes exp(0)), or NaN after a NaN score
  float inv[TI];
  for (int i = 0; i < TI; ++i) {
    const double total = xsimd::hadd(sum[i]);
    if (std::isnan(total)) failed |= 1u << i;
    inv[i] = static_cast<float>(1.0 / total);
  }
  for (int i = 0; i < TI; ++i) {  // padding lanes are not written
    if (failed & (1u << i)) continue;
    const float f = inv[i];
    zip_rows(arch, s + i * lds, s + i * lds, out + i * ldo, K,
             [f](auto e, auto) { return e * decltype(e)(f); });
  }
  return failed;
}

/// responsibilities_tile for a row of kv <= TK registers (a run-time count).
template <int TI, int TK, class Arch, class T>
inline unsigned responsibilities_rows(Arch arch, const PackedDensity<T>& p, Index kv, const T* x,
                                      Index ldx, T* out, Index ldo) {
  if constexpr (TK > 1)
    if (kv < TK) return responsibilities_rows<TI, TK - 1>(arch, p, kv, x, ldx, out, ldo);
  return responsibilities_tile<TI, TK>(arch, p, x, ldx, out, ldo);
}

#endif

/// Scalar twin of the kernel (also the fallback without SIMD): one token, all components.
template <class T>
inline void log_density_row_scalar(const PackedDensity<T>& p, const T* x, T* s) {
  const Index kv = p.padded / p.width, Wd = p.width;
  for (Index k = 0; k < p.padded; ++k) {
    const Index v = k / Wd, lane = k % Wd;
    T acc = 0;
    for (Index m = 0; m < p.dim; ++m) {
      const T* slot = p.ab.data() + (m * kv + v) * 2 * Wd;
      const T t = std::fma(x[m], slot[lane], -slot[Wd + lane]);
      acc = std::fma(t, t, acc);
    }
    s[k] = p.offset[k] - acc;
  }
}

/// One row of responsibilities again in a wider type L, for a token so far from every component
/// that all its log-densities overflowed T (|x a| near T's limit). Gamma is the softmax of the
/// log-densities, which needs no density itself, so it stays well defined: in double every
/// float input fits; for double, long double helps where it is wider. Returns false when even
/// L overflows.
template <class T>
inline bool responsibilities_row_wide(const PackedDensity<T>& p, const T* x, T* out) {
  using L = std::conditional_t<std::is_same<T, float>::value, double, long double>;
  const Index kv = p.padded / p.width, Wd = p.width, K = p.components;
  L m = -std::numeric_limits<L>::infinity();
  std::vector<L> s(static_cast<std::size_t>(K));
  for (Index k = 0; k < K; ++k) {
    const Index v = k / Wd, lane = k % Wd;
    L acc = 0;
    for (Index d = 0; d < p.dim; ++d) {
      const T* slot = p.ab.data() + (d * kv + v) * 2 * Wd;
      const L t =
          static_cast<L>(x[d]) * static_cast<L>(slot[lane]) - static_cast<L>(slot[Wd + lane]);
      acc += t * t;
    }
    s[static_cast<std::size_t>(k)] = static_cast<L>(p.offset[k]) - acc;
    m = std::max(m, s[static_cast<std::size_t>(k)]);
  }
  if (!(m > -std::numeric_limits<L>::infinity())) return false;
  L sum = 0;
  for (L& e : s) sum += (e = std::exp(e - m));
  for (Index k = 0; k < K; ++k) out[k] = static_cast<T>(s[static_cast<std::size_t>(k)] / sum);
  return true;
}

/// Register tile (tokens x component vectors) for Arch: TI*TK accumulators + 2*TK a/b registers
/// + a broadcast and a temporary must fit the register file (32: 5 x 4 + 8 + 2; 16: 5 x 2 + 4 +
/// 2, all of them: with 3 x 2, six accumulators for two FMA pipes of latency 4, the kernel ran at
/// three quarters of this rate). The sweeps behind the choice: bench/results/tuning.md,
/// "Log-density register tile" and "Register tiles on 16 registers".
template <class Arch>
struct DensityTile {
  static constexpr int tokens = 5;
  static constexpr int vectors = simd_registers<Arch>() >= 32 ? 4 : 2;
  // A lone token (the tail of a call, every call of a decoding step): half the registers as
  // accumulators, so that its FMA chains (one per component vector, each m after the last) are
  // enough to cover the FMA latency, where `vectors` alone left it latency-bound.
  static constexpr int single_token_vectors = simd_registers<Arch>() / 2;
};

/// gamma (n x K, row-major, stride ldo) of the n rows of x (stride ldx). Rows whose
/// log-densities all overflow T are recomputed in a wider type (responsibilities_row_wide).
/// Returns the first row that overflows even there (its gamma is left NaN), or -1. `reuse`
/// (optional) holds the score rows between calls, so that repeated calls allocate nothing.
template <class Arch, class T>
inline Index responsibilities_into(Arch arch, const PackedDensity<T>& p, const T* x, Index ldx,
                                   Index n, T* out, Index ldo, std::vector<T>* reuse = nullptr) {
  const Index K = p.components, P = p.padded;
  std::vector<T> own;
  std::vector<T>& scratch = reuse != nullptr ? *reuse : own;
  Index failed = -1;
  // A row whose softmax failed (every log-density -inf) or came out NaN (a NaN log-density, e.g.
  // inf - inf from finite inputs far beyond T's range; NaN spreads over the whole row) is redone
  // in the wide type; a row that fails there too is reported.
  const auto settle = [&](bool ok, Index i) {
    if ((ok && !std::isnan(out[i * ldo])) ||
        responsibilities_row_wide(p, x + i * ldx, out + i * ldo))
      return;
    std::fill(out + i * ldo, out + i * ldo + K, std::numeric_limits<T>::quiet_NaN());
    if (failed < 0) failed = i;
  };
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    constexpr int TI = DensityTile<Arch>::tokens, TK = DensityTile<Arch>::vectors;
    const Index kv = P / p.width;
    // the rows of a failure mask (bit t: row i0 + t) again in the wide type
    const auto retry = [&](unsigned bad, Index i0) {
      for (int t = 0; bad != 0; ++t, bad >>= 1)
        if (bad & 1u) settle(false, i0 + t);
    };
    if (kv <= TK) {  // the whole row fits the tile: scores stay in registers
      Index i = 0;
      for (; i + TI <= n; i += TI)
        retry(responsibilities_rows<TI, TK>(arch, p, kv, x + i * ldx, ldx, out + i * ldo, ldo), i);
      for (; i < n; ++i)
        retry(responsibilities_rows<1, TK>(arch, p, kv, x + i * ldx, ldx, out + i * ldo, ldo), i);
      return failed;
    }
    scratch.resize(static_cast<std::size_t>(TI * P));
    // the softmax of `rows` score rows in scratch into rows [i0, i0 + rows) of out
    const auto softmax = [&](auto rows, Index i0) {
      constexpr int R = decltype(rows)::value;
      if constexpr (std::is_same<T, float>::value) {
        retry(softmax_score_rows<R>(arch, scratch.data(), P, kv, K, out + i0 * ldo, ldo), i0);
      } else {
        for (int t = 0; t < R; ++t)
          settle(softmax_row(arch, scratch.data() + t * P, P, K, out + (i0 + t) * ldo), i0 + t);
      }
    };
    Index i = 0;
    for (; i + TI <= n; i += TI) {
      log_density_rows<TI, TK>(arch, p, x + i * ldx, ldx, scratch.data(), P);
      softmax(std::integral_constant<int, TI>{}, i);
    }
    for (; i < n; ++i) {  // token tail (and a decoding step): one row at a time
      log_density_rows<1, DensityTile<Arch>::single_token_vectors>(arch, p, x + i * ldx, ldx,
                                                                   scratch.data(), P);
      softmax(std::integral_constant<int, 1>{}, i);
    }
    return failed;
  }
#endif
  (void)arch;
  scratch.resize(static_cast<std::size_t>(P));
  for (Index i = 0; i < n; ++i) {
    log_density_row_scalar(p, x + i * ldx, scratch.data());
    settle(softmax_row(scalar_arch{}, scratch.data(), K, K, out + i * ldo), i);
  }
  return failed;
}

// ---- backward (SPEC 1.5) ------------------------------------------------------------------------
//
// With t_ikm = x_im a_km - b_km (the forward's own cancellation-free term, a = 1/(sigma sqrt 2),
// b = mu a), the residual is r = x - mu = t / a and P = 1/sigma^2 = 2 a^2, so
//   P r = 2 a t,      1/2 P^2 r^2 - 1/2 P = a^2 (2 t^2 - 1),
// and SPEC 1.5 becomes, for weights w_ik = dS_ik,
//   dx_im     = -2 sum_k a_km (w_ik t_ikm)
//   dmu_km    =  2 a_km  sum_i w_ik t_ikm
//   dvar_km   =  a_km^2 (2 sum_i w_ik t_ikm^2 - sum_i w_ik).
// Nothing is ever subtracted from something much larger: t is O(1) wherever w is not negligible.
// The kernel vectorises over the dimension m (so dx needs no horizontal sum over components):
// a tile holds a, b and the two token sums of TK components for one register of dims, and
// streams the tokens of a panel through it. Per (token, component, dim) that is t (FMS), w t
// (MUL), the dx FMA and the t^2 FMA on the FMA pipes plus one ADD: the same FMA-pipe work as the
// two GEMMs dS [P | P mu] and dS^T [x | x.x] of the expanded form.

/// Same a and b values as pack_density (bit for bit), so the backward sees the forward's t.
template <class Arch, class T, class W>
void pack_density_dims_into(PackedDensityDims<T>& p, const Matrix<T>& mean,
                            const MixtureConstants<W>& c) {
  const Index K = mean.rows(), r = mean.cols();
  const Index width = static_cast<Index>(simd_width<Arch, T>::value);
  p.components = K;
  p.dim = r;
  p.padded_dim = (r + width - 1) / width * width;
  p.a.assign(static_cast<std::size_t>(K * p.padded_dim), T(0));
  p.b.assign(static_cast<std::size_t>(K * p.padded_dim), T(0));
  for (Index k = 0; k < K; ++k)
    for (Index m = 0; m < r; ++m) {
      const std::size_t at = static_cast<std::size_t>(k * p.padded_dim + m);
      density_coefficients(mean, c, k, m, p.a[at], p.b[at]);
    }
}

template <class Arch, class T, class W>
PackedDensityDims<T> pack_density_dims(const Matrix<T>& mean, const MixtureConstants<W>& c) {
  PackedDensityDims<T> p;
  pack_density_dims_into<Arch>(p, mean, c);
  return p;
}

/// Tokens whose terms the backward kernel sums in T before they go into the wide sums: its
/// in-register sums over a panel, then (panels shorter than this) their running sum over panels
/// in T. As long as the 256-row panels of 32-register builds, which fold once a panel.
constexpr Index density_grad_fold_tokens = 256;

#if MIXATTN_HAS_SIMD
/// TK components (from k0) by TM registers of dims (from m0) over n tokens:
/// acc_im += sum_k a_km w_ik t_ikm (into acc, which holds -dx / 2), and the panel's token sums
/// of w t and w t^2 go to `sums`. x and acc: n x padded_dim (strides ldx, ldacc); w: n x K (ldw).
/// First: acc is not read (the first tile of components starts the sum); Last: acc receives the
/// sum times `scale` (the last tile ends it), so that no pass zeroes acc before or scales it
/// after the kernel. With one component (TK = 1) each acc entry takes one FMA per tile, in
/// component order from +0 as in the scalar twin, whose bits it then has; with more, a token's
/// terms go into two partial sums first, which halves their dependent chain.
template <int TK, int TM, bool First, bool Last, class Arch, class T>
inline void density_grad_tile(Arch, const PackedDensityDims<T>& p, Index k0, Index m0, const T* x,
                              Index ldx, const T* w, Index ldw, Index n, T* acc, Index ldacc,
                              DensityGradSums<T>& sums, T scale) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  const Index rp = p.padded_dim;
  B a[TK][TM], b[TK][TM], swt[TK][TM], swtt[TK][TM];
  for (int c = 0; c < TK; ++c)
    for (int j = 0; j < TM; ++j) {
      a[c][j] = B::load_unaligned(p.a.data() + (k0 + c) * rp + m0 + j * Wd);
      b[c][j] = B::load_unaligned(p.b.data() + (k0 + c) * rp + m0 + j * Wd);
      swt[c][j] = B(T(0));
      swtt[c][j] = B(T(0));
    }
  const T* wi = w + k0;
  for (Index i = 0; i < n; ++i, x += ldx, acc += ldacc, wi += ldw) {
    if constexpr (TK == 1) {
      const B wb(wi[0]);  // one broadcast for the TM registers
      for (int j = 0; j < TM; ++j) {
        T* const at = acc + m0 + j * Wd;
        const B t = xsimd::fms(B::load_unaligned(x + m0 + j * Wd), a[0][j], b[0][j]);
        const B wt = t * wb;
        swt[0][j] += wt;
        swtt[0][j] = xsimd::fma(wt, t, swtt[0][j]);
        const B d = xsimd::fma(a[0][j], wt, First ? B(T(0)) : B::load_unaligned(at));
        (Last ? d * B(scale) : d).store_unaligned(at);
      }
    } else {
      for (int j = 0; j < TM; ++j) {
        T* const at = acc + m0 + j * Wd;
        const B xv = B::load_unaligned(x + m0 + j * Wd);
        // two partial dx sums halve the dependent FMA chain over the components
        B d0 = First ? B(T(0)) : B::load_unaligned(at), d1(T(0));
        for (int c = 0; c < TK; ++c) {
          const B t = xsimd::fms(xv, a[c][j], b[c][j]);
          const B wt = t * B(wi[c]);
          if (c % 2 == 0)
            d0 = xsimd::fma(a[c][j], wt, d0);
          else
            d1 = xsimd::fma(a[c][j], wt, d1);
          swt[c][j] += wt;
          swtt[c][j] = xsimd::fma(wt, t, swtt[c][j]);
        }
        if constexpr (Last)
          ((d0 + d1) * B(scale)).store_unaligned(at);
        else
          (d0 + d1).store_unaligned(at);
      }
    }
  }
  // the panel's sums into the running sums in T, a register at a time
  for (int c = 0; c < TK; ++c)
    for (int j = 0; j < TM; ++j) {
      T* const pwt = sums.part_wt.data() + (k0 + c) * rp + m0 + j * Wd;
      T* const pwtt = sums.part_wtt.data() + (k0 + c) * rp + m0 + j * Wd;
      (B::load_unaligned(pwt) + swt[c][j]).store_unaligned(pwt);
      (B::load_unaligned(pwtt) + swtt[c][j]).store_unaligned(pwtt);
    }
}

/// density_grad_tile of `rest` <= TK components (a run-time count), first and/or last.
template <int TK, int TM, class Arch, class T>
inline void density_grad_tiles(Arch arch, Index rest, bool first, bool last,
                               const PackedDensityDims<T>& p, Index k0, Index m0, const T* x,
                               Index ldx, const T* w, Index ldw, Index n, T* acc, Index ldacc,
                               DensityGradSums<T>& sums, T scale) {
  if constexpr (TK > 1)
    if (rest < TK)
      return density_grad_tiles<TK - 1, TM>(arch, rest, first, last, p, k0, m0, x, ldx, w, ldw, n,
                                            acc, ldacc, sums, scale);
  if (first && last)
    density_grad_tile<TK, TM, true, true>(arch, p, k0, m0, x, ldx, w, ldw, n, acc, ldacc, sums,
                                          scale);
  else if (first)
    density_grad_tile<TK, TM, true, false>(arch, p, k0, m0, x, ldx, w, ldw, n, acc, ldacc, sums,
                                           scale);
  else if (last)
    density_grad_tile<TK, TM, false, true>(arch, p, k0, m0, x, ldx, w, ldw, n, acc, ldacc, sums,
                                           scale);
  else
    density_grad_tile<TK, TM, false, false>(arch, p, k0, m0, x, ldx, w, ldw, n, acc, ldacc, sums,
                                            scale);
}

/// Register tile of the backward kernel: components by registers of dims. Each (component,
/// register) holds a, b and two sums, beside x, the dx partials and temporaries. 32 registers:
/// 6 components by one register (4 x 6 + 6 of 32; larger tiles gain nothing:
/// bench/results/tuning.md, "Log-density backward register tile"). 16 registers: one component
/// by two registers (4 x 2 + 6 of 16), so that each weight's broadcast serves two registers
/// (2 components by one register broadcast once a register, and ran ~5% slower on Zen 3).
template <class Arch>
struct DensityGradTile {
  static constexpr int components = simd_registers<Arch>() >= 32 ? 6 : 1;
  static constexpr int dim_registers = simd_registers<Arch>() >= 32 ? 1 : 2;
};
#endif

/// Scalar twin of the backward kernel (also the fallback without SIMD), same arguments.
template <class T>
inline void density_grad_scalar(const PackedDensityDims<T>& p, const T* x, Index ldx, const T* w,
                                Index ldw, Index n, T* acc, Index ldacc, DensityGradSums<T>& sums) {
  using W = wide_t<T>;
  const Index K = p.components, rp = p.padded_dim;
  for (Index k = 0; k < K; ++k)
    for (Index m = 0; m < p.dim; ++m) {
      const T a = p.a[static_cast<std::size_t>(k * rp + m)],
              b = p.b[static_cast<std::size_t>(k * rp + m)];
      T swt = 0, swtt = 0;
      for (Index i = 0; i < n; ++i) {
        const T t = std::fma(x[i * ldx + m], a, -b);
        const T wt = t * w[i * ldw + k];
        acc[i * ldacc + m] = std::fma(a, wt, acc[i * ldacc + m]);
        swt += wt;
        swtt = std::fma(wt, t, swtt);
      }
      sums.wt(k, m) += static_cast<W>(swt);
      sums.wtt(k, m) += static_cast<W>(swtt);
    }
}

/// Backward through the log-density for n tokens (one panel, at most density_grad_fold_tokens
/// rows so that the sums in T stay short): acc_im = scale sum_k a_km w_ik t_ikm over the first
/// `dim` entries of each row (scale = -2 gives dx), and the token sums go to `sums` (sums.w is
/// the caller's: it needs no kernel; the others wait in T until sums.fold(), which this call
/// makes first if the n tokens would take them past density_grad_fold_tokens, and
/// density_grad_finish last). x is n x padded_dim with zeros beyond dim, acc n x padded_dim
/// (strides ldx, ldacc; both n x dim when dim is a whole number of registers); w = dS is n x K.
template <class Arch, class T>
inline void density_grad_into(Arch arch, const PackedDensityDims<T>& p, const T* x, Index ldx,
                              const T* w, Index ldw, Index n, T* acc, Index ldacc,
                              DensityGradSums<T>& sums, T scale) {
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    if (sums.part_tokens + n > density_grad_fold_tokens) sums.fold();
    sums.part_tokens += n;
    constexpr int TK = DensityGradTile<Arch>::components, TM = DensityGradTile<Arch>::dim_registers;
    constexpr Index Wd = static_cast<Index>(simd_width<Arch, T>::value);
    const Index K = p.components;
    for (Index k0 = 0; k0 < K; k0 += TK) {
      const Index rest = std::min<Index>(TK, K - k0);
      const bool first = k0 == 0, last = k0 + TK >= K;
      Index m0 = 0;
      for (; m0 + TM * Wd <= p.padded_dim; m0 += TM * Wd)
        density_grad_tiles<TK, TM>(arch, rest, first, last, p, k0, m0, x, ldx, w, ldw, n, acc,
                                   ldacc, sums, scale);
      if constexpr (TM > 1)
        for (; m0 < p.padded_dim; m0 += Wd)
          density_grad_tiles<TK, 1>(arch, rest, first, last, p, k0, m0, x, ldx, w, ldw, n, acc,
                                    ldacc, sums, scale);
    }
    return;
  }
#endif
  (void)arch;
  for (Index i = 0; i < n; ++i) std::fill(acc + i * ldacc, acc + i * ldacc + p.dim, T(0));
  density_grad_scalar(p, x, ldx, w, ldw, n, acc, ldacc, sums);
  for (Index i = 0; i < n; ++i)
    for (Index m = 0; m < p.dim; ++m) acc[i * ldacc + m] *= scale;
}

/// The mixture's gradients from the token sums (SPEC 1.5, in the t form above): dmu = 2 a wt,
/// and dvar = a^2 (2 wtt - w) with a^2 = 1 / (2 var), in W; dmu, dvar: K x dim. Given var_raw,
/// dvar holds d var_raw = dvar . sigmoid(var_raw) instead, with the factor sigmoid(var_raw) /
/// (2 var) formed first: it is at most 1/2 (sigmoid <= softplus), while a^2 alone overflows W
/// for a variance at a tiny var_floor that a very negative var_raw leaves, where d var_raw is ~0.
template <class W, class T>
void density_grad_finish(const MixtureConstants<W>& c, DensityGradSums<T>& sums, Matrix<W>& dmu,
                         Matrix<W>& dvar, const Matrix<T>* var_raw = nullptr) {
  static_assert(std::is_same<W, wide_t<T>>::value, "the sums are in wide_t<T>");
  sums.fold();
  const Index K = c.var.rows(), r = c.var.cols();
  dmu.resize(K, r);
  dvar.resize(K, r);
  // Whole-matrix array expressions (vectorized in W where Eigen has its packets): a = c.scale.
  dmu.array() = W(2) * c.scale.array() * sums.wt.leftCols(r).array();
  const auto two_wtt_w = (W(2) * sums.wtt.leftCols(r).array()).colwise() - sums.w.array();
  if (var_raw == nullptr) {
    dvar.array() = two_wtt_w / (W(2) * c.var.array());
    return;
  }
  // sigmoid(w) = (w >= 0 ? 1 : e) / (1 + e) with e = exp(-|w|) in (0, 1]: no overflow either side
  const auto w = var_raw->template cast<W>().array();
  dvar.array() = (-w.abs()).exp();
  dvar.array() = (w >= W(0)).select(W(1), dvar.array()) /
                 ((W(1) + dvar.array()) * (W(2) * c.var.array())) * two_wtt_w;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
