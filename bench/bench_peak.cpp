// bench/bench_peak.cpp — the machine's arithmetic limits for one thread, in float, on the vector
// registers the library's kernels use (xsimd batches of the build's default architecture,
// detail::simd_arch: AVX-512 under -march=native on an AVX-512 machine).
//
//   peak_fma_float   independent FMA chains that never leave the registers: the FLOP/s no float
//                    kernel of this build can beat. bench/summary.py divides every operator's
//                    FLOP rate by it (fraction of peak) and refuses a rate above it.
//   peak_exp_float   xsimd::exp over an L1-resident array: exponentials per second, the other
//                    limit of the softmax and log-density kernels.
//
// Both report flop_per_call / exp_per_call and the lanes of one register; the label names the
// instruction set.
#include "bench_common.hpp"

#include <mixattn/core.hpp>
#include <mixattn/detail/simd.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <vector>

namespace {

namespace mb = mixattn::bench;
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

/// kChains x kFmaSteps FMAs on registers. acc <- acc * a + b with 0 < a < 1 converges to
/// b / (1 - a): no overflow, no denormals, and the compiler cannot fold the chain away.
float fma_chains(float a_value, float b_value) {
  const Vec a = splat(a_value), b = splat(b_value);
  std::array<Vec, kChains> acc;
  for (int c = 0; c < kChains; ++c) acc[c] = splat(static_cast<float>(c));
  for (long s = 0; s < kFmaSteps; ++s)
    for (int c = 0; c < kChains; ++c) acc[c] = fma(acc[c], a, b);
  Vec total = acc[0];
  for (int c = 1; c < kChains; ++c) total = total + acc[c];
  return sum(total);
}

void peak_fma_float(benchmark::State& state) {
  float a = 0.999f, b = 1e-3f;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    benchmark::DoNotOptimize(a);  // opaque operands on every call: nothing to hoist out of the loop
    benchmark::DoNotOptimize(b);
    benchmark::DoNotOptimize(fma_chains(a, b));
  });
  mb::set_flops(state, 2.0 * kLanes * kChains * static_cast<double>(kFmaSteps));
  state.counters["lanes"] = benchmark::Counter(kLanes);
  state.SetLabel(Arch::name());
}

constexpr std::size_t kExpArray = 2048;  // 8 KiB: stays in L1
constexpr int kExpPasses = 32;
constexpr int kExpChains = 4;

/// kExpPasses passes of xsimd::exp over x, summed in kExpChains independent accumulators.
float exp_passes(const std::vector<float>& x) {
  std::array<Vec, kExpChains> acc;
  acc.fill(splat(0.0f));
  constexpr std::size_t step = static_cast<std::size_t>(kLanes) * kExpChains;
  for (int p = 0; p < kExpPasses; ++p)
    for (std::size_t i = 0; i + step <= x.size(); i += step)
      for (int c = 0; c < kExpChains; ++c)
        acc[c] = acc[c] + exp(load(x.data() + i + static_cast<std::size_t>(c) * kLanes));
  Vec total = acc[0];
  for (int c = 1; c < kExpChains; ++c) total = total + acc[c];
  return sum(total);
}

void peak_exp_float(benchmark::State& state) {
  std::vector<float> x(kExpArray);
  // Arguments over [-20, 0], the range a max-subtracted softmax feeds exp.
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = -20.0f * static_cast<float>(i) / static_cast<float>(x.size());
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] { benchmark::DoNotOptimize(exp_passes(x)); });
  const double per_call = static_cast<double>(kExpArray) * kExpPasses;
  state.counters["exp_per_call"] = benchmark::Counter(per_call);
  state.counters["exp_per_s"] =
      benchmark::Counter(per_call, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["lanes"] = benchmark::Counter(kLanes);
  state.SetLabel(Arch::name());
}

BENCHMARK(peak_fma_float)->Unit(benchmark::kMicrosecond);
BENCHMARK(peak_exp_float)->Unit(benchmark::kMicrosecond);

}  // namespace

MIXATTN_BENCH_MAIN()
