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
#define MIXATTN_OVQ_HPP_INCLUDED

#include "mixattn/core.hpp"
#include "mixattn/detail/dictionary.hpp"
#include "mixattn/detail/ovq_attention.hpp"

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

namespace detail {

/// Lends a state's dictionary storage (keys, values, counts) to a Dictionary without a copy,
/// and gives it back trimmed to the live rows (on destruction at the latest).
template <class T>
struct DictionaryLoan {
  State<T>& state;
  Dictionary<T> dict;
  bool lent = false;

  explicit DictionaryLoan(State<T>& st) : state(st) { borrow(); }
  ~DictionaryLoan() { give_back(); }
  DictionaryLoan(const DictionaryLoan&) = delete;
  DictionaryLoan& operator=(const DictionaryLoan&) = delete;

  void borrow() {
    dict.keys.swap(state.keys);
    dict.values.swap(state.values);
    dict.counts.swap(state.counts);
    dict.size = dict.keys.rows();
    lent = true;
  }
  /// Room for `capacity` rows (the live ones kept): once per call that opens centroids.
  void grow(Index capacity) {
    if (capacity <= dict.capacity()) return;
    dict.keys.conservativeResize(capacity, dict.keys.cols());
    dict.values.conservativeResize(capacity, dict.values.cols());
    dict.counts.conservativeResize(capacity);
  }
  void give_back() {
    if (!lent) return;
    if (dict.capacity() != dict.size) {
      dict.keys.conservativeResize(dict.size, dict.keys.cols());
      dict.values.conservativeResize(dict.size, dict.values.cols());
      dict.counts.conservativeResize(dict.size);
    }
    dict.keys.swap(state.keys);
    dict.values.swap(state.values);
    dict.counts.swap(state.counts);
    lent = false;
  }
};

/// The absorption of one complete block (SPEC 2.3), its scratch kept between calls.
template <class T>
class Absorber {
 public:
  void reserve(const Options& opt, Index capacity, Index key_dim, Index value_dim,
               bool own_assignment) {
    const Index c = opt.block;
    quant_.reserve(c, capacity, key_dim);
    update_.reserve(capacity, key_dim, value_dim);
    kb_.resize(c, key_dim);
    vb_.resize(c, value_dim);
    seeds_.resize(static_cast<std::size_t>(c));
    if (own_assignment) assign_.resize(static_cast<std::size_t>(c));
  }

  /// Absorbs the block [ko; kn] (unit-norm keys), [vo; vn] (values) that follows t absorbed
  /// tokens into dict (grown through `loan` when it is the state's own storage, else already of
  /// `capacity` rows); writes the tokens' centroid rows to `assign` (C entries, or internal
  /// scratch when null) and refreshes the changed log counts. Returns nu, the centroids opened.
  Index run(const Options& opt, Index t, Dictionary<T>& dict, DictionaryLoan<T>* loan,
            Index capacity, const CRef<T>& ko, const CRef<T>& vo, const CRef<T>& kn,
            const CRef<T>& vn, std::int32_t* assign, Vector<T>& logc) {
    const Index c = opt.block, po = ko.rows();
    MIXATTN_ASSERT(po + kn.rows() == c);
    kb_.topRows(po) = ko;
    kb_.bottomRows(c - po) = kn;
    vb_.topRows(po) = vo;
    vb_.bottomRows(c - po) = vn;
    const double alpha =
        opt.growth_alpha > 0 ? opt.growth_alpha : static_cast<double>(opt.max_centroids);
    const Index nu =
        new_centroids(t, c, dict.size, opt.max_centroids, opt.growth == Growth::plateau, alpha);
    if (dict.size + nu > dict.capacity()) {
      MIXATTN_ASSERT(loan != nullptr);
      loan->grow(capacity);
    }
    if (assign == nullptr) assign = assign_.data();
    quant_.plan(dict, kb_, nu, opt.seeding == Seeding::greedy_dispersion,
                opt.assignment == Assignment::existing_only, assign, seeds_.data());
    update_.apply(dict, kb_, vb_, assign, nu);
    for (const Index row_n : update_.touched()) logc[row_n] = std::log(dict.counts[row_n]);
    return nu;
  }
  Index seed(Index p) const { return seeds_[static_cast<std::size_t>(p)]; }

 private:
  BlockQuantizer<T> quant_;
  MeanUpdate<T> update_;
  Matrix<T> kb_, vb_;  // C x r, C x d_v: the whole block
  std::vector<std::int32_t> seeds_, assign_;
};

/// A forward call's working memory (kept in Saved for reuse; capacity kept when shapes repeat).
template <class T>
struct ForwardScratch {
  Dictionary<T> dict;    // the working dictionary when the end state goes to another State
  Matrix<T> kn, vn, qh;  // one block's call tokens: normalised keys, values; normalised queries
  Vector<T> logc;
  AttentionScratch<T> sc;
  Absorber<T> absorb;
};

/// A backward call's working memory (kept in Grad for reuse).
template <class T>
struct BackwardScratch {
  std::vector<Dictionary<T>> checkpoints, snaps;
  Dictionary<T> work;
  MeanUpdate<T> update;
  Matrix<T> kb, vb, qh, dkb, dvb, ddk, ddv;
  Matrix<T> dpk, dpv;  // dL/d(end state's pending tokens), read before grad.state is written
  Vector<T> logc;
  AttentionScratch<T> sc;
  std::vector<Index> hits;
};

}  // namespace detail

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

