// mixattn/detail/log_density.hpp — Gaussian log-densities and responsibilities (SPEC 1.2).
//
//   s_k(x) = log pi_k - 1/2 sum_m log var_km - 1/2 sum_m (x_m - mu_km)^2 / var_km,  gamma = softmax s
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

#include "mixattn/core.hpp"
#include "mixattn/detail/simd.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace mixattn::detail {

/// softplus(w) = log(1 + e^w), stable everywhere: w for large w, e^w for very negative w.
template <class W>
inline W softplus(W w) {
  using std::abs, std::exp, std::log1p;
  return std::max(w, W(0)) + log1p(exp(-abs(w)));
}

/// sigmoid(w) = d softplus / dw, without overflow on either side.
template <class W>
inline W sigmoid(W w) {
  using std::exp;
  if (w >= 0) return W(1) / (W(1) + exp(-w));
  const W e = exp(w);
  return e / (W(1) + e);
}

/// Per-call constants of a mixture (SPEC 1.1), computed in the wide type W.
template <class W>
struct MixtureConstants {
  Matrix<W> var;      // K x r, softplus(var_raw) + var_floor
  Vector<W> log_pi;   // K, log_softmax(prior_logit)
  Vector<W> offset;   // K, log pi_k - 1/2 sum_m log var_km
};

template <class W, class T>
MixtureConstants<W> mixture_constants(const Matrix<T>& mean, const Matrix<T>& var_raw,
                                      const Vector<T>& prior_logit, T var_floor) {
  (void)mean;
  MixtureConstants<W> c;
  const Index K = var_raw.rows(), r = var_raw.cols();
  c.var.resize(K, r);
  for (Index k = 0; k < K; ++k)
    for (Index m = 0; m < r; ++m)
      c.var(k, m) = softplus(static_cast<W>(var_raw(k, m))) + static_cast<W>(var_floor);
  const Vector<W> alpha = prior_logit.template cast<W>();
  const W amax = alpha.maxCoeff();
  const W lse = amax + std::log((alpha.array() - amax).exp().sum());
  c.log_pi = alpha.array() - lse;
  c.offset.resize(K);
  for (Index k = 0; k < K; ++k) c.offset(k) = c.log_pi(k) - W(0.5) * c.var.row(k).array().log().sum();
  return c;
}

/// Mixture constants packed for the kernel of Arch: components padded to a multiple of the
/// register width (padding has a = b = 0 and offset -inf, so it gets zero responsibility).
template <class T>
struct PackedDensity {
  Index components = 0, dim = 0, padded = 0, width = 1;
  std::vector<T> ab;      // [m][kv][a(W) | b(W)]: for a fixed m, all component vectors contiguous
  std::vector<T> offset;  // padded
};

template <class Arch, class T, class W>
PackedDensity<T> pack_density(const Matrix<T>& mean, const MixtureConstants<W>& c) {
  PackedDensity<T> p;
  const Index K = mean.rows(), r = mean.cols();
  const Index width = static_cast<Index>(simd_width<Arch, T>::value);
  p.components = K;
  p.dim = r;
  p.width = width;
  p.padded = (K + width - 1) / width * width;
  const Index kv = p.padded / width;
  p.ab.assign(static_cast<std::size_t>(r * kv * 2 * width), T(0));
  p.offset.assign(static_cast<std::size_t>(p.padded), -std::numeric_limits<T>::infinity());
  const W inv_sqrt2 = W(1) / std::sqrt(W(2));
  for (Index k = 0; k < K; ++k) {
    p.offset[k] = static_cast<T>(c.offset(k));
    const Index v = k / width, lane = k % width;
    for (Index m = 0; m < r; ++m) {
      const W a = inv_sqrt2 / std::sqrt(c.var(k, m));
      const W b = static_cast<W>(mean(k, m)) * a;
      T* slot = p.ab.data() + (m * kv + v) * 2 * width;
      slot[lane] = static_cast<T>(a);
      slot[width + lane] = static_cast<T>(b);
    }
  }
  return p;
}

#if MIXATTN_HAS_SIMD
/// s = offset - sum_m (x_m a - b)^2 for TI tokens (rows of x, stride ldx) and TK component
/// vectors starting at vector kv0; writes rows of `s` (stride lds, padded component index).
template <int TI, int TK, class Arch, class T>
inline void log_density_tile(Arch, const PackedDensity<T>& p, const T* x, Index ldx, Index kv0,
                             T* s, Index lds) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  const Index r = p.dim, kv = p.padded / Wd;
  B acc[TI][TK];
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
  for (int j = 0; j < TK; ++j) {
    const B off = B::load_unaligned(p.offset.data() + (kv0 + j) * Wd);
    for (int i = 0; i < TI; ++i) (off - acc[i][j]).store_unaligned(s + i * lds + (kv0 + j) * Wd);
  }
}

