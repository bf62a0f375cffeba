// mixattn/detail/delta/backward.hpp — the gated delta rule's backward (SPEC.md §9.3): the chunks'
// start states (kept or recomputed), one chunk's gradients, the reverse sweep, and the body
// behind the entry points, delta_backward_into.
//
// Internal: included by mixattn/delta.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/delta_types.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/delta/checks.hpp"
#include "mixattn/detail/delta/chunk.hpp"
#include "mixattn/detail/delta/kernels.hpp"
#include "mixattn/detail/common/gemm.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Every chunk's start state into `states` (rows [c d_k, (c + 1) d_k) for chunk c), recomputed
/// from the kept Delta by the state line of SPEC 9.2 from the wide start state in s.sw, with the
/// forward's own operations (delta_advance_state).
template <class T>
void delta_recompute_states(const DeltaInputs<T>& in, const DeltaConfig& cfg,
                            const Vector<T>& inv_q, const Vector<T>& inv_k, const Matrix<T>& delta,
                            Matrix<T>& states, DeltaScratch<T>& s) {
  const Index N = in.q.rows(), dk = in.q.cols();
  const Index C = std::min(cfg.chunk, N);
  states.resize(((N + C - 1) / C) * dk, in.v.cols());
  for (Index c0 = 0, c = 0; c0 < N; c0 += C, ++c) {
    const Index n = std::min(C, N - c0);
    states.middleRows(c * dk, dk) = s.sw.template cast<T>();
    if (c0 + n == N) break;  // the end state is not needed
    delta_load_chunk<T>(in, cfg, inv_q, inv_k, c0, n, s);
    delta_chunk_gamma<T>(in.g, c0, n, s);
    delta_advance_state<T>(delta.middleRows(c0, n), n, s);
  }
}

/// The products of one chunk's backward (SPEC 9.3), after delta_prepare_chunk (with B) and with
/// dS' in s.ds (T) and the chunk's start state S:
///   dDelta = P^T dO + K_d dS' (s.u),  dR = T^T dDelta (bottom of s.dd = [dO; dR]),
///   s.x = [dO; dR] Delta^T,  s.z = [dO; dR] S^T,  s.e = Delta dS'^T,
///   s.dsu = [diag(e^gamma) Q; -diag(beta e^gamma) K]^T [dO; dR].
template <class T>
void delta_chunk_backward_products(const DeltaInputs<T>& in, const ConstMatrixRef<T>& d_out,
                                   const ConstMatrixRef<T>& delta, const ConstMatrixRef<T>& S,
                                   Index c0, Index n, DeltaScratch<T>& s) {
  const Index dv = in.v.cols();
  s.kd.topRows(n).array() = s.qk.middleRows(n, n).array().colwise() * s.ed.head(n).array();
  delta_product<T>(s.u.topRows(n), delta_lhs<T>(s.prod.topLeftCorner(n, n), true, DeltaTri::upper),
                   d_out, false, s.gemm);  // P^T dO
  delta_product<T>(s.u.topRows(n), delta_lhs<T>(s.kd.topRows(n), false), s.ds, true, s.gemm);
  s.dd.topRows(n) = d_out;
  delta_product<T>(s.dd.middleRows(n, n),
                   delta_lhs<T>(s.tri.topLeftCorner(n, n), true, DeltaTri::upper), s.u.topRows(n),
                   false, s.gemm);  // dR = T^T dDelta
  const ConstMatrixRef<T> dd = s.dd.topRows(2 * n);
  s.dt.leftCols(n) = delta.transpose();
  s.st = S.transpose();
  s.dst = s.ds.transpose();
  const ConstMatrixRef<T> dt = s.dt.leftCols(n);
  delta_product<T>(s.x.topLeftCorner(n, n), delta_lhs<T>(s.dd.topRows(n), false), dt, false, s.gemm,
                   true);  // dP's triangle
  delta_product<T>(s.x.block(n, 0, n, n), delta_lhs<T>(s.dd.middleRows(n, n), false), dt, false,
                   s.gemm, true);  // -dA's triangle
  delta_product<T>(s.z.topRows(2 * n), delta_lhs<T>(dd, false), s.st, false, s.gemm);
  delta_product<T>(s.e.topRows(n), delta_lhs<T>(delta, false), s.dst, false, s.gemm);
  const auto beta = in.beta.segment(c0, n).array();
  s.lhs.topRows(n).array() = s.qk.topRows(n).array().colwise() * s.eg.head(n).array();
  s.w.head(n).array() = -(beta * s.eg.head(n).array());
  s.lhs.middleRows(n, n).array() = s.qk.middleRows(n, n).array().colwise() * s.w.head(n).array();
  delta_product<T>(s.dsu, delta_lhs<T>(s.lhs.topRows(2 * n), true), dd, false, s.gemm);
  static_cast<void>(dv);
}

