// mixattn/gma.hpp — Gaussian Mixture Attention (SPEC.md section 1), forward and backward.
//
// Queries and keys are routed through one shared diagonal Gaussian mixture of K components;
// the attention is Gamma_Q Gamma_K^T, a rank-K factorisation that is never formed:
//   bidirectional  O = (Gamma_Q (Gamma_K^T V)) / (Gamma_Q (Gamma_K^T 1) + eps)     O((N+M) K)
//   causal         the same with prefix sums, chunk-wise (SPEC 1.4)
// Thread safety: every function is reentrant and may run concurrently on different threads
// (each with its own Saved and Grad). forward without `saved` reuses per-thread (thread_local)
// scratch, which stays allocated for the thread's lifetime. The State overloads of forward
// (decoding) also keep one small per-thread wide scratch (d_v + 2K) and write only the State
// they are given: distinct States may be continued concurrently. GEMMs use the threads Eigen
// is configured with.
//
// Training loops: forward_into / backward_into write into caller-owned outputs and keep their
// working memory in Saved and Grad (GEMM packing buffers included), so a step whose shapes
// repeat performs no heap allocation, the State overloads (continued causal pieces, grad_state_out)
// included; forward / backward return fresh objects and call them.
//
// Every entry point has a defaulted template parameter Arch (the SIMD instruction set the
// translation unit is compiled for, detail/simd.hpp); callers never write it.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/gemm.hpp"
#include "mixattn/detail/gma_scan.hpp"
#include "mixattn/detail/log_density.hpp"
#include "mixattn/detail/simd.hpp"
#include "mixattn/detail/softmax.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
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
/// Constant size whatever the sequence length: O(K d_v).
template <class T>
struct State {
  using Wide = detail::wide_t<T>;
  Matrix<Wide> S;  // K x d_v
  Vector<Wide> z;  // K
  Index tokens_seen = 0;

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

}  // namespace gma
MIXATTN_END_NAMESPACE

#include "mixattn/detail/gma_scratch.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace gma {

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
  // of q, k, v, the mixture and the start state below (detail::Fingerprint)
  std::uint64_t fingerprint[5] = {0, 0, 0, 0, 0};
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

}  // namespace gma
MIXATTN_END_NAMESPACE

#include "mixattn/detail/gma_common.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace gma {

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

/// Responsibilities Gamma (SPEC 1.2) of the rows of x under a prepared mixture: N x K, every
/// row on the simplex. x: N x r, row-major (r = prepared.dim()). Rows far from every component
/// (log-densities beyond T's range) are computed in a wider type; with check_finite, a row that
/// overflows even there throws std::domain_error naming x.
template <class T, class Arch>
Matrix<T> responsibilities(const Prepared<T, Arch>& prepared, const ConstMatrixRef<T>& x,
                           bool check_finite = true) {
  static constexpr const char* fn = "mixattn::gma::responsibilities";
  detail::require(x.cols() == prepared.dim(), fn, "x is ", detail::shape_str(x),
                  " but the mixture has dimension ", prepared.dim(), " (its r: x must have ",
                  prepared.dim(), " columns)");
  if (check_finite) detail::require_finite(x, fn, "x");
  Matrix<T> out(x.rows(), prepared.components());
  detail::gma_gamma_into<Arch, T>(prepared.packed(), x, out.data(), check_finite, fn, "x");
  return out;
}

/// Responsibilities Gamma (SPEC 1.2) of the rows of x: N x K, every row on the simplex.
/// mix: K components of dimension r; x: N x r, row-major. Prepares the mixture on every call:
/// for many small calls, prepare it once (Prepared) and use the overload above.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> responsibilities(const Mixture<T>& mix, const ConstMatrixRef<T>& x,
                           bool check_finite = true) {
  static constexpr const char* fn = "mixattn::gma::responsibilities";
  detail::gma_check_mixture(mix, fn, check_finite);
  detail::require(x.cols() == mix.dim(), fn, "x is ", detail::shape_str(x),
                  " but the mixture has dimension ", mix.dim(), " (its r: x must have ", mix.dim(),
                  " columns)");
  return responsibilities<T, Arch>(Prepared<T, Arch>(mix, false), x, check_finite);
}

}  // namespace gma
MIXATTN_END_NAMESPACE

#include "mixattn/detail/gma_backward.hpp"
#include "mixattn/detail/gma_forward.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace gma {

/// GMA forward (SPEC 1.3 bidirectional, 1.4 causal) into caller-owned memory.
/// q: N x r, k: M x r, v: M x d_v (M == N when causal); out is resized to N x d_v.
/// If `saved` is given it receives what backward needs (O((N + M) K + N d_v)) and keeps the
/// call's working memory: with a reused `out` and `saved`, a call whose shapes repeat performs
/// no heap allocation. Without `saved`, this thread's scratch (kept for the thread's lifetime)
/// is used instead.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const Mixture<T>& mix, const ConstMatrixRef<T>& q,
                  const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, const Options& opt,
                  Saved<typename detail::identity<T>::type>* saved) {
  detail::gma_forward<Arch, T>("mixattn::gma::forward_into", out, mix, q, k, v, opt, saved);
}

