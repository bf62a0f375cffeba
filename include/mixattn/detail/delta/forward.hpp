// mixattn/detail/delta/forward.hpp — the gated delta rule's forward (SPEC.md §9.1, 9.2): the
// chunked sweep (one chunk's state-dependent products after delta_prepare_chunk) and the
// token-by-token recurrence on the wide state (decoding).
//
// Internal: included by mixattn/delta.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/delta_types.hpp"
#include "mixattn/detail/delta/chunk.hpp"
#include "mixattn/detail/gemm.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// The state-dependent part of one chunk (SPEC 9.2), after delta_prepare_chunk: with S the
/// chunk's start state (s.s in T, s.sw wide),
///   [U | W] = T [diag(beta) V | diag(beta e^gamma) K],  Delta = U - W S,
///   O = diag(e^gamma) Q S + P Delta,  S' = e^gamma_C S + (diag(e^(gamma_C - gamma)) K)^T Delta.
/// Writes Delta (n x d_v) and the output rows (n x d_v); advances s.sw and s.s to S'.
template <class T>
void delta_chunk_forward(const DeltaInputs<T>& in, Index c0, Index n, MatrixRef<T> delta,
                         MatrixRef<T> out, DeltaScratch<T>& s) {
  const Index dk = in.k.cols(), dv = in.v.cols();
  const auto beta = in.beta.segment(c0, n).array();
  s.rhs.topRows(n).leftCols(dv).array() = in.v.middleRows(c0, n).array().colwise() * beta;
  s.w.head(n).array() = beta * s.eg.head(n).array();
  s.rhs.topRows(n).rightCols(dk).array() =
      s.qk.middleRows(n, n).array().colwise() * s.w.head(n).array();
  const ConstMatrixRef<T> tri = s.tri.topLeftCorner(n, n);
  product_into<T>(delta, plain<T>(tri), plain<T>(s.rhs.topRows(n).leftCols(dv)), T(1), false,
                  s.gemm);  // U
  product_into<T>(s.lhs.topRows(n), plain<T>(tri), plain<T>(s.rhs.topRows(n).rightCols(dk)), T(1),
                  false, s.gemm);  // W
  s.lhs.middleRows(n, n).array() = s.qk.topRows(n).array().colwise() * s.eg.head(n).array();
  product_into<T>(s.y.topRows(2 * n), plain<T>(s.lhs.topRows(2 * n)), plain<T>(s.s), T(1), false,
                  s.gemm);  // [W S; diag(e^gamma) Q S]
  delta -= s.y.topRows(n);
  out = s.y.middleRows(n, n);
  product_into<T>(out, plain<T>(s.prod.topLeftCorner(n, n)), plain<T>(delta), T(1), true, s.gemm);
  delta_advance_state<T>(delta, n, s);
}

/// The chunked forward over rows [0, N) from the wide start state s.sw (sized d_k x d_v by the
/// caller): outputs into out (N x d_v), Delta into delta (N x d_v) when given (a record), else
/// chunk by chunk into s.u; with `states`, every chunk's start state (keep_states). Ends with the
/// end state in s.sw.
template <class T>
void delta_forward_sweep(const DeltaInputs<T>& in, const DeltaConfig& cfg, const Vector<T>& inv_q,
                         const Vector<T>& inv_k, Matrix<T>& out, Matrix<T>* delta,
                         Matrix<T>* states, DeltaScratch<T>& s) {
  const Index N = in.q.rows(), dk = in.q.cols(), dv = in.v.cols();
  const Index C = std::min(cfg.chunk, N);
  delta_size_chunk_buffers<T>(s, C, dk, dv);
  s.rhs.resize(C, dv + dk);
  s.lhs.resize(2 * C, dk);
  s.y.resize(2 * C, dv);
  if (!delta) s.u.resize(C, dv);
  if (states) states->resize(((N + C - 1) / C) * dk, dv);
  s.s = s.sw.template cast<T>();
  for (Index c0 = 0, c = 0; c0 < N; c0 += C, ++c) {
    const Index n = std::min(C, N - c0);
    delta_prepare_chunk<T>(in, cfg, inv_q, inv_k, c0, n, s);
    if (states) states->middleRows(c * dk, dk) = s.s;
    MatrixRef<T> d = delta ? MatrixRef<T>(delta->middleRows(c0, n)) : MatrixRef<T>(s.u.topRows(n));
    delta_chunk_forward<T>(in, c0, n, d, out.middleRows(c0, n), s);
  }
}

/// The recurrence (SPEC 9.1, (9.1)) token by token on the wide state S (d_k x d_v), in place:
/// per token one read of S for S^T [k^ q~] and one update S = alpha S + k^ delta^T. For short
/// pieces without a record (decoding); `kq` (2 x d_k) and `ab` (2 x d_v) are wide scratch.
template <class T>
void delta_recurrent_forward(const DeltaInputs<T>& in, const DeltaConfig& cfg, Matrix<T>& out,
                             Matrix<wide_t<T>>& S, Matrix<wide_t<T>>& kq, Matrix<wide_t<T>>& ab) {
  using W = wide_t<T>;
  const Index N = in.q.rows(), dk = in.q.cols(), dv = in.v.cols();
  kq.resize(2, dk);
  ab.resize(2, dv);
  for (Index t = 0; t < N; ++t) {
    kq.row(0) = in.k.row(t).template cast<W>();
    kq.row(1) = in.q.row(t).template cast<W>();
    W sk = static_cast<W>(cfg.scale), kk = 1;
    if (cfg.normalize) {
      const W eps = static_cast<W>(cfg.norm_eps);
      kk = W(1) / std::sqrt(static_cast<W>(kq.row(0).squaredNorm()) + eps);
      sk *= W(1) / std::sqrt(static_cast<W>(kq.row(1).squaredNorm()) + eps);
    }
    kq.row(0) *= kk;
    kq.row(1) *= sk;
    ab.noalias() = kq * S;  // [S^T k^; S^T q~] as rows
    const W alpha = std::exp(static_cast<W>(in.g(t))), b = static_cast<W>(in.beta(t));
    const W kdotq = kq.row(0).dot(kq.row(1));
    // delta = beta (v - alpha S^T k^) in ab's first row; o = alpha S^T q~ + (k^ . q~) delta
    ab.row(0) = b * (in.v.row(t).template cast<W>() - alpha * ab.row(0));
    out.row(t) = (alpha * ab.row(1) + kdotq * ab.row(0)).template cast<T>();
    S *= alpha;
    S.noalias() += kq.row(0).transpose() * ab.row(0);
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