/// dbeta and dg of one chunk (SPEC 9.3) from s.x (before its masks), s.z, s.e, P, A and B, and
/// with S and dS' for the [r = C] term; writes rows [c0, c0 + n) of dbeta and dg.
template <class T>
void delta_chunk_gate_grads(const DeltaInputs<T>& in, const ConstMatrixRef<T>& S, Index c0, Index n,
                            DeltaScratch<T>& s, Vector<T>& dbeta, Vector<T>& dg) {
  using W = wide_t<T>;
  const Index dv = in.v.cols();
  auto& dgam = s.dgamma;
  dgam.head(n).setZero();
  W tail = 0;  // the [r = C] term
  for (Index r = 0; r < n; ++r) {
    const W br = static_cast<W>(in.beta(c0 + r)), eg = static_cast<W>(s.eg(r));
    const W zq = static_cast<W>(s.qk.row(r).dot(s.z.row(r)));
    const W zk = static_cast<W>(s.qk.row(n + r).dot(s.z.row(n + r)));
    const W ek = static_cast<W>(s.ed(r)) * static_cast<W>(s.qk.row(n + r).dot(s.e.row(r)));
    const W vr = static_cast<W>(in.v.row(c0 + r).dot(s.dd.row(n + r)));
    W db = vr - eg * zk, hrow = 0;
    const T* dp = s.x.row(r).data();        // dP_rj (j <= r)
    const T* da = s.x.row(n + r).data();    // -dA_rj (j < r)
    const T* p = s.prod.row(r).data();      // P_rj
    const T* a = s.prod.row(n + r).data();  // A_rj
    const T* b = s.b.row(r).data();         // B_rj
    for (Index j = 0; j <= r; ++j) {
      W h = static_cast<W>(dp[j]) * static_cast<W>(p[j]);
      if (j < r) {
        h -= static_cast<W>(da[j]) * static_cast<W>(a[j]);
        db -= static_cast<W>(da[j]) * static_cast<W>(b[j]);
      }
      hrow += h;
      dgam(j) -= h;
    }
    dgam(r) += hrow + eg * zq - br * eg * zk - ek;
    tail += ek;
    dbeta(c0 + r) = static_cast<T>(db);
  }
  const W sds = (S.template cast<W>().array() * s.ds.template cast<W>().array()).sum();
  dgam(n - 1) += tail + std::exp(s.gamma(n - 1)) * sds;
  W acc = 0;
  for (Index r = n - 1; r >= 0; --r) {
    acc += dgam(r);
    dg(c0 + r) = static_cast<T>(acc);
  }
  static_cast<void>(dv);
}

