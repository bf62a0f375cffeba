// mixattn/packed.hpp — packed variable-length batches: B sequences of different lengths stacked
// along the rows, H heads side by side in the columns, one call.
//
// Layout (the cu_seqlens convention of FlashAttention and PyTorch's nested tensors):
//   offsets: B + 1 nondecreasing row indices, offsets[0] = 0, offsets[B] = total rows;
//            sequence b is rows [offsets[b], offsets[b+1]).
//   q: total_q x (H_q r), k: total_k x (H_kv r), v: total_k x (H_kv d_v), out: total_q x (H_q d_v);
//   head h reads and writes column block h (as in batched.hpp).
// Cross-attention gives keys their own offsets (k_offsets); self-attention passes the same
// vector twice. Grouped-query attention (flash and OVQ): H_q query heads share H_kv key/value
// heads, H_q a multiple of H_kv; query head h reads key/value head h / (H_q / H_kv).
//
// Every (sequence, head) pair is one independent call of the single-sequence operator, so the
// results equal B x H separate calls bit for bit whatever the thread count; gradients of shared
// parameters (a head's mixture, OVQ's beta, a shared key/value head) are the separate calls'
// gradients summed in sequence order (then query-head order). Pairs run on up to `threads`
// threads (0: all cores) of the library's pool, the most expensive first, each thread taking the
// next pair when it finishes one, so mixed lengths balance.
//
// Records (PackedSaved, PackedGrad) keep one record per pair and are reused: with the same
// offsets and shapes, a step allocates nothing in steady state (one thread; the pool's
// scheduling aside). An item's output and (GMA) its dq, dk, dv pass through a buffer of the
// running thread for the item's sequence, reused by the sequence's heads while it is in cache,
// into their blocks, large ones by stores that bypass the caches (copy_block_into); on one
// thread a forward runs the cheapest pairs first, so that its backward, most expensive first,
// starts with the records still in cache. The packed GMA backward leaves q, k, v to the finite
// checks of the forward that filled its records (each item's backward still compares them with
// its record's fingerprints). Measured in bench_batched (gma_packed_fwd_bwd against
// gma_separate_fwd_then_bwd, one thread): the copies into place through the cache and the cold
// per-pair records made the packed call 1.13x the separate calls.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/delta.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/linformer.hpp"
#include "mixattn/ovq.hpp"
#include "mixattn/parallel.hpp"
#include "mixattn/reference.hpp"
#include "mixattn/ssd.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE

namespace detail {

/// Checks that `offsets` describes `rows` rows: B + 1 >= 2 entries, 0 first, nondecreasing,
/// `rows` last.
inline void check_offsets(const char* fn, const char* name, const Offsets& offsets, Index rows) {
  require(offsets.size() >= 2, fn, name, " has ", offsets.size(),
          " entries; it needs B + 1 >= 2 (one more than the number of sequences)");
  require(offsets.front() == 0, fn, name, "[0] is ", offsets.front(), "; it must be 0");
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b)
    require(offsets[b] <= offsets[b + 1], fn, name, " decreases at ", b, ": ", offsets[b], " > ",
            offsets[b + 1]);
  require(offsets.back() == rows, fn, name, " ends at ", offsets.back(), " but the input has ",
          rows, " rows");
}

/// m.block(row0, col0, rows, cols), the block of an item of a packed call; an empty block is
/// taken at (0, 0). Eigen forms a block's address by adding its offset to the data pointer, which
/// is null for an empty matrix (a batch of empty sequences): undefined behaviour even for a block
/// that is never read.
template <class M>
Eigen::Block<M> item_block(M& m, Index row0, Index col0, Index rows, Index cols) {
  const bool empty = rows == 0 || cols == 0;
  return Eigen::Block<M>(m, empty ? 0 : row0, empty ? 0 : col0, rows, cols);
}
/// The same block of an input (ConstMatrixArg), taken of the Eigen::Ref it is.
template <class T>
Eigen::Block<const Eigen::Ref<const Matrix<T>>> item_block(const InputRef<T>& m, Index row0,
                                                           Index col0, Index rows, Index cols) {
  const Eigen::Ref<const Matrix<T>>& ref = m;
  return item_block(ref, row0, col0, rows, cols);
}

/// Destinations of at least this many bytes receive the items' blocks through stores that
/// bypass the caches. Such a destination is several times a core's L2 (2 MiB here): it is
/// evicted before the caller reads it back anyway, and an ordinary store first reads every
/// destination line it writes (a read for ownership), which doubled the memory traffic of the
/// copies and cost the packed GMA fwd+bwd of bench_batched ~7 ms of ~200 (a 4096-row item
/// block: 2.5 us per 64 KiB through the cache, 0.9 us streamed).
constexpr std::size_t packed_stream_bytes = std::size_t(8) << 20;

/// One vector store of v at p (aligned to the vector's size) that bypasses the caches where
/// the instruction set has one, an ordinary aligned store otherwise.
template <class Arch, class T>
inline void stream_store(T* p, const xsimd::batch<T, Arch>& v) {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    if constexpr (std::is_same<T, float>::value)
      return _mm512_stream_ps(p, v);
    else
      return _mm512_stream_pd(p, v);
  }
#endif
#if XSIMD_WITH_AVX
  if constexpr (std::is_base_of<xsimd::avx, Arch>::value) {
    if constexpr (std::is_same<T, float>::value)
      return _mm256_stream_ps(p, v);
    else
      return _mm256_stream_pd(p, v);
  }
#endif
#if XSIMD_WITH_SSE2
  if constexpr (std::is_base_of<xsimd::sse2, Arch>::value) {
    if constexpr (std::is_same<T, float>::value)
      return _mm_stream_ps(p, v);
    else
      return _mm_stream_pd(p, v);
  }
#endif
  v.store_aligned(p);
}

/// dst.block(row0, col0, src.rows(), src.cols()) = src, bit for bit; with `stream`, through
/// stream_store (unaligned heads and tails of rows by scalar stores), then a store fence so
/// that the block is visible to whichever thread reads it after this one's next
/// synchronisation.
template <class Arch, class T>
void copy_block_into(Matrix<T>& dst, Index row0, Index col0, const Matrix<T>& src, bool stream) {
  const Index rows = src.rows(), cols = src.cols();
  MIXATTN_ASSERT(row0 >= 0 && col0 >= 0 && row0 + rows <= dst.rows() && col0 + cols <= dst.cols());
#if MIXATTN_HAS_SIMD
  if constexpr (!std::is_same<Arch, scalar_arch>::value &&
                (std::is_same<T, float>::value || std::is_same<T, double>::value)) {
    if (stream) {
      using B = xsimd::batch<T, Arch>;
      constexpr Index W = static_cast<Index>(B::size);
      constexpr std::uintptr_t bytes = sizeof(T) * B::size;
      for (Index i = 0; i < rows; ++i) {
        T* d = dst.data() + (row0 + i) * dst.outerStride() + col0;
        const T* s = src.data() + i * src.outerStride();
        Index j = 0;
        for (; j < cols && reinterpret_cast<std::uintptr_t>(d + j) % bytes != 0; ++j) d[j] = s[j];
        for (; j + W <= cols; j += W) stream_store<Arch>(d + j, B::load_unaligned(s + j));
        for (; j < cols; ++j) d[j] = s[j];
      }
#if XSIMD_WITH_SSE2
      _mm_sfence();
#endif
      return;
    }
  }
#endif
  (void)stream;
  item_block(dst, row0, col0, rows, cols) = src;
}

