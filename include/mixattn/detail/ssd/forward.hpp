// mixattn/detail/ssd/forward.hpp — the SSD layer's forward (SPEC.md §10.1, 10.2): the chunked
// sweep, the token-by-token recurrence on the wide state (decoding), and the body behind the
// entry points, ssd_forward_into.
//
// Internal: included by mixattn/ssd.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/ssd/checks.hpp"
#include "mixattn/detail/ssd/chunk.hpp"
#include "mixattn/ssd_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// One chunk of SPEC 10.2 after ssd_load_chunk and ssd_chunk_scores, with s.h the chunk's start
/// state H: Y = diag(e^gamma) C H + P U + D X into `out` (n x P); then H' into s.hw and s.h.
template <class T>
void ssd_chunk_forward(const SsdInputs<T>& in, Index c0, Index n, MatrixRef<T> out,
                       SsdScratch<T>& s) {
  ssd_product<T>(out, in.C.middleRows(c0, n), false, s.h, false, false, s.gemm);  // C H
  out.array().colwise() *= s.eg.head(n).array();
  ssd_product<T>(out, s.prod.topLeftCorner(n, n), false, s.u.topRows(n), false, true, s.gemm);
  out += in.D * in.x.middleRows(c0, n);
  ssd_advance_state<T>(in, c0, n, s);
}

/// The chunked forward over rows [0, N) from the wide start state s.hw (sized S x P by the
/// caller), with the steps in `step`: outputs into out (N x P); with `states`, every chunk's
/// start state (keep_states). Ends with the end state in s.hw.
template <class T>
void ssd_forward_sweep(const SsdInputs<T>& in, const ssd::Options& opt, const Vector<T>& step,
                       Matrix<T>& out, Matrix<T>* states, SsdScratch<T>& s) {
  const Index N = in.x.rows(), P = in.x.cols(), S = in.B.cols();
  const Index C = std::min(opt.chunk, N);
  ssd_size_chunk_buffers<T>(s, C, S, P);
  if (states) states->resize(((N + C - 1) / C) * S, P);
  s.h = s.hw.template cast<T>();
  for (Index c0 = 0, c = 0; c0 < N; c0 += C, ++c) {
    const Index n = std::min(C, N - c0);
    ssd_load_chunk<T>(in, step, c0, n, s);
    ssd_chunk_scores<T>(in, c0, n, s);
    if (states) states->middleRows(c * S, S) = s.h;
    ssd_chunk_forward<T>(in, c0, n, out.middleRows(c0, n), s);
  }
}

/// The recurrence (SPEC 10.1, (10.1)) token by token on the wide state h (S x P), in place: per
/// token one pass over h's rows, h_s = a h_s + B_ts u and y += C_ts h_s. For short pieces
/// without a record (decoding); `y` is wide scratch (P).
template <class T>
void ssd_recurrent_forward(const SsdInputs<T>& in, const ssd::Options& opt, Matrix<T>& out,
                           Matrix<wide_t<T>>& h, Vector<wide_t<T>>& y) {
  using W = wide_t<T>;
  const Index N = in.x.rows(), P = in.x.cols(), S = in.B.cols();
  y.resize(P);
  const W A = static_cast<W>(in.A), D = static_cast<W>(in.D);
  for (Index t = 0; t < N; ++t) {
    const W z = ssd_step_input<T>(in.dt, t, opt.dt_bias);
    const W step = static_cast<W>(static_cast<T>(opt.dt_softplus ? ssd_softplus(z) : z));
    const W a = std::exp(step * A);
    y.setZero();
    for (Index i = 0; i < S; ++i) {
      const W b = static_cast<W>(in.B(t, i)) * step, c = static_cast<W>(in.C(t, i));
      auto row = h.row(i).array();
      row = a * row + b * in.x.row(t).array().template cast<W>();
      y.array() += c * row.transpose();
    }
    out.row(t) = (y.array() + D * in.x.row(t).transpose().array().template cast<W>())
                     .template cast<T>()
                     .transpose();
  }
}

/// Pieces of up to this many rows continuing a State without a record run the recurrence token
/// by token on the wide state (SPEC 10.2) instead of the chunked form.
constexpr Index ssd_recurrent_rows = 16;

/// Completes a record after its forward (SPEC 10.4): the options, the fingerprints of the inputs
/// and of the start state, and, for a continued call, the start state and the end state's
/// fingerprint (`end`: the end state).
template <class T>
void ssd_fill_record(ssd::Saved<T>& rec, const SsdInputs<T>& in, const ssd::Options& opt,
                     const ssd::State<T>* state, const Matrix<wide_t<T>>& end) {
  if (!opt.keep_states) rec.states.resize(0, in.x.cols());
  rec.chunk = opt.chunk;
  rec.dt_bias = opt.dt_bias;
  rec.dt_softplus = opt.dt_softplus;
  rec.keep_states = opt.keep_states;
  ssd_fingerprint_inputs<T>(in, rec.fingerprint);
  rec.continued = state != nullptr;
  if (state) {
    rec.start_h = state->h;
    rec.fingerprint.start_state = fingerprint(rec.start_h);
    rec.end_fingerprint = fingerprint(end);
  } else {
    rec.start_h.resize(0, 0);
    rec.fingerprint.start_state = 0;
    rec.end_fingerprint = 0;
  }
  rec.valid = true;
}

/// forward's body (SPEC 10.1, 10.2; `fn` names the entry point in messages): validation once,
/// then the token-by-token recurrence (a short continued piece without a record: decoding) or
/// the chunked sweep; the record completed, the state advanced last (untouched on a throw).
template <class T>
void ssd_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& x,
                      const ConstVectorRef<T>& dt, T A, const ConstMatrixRef<T>& B,
                      const ConstMatrixRef<T>& C, T D, const ssd::Options& opt,
                      ssd::State<T>* state, ssd::Saved<T>* saved) {
  const SsdInputs<T> in{x, dt, A, B, C, D};
  ssd_check_inputs<T>(fn, in, opt);
  const Index N = x.rows(), P = x.cols(), S = B.cols();
  if (state) ssd_check_state<T>(fn, *state, S, P, N, opt);
  if (saved) saved->valid = false;  // until this call has filled it
  SsdScratch<T>& s = saved ? saved->scratch : thread_scratch<SsdScratch<T>>();
  out.resize(N, P);
  if (state)
    s.hw = state->h;
  else
    s.hw.setZero(S, P);
  if (!saved && state && N <= ssd_recurrent_rows) {
    ssd_recurrent_forward<T>(in, opt, out, s.hw, s.dgamma);
  } else if (N > 0) {
    Vector<T>& step = saved ? saved->step : s.step;
    ssd_steps<T>(dt, opt, step);
    ssd_forward_sweep<T>(in, opt, step, out, saved && opt.keep_states ? &saved->states : nullptr,
                         s);
  }
  if (saved && N == 0) saved->step.resize(0);
  if (opt.check_finite) {
    require_finite_result(out, fn, "the output", "x, dt, B, C or the state is");
    if (state) require_finite_result(s.hw, fn, "the end state", "x, dt, B, C or the state is");
  }
  if (saved) ssd_fill_record<T>(*saved, in, opt, state, s.hw);
  if (state) {
    state->h = s.hw;
    state->tokens_seen += N;
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
