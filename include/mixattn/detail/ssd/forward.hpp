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
#include "mixattn/detail/ssd/kernels.hpp"
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
  ssd_triangular_product<T>(out, s.prod.topLeftCorner(n, n), false, s.u.topRows(n), true,
                            s.gemm);  // + P U
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

/// The recurrence (SPEC 10.1, (10.1)) token by token on the wide state, from `start` (S x P) into
/// `h` (sized here; the first token reads `start`, the later ones update `h` in place, so the
/// caller's state is read once and never copied): per token one pass over the state
/// (ssd_state_pass). For short pieces without a record (decoding); `rows` is wide scratch.
/// Returns 0 when the end state is finite (NaN otherwise).
template <class T>
wide_t<T> ssd_recurrent_forward(const SsdInputs<T>& in, const ssd::Options& opt, Matrix<T>& out,
                                const Matrix<wide_t<T>>& start, Matrix<wide_t<T>>& h,
                                Matrix<wide_t<T>>& rows) {
  using W = wide_t<T>;
  const Index N = in.x.rows(), P = in.x.cols(), S = in.B.cols();
  h.resize(S, P);
  rows.resize(4, std::max(S, P));  // b, c (S); u, y (P)
  W *b = rows.row(0).data(), *c = rows.row(1).data(), *u = rows.row(2).data();
  W* y = rows.row(3).data();
  const W A = static_cast<W>(in.A), D = static_cast<W>(in.D);
  W probe = 0;
  for (Index t = 0; t < N; ++t) {
    const W z = ssd_step_input<T>(in.dt, t, opt.dt_bias);
    const W step = static_cast<W>(static_cast<T>(opt.dt_softplus ? ssd_softplus(z) : z));
    for (Index i = 0; i < S; ++i) {
      b[i] = static_cast<W>(in.B(t, i));
      c[i] = static_cast<W>(in.C(t, i));
    }
    for (Index j = 0; j < P; ++j) u[j] = static_cast<W>(in.x(t, j)) * step;
    probe = ssd_state_pass<W>(t == 0 ? start.data() : h.data(), h.data(), S, P, std::exp(step * A),
                              b, c, u, y);
    for (Index j = 0; j < P; ++j) out(t, j) = static_cast<T>(y[j] + D * static_cast<W>(in.x(t, j)));
  }
  if (N == 0) {
    h = start;
    probe = finite_probe(h);
  }
  return probe;
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
  // The recurrence never writes the caller's state and probes the end state as it writes it: a
  // non-finite start state shows there (a h + b u is not finite), so it is scanned only then.
  const bool recurrent = !saved && state && N <= ssd_recurrent_rows;
  if (state) ssd_check_state<T>(fn, *state, S, P, N, opt.check_finite && !recurrent);
  if (saved) saved->valid = false;  // until this call has filled it
  SsdScratch<T>& s = saved ? saved->scratch : thread_scratch<SsdScratch<T>>();
  out.resize(N, P);
  bool end_checked = false;
  if (recurrent)
    end_checked = ssd_recurrent_forward<T>(in, opt, out, state->h, s.hw, s.rows) == 0;
  else if (state)
    s.hw = state->h;
  else
    s.hw.setZero(S, P);
  if (!recurrent && N > 0) {
    Vector<T>& step = saved ? saved->step : s.step;
    ssd_steps<T>(dt, opt, step);
    ssd_forward_sweep<T>(in, opt, step, out, saved && opt.keep_states ? &saved->states : nullptr,
                         s);
  }
  if (saved && N == 0) saved->step.resize(0);
  if (opt.check_finite) {
    if (recurrent && !end_checked) require_finite(state->h, fn, "state.h");
    require_finite_result(out, fn, "the output", "x, dt, B, C or the state is");
    if (state && !end_checked)
      require_finite_result(s.hw, fn, "the end state", "x, dt, B, C or the state is");
  }
  if (saved) ssd_fill_record<T>(*saved, in, opt, state, s.hw);
  if (state) {
    state->h.swap(s.hw);  // the end state, without a copy (s.hw: scratch from here on)
    state->tokens_seen += N;
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