/// GMA forward (SPEC 1.3 bidirectional, 1.4 causal).
/// q: N x r, k: M x r, v: M x d_v (M == N when causal). Returns N x d_v.
/// If `saved` is given it receives what backward needs (O((N + M) K + N d_v)).
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const Mixture<T>& mix, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, const Options& opt = {}, Saved<T>* saved = nullptr) {
  Matrix<T> out;
  const detail::LentScratch<detail::GmaForwardScratch<T>> lent(saved ? &saved->scratch : nullptr);
  detail::gma_forward<Arch, T>("mixattn::gma::forward", out, mix, q, k, v, opt, saved);
  return out;
}

template <class T, class Arch>
Prepared<T, Arch>::Prepared(const Mixture<T>& mix, bool check_finite) {
  detail::gma_check_mixture(mix, "mixattn::gma::Prepared", check_finite);
  constants_ = detail::mixture_constants<W>(mix.mean, mix.var_raw, mix.prior_logit, mix.var_floor);
  packed_ = detail::pack_density<Arch, T>(mix.mean, constants_);
  mixture_fingerprint_ = detail::mixture_fingerprint(mix);
}

/// Causal GMA forward continuing `state` (SPEC 1.4) into caller-owned memory: q, k (n x r) and
/// v (n x d_v) are the next n tokens after state.tokens_seen; out is resized to n x d_v and
/// `state` advances past them. Feeding a sequence in any pieces (down to one token) gives the
/// one-call outputs up to rounding. opt.causal must be true; state must be K x d_v
/// (State<T>::empty(K, d_v)). `saved` receives what backward needs, the start state included
/// (O(n K + n d_v + K d_v)), and keeps the working memory: with a reused `out` and `saved`, a
/// call whose shapes repeat performs no heap allocation (it packs the mixture each call; the
/// Prepared overload does not). On a throw (bad shapes or options: invalid_argument; non-finite
/// q, k, v or state: domain_error) `state` is untouched.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const Mixture<T>& mix, const ConstMatrixRef<T>& q,
                  const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, const Options& opt,
                  State<T>& state, Saved<typename detail::identity<T>::type>* saved) {
  static constexpr const char* fn = "mixattn::gma::forward_into";
  detail::gma_check_inputs(fn, mix, q, k, v, opt);
  detail::gma_check_state(fn, state, mix.components(), v.cols(), q.rows(), opt);
  using W = detail::wide_t<T>;
  detail::GmaForwardScratch<T>& s = saved ? saved->scratch : detail::gma_thread_scratch<T>();
  detail::mixture_constants_into<W>(s.constants, mix.var_raw, mix.prior_logit, mix.var_floor);
  detail::pack_density_into<Arch>(s.packed, mix.mean, s.constants);
  detail::gma_forward_continued<Arch, T>(fn, out, s.packed, q, k, v, opt, state, saved,
                                         detail::mixture_fingerprint(mix));
}

/// The value-returning form of the above. Returns n x d_v.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const Mixture<T>& mix, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, const Options& opt, State<T>& state,
                  Saved<T>* saved = nullptr) {
  static constexpr const char* fn = "mixattn::gma::forward";
  detail::gma_check_inputs(fn, mix, q, k, v, opt);
  detail::gma_check_state(fn, state, mix.components(), v.cols(), q.rows(), opt);
  using W = detail::wide_t<T>;
  const detail::MixtureConstants<W> c =
      detail::mixture_constants<W>(mix.mean, mix.var_raw, mix.prior_logit, mix.var_floor);
  const detail::PackedDensity<T> p = detail::pack_density<Arch, T>(mix.mean, c);
  Matrix<T> out;
  const detail::LentScratch<detail::GmaForwardScratch<T>> lent(saved ? &saved->scratch : nullptr);
  detail::gma_forward_continued<Arch, T>(fn, out, p, q, k, v, opt, state, saved,
                                         detail::mixture_fingerprint(mix));
  return out;
}

/// The same with the mixture prepared once (Prepared): the decode path, which spends per token
/// only the responsibilities of q and k and one pass over the state (O(K (r + d_v))).
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const Prepared<T, Arch>& prep, const ConstMatrixRef<T>& q,
                  const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, const Options& opt,
                  State<T>& state, Saved<typename detail::identity<T>::type>* saved) {
  static constexpr const char* fn = "mixattn::gma::forward_into";
  detail::gma_check_qkv<T>(fn, prep.dim(), q, k, v, opt);
  detail::gma_check_state(fn, state, prep.components(), v.cols(), q.rows(), opt);
  detail::gma_forward_continued<Arch, T>(fn, out, prep.packed(), q, k, v, opt, state, saved,
                                         prep.mixture_fingerprint());
}

