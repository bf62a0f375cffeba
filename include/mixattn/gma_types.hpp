// mixattn/gma_types.hpp — Gaussian Mixture Attention's records: the mixture and its gradient,
// the options, the decoding state and its gradient, what forward saves for backward, the
// gradients, and the working memory they keep (the mixture's constants and the kernels' packed
// coefficients among them, data only). The operations on them, and the prepared mixture, are in
// mixattn/gma.hpp.
#pragma once

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Per-call constants of a mixture (SPEC 1.1), computed in the wide type W.
template <class W>
struct MixtureConstants {
  Matrix<W> var;     // K x r, softplus(var_raw) + var_floor
  Vector<W> log_pi;  // K, log_softmax(prior_logit)
  Vector<W> offset;  // K, log pi_k - 1/2 sum_m log var_km
  Matrix<W> scale;   // K x r, 1 / sqrt(2 var): the kernels' a (density_coefficients)
};

/// Mixture constants packed for the kernel of Arch: components padded to a multiple of the
/// register width (padding has a = b = 0 and offset -inf, so it gets zero responsibility).
template <class T>
struct PackedDensity {
  Index components = 0, dim = 0, padded = 0, width = 1;
  std::vector<T> ab;      // [m][kv][a(W) | b(W)]: for a fixed m, all component vectors contiguous
  std::vector<T> offset;  // padded
};

/// a and b laid out for the backward kernel: K x padded_dim each, row-major, zero beyond dim
/// (zero a and b give t = 0, so padded dims contribute nothing).
template <class T>
struct PackedDensityDims {
  Index components = 0, dim = 0, padded_dim = 0;
  std::vector<T> a, b;
};

/// Token sums of the backward (see above), in the wide type W = wide_t<T>: they run over all
/// N + M tokens, and a float running sum of that length drifts by O(N eps) relative. The kernel
/// sums in T over at most density_grad_fold_tokens tokens (part_wt, part_wtt: its panels' sums
/// added in T, a load, an add and a store a register, where widening each 32-row panel's sums
/// took ~10% of the kernel's time on AVX2), then fold() adds them here.
template <class T>
struct DensityGradSums {
  using W = wide_t<T>;
  Matrix<W> wt;                      // K x padded_dim: sum_i w_ik t_ikm
  Matrix<W> wtt;                     // K x padded_dim: sum_i w_ik t_ikm^2
  Vector<W> w;                       // K: sum_i w_ik
  std::vector<T> part_wt, part_wtt;  // K x padded_dim each: the terms not yet in wt and wtt
  Index part_tokens = 0;             // tokens summed into part_wt and part_wtt since the last fold
  void reset(Index K, Index padded_dim) {
    wt.setZero(K, padded_dim);
    wtt.setZero(K, padded_dim);
    w.setZero(K);
    part_wt.assign(static_cast<std::size_t>(K * padded_dim), T(0));
    part_wtt.assign(static_cast<std::size_t>(K * padded_dim), T(0));
    part_tokens = 0;
  }
  /// The T sums into the wide ones, and the T sums cleared.
  void fold() {
    if (part_tokens == 0) return;
    const Index n = wt.size();
    Eigen::Map<Vector<T>> pwt(part_wt.data(), n), pwtt(part_wtt.data(), n);
    Eigen::Map<Vector<W>>(wt.data(), n) += pwt.template cast<W>();
    Eigen::Map<Vector<W>>(wtt.data(), n) += pwtt.template cast<W>();
    pwt.setZero();
    pwtt.setZero();
    part_tokens = 0;
  }
};

/// Scratch of a forward call: the mixture's packed constants, the bidirectional read-out's
/// buffers (when no Saved holds them), the causal scan's state and the GEMM packing buffers.
template <class T>
struct GmaForwardScratch {
  MixtureConstants<wide_t<T>> constants;
  PackedDensity<T> packed;
  std::vector<T> scores;  // the density kernel's rows of scores
  Vector<T> den, z, ones;
  Matrix<T> vt;
  Matrix<T> block_q, block_k;  // Gamma's rows in passing (no record): gma_gamma_block or
                               // gma_causal_block x K
  // A continued forward's start state, kept (without a Saved to hold it) after values large
  // enough to overflow the state, so that an overflow gives the State back untouched.
  Matrix<wide_t<T>> start_S;
  Vector<wide_t<T>> start_z;
  ScanScratch<T> scan;
  GemmSpace<T> gemm;
};

