// mixattn/parallel.hpp — the library's own threading over independent heads.
//
// Eigen is meant to run single-threaded inside each head (define EIGEN_DONT_PARALLELIZE or
// leave OpenMP off); parallelism comes from running heads side by side. Thread safety: every
// operator is re-entrant; concurrent calls on shared const parameters are safe.
#pragma once

#include "mixattn/core.hpp"

#include <algorithm>
#include <exception>
#include <thread>
#include <vector>

MIXATTN_BEGIN_NAMESPACE

/// Runs fn(i) for i in [0, count) on up to `threads` threads (0 means
/// std::thread::hardware_concurrency()). Items are split into contiguous ranges, one per
/// thread; the calling thread takes the first. If any fn(i) throws, the exception of the lowest
/// such i is rethrown after every thread has joined; the others are discarded.
template <class Fn>
void parallel_for(Index count, int threads, Fn&& fn) {
  detail::require(threads >= 0, "mixattn::parallel_for", "threads must be >= 0, got ", threads);
  if (count <= 0) return;
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const Index workers = std::min<Index>(threads, count);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(count));
  auto run_range = [&](Index w) {
    const Index begin = count * w / workers, end = count * (w + 1) / workers;
    for (Index i = begin; i < end; ++i) {
#if MIXATTN_HAS_EXCEPTIONS
      try {
        fn(i);
      } catch (...) {
        errors[static_cast<std::size_t>(i)] = std::current_exception();
      }
#else
      fn(i);
#endif
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (Index w = 1; w < workers; ++w) pool.emplace_back(run_range, w);
  run_range(0);
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

MIXATTN_END_NAMESPACE
