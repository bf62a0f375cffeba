// mixattn/detail/common/entry.hpp — what every operator's value-returning forms share: a fresh
// result, computed by the body the `_into` form runs, in working memory this thread lends
// (docs/operators.md, "Memory between calls").
//
// Internal.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <type_traits>
#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// One object of type X per thread and per Owner, kept for the thread's lifetime: the working
/// memory the value-returning forms lend, and the record of a forward that was given none. Two
/// bodies that keep the same type with buffers of different shapes name themselves as Owner
/// (the reference's naive and tiled forwards): sharing one object, each would reallocate what
/// the other had sized at every alternate call.
template <class X, class Owner = void>
X& thread_scratch() {
  thread_local X x;
  return x;
}

/// Lends this thread's thread_scratch to a record's scratch (none when null) for one call and
/// takes it back when it goes out of scope (on a throw too), leaving the record's own scratch as
/// it was: a repeated value-returning call reuses warm working memory instead of page-faulting
/// fresh multi-megabyte buffers (glibc maps them from the OS and unmaps them on free). Lends nest
/// (each takes back what it lent, in reverse order).
template <class Scratch>
class LentScratch {
 public:
  explicit LentScratch(Scratch* slot) : slot_(slot) { exchange(); }
  ~LentScratch() { exchange(); }
  LentScratch(const LentScratch&) = delete;
  LentScratch& operator=(const LentScratch&) = delete;

 private:
  void exchange() {
    using std::swap;
    if (slot_ != nullptr) swap(*slot_, thread_scratch<Scratch>());
  }
  Scratch* slot_;
};

template <class R, class = void>
struct wraps_record : std::false_type {};
template <class R>
struct wraps_record<R, std::void_t<decltype(std::declval<R&>().attn)>> : std::true_type {};

/// The working memory a record keeps: its `scratch`, or, for a record that wraps another
/// (Performer's and VQ's wrap linear attention's as `attn`), that one's.
template <class R>
auto& record_scratch(R& record) {
  if constexpr (wraps_record<R>::value)
    return record_scratch(record.attn);
  else
    return record.scratch;
}

/// An operator's value-returning forward: `body(fn, out, inputs..., saved)`, the body of its
/// `_into` form, into a fresh output, with this thread's working memory lent to `saved` (when
/// given) for the call.
template <class T, class Body, class Record, class... Inputs>
Matrix<T> returned_forward(Body body, const char* fn, Record* saved, Inputs&&... inputs) {
  Matrix<T> out;
  using Scratch = std::remove_reference_t<decltype(record_scratch(*saved))>;
  const LentScratch<Scratch> lent(saved ? &record_scratch(*saved) : nullptr);
  body(fn, out, std::forward<Inputs>(inputs)..., saved);
  return out;
}

/// An operator's value-returning backward: `body(fn, grad, inputs...)`, the body of its `_into`
/// form, into a fresh Grad working in this thread's lent memory: the returned gradient carries
/// none.
template <class Grad, class Body, class... Inputs>
Grad returned_backward(Body body, const char* fn, Inputs&&... inputs) {
  Grad grad;
  {
    const LentScratch<std::remove_reference_t<decltype(record_scratch(grad))>> lent(
        &record_scratch(grad));
    body(fn, grad, std::forward<Inputs>(inputs)...);
  }
  return grad;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