/// All component vectors for TI tokens: full TK groups, then the remainder group.
template <int TI, int TK, class Arch, class T>
inline void log_density_rows(Arch arch, const PackedDensity<T>& p, const T* x, Index ldx, T* s,
                             Index lds) {
  const Index kv = p.padded / p.width;
  Index v = 0;
  for (; v + TK <= kv; v += TK) log_density_tile<TI, TK>(arch, p, x, ldx, v, s, lds);
  if constexpr (TK > 2)
    for (; v + 2 <= kv; v += 2) log_density_tile<TI, 2>(arch, p, x, ldx, v, s, lds);
  if constexpr (TK > 1)
    for (; v < kv; ++v) log_density_tile<TI, 1>(arch, p, x, ldx, v, s, lds);
}

/// In-place softmax of one padded row s (padded lanes hold -inf); first K entries go to out.
template <class Arch, class T>
inline void softmax_row(Arch, T* s, Index padded, Index K, T* out) {
  using B = xsimd::batch<T, Arch>;
  constexpr Index Wd = static_cast<Index>(B::size);
  B mx = B::load_unaligned(s);
  for (Index k = Wd; k < padded; k += Wd) mx = xsimd::max(mx, B::load_unaligned(s + k));
  alignas(64) T lanes[Wd];
  mx.store_aligned(lanes);
  T m = lanes[0];
  for (Index l = 1; l < Wd; ++l) m = std::max(m, lanes[l]);
  const B mb(m);
  B sum(T(0));
  for (Index k = 0; k < padded; k += Wd) {
    const B e = xsimd::exp(B::load_unaligned(s + k) - mb);
    e.store_unaligned(s + k);
    sum += e;
  }
  const T invs = T(1) / xsimd::hadd(sum);
  const B inv(invs);
  Index k = 0;
  for (; k + Wd <= K; k += Wd) (B::load_unaligned(s + k) * inv).store_unaligned(out + k);
  for (; k < K; ++k) out[k] = s[k] * invs;  // scalar tail: the output row is not padded
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

template <class T>
inline void softmax_row_scalar(T* s, Index K, T* out) {
  T m = s[0];
  for (Index k = 1; k < K; ++k) m = std::max(m, s[k]);
  T sum = 0;
  for (Index k = 0; k < K; ++k) sum += (s[k] = std::exp(s[k] - m));
  const T inv = T(1) / sum;
  for (Index k = 0; k < K; ++k) out[k] = s[k] * inv;
}

/// Register tile (tokens x component vectors) for Arch: TI*TK accumulators + 2*TK a/b registers
/// + a broadcast and a temporary must fit the register file. Measured on Zen 4 (float, r = K =
/// 64, N = 4096): 5 x 4 runs at 1.05x an Eigen GEMM of the same FLOPs, 6 x 2 and 8 x 2 at
/// 1.07x, 4 x 4 at 1.66x (sic), 3 x 4 and 2 x 4 at 1.4-1.5x.
template <class Arch>
struct DensityTile {
  static constexpr int tokens = simd_registers<Arch>() >= 32 ? 5 : 3;
  static constexpr int vectors = simd_registers<Arch>() >= 32 ? 4 : 2;
};

/// gamma (n x K, row-major, stride ldo) of the n rows of x (stride ldx).
template <class Arch, class T>
inline void responsibilities_into(Arch arch, const PackedDensity<T>& p, const T* x, Index ldx,
                                  Index n, T* out, Index ldo) {
  const Index K = p.components, P = p.padded;
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value) {
    constexpr int TI = DensityTile<Arch>::tokens, TK = DensityTile<Arch>::vectors;
    std::vector<T> scratch(static_cast<std::size_t>(TI * P));
    Index i = 0;
    for (; i + TI <= n; i += TI) {
      log_density_rows<TI, TK>(arch, p, x + i * ldx, ldx, scratch.data(), P);
      for (int t = 0; t < TI; ++t) softmax_row(arch, scratch.data() + t * P, P, K, out + (i + t) * ldo);
    }
    for (; i < n; ++i) {  // token tail: one row at a time
      log_density_rows<1, TK>(arch, p, x + i * ldx, ldx, scratch.data(), P);
      softmax_row(arch, scratch.data(), P, K, out + i * ldo);
    }
    return;
  }
#endif
  (void)arch;
  std::vector<T> scratch(static_cast<std::size_t>(P));
  for (Index i = 0; i < n; ++i) {
    log_density_row_scalar(p, x + i * ldx, scratch.data());
    softmax_row_scalar(scratch.data(), K, out + i * ldo);
  }
}

}  // namespace mixattn::detail
