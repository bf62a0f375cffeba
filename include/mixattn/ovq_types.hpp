// mixattn/ovq_types.hpp — Online VQ attention's records (SPEC.md §2.1, §2.3): the options, the
// state and its gradient, what forward saves for backward and the gradients, which keep the
// calls' working memory for reuse (detail/ovq/scratch.hpp, held through a Workspace). The
// operations on them are in mixattn/ovq.hpp.
#pragma once

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {
template <class T>
struct OvqForwardScratch;
template <class T>
struct OvqBackwardScratch;
}  // namespace detail

namespace ovq {

/// Dictionary growth schedule (SPEC 2.3 step 1).
enum class Growth {
  plateau,  // N(t) = min(max(floor(t N_max / (t + alpha)), 1), N_max)
  linear    // N(t) = min(t, N_max)
};

/// Seeding rule for new centroids (SPEC 2.3 step 2).
enum class Seeding {
  greedy_dispersion,  // each pick scored against old centroids and the picks so far
  one_shot            // all picks scored against the old dictionary only
};

/// Which centroids a block's non-seed tokens may join (SPEC 2.3 step 3).
///   all_centroids (default): the nearest of all centroids after seeding, the block's new ones
///     included.
///   existing_only: the nearest centroid that existed before the block; a block that starts
///     from an empty dictionary sends every non-seed token to the first centroid it opened
///     (row 0, seeded by the block's first token). With Seeding::one_shot this is the rule of
///     the public KVM-paper implementation (`ovq_attention` in recursal/KVM-paper,
///     model/ovq_mixer.py, hard update, no centroid normalisation, no delta rule): same
///     outputs, states and gradients (grad_through_dictionary = true) up to rounding, for
///     block >= 2 and max_centroids >= 2 (SPEC 2.3 lists the remaining differences).
enum class Assignment { all_centroids, existing_only };

struct Options {
  Index block = 256;           // C, tokens per block (>= 1)
  Index max_centroids = 1024;  // N_max (>= 1)
  Growth growth = Growth::plateau;
  double growth_alpha = 0;  // plateau alpha (>= 0); 0 means alpha = N_max
  Seeding seeding = Seeding::greedy_dispersion;
  Assignment assignment = Assignment::all_centroids;
  bool count_bias = true;               // + log c[n] on dictionary logits
  bool grad_through_dictionary = true;  // SPEC 2.4: gradients through the running means
  double norm_eps = 1e-5;               // x_hat = x / (||x|| + norm_eps), > 0
  bool check_finite = true;             // reject NaN/Inf inputs with std::domain_error
};

/// One head's online memory (SPEC 2.1). Make a fresh one with State<T>::empty(r, d_v).
/// Invariants (checked by every call): keys, values, counts agree in rows (<= max_centroids),
/// counts >= 1, pending_keys and pending_values agree in rows, and those rows equal
/// tokens_seen mod options.block.
template <class T>
struct State {
  Matrix<T> keys;            // N_t x r: running means of unit-norm keys
  Matrix<T> values;          // N_t x d_v: running means of the same tokens' values
  Vector<T> counts;          // N_t: tokens absorbed by each centroid
  Matrix<T> pending_keys;    // P x r: normalised keys of the unfinished block (P < C)
  Matrix<T> pending_values;  // P x d_v: raw values of the unfinished block
  Index tokens_seen = 0;     // tokens processed so far, pending ones included

  /// An empty memory for keys of width key_dim (r >= 1) and values of width value_dim (>= 1).
  static State empty(Index key_dim, Index value_dim) {
    constexpr const char* fn = "mixattn::ovq::State::empty";
    mixattn::detail::require(key_dim >= 1, fn, "key_dim is ", key_dim, ", must be >= 1");
    mixattn::detail::require(value_dim >= 1, fn, "value_dim is ", value_dim, ", must be >= 1");
    State s;
    s.keys.resize(0, key_dim);
    s.values.resize(0, value_dim);
    s.counts.resize(0);
    s.pending_keys.resize(0, key_dim);
    s.pending_values.resize(0, value_dim);
    return s;
  }
};

/// Gradient of a scalar loss with respect to the continuous part of a State (SPEC 2.4, across
/// pieces), with the shapes of that state:
///   keys N_t x r, values N_t x d_v (the running means),
///   pending_keys P x r (with respect to the normalised keys the state holds),
///   pending_values P x d_v.
/// Counts, assignments and seeds are constants of the gradient. backward returns it for the
/// state the call started from (Grad::state) and takes it for the state the call ended in.
template <class T>
struct StateGrad {
  Matrix<T> keys, values, pending_keys, pending_values;
  /// Fingerprint of the state this is the gradient of, set by backward (Grad::state) and checked
  /// by the previous piece's backward against the state its forward ended in; 0: not checked.
  std::uint64_t state_fingerprint = 0;
};

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
  detail::Workspace<detail::OvqForwardScratch<T>> scratch;  // the forward's working memory

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
  detail::Workspace<detail::OvqBackwardScratch<T>> scratch;  // backward_into's working memory
};

}  // namespace ovq
MIXATTN_END_NAMESPACE
