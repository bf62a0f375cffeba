// mixattn/detail/gma/common.hpp — what GMA's forward and backward share: the fingerprints, the
// argument checks, the responsibilities and density-gradient passes, the mixture's gradient.
//
// Internal: part of mixattn/gma.hpp; the records it works on are in mixattn/gma_types.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/causal_scan.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/gma/blocks.hpp"
#include "mixattn/detail/gma/log_density.hpp"
#include "mixattn/gma_types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

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

/// Whether an argument check also reads the inputs' values (with check_finite), or leaves them
/// to a pass of the caller's that reads them anyway.
enum class InputValues { check, skip };

/// Shapes of q, k, v against the mixture's dimension r, the options, and (with check_finite and
/// InputValues::check) the inputs' values.
template <class T>
void gma_check_qkv(const char* fn, Index r, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                   const ConstMatrixRef<T>& v, const gma::Options& opt,
                   InputValues values = InputValues::check) {
  require(q.cols() == r, fn, "q is ", shape_str(q), " but the mixture has dimension ", r,
          " (its r: q must have ", r, " columns)");
  require(k.cols() == r, fn, "k is ", shape_str(k), " but the mixture has dimension ", r,
          " (its r: k must have ", r, " columns)");
  require(v.rows() == k.rows(), fn, "v has ", v.rows(), " rows but k has ", k.rows());
  require(!(q.rows() > 0 && k.rows() == 0), fn, "k has 0 rows but q has ", q.rows(),
          ": every query needs at least one key (q: ", shape_str(q), ", k: ", shape_str(k), ")");
  check_scan_options<T>(fn, q.rows(), k.rows(), opt.causal, opt.eps, opt.chunk);
  if (opt.check_finite && values == InputValues::check) require_finite_qkv<T>(fn, q, k, v);
}

/// body(), a forward without a record whose checks are on but whose inputs were not probed
/// first (with `late`): it must raise domain_error where a probe would have, and it does, since
/// a non-finite q or k row fails its softmax (NaN or no finite log-density, also in the wide
/// type: the responsibilities kernel's error) and a non-finite v entry makes its output column
/// non-finite (products by Gamma keep NaN and inf, even by 0: the output's check). On such an
/// error the probes run, in gma_check_qkv's order (q, k, v), and a non-finite input is
/// reported as a probe before the call would have reported it; otherwise the error stands (a
/// finite input beyond the wide type's range, or an output that overflows). A pass of its own
/// over q, k and v took ~3% of the bidirectional forward at N = 4096, K = r = d_v = 64.
template <class T, class Body>
void gma_probe_on_failure(bool late, const char* fn, const ConstMatrixRef<T>& q,
                          const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, Body&& body) {
  if (!late) return body();
  try {
    body();
  } catch (const std::domain_error&) {
    require_finite(q, fn, "q");
    require_finite(k, fn, "k");
    require_finite(v, fn, "v");
    throw;
  }
}

template <class T>
void gma_check_inputs(const char* fn, const gma::Mixture<T>& mix, const ConstMatrixRef<T>& q,
                      const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                      const gma::Options& opt, InputValues values = InputValues::check) {
  gma_check_mixture(mix, fn, opt.check_finite);
  gma_check_qkv<T>(fn, mix.mean.cols(), q, k, v, opt, values);
}

/// Fingerprints of q, k and v (fp[0..2]), each taken in one pass that also tells whether the
/// input is finite; with check_finite a non-finite one raises the same domain_error, in the same
/// order (q, k, v), as gma_check_qkv's own probes. A record's forward and its backward both read
/// their inputs once for the two.
template <class T>
void gma_fingerprint_inputs(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                            const ConstMatrixRef<T>& v, bool check_finite, std::uint64_t* fp) {
  const ConstMatrixRef<T>* inputs[3] = {&q, &k, &v};
  static constexpr const char* names[3] = {"q", "k", "v"};
  for (int a = 0; a < 3; ++a) {
    bool finite = true;
    fp[a] = Fingerprint().add_checked(*inputs[a], finite).value();
    if (check_finite && !finite) require_finite(*inputs[a], fn, names[a]);
  }
}

/// A State continued by a call with K components, d_v value columns and n more tokens.
template <class T>
void gma_check_state(const char* fn, const gma::State<T>& st, Index K, Index d_v, Index n,
                     const gma::Options& opt) {
  require(opt.causal, fn,
          "a State is a causal prefix: options.causal must be true to continue one");
  require(st.S.rows() == K && st.S.cols() == d_v && st.z.size() == K, fn, "state.S is ",
          shape_str(st.S), " and state.z has ", st.z.size(), " entries, but the mixture has ", K,
          " components and v has ", d_v, " columns: make it with State<T>::empty(", K, ", ", d_v,
          ")");
  require(st.tokens_seen >= 0 && n <= std::numeric_limits<Index>::max() - st.tokens_seen, fn,
          "state.tokens_seen is ", st.tokens_seen, "; with ", n,
          " more tokens it must stay in [0, max Index]");
  if (opt.check_finite) {
    // One probe over the contiguous state (x * 0 is 0 only for finite x); the row-wise scan
    // that names the entry runs only on failure.
    if (finite_probe(st.S) + finite_probe(st.z) == wide_t<T>(0)) return;
    require_finite(st.S, fn, "state.S");
    require_finite(st.z, fn, "state.z");
  }
}

/// Gamma_Q and Gamma_K (N x K, M x K) of a forward without `saved`.
template <class T>
struct GmaGammaWorkspace {
  Matrix<T> queries, keys;
};

/// This thread's Gamma buffers for forwards without `saved` (kept for the thread's lifetime and
/// grown to the largest call; each thread has its own, so calls stay reentrant).
template <class T>
GmaGammaWorkspace<T>& gma_gamma_workspace() {
  thread_local GmaGammaWorkspace<T> workspace;
  return workspace;
}

