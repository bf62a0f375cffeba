// mixattn/detail/common/checks.hpp — the argument checks every operator shares: the q, k, v shapes,
// the causal scan's options, the finiteness of inputs and results (probes that cost a fraction
// of a read).
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <Eigen/Core>

#include <cmath>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// The shapes every q, k, v operator without its own dimension needs (reference::, linear::):
/// r = q.cols() >= 1, k with r columns, v with k's rows, and at least one key for any query.
template <class T>
void check_qkv_shapes(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v) {
  require(q.cols() > 0, fn,
          "q has 0 columns: the key dimension r must be at least 1 (q: ", shape_str(q), ")");
  require(k.cols() == q.cols(), fn, "k has ", k.cols(), " columns but q has ", q.cols(),
          " (q: ", shape_str(q), ", k: ", shape_str(k), ")");
  require(v.rows() == k.rows(), fn, "v has ", v.rows(), " rows but k has ", k.rows(),
          " (k: ", shape_str(k), ", v: ", shape_str(v), ")");
  require(!(q.rows() > 0 && k.rows() == 0), fn, "k has 0 rows but q has ", q.rows(),
          ": every query needs at least one key (q: ", shape_str(q), ", k: ", shape_str(k), ")");
}

/// The options of every operator on the causal scan (GMA, linear attention, Performer, VQ): a
/// causal call's shapes (as many queries as keys), eps, chunk.
template <class T>
void check_scan_options(const char* fn, Index queries, Index keys, bool causal, double eps,
                        Index chunk) {
  require(!causal || queries == keys, fn, "causal needs as many queries as keys, but q has ",
          queries, " rows and k has ", keys);
  // eps is applied in T: one that rounds to 0 there (1e-300 in float) would let 0 / 0 through.
  require(eps > 0 && std::isfinite(eps) && static_cast<T>(eps) > T(0) &&
              std::isfinite(static_cast<T>(eps)),
          fn, "options.eps is ", eps, "; it must be positive and finite in the scalar type");
  require(chunk >= 0, fn, "options.chunk is ", chunk, "; it must be >= 0 (0: default)");
}

/// The sum of x * 0 over n contiguous scalars: 0 when every one is finite, NaN otherwise (inf * 0
/// and NaN are NaN), in 32 independent sums (x * 0 + acc, exact, each one FMA where the compiler
/// fuses them), where Eigen's sum has two: over a decoding step's K x d_v state (AVX2, K = d_v =
/// 64) its latency chain took 30% of the step.
template <class S>
inline S finite_probe(const S* x, Index n) {
  constexpr int L = 32;
  S acc[L] = {};
  Index i = 0;
  for (; i + L <= n; i += L)
    for (int j = 0; j < L; ++j) acc[j] += x[i + j] * S(0);
  for (; i < n; ++i) acc[0] += x[i] * S(0);
  S probe = S(0);
  for (int j = 0; j < L; ++j) probe += acc[j];
  return probe;
}

/// finite_probe over every entry of x: in one finite_probe(const S*, Index) when its entries are
/// contiguous (a plain matrix, a block of whole rows of a row-major one, a contiguous map), else
/// row by row with Eigen's sums so that any outer stride works. Probes of blocks add up to the
/// probe of their union.
template <class Derived>
inline typename Derived::Scalar finite_probe(const Eigen::DenseBase<Derived>& x) {
  using S = typename Derived::Scalar;
  const Derived& d = x.derived();
  if constexpr (bool(Derived::Flags & Eigen::DirectAccessBit)) {
    if (d.innerStride() == 1 && (d.outerStride() == d.innerSize() || d.outerSize() <= 1))
      return finite_probe(d.data(), d.size());
  }
  S probe = S(0);
  for (Index i = 0; i < d.rows(); ++i) probe += (d.row(i).array() * S(0)).sum();
  return probe;
}

/// Throws std::domain_error naming `arg` when any entry of `x` is NaN or infinite.
template <class Derived>
inline void require_finite(const Eigen::DenseBase<Derived>& x, const char* fn, const char* arg) {
  // Fast path: finite_probe (x * 0 is 0 for finite x and NaN otherwise). The locating scan below
  // runs only when something is wrong.
  using S = typename Derived::Scalar;
  if (finite_probe(x) == S(0)) return;
  const Index rows = x.rows(), cols = x.cols();
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j)
      if (!std::isfinite(static_cast<double>(x(i, j))))
        raise_domain_error(concat(fn, ": ", arg, " has a non-finite entry at (", i, ", ", j,
                                  ") of ", rows, " x ", cols));
}

/// q, k and v finite, checked in that order.
template <class T>
void require_finite_qkv(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                        const ConstMatrixRef<T>& v) {
  require_finite(q, fn, "q");
  require_finite(k, fn, "k");
  require_finite(v, fn, "v");
}

/// "float" or "double", for messages.
template <class S>
const char* scalar_name() {
  return std::is_same<S, float>::value ? "float" : "double";
}

/// Whether every entry of x is finite.
template <class Derived>
inline bool all_finite(const Eigen::DenseBase<Derived>& x) {
  return finite_probe(x) == typename Derived::Scalar(0);
}

/// With checks on, a result that is not finite although every input was finite overflowed the
/// scalar type: throw std::domain_error naming the result and the way out, never return it.
template <class Derived>
inline void require_finite_result(const Eigen::DenseBase<Derived>& x, const char* fn,
                                  const char* what, const char* culprit) {
  using S = typename Derived::Scalar;
  if (all_finite(x)) return;
  raise_domain_error(concat(fn, ": ", what, " overflows ", scalar_name<S>(),
                            " although every input is finite: ", culprit,
                            " too large for the scalar type (scale it down or use double)"));
}

}  // namespace detail
MIXATTN_END_NAMESPACE
