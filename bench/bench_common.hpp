// bench/bench_common.hpp — shared harness for the mixattn benchmarks.
//
// Include from exactly one translation unit per benchmark binary: it pulls in the counting
// allocator (counting_allocator.hpp defines the global heap entry points) unless
// MIXATTN_BENCH_NO_ALLOCATOR is defined. End the file with MIXATTN_BENCH_MAIN().
//
// What every benchmark reports (see bench/summary.py, which reads the JSON):
//  - time per call (Google Benchmark's own), measured only after one untimed call (timed_loop):
//    the first call touches every output page and fills the caches, and a reading that includes
//    it says nothing about the operator; warm_up_calls = 1 tells the summary the point is warm;
//  - FLOPS: the operator's arithmetic as a rate (Counter kIsIterationInvariantRate), counted as
//    the GEMM-shaped work of its floor so that "ratio to floor" is a pure time ratio, and
//    flop_per_call, the same count per call, from which the summary computes the fraction of the
//    measured peak (one-thread points: peak_flops_beside, the FMA probe measured around the same
//    repetition, timed_loop; the others: bench_peak.cpp);
//  - peak_heap_bytes: the high-water mark of extra heap during the timed calls, over what was
//    live when the loop started (inputs and setup excluded, outputs and Saved included);
//  - N (the sweep variable) as a plain counter, and SetComplexityN(N) for the ->Complexity() fit;
//  - with the MemoryManager registered (default), Google Benchmark's own allocs_per_iter and
//    max_bytes_used from its separate memory run; note that run re-executes the whole benchmark
//    function, so max_bytes_used includes the inputs built before the loop.
#pragma once

#ifndef MIXATTN_BENCH_NO_ALLOCATOR
#include "counting_allocator.hpp"
#endif

#include <mixattn/core.hpp>

#include "../tests/random_matrix.hpp"
#include "fma_probe.hpp"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <random>
#include <string>

namespace mixattn::bench {

#ifdef MIXATTN_BENCH_NO_ALLOCATOR
HeapCounters& heap_counters() noexcept;  // defined by the TU that includes the allocator
#endif

// ---- heap measurement --------------------------------------------------------------------------

/// Peak extra heap over a scope: construct right before the timed loop, read after it. Each
/// call's allocations are freed by the end of its iteration (keep results local to the loop body),
/// so the high-water mark over the loop is the largest single call's extra heap.
class PeakHeap {
 public:
  PeakHeap() noexcept { reset(); }
  void reset() noexcept {
    HeapCounters& c = heap_counters();
    baseline_ = c.current.load(std::memory_order_relaxed);
    c.peak.store(baseline_, std::memory_order_relaxed);
  }
  std::int64_t bytes() const noexcept {
    return heap_counters().peak.load(std::memory_order_relaxed) - baseline_;
  }

 private:
  std::int64_t baseline_ = 0;
};

/// Google Benchmark 1.7.1 MemoryManager over the counting allocator.
class CountingMemoryManager final : public benchmark::MemoryManager {
 public:
  void Start() override {
    HeapCounters& c = heap_counters();
    baseline_ = c.current.load(std::memory_order_relaxed);
    c.peak.store(baseline_, std::memory_order_relaxed);
    allocs0_ = c.allocs.load(std::memory_order_relaxed);
    total0_ = c.total.load(std::memory_order_relaxed);
  }
  void Stop(Result& r) override {
    HeapCounters& c = heap_counters();
    r.num_allocs = c.allocs.load(std::memory_order_relaxed) - allocs0_;
    r.max_bytes_used = c.peak.load(std::memory_order_relaxed) - baseline_;
    r.total_allocated_bytes = c.total.load(std::memory_order_relaxed) - total0_;
    r.net_heap_growth = c.current.load(std::memory_order_relaxed) - baseline_;
  }
  // 1.7.1 still declares the pointer overload pure virtual (deprecated).
  void Stop(Result* r) override { Stop(*r); }

