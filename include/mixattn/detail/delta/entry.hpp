// mixattn/detail/delta/entry.hpp — the gated delta rule's value-returning forms: a fresh result,
// computed by the body the `_into` form runs, in working memory this thread lends
// (docs/operators.md, "Memory between calls"). The same shape as every operator's: one line per
// entry point in mixattn/delta.hpp.
//
// Internal: included by mixattn/delta.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/delta_types.hpp"
#include "mixattn/detail/value_form_scratch.hpp"

#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// A value-returning forward: `body(fn, out, inputs..., saved)`, the body of the `_into` form,
/// into a fresh output, with this thread's working memory lent to `saved` (when given).
template <class T, class Body, class... Inputs>
Matrix<T> delta_returned_forward(Body body, const char* fn, delta::Saved<T>* saved,
                                 Inputs&&... inputs) {
  Matrix<T> out;
  const LentScratch<DeltaScratch<T>> lent(saved ? &saved->scratch : nullptr);
  body(fn, out, std::forward<Inputs>(inputs)..., saved);
  return out;
}

/// A value-returning backward: `body(fn, grad, inputs...)`, the body of the `_into` form, into a
/// fresh Grad working in this thread's lent memory: the returned gradient carries none.
template <class T, class Body, class... Inputs>
delta::Grad<T> delta_returned_backward(Body body, const char* fn, Inputs&&... inputs) {
  delta::Grad<T> grad;
  {
    const LentScratch<DeltaScratch<T>> lent(&grad.scratch);
    body(fn, grad, std::forward<Inputs>(inputs)...);
  }
  return grad;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
