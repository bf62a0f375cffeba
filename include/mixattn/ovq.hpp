// mixattn/ovq.hpp — Online Vector-Quantized attention (SPEC.md §2), forward and backward.
//
// One head keeps a constant-size memory: a dictionary of at most N_max centroids (running means
// of unit-norm keys and of the same tokens' values, with counts) plus the keys and values of the
// block that is not complete yet. Queries of block b attend, in one joint softmax, to the
// dictionary as it stood before block b (with a log-count bias) and causally to the block's own
// raw keys; each complete block is then absorbed by one online k-means step (SPEC 2.3).
//
// Token positions are global (state.tokens_seen + row) and blocks are aligned to multiples of
// options.block, so a call may start or end mid-block: the unfinished block is carried in the
// state. Splitting a sequence into any pieces gives the same outputs up to rounding and the
// same final state, bit for bit (the absorption of a block reads only that block and the
// dictionary, always with the same shapes). backward differentiates a call with respect to its
// start state too (Grad::state, a StateGrad) and takes the end state's gradient, so a sequence
// also trains piecewise, the pieces' backwards run in reverse (SPEC 2.4, across pieces).
//
// Cost per token: O((N_max + C) (r + d_v)) flops, all of it GEMMs; memory O(N_max (r + d_v)).
//
// Thread safety: calls on distinct states may run concurrently; a State must not be shared by
// concurrent calls. Each call is single-threaded (Eigen's own threading aside).
// The `_into` forms write into caller-owned outputs, states, Saved and Grad and keep their
// working memory there: a training step from a constant start state (forward_into with start and
// next) whose shapes repeat performs no heap allocation.
#pragma once

#include "mixattn/core.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
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

}  // namespace ovq
MIXATTN_END_NAMESPACE

#include "mixattn/detail/ovq_scratch.hpp"

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

#include "mixattn/detail/ovq_forward.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace ovq {

/// OVQ attention over q, k, v as the continuation of `state` (SPEC 2.2-2.3), which it updates.
///   q: T x r, k: T x r, v: T x d_v (row-major, rows are tokens; r, d_v fixed by the state)
///   beta: scale factor (> 0), logits use s = beta sqrt(r)
///   returns T x d_v.
/// `saved` (optional) receives what backward needs: O(N_max (r + d_v) + T) memory.
/// Throws std::invalid_argument on bad shapes, options or an inconsistent state, and
/// std::domain_error on non-finite input (options.check_finite); `state` is untouched then.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, typename mixattn::detail::identity<T>::type beta,
                  const Options& opt, State<T>& state, Saved<T>* saved = nullptr) {
  Matrix<T> out;
  const detail::LentScratch<detail::ForwardScratch<T>> lent(saved ? &saved->scratch : nullptr);
  detail::ovq_forward<T>("mixattn::ovq::forward", out, q, k, v, beta, opt, state, state, saved);
  return out;
}

/// forward into a caller-owned `out` (resized to T x d_v); `state` is continued and updated as
/// in forward, and `saved` keeps the call's working memory, so calls whose shapes repeat reuse
/// it. Without `saved`, per-thread scratch is used.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, typename mixattn::detail::identity<T>::type beta,
                  const Options& opt, State<T>& state,
                  Saved<typename mixattn::detail::identity<T>::type>* saved) {
  detail::ovq_forward<T>("mixattn::ovq::forward_into", out, q, k, v, beta, opt, state, state,
                         saved);
}

/// forward_into from a constant `start` state, writing the final state into `next` (its capacity
/// kept when its shapes repeat). The training-loop form: every step starts from the same state
/// (usually State::empty) and, with reused out, next and saved, allocates nothing in steady
/// state. `next` may be `start`.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, typename mixattn::detail::identity<T>::type beta,
                  const Options& opt, const State<T>& start, State<T>& next,
                  Saved<typename mixattn::detail::identity<T>::type>* saved) {
  detail::ovq_forward<T>("mixattn::ovq::forward_into", out, q, k, v, beta, opt, start, next, saved);
}

}  // namespace ovq
MIXATTN_END_NAMESPACE

#include "mixattn/detail/ovq_backward.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace ovq {

/// Gradients of a scalar loss L through forward (SPEC 2.4), given grad_out = dL/d(output).
///   q, k, v: the forward's inputs (T x r, T x r, T x d_v); beta as in forward;
///   grad_out: T x d_v; saved: filled by that forward call; opt: its options (block,
///   count_bias and norm_eps must match; grad_through_dictionary chooses the mode).
/// Assignments, seeds, counts and the count bias are constants. With grad_through_dictionary the
/// gradient also flows through the running means into earlier tokens of the call:
///   dD_old[n] += (c_old / c_new) dD_new[n],   dk_hat_j += dD_k,new[n] / c_new  (j -> n);
/// otherwise nothing passes a block's update (each block reads its dictionary as constant keys
/// and values, except that block 0 reads the start state's).
/// grad.state receives dL/d(the state the call started from) (its keys, values, pending_keys
/// and pending_values; zero-size parts for State::empty); the end state is taken to have no
/// further use (see the overload with grad_state_out for pieces of a longer sequence).
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                 typename mixattn::detail::identity<T>::type beta,
                 const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  Grad<T> g;
  {  // the working memory is this thread's: the returned gradient carries none
    const detail::LentScratch<detail::BackwardScratch<T>> lent(&g.scratch);
    detail::ovq_backward<T>("mixattn::ovq::backward", g, q, k, v, beta, grad_out, saved, opt,
                            static_cast<const StateGrad<T>*>(nullptr));
  }
  return g;
}

