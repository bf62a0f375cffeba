// mixattn/detail/delta/checks.hpp — the gated delta rule's argument checks (SPEC.md §9.4): shapes,
// options, the values of g and beta, finiteness, the state, and the record a backward is given.
//
// Internal: included by mixattn/delta.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/delta_types.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/delta/chunk.hpp"
#include "mixattn/detail/common/fingerprint.hpp"

#include <cmath>
#include <cstdint>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
void delta_check_options(const char* fn, const delta::Options& opt) {
  require(opt.chunk >= 1, fn, "options.chunk is ", opt.chunk, "; it must be >= 1");
  require(std::isfinite(opt.scale) && opt.scale >= 0 &&
              static_cast<double>(static_cast<T>(opt.scale)) <
                  static_cast<double>(std::numeric_limits<T>::max()),
          fn, "options.scale is ", opt.scale, "; it must be finite in ", scalar_name<T>(),
          " and >= 0 (0: 1/sqrt(d_k))");
  require(std::isfinite(opt.norm_eps) && opt.norm_eps > 0 && static_cast<T>(opt.norm_eps) > T(0) &&
              static_cast<double>(static_cast<T>(opt.norm_eps)) <
                  static_cast<double>(std::numeric_limits<T>::max()),
          fn, "options.norm_eps is ", opt.norm_eps, "; it must be > 0 and finite in ",
          scalar_name<T>());
}

/// g_t <= 0 and 0 <= beta_t <= 1 (always: the chunked form's e^gamma <= 1 rests on them); NaN
/// passes these comparisons and is left to the finiteness check.
template <class T>
void delta_check_gates(const char* fn, const DeltaInputs<T>& in) {
  for (Index t = 0; t < in.g.size(); ++t)
    if (in.g(t) > T(0))
      raise_domain_error(concat(fn, ": g has ", in.g(t), " at row ", t, " of ", in.g.size(),
                                "; g is a log decay and must be <= 0"));
  for (Index t = 0; t < in.beta.size(); ++t)
    if (in.beta(t) < T(0) || in.beta(t) > T(1))
      raise_domain_error(concat(fn, ": beta has ", in.beta(t), " at row ", t, " of ",
                                in.beta.size(), "; beta must be in [0, 1]"));
}

/// Shapes, options and values of q, k (N x d_k), v (N x d_v), g, beta (N).
template <class T>
void delta_check_inputs(const char* fn, const DeltaInputs<T>& in, const delta::Options& opt) {
  const Index N = in.q.rows();
  require(in.q.cols() > 0, fn,
          "q has 0 columns: the key dimension d_k must be at least 1 (q: ", shape_str(in.q), ")");
  require(in.k.rows() == N && in.k.cols() == in.q.cols(), fn, "k is ", shape_str(in.k),
          " but q is ", shape_str(in.q), ": k must be ", N, " x ", in.q.cols());
  require(in.v.rows() == N && in.v.cols() > 0, fn, "v is ", shape_str(in.v), " but q has ", N,
          " rows: v must have ", N, " rows and at least 1 column");
  require(in.g.size() == N, fn, "g has ", in.g.size(), " entries but q has ", N, " rows");
  require(in.beta.size() == N, fn, "beta has ", in.beta.size(), " entries but q has ", N, " rows");
  delta_check_options<T>(fn, opt);
  delta_check_gates<T>(fn, in);
  if (!opt.check_finite) return;
  if (finite_probe(in.q) + finite_probe(in.k) + finite_probe(in.v) + finite_probe(in.g) +
          finite_probe(in.beta) ==
      T(0))
    return;
  require_finite(in.q, fn, "q");
  require_finite(in.k, fn, "k");
  require_finite(in.v, fn, "v");
  require_finite(in.g, fn, "g");
  require_finite(in.beta, fn, "beta");
}

template <class T>
void delta_check_state(const char* fn, const delta::State<T>& st, Index dk, Index dv, Index n,
                       bool check_finite) {
  require(st.S.rows() == dk && st.S.cols() == dv, fn, "state.S is ", shape_str(st.S), " but q has ",
          dk, " columns and v has ", dv, ": make it with State<T>::empty(", dk, ", ", dv, ")");
  require(st.tokens_seen >= 0 && n <= std::numeric_limits<Index>::max() - st.tokens_seen, fn,
          "state.tokens_seen is ", st.tokens_seen, "; with ", n,
          " more tokens it must stay in [0, max Index]");
  if (check_finite) require_finite(st.S, fn, "state.S");
}

