// mixattn/detail/delta/forward.hpp — the gated delta rule's forward (SPEC.md §9.1, 9.2): the
// chunked sweep (one chunk's state-dependent products after delta_prepare_chunk), the
// token-by-token recurrence on the wide state (decoding), and the body behind the entry points,
// delta_forward_into.
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
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/entry.hpp"

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
  const DeltaLhs<T> tri = delta_lhs<T>(s.tri.topLeftCorner(n, n), false, DeltaTri::lower);
  delta_product<T>(delta, tri, s.rhs.topRows(n).leftCols(dv), false, s.gemm);              // U
  delta_product<T>(s.lhs.topRows(n), tri, s.rhs.topRows(n).rightCols(dk), false, s.gemm);  // W
  s.lhs.middleRows(n, n).array() = s.qk.topRows(n).array().colwise() * s.eg.head(n).array();
  delta_product<T>(s.y.topRows(2 * n), delta_lhs<T>(s.lhs.topRows(2 * n), false), s.s, false,
                   s.gemm);  // [W S; diag(e^gamma) Q S]
  delta -= s.y.topRows(n);
  out = s.y.middleRows(n, n);
  delta_product<T>(out, delta_lhs<T>(s.prod.topLeftCorner(n, n), false, DeltaTri::lower), delta,
                   true, s.gemm);  // + P Delta
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

/// k^_t and q~_t (wide) into the rows `kr` and `qr` (SPEC 9.1).
template <class T>
void delta_token_rows(const DeltaInputs<T>& in, const DeltaConfig& cfg, Index t,
                      Eigen::Ref<Vector<wide_t<T>>> kr, Eigen::Ref<Vector<wide_t<T>>> qr) {
  using W = wide_t<T>;
  kr = in.k.row(t).transpose().template cast<W>();
  qr = in.q.row(t).transpose().template cast<W>();
  W sk = static_cast<W>(cfg.scale), kk = 1;
  if (cfg.normalize) {
    const W eps = static_cast<W>(cfg.norm_eps);
    kk = W(1) / std::sqrt(kr.squaredNorm() + eps);
    sk *= W(1) / std::sqrt(qr.squaredNorm() + eps);
  }
  kr *= kk;
  qr *= sk;
}

/// The recurrence (SPEC 9.1, (9.1)) token by token on the wide state (decoding): delta_t =
/// beta_t (v_t - alpha_t S^T k^_t), o_t = alpha_t S^T q~_t + (k^_t . q~_t) delta_t, S = alpha_t S +
/// k^_t delta_t^T. The first token reads `from` and every token writes `to` (d_k x d_v, sized
/// here), so `from` is left as it was: the caller swaps the two when the call succeeds, and a
/// token costs one read and one write of the state. For short pieces without a record; `rows` is
/// wide scratch. Returns whether `from` and every state written were finite.
template <class T>
DeltaDecodeFinite delta_recurrent_forward(const DeltaInputs<T>& in, const DeltaConfig& cfg,
                                          Matrix<T>& out, const Matrix<wide_t<T>>& from,
                                          Matrix<wide_t<T>>& to, Matrix<wide_t<T>>& rows) {
  using W = wide_t<T>;
  const Index N = in.q.rows(), dk = in.q.cols(), dv = in.v.cols(), ld = dv;
  to.resize(dk, dv);
  rows.resize(5, std::max(dk, dv));
  W* kr = rows.row(0).data();
  W* qr = rows.row(1).data();
  W* vr = rows.row(2).data();
  DeltaDecodeToken<W> tok{kr, qr, vr, W(0), W(0), W(0), rows.row(3).data(), rows.row(4).data()};
  DeltaDecodeFinite seen;
  for (Index t = 0; t < N; ++t) {
    delta_token_rows<T>(in, cfg, t, Eigen::Map<Vector<W>>(kr, dk), Eigen::Map<Vector<W>>(qr, dk));
    tok.kq = 0;
    for (Index i = 0; i < dk; ++i) tok.kq += kr[i] * qr[i];
    for (Index j = 0; j < dv; ++j) vr[j] = static_cast<W>(in.v(t, j));
    tok.alpha = std::exp(static_cast<W>(in.g(t)));
    tok.beta = static_cast<W>(in.beta(t));
    const DeltaDecodeFinite step =
        delta_decode_step<W>(t == 0 ? from.data() : to.data(), to.data(), dk, dv, ld, tok);
    if (t == 0) seen.read = step.read;
    seen.written = seen.written && step.written;
    for (Index j = 0; j < dv; ++j) out(t, j) = static_cast<T>(tok.o[j]);
  }
  return seen;
}

/// Continues `state` by a short piece without a record (decoding): the recurrence from state.S
/// into s.sw, the checks of the state read, the output and the state written, then the two
/// swapped (no copy; the state is untouched on a throw).
template <class T>
void delta_decode_into(const char* fn, const DeltaInputs<T>& in, const DeltaConfig& cfg,
                       bool check_finite, Matrix<T>& out, delta::State<T>& state,
                       DeltaScratch<T>& s) {
  const DeltaDecodeFinite seen = delta_recurrent_forward<T>(in, cfg, out, state.S, s.sw, s.rows);
  if (check_finite) {
    if (!seen.read) require_finite(state.S, fn, "state.S");
    require_finite_result(out, fn, "the output", "q, k, v or the state is");
    if (!seen.written) require_finite_result(s.sw, fn, "the end state", "q, k, v or the state is");
  }
  state.S.swap(s.sw);
  state.tokens_seen += in.q.rows();
}

