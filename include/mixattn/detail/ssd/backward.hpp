// mixattn/detail/ssd/backward.hpp — the SSD layer's backward (SPEC.md §10.3): the chunks' start
// states (kept or recomputed), one chunk's gradients, the reverse sweep, and the body behind the
// entry points, ssd_backward_into.
//
// Internal: included by mixattn/ssd.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/ssd/checks.hpp"
#include "mixattn/detail/ssd/chunk.hpp"
#include "mixattn/ssd_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Every chunk's start state into `states` (rows [c S, (c + 1) S) for chunk c), recomputed from
/// the inputs by the state line of SPEC 10.2 from the wide start state in s.hw, with the
/// forward's own operations (ssd_advance_state): the same bits as the forward's.
template <class T>
void ssd_recompute_states(const SsdInputs<T>& in, const ssd::Options& opt, const Vector<T>& step,
                          Matrix<T>& states, SsdScratch<T>& s) {
  const Index N = in.x.rows(), S = in.B.cols();
  const Index C = std::min(opt.chunk, N);
  states.resize(((N + C - 1) / C) * S, in.x.cols());
  for (Index c0 = 0, c = 0; c0 < N; c0 += C, ++c) {
    const Index n = std::min(C, N - c0);
    states.middleRows(c * S, S) = s.hw.template cast<T>();
    if (c0 + n == N) break;  // the end state is not needed
    ssd_load_chunk<T>(in, step, c0, n, s);
    ssd_advance_state<T>(in, c0, n, s);
  }
}

/// The products of one chunk's backward (SPEC 10.3), after ssd_load_chunk and ssd_chunk_scores,
/// with dH' in s.dh (T) and the chunk's start state H:
///   s.z = B dH',  s.du = dU = P^T dY + diag(e_d) s.z,  s.dp = dY U^T,  s.yh = dY H^T,
///   s.ud = U dH'^T,  s.dhu = (diag(e^gamma) C)^T dY.
template <class T>
void ssd_chunk_backward_products(const SsdInputs<T>& in, const ConstMatrixRef<T>& d_out,
                                 const ConstMatrixRef<T>& H, Index c0, Index n, SsdScratch<T>& s) {
  const ConstMatrixRef<T> U = s.u.topRows(n);
  ssd_product<T>(s.z.topRows(n), in.B.middleRows(c0, n), false, s.dh, false, false, s.gemm);
  ssd_triangular_product<T>(s.du.topRows(n), s.prod.topLeftCorner(n, n), true, d_out, false,
                            s.gemm);
  s.du.topRows(n) += (s.z.topRows(n).array().colwise() * s.ed.head(n).array()).matrix();
  ssd_lower_abt<T>(s.dp.topLeftCorner(n, n), d_out, U, s.gemm);
  ssd_product<T>(s.yh.topRows(n), d_out, false, H, true, false, s.gemm);
  ssd_product<T>(s.ud.topRows(n), U, false, s.dh, true, false, s.gemm);
  s.ce.topRows(n).array() = in.C.middleRows(c0, n).array().colwise() * s.eg.head(n).array();
  ssd_product<T>(s.dhu, s.ce.topRows(n), true, d_out, false, false, s.gemm);
}

/// The decay's gradient of one chunk (SPEC 10.3): dgamma from s.dp (dP, before its mask), P,
/// s.yh, s.z and U, and <H, dH'> for the [r = n] term; then dl (suffix sums), written with
/// x_r . dU_r into dstep (dDelta) rows [c0, c0 + n), and Delta dl added to dA.
template <class T>
void ssd_chunk_decay_grads(const SsdInputs<T>& in, const Vector<T>& step,
                           const ConstMatrixRef<T>& H, Index c0, Index n, SsdScratch<T>& s,
                           wide_t<T>& dA) {
  using W = wide_t<T>;
  auto& dgam = s.dgamma;
  dgam.head(n).setZero();
  W tail = 0;  // the [r = n] term's sum over j < n
  for (Index r = 0; r < n; ++r) {
    const W cy = static_cast<W>(s.eg(r)) * static_cast<W>(in.C.row(c0 + r).dot(s.yh.row(r)));
    const W uz = static_cast<W>(s.ed(r)) * static_cast<W>(s.u.row(r).dot(s.z.row(r)));
    const T* dp = s.dp.row(r).data();
    const T* p = s.prod.row(r).data();
    W mrow = 0;
    for (Index j = 0; j <= r; ++j) {
      const W m = static_cast<W>(dp[j]) * static_cast<W>(p[j]);
      mrow += m;
      dgam(j) -= m;
    }
    if (r + 1 < n) {  // at r = n the two uz terms cancel: left out, not rounded
      dgam(r) -= uz;
      tail += uz;
    }
    dgam(r) += mrow + cy;
  }
  const W hdh = (H.template cast<W>().array() * s.dh.template cast<W>().array()).sum();
  dgam(n - 1) += tail + std::exp(s.gamma(n - 1)) * hdh;
  const W A = static_cast<W>(in.A);
  W acc = 0;
  for (Index r = n - 1; r >= 0; --r) {
    acc += dgam(r);
    const W xdu = static_cast<W>(in.x.row(c0 + r).dot(s.du.row(r)));
    s.dstep(c0 + r) = xdu + A * acc;
    dA += static_cast<W>(step(c0 + r)) * acc;
  }
}