/// Head layout of a packed call: H_q query heads of width r and H_kv key/value heads.
struct PackedHeads {
  Index batch = 0, heads = 0, kv_heads = 0, r = 0, d_v = 0;
  Index items() const { return batch * heads; }
  Index kv_of(Index h) const { return h / (heads / kv_heads); }
};

/// Validates the packed shapes; `heads` query heads, `kv_heads` key/value heads. Messages name
/// the offsets q_name and k_name, the caller's parameters; k_name nullptr: the call takes one
/// offsets vector (OVQ's `offsets`, passed as both), q_name, so k must have q's rows.
inline PackedHeads check_packed(const char* fn, Index heads, Index kv_heads, Index qc, Index kc,
                                Index vc, Index q_rows, Index k_rows, Index v_rows,
                                const Offsets& q_offsets, const Offsets& k_offsets, int threads,
                                const char* q_name = "q_offsets",
                                const char* k_name = "k_offsets") {
  require(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, fn, "heads is ", heads,
          " and key/value heads is ", kv_heads, "; both >= 1 and heads a multiple of them");
  require(qc % heads == 0 && qc > 0, fn, "q has ", qc, " columns, not a positive multiple of ",
          heads, " heads");
  const Index r = qc / heads;
  require(kc == kv_heads * r, fn, "k has ", kc, " columns but ", kv_heads,
          " key heads of dimension ", r, " need ", kv_heads * r);
  require(vc % kv_heads == 0 && vc > 0, fn, "v has ", vc, " columns, not a positive multiple of ",
          kv_heads, " value heads");
  require(v_rows == k_rows, fn, "v has ", v_rows, " rows but k has ", k_rows);
  require(threads >= 0, fn, "threads must be >= 0, got ", threads);
  const bool one_vector = k_name == nullptr;
  if (one_vector)
    require(k_rows == q_rows, fn, "k has ", k_rows, " rows but q has ", q_rows, " (", q_name,
            " describes both)");
  check_offsets(fn, q_name, q_offsets, q_rows);
  if (!one_vector) {
    check_offsets(fn, k_name, k_offsets, k_rows);
    require(q_offsets.size() == k_offsets.size(), fn, q_name, " has ", q_offsets.size(),
            " entries but ", k_name, " has ", k_offsets.size(), " (both B + 1)");
  }
  return {static_cast<Index>(q_offsets.size()) - 1, heads, kv_heads, r, vc / kv_heads};
}

/// dk, dv of the key/value heads from the per-item gradients: a key/value head's is the sum over
/// the query heads that share it, in query-head order (one term without grouping). The
/// (sequence, key/value head) blocks are independent and run on up to `threads` threads.
template <class Grad, class T>
void packed_sum_kv(const std::vector<Grad>& items, const PackedHeads& ph, const Offsets& k_offsets,
                   Index k_cols, Index v_cols, Matrix<T>& dk, Matrix<T>& dv, int threads) {
  dk.resize(k_offsets.back(), k_cols);
  dv.resize(k_offsets.back(), v_cols);
  const Index group = ph.heads / ph.kv_heads, r = ph.r, d = ph.d_v;
  parallel_for(ph.batch * ph.kv_heads, threads, [&](Index bg) {
    const Index b = bg / ph.kv_heads, g = bg % ph.kv_heads;
    const Index k0 = k_offsets[static_cast<std::size_t>(b)];
    const Index nk = k_offsets[static_cast<std::size_t>(b) + 1] - k0;
    const std::size_t first = static_cast<std::size_t>(b * ph.heads + g * group);
    item_block(dk, k0, g * r, nk, r) = items[first].k;
    item_block(dv, k0, g * d, nk, d) = items[first].v;
    for (Index j = 1; j < group; ++j) {
      item_block(dk, k0, g * r, nk, r) += items[first + static_cast<std::size_t>(j)].k;
      item_block(dv, k0, g * d, nk, d) += items[first + static_cast<std::size_t>(j)].v;
    }
  });
}

/// Threads parallel_largest_first_on_workers runs `count` items on: worker indices are
/// [0, this).
inline Index largest_first_workers(Index count, int threads) {
  return std::max<Index>(1, std::min<Index>(resolve_threads(threads), count));
}

/// Runs fn(item, worker) for every item in [0, count), the largest cost(item) first (ties by
/// index), on up to `threads` threads that each take the next item when done. `worker`, in
/// [0, largest_first_workers(count, threads)), is the same for every item one thread runs, so
/// fn may index per-thread scratch by it. With serial_reversed and one thread, the order runs
/// backwards (smallest first): nothing is left to balance, and a forward that ends with the
/// largest items leaves their records in cache for a backward that starts with them. `order`
/// is scratch.
template <class Cost, class Fn>
void parallel_largest_first_on_workers(Index count, int threads, Cost&& cost, Fn&& fn,
                                       std::vector<Index>& order, bool serial_reversed = false) {
  order.resize(static_cast<std::size_t>(count));
  for (Index i = 0; i < count; ++i) order[static_cast<std::size_t>(i)] = i;
  std::sort(order.begin(), order.end(), [&](Index a, Index b) {
    const Index ca = cost(a), cb = cost(b);
    return ca != cb ? ca > cb : a < b;
  });
  const Index workers = largest_first_workers(count, threads);
  if (workers == 1 && serial_reversed) std::reverse(order.begin(), order.end());
  std::atomic<Index> next{0};
  parallel_for(workers, threads, [&](Index w) {
    for (Index i = next++; i < count; i = next++) fn(order[static_cast<std::size_t>(i)], w);
  });
}

/// Runs fn(item) for every item in [0, count), the largest cost(item) first (ties by index),
/// on up to `threads` threads that each take the next item when done. `order` is scratch.
template <class Cost, class Fn>
void parallel_largest_first(Index count, int threads, Cost&& cost, Fn&& fn,
                            std::vector<Index>& order) {
  parallel_largest_first_on_workers(
      count, threads, std::forward<Cost>(cost), [&](Index i, Index) { fn(i); }, order);
}