namespace detail {

using mixattn::detail::concat;
using mixattn::detail::require;
using mixattn::detail::require_finite;
using mixattn::detail::shape_str;
using mixattn::detail::wide_t;

inline void check_options(const Options& opt, const char* fn) {
  require(opt.block >= 1, fn, "options.block is ", opt.block, ", must be >= 1");
  require(opt.max_centroids >= 1 && opt.max_centroids <= std::numeric_limits<std::int32_t>::max(),
          fn, "options.max_centroids is ", opt.max_centroids, ", must be in [1, 2^31 - 1]");
  require(opt.growth_alpha >= 0 && std::isfinite(opt.growth_alpha), fn, "options.growth_alpha is ",
          opt.growth_alpha, ", must be finite and >= 0");
  require(opt.norm_eps > 0 && std::isfinite(opt.norm_eps), fn, "options.norm_eps is ", opt.norm_eps,
          ", must be finite and > 0");
  require(
      opt.assignment == Assignment::all_centroids || opt.assignment == Assignment::existing_only,
      fn, "options.assignment is ", static_cast<int>(opt.assignment),
      ", must be Assignment::all_centroids or Assignment::existing_only");
}

/// Every part of the state must agree before anything is read from it (shapes, counts; the
/// matrices' values: check_state_values). O(N_t), no scan of the matrices.
template <class T>
void check_state(const State<T>& st, const Options& opt, const char* fn) {
  const Index n = st.keys.rows(), p = st.pending_keys.rows();
  require(st.keys.cols() >= 1 && st.values.cols() >= 1, fn, "state.keys is ", shape_str(st.keys),
          " and state.values is ", shape_str(st.values),
          ": make the state with State<T>::empty(key_dim, value_dim)");
  require(st.values.rows() == n, fn, "state.values has ", st.values.rows(),
          " rows but state.keys has ", n);
  require(st.counts.size() == n, fn, "state.counts has ", st.counts.size(),
          " entries but state.keys has ", n, " rows");
  require(n <= opt.max_centroids, fn, "state.keys has ", n,
          " centroids, more than options.max_centroids = ", opt.max_centroids);
  require(st.pending_keys.cols() == st.keys.cols(), fn, "state.pending_keys is ",
          shape_str(st.pending_keys), " but state.keys has ", st.keys.cols(), " columns");
  require(st.pending_values.cols() == st.values.cols(), fn, "state.pending_values is ",
          shape_str(st.pending_values), " but state.values has ", st.values.cols(), " columns");
  require(st.pending_values.rows() == p, fn, "state.pending_values has ", st.pending_values.rows(),
          " rows but state.pending_keys has ", p);
  require(p < opt.block, fn, "state.pending_keys has ", p,
          " rows, but the unfinished block must hold fewer than options.block = ", opt.block);
  require(st.tokens_seen >= 0, fn, "state.tokens_seen is ", st.tokens_seen, ", must be >= 0");
  require(st.tokens_seen % opt.block == p, fn, "state.pending_keys has ", p,
          " rows but state.tokens_seen = ", st.tokens_seen, " leaves ", st.tokens_seen % opt.block,
          " tokens in the unfinished block of ", opt.block);
  if (opt.check_finite) require_finite(st.counts, fn, "state.counts");
  // Vectorised (a NaN count makes the minimum NaN); the loop names the culprit.
  if (n == 0 || st.counts.template minCoeff<Eigen::PropagateNaN>() >= T(1)) return;
  for (Index i = 0; i < n; ++i)
    require(st.counts[i] >= T(1), fn, "state.counts[", i, "] is ", st.counts[i],
            ", every centroid holds at least one token");
}

/// The state's matrices hold no NaN or infinity (std::domain_error naming the first).
/// forward does not scan them on every call: a non-finite dictionary or pending entry always
/// makes a logit or the output of the call's first query non-finite (q_hat . x with x
/// non-finite, then exp and the value GEMM, never give a finite number), and only then does
/// forward run this scan, before it has changed anything.
template <class T>
void check_state_values(const State<T>& st, const char* fn) {
  require_finite(st.keys, fn, "state.keys");
  require_finite(st.values, fn, "state.values");
  require_finite(st.pending_keys, fn, "state.pending_keys");
  require_finite(st.pending_values, fn, "state.pending_values");
}

/// Shapes of q, k, v (and grad_out when given) against the key and value widths.
template <class T>
void check_inputs(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, Index r, Index dv, const char* where,
                  const char* fn) {
  require(q.cols() == r, fn, "q has ", q.cols(), " columns but ", where, " has key width ", r,
          " (q: ", shape_str(q), ")");
  require(k.cols() == r, fn, "k has ", k.cols(), " columns but ", where, " has key width ", r,
          " (k: ", shape_str(k), ")");
  require(v.cols() == dv, fn, "v has ", v.cols(), " columns but ", where, " has value width ", dv,
          " (v: ", shape_str(v), ")");
  require(k.rows() == q.rows(), fn, "k has ", k.rows(), " rows but q has ", q.rows());
  require(v.rows() == q.rows(), fn, "v has ", v.rows(), " rows but q has ", q.rows());
}

/// x_hat = x / (||x|| + eps) row by row, the norm summed in the wide type in a fixed order so
/// that a token's normalised key is the same bits whichever call normalises it.
template <class T>
void normalize_rows(const CRef<T>& x, Eigen::Ref<Matrix<T>> out, double eps) {
  using W = wide_t<T>;
  const Index cols = x.cols();
  for (Index i = 0; i < x.rows(); ++i) {
    const T* a = x.row(i).data();
    W ss = 0;
    for (Index c = 0; c < cols; ++c) ss += static_cast<W>(a[c]) * static_cast<W>(a[c]);
    const W den = std::sqrt(ss) + static_cast<W>(eps);
    T* o = out.row(i).data();
    for (Index c = 0; c < cols; ++c) o[c] = static_cast<T>(static_cast<W>(a[c]) / den);
  }
}

/// Backward of x_hat = x / (n + eps), n = ||x||: with g = dL/dx_hat (overwritten by dL/dx),
///   dx = (g - x (x . g) / (n (n + eps))) / (n + eps),
/// and dx = g / eps at x = 0, where the second term vanishes in the limit.
template <class T>
void normalize_backward(const CRef<T>& x, Eigen::Ref<Matrix<T>> g, double eps) {
  using W = wide_t<T>;
  const Index cols = x.cols();
  for (Index i = 0; i < x.rows(); ++i) {
    const T* a = x.row(i).data();
    T* d = g.row(i).data();
    W ss = 0, dot = 0;
    for (Index c = 0; c < cols; ++c) {
      ss += static_cast<W>(a[c]) * static_cast<W>(a[c]);
      dot += static_cast<W>(a[c]) * static_cast<W>(d[c]);
    }
    const W n = std::sqrt(ss), den = n + static_cast<W>(eps);
    const W coef = n > 0 ? dot / (n * den) : W(0);
    for (Index c = 0; c < cols; ++c)
      d[c] = static_cast<T>((static_cast<W>(d[c]) - static_cast<W>(a[c]) * coef) / den);
  }
}

/// Token ranges of the call's blocks. The call's sequence is the start state's P0 pending
/// tokens followed by its T rows; block u covers sequence positions [uC, min((u+1)C, P0+T)),
/// its queries begin at max(uC, P0) (sequence) = first - P0 (call row).
struct Blocks {
  Index c = 0, p0 = 0, total = 0, count = 0, complete = 0;
  Blocks(Index block, Index pending, Index tokens)
      : c(block),
        p0(pending),
        total(pending + tokens),
        count(tokens == 0 ? 0 : (pending + tokens + block - 1) / block),
        complete((pending + tokens) / block) {}
  Index begin(Index u) const { return u * c; }
  Index end(Index u) const { return std::min(u * c + c, total); }
  Index query_offset(Index u) const { return u == 0 ? p0 : 0; }  // block position of 1st query
  Index queries(Index u) const { return end(u) - begin(u) - query_offset(u); }
  Index call_row(Index u) const { return begin(u) + query_offset(u) - p0; }
  bool is_complete(Index u) const { return u < complete; }
};

/// Fingerprints of what backward will be given besides the record: q, k, v.
template <class T>
void fingerprints(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                  const ConstMatrixRef<T>& v, std::uint64_t* out) {
  out[0] = mixattn::detail::fingerprint(q);
  out[1] = mixattn::detail::fingerprint(k);
  out[2] = mixattn::detail::fingerprint(v);
}

/// Fingerprint of a state: the end state a record was made with, or the one whose gradient a
/// StateGrad carries, so that pieces of a sequence are chained backward as they ran forward.
template <class T>
std::uint64_t state_fingerprint(const State<T>& st) {
  return mixattn::detail::Fingerprint()
      .add(st.keys)
      .add(st.values)
      .add(st.counts)
      .add(st.pending_keys)
      .add(st.pending_values)
      .add(st.tokens_seen)
      .value();
}

template <class T>
void log_counts(const Dictionary<T>& d, Vector<T>& logc) {
  logc.head(d.size) = d.counts.head(d.size).array().log().matrix();
}

/// Appends rows to a matrix (the unfinished block growing by a call's tokens).
template <class T>
void append_rows(Matrix<T>& m, const CRef<T>& rows) {
  if (rows.rows() == 0) return;
  const Index n = m.rows();
  m.conservativeResize(n + rows.rows(), m.cols());
  m.bottomRows(rows.rows()) = rows;
}

/// Validates a forward call; returns s = beta sqrt(r).
template <class T>
T check_forward(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                const ConstMatrixRef<T>& v, T beta, const Options& opt, const State<T>& state) {
  check_options(opt, fn);
  check_state(state, opt, fn);
  const Index r = state.keys.cols(), dv = state.values.cols(), tn = q.rows();
  check_inputs<T>(q, k, v, r, dv, "state.keys", fn);
  require(tn <= std::numeric_limits<Index>::max() - state.tokens_seen - opt.block, fn,
          "state.tokens_seen + q.rows() overflows the token counter");
  if (opt.check_finite) {
    require_finite(q, fn, "q");
    require_finite(k, fn, "k");
    require_finite(v, fn, "v");
    if (!std::isfinite(beta))
      mixattn::detail::raise_domain_error(concat(fn, ": beta is ", beta, ", not finite"));
  }
  // beta = 0 would make every logit equal and a negative one would invert the attention; NaN
  // passes to the finiteness check (or through it when the caller turned it off).
  require(!(beta <= 0), fn, "beta is ", beta, "; the scale factor must be > 0");
  const T s = beta * static_cast<T>(std::sqrt(static_cast<double>(r)));
  if (opt.check_finite && !std::isfinite(s))
    mixattn::detail::raise_domain_error(
        concat(fn, ": beta * sqrt(r) = ", beta, " * sqrt(", r, ") overflows"));
  return s;
}

/// Starts the record of a forward call in `saved` (its capacity reused): the start state and
/// the options; the assignments and seeds follow block by block.
template <class T>
void begin_record(Saved<T>& saved, const State<T>& start, const Options& opt, const Blocks& blocks,
                  Index tn, T beta) {
  saved.recorded = false;
  saved.start = start;
  saved.assignment.assign(static_cast<std::size_t>(blocks.total), -1);
  saved.new_centroids.clear();
  saved.new_centroids.reserve(static_cast<std::size_t>(blocks.complete));
  saved.seeds.clear();
  saved.tokens = tn;
  saved.beta = beta;
  saved.block = opt.block;
  saved.count_bias = opt.count_bias;
  saved.norm_eps = opt.norm_eps;
}

/// The blocks of one call (SPEC 2.2-2.3) over `dict`, which holds the start state's dictionary
/// on entry and the end state's on exit: the state's own storage lent through `loan` (grown
/// there when a block opens centroids), or scratch of `capacity` rows (loan null). Block
/// positions [0, po) are the start state's pending tokens (block 0 only); this call's tokens of
/// the block are w.kn / w.vn rows [0, m), at positions po + row.
template <class T>
void forward_blocks(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                    const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, T s, const Options& opt,
                    const State<T>& start, const Blocks& blocks, Index capacity,
                    Dictionary<T>& dict, DictionaryLoan<T>* loan, ForwardScratch<T>& w,
                    Saved<T>* saved) {
  const Index t_start = start.tokens_seen - blocks.p0;  // tokens absorbed before the call
  log_counts(dict, w.logc);
  for (Index u = 0; u < blocks.count; ++u) {
    const Index pq = blocks.query_offset(u), m = blocks.queries(u), row = blocks.call_row(u);
    const Index po = u == 0 ? blocks.p0 : 0;
    const CRef<T> ko = start.pending_keys.topRows(po), vo = start.pending_values.topRows(po);
    normalize_rows<T>(q.middleRows(row, m), w.qh.topRows(m), opt.norm_eps);
    normalize_rows<T>(k.middleRows(row, m), w.kn.topRows(m), opt.norm_eps);
    w.vn.topRows(m) = v.middleRows(row, m);
    const T* lc = opt.count_bias ? w.logc.data() : nullptr;
    for (Index t0 = 0; t0 < m; t0 += query_tile) {
      const Index mt = std::min(query_tile, m - t0);
      const bool check = opt.check_finite && u == 0 && t0 == 0;
      MatrixRef<T> o = out.middleRows(row + t0, mt);
      const bool finite = tile_forward<T>(
          w.qh.middleRows(t0, mt), dict.keys.topRows(dict.size), dict.values.topRows(dict.size), lc,
          ko, vo, w.kn.topRows(t0 + mt), w.vn.topRows(t0 + mt), pq + t0, s, w.sc, o, check);
      if (check && !(finite && (o.array() * T(0)).sum() == T(0))) {
        if (loan != nullptr) loan->give_back();  // nothing changed yet
        check_state_values(start, fn);           // throws if the state is to blame
        if (loan != nullptr) loan->borrow();     // else: finite inputs that overflowed
      }
    }
    if (!blocks.is_complete(u)) continue;
    // Absorb the block (SPEC 2.3): grow, seed, assign, update the running means.
    std::int32_t* assign = saved != nullptr ? saved->assignment.data() + blocks.begin(u) : nullptr;
    const Index nu = w.absorb.run(opt, t_start + blocks.begin(u), dict, loan, capacity, ko, vo,
                                  w.kn.topRows(m), w.vn.topRows(m), assign, w.logc);
    if (saved != nullptr) {
      saved->new_centroids.push_back(static_cast<std::int32_t>(nu));
      for (Index p = 0; p < nu; ++p) saved->seeds.push_back(blocks.begin(u) + w.absorb.seed(p));
    }
  }
}

/// The unfinished block after the call into `next`: the start state's pending tokens then this
/// call's (no block absorbed), or the last partial block's tokens (capacity kept when its shapes
/// repeat). `next` may be `start`.
template <class T>
void store_pending(const ForwardScratch<T>& w, const State<T>& start, const Blocks& blocks,
                   Index tn, State<T>& next) {
  const Index pending = blocks.total - blocks.complete * blocks.c, p0 = blocks.p0;
  if (blocks.complete > 0) {
    next.pending_keys = w.kn.topRows(pending);
    next.pending_values = w.vn.topRows(pending);
  } else if (&start == &next) {
    append_rows<T>(next.pending_keys, w.kn.topRows(tn));
    append_rows<T>(next.pending_values, w.vn.topRows(tn));
  } else {
    next.pending_keys.resize(p0 + tn, start.pending_keys.cols());
    next.pending_values.resize(p0 + tn, start.pending_values.cols());
    next.pending_keys.topRows(p0) = start.pending_keys;
    next.pending_values.topRows(p0) = start.pending_values;
    next.pending_keys.bottomRows(tn) = w.kn.topRows(tn);
    next.pending_values.bottomRows(tn) = w.vn.topRows(tn);
  }
}

/// With checks on, whether v (new values, or the dictionary's) holds values beyond sqrt(max T),
/// which can make the output or the running means overflow (only then does an in-place forward
/// keep a copy of the state).
template <class T>
bool large_values(const ConstMatrixRef<T>& v, const Options& opt) {
  return opt.check_finite && v.size() > 0 &&
         static_cast<double>(v.cwiseAbs().maxCoeff()) >
             std::sqrt(static_cast<double>(std::numeric_limits<T>::max()));
}

/// With checks on: the output is a convex combination of values and the running means stay
/// within their range, so only sums of v near T's limit can overflow; reported, never returned.
/// The dictionary is scanned only when the call absorbed a block (`absorbed`): otherwise it is
/// the start state's, which the first query's attention already vouched for, and a decoding
/// call stays O(N_t r) in its arithmetic alone.
template <class T>
void check_overflow(const char* fn, const Matrix<T>& out, const Dictionary<T>& dict, bool absorbed,
                    DictionaryLoan<T>* loan, State<T>* restore, State<T>& kept) {
  if ((out.array() * T(0)).sum() == T(0) &&
      (!absorbed || (dict.values.topRows(dict.size).array() * T(0)).sum() == T(0)))
    return;
  if (loan != nullptr) loan->give_back();
  if (restore != nullptr) *restore = std::move(kept);
  mixattn::detail::require_finite_result(out, fn, "the output", "v is");
  mixattn::detail::raise_domain_error(concat(
      fn, ": the dictionary's running means of v overflow ", mixattn::detail::scalar_name<T>(),
      " although every input is finite: v is too large for the scalar type (scale it down or "
      "use double)"));
}

/// The forward (SPEC 2.2-2.3) from `start` into `out` and `next` (which may be `start`).
/// In place (next is start), the dictionary is worked on where it lies (its storage lent to a
/// Dictionary and given back at the end, grown only when a block opens centroids) and the
/// unfinished block is read from the state, so a decoding call copies nothing of size N_t or C.
/// Into another State, the dictionary is worked on in scratch and copied out (no allocation
/// when shapes repeat: the training loop). Nothing in `next` or `*saved` changes before the
/// state's values are vouched for (by the first query's attention, or by a scan when there is
/// no query or a record to fill).
template <class T>
void forward(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
             const ConstMatrixRef<T>& v, T beta, const Options& opt, const State<T>& start,
             State<T>& next, Saved<T>* saved) {
  const T s = check_forward<T>(fn, q, k, v, beta, opt, start);
  const Index r = start.keys.cols(), dv = start.values.cols(), tn = q.rows();
  if (opt.check_finite && (tn == 0 || saved != nullptr)) check_state_values(start, fn);
  const Index c = opt.block, n_start = start.keys.rows();
  const Blocks blocks(c, start.pending_keys.rows(), tn);
  const Index capacity =
      std::max(n_start, std::min(opt.max_centroids, n_start + blocks.complete * c));
  const Index rows_new = std::min(c, std::max<Index>(tn, 1));  // call tokens of one block
  const Index tokens_after = start.tokens_seen + tn;

  thread_local ForwardScratch<T> thread_scratch;  // calls without `saved`
  ForwardScratch<T>& w = saved != nullptr ? saved->scratch : thread_scratch;
  if (saved != nullptr) begin_record(*saved, start, opt, blocks, tn, beta);
  w.kn.resize(rows_new, r);
  w.vn.resize(rows_new, dv);
  w.qh.resize(rows_new, r);
  w.logc.resize(capacity);
  w.sc.reserve(capacity, c, r, false, rows_new);
  if (blocks.complete > 0) w.absorb.reserve(opt, capacity, r, dv, saved == nullptr);
  out.resize(tn, dv);
  if (&start == &next) {
    // Values near T's limit, in v, in the unfinished block or in the dictionary, when the call
    // absorbs a block (only then is the dictionary changed before the overflow check): keep a
    // copy of the state, so that an overflow's domain_error leaves it as it was. The dictionary
    // scan costs no more than the absorption's own pass over it; a call that absorbs nothing
    // never scans it.
    const bool keep =
        blocks.complete > 0 && (large_values<T>(v, opt) || large_values<T>(start.pending_values, opt) ||
                                large_values<T>(start.values, opt));
    State<T> kept;
    if (keep) kept = start;
    DictionaryLoan<T> loan(next);
    forward_blocks<T>(fn, out, q, k, v, s, opt, start, blocks, capacity, loan.dict, &loan, w,
                      saved);
    if (opt.check_finite)
      check_overflow<T>(fn, out, loan.dict, blocks.complete > 0, &loan, keep ? &next : nullptr,
                        kept);
    store_pending<T>(w, start, blocks, tn, next);
    loan.give_back();
  } else {
    w.dict.allocate(capacity, r, dv);
    w.dict.load(start.keys, start.values, start.counts);
    forward_blocks<T>(fn, out, q, k, v, s, opt, start, blocks, capacity, w.dict, nullptr, w, saved);
    State<T> unused;
    if (opt.check_finite)
      check_overflow<T>(fn, out, w.dict, blocks.complete > 0, nullptr, nullptr, unused);
    store_pending<T>(w, start, blocks, tn, next);
    next.keys = w.dict.keys.topRows(w.dict.size);
    next.values = w.dict.values.topRows(w.dict.size);
    next.counts = w.dict.counts.head(w.dict.size);
  }
  next.tokens_seen = tokens_after;
  if (saved != nullptr) {
    fingerprints<T>(q, k, v, saved->fingerprint);
    saved->end_fingerprint = state_fingerprint(next);
    saved->recorded = true;
  }
}

}  // namespace detail

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
  detail::forward<T>("mixattn::ovq::forward", out, q, k, v, beta, opt, state, state, saved);
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
  detail::forward<T>("mixattn::ovq::forward_into", out, q, k, v, beta, opt, state, state, saved);
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
  detail::forward<T>("mixattn::ovq::forward_into", out, q, k, v, beta, opt, start, next, saved);
}

