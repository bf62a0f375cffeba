// mixattn/detail/ovq/forward.hpp — OVQ's forward (SPEC.md §2.2–2.3): validation, the block loop,
// the record for backward, the overflow check.
//
// Internal: part of mixattn/ovq.hpp; the records it works on are in mixattn/ovq_types.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/ovq/scratch.hpp"
#include "mixattn/ovq_types.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

inline void ovq_check_options(const ovq::Options& opt, const char* fn) {
  require(opt.block >= 1, fn, "options.block is ", opt.block, ", must be >= 1");
  require(opt.max_centroids >= 1 && opt.max_centroids <= std::numeric_limits<std::int32_t>::max(),
          fn, "options.max_centroids is ", opt.max_centroids, ", must be in [1, 2^31 - 1]");
  require(opt.growth_alpha >= 0 && std::isfinite(opt.growth_alpha), fn, "options.growth_alpha is ",
          opt.growth_alpha, ", must be finite and >= 0");
  require(opt.norm_eps > 0 && std::isfinite(opt.norm_eps), fn, "options.norm_eps is ", opt.norm_eps,
          ", must be finite and > 0");
  require(opt.assignment == ovq::Assignment::all_centroids ||
              opt.assignment == ovq::Assignment::existing_only,
          fn, "options.assignment is ", static_cast<int>(opt.assignment),
          ", must be Assignment::all_centroids or Assignment::existing_only");
}