/// Records of a packed call: one per (sequence b, query head h), item b H + h.
template <class T, class Record>
struct PackedRecords {
  std::vector<Record> items;
  // forward: an item's output before it is copied into place, one per (thread w, sequence b),
  // index w B + b (work_slot): the H items of a sequence, run one after another, reuse one
  // buffer of their size while it is in cache, and no buffer changes size between steps.
  std::vector<Matrix<T>> outs;
  std::vector<Index> order;  // scratch of the largest-first schedule
  Offsets q_offsets, k_offsets;
  // Set by a forward that checked q, k, v and the parameters for finite values (GMA): its
  // backward, which finds by the records' fingerprints that it has the same data, need not
  // check them again.
  bool finite_checked = false;
};

/// Gradients of a packed call: q, k, v like the inputs and one record per item.
template <class T, class Record>
struct PackedGrads {
  Matrix<T> q, k, v;
  std::vector<Record> items;
  std::vector<Index> order;
};

/// Rows and heads of one (sequence, head) item.
struct PairRows {
  Index b, h, g, q0, nq, k0, nk;  // g: the key/value head query head h reads
};

inline PairRows pair_rows(const PackedHeads& ph, const Offsets& q_offsets, const Offsets& k_offsets,
                          Index item) {
  const Index b = item / ph.heads, h = item % ph.heads;
  const std::size_t bs = static_cast<std::size_t>(b);
  return {b,
          h,
          ph.kv_of(h),
          q_offsets[bs],
          q_offsets[bs + 1] - q_offsets[bs],
          k_offsets[bs],
          k_offsets[bs + 1] - k_offsets[bs]};
}

/// The cost of an item for the schedule: n_q n_k for softmax attention, n_q + n_k otherwise.
inline Index pair_cost(const PackedHeads& ph, const Offsets& q_offsets, const Offsets& k_offsets,
                       Index item, bool quadratic) {
  const PairRows p = pair_rows(ph, q_offsets, k_offsets, item);
  return quadratic ? p.nq * p.nk : p.nq + p.nk;
}

/// Runs fn(rows, item, worker) for every (sequence, head) item of a packed call on up to
/// `threads` threads, the most expensive first (parallel_largest_first_on_workers; `order` is
/// its scratch). A forward passes forward = true: on one thread it then runs the cheapest
/// first, so that the backward, most expensive first, starts where the forward ended.
template <class Fn>
void packed_items(const PackedHeads& ph, const Offsets& q_offsets, const Offsets& k_offsets,
                  int threads, bool quadratic, std::vector<Index>& order, Fn&& fn,
                  bool forward = false) {
  parallel_largest_first_on_workers(
      ph.items(), threads,
      [&](Index i) { return pair_cost(ph, q_offsets, k_offsets, i, quadratic); },
      [&](Index i, Index w) {
        fn(pair_rows(ph, q_offsets, k_offsets, i), static_cast<std::size_t>(i), w);
      },
      order, forward);
}

/// Slots of per-(thread, sequence) working records: workers x B.
inline std::size_t work_slots(const PackedHeads& ph, int threads) {
  return static_cast<std::size_t>(largest_first_workers(ph.items(), threads) * ph.batch);
}

/// The per-(thread, sequence) record of item rows p run by worker w.
inline std::size_t work_slot(const PackedHeads& ph, const PairRows& p, Index w) {
  return static_cast<std::size_t>(w * ph.batch + p.b);
}

/// A packed forward: sizes `rec` (and out: total_q x H d_v), then runs
/// item(rows, out_item, record or nullptr) for every item, largest first, and copies each item's
/// output into its block of out while it is in cache. out_item is a buffer of the running
/// thread for the item's sequence (PackedRecords::outs), not one per item: a step writes each
/// output twice (buffer, block) and touches no more memory than the separate calls would.
template <class T, class Record, class Item>
void packed_forward(Matrix<T>& out, const PackedHeads& ph, const Offsets& q_offsets,
                    const Offsets& k_offsets, PackedRecords<T, Record>& rec, bool keep, int threads,
                    bool quadratic, Item&& item) {
  const std::size_t items = static_cast<std::size_t>(ph.items());
  rec.items.resize(keep ? items : 0);
  rec.outs.resize(work_slots(ph, threads));
  rec.q_offsets = q_offsets;
  rec.k_offsets = k_offsets;
  rec.finite_checked = false;
  out.resize(q_offsets.back(), ph.heads * ph.d_v);
  const bool stream = static_cast<std::size_t>(out.size()) * sizeof(T) >= packed_stream_bytes;
  packed_items(
      ph, q_offsets, k_offsets, threads, quadratic, rec.order,
      [&](const PairRows& p, std::size_t i, Index w) {
        Matrix<T>& o = rec.outs[work_slot(ph, p, w)];
        item(p, o, keep ? &rec.items[i] : nullptr);
        copy_block_into<simd_arch>(out, p.q0, p.h * ph.d_v, o, stream);
      },
      true);
}

/// Checks a packed backward's grad_out and records against the call.
template <class T, class Record>
void check_packed_backward(const char* fn, const PackedHeads& ph, Index q_rows,
                           const ConstMatrixRef<T>& grad_out, const Offsets& q_offsets,
                           const Offsets& k_offsets, const PackedRecords<T, Record>& saved) {
  require(grad_out.rows() == q_rows && grad_out.cols() == ph.heads * ph.d_v, fn, "grad_out is ",
          shape_str(grad_out), " but the output is ", q_rows, " x ", ph.heads * ph.d_v);
  require(static_cast<Index>(saved.items.size()) == ph.items() && saved.q_offsets == q_offsets &&
              saved.k_offsets == k_offsets,
          fn, "saved holds ", saved.items.size(), " records for other offsets; this call has ",
          ph.items(), " (sequence, head) pairs (fill it with the packed forward, with saved)");
}

/// A packed backward: runs item(rows, grad_item, saved_item) for every item, largest first,
/// and copies each item's dq (and without grouped heads its dk, dv) into place while it is
/// still in cache; grouped heads' dk, dv are summed afterwards (packed_sum_kv).
template <class T, class Record, class GradRecord, class Item>
void packed_backward(PackedGrads<T, GradRecord>& grad, const PackedHeads& ph,
                     const Offsets& q_offsets, const Offsets& k_offsets,
                     const PackedRecords<T, Record>& saved, int threads, bool quadratic,
                     Item&& item) {
  const bool grouped = ph.heads != ph.kv_heads;
  grad.items.resize(static_cast<std::size_t>(ph.items()));
  grad.q.resize(q_offsets.back(), ph.heads * ph.r);
  grad.k.resize(k_offsets.back(), ph.kv_heads * ph.r);
  grad.v.resize(k_offsets.back(), ph.kv_heads * ph.d_v);
  const auto streams = [](const Matrix<T>& m) {
    return static_cast<std::size_t>(m.size()) * sizeof(T) >= packed_stream_bytes;
  };
  const bool stream_q = streams(grad.q), stream_k = streams(grad.k), stream_v = streams(grad.v);
  packed_items(ph, q_offsets, k_offsets, threads, quadratic, grad.order,
               [&](const PairRows& p, std::size_t i, Index) {
                 GradRecord& g = grad.items[i];
                 item(p, g, saved.items[i]);
                 copy_block_into<simd_arch>(grad.q, p.q0, p.h * ph.r, g.q, stream_q);
                 if (grouped) return;
                 copy_block_into<simd_arch>(grad.k, p.k0, p.g * ph.r, g.k, stream_k);
                 copy_block_into<simd_arch>(grad.v, p.k0, p.g * ph.d_v, g.v, stream_v);
               });
  if (grouped)
    packed_sum_kv(grad.items, ph, k_offsets, ph.kv_heads * ph.r, ph.kv_heads * ph.d_v, grad.k,
                  grad.v, threads);
}

}  // namespace detail