template <class T>
void delta_fingerprint_inputs(const DeltaInputs<T>& in, typename delta::Saved<T>::Fingerprints& f) {
  f.q = fingerprint(in.q);
  f.k = fingerprint(in.k);
  f.v = fingerprint(in.v);
  f.g = fingerprint(in.g);
  f.beta = fingerprint(in.beta);
}

/// dL/d(end state) is only meaningful for a forward that continued a State.
template <class T>
void delta_check_state_grad(const char* fn, const delta::Saved<T>& saved,
                            const delta::StateGrad<T>& gs, Index dk, Index dv, bool check_finite) {
  require(saved.continued, fn,
          "grad_state_out is given but saved is from a forward without a State");
  require(gs.S.rows() == dk && gs.S.cols() == dv, fn, "grad_state_out.S is ", shape_str(gs.S),
          " but the state is ", dk, " x ", dv);
  if (check_finite) require_finite(gs.S, fn, "grad_state_out.S");
  if (gs.state_fingerprint != 0 && gs.state_fingerprint != saved.end_fingerprint)
    raise_invalid_argument(concat(
        fn,
        ": grad_state_out came from other data: it is the gradient of a state other than the "
        "one this piece's forward ended with (run the pieces' backwards in reverse order, "
        "each given its successor's grad.state)"));
}

/// Validates backward's arguments against the inputs and the record.
template <class T>
void delta_check_backward(const char* fn, const DeltaInputs<T>& in,
                          const ConstMatrixRef<T>& grad_out, const delta::Saved<T>& saved,
                          const delta::Options& opt, const delta::StateGrad<T>* grad_state_out) {
  delta_check_inputs<T>(fn, in, opt);
  const Index N = in.q.rows(), dk = in.q.cols(), dv = in.v.cols();
  require(grad_out.rows() == N && grad_out.cols() == dv, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", N, " x ", dv, " (q rows x v columns)");
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.valid, fn, "saved was not filled by forward");
  require(saved.delta.rows() == N && saved.delta.cols() == dv, fn,
          "saved is for N = ", saved.delta.rows(), ", d_v = ", saved.delta.cols(),
          " but the inputs have N = ", N, ", d_v = ", dv);
  const DeltaConfig cfg = delta_config(opt, dk);
  require(saved.chunk == cfg.chunk && saved.scale == cfg.scale &&
              saved.normalize == cfg.normalize && saved.norm_eps == cfg.norm_eps &&
              saved.keep_states == opt.keep_states,
          fn, "saved was made with chunk = ", saved.chunk, ", scale = ", saved.scale,
          ", normalize = ", saved.normalize, ", norm_eps = ", saved.norm_eps,
          ", keep_states = ", saved.keep_states, " but the options give chunk = ", cfg.chunk,
          ", scale = ", cfg.scale, ", normalize = ", cfg.normalize, ", norm_eps = ", cfg.norm_eps,
          ", keep_states = ", opt.keep_states);
  typename delta::Saved<T>::Fingerprints now;
  delta_fingerprint_inputs<T>(in, now);
  const typename delta::Saved<T>::Fingerprints& kept = saved.fingerprint;
  check_record(fn, "saved",
               {{kept.q, now.q, "q"},
                {kept.k, now.k, "k"},
                {kept.v, now.v, "v"},
                {kept.g, now.g, "g"},
                {kept.beta, now.beta, "beta"},
                {kept.start_state, saved.continued ? fingerprint(saved.start_S) : 0,
                 "saved.start_S (the start state)"}});
  require(!saved.continued || (saved.start_S.rows() == dk && saved.start_S.cols() == dv), fn,
          "saved.start_S is ", shape_str(saved.start_S), " but the state is ", dk, " x ", dv);
  if (grad_state_out != nullptr)
    delta_check_state_grad<T>(fn, saved, *grad_state_out, dk, dv, opt.check_finite);
}

/// The gates of a packed call: g and beta H x total (row h: head h's), read in place.
template <class T>
void delta_check_packed_gates(const char* fn, const ConstMatrixRef<T>& g,
                              const ConstMatrixRef<T>& beta, Index heads, Index total) {
  require(g.rows() == heads && g.cols() == total, fn, "g is ", shape_str(g), " but ", heads,
          " heads over ", total, " rows need ", heads, " x ", total, " (row h: head h's gates)");
  require(beta.rows() == heads && beta.cols() == total, fn, "beta is ", shape_str(beta), " but ",
          heads, " heads over ", total, " rows need ", heads, " x ", total,
          " (row h: head h's gates)");
}

}  // namespace detail
MIXATTN_END_NAMESPACE
