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

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Scratch of a forward call: the mixture's packed constants, the bidirectional read-out's
/// buffers (when no Saved holds them), the causal scan's state and the GEMM packing buffers.
template <class T>
struct GmaForwardScratch {
  MixtureConstants<wide_t<T>> constants;
  PackedDensity<T> packed;
  std::vector<T> scores;  // the density kernel's rows of scores
  Vector<T> den, z, ones;
  Matrix<T> vt;
  // A continued forward's start state, kept (without a Saved to hold it) after values large
  // enough to overflow the state, so that an overflow gives the State back untouched.
  Matrix<wide_t<T>> start_S;
  Vector<wide_t<T>> start_z;
  GmaScanScratch<T> scan;
  GemmSpace<T> gemm;
};

/// Rows per panel of the backward: the panel's dGamma/dS (panel x K), [g | h] (panel x (d_v+1))
/// and padded x / dx tiles stay in L2 while the log-density kernel streams them once per tile of
/// components, and the kernel's in-panel float sums stay short (the sweep: bench/results/tuning.md,
/// "GMA backward panel").
constexpr Index gma_backward_panel = 256;

/// Scratch of one backward call, reused by every panel and, through Grad, by later calls.
template <class T>
struct GmaBackwardScratch {
  using W = wide_t<T>;
  Matrix<T> gh;       // panel x (d_v + 1): [g | h] (bidirectional)
  Matrix<T> ds;       // panel x K: dGamma, then dS in place (bidirectional)
  Matrix<T> xpad;     // panel x padded r: x, zero beyond r
  Matrix<T> acc;      // panel x padded r: -dx / 2
  Matrix<T> upd;      // K x (d_v + 1): one panel's [dVt | dZ]
  Matrix<T> vz, dvz;  // K x (d_v + 1): [Vt | Z] and the summed [dVt | dZ]
  Matrix<W> dvz_wide;
  Matrix<T> g, dgq, dgk;  // causal: N x d_v, N x K, M x K
  Vector<T> h, inv_den;   // causal: N
  Matrix<W> dmu, dvar;    // K x r
  MixtureConstants<W> constants;
  PackedDensityDims<T> packed;
  DensityGradSums<W> sums;
  Matrix<W> G;  // causal: K x d_v, the suffix state dL/dS (when grad.state does not hold it)
  Vector<W> u;  // causal: K, dL/dz
  GmaScanScratch<T> scan;
  GemmSpace<T> gemm;
};

}  // namespace detail
MIXATTN_END_NAMESPACE