/// A mixture as the decoding forward last received it, and what preparing it gave: the Mixture
/// overloads of the continued forward reuse the preparation while the mixture stays bit for bit
/// the same (one comparison of its parameters per call instead of K r softplus and logs and the
/// packing), so the obvious decoding loop costs about what the Prepared overload costs.
template <class T>
struct GmaPreparedMixture {
  Matrix<T> mean, var_raw;  // K x r, copies of the mixture's
  Vector<T> prior_logit;    // K
  T var_floor = T(0);
  bool valid = false;
  bool checked_finite = false;  // its values were checked finite
  bool fingerprinted = false;   // `fingerprint` is set (computed when a record first needs it)
  std::uint64_t fingerprint = 0;
  MixtureConstants<wide_t<T>> constants;
  PackedDensity<T> packed;
};

/// Scratch of one backward call, reused by every panel and, through Grad, by later calls.
template <class T>
struct GmaBackwardScratch {
  using W = wide_t<T>;
  Matrix<T> gh;             // panel x d_v: g = dO / den (bidirectional)
  Vector<T> z_eps;          // K: z + eps (bidirectional)
  Matrix<T> ds;             // panel x K: dGamma, then dS in place (bidirectional)
  Matrix<T> xpad;           // panel x padded r: x, zero beyond r
  Matrix<T> acc;            // panel x padded r: dx, when r is not a whole number of registers
  Vector<T> panel_w;        // K: one panel's sum of dS
  Vector<T> panel_dz;       // K: one panel's dZ (bidirectional), then the whole dZ
  Matrix<T> upd;            // K x d_v: one panel's dVt
  Matrix<T> dvz;            // K x d_v: the summed dVt (bidirectional)
  Matrix<T> vzt, dvt;       // SIMD builds: d_v x K, Vt and dVt transposed
  Matrix<W> dvz_wide;       // K x d_v
  Vector<W> dz_wide;        // K: the summed dZ
  Matrix<T> g, dgq, dgk;    // causal: N x d_v, N x K, M x K
  Vector<T> h, inv_den;     // causal: N
  Matrix<W> dmu, dvar_raw;  // K x r
  MixtureConstants<W> constants;
  PackedDensityDims<T> packed;
  DensityGradSums<T> sums;
  Matrix<W> G;  // causal: K x d_v, the suffix state dL/dS (when grad.state does not hold it)
  Vector<W> u;  // causal: K, dL/dz
  ScanScratch<T> scan;
  GemmSpace<T> gemm;
};

}  // namespace detail

namespace gma {

/// One head's routing mixture (SPEC 1.1): mean K x r, var_raw K x r, prior_logit K.
/// variance = softplus(var_raw) + var_floor, log pi = log_softmax(prior_logit).
template <class T>
struct Mixture {
  static_assert(detail::refuse_arguments<T>(), "see the message above");
  Matrix<T> mean;         // K x r
  Matrix<T> var_raw;      // K x r
  Vector<T> prior_logit;  // K
  T var_floor = T(1e-4);

  Index components() const { return mean.rows(); }
  Index dim() const { return mean.cols(); }

  /// Default initialisation (SPEC 1.1): mean ~ N(0, 1) * mean_scale, var_raw = 0, prior_logit
  /// = 0. Reproducible for a given seed on every platform (mt19937_64 and Box-Muller, no
  /// implementation-defined distribution).
  static Mixture random(Index components, Index dim, std::uint64_t seed, T mean_scale = T(1));
};

/// Gradients of the mixture's parameters; same shapes as Mixture.
template <class T>
struct MixtureGrad {
  Matrix<T> mean;         // K x r
  Matrix<T> var_raw;      // K x r
  Vector<T> prior_logit;  // K
};

struct Options {
  bool causal = false;  // SPEC 1.4 (requires q.rows() == k.rows())
  double eps = 1e-6;    // read-out denominator floor, > 0
  bool check_finite = true;
  /// Causal chunk length C (SPEC 1.4); 0 picks the measured default (32). Does not change the
  /// result beyond rounding.
  Index chunk = 0;
};

/// One head's causal prefix state (SPEC 1.4): after t tokens, S = sum_{j<t} gamma_k,j v_j^T and
/// z = sum_{j<t} gamma_k,j, kept in the wide type (double for float) like the chunked scan.
/// Constant size whatever the sequence length: O(K d_v), and O(K r) for the prepared mixture.
template <class T>
struct State {
  using Wide = detail::wide_t<T>;
  Matrix<Wide> S;  // K x d_v
  Vector<Wide> z;  // K
  Index tokens_seen = 0;
  /// Not part of the state's value: the mixture the Mixture overloads of forward last continued
  /// it with, prepared (O(K r)), reused while that mixture is unchanged and prepared again when
  /// it changes. Copies carry it along; the Prepared overloads neither read nor write it.
  detail::GmaPreparedMixture<T> prepared_mixture;