namespace gma {

/// What forward_packed_into keeps for backward_packed_into: one Saved per (sequence b, head h),
/// item b H + h, and the call's scratch.
template <class T>
using PackedSaved = detail::PackedRecords<T, Saved<T>>;

/// Gradients of forward_packed_into: q, k, v like the inputs, one MixtureGrad per head (summed
/// over the sequences in order), and the working records kept for reuse. Unlike the other
/// packed gradients, `items` stays empty: each item's dq, dk, dv go straight into place from a
/// record of the running thread for the item's sequence (`work`, index w B + b), and only the
/// item's mixture gradient is kept (item_mixtures, item b H + h) for the sums over sequences.
template <class T>
struct PackedGrad : detail::PackedGrads<T, Grad<T>> {
  std::vector<MixtureGrad<T>> mixtures;
  std::vector<MixtureGrad<T>> item_mixtures;  // one per (sequence b, head h), item b H + h
  std::vector<Grad<T>> work;                  // per (thread w, sequence b), index w B + b
};

/// Packed GMA forward. mixtures: H mixtures of dimension r (one per head); q: total_q x (H r),
/// k: total_k x (H r), v: total_k x (H d_v); q_offsets, k_offsets: B + 1 entries each (the same
/// vector for self-attention; causal needs equal lengths per sequence). out: resized to
/// total_q x (H d_v). saved (optional) is filled for backward_packed_into.
template <class T, detail::enable_if_supported<T> = 0>
void forward_packed_into(Matrix<T>& out, const std::vector<Mixture<T>>& mixtures,
                         const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                         const ConstMatrixArg<T>& v, const Offsets& q_offsets,
                         const Offsets& k_offsets, const Options& opt,
                         PackedSaved<typename detail::identity<T>::type>* saved, int threads = 1) {
  constexpr const char* fn = "mixattn::gma::forward_packed_into";
  detail::require(!mixtures.empty(), fn, "mixtures is empty (need one mixture per head)");
  const Index heads = static_cast<Index>(mixtures.size());
  const detail::PackedHeads ph =
      detail::check_packed(fn, heads, heads, q.cols(), k.cols(), v.cols(), q.rows(), k.rows(),
                           v.rows(), q_offsets, k_offsets, threads);
  PackedSaved<T> local;
  const Index r = ph.r, d_v = ph.d_v;
  detail::packed_forward(out, ph, q_offsets, k_offsets, saved ? *saved : local, saved != nullptr,
                         threads, false, [&](const detail::PairRows& p, Matrix<T>& o, Saved<T>* s) {
                           forward_into(o, mixtures[static_cast<std::size_t>(p.h)],
                                        detail::item_block(q, p.q0, p.h * r, p.nq, r),
                                        detail::item_block(k, p.k0, p.h * r, p.nk, r),
                                        detail::item_block(v, p.k0, p.h * d_v, p.nk, d_v), opt, s);
                         });
  if (saved) saved->finite_checked = opt.check_finite;  // every item's forward checked them
}

/// Packed GMA backward; grad_out: total_q x (H d_v); saved from forward_packed_into with the
/// same inputs, offsets and options.
template <class T, detail::enable_if_supported<T> = 0>
void backward_packed_into(PackedGrad<T>& grad, const std::vector<Mixture<T>>& mixtures,
                          const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                          const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                          const Offsets& q_offsets, const Offsets& k_offsets,
                          const PackedSaved<T>& saved, const Options& opt, int threads = 1) {
  constexpr const char* fn = "mixattn::gma::backward_packed_into";
  detail::require(!mixtures.empty(), fn, "mixtures is empty (need one mixture per head)");
  const Index heads = static_cast<Index>(mixtures.size());
  const detail::PackedHeads ph =
      detail::check_packed(fn, heads, heads, q.cols(), k.cols(), v.cols(), q.rows(), k.rows(),
                           v.rows(), q_offsets, k_offsets, threads);
  detail::check_packed_backward<T>(fn, ph, q.rows(), grad_out, q_offsets, k_offsets, saved);
  const Index r = ph.r, d_v = ph.d_v;
  // The per-item Grad records of detail::packed_backward would hold dq, dk, dv of every item
  // (as much memory again as the packed gradients) and copy each from its own cold record; a
  // record per (thread, sequence) is reused by the sequence's H heads while it is in cache and
  // keeps its size from step to step (no allocation in steady state).
  grad.items.clear();
  grad.item_mixtures.resize(static_cast<std::size_t>(ph.items()));
  grad.work.resize(detail::work_slots(ph, threads));
  grad.q.resize(q_offsets.back(), heads * r);
  grad.k.resize(k_offsets.back(), heads * r);
  grad.v.resize(k_offsets.back(), heads * d_v);
  const auto streams = [](const Matrix<T>& m) {
    return static_cast<std::size_t>(m.size()) * sizeof(T) >= detail::packed_stream_bytes;
  };
  const bool stream_q = streams(grad.q), stream_k = streams(grad.k), stream_v = streams(grad.v);
  // A forward that checked q, k, v and the mixtures for finite values leaves the items'
  // backwards only grad_out and the results to check: each backward still compares q, k, v and
  // the mixture with its record's fingerprints, so they are the data the forward checked (a
  // change since then is reported as other data). The checks that remain are the single
  // call's, on the same blocks.
  const bool checked_once = opt.check_finite && saved.finite_checked;
  Options item_opt = opt;
  if (checked_once) item_opt.check_finite = false;
  detail::packed_items(
      ph, q_offsets, k_offsets, threads, false, grad.order,
      [&](const detail::PairRows& p, std::size_t i, Index w) {
        Grad<T>& g = grad.work[detail::work_slot(ph, p, w)];
        const auto d_out = detail::item_block(grad_out, p.q0, p.h * d_v, p.nq, d_v);
        if (checked_once) detail::require_finite(d_out, fn, "grad_out");
        backward_into(g, mixtures[static_cast<std::size_t>(p.h)],
                      detail::item_block(q, p.q0, p.h * r, p.nq, r),
                      detail::item_block(k, p.k0, p.h * r, p.nk, r),
                      detail::item_block(v, p.k0, p.h * d_v, p.nk, d_v), d_out, saved.items[i],
                      item_opt);
        if (checked_once) detail::gma_check_grad(fn, g);
        detail::copy_block_into<detail::simd_arch>(grad.q, p.q0, p.h * r, g.q, stream_q);
        detail::copy_block_into<detail::simd_arch>(grad.k, p.k0, p.h * r, g.k, stream_k);
        detail::copy_block_into<detail::simd_arch>(grad.v, p.k0, p.h * d_v, g.v, stream_v);
        MixtureGrad<T>& m = grad.item_mixtures[i];
        m.mean = g.mixture.mean;
        m.var_raw = g.mixture.var_raw;
        m.prior_logit = g.mixture.prior_logit;
      });
  grad.mixtures.resize(static_cast<std::size_t>(heads));
  for (Index h = 0; h < heads; ++h) {  // sequence order, as separate calls summed would be
    MixtureGrad<T>& m = grad.mixtures[static_cast<std::size_t>(h)];
    for (Index b = 0; b < ph.batch; ++b) {
      const MixtureGrad<T>& g = grad.item_mixtures[static_cast<std::size_t>(b * heads + h)];
      if (b == 0) {
        m.mean = g.mean;
        m.var_raw = g.var_raw;
        m.prior_logit = g.prior_logit;
      } else {
        m.mean += g.mean;
        m.var_raw += g.var_raw;
        m.prior_logit += g.prior_logit;
      }
    }
  }
}

}  // namespace gma