/// Backward of a piece of a longer sequence (SPEC 2.4, across pieces): as backward, with
/// grad_state_out (optional) = dL/d(the state the call ended in), which the next piece's
/// backward returned as its grad.state: keys and values N_end x r and N_end x d_v, pending_keys
/// and pending_values P_end x r and P_end x d_v, the end state's shapes. Its dictionary part
/// flows back through the running means (only when no block completed in the call if the
/// gradient is stopped at the dictionary), its pending part into the tokens those rows copy.
/// Running the pieces' backwards in reverse, each fed its successor's grad.state, gives the
/// gradients of one call over the whole sequence. Throws std::invalid_argument on other shapes
/// or when grad_state_out is the gradient of another state than this call's end state.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                 typename mixattn::detail::identity<T>::type beta,
                 const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt,
                 const StateGrad<typename mixattn::detail::identity<T>::type>* grad_state_out) {
  Grad<T> g;
  {  // the working memory is this thread's: the returned gradient carries none
    const detail::LentScratch<detail::BackwardScratch<T>> lent(&g.scratch);
    detail::ovq_backward<T>("mixattn::ovq::backward", g, q, k, v, beta, grad_out, saved, opt,
                            grad_state_out);
  }
  return g;
}

/// backward into caller-owned gradients (resized; the working memory is kept in `grad`, so calls
/// whose shapes repeat allocate nothing).
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                   const ConstMatrixRef<T>& v, typename mixattn::detail::identity<T>::type beta,
                   const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::ovq_backward<T>("mixattn::ovq::backward_into", grad, q, k, v, beta, grad_out, saved, opt,
                          static_cast<const StateGrad<T>*>(nullptr));
}

/// Backward of a piece into caller-owned gradients (see the backward overload with
/// grad_state_out); grad_state_out may be grad.state itself, so one Grad can run the pieces'
/// backwards in reverse, each fed the grad.state its successor left.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                   const ConstMatrixRef<T>& v, typename mixattn::detail::identity<T>::type beta,
                   const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt,
                   const StateGrad<typename mixattn::detail::identity<T>::type>* grad_state_out) {
  detail::ovq_backward<T>("mixattn::ovq::backward_into", grad, q, k, v, beta, grad_out, saved, opt,
                          grad_state_out);
}

// Compile-time refusals (core.hpp, refuse_arguments): an unsupported scalar type, or a
// column-major or strided argument that would be copied on every call, selects one of these
// overloads instead of the ones above; the static_assert's message is their only effect.
template <class T, class Q, class K, class V, mixattn::detail::enable_if_refused<T, Q, K, V> = 0>
Matrix<T> forward(const Q&, const K&, const V&, typename mixattn::detail::identity<T>::type,
                  const Options&, State<T>&, Saved<T>* = nullptr) {
  mixattn::detail::refuse_arguments<T, Q, K, V>();
  return {};
}
template <class T, class Q, class K, class V, mixattn::detail::enable_if_refused<T, Q, K, V> = 0>
void forward_into(Matrix<T>&, const Q&, const K&, const V&,
                  typename mixattn::detail::identity<T>::type, const Options&, State<T>&,
                  Saved<typename mixattn::detail::identity<T>::type>*) {
  mixattn::detail::refuse_arguments<T, Q, K, V>();
}
template <class T, class Q, class K, class V, mixattn::detail::enable_if_refused<T, Q, K, V> = 0>
void forward_into(Matrix<T>&, const Q&, const K&, const V&,
                  typename mixattn::detail::identity<T>::type, const Options&, const State<T>&,
                  State<T>&, Saved<typename mixattn::detail::identity<T>::type>*) {
  mixattn::detail::refuse_arguments<T, Q, K, V>();
}
template <class T, class Q, class K, class V, class G,
          mixattn::detail::enable_if_refused<T, Q, K, V, G> = 0>
Grad<T> backward(const Q&, const K&, const V&, typename mixattn::detail::identity<T>::type,
                 const G&, const Saved<T>&, const Options&,
                 const StateGrad<typename mixattn::detail::identity<T>::type>* = nullptr) {
  mixattn::detail::refuse_arguments<T, Q, K, V, G>();
  return {};
}
template <class T, class Q, class K, class V, class G,
          mixattn::detail::enable_if_refused<T, Q, K, V, G> = 0>
void backward_into(Grad<T>&, const Q&, const K&, const V&,
                   typename mixattn::detail::identity<T>::type, const G&, const Saved<T>&,
                   const Options&,
                   const StateGrad<typename mixattn::detail::identity<T>::type>* = nullptr) {
  mixattn::detail::refuse_arguments<T, Q, K, V, G>();
}

}  // namespace ovq

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every forward and backward form (core.hpp: compiling the operators once).
namespace detail {
#define MIXATTN_OVQ_INSTANCES(T)                                                              \
  MIXATTN_TEMPLATE_INSTANCE void ovq_forward<T>(                                              \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,            \
      const ConstMatrixRef<T>&, T, const ovq::Options&, const ovq::State<T>&, ovq::State<T>&, \
      ovq::Saved<T>*);                                                                        \
  MIXATTN_TEMPLATE_INSTANCE void ovq_backward<T>(                                             \
      const char*, ovq::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,         \
      const ConstMatrixRef<T>&, T, const ConstMatrixRef<T>&, const ovq::Saved<T>&,            \
      const ovq::Options&, const ovq::StateGrad<T>*);
MIXATTN_OVQ_INSTANCES(float)
MIXATTN_OVQ_INSTANCES(double)
#undef MIXATTN_OVQ_INSTANCES
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