/// The rest of one chunk's backward: G = dP o L (in place on s.dp), then the rows of dC, dB and
/// dX, and the previous chunk's dH' into s.hw's twin s.dhw.
template <class T>
void ssd_chunk_input_grads(const SsdInputs<T>& in, const Vector<T>& step,
                           const ConstMatrixRef<T>& d_out, Index c0, Index n, SsdScratch<T>& s,
                           ssd::Grad<T>& grad) {
  using W = wide_t<T>;
  for (Index r = 0; r < n; ++r) {
    T* dp = s.dp.row(r).data();
    const T* l = s.decay.row(r).data();
    for (Index j = 0; j <= r; ++j) dp[j] *= l[j];
    std::fill(dp + r + 1, dp + n, T(0));
  }
  const ConstMatrixRef<T> G = s.dp.topLeftCorner(n, n);
  MatrixRef<T> dC = grad.C.middleRows(c0, n), dB = grad.B.middleRows(c0, n);
  ssd_triangular_product<T>(dC, G, false, in.B.middleRows(c0, n), false, s.gemm);
  dC += (s.yh.topRows(n).array().colwise() * s.eg.head(n).array()).matrix();
  ssd_triangular_product<T>(dB, G, true, in.C.middleRows(c0, n), false, s.gemm);
  dB += (s.ud.topRows(n).array().colwise() * s.ed.head(n).array()).matrix();
  grad.x.middleRows(c0, n) =
      (s.du.topRows(n).array().colwise() * step.segment(c0, n).array()).matrix() + in.D * d_out;
  s.dhw = std::exp(s.gamma(n - 1)) * s.dhw + s.dhu.template cast<W>();
}

/// The reverse sweep over the chunks: s.dhw holds dh_N on entry (sized S x P) and dh_0 on exit;
/// `states` every chunk's start state; dDelta into s.dstep, dA's sum into dA.
template <class T>
void ssd_backward_sweep(const SsdInputs<T>& in, const ssd::Options& opt, const Vector<T>& step,
                        const ConstMatrixRef<T>& grad_out, const Matrix<T>& states,
                        ssd::Grad<T>& grad, SsdScratch<T>& s, wide_t<T>& dA) {
  const Index N = in.x.rows(), P = in.x.cols(), S = in.B.cols();
  const Index C = std::min(opt.chunk, N);
  ssd_size_chunk_buffers<T>(s, C, S, P);
  s.du.resize(C, P);
  s.z.resize(C, P);
  s.dp.resize(C, C);
  s.yh.resize(C, S);
  s.ud.resize(C, S);
  s.ce.resize(C, S);
  s.dh.resize(S, P);
  s.dhu.resize(S, P);
  s.dgamma.resize(C);
  s.dstep.resize(N);
  const Index chunks = (N + C - 1) / C;
  for (Index c = chunks - 1; c >= 0; --c) {
    const Index c0 = c * C, n = std::min(C, N - c0);
    ssd_load_chunk<T>(in, step, c0, n, s);
    ssd_chunk_scores<T>(in, c0, n, s);
    s.dh = s.dhw.template cast<T>();
    const ConstMatrixRef<T> H = states.middleRows(c * S, S);
    const ConstMatrixRef<T> dY = grad_out.middleRows(c0, n);
    ssd_chunk_backward_products<T>(in, dY, H, c0, n, s);
    ssd_chunk_decay_grads<T>(in, step, H, c0, n, s, dA);
    ssd_chunk_input_grads<T>(in, step, dY, c0, n, s, grad);
  }
}

