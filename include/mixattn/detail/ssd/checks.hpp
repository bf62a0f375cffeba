// mixattn/detail/ssd/checks.hpp — the SSD layer's argument checks (SPEC.md §10.4): shapes,
// options, the values of A and the step, finiteness, the state, and the record a backward is
// given.
//
// Internal: included by mixattn/ssd.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/ssd/chunk.hpp"
#include "mixattn/ssd_types.hpp"

#include <cmath>
#include <cstdint>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
void ssd_check_options(const char* fn, const ssd::Options& opt) {
  require(opt.chunk >= 1, fn, "options.chunk is ", opt.chunk, "; it must be >= 1");
  require(std::isfinite(opt.dt_bias) &&
              std::abs(opt.dt_bias) < static_cast<double>(std::numeric_limits<T>::max()),
          fn, "options.dt_bias is ", opt.dt_bias, "; it must be finite in ", scalar_name<T>());
}

/// A <= 0, and without the softplus dt_t + dt_bias >= 0 (always: a_t <= 1 and Delta_t >= 0 are
/// what the chunked form's e^gamma <= 1 rests on); NaN passes these comparisons and is left to
/// the finiteness check.
template <class T>
void ssd_check_values(const char* fn, const SsdInputs<T>& in, const ssd::Options& opt) {
  if (in.A > T(0))
    raise_domain_error(concat(fn, ": A is ", in.A,
                              "; A must be <= 0 (a decay e^(Delta A) <= 1; Mamba2 uses "
                              "A = -exp(A_log))"));
  if (opt.dt_softplus) return;
  for (Index t = 0; t < in.dt.size(); ++t)
    if (ssd_step_input<T>(in.dt, t, opt.dt_bias) < wide_t<T>(0))
      raise_domain_error(concat(fn, ": dt + dt_bias is ", ssd_step_input<T>(in.dt, t, opt.dt_bias),
                                " at row ", t, " of ", in.dt.size(),
                                "; without the softplus (options.dt_softplus) the step must be "
                                ">= 0"));
}

/// Shapes, options and values of x (N x P), dt (N), A, B, C (N x S), D.
template <class T>
void ssd_check_inputs(const char* fn, const SsdInputs<T>& in, const ssd::Options& opt) {
  const Index N = in.x.rows();
  require(in.x.cols() > 0, fn,
          "x has 0 columns: the head dimension d_head must be at least 1 (x: ", shape_str(in.x),
          ")");
  require(in.dt.size() == N, fn, "dt has ", in.dt.size(), " entries but x has ", N, " rows");
  require(in.B.rows() == N && in.B.cols() > 0, fn, "B is ", shape_str(in.B), " but x has ", N,
          " rows: B must have ", N, " rows and at least 1 column (d_state)");
  require(in.C.rows() == N && in.C.cols() == in.B.cols(), fn, "C is ", shape_str(in.C),
          " but B is ", shape_str(in.B), ": C must be ", N, " x ", in.B.cols());
  ssd_check_options<T>(fn, opt);
  ssd_check_values<T>(fn, in, opt);
  if (!opt.check_finite) return;
  if (!std::isfinite(in.A)) raise_domain_error(concat(fn, ": A is ", in.A, "; it must be finite"));
  require_finite(in.x, fn, "x");
  require_finite(in.dt, fn, "dt");
  require_finite(in.B, fn, "B");
  require_finite(in.C, fn, "C");
  if (!std::isfinite(in.D)) raise_domain_error(concat(fn, ": D is ", in.D, "; it must be finite"));
}

/// The state's shape and count, and with `scan` its values.
template <class T>
void ssd_check_state(const char* fn, const ssd::State<T>& st, Index S, Index P, Index n,
                     bool scan) {
  require(st.h.rows() == S && st.h.cols() == P, fn, "state.h is ", shape_str(st.h), " but B has ",
          S, " columns and x has ", P, ": make it with State<T>::empty(", S, ", ", P, ")");
  require(st.tokens_seen >= 0 && n <= std::numeric_limits<Index>::max() - st.tokens_seen, fn,
          "state.tokens_seen is ", st.tokens_seen, "; with ", n,
          " more tokens it must stay in [0, max Index]");
  if (scan) require_finite(st.h, fn, "state.h");
}

