// mixattn/detail/reference/checks.hpp — softmax attention's argument and record checks, shared by
// the naive and tiled forms and by decoding.
//
// Internal: part of mixattn/reference.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/reference_types.hpp"

#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Validates q, k, v and the options (once, at the API boundary); returns the resolved scale.
template <class T>
double reference_check_inputs(const char* fn, const ConstMatrixRef<T>& q,
                              const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                              const reference::Options& opt) {
  check_qkv_shapes<T>(fn, q, k, v);
  require(!opt.causal || q.rows() == k.rows(), fn, "causal attention needs as many keys as ",
          "queries, but q has ", q.rows(), " rows and k has ", k.rows());
  require(std::isfinite(opt.scale), fn, "options.scale is ", opt.scale, ", not finite");
  require(opt.window >= 0, fn, "options.window is ", opt.window, ", must be >= 0 (0: no window)");
  require(opt.window == 0 || opt.causal, fn, "options.window is ", opt.window,
          ": a sliding window needs options.causal = true");
  if (opt.check_finite) {
    require_finite(q, fn, "q");
    require_finite(k, fn, "k");
    require_finite(v, fn, "v");
  }
  return opt.scale != 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(q.cols()));
}

/// Validates grad_out and the Saved record against the inputs; returns the resolved scale.
template <class T>
double reference_check_backward(const char* fn, const ConstMatrixRef<T>& q,
                                const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                                const ConstMatrixRef<T>& grad_out, const reference::Saved<T>& saved,
                                const reference::Options& opt,
                                typename reference::Saved<T>::Source expected,
                                const char* forward_name) {
  const double scale = reference_check_inputs<T>(fn, q, k, v, opt);
  require(grad_out.rows() == q.rows() && grad_out.cols() == v.cols(), fn, "grad_out is ",
          shape_str(grad_out), " but the output is ", q.rows(), " x ", v.cols(),
          " (q rows x v columns)");
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.source == expected, fn, "saved was not filled by ", forward_name,
          saved.source == reference::Saved<T>::Source::none ? " (it is empty)"
                                                            : " (it comes from the other forward)");
  require(saved.queries == q.rows() && saved.keys == k.rows() && saved.value_dim == v.cols(), fn,
          "saved is for ", saved.queries, " queries, ", saved.keys,
          " keys and d_v = ", saved.value_dim, " but q has ", q.rows(), " rows, k has ", k.rows(),
          " rows and v has ", v.cols(), " columns");
  require(saved.causal == opt.causal && saved.scale == scale, fn,
          "saved was made with causal = ", saved.causal, ", scale = ", saved.scale,
          " but options give causal = ", opt.causal, ", scale = ", scale);
  require(saved.window == opt.window, fn, "saved was made with window = ", saved.window,
          " but options give window = ", opt.window);
  check_record(fn, "saved",
               {{saved.fingerprint[0], fingerprint(q), "q"},
                {saved.fingerprint[1], fingerprint(k), "k"},
                {saved.fingerprint[2], fingerprint(v), "v"}});
  return scale;
}

template <class T>
void reference_record(reference::Saved<T>& saved, typename reference::Saved<T>::Source source,
                      const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v, const reference::Options& opt, double scale) {
  saved.source = source;
  saved.queries = q.rows();
  saved.keys = k.rows();
  saved.value_dim = v.cols();
  saved.causal = opt.causal;
  saved.scale = scale;
  saved.window = opt.window;
  saved.fingerprint[0] = fingerprint(q);
  saved.fingerprint[1] = fingerprint(k);
  saved.fingerprint[2] = fingerprint(v);
}

/// With checks on, gradients that overflow T are reported, never returned.
template <class T>
void reference_check_grad(const char* fn, const reference::Grad<T>& g,
                          const reference::Options& opt) {
  if (!opt.check_finite) return;
  const char* culprit = "q, k, v or grad_out is";
  require_finite_result(g.q, fn, "the gradient of q", culprit);
  require_finite_result(g.k, fn, "the gradient of k", culprit);
  require_finite_result(g.v, fn, "the gradient of v", culprit);
}

/// Logits this large overflow T: report it rather than return NaN.
template <class T>
void reference_check_output(const char* fn, const Matrix<T>& out, const reference::Options& opt) {
  if (opt.check_finite && !out.allFinite())
    raise_domain_error(
        concat(fn, ": the output is not finite although q, k, v are: scale * q . k overflows the ",
               "scalar type (lower options.scale or use double)"));
}

}  // namespace detail
MIXATTN_END_NAMESPACE