/// Through the step (SPEC 10.3): d dt_t = dDelta_t sigma(z_t) (or dDelta_t without the softplus),
/// d dt_bias their sum.
template <class T>
void ssd_step_backward(const SsdInputs<T>& in, const ssd::Options& opt, const SsdScratch<T>& s,
                       ssd::Grad<T>& grad) {
  using W = wide_t<T>;
  W sum = 0;
  for (Index t = 0; t < in.dt.size(); ++t) {
    W d = s.dstep(t);
    if (opt.dt_softplus) d *= ssd_sigmoid(ssd_step_input<T>(in.dt, t, opt.dt_bias));
    grad.dt(t) = static_cast<T>(d);
    sum += d;
  }
  grad.dt_bias = static_cast<T>(sum);
}

/// The gradient of a continued call's start state into grad.state (else empty), and the
/// finiteness of every gradient (check_finite).
template <class T>
void ssd_finish_gradients(const char* fn, ssd::Grad<T>& grad, const ssd::Saved<T>& saved,
                          const ssd::Options& opt, const Matrix<wide_t<T>>& dh0) {
  if (saved.continued) {
    grad.state.h = dh0;
    grad.state.state_fingerprint = saved.fingerprint.start_state;
  } else {
    grad.state.h.resize(0, 0);
    grad.state.state_fingerprint = 0;
  }
  if (!opt.check_finite) return;
  const char* culprit = "x, dt, B, C, grad_out or the state is";
  require_finite_result(grad.x, fn, "the gradient of x", culprit);
  require_finite_result(grad.dt, fn, "the gradient of dt", culprit);
  require_finite_result(grad.B, fn, "the gradient of B", culprit);
  require_finite_result(grad.C, fn, "the gradient of C", culprit);
  const Eigen::Matrix<T, 3, 1> scalars(grad.A, grad.D, grad.dt_bias);
  require_finite_result(scalars, fn, "the gradient of A, D or dt_bias", culprit);
  require_finite_result(grad.state.h, fn, "the gradient of the start state", culprit);
}

/// backward's body (SPEC 10.3; `fn` names the entry point in messages): validation once, the
/// chunks' start states (kept by the forward or recomputed), the reverse sweep, then the
/// gradients through the step.
template <class T>
void ssd_backward_into(const char* fn, ssd::Grad<T>& grad, const ConstMatrixRef<T>& x,
                       const ConstVectorRef<T>& dt, T A, const ConstMatrixRef<T>& B,
                       const ConstMatrixRef<T>& C, T D, const ConstMatrixRef<T>& grad_out,
                       const ssd::Saved<T>& saved, const ssd::Options& opt,
                       const ssd::StateGrad<T>* grad_state_out) {
  using W = wide_t<T>;
  const SsdInputs<T> in{x, dt, A, B, C, D};
  ssd_check_backward<T>(fn, in, grad_out, saved, opt, grad_state_out);
  const Index N = x.rows(), P = x.cols(), S = B.cols();
  SsdScratch<T>& s = grad.scratch;
  if (grad_state_out)
    s.dhw = grad_state_out->h;  // first: it may be grad.state itself
  else
    s.dhw.setZero(S, P);
  grad.x.resize(N, P);
  grad.B.resize(N, S);
  grad.C.resize(N, S);
  grad.dt.resize(N);
  W dA = 0;
  if (N > 0) {
    const Matrix<T>* states = &saved.states;
    if (!saved.keep_states) {
      ssd_size_chunk_buffers<T>(s, std::min(opt.chunk, N), S, P);
      if (saved.continued)
        s.hw = saved.start_h;
      else
        s.hw.setZero(S, P);
      ssd_recompute_states<T>(in, opt, saved.step, s.states, s);
      states = &s.states;
    }
    ssd_backward_sweep<T>(in, opt, saved.step, grad_out, *states, grad, s, dA);
  }
  s.dstep.resize(N);
  ssd_step_backward<T>(in, opt, s, grad);
  grad.A = static_cast<T>(dA);
  grad.D =
      static_cast<T>((grad_out.template cast<W>().array() * x.template cast<W>().array()).sum());
  ssd_finish_gradients<T>(fn, grad, saved, opt, s.dhw);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