/// The rest of one chunk's backward: the masks on s.x (dP o Gamma; M = diag(beta) (dA o Gamma)),
/// then dQ, dK, dV rows (of the scaled, normalised q~ and k^: the caller takes them through the
/// scale and the normalisation) and the previous chunk's dS' into s.dsw.
template <class T>
void delta_chunk_input_grads(const DeltaInputs<T>& in, Index c0, Index n, DeltaScratch<T>& s,
                             delta::Grad<T>& grad) {
  using W = wide_t<T>;
  for (Index r = 0; r < n; ++r) {
    T* dp = s.x.row(r).data();
    T* m = s.x.row(n + r).data();
    const T* d = s.decay.row(r).data();
    const T br = in.beta(c0 + r);
    for (Index j = 0; j <= r; ++j) dp[j] *= d[j];
    std::fill(dp + r + 1, dp + n, T(0));
    for (Index j = 0; j < r; ++j) m[j] = -br * m[j] * d[j];  // s.x held -dA
    std::fill(m + r, m + n, T(0));
  }
  const ConstMatrixRef<T> dpg = s.x.topLeftCorner(n, n), m = s.x.block(n, 0, n, n);
  const ConstMatrixRef<T> Q = s.qk.topRows(n), K = s.qk.middleRows(n, n);
  delta_product<T>(s.dqk.topRows(n), delta_lhs<T>(dpg, false, DeltaTri::lower), K, false,
                   s.gemm);  // (dP o Gamma) K
  delta_product<T>(s.dqk.middleRows(n, n), delta_lhs<T>(m, false, DeltaTri::lower), K, false,
                   s.gemm);  // M K
  delta_product<T>(s.dk.topRows(n), delta_lhs<T>(dpg, true, DeltaTri::upper), Q, false,
                   s.gemm);  // (dP o Gamma)^T Q
  delta_product<T>(s.dk.topRows(n), delta_lhs<T>(m, true, DeltaTri::upper), K, true,
                   s.gemm);  // + M^T K
  const auto beta = in.beta.segment(c0, n).array();
  const auto eg = s.eg.head(n).array();
  grad.q.middleRows(c0, n) = s.dqk.topRows(n) + (s.z.topRows(n).array().colwise() * eg).matrix();
  s.w.head(n).array() = beta * eg;
  grad.k.middleRows(c0, n) =
      s.dk.topRows(n) + s.dqk.middleRows(n, n) +
      (s.e.topRows(n).array().colwise() * s.ed.head(n).array()).matrix() -
      (s.z.middleRows(n, n).array().colwise() * s.w.head(n).array()).matrix();
  grad.v.middleRows(c0, n) = s.dd.middleRows(n, n).array().colwise() * beta;
  s.dsw = std::exp(s.gamma(n - 1)) * s.dsw + s.dsu.template cast<W>();
}

/// The reverse sweep over the chunks: s.dsw holds dS_N on entry (sized d_k x d_v) and dS_0 on
/// exit; `states` every chunk's start state. grad.q and grad.k receive the gradients of q~ and
/// k^ (before the scale and the normalisation).
template <class T>
void delta_backward_sweep(const DeltaInputs<T>& in, const DeltaConfig& cfg, const Vector<T>& inv_q,
                          const Vector<T>& inv_k, const ConstMatrixRef<T>& grad_out,
                          const Matrix<T>& delta, const Matrix<T>& states, delta::Grad<T>& grad,
                          DeltaScratch<T>& s) {
  const Index N = in.q.rows(), dk = in.q.cols(), dv = in.v.cols();
  const Index C = std::min(cfg.chunk, N);
  delta_size_chunk_buffers<T>(s, C, dk, dv);
  s.b.resize(C, C);
  s.u.resize(C, dv);
  s.lhs.resize(2 * C, dk);
  s.dd.resize(2 * C, dv);
  s.x.resize(2 * C, C);
  s.z.resize(2 * C, dk);
  s.e.resize(C, dk);
  s.dqk.resize(2 * C, dk);
  s.dk.resize(C, dk);
  s.ds.resize(dk, dv);
  s.dsu.resize(dk, dv);
  s.dt.resize(dv, C);
  s.st.resize(dv, dk);
  s.dst.resize(dv, dk);
  s.dgamma.resize(C);
  const Index chunks = (N + C - 1) / C;
  for (Index c = chunks - 1; c >= 0; --c) {
    const Index c0 = c * C, n = std::min(C, N - c0);
    delta_prepare_chunk<T>(in, cfg, inv_q, inv_k, c0, n, s, &s.b);
    s.ds = s.dsw.template cast<T>();
    const ConstMatrixRef<T> S = states.middleRows(c * dk, dk);
    const ConstMatrixRef<T> d = delta.middleRows(c0, n);
    delta_chunk_backward_products<T>(in, grad_out.middleRows(c0, n), d, S, c0, n, s);
    delta_chunk_gate_grads<T>(in, S, c0, n, s, grad.beta, grad.g);
    delta_chunk_input_grads<T>(in, c0, n, s, grad);
  }
}