inline Index gma_chunk(const gma::Options& opt) {
  return resolved_chunk(opt.chunk);
}

/// Gamma of the n rows of x (N x r view) into out (N x K), for a mixture already reduced to its
/// packed constants; `scores` (optional) keeps the kernel's score rows between calls. A row
/// that overflows even in the wide fallback is reported (with checks on) as std::domain_error
/// naming `arg`.
/// (x may be rows from row0 on of the caller's argument, for the message.)
template <class Arch, class T>
void gma_gamma_into(const PackedDensity<T>& p, const ConstMatrixRef<T>& x, T* out, bool check,
                    const char* fn, const char* arg, std::vector<T>* scores = nullptr,
                    Index row0 = 0) {
  const Index bad = responsibilities_into(Arch{}, p, x.data(), x.outerStride(), x.rows(), out,
                                          p.components, scores);
  if (bad >= 0 && check)
    raise_domain_error(concat(fn, ": ", arg, " row ", row0 + bad, " (largest magnitude ",
                              x.row(bad).cwiseAbs().maxCoeff(),
                              ") is so far from every mixture component that its log-densities "
                              "overflow even in the widest type: scale ",
                              arg, " down"));
}

/// What gma_density_backward_rows' ds holds on entry: dGamma (the softmax's backward is still
/// to run) or dS already.
enum class DensitySoftmax { pending, done };

/// Through the softmax and the log-density (SPEC 1.5) for n <= panel tokens x (stride ldx) with
/// responsibilities gamma (n x K, stride ldg): ds holds dGamma on entry and dS on exit (n x K,
/// stride ldds; with DensitySoftmax::done, dS on entry already); dx (n x r, stride lddx) is
/// written; the mixture's token sums go to `sums`. When r is a whole number of registers the kernel
/// reads x and accumulates into dx in place; otherwise through the zero-padded copies in s.
template <class Arch, class T>
void gma_density_backward_rows(Arch arch, const PackedDensityDims<T>& p, const T* x, Index ldx,
                               const T* gamma, Index ldg, T* ds, Index ldds, Index n,
                               GmaBackwardScratch<T>& s, DensityGradSums<T>& sums, T* dx,
                               Index lddx, DensitySoftmax softmax = DensitySoftmax::pending) {
  using W = wide_t<T>;
  const Index K = p.components, r = p.dim, rp = p.padded_dim;
  // the panel's sum of dS in T (a few hundred terms, as the kernel's own in-panel sums), then
  // added to the sum over all tokens in W
  Eigen::Map<Vector<T>> panel_w(s.panel_w.data(), K);
  panel_w.setZero();
  for (Index i = 0; i < n; ++i) {
    // dS = gamma . (dgamma - gamma . dgamma)
    T* di = ds + i * ldds;
    if (softmax == DensitySoftmax::pending) softmax_backward_row(arch, gamma + i * ldg, di, K);
    panel_w += Eigen::Map<const Vector<T>>(di, K);
  }
  sums.w += panel_w.template cast<W>();
  // dx = -2 sum_k a_km dS_ik t_ikm
  if (r == rp) {
    density_grad_into(arch, p, x, ldx, ds, ldds, n, dx, lddx, sums, T(-2));
    return;
  }
  for (Index i = 0; i < n; ++i)
    std::copy(x + i * ldx, x + i * ldx + r, s.xpad.data() + i * rp);  // padding stays zero
  density_grad_into(arch, p, s.xpad.data(), rp, ds, ldds, n, s.acc.data(), rp, sums, T(-2));
  for (Index i = 0; i < n; ++i)
    std::copy(s.acc.row(i).data(), s.acc.row(i).data() + r, dx + i * lddx);
}

/// Mixture gradients from the token sums (SPEC 1.5): d var_raw = d var . sigmoid(var_raw)
/// (density_grad_finish's overflow-free form), d prior_logit = dlogpi - pi sum(dlogpi).
/// dmu, dvar_raw: scratch in W.
template <class T, class W>
void gma_mixture_grad(const gma::Mixture<T>& mix, const MixtureConstants<W>& c,
                      DensityGradSums<T>& sums, Matrix<W>& dmu, Matrix<W>& dvar_raw,
                      gma::MixtureGrad<T>& grad) {
  density_grad_finish(c, sums, dmu, dvar_raw, &mix.var_raw);
  grad.mean = dmu.template cast<T>();
  grad.var_raw = dvar_raw.template cast<T>();
  const W total = sums.w.sum();
  grad.prior_logit = (sums.w.array() - c.log_pi.array().exp() * total).template cast<T>();
}

/// With checks on, gradients that overflow T are reported, never returned. qkv_finite: the
/// caller saw every entry of the gradients of q, k and v finite as it wrote them.
template <class T>
void gma_check_grad(const char* fn, const gma::Grad<T>& g, bool qkv_finite = false) {
  const char* culprit = "q, k, v or grad_out is";
  if (!qkv_finite) {
    require_finite_result(g.q, fn, "the gradient of q", culprit);
    require_finite_result(g.k, fn, "the gradient of k", culprit);
    require_finite_result(g.v, fn, "the gradient of v", culprit);
  }
  require_finite_result(g.mixture.mean, fn, "the gradient of mixture.mean", culprit);
  require_finite_result(g.mixture.var_raw, fn, "the gradient of mixture.var_raw", culprit);
  require_finite_result(g.mixture.prior_logit, fn, "the gradient of mixture.prior_logit", culprit);
  require_finite_result(g.state.S, fn, "the gradient of the start state's S", culprit);
  require_finite_result(g.state.z, fn, "the gradient of the start state's z", culprit);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
