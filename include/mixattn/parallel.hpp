// mixattn/parallel.hpp — the library's own threading over independent heads and sequences.
//
// Work runs on a persistent pool (Eigen's non-blocking ThreadPool, the pool TensorFlow runs
// on): no thread is started per call. The library's default pool has hardware_concurrency()
// workers and is created on first use; a caller may pass a pool of their own instead.
// Eigen is meant to run single-threaded inside each head (define EIGEN_DONT_PARALLELIZE or
// leave OpenMP off); parallelism comes from running heads side by side. Thread safety: every
// operator is re-entrant; concurrent calls on shared const parameters are safe, and any number
// of threads may call parallel_for on one pool at once.
#pragma once

#include "mixattn/core.hpp"

#include <unsupported/Eigen/CXX11/ThreadPool>

#include <algorithm>
#include <exception>
#include <mutex>
#include <thread>

MIXATTN_BEGIN_NAMESPACE

/// The pool type parallel_for runs on (any Eigen::ThreadPoolInterface works).
using ThreadPool = Eigen::ThreadPool;

/// The library's default pool: hardware_concurrency() workers, created on first use and kept
/// for the life of the process.
inline Eigen::ThreadPoolInterface& default_thread_pool() {
  static ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

namespace detail {

/// Shared state of one parallel_for call; lives on the caller's stack until every range is done.
template <class Fn>
struct ParallelRun {
  Fn* fn;
  Index count, workers;
  Eigen::Barrier* done;
  std::mutex error_mutex;
  Index error_index;
  std::exception_ptr error;

  void run_range(Index w) {
    const Index begin = count * w / workers, end = count * (w + 1) / workers;
    for (Index i = begin; i < end; ++i) {
#if MIXATTN_HAS_EXCEPTIONS
      try {
        (*fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (i < error_index) {
          error_index = i;
          error = std::current_exception();
        }
      }
#else
      (*fn)(i);
#endif
    }
  }
};

/// Runs the ranges of `workers` threads: the caller takes range 0, the pool the others.
template <class Fn>
void parallel_run(Index count, Index workers, Fn& fn, Eigen::ThreadPoolInterface* pool) {
  ParallelRun<Fn> run{&fn, count, workers, nullptr, {}, count, nullptr};
  if (workers > 1) {
    Eigen::Barrier done(static_cast<unsigned>(workers - 1));
    run.done = &done;
    for (Index w = 1; w < workers; ++w) {
      // A pointer and an int: std::function keeps the capture inline, nothing is allocated.
      ParallelRun<Fn>* r = &run;
      const int wi = static_cast<int>(w);
      pool->Schedule([r, wi] {
        r->run_range(wi);
        r->done->Notify();
      });
    }
    run.run_range(0);
    done.Wait();
  } else {
    run.run_range(0);
  }
  if (run.error) std::rethrow_exception(run.error);
}

inline int resolve_threads(int threads) {
  require(threads >= 0, "mixattn::parallel_for", "threads must be >= 0, got ", threads);
  return threads == 0 ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))
                      : threads;
}

}  // namespace detail

/// Runs fn(i) for i in [0, count) on up to `threads` threads (0 means
/// std::thread::hardware_concurrency()): the calling thread and workers of `pool`. Items are
/// split into contiguous ranges, one per thread; the calling thread takes the first. Calls from
/// inside a worker of `pool` run inline (no nested waits on the same pool). If any fn(i) throws,
/// the exception of the lowest such i is rethrown after every range has finished; the others
/// are discarded. Starts no thread and allocates nothing itself.
template <class Fn>
void parallel_for(Index count, int threads, Fn&& fn, Eigen::ThreadPoolInterface& pool) {
  threads = detail::resolve_threads(threads);
  if (count <= 0) return;
  Index workers = std::min<Index>(threads, count);
  if (pool.CurrentThreadId() != -1) workers = 1;
  detail::parallel_run(count, workers, fn, &pool);
}

/// parallel_for on the library's default pool (not created while every call runs on one
/// thread).
template <class Fn>
void parallel_for(Index count, int threads, Fn&& fn) {
  threads = detail::resolve_threads(threads);
  if (count <= 0) return;
  const Index workers = std::min<Index>(threads, count);
  if (workers <= 1) return detail::parallel_run(count, Index(1), fn, nullptr);
  Eigen::ThreadPoolInterface& pool = default_thread_pool();
  detail::parallel_run(count, pool.CurrentThreadId() != -1 ? Index(1) : workers, fn, &pool);
}

MIXATTN_END_NAMESPACE
