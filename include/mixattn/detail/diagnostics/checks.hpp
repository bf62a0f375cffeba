// mixattn/detail/diagnostics/checks.hpp — what the diagnostics share: the check of a
// responsibility matrix, the entropy of a histogram, labels made dense (SPEC 1.7).
//
// Internal: part of mixattn/diagnostics.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Shared validation: Γ must be non-empty, finite and non-negative.
template <class T>
void check_responsibilities(const ConstMatrixRef<T>& gamma, const char* fn, const char* arg) {
  detail::require(gamma.rows() > 0 && gamma.cols() > 0, fn, arg,
                  " must have at least one row and one column, got ", detail::shape_str(gamma));
  detail::require_finite(gamma, fn, arg);
  detail::require(gamma.minCoeff() >= T(0), fn, arg, " has a negative entry (", gamma.minCoeff(),
                  "); responsibilities lie on the simplex");
}

/// Shannon entropy (nats) of a count histogram with total n; 0 log 0 = 0.
inline double entropy_of_counts(const std::vector<std::int64_t>& counts, double n) {
  double h = 0;
  for (std::int64_t c : counts)
    if (c > 0) {
      const double p = static_cast<double>(c) / n;
      h -= p * std::log(p);
    }
  return h;
}

/// Maps arbitrary integer labels to 0..L-1 (order of first sorted appearance); returns L.
template <class Label>
Index compact_labels(const std::vector<Label>& labels, std::vector<Index>& out) {
  std::vector<Label> sorted(labels);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  out.resize(labels.size());
  for (std::size_t i = 0; i < labels.size(); ++i)
    out[i] = static_cast<Index>(std::lower_bound(sorted.begin(), sorted.end(), labels[i]) -
                                sorted.begin());
  return static_cast<Index>(sorted.size());
}

}  // namespace detail
MIXATTN_END_NAMESPACE
