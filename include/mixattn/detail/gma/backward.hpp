// mixattn/detail/gma/backward.hpp — GMA's backward (SPEC.md §1.5): the checks of a backward call,
// the causal and the bidirectional backward side by side, and the entry point's body
// (gma_backward).
//
// Internal: part of mixattn/gma.hpp; the records it works on are in mixattn/gma_types.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/causal_scan.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/gma/forward.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// dL/d(end state) is only meaningful for a forward that continued a State.
template <class T>
void gma_check_state_grad(const char* fn, const gma::Saved<T>& saved, const gma::StateGrad<T>& gs,
                          Index K, Index d_v, bool check_finite) {
  require(saved.continued, fn,
          "grad_state_out is given but saved is from a forward without a State");
  require(gs.S.rows() == K && gs.S.cols() == d_v && gs.z.size() == K, fn, "grad_state_out.S is ",
          shape_str(gs.S), " and grad_state_out.z has ", gs.z.size(), " entries, but the state is ",
          K, " x ", d_v, " and ", K);
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
/// input_fp: the fingerprints of q, k and v (gma_fingerprint_inputs).
template <class T>
void gma_check_record(const char* fn, const gma::Saved<T>& saved, const gma::Mixture<T>& mix,
                      const std::uint64_t* input_fp) {
  const typename gma::Saved<T>::Fingerprints& kept = saved.fingerprint;
  check_record(fn, "saved",
               {{kept.q, input_fp[0], "q"},
                {kept.k, input_fp[1], "k"},
                {kept.v, input_fp[2], "v"},
                {kept.mixture, mixture_fingerprint(mix), "the mixture"},
                {kept.start_state, gma_state_fingerprint(saved.start_S, saved.start_z),
                 "saved.start_S or saved.start_z (the start state)"}});
}

/// Validates backward's arguments against the inputs and the Saved record. grad_out_values:
/// check probes grad_out's values here; skip leaves them to the caller, on its way through them.
template <class T>
void gma_check_backward(const char* fn, const gma::Mixture<T>& mix, const ConstMatrixRef<T>& q,
                        const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                        const ConstMatrixRef<T>& grad_out, const gma::Saved<T>& saved,
                        const gma::Options& opt, const gma::StateGrad<T>* grad_state_out,
                        InputValues grad_out_values = InputValues::check) {
  // The inputs' finiteness probes (check_finite) and their fingerprints in one pass each.
  gma_check_inputs(fn, mix, q, k, v, opt, InputValues::skip);
  std::uint64_t input_fp[3];
  gma_fingerprint_inputs<T>(fn, q, k, v, opt.check_finite, input_fp);
  const Index N = q.rows(), M = k.rows(), K = mix.components(), d_v = v.cols();
  require(grad_out.rows() == N && grad_out.cols() == d_v, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", N, " x ", d_v);
  if (opt.check_finite && grad_out_values == InputValues::check)
    require_finite(grad_out, fn, "grad_out");
  require(saved.valid, fn, "saved was not filled by forward");
  // the causal backward reads the output (h), the bidirectional one Vt and z
  const Index saved_dv = saved.causal ? saved.out.cols() : saved.vt.cols();
  require(
      saved.gamma_q.rows() == N && saved.gamma_q.cols() == K && saved.gamma_k.rows() == M &&
          saved.gamma_k.cols() == K && saved.den.size() == N &&
          (saved.causal ? saved.out.rows() == N : saved.vt.rows() == K && saved.z.size() == K) &&
          saved_dv == d_v,
      fn, "saved is for N = ", saved.gamma_q.rows(), ", M = ", saved.gamma_k.rows(),
      ", K = ", saved.gamma_q.cols(), ", d_v = ", saved_dv, " but the inputs have N = ", N,
      ", M = ", M, ", K = ", K, ", d_v = ", d_v);
  require(saved.causal == opt.causal && saved.eps == opt.eps, fn,
          "saved was made with causal = ", saved.causal, ", eps = ", saved.eps,
          " but options have causal = ", opt.causal, ", eps = ", opt.eps);
  gma_check_record(fn, saved, mix, input_fp);
  require(!saved.continued || (saved.start_S.rows() == K && saved.start_S.cols() == d_v &&
                               saved.start_z.size() == K),
          fn, "saved.start_S is ", shape_str(saved.start_S), " but the state is ", K, " x ", d_v);
  if (grad_state_out != nullptr)
    gma_check_state_grad(fn, saved, *grad_state_out, K, d_v, opt.check_finite);
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
  const Index N = q.rows(), M = k.rows(), K = p.components, r = p.dim, d_v = v.cols();
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
    G.setZero(K, d_v);
    u.setZero(K);
  }
  if (!saved.continued) {
    grad.state.S.resize(0, 0);
    grad.state.z.resize(0);
  }
  grad.state.state_fingerprint = saved.continued ? saved.fingerprint.start_state : 0;
  causal_scan_backward<T, Arch>(saved.gamma_q, saved.gamma_k, v, s.g, s.h, saved.chunk, s.dgq,
                                s.dgk, grad.v, saved.continued ? &saved.start_S : nullptr,
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

/// Bidirectional backward, panel by panel, nothing N x K: with g_i = dO_i / den_i,
///   P = g Vt^T,  h_i = -(dO_i . O_i) / den_i = -(gamma_q,i . P_i) / den_i,
///   dGamma_Q = P + h z^T,  [dVt | dZ] = Gamma_Q^T [g | h],
///   dGamma_K = V dVt^T + 1 dZ^T,    dV = Gamma_K dVt.
/// (dO_i . O_i = gamma_q,i . (Vt dO_i) / den_i, since O_i = gamma_q,i Vt / den_i: the record
/// needs no copy of the output.) Through the query side's softmax, gamma_q,i . dgamma_q,i =
/// gamma_q,i . P_i + h_i gamma_q,i . z = -h_i den_i + h_i (den_i - eps) = -h_i eps exactly, so
/// dS_Q,i = gamma_q,i . (P_i + h_i (z + eps)) without a second dot product (and without the
/// cancellation in den_i - gamma_q,i . z that a computed one would carry). [dVt | dZ] sums over
/// all N queries; each run of panels' part (gma_backward_fold_rows) is added in W.
/// With probe_finite, returns whether the gradients of q, k and v were seen finite, panel by panel
/// as they were written (while in cache), so that gma_check_grad need not read them again. False
/// without probe_finite, or when an entry is not finite. With probe_finite, grad_out is probed
/// on the way too, through g = dO / den (finite for finite dO unless the quotient overflows),
/// and a non-finite grad_out raises domain_error naming it once every panel is through: the
/// gradients were overwritten by then, which an _into form allows, and nothing else was (a
/// separate pass over grad_out before the panels took ~0.6% of a training step).
/// Whether the bidirectional backward runs its products on row_tiles.hpp's register tiles (SIMD
/// builds: no packing, the K x d_v operands stay in L1, the two that contract over value columns
/// reading a transposed copy) or on Eigen's GEMM (the scalar build).
template <class Arch>
constexpr bool gma_backward_tiles = MIXATTN_HAS_SIMD && !std::is_same<Arch, scalar_arch>::value;

/// The bidirectional backward's pass over one panel of queries [i0, i0 + n): g = dO / den, dS_Q
/// into s.ds, this panel's part of [dVt | dZ] into the wide sums, and grad.q's rows. probe_g
/// collects finite_probe(g).
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void gma_bidirectional_query_panel(const PackedDensityDims<T>& p,
                                                         const ConstMatrixRef<T>& q,
                                                         const ConstMatrixRef<T>& grad_out,
                                                         const gma::Saved<T>& saved, Index panel,
                                                         Index i0, Index n, gma::Grad<T>& grad,
                                                         bool probe_finite, T& probe_g) {
  using W = wide_t<T>;
  constexpr bool tiles = gma_backward_tiles<Arch>;
  GmaBackwardScratch<T>& s = grad.scratch;
  const Index K = p.components, r = p.dim, d_v = grad_out.cols();
  Eigen::Map<Matrix<T>> g(s.gh.data(), n, d_v), ds(s.ds.data(), n, K);
  for (Index i = 0; i < n; ++i) g.row(i) = grad_out.row(i0 + i) * (T(1) / saved.den(i0 + i));
  if (probe_finite) probe_g += finite_probe(g);
  const T* gq = saved.gamma_q.data() + i0 * K;
#if MIXATTN_HAS_SIMD
  if constexpr (tiles)
    read_block<Arch, T>(ReadSources<T>{g.data(), d_v, s.vzt.data(), K, d_v}, n, K, nullptr,
                        ds.data(), K);
#endif
  if constexpr (!tiles) gemm<T>(ds, plain<T>(g), transposed<T>(saved.vt), T(1), false, s.gemm);
  Eigen::Map<Vector<T>> dz(s.panel_dz.data(), K);
  dz.setZero();
  for (Index i = 0; i < n; ++i) {
    Eigen::Map<const Vector<T>> gi(gq + i * K, K);
    Eigen::Map<Vector<T>> di(ds.data() + i * K, K);
    const T h = static_cast<T>(-row_dot(Arch{}, gi.data(), di.data(), K) / saved.den(i0 + i));
    dz.noalias() += h * gi;
    di = gi.cwiseProduct(di + h * s.z_eps);  // dS_Q,i
  }
#if MIXATTN_HAS_SIMD
  // dVt's terms accumulate in T over gma_backward_fold_rows queries (several panels), then
  // fold into the wide sum: a fold (and the clearing after it) per panel of 32 rows, K d_v
  // conversions and adds each, took ~1.5% of an AVX2 training step
  if constexpr (tiles) {
    if (i0 % gma_backward_fold_rows(panel) == 0) s.upd.setZero();
    write_block<Arch>(gq, K, g.data(), d_v, n, K, d_v, s.upd.data(), d_v);
    if ((i0 + n) % gma_backward_fold_rows(panel) == 0 || i0 + n == q.rows())
      s.dvz_wide += s.upd.template cast<W>();
  }
#endif
  if constexpr (!tiles) {
    gemm<T>(s.upd, transposed<T>(saved.gamma_q.middleRows(i0, n)), plain<T>(g), T(1), false,
            s.gemm);
    s.dvz_wide += s.upd.template cast<W>();
  }
  s.dz_wide += dz.template cast<W>();
  gma_density_backward_rows(Arch{}, p, q.data() + i0 * q.outerStride(), q.outerStride(), gq, K,
                            ds.data(), K, n, s, s.sums, grad.q.data() + i0 * r, r,
                            DensitySoftmax::done);
}

/// The bidirectional backward's pass over one panel of keys [j0, j0 + n), after the queries'
/// [dVt | dZ]: grad.v's rows (SIMD builds; the scalar build forms grad.v in one GEMM),
/// dS_K = V dVt^T + 1 dZ^T and grad.k's rows. probe collects finite_probe of the rows written.
template <class Arch, class T>
MIXATTN_ALWAYS_INLINE void gma_bidirectional_key_panel(const PackedDensityDims<T>& p,
                                                       const ConstMatrixRef<T>& k,
                                                       const ConstMatrixRef<T>& v,
                                                       const gma::Saved<T>& saved, Index j0,
                                                       Index n, gma::Grad<T>& grad,
                                                       bool probe_finite, T& probe) {
  GmaBackwardScratch<T>& s = grad.scratch;
  const Index K = p.components, r = p.dim, d_v = v.cols();
  Eigen::Map<Matrix<T>> ds(s.ds.data(), n, K);
#if MIXATTN_HAS_SIMD
  if constexpr (gma_backward_tiles<Arch>) {
    // dV = Gamma_K dVt panel by panel (each row its own sum: the bits of one pass over M)
    read_block<Arch, T>(ReadSources<T>{saved.gamma_k.data() + j0 * K, K, s.dvz.data(), d_v, K}, n,
                        d_v, nullptr, grad.v.data() + j0 * d_v, d_v);
    if (probe_finite) probe += finite_probe(grad.v.middleRows(j0, n));
    read_block<Arch, T>(
        ReadSources<T>{v.data() + j0 * v.outerStride(), v.outerStride(), s.dvt.data(), K, d_v}, n,
        K, nullptr, ds.data(), K);
  }
#endif
  if constexpr (!gma_backward_tiles<Arch>)
    gemm<T>(ds, plain<T>(v.middleRows(j0, n)), transposed<T>(s.dvz), T(1), false, s.gemm);
  for (Index j = 0; j < n; ++j)
    zip_rows(Arch{}, ds.data() + j * K, s.panel_dz.data(), ds.data() + j * K, K,
             [](auto a, auto b) { return a + b; });
  gma_density_backward_rows(Arch{}, p, k.data() + j0 * k.outerStride(), k.outerStride(),
                            saved.gamma_k.data() + j0 * K, K, ds.data(), K, n, s, s.sums,
                            grad.k.data() + j0 * r, r);
}

template <class Arch, class T>
bool gma_bidirectional_backward(const char* fn, const PackedDensityDims<T>& p,
                                const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                                const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                                const gma::Saved<T>& saved, Index panel, gma::Grad<T>& grad,
                                bool probe_finite) {
  constexpr bool tiles = gma_backward_tiles<Arch>;
  GmaBackwardScratch<T>& s = grad.scratch;
  const Index N = q.rows(), M = k.rows(), K = p.components, d_v = v.cols();
  s.gh.resize(panel, d_v);
  s.ds.resize(panel, K);
  s.upd.resize(K, d_v);  // whole registers per row: the write's rows of M load aligned
  s.panel_dz.resize(K);
  s.dvz_wide.setZero(K, d_v);
  s.dz_wide.setZero(K);
  s.z_eps = saved.z.array() + static_cast<T>(saved.eps);
  if constexpr (tiles) s.vzt = saved.vt.transpose();
  // sum of 0 * every gradient entry written (finite_probe): 0 unless one is inf or NaN; the
  // same for g
  T probe = T(0), probe_g = T(0);
  for (Index i0 = 0; i0 < N; i0 += panel) {
    const Index n = std::min(panel, N - i0);
    gma_bidirectional_query_panel<Arch, T>(p, q, grad_out, saved, panel, i0, n, grad, probe_finite,
                                           probe_g);
    if (probe_finite) probe += finite_probe(grad.q.middleRows(i0, n));
  }
  s.dvz = s.dvz_wide.template cast<T>();      // dVt, K x d_v
  s.panel_dz = s.dz_wide.template cast<T>();  // dZ
#if MIXATTN_HAS_SIMD
  if constexpr (tiles) s.dvt = s.dvz.transpose();
#endif
  if constexpr (!tiles) {
    gemm<T>(grad.v, plain<T>(saved.gamma_k), plain<T>(s.dvz), T(1), false, s.gemm);
    if (probe_finite) probe += finite_probe(grad.v);
  }
  for (Index j0 = 0; j0 < M; j0 += panel) {
    const Index n = std::min(panel, M - j0);
    gma_bidirectional_key_panel<Arch, T>(p, k, v, saved, j0, n, grad, probe_finite, probe);
    if (probe_finite) probe += finite_probe(grad.k.middleRows(j0, n));
  }
  if (probe_g != T(0)) require_finite(grad_out, fn, "grad_out");  // else g overflowed
  return probe_finite && probe == T(0);
}

/// backward_into's body; `fn` names the public entry point in messages.
template <class Arch, class T>
void gma_backward_into(const char* fn, gma::Grad<T>& grad, const gma::Mixture<T>& mix,
                       const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                       const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                       const gma::Saved<T>& saved, const gma::Options& opt,
                       const gma::StateGrad<T>* grad_state_out) {
  gma_check_backward(fn, mix, q, k, v, grad_out, saved, opt, grad_state_out,
                     opt.causal ? InputValues::check : InputValues::skip);
  const FlushSubnormals flush;
  using W = wide_t<T>;
  const Index N = q.rows(), M = k.rows(), K = mix.components(), d_v = v.cols(), r = mix.dim();
  GmaBackwardScratch<T>& s = grad.scratch;
  mixture_constants_into<W>(s.constants, mix.var_raw, mix.prior_logit, mix.var_floor);
  pack_density_dims_into<Arch>(s.packed, mix.mean, s.constants);
  const Index panel = std::max<Index>(1, std::min(gma_backward_panel_rows<Arch>(), std::max(N, M)));
  if (s.packed.padded_dim != r) {  // else the kernel works on x and dx in place
    s.xpad.setZero(panel, s.packed.padded_dim);
    s.acc.resize(panel, s.packed.padded_dim);
  }
  s.panel_w.resize(K);
  s.sums.reset(K, s.packed.padded_dim);
  grad.q.resize(N, r);
  grad.k.resize(M, r);
  grad.v.resize(M, d_v);
  bool qkv_finite = false;  // the gradients of q, k and v already probed and finite
  if (opt.causal) {
    gma_causal_backward_all<Arch>(s.packed, q, k, v, grad_out, saved, grad_state_out, panel, grad);
  } else {
    grad.state.S.resize(0, 0);
    grad.state.z.resize(0);
    grad.state.state_fingerprint = 0;
    qkv_finite = gma_bidirectional_backward<Arch>(fn, s.packed, q, k, v, grad_out, saved, panel,
                                                  grad, opt.check_finite);
  }
  gma_mixture_grad(mix, s.constants, s.sums, s.dmu, s.dvar_raw, grad.mixture);
  if (opt.check_finite) gma_check_grad(fn, grad, qkv_finite);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