namespace reference {

/// Records of flash_forward_packed_into: one Saved per (sequence, query head), item b H_q + h.
template <class T>
using PackedSaved = mixattn::detail::PackedRecords<T, Saved<T>>;

/// Gradients of flash_forward_packed_into; a shared key/value head's dk, dv are summed over its
/// query heads in order.
template <class T>
using PackedGrad = mixattn::detail::PackedGrads<T, Grad<T>>;

/// Packed tiled softmax attention with grouped-query heads. q: total_q x (H_q r), k:
/// total_k x (H_kv r), v: total_k x (H_kv d_v), H_kv = kv_heads dividing H_q = heads; offsets as
/// at the top of this file. out: resized to total_q x (H_q d_v).
template <class T, detail::enable_if_supported<T> = 0>
void flash_forward_packed_into(Matrix<T>& out, Index heads, Index kv_heads,
                               const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                               const ConstMatrixArg<T>& v, const Offsets& q_offsets,
                               const Offsets& k_offsets, const Options& opt,
                               PackedSaved<typename mixattn::detail::identity<T>::type>* saved,
                               int threads = 1) {
  constexpr const char* fn = "mixattn::reference::flash_forward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::check_packed(fn, heads, kv_heads, q.cols(), k.cols(), v.cols(), q.rows(),
                                    k.rows(), v.rows(), q_offsets, k_offsets, threads);
  PackedSaved<T> local;
  const Index r = ph.r, d_v = ph.d_v;
  mixattn::detail::packed_forward(
      out, ph, q_offsets, k_offsets, saved ? *saved : local, saved != nullptr, threads, true,
      [&](const mixattn::detail::PairRows& p, Matrix<T>& o, Saved<T>* s) {
        flash_forward_into<T>(o, mixattn::detail::item_block(q, p.q0, p.h * r, p.nq, r),
                              mixattn::detail::item_block(k, p.k0, p.g * r, p.nk, r),
                              mixattn::detail::item_block(v, p.k0, p.g * d_v, p.nk, d_v), opt, s);
      });
}

/// Backward of flash_forward_packed_into; grad_out: total_q x (H_q d_v).
template <class T, detail::enable_if_supported<T> = 0>
void flash_backward_packed_into(PackedGrad<T>& grad, Index heads, Index kv_heads,
                                const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                                const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                                const Offsets& q_offsets, const Offsets& k_offsets,
                                const PackedSaved<T>& saved, const Options& opt, int threads = 1) {
  constexpr const char* fn = "mixattn::reference::flash_backward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::check_packed(fn, heads, kv_heads, q.cols(), k.cols(), v.cols(), q.rows(),
                                    k.rows(), v.rows(), q_offsets, k_offsets, threads);
  mixattn::detail::check_packed_backward<T>(fn, ph, q.rows(), grad_out, q_offsets, k_offsets,
                                            saved);
  const Index r = ph.r, d_v = ph.d_v;
  mixattn::detail::packed_backward(
      grad, ph, q_offsets, k_offsets, saved, threads, true,
      [&](const mixattn::detail::PairRows& p, Grad<T>& g, const Saved<T>& s) {
        flash_backward_into<T>(g, mixattn::detail::item_block(q, p.q0, p.h * r, p.nq, r),
                               mixattn::detail::item_block(k, p.k0, p.g * r, p.nk, r),
                               mixattn::detail::item_block(v, p.k0, p.g * d_v, p.nk, d_v),
                               mixattn::detail::item_block(grad_out, p.q0, p.h * d_v, p.nq, d_v), s,
                               opt);
      });
}

}  // namespace reference