MIXATTN_BEGIN_NAMESPACE
namespace gma {

/// What forward keeps for backward: O((N + M) K + N d_v), never O(N M).
/// Reusable: forward_into overwrites it and keeps its capacity when shapes repeat.
template <class T>
struct Saved {
  Matrix<T> gamma_q;  // N x K
  Matrix<T> gamma_k;  // M x K
  Vector<T> den;      // N, gamma_q,i . z_i + eps
  Matrix<T> out;      // N x d_v, the forward output (h_i = -(dO_i . O_i) / den_i needs it)
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

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
std::uint64_t mixture_fingerprint(const gma::Mixture<T>& mix) {
  return Fingerprint()
      .add(mix.mean)
      .add(mix.var_raw)
      .add(mix.prior_logit)
      .add(mix.var_floor)
      .value();
}

/// Fingerprint of a causal prefix state (S, z): a record's start state, or the end state whose
/// gradient a StateGrad carries, so that pieces of a sequence are chained as they ran.
template <class W>
std::uint64_t gma_state_fingerprint(const Matrix<W>& S, const Vector<W>& z) {
  return Fingerprint().add(S).add(z).value();
}

template <class T>
void gma_check_mixture(const gma::Mixture<T>& mix, const char* fn, bool check_finite) {
  const Index K = mix.mean.rows(), r = mix.mean.cols();
  require(K > 0 && r > 0, fn, "mixture has ", K, " components of dimension ", r, " (mean is ",
          shape_str(mix.mean), "); both must be positive");
  require(mix.var_raw.rows() == K && mix.var_raw.cols() == r, fn, "mixture.var_raw is ",
          shape_str(mix.var_raw), " but mixture.mean is ", shape_str(mix.mean));
  require(mix.prior_logit.size() == K, fn, "mixture.prior_logit has ", mix.prior_logit.size(),
          " entries but mixture.mean has ", K, " components");
  require(std::isfinite(static_cast<double>(mix.var_floor)) && mix.var_floor > 0, fn,
          "mixture.var_floor is ", mix.var_floor, "; it must be positive and finite");
  if (check_finite) {
    require_finite(mix.mean, fn, "mixture.mean");
    require_finite(mix.var_raw, fn, "mixture.var_raw");
    require_finite(mix.prior_logit, fn, "mixture.prior_logit");
  }
}

/// Shapes of q, k, v against the mixture's dimension r, the options, and (with check_finite)
/// the inputs' values.
template <class T>
void gma_check_qkv(const char* fn, Index r, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                   const ConstMatrixRef<T>& v, const gma::Options& opt) {
  require(q.cols() == r, fn, "q is ", shape_str(q), " but the mixture has dimension ", r,
          " (its r: q must have ", r, " columns)");
  require(k.cols() == r, fn, "k is ", shape_str(k), " but the mixture has dimension ", r,
          " (its r: k must have ", r, " columns)");
  require(v.rows() == k.rows(), fn, "v has ", v.rows(), " rows but k has ", k.rows());
  require(!(q.rows() > 0 && k.rows() == 0), fn, "k has 0 rows but q has ", q.rows(),
          ": every query needs at least one key (q: ", shape_str(q), ", k: ", shape_str(k), ")");
  require(!opt.causal || q.rows() == k.rows(), fn,
          "causal needs as many queries as keys, but q has ", q.rows(), " rows and k has ",
          k.rows());
  // eps is applied in T: one that rounds to 0 there (1e-300 in float) would let 0 / 0 through.
  require(opt.eps > 0 && std::isfinite(opt.eps) && static_cast<T>(opt.eps) > T(0) &&
              std::isfinite(static_cast<T>(opt.eps)),
          fn, "options.eps is ", opt.eps, "; it must be positive and finite in the scalar type");
  require(opt.chunk >= 0, fn, "options.chunk is ", opt.chunk, "; it must be >= 0 (0: default)");
  if (opt.check_finite) {
    require_finite(q, fn, "q");
    require_finite(k, fn, "k");
    require_finite(v, fn, "v");
  }
}

template <class T>
void gma_check_inputs(const char* fn, const gma::Mixture<T>& mix, const ConstMatrixRef<T>& q,
                      const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                      const gma::Options& opt) {
  gma_check_mixture(mix, fn, opt.check_finite);
  gma_check_qkv<T>(fn, mix.mean.cols(), q, k, v, opt);
}

/// A State continued by a call with K components, d_v value columns and n more tokens.
template <class T>
void gma_check_state(const char* fn, const gma::State<T>& st, Index K, Index dv, Index n,
                     const gma::Options& opt) {
  require(opt.causal, fn,
          "a State is a causal prefix: options.causal must be true to continue one");
  require(st.S.rows() == K && st.S.cols() == dv && st.z.size() == K, fn, "state.S is ",
          shape_str(st.S), " and state.z has ", st.z.size(), " entries, but the mixture has ", K,
          " components and v has ", dv, " columns: make it with State<T>::empty(", K, ", ", dv,
          ")");
  require(st.tokens_seen >= 0 && n <= std::numeric_limits<Index>::max() - st.tokens_seen, fn,
          "state.tokens_seen is ", st.tokens_seen, "; with ", n,
          " more tokens it must stay in [0, max Index]");
  if (opt.check_finite) {
    // One vectorised probe over the contiguous state (x * 0 is 0 only for finite x); the
    // row-wise scan that names the entry runs only on failure.
    using W = wide_t<T>;
    const W probe =
        (Eigen::Map<const Eigen::Matrix<W, 1, Eigen::Dynamic>>(st.S.data(), st.S.size()).array() *
         W(0))
            .sum() +
        (st.z.array() * W(0)).sum();
    if (probe == W(0)) return;
    require_finite(st.S, fn, "state.S");
    require_finite(st.z, fn, "state.z");
  }
}

/// Per-thread scratch for forward without `saved` (two N x K buffers, kept for the thread's
/// lifetime and grown to the largest call; each thread has its own, so calls stay reentrant).
template <class T>
Matrix<T>& gma_workspace(int slot) {
  thread_local Matrix<T> buffers[2];
  return buffers[slot];
}

inline Index gma_chunk(const gma::Options& opt) {
  return opt.chunk > 0 ? opt.chunk : gma_default_chunk;
}

/// Gamma of the n rows of x (N x r view) into out (N x K), for a mixture already reduced to its
/// packed constants; `scores` (optional) keeps the kernel's score rows between calls. A row that
/// overflows even in the wide fallback is reported (with checks on) as std::domain_error naming
/// `arg`.
template <class Arch, class T>
void gma_gamma_into(const PackedDensity<T>& p, const ConstMatrixRef<T>& x, T* out, bool check,
                    const char* fn, const char* arg, std::vector<T>* scores = nullptr) {
  const Index bad = responsibilities_into(Arch{}, p, x.data(), x.outerStride(), x.rows(), out,
                                          p.components, scores);
  if (bad >= 0 && check)
    raise_domain_error(concat(fn, ": ", arg, " row ", bad, " (largest magnitude ",
                              x.row(bad).cwiseAbs().maxCoeff(),
                              ") is so far from every mixture component that its log-densities "
                              "overflow even in the widest type: scale ",
                              arg, " down"));
}

/// Through the softmax and the log-density (SPEC 1.5) for n <= panel tokens x (stride ldx) with
/// responsibilities gamma (n x K, stride ldg): ds holds dGamma on entry and dS on exit (n x K,
/// stride ldds); dx (n x r, stride lddx) is written; the mixture's token sums go to `sums`.
template <class Arch, class T, class W>
void gma_density_backward_rows(Arch arch, const PackedDensityDims<T>& p, const T* x, Index ldx,
                               const T* gamma, Index ldg, T* ds, Index ldds, Index n,
                               GmaBackwardScratch<T>& s, DensityGradSums<W>& sums, T* dx,
                               Index lddx) {
  const Index K = p.components, r = p.dim, rp = p.padded_dim;
  for (Index i = 0; i < n; ++i) {
    // dS = gamma . (dgamma - gamma . dgamma)
    T* di = ds + i * ldds;
    softmax_backward_row(arch, gamma + i * ldg, di, K);
    for (Index k = 0; k < K; ++k) sums.w(k) += static_cast<W>(di[k]);
    std::copy(x + i * ldx, x + i * ldx + r, s.xpad.data() + i * rp);  // padding stays zero
  }
  s.acc.topRows(n).setZero();
  density_grad_into(arch, p, s.xpad.data(), rp, ds, ldds, n, s.acc.data(), rp, sums);
  for (Index i = 0; i < n; ++i)
    for (Index m = 0; m < r; ++m) dx[i * lddx + m] = T(-2) * s.acc(i, m);
}

/// Mixture gradients from the token sums (SPEC 1.5): d var_raw = d var . sigmoid(var_raw),
/// d prior_logit = dlogpi - pi sum(dlogpi).
template <class T, class W>
void gma_mixture_grad(const gma::Mixture<T>& mix, const MixtureConstants<W>& c,
                      const DensityGradSums<W>& sums, Matrix<W>& dmu, Matrix<W>& dvar,
                      gma::MixtureGrad<T>& grad) {
  const Index K = mix.mean.rows(), r = mix.mean.cols();
  density_grad_finish(c, sums, dmu, dvar);
  grad.mean = dmu.template cast<T>();
  grad.var_raw.resize(K, r);
  for (Index kk = 0; kk < K; ++kk)
    for (Index m = 0; m < r; ++m)
      grad.var_raw(kk, m) =
          static_cast<T>(dvar(kk, m) * sigmoid(static_cast<W>(mix.var_raw(kk, m))));
  const W total = sums.w.sum();
  grad.prior_logit = (sums.w.array() - c.log_pi.array().exp() * total).template cast<T>();
}

/// With checks on, gradients that overflow T are reported, never returned.
template <class T>
void gma_check_grad(const char* fn, const gma::Grad<T>& g) {
  const char* culprit = "q, k, v or grad_out is";
  require_finite_result(g.q, fn, "the gradient of q", culprit);
  require_finite_result(g.k, fn, "the gradient of k", culprit);
  require_finite_result(g.v, fn, "the gradient of v", culprit);
  require_finite_result(g.mixture.mean, fn, "the gradient of mixture.mean", culprit);
  require_finite_result(g.mixture.var_raw, fn, "the gradient of mixture.var_raw", culprit);
  require_finite_result(g.mixture.prior_logit, fn, "the gradient of mixture.prior_logit", culprit);
  require_finite_result(g.state.S, fn, "the gradient of the start state's S", culprit);
  require_finite_result(g.state.z, fn, "the gradient of the start state's z", culprit);
}

}  // namespace detail
MIXATTN_END_NAMESPACE

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

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Bidirectional read-out (SPEC 1.3): Vt = Gamma_K^T V, z = Gamma_K^T 1, then numerators by
/// GEMM and denominators by GEMV (cheaper than copying V into [V | 1] for the ones column).
template <class T>
void gma_bidirectional_forward(const Matrix<T>& gq, const Matrix<T>& gk, const ConstMatrixRef<T>& v,
                               T eps, Matrix<T>& vt, Vector<T>& z, Matrix<T>& out, Vector<T>& den,
                               GmaForwardScratch<T>& s) {
  const Index K = gq.cols(), dv = v.cols();
  vt.resize(K, dv);
  gemm<T>(vt, transposed<T>(gk), plain<T>(v), T(1), false, s.gemm);
  z.resize(K);
  s.ones.setOnes(gk.rows());  // a stored vector: the GEMV reads it in place, no temporary
  z.noalias() = gk.transpose() * s.ones;
  gemm<T>(out, plain<T>(gq), plain<T>(vt), T(1), false, s.gemm);
  den.noalias() = gq * z;
  den.array() += eps;
  out.array().colwise() /= den.array();
}

/// This thread's forward scratch, for calls without `saved` (kept for the thread's lifetime).
template <class T>
GmaForwardScratch<T>& gma_thread_scratch() {
  thread_local GmaForwardScratch<T> scratch;
  return scratch;
}

/// Completes a Saved record whose gamma_q, gamma_k and den the forward wrote in place: the
/// output, the options and the fingerprints of the call's own inputs.
/// The start state (saved.start_S, saved.start_z: empty for a whole sequence) is in place
/// before the call; its fingerprint is taken here, and end_fingerprint is reset (a continued
/// forward sets it after). O(size) passes, no allocation.
template <class T>
void gma_save(gma::Saved<T>& saved, const Matrix<T>& out, const ConstMatrixRef<T>& q,
              const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, const gma::Options& opt,
              std::uint64_t mixture_fingerprint) {
  saved.out = out;
  saved.causal = opt.causal;
  saved.eps = opt.eps;
  saved.chunk = gma_chunk(opt);
  saved.fingerprint[0] = fingerprint(q);
  saved.fingerprint[1] = fingerprint(k);
  saved.fingerprint[2] = fingerprint(v);
  saved.fingerprint[3] = mixture_fingerprint;
  saved.fingerprint[4] = gma_state_fingerprint(saved.start_S, saved.start_z);
  saved.end_fingerprint = 0;
  saved.valid = true;
}

/// forward_into's body; `fn` names the public entry point in messages.
template <class Arch, class T>
void gma_forward(const char* fn, Matrix<T>& out, const gma::Mixture<T>& mix,
                 const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                 const gma::Options& opt, gma::Saved<T>* saved) {
  gma_check_inputs(fn, mix, q, k, v, opt);
  using W = wide_t<T>;
  const Index N = q.rows(), K = mix.components(), dv = v.cols();
  const T eps = static_cast<T>(opt.eps);
  // Without `saved` the responsibilities and the rest are scratch: this thread's buffers, so a
  // steady stream of calls neither page-faults fresh memory nor returns it to the OS each time.
  GmaForwardScratch<T>& s = saved ? saved->scratch : gma_thread_scratch<T>();
  if (saved) saved->valid = false;
  mixture_constants_into<W>(s.constants, mix.var_raw, mix.prior_logit, mix.var_floor);
  pack_density_into<Arch>(s.packed, mix.mean, s.constants);
  Matrix<T>& gq = saved ? saved->gamma_q : gma_workspace<T>(0);
  Matrix<T>& gk = saved ? saved->gamma_k : gma_workspace<T>(1);
  gq.resize(N, K);
  gk.resize(k.rows(), K);
  gma_gamma_into<Arch, T>(s.packed, q, gq.data(), opt.check_finite, fn, "q", &s.scores);
  gma_gamma_into<Arch, T>(s.packed, k, gk.data(), opt.check_finite, fn, "k", &s.scores);
  out.resize(N, dv);
  Vector<T>& den = saved ? saved->den : s.den;
  den.resize(N);
  if (opt.causal) {
    s.scan.S.setZero(K, dv);
    s.scan.z.setZero(K);
    gma_causal_forward<T>(gq, gk, v, eps, gma_chunk(opt), out, den, s.scan.S, s.scan.z, s.scan);
  } else {
    gma_bidirectional_forward<T>(gq, gk, v, eps, saved ? saved->vt : s.vt, saved ? saved->z : s.z,
                                 out, den, s);
  }
  // Gamma is finite now, so only the sums of v over keys can overflow (the output itself is a
  // weighted mean of v's rows).
  if (opt.check_finite) require_finite_result(out, fn, "the output", "v is");
  if (saved) {
    if (opt.causal) {
      saved->vt.resize(0, 0);
      saved->z.resize(0);
    }
    saved->continued = false;
    saved->start_S.resize(0, 0);
    saved->start_z.resize(0);
    gma_save(*saved, out, q, k, v, opt, mixture_fingerprint(mix));
  }
}

/// Wide scratch of the one-token decode kernel, per thread (d_v + 2K).
template <class W>
Vector<W>& gma_decode_scratch() {
  thread_local Vector<W> buffer;
  return buffer;
}

/// With checks on, whether v holds values that may make a continued forward's sums overflow.
/// The state holds weighted sums of v's rows in the wide type (z only weights): values below
/// sqrt(max T) cannot overflow it (not even over 2^63 tokens), and cannot carry a sum that is
/// already near the limit over it either, since they are below half its rounding step there.
template <class T>
bool gma_large_values(const ConstMatrixRef<T>& v, const gma::Options& opt) {
  if (!opt.check_finite || v.size() == 0) return false;
  return static_cast<double>(v.cwiseAbs().maxCoeff()) >
         std::sqrt(static_cast<double>(std::numeric_limits<T>::max()));
}

/// With checks on, a continued forward whose output or (after large values) new state
/// overflowed restores the start state when it kept it and throws domain_error. The output, a
/// weighted mean of values, is always probed (O(n d_v)); the state (O(K d_v)) only after large
/// values, so that decoding ordinary tokens pays no extra pass over it.
template <class T>
void gma_check_continued(const char* fn, const Matrix<T>& out, gma::State<T>& st, bool large,
                         bool kept, const Matrix<wide_t<T>>& start_S,
                         const Vector<wide_t<T>>& start_z, Index start_tokens) {
  using W = wide_t<T>;
  const bool finite =
      (out.array() * T(0)).sum() == T(0) && (!large || (st.S.array() * W(0)).sum() == W(0));
  if (finite) return;
  if (kept) {
    st.S = start_S;
    st.z = start_z;
    st.tokens_seen = start_tokens;
  }
  require_finite_result(out, fn, "the output", "v is");
  require_finite_result(st.S, fn, "the state's S", "v is");
}

/// Causal forward continuing `st` (SPEC 1.4) for a mixture already packed, into out (n x d_v);
/// validated by the caller. Short pieces (fewer tokens than a chunk: decoding) take the
/// one-token recurrence on the wide state, longer ones the chunked scan; both are the same sums
/// up to rounding. Working memory lives in `saved` (or this thread's scratch without it).
template <class Arch, class T>
void gma_forward_continued(const char* fn, Matrix<T>& out, const PackedDensity<T>& p,
                           const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                           const ConstMatrixRef<T>& v, const gma::Options& opt, gma::State<T>& st,
                           gma::Saved<T>* saved, std::uint64_t mixture_fingerprint) {
  using W = wide_t<T>;
  const Index N = q.rows(), K = p.components, dv = v.cols(), chunk = gma_chunk(opt);
  GmaForwardScratch<T>& s = saved ? saved->scratch : gma_thread_scratch<T>();
  if (saved) saved->valid = false;
  Matrix<T>& gq = saved ? saved->gamma_q : gma_workspace<T>(0);
  Matrix<T>& gk = saved ? saved->gamma_k : gma_workspace<T>(1);
  gq.resize(N, K);
  gk.resize(N, K);
  // Rows far from every component fall back to a wider type; a throw here leaves st untouched.
  gma_gamma_into<Arch, T>(p, q, gq.data(), opt.check_finite, fn, "q", &s.scores);
  gma_gamma_into<Arch, T>(p, k, gk.data(), opt.check_finite, fn, "k", &s.scores);
  out.resize(N, dv);
  Vector<T>& den = saved ? saved->den : s.den;
  den.resize(N);
  // The start state, for backward or to give it back untouched after an overflow (capacity
  // reused when shapes repeat).
  const Index start_tokens = st.tokens_seen;
  const bool large = gma_large_values<T>(v, opt), kept = large || saved != nullptr;
  Matrix<W>& start_S = saved ? saved->start_S : s.start_S;
  Vector<W>& start_z = saved ? saved->start_z : s.start_z;
  if (kept) {
    start_S = st.S;
    start_z = st.z;
  }
  if (N < chunk) {
    Vector<W>& w = gma_decode_scratch<W>();
    w.resize(dv + 2 * K);
    gma_causal_tokens<T>(gq.data(), gk.data(), v.data(), v.outerStride(), N, K, dv,
                         static_cast<T>(opt.eps), st.S, st.z, w, out.data(), dv, den.data());
  } else {
    gma_causal_forward<T>(gq, gk, v, static_cast<T>(opt.eps), chunk, out, den, st.S, st.z, s.scan);
  }
  st.tokens_seen += N;
  if (opt.check_finite)
    gma_check_continued<T>(fn, out, st, large, kept, start_S, start_z, start_tokens);
  if (saved) {
    saved->vt.resize(0, 0);
    saved->z.resize(0);
    saved->continued = true;
    gma_save(*saved, out, q, k, v, opt, mixture_fingerprint);
    saved->end_fingerprint = gma_state_fingerprint(st.S, st.z);
  }
}

/// dL/d(end state) is only meaningful for a forward that continued a State.
template <class T>
void gma_check_state_grad(const char* fn, const gma::Saved<T>& saved, const gma::StateGrad<T>& gs,
                          Index K, Index dv, bool check_finite) {
  require(saved.continued, fn,
          "grad_state_out is given but saved is from a forward without a State");
  require(gs.S.rows() == K && gs.S.cols() == dv && gs.z.size() == K, fn, "grad_state_out.S is ",
          shape_str(gs.S), " and grad_state_out.z has ", gs.z.size(), " entries, but the state is ",
          K, " x ", dv, " and ", K);
  if (check_finite) {
    require_finite(gs.S, fn, "grad_state_out.S");
    require_finite(gs.z, fn, "grad_state_out.z");
  }
  if (gs.state_fingerprint != 0 && gs.state_fingerprint != saved.end_fingerprint)
    raise_invalid_argument(concat(
        fn,
        ": grad_state_out came from other data: it is the gradient of a state other than the "
        "one this piece's forward ended with (run the pieces' backwards in reverse order, "
        "each given its successor's grad.state)"));
}

/// A record filled by forward from the data backward is given: q, k, v, the mixture, and (for a
/// continued forward) the start state it keeps.
template <class T>
void gma_check_record(const char* fn, const gma::Saved<T>& saved, const gma::Mixture<T>& mix,
                      const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v) {
  if (fingerprint(q) != saved.fingerprint[0]) raise_other_data(fn, "saved", "q");
  if (fingerprint(k) != saved.fingerprint[1]) raise_other_data(fn, "saved", "k");
  if (fingerprint(v) != saved.fingerprint[2]) raise_other_data(fn, "saved", "v");
  if (mixture_fingerprint(mix) != saved.fingerprint[3])
    raise_other_data(fn, "saved", "the mixture");
  if (gma_state_fingerprint(saved.start_S, saved.start_z) != saved.fingerprint[4])
    raise_other_data(fn, "saved", "saved.start_S or saved.start_z (the start state)");
}

/// Validates backward's arguments against the inputs and the Saved record.
template <class T>
void gma_check_backward(const char* fn, const gma::Mixture<T>& mix, const ConstMatrixRef<T>& q,
                        const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                        const ConstMatrixRef<T>& grad_out, const gma::Saved<T>& saved,
                        const gma::Options& opt, const gma::StateGrad<T>* grad_state_out) {
  gma_check_inputs(fn, mix, q, k, v, opt);
  const Index N = q.rows(), M = k.rows(), K = mix.components(), dv = v.cols();
  require(grad_out.rows() == N && grad_out.cols() == dv, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", N, " x ", dv);
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.valid, fn, "saved was not filled by forward");
  require(saved.gamma_q.rows() == N && saved.gamma_q.cols() == K && saved.gamma_k.rows() == M &&
              saved.gamma_k.cols() == K && saved.den.size() == N && saved.out.rows() == N &&
              saved.out.cols() == dv,
          fn, "saved is for N = ", saved.gamma_q.rows(), ", M = ", saved.gamma_k.rows(),
          ", K = ", saved.gamma_q.cols(), ", d_v = ", saved.out.cols(),
          " but the inputs have N = ", N, ", M = ", M, ", K = ", K, ", d_v = ", dv);
  require(saved.causal == opt.causal && saved.eps == opt.eps, fn,
          "saved was made with causal = ", saved.causal, ", eps = ", saved.eps,
          " but options have causal = ", opt.causal, ", eps = ", opt.eps);
  gma_check_record(fn, saved, mix, q, k, v);
  require(!saved.continued || (saved.start_S.rows() == K && saved.start_S.cols() == dv &&
                               saved.start_z.size() == K),
          fn, "saved.start_S is ", shape_str(saved.start_S), " but the state is ", K, " x ", dv);
  if (grad_state_out != nullptr)
    gma_check_state_grad(fn, saved, *grad_state_out, K, dv, opt.check_finite);
}

/// Causal backward (SPEC 1.5): g_i = dO_i / den_i, h_i = -(dO_i . O_i) / den_i through the
/// chunked scans, then through the softmax and log-density panel by panel. The prefix starts
/// from the forward's start state (zero for a whole sequence), the suffix from dL/d(end state)
/// (zero if none); for a continued forward, grad.state receives dL/d(start state).
template <class Arch, class T>
void gma_causal_backward_all(const PackedDensityDims<T>& p, const ConstMatrixRef<T>& q,
                             const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                             const ConstMatrixRef<T>& grad_out, const gma::Saved<T>& saved,
                             const gma::StateGrad<T>* grad_state_out, Index panel,
                             gma::Grad<T>& grad) {
  using W = wide_t<T>;
  GmaBackwardScratch<T>& s = grad.scratch;
  const Index N = q.rows(), M = k.rows(), K = p.components, r = p.dim, dv = v.cols();
  s.inv_den = saved.den.cwiseInverse();
  s.g = grad_out;
  s.g.array().colwise() *= s.inv_den.array();
  s.h.resize(N);
  s.h.noalias() =
      -(grad_out.cwiseProduct(saved.out).rowwise().sum().array() * s.inv_den.array()).matrix();
  s.dgq.resize(N, K);
  s.dgk.resize(M, K);
  // The suffix state runs in grad.state when it is returned (a continued forward), else in s.
  Matrix<W>& G = saved.continued ? grad.state.S : s.G;
  Vector<W>& u = saved.continued ? grad.state.z : s.u;
  if (grad_state_out != nullptr) {  // may be grad.state itself: then these are no-ops
    G = grad_state_out->S;
    u = grad_state_out->z;
  } else {
    G.setZero(K, dv);
    u.setZero(K);
  }
  if (!saved.continued) {
    grad.state.S.resize(0, 0);
    grad.state.z.resize(0);
  }
  grad.state.state_fingerprint = saved.continued ? saved.fingerprint[4] : 0;
  gma_causal_backward<T>(saved.gamma_q, saved.gamma_k, v, s.g, s.h, saved.chunk, s.dgq, s.dgk,
                         grad.v, saved.continued ? &saved.start_S : nullptr,
                         saved.continued ? &saved.start_z : nullptr, G, u, s.scan);
  for (Index i0 = 0; i0 < N; i0 += panel) {
    const Index n = std::min(panel, N - i0);
    gma_density_backward_rows(Arch{}, p, q.data() + i0 * q.outerStride(), q.outerStride(),
                              saved.gamma_q.data() + i0 * K, K, s.dgq.data() + i0 * K, K, n, s,
                              s.sums, grad.q.data() + i0 * r, r);
    gma_density_backward_rows(Arch{}, p, k.data() + i0 * k.outerStride(), k.outerStride(),
                              saved.gamma_k.data() + i0 * K, K, s.dgk.data() + i0 * K, K, n, s,
                              s.sums, grad.k.data() + i0 * r, r);
  }
}

/// Bidirectional backward, panel by panel, nothing N x K: with [g | h] (g_i = dO_i / den_i,
/// h_i = -(dO_i . O_i) / den_i) and [Vt | Z] (the ones-column trick),
///   dGamma_Q = [g | h] [Vt | Z]^T,  [dVt | dZ] = Gamma_Q^T [g | h],
///   dGamma_K = V dVt^T + 1 dZ^T,    dV = Gamma_K dVt.
/// [dVt | dZ] sums over all N queries; each panel's GEMM result is added in W.
template <class Arch, class T>
void gma_bidirectional_backward(const PackedDensityDims<T>& p, const ConstMatrixRef<T>& q,
                                const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                                const ConstMatrixRef<T>& grad_out, const gma::Saved<T>& saved,
                                Index panel, gma::Grad<T>& grad) {
  GmaBackwardScratch<T>& s = grad.scratch;
  const Index N = q.rows(), M = k.rows(), K = p.components, r = p.dim, dv = v.cols();
  s.gh.resize(panel, dv + 1);
  s.ds.resize(panel, K);
  s.upd.resize(K, dv + 1);
  s.vz.resize(K, dv + 1);
  s.vz.leftCols(dv) = saved.vt;
  s.vz.col(dv) = saved.z;
  s.dvz_wide.setZero(K, dv + 1);
  for (Index i0 = 0; i0 < N; i0 += panel) {
    const Index n = std::min(panel, N - i0);
    Eigen::Map<Matrix<T>> gh(s.gh.data(), n, dv + 1), ds(s.ds.data(), n, K);
    for (Index i = 0; i < n; ++i) {
      const T inv = T(1) / saved.den(i0 + i);
      gh.row(i).head(dv) = grad_out.row(i0 + i) * inv;
      gh(i, dv) = -grad_out.row(i0 + i).dot(saved.out.row(i0 + i)) * inv;
    }
    gemm<T>(s.upd, transposed<T>(saved.gamma_q.middleRows(i0, n)), plain<T>(gh), T(1), false,
            s.gemm);
    s.dvz_wide += s.upd.template cast<wide_t<T>>();
    gemm<T>(ds, plain<T>(gh), transposed<T>(s.vz), T(1), false, s.gemm);
    gma_density_backward_rows(Arch{}, p, q.data() + i0 * q.outerStride(), q.outerStride(),
                              saved.gamma_q.data() + i0 * K, K, ds.data(), K, n, s, s.sums,
                              grad.q.data() + i0 * r, r);
  }
  s.dvz = s.dvz_wide.template cast<T>();
  gemm<T>(grad.v, plain<T>(saved.gamma_k), plain<T>(s.dvz.leftCols(dv)), T(1), false, s.gemm);
  for (Index j0 = 0; j0 < M; j0 += panel) {
    const Index n = std::min(panel, M - j0);
    Eigen::Map<Matrix<T>> ds(s.ds.data(), n, K);
    gemm<T>(ds, plain<T>(v.middleRows(j0, n)), transposed<T>(s.dvz.leftCols(dv)), T(1), false,
            s.gemm);
    ds.rowwise() += s.dvz.col(dv).transpose();
    gma_density_backward_rows(Arch{}, p, k.data() + j0 * k.outerStride(), k.outerStride(),
                              saved.gamma_k.data() + j0 * K, K, ds.data(), K, n, s, s.sums,
                              grad.k.data() + j0 * r, r);
  }
}

/// backward_into's body; `fn` names the public entry point in messages.
template <class Arch, class T>
void gma_backward(const char* fn, gma::Grad<T>& grad, const gma::Mixture<T>& mix,
                  const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                  const gma::Saved<T>& saved, const gma::Options& opt,
                  const gma::StateGrad<T>* grad_state_out) {
  gma_check_backward(fn, mix, q, k, v, grad_out, saved, opt, grad_state_out);
  using W = wide_t<T>;
  const Index N = q.rows(), M = k.rows(), K = mix.components(), dv = v.cols(), r = mix.dim();
  GmaBackwardScratch<T>& s = grad.scratch;
  mixture_constants_into<W>(s.constants, mix.var_raw, mix.prior_logit, mix.var_floor);
  pack_density_dims_into<Arch>(s.packed, mix.mean, s.constants);
  const Index panel = std::max<Index>(1, std::min(gma_backward_panel, std::max(N, M)));
  s.xpad.setZero(panel, s.packed.padded_dim);
  s.acc.resize(panel, s.packed.padded_dim);
  s.sums.reset(K, s.packed.padded_dim);
  grad.q.resize(N, r);
  grad.k.resize(M, r);
  grad.v.resize(M, dv);
  if (opt.causal) {
    gma_causal_backward_all<Arch>(s.packed, q, k, v, grad_out, saved, grad_state_out, panel, grad);
  } else {
    grad.state.S.resize(0, 0);
    grad.state.z.resize(0);
    grad.state.state_fingerprint = 0;
    gma_bidirectional_backward<Arch>(s.packed, q, k, v, grad_out, saved, panel, grad);
  }
  gma_mixture_grad(mix, s.constants, s.sums, s.dmu, s.dvar, grad.mixture);
  if (opt.check_finite) gma_check_grad(fn, grad);
}

}  // namespace detail
MIXATTN_END_NAMESPACE

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
  detail::gma_backward<Arch, T>("mixattn::gma::backward", grad, mix, q, k, v, grad_out, saved, opt,
                                grad_state_out);
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
#define MIXATTN_GMA_INSTANCES(T)                                                                  \
  MIXATTN_TEMPLATE_INSTANCE void gma_forward<simd_arch, T>(                                       \
      const char*, Matrix<T>&, const gma::Mixture<T>&, const ConstMatrixRef<T>&,                 \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const gma::Options&, gma::Saved<T>*);   \
  MIXATTN_TEMPLATE_INSTANCE void gma_forward_continued<simd_arch, T>(                             \
      const char*, Matrix<T>&, const PackedDensity<T>&, const ConstMatrixRef<T>&,                 \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const gma::Options&, gma::State<T>&,    \
      gma::Saved<T>*, std::uint64_t);                                                             \
  MIXATTN_TEMPLATE_INSTANCE void gma_backward<simd_arch, T>(                                      \
      const char*, gma::Grad<T>&, const gma::Mixture<T>&, const ConstMatrixRef<T>&,              \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,               \
      const gma::Saved<T>&, const gma::Options&, const gma::StateGrad<T>*);
MIXATTN_GMA_INSTANCES(float)
MIXATTN_GMA_INSTANCES(double)
#undef MIXATTN_GMA_INSTANCES
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
