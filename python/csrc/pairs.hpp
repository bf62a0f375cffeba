// python/csrc/pairs.hpp — shared by the kernel translation units: views of one (batch, head)
// slice and the loop over (batch, head) pairs on PyTorch's intra-op thread pool.
#pragma once

#include "kernels.hpp"

#include <mixattn/core.hpp>

#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace mixattn_torch {

template <class T>
using ConstMap = Eigen::Map<const mixattn::Matrix<T>>;
template <class T>
using Map = Eigen::Map<mixattn::Matrix<T>>;

/// Slice `pair` (= b * H + h) of a contiguous (B, H, rows, cols) tensor, rows x cols row-major.
template <class T>
ConstMap<T> slice(const T* base, Index pair, Index rows, Index cols) {
  return ConstMap<T>(base + pair * rows * cols, rows, cols);
}
template <class T>
Map<T> slice(T* base, Index pair, Index rows, Index cols) {
  return Map<T>(base + pair * rows * cols, rows, cols);
}

/// Pair `pair`'s block of a (B, H, rows, cols) tensor, rows x cols row-major: slice(base, pair,
/// rows, cols); for a packed shape (Shape::offsets) the tensor is (1, H, T, cols) and the block
/// is sequence pair / H's tokens of head pair % H (`rows` is then T and not the block's).
template <class T>
auto pair_rows(const Shape& s, T* base, Index pair, Index rows, Index cols) {
  if (s.offsets.empty()) return slice(base, pair, rows, cols);
  const auto b = static_cast<std::size_t>(pair / s.heads);
  const Index first = s.offsets[b], count = s.offsets[b + 1] - first;
  return slice(base + ((pair % s.heads) * rows + first) * cols, 0, count, cols);
}

/// fn(pair) for every (b, h) pair, split over torch.get_num_threads() threads (an exception is
/// rethrown on the calling thread after all have finished). `reversed`: each thread visits its
/// pairs last to first (PairOrder).
template <class Fn>
void for_each_pair(const Shape& s, const Fn& fn, bool reversed = false) {
  at::parallel_for(0, s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      fn(static_cast<Index>(reversed ? end - 1 - (i - begin) : i));
  });
}

/// What one forward call keeps: the library's record per pair (pair = b * H + h), anything the
/// pairs share (GMA: the heads' mixtures), and the shape it was made for.
template <class Pair, class Shared = std::nullptr_t>
struct PairRecords {
  Shape shape;
  std::vector<Pair> pairs;
  Shared shared{};
};

/// Every RecordPool's clear(), for release_kept_records(); read and written under `mutex`.
struct PoolRegistry {
  std::mutex mutex;
  std::vector<void (*)()> clears;
};

// Never destroyed, like the pools.
inline PoolRegistry& pool_registry() {
  static auto* const registry = new PoolRegistry;
  return *registry;
}

/// The records of finished calls of one kind (Rec), kept for the next forward: a record comes
/// back here when the last reference to it goes (its backward has run, or autograd dropped the
/// graph), and the next forward overwrites it, reusing the library's Saved buffers and working
/// memory (they keep their capacity) instead of page-faulting fresh ones. At most kKept records
/// per kind are kept (as many as the forwards alive at once in a training step, for up to that
/// many layers); release_kept_records() frees them all.
template <class Rec>
class RecordPool {
 public:
  static constexpr std::size_t kKept = 16;

  static std::shared_ptr<Rec> take() {
    Pool& p = pool();
    std::unique_ptr<Rec> r;
    {
      const std::lock_guard<std::mutex> lock(p.mutex);
      if (!p.free.empty()) {
        r = std::move(p.free.back());
        p.free.pop_back();
      }
    }
    if (!r) r = std::make_unique<Rec>();
    return std::shared_ptr<Rec>(r.release(), [](Rec* done) { give_back(done); });
  }

  static void clear() {
    std::vector<std::unique_ptr<Rec>> gone;
    Pool& p = pool();
    const std::lock_guard<std::mutex> lock(p.mutex);
    gone.swap(p.free);
  }

 private:
  struct Pool {
    std::mutex mutex;
    std::vector<std::unique_ptr<Rec>> free;
  };
  // Never destroyed: a record may come back while the interpreter shuts down, after static
  // destructors have run.
  static Pool& pool() {
    static Pool* const p = [] {
      PoolRegistry& registry = pool_registry();
      const std::lock_guard<std::mutex> lock(registry.mutex);
      registry.clears.push_back(&RecordPool::clear);
      return new Pool;
    }();
    return *p;
  }
  static void give_back(Rec* done) {
    std::unique_ptr<Rec> owned(done);  // destroyed after the lock is released, if not kept
    Pool& p = pool();
    const std::lock_guard<std::mutex> lock(p.mutex);
    if (p.free.size() < kKept) p.free.push_back(std::move(owned));
  }
};

