// bench/bench_peak.cpp — the machine's arithmetic limits for one thread, in float, on the vector
// registers the library's kernels use (xsimd batches of the build's default architecture,
// detail::simd_arch: AVX-512 under -march=native on an AVX-512 machine).
//
//   peak_fma_float   independent FMA chains that never leave the registers (fma_probe.hpp): the
//                    FLOP/s no float kernel of this build can beat. bench/summary.py refuses a
//                    rate above it; it divides a one-thread operator's FLOP rate by the same
//                    probe's rate measured beside each repetition (peak_flops_beside,
//                    bench_common.hpp), and the others' by this one (fraction of peak).
//   peak_exp_float   xsimd::exp over an L1-resident array: exponentials per second, the other
//                    limit of the softmax and log-density kernels.
//
// Both report flop_per_call / exp_per_call and the lanes of one register; the label names the
// instruction set.
#include "bench_common.hpp"

#include <mixattn/core.hpp>
#include <mixattn/detail/common/simd.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <vector>

namespace {

namespace mb = mixattn::bench;
namespace fp = mixattn::bench::fma_probe;
using fp::exp;
using fp::kLanes;
using fp::load;
using fp::splat;
using fp::sum;
using fp::Vec;

void peak_fma_float(benchmark::State& state) {
  float a = 0.999f, b = 1e-3f;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    benchmark::DoNotOptimize(a);  // opaque operands on every call: nothing to hoist out of the loop
    benchmark::DoNotOptimize(b);
    benchmark::DoNotOptimize(fp::fma_chains(a, b));
  });
  mb::set_flops(state, fp::flop_per_call());
  state.counters["lanes"] = benchmark::Counter(kLanes);
  state.SetLabel(fp::Arch::name());
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
  state.SetLabel(fp::Arch::name());
}

BENCHMARK(peak_fma_float)->Unit(benchmark::kMicrosecond);
BENCHMARK(peak_exp_float)->Unit(benchmark::kMicrosecond);

}  // namespace

MIXATTN_BENCH_MAIN()