 private:
  std::int64_t baseline_ = 0, allocs0_ = 0, total0_ = 0;
};

// ---- the timed loop ----------------------------------------------------------------------------

/// Thread CPU seconds of FMA peak probe run beside each one-thread repetition (half right before
/// its timed calls, half right after).
constexpr double kPeakBesideSeconds = 0.02;

/// Runs `body` once untimed, then once per benchmark iteration, and marks the point warm.
/// Keep every allocation of a call local to `body` (see PeakHeap): the peak heap is measured over
/// the timed calls only, from what was live after the warm-up call.
/// A one-thread benchmark also reports peak_flops_beside: the FLOP/s of fma_probe.hpp's register-
/// only FMA chains over kPeakBesideSeconds around its timed calls (after the warm-up call, so the
/// probe, which touches no memory, sits between the call that fills the caches and the timed
/// ones). The summary divides the repetition's FLOP rate by it: the host's speed drifts by
/// several percent within seconds (Zen 5 guest, bench_peak in 0.6 s runs a few seconds apart:
/// 220-232 GFLOP/s), so a fraction of peak against a probe run minutes earlier or later is off
/// by as much.
template <class Body>
void timed_loop(benchmark::State& state, PeakHeap& heap, Body&& body) {
  body();
  const bool beside = state.threads() == 1;
  fma_probe::Probe probe;
  if (beside) probe.run(kPeakBesideSeconds / 2);
  heap.reset();
  for (auto _ : state) {
    body();
    benchmark::ClobberMemory();
  }
  if (beside) {
    probe.run(kPeakBesideSeconds / 2);
    state.counters["peak_flops_beside"] = benchmark::Counter(probe.flops_per_second());
  }
  state.counters["warm_up_calls"] = benchmark::Counter(1);
}

// ---- inputs ------------------------------------------------------------------------------------

// random_matrix(rows, cols, seed, scale = 1): the tests' seeded N(0, scale^2) matrices.
using mixattn::testing::random_matrix;

/// An attention call's inputs: q, k (n x r), v and an output gradient d_out (n x d_v; empty
/// without with_grad), N(0, 1) from seeds 1 to 4. The operators' cost does not depend on the
/// values (no data-dependent branches), so plain normal inputs serve.
struct QkvInputs {
  Matrix<float> q, k, v, d_out;
  QkvInputs(Index n, Index r, Index dv, bool with_grad = true)
      : q(random_matrix<float>(n, r, 1)),
        k(random_matrix<float>(n, r, 2)),
        v(random_matrix<float>(n, dv, 3)),
        d_out(with_grad ? random_matrix<float>(n, dv, 4) : Matrix<float>()) {}
};

/// Bytes an attention call over n tokens must move at least: the forward reads q, k, v and writes
/// O; the backward also reads dO and writes dq, dk, dv.
inline double qkv_io_bytes(Index n, Index r, Index dv, bool backward) {
  const double fwd = static_cast<double>(n) * (2 * r + 2 * dv) * sizeof(float);
  return backward ? fwd + static_cast<double>(n) * (3 * r + 3 * dv) * sizeof(float) : fwd;
}

// ---- counters ----------------------------------------------------------------------------------

/// Per-call FLOPs, reported as FLOP/s.
inline void set_flops(benchmark::State& state, double flops_per_call) {
  state.counters["FLOPS"] =
      benchmark::Counter(flops_per_call, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["flop_per_call"] = benchmark::Counter(flops_per_call);
}

/// Per-call bytes the operator must read and write at least once (inputs + outputs), reported as
/// bytes/s, plus the per-call figure itself.
inline void set_bytes(benchmark::State& state, double bytes_per_call) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes_per_call) * state.iterations());
  state.counters["io_bytes"] = benchmark::Counter(bytes_per_call);
}