/// Pieces of up to this many rows continuing a State without a record run the recurrence token
/// by token on the wide state (SPEC 9.1) instead of the chunked form.
constexpr Index delta_recurrent_rows = 16;

/// The chunked forward of a call (SPEC 9.2) from the start state in s.sw: the inverse norms and
/// Delta into the record when there is one (else into scratch), the outputs into out; leaves the
/// end state in s.sw.
template <class T>
void delta_forward_chunked(const DeltaInputs<T>& in, const DeltaConfig& cfg,
                           const delta::Options& opt, Matrix<T>& out, const delta::State<T>* state,
                           delta::Saved<T>* saved, DeltaScratch<T>& s) {
  const Index N = in.q.rows(), dv = in.v.cols();
  Vector<T>& inv_q = saved ? saved->inv_norm_q : s.inv_q;
  Vector<T>& inv_k = saved ? saved->inv_norm_k : s.inv_k;
  if (cfg.normalize) {
    delta_inverse_norms<T>(in.q, cfg.norm_eps, inv_q);
    delta_inverse_norms<T>(in.k, cfg.norm_eps, inv_k);
  } else {
    inv_q.resize(0);
    inv_k.resize(0);
  }
  if (saved) saved->delta.resize(N, dv);
  if (saved && state) saved->start_S = state->S;
  delta_forward_sweep<T>(in, cfg, inv_q, inv_k, out, saved ? &saved->delta : nullptr,
                         saved && opt.keep_states ? &saved->states : nullptr, s);
}

/// Completes a record after its forward (SPEC 9.4): the options, the fingerprints of the inputs
/// and of the start state, and, for a continued call, the start state and the end state's
/// fingerprint (`end`: the end state).
template <class T>
void delta_fill_record(delta::Saved<T>& rec, const DeltaInputs<T>& in, const DeltaConfig& cfg,
                       const delta::Options& opt, const delta::State<T>* state,
                       const Matrix<wide_t<T>>& end) {
  const Index N = in.q.rows();
  if (N == 0) rec.delta.resize(0, in.v.cols());
  if (N == 0 || !cfg.normalize) {
    rec.inv_norm_q.resize(cfg.normalize ? N : 0);
    rec.inv_norm_k.resize(cfg.normalize ? N : 0);
  }
  if (!opt.keep_states) rec.states.resize(0, in.v.cols());
  rec.chunk = cfg.chunk;
  rec.scale = cfg.scale;
  rec.normalize = cfg.normalize;
  rec.norm_eps = cfg.norm_eps;
  rec.keep_states = opt.keep_states;
  delta_fingerprint_inputs<T>(in, rec.fingerprint);
  rec.continued = state != nullptr;
  if (state) {
    if (N == 0) rec.start_S = state->S;
    rec.fingerprint.start_state = fingerprint(rec.start_S);
    rec.end_fingerprint = fingerprint(end);
  } else {
    rec.start_S.resize(0, 0);
    rec.fingerprint.start_state = 0;
    rec.end_fingerprint = 0;
  }
  rec.valid = true;
}

/// forward's body (SPEC 9.1, 9.2; `fn` names the entry point in messages): validation once, then
/// the token-by-token recurrence (a short continued piece without a record: decoding) or the
/// chunked sweep; the record completed, the state advanced last (untouched on a throw).
template <class T>
void delta_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                        const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                        const ConstVectorRef<T>& g, const ConstVectorRef<T>& beta,
                        const delta::Options& opt, delta::State<T>* state, delta::Saved<T>* saved) {
  const DeltaInputs<T> in{q, k, v, g, beta};
  delta_check_inputs<T>(fn, in, opt);
  const Index N = q.rows(), dk = q.cols(), dv = v.cols();
  // A short continued piece without a record (decoding) checks the state's finiteness in its
  // one read of it.
  const bool decode = !saved && state && N >= 1 && N <= delta_recurrent_rows;
  if (state) delta_check_state<T>(fn, *state, dk, dv, N, opt.check_finite && !decode);
  const DeltaConfig cfg = delta_config(opt, dk);
  if (saved) saved->valid = false;  // until this call has filled it
  DeltaScratch<T>& s = saved ? saved->scratch : thread_scratch<DeltaScratch<T>>();
  out.resize(N, dv);
  if (decode) return delta_decode_into<T>(fn, in, cfg, opt.check_finite, out, *state, s);
  if (state)
    s.sw = state->S;
  else
    s.sw.setZero(dk, dv);
  if (N > 0)
    delta_forward_chunked<T>(in, cfg, opt, out, state, saved, s);
  if (opt.check_finite) {
    require_finite_result(out, fn, "the output", "q, k, v or the state is");
    if (state) require_finite_result(s.sw, fn, "the end state", "q, k, v or the state is");
  }
  if (saved) delta_fill_record<T>(*saved, in, cfg, opt, state, s.sw);
  if (state) {
    state->S = s.sw;
    state->tokens_seen += N;
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