template <class T>
void ssd_fingerprint_inputs(const SsdInputs<T>& in, typename ssd::Saved<T>::Fingerprints& f) {
  f.x = fingerprint(in.x);
  f.dt = fingerprint(in.dt);
  f.A = fingerprint(in.A);
  f.B = fingerprint(in.B);
  f.C = fingerprint(in.C);
  f.D = fingerprint(in.D);
}

/// dL/d(end state) is only meaningful for a forward that continued a State.
template <class T>
void ssd_check_state_grad(const char* fn, const ssd::Saved<T>& saved, const ssd::StateGrad<T>& gs,
                          Index S, Index P, bool check_finite) {
  require(saved.continued, fn,
          "grad_state_out is given but saved is from a forward without a State");
  require(gs.h.rows() == S && gs.h.cols() == P, fn, "grad_state_out.h is ", shape_str(gs.h),
          " but the state is ", S, " x ", P);
  if (check_finite) require_finite(gs.h, fn, "grad_state_out.h");
  if (gs.state_fingerprint != 0 && gs.state_fingerprint != saved.end_fingerprint)
    raise_invalid_argument(concat(
        fn,
        ": grad_state_out came from other data: it is the gradient of a state other than the "
        "one this piece's forward ended with (run the pieces' backwards in reverse order, "
        "each given its successor's grad.state)"));
}

/// Validates backward's arguments against the inputs and the record.
template <class T>
void ssd_check_backward(const char* fn, const SsdInputs<T>& in, const ConstMatrixRef<T>& grad_out,
                        const ssd::Saved<T>& saved, const ssd::Options& opt,
                        const ssd::StateGrad<T>* grad_state_out) {
  ssd_check_inputs<T>(fn, in, opt);
  const Index N = in.x.rows(), P = in.x.cols(), S = in.B.cols();
  require(grad_out.rows() == N && grad_out.cols() == P, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", N, " x ", P, " (the shape of x)");
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.valid, fn, "saved was not filled by forward");
  require(saved.step.size() == N, fn, "saved is for N = ", saved.step.size(),
          " but the inputs have N = ", N);
  require(saved.chunk == opt.chunk && saved.dt_bias == opt.dt_bias &&
              saved.dt_softplus == opt.dt_softplus && saved.keep_states == opt.keep_states,
          fn, "saved was made with chunk = ", saved.chunk, ", dt_bias = ", saved.dt_bias,
          ", dt_softplus = ", saved.dt_softplus, ", keep_states = ", saved.keep_states,
          " but the options give chunk = ", opt.chunk, ", dt_bias = ", opt.dt_bias,
          ", dt_softplus = ", opt.dt_softplus, ", keep_states = ", opt.keep_states);
  typename ssd::Saved<T>::Fingerprints now;
  ssd_fingerprint_inputs<T>(in, now);
  const typename ssd::Saved<T>::Fingerprints& kept = saved.fingerprint;
  check_record(fn, "saved",
               {{kept.x, now.x, "x"},
                {kept.dt, now.dt, "dt"},
                {kept.A, now.A, "A"},
                {kept.B, now.B, "B"},
                {kept.C, now.C, "C"},
                {kept.D, now.D, "D"},
                {kept.start_state, saved.continued ? fingerprint(saved.start_h) : 0,
                 "saved.start_h (the start state)"}});
  require(!saved.continued || (saved.start_h.rows() == S && saved.start_h.cols() == P), fn,
          "saved.start_h is ", shape_str(saved.start_h), " but the state is ", S, " x ", P);
  if (grad_state_out != nullptr)
    ssd_check_state_grad<T>(fn, saved, *grad_state_out, S, P, opt.check_finite);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