namespace ovq {

/// Records of forward_packed_into: one Saved per (sequence, query head), item b H_q + h.
template <class T>
using PackedSaved = mixattn::detail::PackedRecords<T, Saved<T>>;

/// Gradients of forward_packed_into: dq, dk, dv like the inputs (a shared key/value head's
/// summed over its query heads in order) and one dbeta per query head (summed over sequences).
template <class T>
struct PackedGrad : mixattn::detail::PackedGrads<T, Grad<T>> {
  std::vector<T> beta;
};

/// Packed OVQ attention with grouped-query heads (OVQ is causal: one offsets vector).
/// q: total x (H_q r), k: total x (H_kv r), v: total x (H_kv d_v); beta: H_q scale factors;
/// states: B H_q states, item b H_q + h, each continued and updated as by forward (in and out).
/// out: resized to total x (H_q d_v).
template <class T, detail::enable_if_supported<T> = 0>
void forward_packed_into(Matrix<T>& out, Index kv_heads, const ConstMatrixArg<T>& q,
                         const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                         const std::vector<T>& beta, const Offsets& offsets, const Options& opt,
                         std::vector<State<T>>& states,
                         PackedSaved<typename mixattn::detail::identity<T>::type>* saved,
                         int threads = 1) {
  constexpr const char* fn = "mixattn::ovq::forward_packed_into";
  const Index heads = static_cast<Index>(beta.size());
  const mixattn::detail::PackedHeads ph = mixattn::detail::check_packed(
      fn, heads, kv_heads, q.cols(), k.cols(), v.cols(), q.rows(), k.rows(), v.rows(), offsets,
      offsets, threads, "offsets", nullptr);
  detail::require(static_cast<Index>(states.size()) == ph.items(), fn, "states has ", states.size(),
                  " entries but ", ph.batch, " sequences x ", heads, " heads need ", ph.items());
  PackedSaved<T> local;
  const Index r = ph.r, d_v = ph.d_v;
  mixattn::detail::packed_forward(
      out, ph, offsets, offsets, saved ? *saved : local, saved != nullptr, threads, false,
      [&](const mixattn::detail::PairRows& p, Matrix<T>& o, Saved<T>* s) {
        forward_into(o, mixattn::detail::item_block(q, p.q0, p.h * r, p.nq, r),
                     mixattn::detail::item_block(k, p.k0, p.g * r, p.nk, r),
                     mixattn::detail::item_block(v, p.k0, p.g * d_v, p.nk, d_v),
                     beta[static_cast<std::size_t>(p.h)], opt,
                     states[static_cast<std::size_t>(p.b * heads + p.h)], s);
      });
}

/// Backward of forward_packed_into; grad_out: total x (H_q d_v).
template <class T, detail::enable_if_supported<T> = 0>
void backward_packed_into(PackedGrad<T>& grad, Index kv_heads, const ConstMatrixArg<T>& q,
                          const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                          const std::vector<T>& beta, const ConstMatrixArg<T>& grad_out,
                          const Offsets& offsets, const PackedSaved<T>& saved, const Options& opt,
                          int threads = 1) {
  constexpr const char* fn = "mixattn::ovq::backward_packed_into";
  const Index heads = static_cast<Index>(beta.size());
  const mixattn::detail::PackedHeads ph = mixattn::detail::check_packed(
      fn, heads, kv_heads, q.cols(), k.cols(), v.cols(), q.rows(), k.rows(), v.rows(), offsets,
      offsets, threads, "offsets", nullptr);
  mixattn::detail::check_packed_backward<T>(fn, ph, q.rows(), grad_out, offsets, offsets, saved);
  const Index r = ph.r, d_v = ph.d_v;
  mixattn::detail::packed_backward(
      grad, ph, offsets, offsets, saved, threads, false,
      [&](const mixattn::detail::PairRows& p, Grad<T>& g, const Saved<T>& s) {
        backward_into(g, mixattn::detail::item_block(q, p.q0, p.h * r, p.nq, r),
                      mixattn::detail::item_block(k, p.k0, p.g * r, p.nk, r),
                      mixattn::detail::item_block(v, p.k0, p.g * d_v, p.nk, d_v),
                      beta[static_cast<std::size_t>(p.h)],
                      mixattn::detail::item_block(grad_out, p.q0, p.h * d_v, p.nq, d_v), s, opt);
      });
  grad.beta.assign(static_cast<std::size_t>(heads), T(0));
  for (Index h = 0; h < heads; ++h)  // sequence order, as separate calls summed would be
    for (Index b = 0; b < ph.batch; ++b)
      grad.beta[static_cast<std::size_t>(h)] +=
          grad.items[static_cast<std::size_t>(b * heads + h)].beta;
}

}  // namespace ovq

namespace delta {

/// Records of forward_packed_into: one Saved per (sequence b, head h), item b H + h.
template <class T>
using PackedSaved = mixattn::detail::PackedRecords<T, Saved<T>>;

/// Gradients of forward_packed_into: dq, dk, dv like q, k, v, dg and dbeta like g and beta
/// (H x total), and one Grad per item (its `state`: the start state's gradient when the forward
/// continued states).
template <class T>
struct PackedGrad : mixattn::detail::PackedGrads<T, Grad<T>> {
  Matrix<T> g, beta;
};

/// Packed gated delta rule (causal: one offsets vector). q, k: total x (H d_k), v: total x (H d_v),
/// head h in column block h; g, beta: H x total, row h the gates of head h (read in place);
/// states: null (every sequence starts from zero) or B H states, item b H + h, each continued and
/// advanced as by forward. out: resized to total x (H d_v). Every (sequence, head) item is one
/// call of forward_into: the results equal the separate calls bit for bit.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void forward_packed_into(Matrix<T>& out, Index heads, const ConstMatrixArg<T>& q,
                         const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                         const ConstMatrixArg<T>& g, const ConstMatrixArg<T>& beta,
                         const Offsets& offsets, const Options& opt,
                         std::vector<State<typename mixattn::detail::identity<T>::type>>* states,
                         PackedSaved<typename mixattn::detail::identity<T>::type>* saved,
                         int threads = 1) {
  constexpr const char* fn = "mixattn::delta::forward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::check_packed(fn, heads, heads, q.cols(), k.cols(), v.cols(), q.rows(),
                                    k.rows(), v.rows(), offsets, offsets, threads);
  mixattn::detail::delta_check_packed_gates<T>(fn, g, beta, heads, q.rows());
  if (states)
    detail::require(static_cast<Index>(states->size()) == ph.items(), fn, "states has ",
                    states->size(), " entries but ", ph.batch, " sequences x ", heads,
                    " heads need ", ph.items());
  PackedSaved<T> local;
  const Index dk = ph.r, dv = ph.d_v;
  mixattn::detail::packed_forward(
      out, ph, offsets, offsets, saved ? *saved : local, saved != nullptr, threads, false,
      [&](const mixattn::detail::PairRows& p, Matrix<T>& o, Saved<T>* s) {
        State<T>* st = states ? &(*states)[static_cast<std::size_t>(p.b * heads + p.h)] : nullptr;
        forward_into<T>(o, q.block(p.q0, p.h * dk, p.nq, dk), k.block(p.q0, p.h * dk, p.nq, dk),
                        v.block(p.q0, p.h * dv, p.nq, dv), g.row(p.h).segment(p.q0, p.nq),
                        beta.row(p.h).segment(p.q0, p.nq), opt, st, s);
      });
}