namespace detail {

/// Validates a backward call.
template <class T>
void check_backward(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                    const ConstMatrixRef<T>& v, T beta, const ConstMatrixRef<T>& grad_out,
                    const Saved<T>& saved, const Options& opt) {
  check_options(opt, fn);
  require(saved.recorded, fn, "saved was not filled by mixattn::ovq::forward");
  const Index r = saved.start.keys.cols(), dv = saved.start.values.cols(), tn = saved.tokens;
  check_inputs<T>(q, k, v, r, dv, "saved", fn);
  require(q.rows() == tn, fn, "q has ", q.rows(), " rows but saved is for ", tn, " tokens");
  require(grad_out.rows() == tn && grad_out.cols() == dv, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", tn, " x ", dv);
  require(opt.block == saved.block && opt.count_bias == saved.count_bias &&
              opt.norm_eps == saved.norm_eps,
          fn, "options (block ", opt.block, ", count_bias ", opt.count_bias, ", norm_eps ",
          opt.norm_eps, ") differ from the forward's (block ", saved.block, ", count_bias ",
          saved.count_bias, ", norm_eps ", saved.norm_eps, ")");
  require(!(beta <= 0), fn, "beta is ", beta, "; the scale factor must be > 0");
  require(beta == saved.beta, fn, "beta is ", beta, " but the forward ran with ", saved.beta);
  if (opt.check_finite) {
    require_finite(q, fn, "q");
    require_finite(k, fn, "k");
    require_finite(v, fn, "v");
    require_finite(grad_out, fn, "grad_out");
  }
  std::uint64_t now[3];
  fingerprints<T>(q, k, v, now);
  const char* names[3] = {"q", "k", "v"};
  for (int a = 0; a < 3; ++a)
    if (now[a] != saved.fingerprint[a]) mixattn::detail::raise_other_data(fn, "saved", names[a]);
}

/// Sizes the backward's scratch (no allocation when the shapes repeat).
template <class T>
void prepare_backward(BackwardScratch<T>& w, Index groups, Index snaps, Index capacity, Index c,
                      Index r, Index dv) {
  w.checkpoints.resize(static_cast<std::size_t>(groups));
  w.snaps.resize(static_cast<std::size_t>(snaps));
  for (auto& d : w.checkpoints) d.allocate(capacity, r, dv);
  for (auto& d : w.snaps) d.allocate(capacity, r, dv);
  w.work.allocate(capacity, r, dv);
  w.update.reserve(capacity, r, dv);
  w.kb.resize(c, r);
  w.vb.resize(c, dv);
  w.qh.resize(c, r);
  w.dkb.resize(c, r);
  w.dvb.resize(c, dv);
  w.ddk.setZero(capacity, r);
  w.ddv.setZero(capacity, dv);
  w.logc.resize(capacity);
  w.sc.reserve(capacity, c, r, true);
  w.hits.assign(static_cast<std::size_t>(capacity), 0);
}

/// Validates dL/d(end state) against the state the recorded forward ended in: n_end centroids
/// and p_end pending tokens, of the start state's widths.
template <class T>
void check_state_grad(const char* fn, const StateGrad<T>& gs, const Saved<T>& saved, Index n_end,
                      Index p_end, bool check_finite) {
  const Index r = saved.start.keys.cols(), dv = saved.start.values.cols();
  require(gs.keys.rows() == n_end && gs.keys.cols() == r && gs.values.rows() == n_end &&
              gs.values.cols() == dv,
          fn, "grad_state_out.keys is ", shape_str(gs.keys), " and grad_state_out.values is ",
          shape_str(gs.values), " but the end state's dictionary is ", n_end, " x ", r, " and ",
          n_end, " x ", dv);
  require(gs.pending_keys.rows() == p_end && gs.pending_keys.cols() == r &&
              gs.pending_values.rows() == p_end && gs.pending_values.cols() == dv,
          fn, "grad_state_out.pending_keys is ", shape_str(gs.pending_keys),
          " and grad_state_out.pending_values is ", shape_str(gs.pending_values),
          " but the end state's unfinished block is ", p_end, " x ", r, " and ", p_end, " x ", dv);
  if (check_finite) {
    require_finite(gs.keys, fn, "grad_state_out.keys");
    require_finite(gs.values, fn, "grad_state_out.values");
    require_finite(gs.pending_keys, fn, "grad_state_out.pending_keys");
    require_finite(gs.pending_values, fn, "grad_state_out.pending_values");
  }
  if (gs.state_fingerprint != 0 && gs.state_fingerprint != saved.end_fingerprint)
    mixattn::detail::raise_invalid_argument(concat(
        fn,
        ": grad_state_out came from other data: it is the gradient of a state other than the "
        "one this piece's forward ended in (run the pieces' backwards in reverse order, each "
        "given its successor's grad.state)"));
}

/// Starts the reverse pass from dL/d(end state) (SPEC 2.4, across pieces; zero without one):
/// the running-mean accumulators ddk, ddv (zeroed by prepare_backward) take dD_T on the end
/// dictionary's n_end rows, dpk, dpv take d pending_T. Reads gs before grad.state (which gs may
/// be) is overwritten.
template <class T>
void load_end_grad(BackwardScratch<T>& w, const StateGrad<T>* gs, Index n_end, Index r, Index dv) {
  if (gs == nullptr) {
    w.dpk.resize(0, r);
    w.dpv.resize(0, dv);
    return;
  }
  w.ddk.topRows(n_end) = gs->keys;
  w.ddv.topRows(n_end) = gs->values;
  w.dpk = gs->pending_keys;
  w.dpv = gs->pending_values;
}

/// Zeroes grad.state to the start state's shapes and adds d pending_T to the tokens the end
/// state's pending rows copy: sequence positions [complete C, P0 + T), the start's own pending
/// tokens below P0 (only when no block completed), the call's rows (normalised keys) above.
template <class T>
void begin_state_grad(Grad<T>& g, const BackwardScratch<T>& w, const State<T>& st,
                      const Blocks& blocks) {
  g.state.keys.setZero(st.keys.rows(), st.keys.cols());
  g.state.values.setZero(st.values.rows(), st.values.cols());
  g.state.pending_keys.setZero(blocks.p0, st.pending_keys.cols());
  g.state.pending_values.setZero(blocks.p0, st.pending_values.cols());
  const Index first = blocks.complete * blocks.c;
  for (Index i = 0; i < w.dpk.rows(); ++i) {
    const Index pos = first + i;
    if (pos < blocks.p0) {
      g.state.pending_keys.row(pos) += w.dpk.row(i);
      g.state.pending_values.row(pos) += w.dpv.row(i);
    } else {
      g.k.row(pos - blocks.p0) += w.dpk.row(i);
      g.v.row(pos - blocks.p0) += w.dpv.row(i);
    }
  }
}

/// Through the running means of block u's update (grad_through_dictionary): token j -> n
/// receives dD_new[n] / c_new (the start state's pending tokens into grad.state); a surviving
/// row keeps (c_old / c_new) dD_new[n]; rows the block opened did not exist before it.
template <class T>
void through_update(BackwardScratch<T>& w, const Dictionary<T>& d, const Saved<T>& saved,
                    const Blocks& blocks, Index u, Grad<T>& g) {
  using W = wide_t<T>;
  const Index c = saved.block, n = d.size, b0 = blocks.begin(u);
  const std::int32_t* a = saved.assignment.data() + b0;
  const Index nu = saved.new_centroids[static_cast<std::size_t>(u)];
  for (Index j = 0; j < c; ++j) ++w.hits[a[j]];
  for (Index j = 0; j < c; ++j) {
    const Index nn = a[j], pos = b0 + j;
    const W c_old = nn < n ? static_cast<W>(d.counts[nn]) : W(0);
    const T inv = static_cast<T>(W(1) / (c_old + static_cast<W>(w.hits[nn])));
    const bool start = pos < blocks.p0;
    (start ? g.state.pending_keys.row(pos) : g.k.row(pos - blocks.p0)) += inv * w.ddk.row(nn);
    (start ? g.state.pending_values.row(pos) : g.v.row(pos - blocks.p0)) += inv * w.ddv.row(nn);
  }
  for (Index j = 0; j < c; ++j) {
    const Index nn = a[j];
    if (w.hits[nn] == 0) continue;
    if (nn < n) {
      const W c_old = static_cast<W>(d.counts[nn]);
      const T keep = static_cast<T>(c_old / (c_old + static_cast<W>(w.hits[nn])));
      w.ddk.row(nn) *= keep;
      w.ddv.row(nn) *= keep;
    }
    w.hits[nn] = 0;
  }
  w.ddk.middleRows(n, nu).setZero();
  w.ddv.middleRows(n, nu).setZero();
}

/// The backward of one block u from the dictionary d it attended to. With the gradient stopped
/// at the dictionary nothing passes a block's update, and only block 0's reads of the start
/// dictionary are differentiated (the start state is an input of the call).
template <class T>
void block_backward(BackwardScratch<T>& w, const Dictionary<T>& d, const ConstMatrixRef<T>& q,
                    const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt,
                    const Blocks& blocks, Index u, T s, wide_t<T>& ds, Grad<T>& g) {
  const Index n = d.size, pq = blocks.query_offset(u), m = blocks.queries(u);
  const Index row = blocks.call_row(u);
  const bool through = opt.grad_through_dictionary, dict_grad = through || u == 0;
  normalize_rows<T>(q.middleRows(row, m), w.qh.topRows(m), opt.norm_eps);
  if (blocks.is_complete(u)) {
    if (through) {
      through_update(w, d, saved, blocks, u, g);
    } else {
      w.ddk.setZero();
      w.ddv.setZero();
    }
  }
  log_counts(d, w.logc);
  const T* lc = opt.count_bias ? w.logc.data() : nullptr;
  const Index l_all = pq + m;
  w.dkb.topRows(l_all).setZero();
  w.dvb.topRows(l_all).setZero();
  for (Index t0 = 0; t0 < m; t0 += query_tile) {
    const Index mt = std::min(query_tile, m - t0), l = pq + t0 + mt;
    tile_backward<T>(w.qh.middleRows(t0, mt), d.keys.topRows(n), d.values.topRows(n), lc,
                     w.kb.topRows(l), w.vb.topRows(l), pq + t0, s,
                     grad_out.middleRows(row + t0, mt), w.sc, g.q.middleRows(row + t0, mt), ds,
                     w.dkb.topRows(l), w.dvb.topRows(l), dict_grad, w.ddk.topRows(n),
                     w.ddv.topRows(n));
  }
  g.k.middleRows(row, m) += w.dkb.middleRows(pq, m);
  g.v.middleRows(row, m) += w.dvb.middleRows(pq, m);
  if (pq > 0) {  // block 0 read the start state's pending tokens
    g.state.pending_keys += w.dkb.topRows(pq);
    g.state.pending_values += w.dvb.topRows(pq);
  }
}

/// The blocks in reverse. Dictionaries before each block come from replaying the recorded
/// updates: a first pass keeps one checkpoint every `group` blocks; then, group by group from
/// the end, the group's dictionaries are rebuilt from its checkpoint and its blocks are
/// differentiated in reverse.
template <class T>
void reverse_blocks(BackwardScratch<T>& w, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                    const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                    const Saved<T>& saved, const Options& opt, const Blocks& blocks, Index group,
                    T s, wide_t<T>& ds, Grad<T>& g) {
  const State<T>& st = saved.start;
  const Index groups = (blocks.count + group - 1) / group;
  // Loads block u's normalised keys and values (the start state's pending ones first).
  const auto load_block = [&](Index u) {
    const Index pq = blocks.query_offset(u), m = blocks.queries(u), row = blocks.call_row(u);
    if (u == 0 && blocks.p0 > 0) {
      w.kb.topRows(blocks.p0) = st.pending_keys;
      w.vb.topRows(blocks.p0) = st.pending_values;
    }
    normalize_rows<T>(k.middleRows(row, m), w.kb.middleRows(pq, m), opt.norm_eps);
    w.vb.middleRows(pq, m) = v.middleRows(row, m);
  };
  const auto replay = [&](Index u) {
    load_block(u);
    w.update.apply(w.work, w.kb, w.vb, saved.assignment.data() + blocks.begin(u),
                   saved.new_centroids[static_cast<std::size_t>(u)]);
  };

  w.work.load(st.keys, st.values, st.counts);
  for (Index u = 0; u < blocks.count; ++u) {
    if (u % group == 0) w.checkpoints[static_cast<std::size_t>(u / group)].copy_from(w.work);
    if (blocks.is_complete(u) && u + 1 < blocks.count) replay(u);
  }
  for (Index gi = groups - 1; gi >= 0; --gi) {
    const Index lo = gi * group, hi = std::min(blocks.count, lo + group);
    w.work.copy_from(w.checkpoints[static_cast<std::size_t>(gi)]);
    for (Index u = lo; u < hi; ++u) {
      w.snaps[static_cast<std::size_t>(u - lo)].copy_from(w.work);
      if (blocks.is_complete(u) && u + 1 < hi) replay(u);
    }
    for (Index u = hi - 1; u >= lo; --u) {
      load_block(u);
      block_backward<T>(w, w.snaps[static_cast<std::size_t>(u - lo)], q, grad_out, saved, opt,
                        blocks, u, s, ds, g);
    }
  }
}

/// backward_into's body; gs: dL/d(end state), or null when the end state has no further use.
template <class T>
void backward(const char* fn, Grad<T>& g, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
              const ConstMatrixRef<T>& v, T beta, const ConstMatrixRef<T>& grad_out,
              const Saved<T>& saved, const Options& opt, const StateGrad<T>* gs) {
  using W = wide_t<T>;
  check_backward<T>(fn, q, k, v, beta, grad_out, saved, opt);
  const Index r = saved.start.keys.cols(), dv = saved.start.values.cols(), tn = saved.tokens;
  const Index c = saved.block;
  const State<T>& st = saved.start;
  const Blocks blocks(c, st.pending_keys.rows(), tn);
  MIXATTN_ASSERT(static_cast<Index>(saved.new_centroids.size()) == blocks.complete);
  MIXATTN_ASSERT(static_cast<Index>(saved.assignment.size()) == blocks.total);
  const Index n_final = st.keys.rows() + static_cast<Index>(saved.seeds.size());
  if (gs != nullptr)
    check_state_grad<T>(fn, *gs, saved, n_final, blocks.total - blocks.complete * c,
                        opt.check_finite);
  const Index capacity = std::max<Index>(n_final, 1);
  const Index group = std::max<Index>(
      1, static_cast<Index>(std::ceil(std::sqrt(static_cast<double>(blocks.count)))));
  BackwardScratch<T>& w = g.scratch;
  prepare_backward(w, (blocks.count + group - 1) / group, std::min(group, blocks.count), capacity,
                   c, r, dv);
  load_end_grad(w, gs, n_final, r, dv);
  g.q.setZero(tn, r);
  g.k.setZero(tn, r);
  g.v.setZero(tn, dv);
  g.beta = T(0);
  begin_state_grad(g, w, st, blocks);
  const T s = beta * static_cast<T>(std::sqrt(static_cast<double>(r)));
  W ds = 0;
  reverse_blocks<T>(w, q, k, v, grad_out, saved, opt, blocks, group, s, ds, g);
  normalize_backward<T>(q, g.q, opt.norm_eps);
  normalize_backward<T>(k, g.k, opt.norm_eps);
  g.beta = static_cast<T>(ds * std::sqrt(static_cast<W>(r)));
  g.state.keys = w.ddk.topRows(st.keys.rows());
  g.state.values = w.ddv.topRows(st.keys.rows());
  g.state.state_fingerprint = state_fingerprint(st);
  if (opt.check_finite) {
    const char* culprit = gs != nullptr ? "q, k, v, beta, grad_out or grad_state_out is"
                                        : "q, k, v, beta or grad_out is";
    mixattn::detail::require_finite_result(g.q, fn, "the gradient of q", culprit);
    mixattn::detail::require_finite_result(g.k, fn, "the gradient of k", culprit);
    mixattn::detail::require_finite_result(g.v, fn, "the gradient of v", culprit);
    mixattn::detail::require_finite_result(Eigen::Map<const Vector<T>>(&g.beta, 1), fn,
                                           "the gradient of beta", culprit);
    mixattn::detail::require_finite_result(g.state.keys, fn,
                                           "the gradient of the start state's keys", culprit);
    mixattn::detail::require_finite_result(g.state.values, fn,
                                           "the gradient of the start state's values", culprit);
    mixattn::detail::require_finite_result(
        g.state.pending_keys, fn, "the gradient of the start state's pending_keys", culprit);
    mixattn::detail::require_finite_result(
        g.state.pending_values, fn, "the gradient of the start state's pending_values", culprit);
  }
}

}  // namespace detail

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
  detail::backward<T>("mixattn::ovq::backward", g, q, k, v, beta, grad_out, saved, opt,
                      static_cast<const StateGrad<T>*>(nullptr));
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
  detail::backward<T>("mixattn::ovq::backward", g, q, k, v, beta, grad_out, saved, opt,
                      grad_state_out);
  return g;
}