/// Every part of the state must agree before anything is read from it (shapes, counts; the
/// matrices' values: check_state_values). O(N_t), no scan of the matrices.
template <class T>
void ovq_check_state(const ovq::State<T>& st, const ovq::Options& opt, const char* fn) {
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
void ovq_check_state_values(const ovq::State<T>& st, const char* fn) {
  require_finite(st.keys, fn, "state.keys");
  require_finite(st.values, fn, "state.values");
  require_finite(st.pending_keys, fn, "state.pending_keys");
  require_finite(st.pending_values, fn, "state.pending_values");
}

/// Shapes of q, k, v (and grad_out when given) against the key and value widths.
template <class T>
void ovq_check_inputs(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v, Index r, Index d_v, const char* where,
                      const char* fn) {
  require(q.cols() == r, fn, "q has ", q.cols(), " columns but ", where, " has key width ", r,
          " (q: ", shape_str(q), ")");
  require(k.cols() == r, fn, "k has ", k.cols(), " columns but ", where, " has key width ", r,
          " (k: ", shape_str(k), ")");
  require(v.cols() == d_v, fn, "v has ", v.cols(), " columns but ", where, " has value width ", d_v,
          " (v: ", shape_str(v), ")");
  require(k.rows() == q.rows(), fn, "k has ", k.rows(), " rows but q has ", q.rows());
  require(v.rows() == q.rows(), fn, "v has ", v.rows(), " rows but q has ", q.rows());
}

/// x_hat = x / (||x|| + eps) row by row, the norm summed in the wide type in a fixed order so
/// that a token's normalised key is the same bits whichever call normalises it.
/// The sum of squares in W: in SIMD builds a vector of W lanes (lane l takes columns l, l + w,
/// ... in order), then the lanes' sum and the columns past the last whole vector; the bits
/// depend on the row alone, never on which call or how many rows are normalised together.
template <class T>
void normalize_rows(const ConstMatrixRef<T>& x, Eigen::Ref<Matrix<T>> out, double eps) {
  using W = wide_t<T>;
  const Index cols = x.cols();
  for (Index i = 0; i < x.rows(); ++i) {
    const T* a = x.row(i).data();
    W ss = 0;
    Index c = 0;
#if MIXATTN_HAS_SIMD
    using BW = xsimd::batch<W, simd_arch>;
    constexpr Index ww = static_cast<Index>(BW::size);
    if (cols >= ww) {
      BW acc(W(0));
      for (; c + ww <= cols; c += ww) {
        const BW v = load_wide<simd_arch>(a + c);
        acc = xsimd::fma(v, v, acc);
      }
      ss = xsimd::hadd(acc);
    }
#endif
    for (; c < cols; ++c) ss += static_cast<W>(a[c]) * static_cast<W>(a[c]);
    // times the reciprocal in W: within an ulp of W of the quotient, so the same T value but
    // for ties of T's rounding, with one multiply per entry instead of a division
    const W inv = W(1) / (std::sqrt(ss) + static_cast<W>(eps));
    T* o = out.row(i).data();
    for (c = 0; c < cols; ++c) o[c] = static_cast<T>(static_cast<W>(a[c]) * inv);
  }
}

/// Backward of x_hat = x / (n + eps), n = ||x||: with g = dL/dx_hat (overwritten by dL/dx),
///   dx = (g - x (x . g) / (n (n + eps))) / (n + eps),
/// and dx = g / eps at x = 0, where the second term vanishes in the limit.
template <class T>
void normalize_backward(const ConstMatrixRef<T>& x, Eigen::Ref<Matrix<T>> g, double eps) {
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
std::uint64_t state_fingerprint(const ovq::State<T>& st) {
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
void append_rows(Matrix<T>& m, const ConstMatrixRef<T>& rows) {
  if (rows.rows() == 0) return;
  const Index n = m.rows();
  m.conservativeResize(n + rows.rows(), m.cols());
  m.bottomRows(rows.rows()) = rows;
}

/// Validates a forward call; returns s = beta sqrt(r).
template <class T>
T ovq_check_forward(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                    const ConstMatrixRef<T>& v, T beta, const ovq::Options& opt,
                    const ovq::State<T>& state) {
  ovq_check_options(opt, fn);
  ovq_check_state(state, opt, fn);
  const Index r = state.keys.cols(), d_v = state.values.cols(), tn = q.rows();
  ovq_check_inputs<T>(q, k, v, r, d_v, "state.keys", fn);
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
void begin_record(ovq::Saved<T>& saved, const ovq::State<T>& start, const ovq::Options& opt,
                  const Blocks& blocks, Index tn, T beta) {
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
                    const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, T s,
                    const ovq::Options& opt, const ovq::State<T>& start, const Blocks& blocks,
                    Index capacity, Dictionary<T>& dict, DictionaryLoan<T>* loan,
                    OvqForwardScratch<T>& w, ovq::Saved<T>* saved) {
  const Index t_start = start.tokens_seen - blocks.p0;  // tokens absorbed before the call
  log_counts(dict, w.logc);
  for (Index u = 0; u < blocks.count; ++u) {
    const Index pq = blocks.query_offset(u), m = blocks.queries(u), row = blocks.call_row(u);
    const Index po = u == 0 ? blocks.p0 : 0;
    const ConstMatrixRef<T> ko = start.pending_keys.topRows(po),
                            vo = start.pending_values.topRows(po);
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
      if (check && !(finite && all_finite(o))) {
        if (loan != nullptr) loan->give_back();  // nothing changed yet
        ovq_check_state_values(start, fn);       // throws if the state is to blame
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
void store_pending(const OvqForwardScratch<T>& w, const ovq::State<T>& start, const Blocks& blocks,
                   Index tn, ovq::State<T>& next) {
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
bool large_values(const ConstMatrixRef<T>& v, const ovq::Options& opt) {
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
void ovq_check_overflow(const char* fn, const Matrix<T>& out, const Dictionary<T>& dict,
                        bool absorbed, DictionaryLoan<T>* loan, ovq::State<T>* restore,
                        ovq::State<T>& kept) {
  if (all_finite(out) && (!absorbed || all_finite(dict.values.topRows(dict.size)))) return;
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
void ovq_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                      const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, T beta,
                      const ovq::Options& opt, const ovq::State<T>& start, ovq::State<T>& next,
                      ovq::Saved<T>* saved) {
  const T s = ovq_check_forward<T>(fn, q, k, v, beta, opt, start);
  const Index r = start.keys.cols(), d_v = start.values.cols(), tn = q.rows();
  if (opt.check_finite && (tn == 0 || saved != nullptr)) ovq_check_state_values(start, fn);
  const Index c = opt.block, n_start = start.keys.rows();
  const Blocks blocks(c, start.pending_keys.rows(), tn);
  const Index capacity =
      std::max(n_start, std::min(opt.max_centroids, n_start + blocks.complete * c));
  const Index rows_new = std::min(c, std::max<Index>(tn, 1));  // call tokens of one block
  const Index tokens_after = start.tokens_seen + tn;

  OvqForwardScratch<T>& w =  // calls without `saved` work in this thread's
      saved != nullptr ? saved->scratch.get() : thread_scratch<OvqForwardScratch<T>>();
  if (saved != nullptr) begin_record(*saved, start, opt, blocks, tn, beta);
  w.kn.resize(rows_new, r);
  w.vn.resize(rows_new, d_v);
  w.qh.resize(rows_new, r);
  w.logc.resize(capacity);
  w.sc.reserve(capacity, c, r, false, rows_new);
  if (blocks.complete > 0) w.absorb.reserve(opt, capacity, r, d_v, saved == nullptr);
  out.resize(tn, d_v);
  if (&start == &next) {
    // Values near T's limit, in v, in the unfinished block or in the dictionary, when the call
    // absorbs a block (only then is the dictionary changed before the overflow check): keep a
    // copy of the state, so that an overflow's domain_error leaves it as it was. The dictionary
    // scan costs no more than the absorption's own pass over it; a call that absorbs nothing
    // never scans it.
    const bool keep = blocks.complete > 0 &&
                      (large_values<T>(v, opt) || large_values<T>(start.pending_values, opt) ||
                       large_values<T>(start.values, opt));
    ovq::State<T> kept;
    if (keep) kept = start;
    DictionaryLoan<T> loan(next);
    forward_blocks<T>(fn, out, q, k, v, s, opt, start, blocks, capacity, loan.dict, &loan, w,
                      saved);
    if (opt.check_finite)
      ovq_check_overflow<T>(fn, out, loan.dict, blocks.complete > 0, &loan, keep ? &next : nullptr,
                            kept);
    store_pending<T>(w, start, blocks, tn, next);
    loan.give_back();
  } else {
    w.dict.allocate(capacity, r, d_v);
    w.dict.load(start.keys, start.values, start.counts);
    forward_blocks<T>(fn, out, q, k, v, s, opt, start, blocks, capacity, w.dict, nullptr, w, saved);
    ovq::State<T> unused;
    if (opt.check_finite)
      ovq_check_overflow<T>(fn, out, w.dict, blocks.complete > 0, nullptr, nullptr, unused);
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
MIXATTN_END_NAMESPACE