/// The value-returning form of the above. Returns n x d_v.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const Prepared<T, Arch>& prep, const ConstMatrixRef<T>& q,
                  const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, const Options& opt,
                  State<T>& state, Saved<T>* saved = nullptr) {
  static constexpr const char* fn = "mixattn::gma::forward";
  detail::gma_check_qkv<T>(fn, prep.dim(), q, k, v, opt);
  detail::gma_check_state(fn, state, prep.components(), v.cols(), q.rows(), opt);
  Matrix<T> out;
  const detail::LentScratch<detail::GmaForwardScratch<T>> lent(saved ? &saved->scratch : nullptr);
  detail::gma_forward_continued<Arch, T>(fn, out, prep.packed(), q, k, v, opt, state, saved,
                                         prep.mixture_fingerprint());
  return out;
}

/// GMA backward (SPEC 1.5) into caller-owned gradients: the same as backward, with grad's
/// matrices resized (no-op when shapes repeat) and its scratch reused, so a call whose shapes
/// repeat performs no heap allocation.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const Mixture<T>& mix, const ConstMatrixRef<T>& q,
                   const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                   const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::gma_backward<Arch, T>("mixattn::gma::backward_into", grad, mix, q, k, v, grad_out, saved,
                                opt, static_cast<const StateGrad<T>*>(nullptr));
}

/// Backward of a piece of a longer sequence into caller-owned gradients (see the backward
/// overload with grad_state_out); grad_state_out may be grad.state itself, so one Grad can run
/// the pieces' backwards in reverse, each fed the grad.state its successor left.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const Mixture<T>& mix, const ConstMatrixRef<T>& q,
                   const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                   const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt,
                   const StateGrad<typename detail::identity<T>::type>* grad_state_out) {
  detail::gma_backward<Arch, T>("mixattn::gma::backward_into", grad, mix, q, k, v, grad_out, saved,
                                opt, grad_state_out);
}

/// Backward of a piece of a longer sequence (SPEC 1.5, pieces): saved comes from the State
/// overload of forward; grad_state_out (optional, K x d_v and K) is dL/d(end state), which the
/// next piece's backward returned as its grad.state. Adds the end state's use to the keys and
/// values of this piece and writes grad.state = dL/d(start state). Running the pieces' backwards
/// in reverse, each fed its successor's grad.state, gives the gradients of one call over the
/// whole sequence.
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Grad<T> backward(const Mixture<T>& mix, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                 const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                 const Saved<T>& saved, const Options& opt, const StateGrad<T>* grad_state_out) {
  Grad<T> grad;
  {  // the working memory is this thread's: the returned gradient carries none
    const detail::LentScratch<detail::GmaBackwardScratch<T>> lent(&grad.scratch);
    detail::gma_backward<Arch, T>("mixattn::gma::backward", grad, mix, q, k, v, grad_out, saved,
                                  opt, grad_state_out);
  }
  return grad;
}

/// GMA backward (SPEC 1.5): gradients of sum(grad_out . forward(mix, q, k, v)) with respect to
/// q (N x r), k (M x r), v (M x d_v) and the mixture's mean, var_raw, prior_logit.
/// grad_out: N x d_v; saved: filled by forward with the same inputs and options.
/// When saved comes from the State overload of forward, grad.state also receives the gradient
/// with respect to the state that call continued (dS0, dz0); the end state is taken to have
/// no further use (see the overload with grad_state_out for pieces of a longer sequence).
template <class T, class Arch = detail::simd_arch, detail::enable_if_supported<T> = 0>
Grad<T> backward(const Mixture<T>& mix, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                 const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                 const Saved<T>& saved, const Options& opt = {}) {
  return backward<T, Arch>(mix, q, k, v, grad_out, saved, opt,
                           static_cast<const StateGrad<T>*>(nullptr));
}