/// A record for a forward of shape `s`: a kept one (RecordPool) or a new one.
template <class Pair, class Shared = std::nullptr_t>
std::shared_ptr<PairRecords<Pair, Shared>> make_records(const Shape& s) {
  auto records = RecordPool<PairRecords<Pair, Shared>>::take();
  records->shape = s;
  records->pairs.resize(static_cast<std::size_t>(s.batch * s.heads));
  return records;
}

/// This thread's instance of M (a library output matrix or Grad): the kernels write a pair's
/// results here and copy them into the tensor, so that a steady stream of calls on PyTorch's
/// pool threads reuses the same memory instead of page-faulting fresh pages on every call.
template <class M>
M& thread_scratch() {
  thread_local M m;
  return m;
}

/// The record of a packed call (library PackedSaved), what its items share, and its shape.
template <class Saved, class Shared = std::nullptr_t>
struct PackedRecord {
  PackedShape shape;
  Saved saved;
  Shared shared{};
};

/// The record a backward was handed (the binding checked it comes from this operator and scalar
/// type: a PairRecords or a PackedRecord, Rec), checked to be for the same shape (and offsets).
template <class Rec, class ShapeOf>
const Rec& record_for(const SavedPtr& saved, const ShapeOf& s, const char* fn) {
  const auto* r = static_cast<const Rec*>(saved.get());
  if (r == nullptr || !(r->shape == s))
    throw std::invalid_argument(std::string(fn) +
                                ": saved was not made by the forward of these shapes");
  return *r;
}

/// The library States of a cache or of an OVQ state (kernels.hpp, PairStates).
template <class State>
class StatesOf final : public PairStates {
 public:
  std::vector<State> pairs;

  std::unique_ptr<PairStates> clone() const override { return std::make_unique<StatesOf>(*this); }
  std::vector<Index> tokens_seen() const override {
    std::vector<Index> t;
    t.reserve(pairs.size());
    for (const State& st : pairs) t.push_back(st.tokens_seen);
    return t;
  }
  std::uint64_t content_fingerprint() const override {
    mixattn::detail::Fingerprint f;
    f.add(static_cast<Index>(pairs.size()));
    for (const State& st : pairs) add_state(f, st);
    return f.value();
  }

 private:
  template <class T>
  static void add_state(mixattn::detail::Fingerprint& f, const mixattn::ovq::State<T>& st) {
    for (const auto* m : {&st.keys, &st.values, &st.pending_keys, &st.pending_values})
      f.add(m->rows()).add(m->cols()).add(*m);
    f.add(st.counts.size()).add(st.counts).add(st.tokens_seen);
  }
  template <class T>
  static void add_state(mixattn::detail::Fingerprint& f, const mixattn::gma::State<T>& st) {
    f.add(st.S.rows()).add(st.S.cols()).add(st.S).add(st.z).add(st.tokens_seen);
  }
};

/// The States in `states`, which must be StatesOf<State> holding `count` of them (the bindings
/// keep each cache's operator and scalar type; this catches a mix-up as an error, not a crash).
template <class State, class P>
auto& states_of(P& states, Index count, const char* fn) {
  using Of = std::conditional_t<std::is_const<P>::value, const StatesOf<State>, StatesOf<State>>;
  auto* of = dynamic_cast<Of*>(&states);
  if (of == nullptr || static_cast<Index>(of->pairs.size()) != count)
    throw std::logic_error(std::string(fn) + ": the states are of another kind or count");
  return of->pairs;
}

/// The loops of gma_decode_seconds and ovq_decode_seconds (kernels.hpp): step(h, t) decodes
/// row t of head h (its state prefilled already) and returns an entry of its output, summed and
/// checked finite after the clock so the calls cannot be optimised away.
template <class Step>
std::vector<double> decode_seconds(Index heads, Index first, Index rows, bool all_heads_per_call,
                                   const Step& step) {
  std::vector<double> seconds;
  seconds.reserve(static_cast<std::size_t>((rows - first) * (all_heads_per_call ? 1 : heads)));
  double sink = 0;
  const auto timed = [&](Index h0, Index h1, Index t) {
    const auto t0 = std::chrono::steady_clock::now();
    for (Index h = h0; h < h1; ++h) sink += static_cast<double>(step(h, t));
    const auto t1 = std::chrono::steady_clock::now();
    seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
  };
  if (all_heads_per_call) {
    for (Index t = first; t < rows; ++t) timed(0, heads, t);
  } else {
    for (Index h = 0; h < heads; ++h)
      for (Index t = first; t < rows; ++t) timed(h, h + 1, t);
  }
  if (!std::isfinite(sink)) throw std::logic_error("decode_seconds: a non-finite output");
  return seconds;
}

/// rows x cols row-major views of a packed tensor.
template <class T>
ConstMap<T> packed(const T* base, Index rows, Index cols) {
  return ConstMap<T>(base, rows, cols);
}
template <class T>
Map<T> packed(T* base, Index rows, Index cols) {
  return Map<T>(base, rows, cols);
}

}  // namespace mixattn_torch
