// mixattn/detail/value_form_scratch.hpp — the working memory the value-returning forms borrow:
// one per thread and scratch type (docs/operators.md, "Memory between calls").
//
// Internal.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// The working memory of the value-returning forms (forward, backward): one per thread and
/// scratch type, kept for the thread's lifetime and holding the buffers of the last call that
/// used it. The `_into` forms use their records'.
template <class Scratch>
Scratch& value_form_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

/// Lends this thread's value_form_scratch to a record's scratch (none when null) for one call
/// and takes it back when it goes out of scope (on a throw too), leaving the record's own
/// scratch as it was: a repeated value-returning call reuses warm working memory instead of
/// page-faulting fresh multi-megabyte buffers (glibc maps them from the OS and unmaps them on
/// free). Lends nest (each takes back what it lent, in reverse order).
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
    if (slot_ != nullptr) swap(*slot_, value_form_scratch<Scratch>());
  }
  Scratch* slot_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