/// dx = (dx^ - x^ (x^ . dx^)) inv(x), x^ = x inv(x), row by row in place on dx (SPEC 9.3); the
/// scale first (dx^ = scale dx~).
template <class T>
void delta_normalize_backward(const ConstMatrixRef<T>& x, const Vector<T>* inv, T scale,
                              Matrix<T>& dx) {
  using W = wide_t<T>;
  if (scale != T(1)) dx *= scale;
  if (!inv) return;
  for (Index t = 0; t < x.rows(); ++t) {
    const T iv = (*inv)(t);
    const W proj = static_cast<W>(x.row(t).dot(dx.row(t))) * static_cast<W>(iv);
    dx.row(t) = (dx.row(t) - static_cast<T>(proj) * iv * x.row(t)) * iv;
  }
}

/// The gradients of a continued call's start state into grad.state (else empty), and the
/// finiteness of every gradient (check_finite).
template <class T>
void delta_finish_gradients(const char* fn, delta::Grad<T>& grad, const delta::Saved<T>& saved,
                            const delta::Options& opt, const Matrix<wide_t<T>>& dS0) {
  if (saved.continued) {
    grad.state.S = dS0;
    grad.state.state_fingerprint = saved.fingerprint.start_state;
  } else {
    grad.state.S.resize(0, 0);
    grad.state.state_fingerprint = 0;
  }
  if (!opt.check_finite) return;
  const char* culprit = "q, k, v, grad_out or the state is";
  require_finite_result(grad.q, fn, "the gradient of q", culprit);
  require_finite_result(grad.k, fn, "the gradient of k", culprit);
  require_finite_result(grad.v, fn, "the gradient of v", culprit);
  require_finite_result(grad.g, fn, "the gradient of g", culprit);
  require_finite_result(grad.beta, fn, "the gradient of beta", culprit);
  require_finite_result(grad.state.S, fn, "the gradient of the start state", culprit);
}

/// backward's body (SPEC 9.3; `fn` names the entry point in messages): validation once, the
/// chunks' start states (kept by the forward or recomputed), the reverse sweep, then the
/// gradients through the scale and the normalisation.
template <class T>
void delta_backward_into(const char* fn, delta::Grad<T>& grad, const ConstMatrixRef<T>& q,
                         const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                         const ConstVectorRef<T>& g, const ConstVectorRef<T>& beta,
                         const ConstMatrixRef<T>& grad_out, const delta::Saved<T>& saved,
                         const delta::Options& opt, const delta::StateGrad<T>* grad_state_out) {
  const DeltaInputs<T> in{q, k, v, g, beta};
  delta_check_backward<T>(fn, in, grad_out, saved, opt, grad_state_out);
  const Index N = q.rows(), dk = q.cols(), dv = v.cols();
  const DeltaConfig cfg = delta_config(opt, dk);
  DeltaScratch<T>& s = grad.scratch;
  if (grad_state_out)
    s.dsw = grad_state_out->S;  // first: it may be grad.state itself
  else
    s.dsw.setZero(dk, dv);
  grad.q.resize(N, dk);
  grad.k.resize(N, dk);
  grad.v.resize(N, dv);
  grad.g.resize(N);
  grad.beta.resize(N);
  if (N > 0) {
    const Matrix<T>* states = &saved.states;
    if (!saved.keep_states) {
      delta_size_chunk_buffers<T>(s, std::min(cfg.chunk, N), dk, dv);
      if (saved.continued)
        s.sw = saved.start_S;
      else
        s.sw.setZero(dk, dv);
      delta_recompute_states<T>(in, cfg, saved.inv_norm_q, saved.inv_norm_k, saved.delta, s.states,
                                s);
      states = &s.states;
    }
    delta_backward_sweep<T>(in, cfg, saved.inv_norm_q, saved.inv_norm_k, grad_out, saved.delta,
                            *states, grad, s);
    delta_normalize_backward<T>(q, cfg.normalize ? &saved.inv_norm_q : nullptr,
                                static_cast<T>(cfg.scale), grad.q);
    delta_normalize_backward<T>(k, cfg.normalize ? &saved.inv_norm_k : nullptr, T(1), grad.k);
  }
  delta_finish_gradients<T>(fn, grad, saved, opt, s.dsw);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
