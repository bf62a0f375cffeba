// mixattn/ovq_types.hpp — Online VQ attention's records: the options and state
// (mixattn/ovq_state.hpp), what forward saves for backward and the gradients, which keep the
// calls' working memory for reuse. The operations on them are in mixattn/ovq.hpp.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/ovq_state.hpp"

// After ovq_state.hpp: the working memory is built on the state it declares.
#include "mixattn/detail/ovq_scratch.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace ovq {

/// What forward keeps for backward. No dictionary snapshot per block: the state the call began
/// from plus every token's centroid assignment, from which backward replays the updates bit for
/// bit (checkpointing sqrt(#blocks) dictionaries while it runs). Tokens are indexed by their
/// position in the call's sequence: the start state's pending tokens first (P0 of them), then
/// the call's T rows.
template <class T>
struct Saved {
  State<T> start;                           // the state the call began from (backward: Grad::state)
  std::vector<std::int32_t> assignment;     // P0 + T: centroid row each token was absorbed
                                            // into, -1 for tokens still pending at the end
  std::vector<std::int64_t> seeds;          // sequence index of the token that opened each new
                                            // centroid, in row order (rows N_start, N_start+1..)
  std::vector<std::int32_t> new_centroids;  // per absorbed block: nu
  Index tokens = 0;                         // T
  T beta = T(0);
  Index block = 0;  // options the forward ran with
  bool count_bias = true;
  double norm_eps = 0;
  std::uint64_t fingerprint[3] = {0, 0, 0};  // of q, k, v (mixattn::detail::Fingerprint)
  std::uint64_t end_fingerprint = 0;         // of the state the call ended in
  bool recorded = false;                     // set by forward
  detail::ForwardScratch<T> scratch;         // the forward's working memory, kept for reuse

  /// Heap and object bytes held.
  std::size_t bytes() const {
    const auto mat = [](const auto& m) { return static_cast<std::size_t>(m.size()) * sizeof(T); };
    return sizeof(*this) + mat(start.keys) + mat(start.values) + mat(start.counts) +
           mat(start.pending_keys) + mat(start.pending_values) +
           assignment.capacity() * sizeof(std::int32_t) + seeds.capacity() * sizeof(std::int64_t) +
           new_centroids.capacity() * sizeof(std::int32_t);
  }
};

/// Gradients of a scalar loss with respect to the call's q (T x r), k (T x r), v (T x d_v), the
/// scale factor beta and the continuous part of the state the call started from (SPEC 2.4).
template <class T>
struct Grad {
  Matrix<T> q, k, v;
  T beta;
  StateGrad<T> state;                  // dL/d(the state the call started from), its shapes
  detail::BackwardScratch<T> scratch;  // backward_into's working memory, kept for reuse
};

}  // namespace ovq
MIXATTN_END_NAMESPACE
