// mixattn/gma_types.hpp — Gaussian Mixture Attention's records: the mixture and its gradient,
// the options, the decoding state and its gradient, what forward saves for backward, the
// gradients, and the prepared mixture. The operations on them are in mixattn/gma.hpp.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/detail/gma_scratch.hpp"
#include "mixattn/detail/log_density.hpp"

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <random>

MIXATTN_BEGIN_NAMESPACE
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

/// A mixture reduced once to what every evaluation of its responsibilities needs: variances,
/// log-priors and offsets (in the wide type) and the SIMD kernel's packed coefficients for Arch.
/// Build it once and call responsibilities(prepared, x) or the decoding forward(prepared, ...,
/// state) many times, e.g. one token at a time: each call then costs O(K r) per row instead of
/// also rebuilding the O(K r) constants (K r softplus and logs, more than the token itself).
/// It is a snapshot: after changing the mixture, prepare it again (backward compares the mixture
/// it is given against mixture_fingerprint()). Immutable, so one Prepared may serve concurrent
/// calls. Arch is the SIMD instruction set (never written by callers), so a prepared mixture
/// cannot meet another instruction set's kernel.
template <class T, class Arch = detail::simd_arch>
class Prepared {
  static_assert(detail::refuse_arguments<T>(), "see the message above");

 public:
  using W = detail::wide_t<T>;
  /// Validates the mixture (shapes; finite values unless check_finite is false) and reduces it.
  explicit Prepared(const Mixture<T>& mix, bool check_finite = true);
  Index components() const { return packed_.components; }  // K
  Index dim() const { return packed_.dim; }                // r
  const detail::MixtureConstants<W>& constants() const { return constants_; }
  const detail::PackedDensity<T>& packed() const { return packed_; }
  /// Position-sensitive fingerprint of the mixture it was prepared from (detail::Fingerprint).
  std::uint64_t mixture_fingerprint() const { return mixture_fingerprint_; }

 private:
  detail::MixtureConstants<W> constants_;
  detail::PackedDensity<T> packed_;
  std::uint64_t mixture_fingerprint_ = 0;
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
