// mixattn/detail/linformer/checks.hpp — Linformer's argument checks (SPEC.md §11.3): shapes of q,
// k, v and the projections E, F, the options, finiteness, and the record a backward is given.
//
// Internal: included by mixattn/linformer.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/linformer_types.hpp"

#include <cmath>
#include <cstddef>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// One call's inputs: q, k (N x d), v (N x d_v), E, F (k_proj x N).
template <class T>
struct LinformerInputs {
  const ConstMatrixRef<T>& q;
  const ConstMatrixRef<T>& k;
  const ConstMatrixRef<T>& v;
  const ConstMatrixRef<T>& E;
  const ConstMatrixRef<T>& F;
};

/// The scale applied: options.scale, or 1/sqrt(d) for 0.
inline double linformer_scale(const linformer::Options& opt, Index d) {
  return opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(d));
}

template <class T>
void linformer_check_options(const char* fn, const linformer::Options& opt) {
  require(!opt.causal, fn,
          "options.causal is true, but Linformer is bidirectional only: every projected key "
          "and value (rows of E k and F v) mixes all N positions, later ones included, so no "
          "mask can hide the future");
  require(std::isfinite(opt.scale) && opt.scale >= 0 &&
              static_cast<double>(static_cast<T>(opt.scale)) <
                  static_cast<double>(std::numeric_limits<T>::max()),
          fn, "options.scale is ", opt.scale, "; it must be finite in ", scalar_name<T>(),
          " and >= 0 (0: 1/sqrt(d))");
}

/// Shapes of q, k (N x d), v (N x d_v), E and F (k_proj x N, k_proj >= 1).
template <class T>
void linformer_check_shapes(const char* fn, const LinformerInputs<T>& in) {
  const Index N = in.q.rows();
  require(in.q.cols() > 0, fn,
          "q has 0 columns: the key dimension d must be at least 1 (q: ", shape_str(in.q), ")");
  require(in.k.rows() == N && in.k.cols() == in.q.cols(), fn, "k is ", shape_str(in.k),
          " but q is ", shape_str(in.q), ": k must be ", N, " x ", in.q.cols());
  require(in.v.rows() == N && in.v.cols() > 0, fn, "v is ", shape_str(in.v), " but q has ", N,
          " rows: v must have ", N, " rows and at least 1 column");
  require(in.E.rows() > 0, fn,
          "E has 0 rows: the projected length k_proj must be at least 1 (E: ", shape_str(in.E),
          ")");
  require(in.E.cols() == N, fn, "E has ", in.E.cols(), " columns but the sequence has length ", N,
          " (q, k, v rows): E and F project sequences of length ", in.E.cols(),
          " only (E: ", shape_str(in.E), ")");
  require(in.F.rows() == in.E.rows(), fn, "F has ", in.F.rows(), " rows but E has ", in.E.rows(),
          ": E and F must have the same k_proj (E: ", shape_str(in.E), ", F: ", shape_str(in.F),
          ")");
  require(in.F.cols() == N, fn, "F has ", in.F.cols(), " columns but the sequence has length ", N,
          " (q, k, v rows): E and F project sequences of length ", in.E.cols(),
          " only (F: ", shape_str(in.F), ")");
}

/// The finiteness of every input (in the order q, k, v, E, F), located when one is not.
template <class T>
void linformer_require_finite(const char* fn, const LinformerInputs<T>& in) {
  require_finite_qkv<T>(fn, in.q, in.k, in.v);
  require_finite(in.E, fn, "E");
  require_finite(in.F, fn, "F");
}

/// Shapes, options and, with check_finite, the finiteness of every input.
template <class T>
void linformer_check_inputs(const char* fn, const LinformerInputs<T>& in,
                            const linformer::Options& opt) {
  linformer_check_options<T>(fn, opt);
  linformer_check_shapes<T>(fn, in);
  if (!opt.check_finite) return;
  if (finite_probe(in.q) + finite_probe(in.k) + finite_probe(in.v) + finite_probe(in.E) +
          finite_probe(in.F) !=
      T(0))
    linformer_require_finite<T>(fn, in);
}

/// The fingerprints of q, k, v, E and F and, with `check`, their finiteness read off the same
/// pass (Fingerprint::add_checked): a record's inputs are read once, not once per purpose (E and
/// F alone are 2 k_proj N scalars).
template <class T>
void linformer_scan_inputs(const char* fn, const LinformerInputs<T>& in, bool check,
                           typename linformer::Saved<T>::Fingerprints& f) {
  bool fq = true, fk = true, fv = true, fE = true, fF = true;
  f.q = Fingerprint().add_checked(in.q, fq).value();
  f.k = Fingerprint().add_checked(in.k, fk).value();
  f.v = Fingerprint().add_checked(in.v, fv).value();
  f.E = Fingerprint().add_checked(in.E, fE).value();
  f.F = Fingerprint().add_checked(in.F, fF).value();
  if (check && !(fq && fk && fv && fE && fF)) linformer_require_finite<T>(fn, in);
}

/// Validates backward's arguments against the inputs and the record.
template <class T>
void linformer_check_backward(const char* fn, const LinformerInputs<T>& in,
                              const ConstMatrixRef<T>& grad_out, const linformer::Saved<T>& saved,
                              const linformer::Options& opt) {
  linformer_check_options<T>(fn, opt);
  linformer_check_shapes<T>(fn, in);
  typename linformer::Saved<T>::Fingerprints now;
  linformer_scan_inputs<T>(fn, in, opt.check_finite, now);
  const Index N = in.q.rows(), dv = in.v.cols(), kp = in.E.rows();
  require(grad_out.rows() == N && grad_out.cols() == dv, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", N, " x ", dv, " (q rows x v columns)");
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.valid, fn, "saved was not filled by forward");
  require(saved.probs.rows() == N && saved.probs.cols() == kp && saved.kp.cols() == in.q.cols() &&
              saved.vp.cols() == dv,
          fn, "saved is for N = ", saved.probs.rows(), ", k_proj = ", saved.probs.cols(),
          ", d = ", saved.kp.cols(), ", d_v = ", saved.vp.cols(), " but the inputs have N = ", N,
          ", k_proj = ", kp, ", d = ", in.q.cols(), ", d_v = ", dv);
  const double scale = linformer_scale(opt, in.q.cols());
  require(saved.scale == scale, fn, "saved was made with scale = ", saved.scale,
          " but the options give scale = ", scale);
  const typename linformer::Saved<T>::Fingerprints& kept = saved.fingerprint;
  check_record(fn, "saved",
               {{kept.q, now.q, "q"},
                {kept.k, now.k, "k"},
                {kept.v, now.v, "v"},
                {kept.E, now.E, "E"},
                {kept.F, now.F, "F"}});
}

/// The options and projections of a packed call, and its sequences: each must have E's length
/// (one E and F for every item).
template <class T>
void linformer_check_packed(const char* fn, const Offsets& offsets, const ConstMatrixRef<T>& E,
                            const ConstMatrixRef<T>& F, const linformer::Options& opt) {
  linformer_check_options<T>(fn, opt);
  require(E.rows() > 0 && F.rows() == E.rows() && F.cols() == E.cols(), fn, "E is ", shape_str(E),
          " and F is ", shape_str(F), ": both must be k_proj x N with the same k_proj >= 1");
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b)
    require(offsets[b + 1] - offsets[b] == E.cols(), fn, "sequence ", b, " has length ",
            offsets[b + 1] - offsets[b], " but E and F project sequences of length ", E.cols(),
            " only (E: ", shape_str(E), ")");
}

}  // namespace detail
MIXATTN_END_NAMESPACE
