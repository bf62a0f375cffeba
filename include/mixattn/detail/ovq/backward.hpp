// mixattn/detail/ovq/backward.hpp — OVQ's backward (SPEC.md §2.4): the running-mean backward
// (through_update), one block's backward (block_backward), the checkpoint replayer (reverse_blocks)
// and the entry point's body (ovq_backward).
//
// Internal: included by mixattn/ovq.hpp after its forward.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/ovq/forward.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Validates a backward call.
template <class T>
void ovq_check_backward(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                        const ConstMatrixRef<T>& v, T beta, const ConstMatrixRef<T>& grad_out,
                        const ovq::Saved<T>& saved, const ovq::Options& opt) {
  ovq_check_options(opt, fn);
  require(saved.recorded, fn, "saved was not filled by mixattn::ovq::forward");
  const Index r = saved.start.keys.cols(), d_v = saved.start.values.cols(), tn = saved.tokens;
  ovq_check_inputs<T>(q, k, v, r, d_v, "saved", fn);
  require(q.rows() == tn, fn, "q has ", q.rows(), " rows but saved is for ", tn, " tokens");
  require(grad_out.rows() == tn && grad_out.cols() == d_v, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", tn, " x ", d_v);
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
void prepare_backward(OvqBackwardScratch<T>& w, Index groups, Index snaps, Index capacity, Index c,
                      Index r, Index d_v) {
  w.checkpoints.resize(static_cast<std::size_t>(groups));
  w.snaps.resize(static_cast<std::size_t>(snaps));
  for (auto& d : w.checkpoints) d.allocate(capacity, r, d_v);
  for (auto& d : w.snaps) d.allocate(capacity, r, d_v);
  w.work.allocate(capacity, r, d_v);
  w.update.reserve(capacity, r, d_v);
  w.kb.resize(c, r);
  w.vb.resize(c, d_v);
  w.qh.resize(c, r);
  w.dkb.resize(c, r);
  w.dvb.resize(c, d_v);
  w.ddk.setZero(capacity, r);
  w.ddv.setZero(capacity, d_v);
  w.logc.resize(capacity);
  w.sc.reserve(capacity, c, r, true);
  w.hits.assign(static_cast<std::size_t>(capacity), 0);
}

/// Validates dL/d(end state) against the state the recorded forward ended in: n_end centroids
/// and p_end pending tokens, of the start state's widths.
template <class T>
void ovq_check_state_grad(const char* fn, const ovq::StateGrad<T>& gs, const ovq::Saved<T>& saved,
                          Index n_end, Index p_end, bool check_finite) {
  const Index r = saved.start.keys.cols(), d_v = saved.start.values.cols();
  require(gs.keys.rows() == n_end && gs.keys.cols() == r && gs.values.rows() == n_end &&
              gs.values.cols() == d_v,
          fn, "grad_state_out.keys is ", shape_str(gs.keys), " and grad_state_out.values is ",
          shape_str(gs.values), " but the end state's dictionary is ", n_end, " x ", r, " and ",
          n_end, " x ", d_v);
  require(gs.pending_keys.rows() == p_end && gs.pending_keys.cols() == r &&
              gs.pending_values.rows() == p_end && gs.pending_values.cols() == d_v,
          fn, "grad_state_out.pending_keys is ", shape_str(gs.pending_keys),
          " and grad_state_out.pending_values is ", shape_str(gs.pending_values),
          " but the end state's unfinished block is ", p_end, " x ", r, " and ", p_end, " x ", d_v);
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
void load_end_grad(OvqBackwardScratch<T>& w, const ovq::StateGrad<T>* gs, Index n_end, Index r,
                   Index d_v) {
  if (gs == nullptr) {
    w.dpk.resize(0, r);
    w.dpv.resize(0, d_v);
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
void begin_state_grad(ovq::Grad<T>& g, const OvqBackwardScratch<T>& w, const ovq::State<T>& st,
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
void through_update(OvqBackwardScratch<T>& w, const Dictionary<T>& d, const ovq::Saved<T>& saved,
                    const Blocks& blocks, Index u, ovq::Grad<T>& g) {
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
void block_backward(OvqBackwardScratch<T>& w, const Dictionary<T>& d, const ConstMatrixRef<T>& q,
                    const ConstMatrixRef<T>& grad_out, const ovq::Saved<T>& saved,
                    const ovq::Options& opt, const Blocks& blocks, Index u, T s, wide_t<T>& ds,
                    ovq::Grad<T>& g) {
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
void reverse_blocks(OvqBackwardScratch<T>& w, const ConstMatrixRef<T>& q,
                    const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                    const ConstMatrixRef<T>& grad_out, const ovq::Saved<T>& saved,
                    const ovq::Options& opt, const Blocks& blocks, Index group, T s, wide_t<T>& ds,
                    ovq::Grad<T>& g) {
  const ovq::State<T>& st = saved.start;
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
void ovq_backward_into(const char* fn, ovq::Grad<T>& g, const ConstMatrixRef<T>& q,
                       const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v, T beta,
                       const ConstMatrixRef<T>& grad_out, const ovq::Saved<T>& saved,
                       const ovq::Options& opt, const ovq::StateGrad<T>* gs) {
  using W = wide_t<T>;
  ovq_check_backward<T>(fn, q, k, v, beta, grad_out, saved, opt);
  const Index r = saved.start.keys.cols(), d_v = saved.start.values.cols(), tn = saved.tokens;
  const Index c = saved.block;
  const ovq::State<T>& st = saved.start;
  const Blocks blocks(c, st.pending_keys.rows(), tn);
  MIXATTN_ASSERT(static_cast<Index>(saved.new_centroids.size()) == blocks.complete);
  MIXATTN_ASSERT(static_cast<Index>(saved.assignment.size()) == blocks.total);
  const Index n_final = st.keys.rows() + static_cast<Index>(saved.seeds.size());
  if (gs != nullptr)
    ovq_check_state_grad<T>(fn, *gs, saved, n_final, blocks.total - blocks.complete * c,
                            opt.check_finite);
  const Index capacity = std::max<Index>(n_final, 1);
  const Index group = std::max<Index>(
      1, static_cast<Index>(std::ceil(std::sqrt(static_cast<double>(blocks.count)))));
  OvqBackwardScratch<T>& w = g.scratch.get();
  prepare_backward(w, (blocks.count + group - 1) / group, std::min(group, blocks.count), capacity,
                   c, r, d_v);
  load_end_grad(w, gs, n_final, r, d_v);
  g.q.setZero(tn, r);
  g.k.setZero(tn, r);
  g.v.setZero(tn, d_v);
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
MIXATTN_END_NAMESPACE