  Index components() const { return S.rows(); }
  Index value_dim() const { return S.cols(); }

  /// The state before the first token: zeros, K = components (>= 1), d_v = value_dim (>= 1).
  static State empty(Index components, Index value_dim) {
    detail::require(components >= 1 && value_dim >= 1, "mixattn::gma::State::empty",
                    "components is ", components, " and value_dim is ", value_dim,
                    "; both must be >= 1");
    State st;
    st.S = Matrix<Wide>::Zero(components, value_dim);
    st.z = Vector<Wide>::Zero(components);
    return st;
  }
};

/// Gradient of a scalar loss with respect to a State's S (K x d_v) and z (K), in the wide type.
/// backward of a continued forward returns it for the start state (Grad::state) and takes it
/// for the end state (the loss's dependence on what later pieces read from it).
template <class T>
struct StateGrad {
  Matrix<detail::wide_t<T>> S;  // K x d_v
  Vector<detail::wide_t<T>> z;  // K
  /// Fingerprint of the state this is the gradient of, set by backward (Grad::state) and checked
  /// by the previous piece's backward against the state its forward ended with; 0: not checked.
  std::uint64_t state_fingerprint = 0;
};

/// What forward keeps for backward: O((N + M) K + N d_v), never O(N M).
/// Reusable: forward_into overwrites it and keeps its capacity when shapes repeat.
template <class T>
struct Saved {
  Matrix<T> gamma_q;  // N x K
  Matrix<T> gamma_k;  // M x K
  Vector<T> den;      // N, gamma_q,i . z_i + eps
  Matrix<T> out;      // N x d_v, the forward output: causal only (h_i = -(dO_i . O_i) / den_i
                      // needs it; the bidirectional backward forms dO_i . O_i from vt), else empty
  Matrix<T> vt;       // K x d_v, Gamma_K^T V (bidirectional only)
  Vector<T> z;        // K, Gamma_K^T 1 (bidirectional only)
  bool causal = false;
  double eps = 0;
  Index chunk = 0;
  /// Of q, k, v, the mixture and the start state below (detail::Fingerprint), checked by backward.
  struct Fingerprints {
    std::uint64_t q = 0, k = 0, v = 0, mixture = 0, start_state = 0;
  };
  Fingerprints fingerprint;
  bool valid = false;
  // Set by the State overload of forward: the state the call continued (a copy, O(K d_v)).
  bool continued = false;
  Matrix<detail::wide_t<T>> start_S;     // K x d_v
  Vector<detail::wide_t<T>> start_z;     // K
  std::uint64_t end_fingerprint = 0;     // of the state the call ended with (continued only)
  detail::GmaForwardScratch<T> scratch;  // the forward's working memory, kept for reuse
};

/// Gradients (N x r, M x r, M x d_v and the mixture's); backward_into overwrites them and
/// keeps `scratch` (the backward's working memory) for the next call.
template <class T>
struct Grad {
  Matrix<T> q, k, v;  // N x r, M x r, M x d_v
  MixtureGrad<T> mixture;
  StateGrad<T> state;  // dS0, dz0 of the start state (continued forward only; else empty)
  detail::GmaBackwardScratch<T> scratch;
};

template <class T>
Mixture<T> Mixture<T>::random(Index components, Index dim, std::uint64_t seed, T mean_scale) {
  detail::require(components > 0 && dim > 0, "mixattn::gma::Mixture::random", "components is ",
                  components, " and dim is ", dim, "; both must be positive");
  std::mt19937_64 rng(seed);
  const double two_pi = 6.283185307179586476925286766559;
  auto uniform = [&rng] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  Mixture m;
  m.mean.resize(components, dim);
  for (Index i = 0; i < m.mean.size(); i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(uniform())), angle = two_pi * uniform();
    m.mean.data()[i] = static_cast<T>(radius * std::cos(angle) * static_cast<double>(mean_scale));
    if (i + 1 < m.mean.size())
      m.mean.data()[i + 1] =
          static_cast<T>(radius * std::sin(angle) * static_cast<double>(mean_scale));
  }
  m.var_raw = Matrix<T>::Zero(components, dim);
  m.prior_logit = Vector<T>::Zero(components);
  return m;
}

}  // namespace gma
MIXATTN_END_NAMESPACE
