// mixattn/detail/gma_backward.hpp — GMA's backward (SPEC.md §1.5): the checks of a backward call,
// the causal and the bidirectional backward side by side, and the entry point's body
// (gma_backward).
//
// Internal: included by mixattn/gma.hpp after its forward.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/gma_forward.hpp"
#include "mixattn/detail/gma_scan.hpp"

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
  const Index N = q.rows(), M = k.rows(), K = mix.components(), d_v = v.cols();
  require(grad_out.rows() == N && grad_out.cols() == d_v, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", N, " x ", d_v);
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.valid, fn, "saved was not filled by forward");
  require(saved.gamma_q.rows() == N && saved.gamma_q.cols() == K && saved.gamma_k.rows() == M &&
              saved.gamma_k.cols() == K && saved.den.size() == N && saved.out.rows() == N &&
              saved.out.cols() == d_v,
          fn, "saved is for N = ", saved.gamma_q.rows(), ", M = ", saved.gamma_k.rows(),
          ", K = ", saved.gamma_q.cols(), ", d_v = ", saved.out.cols(),
          " but the inputs have N = ", N, ", M = ", M, ", K = ", K, ", d_v = ", d_v);
  require(saved.causal == opt.causal && saved.eps == opt.eps, fn,
          "saved was made with causal = ", saved.causal, ", eps = ", saved.eps,
          " but options have causal = ", opt.causal, ", eps = ", opt.eps);
  gma_check_record(fn, saved, mix, q, k, v);
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
  const Index N = q.rows(), M = k.rows(), K = p.components, r = p.dim, d_v = v.cols();
  s.gh.resize(panel, d_v + 1);
  s.ds.resize(panel, K);
  s.upd.resize(K, d_v + 1);
  s.vz.resize(K, d_v + 1);
  s.vz.leftCols(d_v) = saved.vt;
  s.vz.col(d_v) = saved.z;
  s.dvz_wide.setZero(K, d_v + 1);
  // SIMD builds run the four products on row_tiles.hpp's register tiles (no packing; the K x
  // (d_v + 1) operands stay in L1), with the two that contract over value columns reading a
  // transposed copy; the scalar build uses Eigen's GEMM.
  constexpr bool tiles = MIXATTN_HAS_SIMD && !std::is_same<Arch, scalar_arch>::value;
  if constexpr (tiles) s.vzt = s.vz.transpose();
  for (Index i0 = 0; i0 < N; i0 += panel) {
    const Index n = std::min(panel, N - i0);
    Eigen::Map<Matrix<T>> gh(s.gh.data(), n, d_v + 1), ds(s.ds.data(), n, K);
    for (Index i = 0; i < n; ++i) {
      const T inv = T(1) / saved.den(i0 + i);
      gh.row(i).head(d_v) = grad_out.row(i0 + i) * inv;
      gh(i, d_v) = -grad_out.row(i0 + i).dot(saved.out.row(i0 + i)) * inv;
    }
    const T* gq = saved.gamma_q.data() + i0 * K;
#if MIXATTN_HAS_SIMD
    if constexpr (tiles) {
      s.upd.setZero();
      write_block<Arch>(gq, K, gh.data(), d_v + 1, n, K, d_v + 1, s.upd.data(), d_v + 1);
      read_block<Arch, T>(ReadSources<T>{gh.data(), d_v + 1, s.vzt.data(), K, d_v + 1}, n, K,
                          nullptr, ds.data(), K);
    }
#endif
    if constexpr (!tiles) {
      gemm<T>(s.upd, transposed<T>(saved.gamma_q.middleRows(i0, n)), plain<T>(gh), T(1), false,
              s.gemm);
      gemm<T>(ds, plain<T>(gh), transposed<T>(s.vz), T(1), false, s.gemm);
    }
    s.dvz_wide += s.upd.template cast<wide_t<T>>();
    gma_density_backward_rows(Arch{}, p, q.data() + i0 * q.outerStride(), q.outerStride(), gq, K,
                              ds.data(), K, n, s, s.sums, grad.q.data() + i0 * r, r);
  }
  s.dvz = s.dvz_wide.template cast<T>();
#if MIXATTN_HAS_SIMD
  if constexpr (tiles) {
    s.dvt = s.dvz.leftCols(d_v).transpose();
    read_block<Arch, T>(ReadSources<T>{saved.gamma_k.data(), K, s.dvz.data(), d_v + 1, K}, M, d_v,
                        nullptr, grad.v.data(), d_v);
  }
#endif
  if constexpr (!tiles)
    gemm<T>(grad.v, plain<T>(saved.gamma_k), plain<T>(s.dvz.leftCols(d_v)), T(1), false, s.gemm);
  for (Index j0 = 0; j0 < M; j0 += panel) {
    const Index n = std::min(panel, M - j0);
    Eigen::Map<Matrix<T>> ds(s.ds.data(), n, K);
#if MIXATTN_HAS_SIMD
    if constexpr (tiles)
      read_block<Arch, T>(ReadSources<T>{v.data() + j0 * v.outerStride(), v.outerStride(),
                                         s.dvt.data(), K, d_v},
                          n, K, nullptr, ds.data(), K);
#endif
    if constexpr (!tiles)
      gemm<T>(ds, plain<T>(v.middleRows(j0, n)), transposed<T>(s.dvz.leftCols(d_v)), T(1), false,
              s.gemm);
    ds.rowwise() += s.dvz.col(d_v).transpose();
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
  const FlushSubnormals flush;
  using W = wide_t<T>;
  const Index N = q.rows(), M = k.rows(), K = mix.components(), d_v = v.cols(), r = mix.dim();
  GmaBackwardScratch<T>& s = grad.scratch;
  mixture_constants_into<W>(s.constants, mix.var_raw, mix.prior_logit, mix.var_floor);
  pack_density_dims_into<Arch>(s.packed, mix.mean, s.constants);
  const Index panel = std::max<Index>(1, std::min(gma_backward_panel, std::max(N, M)));
  s.xpad.setZero(panel, s.packed.padded_dim);
  s.acc.resize(panel, s.packed.padded_dim);
  s.sums.reset(K, s.packed.padded_dim);
  grad.q.resize(N, r);
  grad.k.resize(M, r);
  grad.v.resize(M, d_v);
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