/// backward into caller-owned gradients (resized; the working memory is kept in `grad`, so calls
/// whose shapes repeat allocate nothing).
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                   const ConstMatrixRef<T>& v, typename mixattn::detail::identity<T>::type beta,
                   const ConstMatrixRef<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::backward<T>("mixattn::ovq::backward_into", grad, q, k, v, beta, grad_out, saved, opt,
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
  detail::backward<T>("mixattn::ovq::backward_into", grad, q, k, v, beta, grad_out, saved, opt,
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
namespace ovq {
namespace detail {
#define MIXATTN_OVQ_INSTANCES(T)                                                                  \
  MIXATTN_TEMPLATE_INSTANCE void forward<T>(                                                      \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,                \
      const ConstMatrixRef<T>&, T, const Options&, const State<T>&, State<T>&, Saved<T>*);        \
  MIXATTN_TEMPLATE_INSTANCE void backward<T>(                                                     \
      const char*, Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,                  \
      const ConstMatrixRef<T>&, T, const ConstMatrixRef<T>&, const Saved<T>&, const Options&,     \
      const StateGrad<T>*);
MIXATTN_OVQ_INSTANCES(float)
MIXATTN_OVQ_INSTANCES(double)
#undef MIXATTN_OVQ_INSTANCES
}  // namespace detail
}  // namespace ovq
#endif
MIXATTN_END_NAMESPACE