// Compile-time refusals (core.hpp, refuse_arguments): an unsupported scalar type, or a
// column-major or strided argument that would be copied on every call, selects one of these
// overloads instead of the ones above; the static_assert's message is their only effect.
template <class T, class X, detail::enable_if_refused<T, X> = 0>
Matrix<T> responsibilities(const Mixture<T>&, const X&, bool = true) {
  detail::refuse_arguments<T, X>();
  return {};
}
template <class T, class Arch, class X, detail::enable_if_refused<T, X> = 0>
Matrix<T> responsibilities(const Prepared<T, Arch>&, const X&, bool = true) {
  detail::refuse_arguments<T, X>();
  return {};
}
template <class T, class Q, class K, class V, detail::enable_if_refused<T, Q, K, V> = 0>
Matrix<T> forward(const Mixture<T>&, const Q&, const K&, const V&, const Options& = {},
                  Saved<T>* = nullptr) {
  detail::refuse_arguments<T, Q, K, V>();
  return {};
}
template <class T, class Q, class K, class V, detail::enable_if_refused<T, Q, K, V> = 0>
Matrix<T> forward(const Mixture<T>&, const Q&, const K&, const V&, const Options&, State<T>&,
                  Saved<T>* = nullptr) {
  detail::refuse_arguments<T, Q, K, V>();
  return {};
}
template <class T, class Arch, class Q, class K, class V, detail::enable_if_refused<T, Q, K, V> = 0>
Matrix<T> forward(const Prepared<T, Arch>&, const Q&, const K&, const V&, const Options&, State<T>&,
                  Saved<T>* = nullptr) {
  detail::refuse_arguments<T, Q, K, V>();
  return {};
}
template <class T, class Q, class K, class V, class G, detail::enable_if_refused<T, Q, K, V, G> = 0>
Grad<T> backward(const Mixture<T>&, const Q&, const K&, const V&, const G&, const Saved<T>&,
                 const Options& = {}) {
  detail::refuse_arguments<T, Q, K, V, G>();
  return {};
}
template <class T, class Q, class K, class V, class G, detail::enable_if_refused<T, Q, K, V, G> = 0>
Grad<T> backward(const Mixture<T>&, const Q&, const K&, const V&, const G&, const Saved<T>&,
                 const Options&, const StateGrad<T>*) {
  detail::refuse_arguments<T, Q, K, V, G>();
  return {};
}
template <class T, class Q, class K, class V, detail::enable_if_refused<T, Q, K, V> = 0>
void forward_into(Matrix<T>&, const Mixture<T>&, const Q&, const K&, const V&, const Options&,
                  Saved<typename detail::identity<T>::type>*) {
  detail::refuse_arguments<T, Q, K, V>();
}
template <class T, class Q, class K, class V, detail::enable_if_refused<T, Q, K, V> = 0>
void forward_into(Matrix<T>&, const Mixture<T>&, const Q&, const K&, const V&, const Options&,
                  State<T>&, Saved<typename detail::identity<T>::type>*) {
  detail::refuse_arguments<T, Q, K, V>();
}
template <class T, class Arch, class Q, class K, class V, detail::enable_if_refused<T, Q, K, V> = 0>
void forward_into(Matrix<T>&, const Prepared<T, Arch>&, const Q&, const K&, const V&,
                  const Options&, State<T>&, Saved<typename detail::identity<T>::type>*) {
  detail::refuse_arguments<T, Q, K, V>();
}
template <class T, class Q, class K, class V, class G, detail::enable_if_refused<T, Q, K, V, G> = 0>
void backward_into(Grad<T>&, const Mixture<T>&, const Q&, const K&, const V&, const G&,
                   const Saved<T>&, const Options&) {
  detail::refuse_arguments<T, Q, K, V, G>();
}
template <class T, class Q, class K, class V, class G, detail::enable_if_refused<T, Q, K, V, G> = 0>
void backward_into(Grad<T>&, const Mixture<T>&, const Q&, const K&, const V&, const G&,
                   const Saved<T>&, const Options&,
                   const StateGrad<typename detail::identity<T>::type>*) {
  detail::refuse_arguments<T, Q, K, V, G>();
}

}  // namespace gma

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every forward and backward form, at the default instruction set (core.hpp:
// compiling the operators once).
namespace detail {
#define MIXATTN_GMA_INSTANCES(T)                                                                \
  MIXATTN_TEMPLATE_INSTANCE void gma_forward<simd_arch, T>(                                     \
      const char*, Matrix<T>&, const gma::Mixture<T>&, const ConstMatrixRef<T>&,                \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const gma::Options&, gma::Saved<T>*); \
  MIXATTN_TEMPLATE_INSTANCE void gma_forward_continued<simd_arch, T>(                           \
      const char*, Matrix<T>&, const PackedDensity<T>&, const ConstMatrixRef<T>&,               \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const gma::Options&, gma::State<T>&,  \
      gma::Saved<T>*, std::uint64_t);                                                           \
  MIXATTN_TEMPLATE_INSTANCE void gma_backward<simd_arch, T>(                                    \
      const char*, gma::Grad<T>&, const gma::Mixture<T>&, const ConstMatrixRef<T>&,             \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,             \
      const gma::Saved<T>&, const gma::Options&, const gma::StateGrad<T>*);
MIXATTN_GMA_INSTANCES(float)
MIXATTN_GMA_INSTANCES(double)
#undef MIXATTN_GMA_INSTANCES
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