/// The sweep variable, peak heap and complexity N; call after the timed loop.
inline void finish(benchmark::State& state, Index n, const PeakHeap& heap) {
  state.SetComplexityN(static_cast<std::int64_t>(n));
  state.counters["N"] = benchmark::Counter(static_cast<double>(n));
  state.counters["peak_heap_bytes"] = benchmark::Counter(static_cast<double>(heap.bytes()));
}

/// Tokens per second and seconds per token for sequence benchmarks.
inline void set_tokens(benchmark::State& state, Index tokens) {
  state.counters["tokens_per_s"] = benchmark::Counter(
      static_cast<double>(tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["s_per_token"] = benchmark::Counter(
      static_cast<double>(tokens),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// ---- sweeps ------------------------------------------------------------------------------------

/// The run bench/run.sh makes (MIXATTN_BENCH_MODE): "main", its headline set, picked out of every
/// binary's sweep by --benchmark_filter, or "full", the whole sweep. Recorded in the JSON context.
inline std::string run_mode() {
  const char* m = std::getenv("MIXATTN_BENCH_MODE");
  return m && *m ? m : "full";
}

/// Seconds of timed calls per repetition for points whose ratio needs more than the command
/// line's --benchmark_min_time; the full run only (the main job keeps every point short).
inline void min_time_in_full_run(benchmark::internal::Benchmark* b, double seconds) {
  if (run_mode() == "full") b->MinTime(seconds);
}

/// Powers of two lo, 2 lo, ..., hi as Args, the complexity fit and one thread.
inline void sweep(benchmark::internal::Benchmark* b, Index lo, Index hi) {
  for (Index n = lo; n <= hi; n *= 2) b->Arg(n);
  b->Complexity()->Unit(benchmark::kMillisecond);
}

/// Makes glibc keep freed memory instead of handing blocks above its adaptive mmap/trim
/// thresholds back to the kernel (M_MMAP_THRESHOLD 32 MiB, its maximum; M_TRIM_THRESHOLD 1 GiB):
/// the "memory-keeping allocator" the library's steady-state forms are compared against. Applies
/// to the whole process from the call on. Returns what was applied.
inline std::string keep_freed_memory() {
#if defined(__GLIBC__)
  if (mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1)
    return "keep freed memory (M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB)";
  return "default (mallopt refused)";
#else
  return "default (not glibc)";
#endif
}

/// The benchmarks run under glibc's default malloc, as a user's program does: the training-loop
/// rows go through the `_into` forms, which allocate nothing in steady state.
/// MIXATTN_BENCH_MALLOC=keep opts into keep_freed_memory() for the whole run, as a comparison.
inline std::string configure_malloc() {
  const char* env = std::getenv("MIXATTN_BENCH_MALLOC");
  if (env && std::strcmp(env, "keep") == 0) return keep_freed_memory();
  return "default";
}

inline int run_main(int argc, char** argv) {
  const std::string malloc_mode = configure_malloc();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  static CountingMemoryManager memory_manager;
  // The memory run re-executes each benchmark for up to 16 iterations; set
  // MIXATTN_BENCH_MEMORY_MANAGER=0 to skip it (peak_heap_bytes is reported either way).
  const char* mm = std::getenv("MIXATTN_BENCH_MEMORY_MANAGER");
  if (!(mm && std::strcmp(mm, "0") == 0)) benchmark::RegisterMemoryManager(&memory_manager);
  benchmark::AddCustomContext("mixattn_version", mixattn::version());
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  benchmark::AddCustomContext("eigen_version", std::to_string(EIGEN_WORLD_VERSION) + "." +
                                                   std::to_string(EIGEN_MAJOR_VERSION) + "." +
                                                   std::to_string(EIGEN_MINOR_VERSION));
  benchmark::AddCustomContext("mixattn_bench_mode", run_mode());
  benchmark::AddCustomContext("malloc", malloc_mode);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace mixattn::bench

#define MIXATTN_BENCH_MAIN()                       \
  int main(int argc, char** argv) {                \
    return ::mixattn::bench::run_main(argc, argv); \
  }