/// Backward of forward_packed_into; grad_out: total x (H d_v). grad_states_out (optional, with
/// states in the forward): B H gradients of the end states, item b H + h.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void backward_packed_into(PackedGrad<T>& grad, Index heads, const ConstMatrixArg<T>& q,
                          const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                          const ConstMatrixArg<T>& g, const ConstMatrixArg<T>& beta,
                          const ConstMatrixArg<T>& grad_out, const Offsets& offsets,
                          const PackedSaved<T>& saved, const Options& opt,
                          const std::vector<StateGrad<T>>* grad_states_out = nullptr,
                          int threads = 1) {
  constexpr const char* fn = "mixattn::delta::backward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::check_packed(fn, heads, heads, q.cols(), k.cols(), v.cols(), q.rows(),
                                    k.rows(), v.rows(), offsets, offsets, threads);
  mixattn::detail::delta_check_packed_gates<T>(fn, g, beta, heads, q.rows());
  mixattn::detail::check_packed_backward<T>(fn, ph, q.rows(), grad_out, offsets, offsets, saved);
  if (grad_states_out)
    detail::require(static_cast<Index>(grad_states_out->size()) == ph.items(), fn,
                    "grad_states_out has ", grad_states_out->size(), " entries but ", ph.batch,
                    " sequences x ", heads, " heads need ", ph.items());
  const Index dk = ph.r, dv = ph.d_v;
  grad.g.resize(heads, q.rows());
  grad.beta.resize(heads, q.rows());
  mixattn::detail::packed_backward(
      grad, ph, offsets, offsets, saved, threads, false,
      [&](const mixattn::detail::PairRows& p, Grad<T>& gr, const Saved<T>& s) {
        const std::size_t i = static_cast<std::size_t>(p.b * heads + p.h);
        backward_into<T>(gr, q.block(p.q0, p.h * dk, p.nq, dk), k.block(p.q0, p.h * dk, p.nq, dk),
                         v.block(p.q0, p.h * dv, p.nq, dv), g.row(p.h).segment(p.q0, p.nq),
                         beta.row(p.h).segment(p.q0, p.nq),
                         grad_out.block(p.q0, p.h * dv, p.nq, dv), s, opt,
                         grad_states_out ? &(*grad_states_out)[i] : nullptr);
        grad.g.row(p.h).segment(p.q0, p.nq) = gr.g.transpose();
        grad.beta.row(p.h).segment(p.q0, p.nq) = gr.beta.transpose();
      });
}

}  // namespace delta
namespace ssd {

/// Records of forward_packed_into: one Saved per (sequence b, head h), item b H + h.
template <class T>
using PackedSaved = mixattn::detail::PackedRecords<T, Saved<T>>;

/// Gradients of forward_packed_into: dx, dB, dC like x, B and C, ddt like dt (H x total), one dA,
/// dD and d dt_bias per head (summed over the sequences in order), and one Grad per item (its
/// `state`: the start state's gradient when the forward continued states).
template <class T>
struct PackedGrad {
  Matrix<T> x, B, C, dt;
  std::vector<T> A, D, dt_bias;
  std::vector<Grad<T>> items;
  std::vector<Index> order;  // scratch of the largest-first schedule
};

}  // namespace ssd

namespace detail {

/// Validates a packed SSD call: x total x (H P), B and C total x (H S), dt H x total, A and D one
/// per head, the offsets, the thread count; returns the layout (r = S, d_v = P).
template <class T>
PackedHeads ssd_check_packed(const char* fn, Index heads, const ConstMatrixRef<T>& x,
                             const ConstMatrixRef<T>& dt, const std::vector<T>& A,
                             const ConstMatrixRef<T>& B, const ConstMatrixRef<T>& C,
                             const std::vector<T>& D, const Offsets& offsets, int threads) {
  require(heads >= 1, fn, "heads is ", heads, "; it must be >= 1");
  const Index total = x.rows();
  require(x.cols() % heads == 0 && x.cols() > 0, fn, "x has ", x.cols(),
          " columns, not a positive multiple of ", heads, " heads");
  require(B.rows() == total && B.cols() % heads == 0 && B.cols() > 0, fn, "B is ", shape_str(B),
          " but x has ", total, " rows and ", heads, " heads: B must be ", total,
          " x (a positive multiple of ", heads, ")");
  require(C.rows() == B.rows() && C.cols() == B.cols(), fn, "C is ", shape_str(C), " but B is ",
          shape_str(B));
  require(dt.rows() == heads && dt.cols() == total, fn, "dt is ", shape_str(dt), " but ", heads,
          " heads over ", total, " rows need ", heads, " x ", total, " (row h: head h's steps)");
  require(static_cast<Index>(A.size()) == heads && static_cast<Index>(D.size()) == heads, fn,
          "A has ", A.size(), " and D has ", D.size(), " entries; ", heads, " heads need ", heads,
          " each");
  require(threads >= 0, fn, "threads must be >= 0, got ", threads);
  check_offsets(fn, "offsets", offsets, total);
  return {static_cast<Index>(offsets.size()) - 1, heads, heads, B.cols() / heads, x.cols() / heads};
}

}  // namespace detail

namespace ssd {

/// Packed SSD layer (causal: one offsets vector). x: total x (H P), head h in column block h;
/// B, C: total x (H S); dt: H x total, row h the raw steps of head h (read in place); A, D: one
/// per head; opt.dt_bias applies to every head; states: null (every sequence starts from zero)
/// or B H states, item b H + h, each continued and advanced as by forward. out: resized to
/// total x (H P). Every (sequence, head) item is one call of forward_into: the results equal the
/// separate calls bit for bit.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void forward_packed_into(Matrix<T>& out, Index heads, const ConstMatrixArg<T>& x,
                         const ConstMatrixArg<T>& dt, const std::vector<T>& A,
                         const ConstMatrixArg<T>& B, const ConstMatrixArg<T>& C,
                         const std::vector<T>& D, const Offsets& offsets, const Options& opt,
                         std::vector<State<typename mixattn::detail::identity<T>::type>>* states,
                         PackedSaved<typename mixattn::detail::identity<T>::type>* saved,
                         int threads = 1) {
  constexpr const char* fn = "mixattn::ssd::forward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::ssd_check_packed<T>(fn, heads, x, dt, A, B, C, D, offsets, threads);
  if (states)
    detail::require(static_cast<Index>(states->size()) == ph.items(), fn, "states has ",
                    states->size(), " entries but ", ph.batch, " sequences x ", heads,
                    " heads need ", ph.items());
  PackedSaved<T> local;
  const Index S = ph.r, P = ph.d_v;
  mixattn::detail::packed_forward(
      out, ph, offsets, offsets, saved ? *saved : local, saved != nullptr, threads, false,
      [&](const mixattn::detail::PairRows& p, Matrix<T>& o, Saved<T>* s) {
        const std::size_t h = static_cast<std::size_t>(p.h);
        State<T>* st = states ? &(*states)[static_cast<std::size_t>(p.b * heads + p.h)] : nullptr;
        forward_into<T>(o, mixattn::detail::item_block(x, p.q0, p.h * P, p.nq, P),
                        dt.row(p.h).segment(p.q0, p.nq), A[h],
                        mixattn::detail::item_block(B, p.q0, p.h * S, p.nq, S),
                        mixattn::detail::item_block(C, p.q0, p.h * S, p.nq, S), D[h], opt, st, s);
      });
}

