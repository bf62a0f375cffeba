// bench/fma_probe.hpp — the FMA peak probe: independent FMA chains on the widest vector registers
// the build targets (xsimd batches of detail::simd_arch), which never leave the registers. Its
// FLOP rate is the most that any float kernel of this build can reach on one thread.
//
// bench_peak.cpp measures it as a benchmark of its own (peak_fma_float), and timed_loop
// (bench_common.hpp) measures it beside every one-thread repetition, right before and right after
// the timed calls (the counter peak_flops_beside): the host's speed drifts by several percent
// within seconds and by more over minutes, so a fraction of peak is judged against the peak of
// the same moment (bench/summary.py).
#pragma once

#include <mixattn/core.hpp>
#include <mixattn/detail/common/simd.hpp>

#include <benchmark/benchmark.h>

#include <array>
#include <cmath>
#include <ctime>

namespace mixattn::bench::fma_probe {

using Arch = mixattn::detail::simd_arch;
constexpr int kLanes = static_cast<int>(mixattn::detail::simd_width<Arch, float>::value);

#if MIXATTN_HAS_SIMD
using Vec = xsimd::batch<float, Arch>;
inline Vec splat(float x) {
  return Vec(x);
}
inline Vec fma(const Vec& a, const Vec& b, const Vec& c) {
  return xsimd::fma(a, b, c);
}
inline Vec exp(const Vec& x) {
  return xsimd::exp(x);
}
inline Vec load(const float* p) {
  return Vec::load_unaligned(p);
}
inline float sum(const Vec& x) {
  return xsimd::hadd(x);
}
#else
using Vec = float;
inline Vec splat(float x) {
  return x;
}
inline Vec fma(Vec a, Vec b, Vec c) {
  return a * b + c;
}
inline Vec exp(Vec x) {
  return std::exp(x);
}
inline Vec load(const float* p) {
  return *p;
}
inline float sum(Vec x) {
  return x;
}
#endif

// Enough independent chains to cover FMA latency times the FMA pipes (4 cycles x 2 pipes on
// current x86 cores), leaving two registers for the operands and none to spill.
constexpr int kChains = mixattn::detail::simd_registers<Arch>() >= 32 ? 16 : 10;
constexpr long kFmaSteps = 1 << 15;

/// FLOPs of one fma_chains call (an FMA is two).
constexpr double flop_per_call() {
  return 2.0 * kLanes * kChains * static_cast<double>(kFmaSteps);
}

/// kChains x kFmaSteps FMAs on registers. acc <- acc * a + b with 0 < a < 1 converges to
/// b / (1 - a): no overflow, no denormals, and the compiler cannot fold the chain away.
inline float fma_chains(float a_value, float b_value) {
  const Vec a = splat(a_value), b = splat(b_value);
  std::array<Vec, kChains> acc;
  for (int c = 0; c < kChains; ++c) acc[c] = splat(static_cast<float>(c));
  for (long s = 0; s < kFmaSteps; ++s)
    for (int c = 0; c < kChains; ++c) acc[c] = fma(acc[c], a, b);
  Vec total = acc[0];
  for (int c = 1; c < kChains; ++c) total = total + acc[c];
  return sum(total);
}

/// CPU time of the calling thread, in seconds: what Google Benchmark's cpu_time measures for a
/// one-thread benchmark, so that a probe and the timed calls beside it are timed alike.
inline double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Calls of fma_chains between two readings of the clock in Probe::run: reading the thread CPU
/// clock is a system call (not in the vDSO), and read after every ~75 us call it made the probe
/// ~2.5% slower than bench_peak's own loop (Zen 5 guest); every 16 calls, within 0.4% of it.
constexpr int kCallsPerReading = 16;

/// Accumulates probe runs: run() calls fma_chains, kCallsPerReading at a time, until `seconds` of
/// thread CPU time have passed; flops_per_second() is the rate over every run so far.
class Probe {
 public:
  void run(double seconds) {
    float a = 0.999f, b = 1e-3f;
    const double t0 = thread_seconds();
    double t = t0;
    do {
      for (int i = 0; i < kCallsPerReading; ++i) {
        benchmark::DoNotOptimize(a);  // opaque operands on every call: nothing to hoist
        benchmark::DoNotOptimize(b);
        benchmark::DoNotOptimize(fma_chains(a, b));
      }
      calls_ += kCallsPerReading;
      t = thread_seconds();
    } while (t - t0 < seconds);
    seconds_ += t - t0;
  }
  double flops_per_second() const {
    return seconds_ > 0 ? static_cast<double>(calls_) * flop_per_call() / seconds_ : 0.0;
  }

 private:
  long calls_ = 0;
  double seconds_ = 0;
};

}  // namespace mixattn::bench::fma_probe