/// Backward of forward_packed_into; grad_out: total x (H P). grad_states_out (optional, with
/// states in the forward): B H gradients of the end states, item b H + h.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void backward_packed_into(PackedGrad<T>& grad, Index heads, const ConstMatrixArg<T>& x,
                          const ConstMatrixArg<T>& dt, const std::vector<T>& A,
                          const ConstMatrixArg<T>& B, const ConstMatrixArg<T>& C,
                          const std::vector<T>& D, const ConstMatrixArg<T>& grad_out,
                          const Offsets& offsets, const PackedSaved<T>& saved, const Options& opt,
                          const std::vector<StateGrad<T>>* grad_states_out = nullptr,
                          int threads = 1) {
  constexpr const char* fn = "mixattn::ssd::backward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::ssd_check_packed<T>(fn, heads, x, dt, A, B, C, D, offsets, threads);
  mixattn::detail::check_packed_backward<T>(fn, ph, x.rows(), grad_out, offsets, offsets, saved);
  if (grad_states_out)
    detail::require(static_cast<Index>(grad_states_out->size()) == ph.items(), fn,
                    "grad_states_out has ", grad_states_out->size(), " entries but ", ph.batch,
                    " sequences x ", heads, " heads need ", ph.items());
  const Index S = ph.r, P = ph.d_v;
  grad.items.resize(static_cast<std::size_t>(ph.items()));
  grad.x.resize(x.rows(), x.cols());
  grad.B.resize(B.rows(), B.cols());
  grad.C.resize(C.rows(), C.cols());
  grad.dt.resize(heads, x.rows());
  mixattn::detail::packed_items(
      ph, offsets, offsets, threads, false, grad.order,
      [&](const mixattn::detail::PairRows& p, std::size_t i, Index) {
        Grad<T>& gr = grad.items[i];
        const std::size_t h = static_cast<std::size_t>(p.h);
        backward_into<T>(gr, mixattn::detail::item_block(x, p.q0, p.h * P, p.nq, P),
                         dt.row(p.h).segment(p.q0, p.nq), A[h],
                         mixattn::detail::item_block(B, p.q0, p.h * S, p.nq, S),
                         mixattn::detail::item_block(C, p.q0, p.h * S, p.nq, S), D[h],
                         mixattn::detail::item_block(grad_out, p.q0, p.h * P, p.nq, P),
                         saved.items[i], opt, grad_states_out ? &(*grad_states_out)[i] : nullptr);
        mixattn::detail::item_block(grad.x, p.q0, p.h * P, p.nq, P) = gr.x;
        mixattn::detail::item_block(grad.B, p.q0, p.h * S, p.nq, S) = gr.B;
        mixattn::detail::item_block(grad.C, p.q0, p.h * S, p.nq, S) = gr.C;
        grad.dt.row(p.h).segment(p.q0, p.nq) = gr.dt.transpose();
      });
  grad.A.assign(static_cast<std::size_t>(heads), T(0));
  grad.D.assign(static_cast<std::size_t>(heads), T(0));
  grad.dt_bias.assign(static_cast<std::size_t>(heads), T(0));
  for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h)  // sequence order
    for (Index b = 0; b < ph.batch; ++b) {
      const Grad<T>& gr = grad.items[static_cast<std::size_t>(b * heads) + h];
      grad.A[h] += gr.A;
      grad.D[h] += gr.D;
      grad.dt_bias[h] += gr.dt_bias;
    }
}

}  // namespace ssd

namespace linformer {

/// Records of forward_packed_into: one Saved per (sequence b, head h), item b H + h.
template <class T>
using PackedSaved = mixattn::detail::PackedRecords<T, Saved<T>>;

/// Gradients of forward_packed_into: dq, dk, dv like q, k, v; dE, dF (k_proj x N) the items'
/// gradients of the shared E and F summed in item order (b H + h); one Grad per item.
template <class T>
struct PackedGrad : mixattn::detail::PackedGrads<T, Grad<T>> {
  Matrix<T> E, F;
};

/// Packed Linformer (one offsets vector). q, k: total x (H d), v: total x (H d_v), head h in
/// column block h; E, F: k_proj x N, shared by every head and sequence (the paper's layer-wise
/// sharing: one projection per layer), so every sequence must have length N = E.cols().
/// out: resized to total x (H d_v). Every (sequence, head) item is one call of forward_into:
/// the results equal the separate calls bit for bit.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void forward_packed_into(Matrix<T>& out, Index heads, const ConstMatrixArg<T>& q,
                         const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                         const ConstMatrixArg<T>& E, const ConstMatrixArg<T>& F,
                         const Offsets& offsets, const Options& opt,
                         PackedSaved<typename mixattn::detail::identity<T>::type>* saved,
                         int threads = 1) {
  constexpr const char* fn = "mixattn::linformer::forward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::check_packed(fn, heads, heads, q.cols(), k.cols(), v.cols(), q.rows(),
                                    k.rows(), v.rows(), offsets, offsets, threads);
  mixattn::detail::linformer_check_packed<T>(fn, offsets, E, F, opt);
  PackedSaved<T> local;
  const Index d = ph.r, dv = ph.d_v;
  mixattn::detail::packed_forward(
      out, ph, offsets, offsets, saved ? *saved : local, saved != nullptr, threads, false,
      [&](const mixattn::detail::PairRows& p, Matrix<T>& o, Saved<T>* s) {
        forward_into<T>(o, q.block(p.q0, p.h * d, p.nq, d), k.block(p.q0, p.h * d, p.nq, d),
                        v.block(p.q0, p.h * dv, p.nq, dv), E, F, opt, s);
      });
}

/// Backward of forward_packed_into; grad_out: total x (H d_v). grad.E and grad.F: the sums of
/// the items' gradients of E and F, in item order.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void backward_packed_into(PackedGrad<T>& grad, Index heads, const ConstMatrixArg<T>& q,
                          const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                          const ConstMatrixArg<T>& E, const ConstMatrixArg<T>& F,
                          const ConstMatrixArg<T>& grad_out, const Offsets& offsets,
                          const PackedSaved<T>& saved, const Options& opt, int threads = 1) {
  constexpr const char* fn = "mixattn::linformer::backward_packed_into";
  const mixattn::detail::PackedHeads ph =
      mixattn::detail::check_packed(fn, heads, heads, q.cols(), k.cols(), v.cols(), q.rows(),
                                    k.rows(), v.rows(), offsets, offsets, threads);
  mixattn::detail::linformer_check_packed<T>(fn, offsets, E, F, opt);
  mixattn::detail::check_packed_backward<T>(fn, ph, q.rows(), grad_out, offsets, offsets, saved);
  const Index d = ph.r, dv = ph.d_v;
  mixattn::detail::packed_backward(
      grad, ph, offsets, offsets, saved, threads, false,
      [&](const mixattn::detail::PairRows& p, Grad<T>& gr, const Saved<T>& s) {
        backward_into<T>(gr, q.block(p.q0, p.h * d, p.nq, d), k.block(p.q0, p.h * d, p.nq, d),
                         v.block(p.q0, p.h * dv, p.nq, dv), E, F,
                         grad_out.block(p.q0, p.h * dv, p.nq, dv), s, opt);
      });
  grad.E.setZero(E.rows(), E.cols());
  grad.F.setZero(F.rows(), F.cols());
  for (const Grad<T>& gr : grad.items) {  // item order, as separate calls summed would be
    grad.E += gr.E;
    grad.F += gr.F;
  }
}

}  // namespace linformer
MIXATTN_END_NAMESPACE
