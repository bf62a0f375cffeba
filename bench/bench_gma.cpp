// bench/bench_gma.cpp — Gaussian Mixture Attention (SPEC §1), float, one thread.
//
//   gma_responsibilities          Γ of N tokens (SPEC 1.2)
//   gma_forward_{bidir,causal}    SPEC 1.3 / 1.4 (causal with the library's default chunk)
//   gma_fwd_bwd_{bidir,causal}    forward with Saved, then backward (SPEC 1.5)
//   gma_train_step_into_{bidir,causal}
//                                 the same step through forward_into / backward_into with
//                                 reused records (no allocation in steady state), under glibc's
//                                 default malloc, also at N = 131072 (per token flat in N: the
//                                 records stream through memory); gma_fwd_bwd_* over these at
//                                 the same N is what the value-returning forms cost; ..._keep:
//                                 the same after keep_freed_memory(), registered last because it
//                                 changes the process's malloc policy
//   floor_gma_*                   the Eigen GEMMs of the same shapes (gma_floor.hpp lists them)
// N = 256 ... 65536, K = 64 components, r = d_v = 64. The FLOPS counter is the floor's GEMM
// work for both an operator and its floor, so the counter ratio is the time ratio.
#include "bench_common.hpp"
#include "gma_floor.hpp"

#include <mixattn/gma.hpp>

#include <cmath>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace mb = mixattn::bench;
namespace gma = mixattn::gma;

constexpr Index kK = 64;
constexpr Index kR = 64;
constexpr Index kDv = 64;
constexpr Index kMaxN = 65536;
// The floor uses the chunk the operator uses by default (options.chunk = 0).
constexpr Index kChunk = mixattn::detail::default_scan_chunk;

struct Inputs : mb::QkvInputs {
  gma::Mixture<float> mix;
  explicit Inputs(Index n) : QkvInputs(n, kR, kDv), mix(gma::Mixture<float>::random(kK, kR, 7)) {}
};

double io_bytes(Index n, bool backward) { return mb::qkv_io_bytes(n, kR, kDv, backward); }

void gma_responsibilities(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    Matrix<float> g = gma::responsibilities(in.mix, in.q);
    benchmark::DoNotOptimize(g.data());
  });
  mb::set_flops(state, mb::GmaFloor::responsibilities_flops(n, kK, kR));
  mb::set_bytes(state, static_cast<double>(n) * (kR + kK) * sizeof(float));
  mb::finish(state, n, heap);
}

void run_forward(benchmark::State& state, bool causal) {
  const Index n = state.range(0);
  const Inputs in(n);
  gma::Options opt;
  opt.causal = causal;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    Matrix<float> out = gma::forward(in.mix, in.q, in.k, in.v, opt);
    benchmark::DoNotOptimize(out.data());
  });
  mb::set_flops(state, mb::GmaFloor::forward_flops(n, kK, kR, kDv, kChunk, causal));
  mb::set_bytes(state, io_bytes(n, false));
  mb::finish(state, n, heap);
}

void run_forward_backward(benchmark::State& state, bool causal) {
  const Index n = state.range(0);
  const Inputs in(n);
  gma::Options opt;
  opt.causal = causal;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    gma::Saved<float> saved;
    Matrix<float> out = gma::forward(in.mix, in.q, in.k, in.v, opt, &saved);
    benchmark::DoNotOptimize(out.data());
    gma::Grad<float> g = gma::backward(in.mix, in.q, in.k, in.v, in.d_out, saved, opt);
    benchmark::DoNotOptimize(g.q.data());
  });
  mb::set_flops(state, mb::GmaFloor::forward_flops(n, kK, kR, kDv, kChunk, causal) +
                           mb::GmaFloor::backward_flops(n, kK, kR, kDv, kChunk, causal));
  mb::set_bytes(state, io_bytes(n, true));
  mb::finish(state, n, heap);
}

void run_train_step_into(benchmark::State& state, bool keep, bool causal) {
  const Index n = state.range(0);
  if (keep) state.SetLabel(mb::keep_freed_memory());
  const Inputs in(n);
  gma::Options opt;
  opt.causal = causal;
  Matrix<float> out;
  gma::Saved<float> saved;
  gma::Grad<float> g;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {  // the untimed first call sizes the records
    gma::forward_into(out, in.mix, in.q, in.k, in.v, opt, &saved);
    gma::backward_into(g, in.mix, in.q, in.k, in.v, in.d_out, saved, opt);
    benchmark::DoNotOptimize(g.q.data());
  });
  mb::set_flops(state, mb::GmaFloor::forward_flops(n, kK, kR, kDv, kChunk, causal) +
                           mb::GmaFloor::backward_flops(n, kK, kR, kDv, kChunk, causal));
  mb::set_bytes(state, io_bytes(n, true));
  mb::finish(state, n, heap);
}

enum class What { responsibilities, forward, forward_backward };

void run_floor(benchmark::State& state, What what, bool causal) {
  const Index n = state.range(0);
  mb::GmaFloor floor(n, kK, kR, kDv, kChunk);
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    floor.reset_flops();
    switch (what) {
      case What::responsibilities:
        floor.responsibilities();
        break;
      case What::forward:
        floor.forward(causal);
        break;
      case What::forward_backward:
        floor.forward_backward(causal);
        break;
    }
    benchmark::DoNotOptimize(floor.sink());
  });
  double expected = mb::GmaFloor::responsibilities_flops(n, kK, kR);
  if (what != What::responsibilities)
    expected = mb::GmaFloor::forward_flops(n, kK, kR, kDv, kChunk, causal);
  if (what == What::forward_backward)
    expected += mb::GmaFloor::backward_flops(n, kK, kR, kDv, kChunk, causal);
  // The operators' FLOPS counters use the closed form; it must match what the floor issues.
  if (std::abs(floor.flops() - expected) > 1e-9 * expected)
    state.SkipWithError("GmaFloor closed-form FLOP count disagrees with the issued GEMMs");
  mb::set_flops(state, floor.flops());
  mb::set_bytes(state, io_bytes(n, what == What::forward_backward));
  mb::finish(state, n, heap);
}

void sweep(benchmark::internal::Benchmark* b) {
  mb::sweep(b, 256, kMaxN);
}

BENCHMARK(gma_responsibilities)->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, responsibilities, What::responsibilities, false)
    ->Name("floor_gma_responsibilities")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_forward, bidir, false)->Name("gma_forward_bidir")->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, forward_bidir, What::forward, false)
    ->Name("floor_gma_forward_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_forward, causal, true)->Name("gma_forward_causal")->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, forward_causal, What::forward, true)
    ->Name("floor_gma_forward_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_forward_backward, bidir, false)->Name("gma_fwd_bwd_bidir")->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, fwd_bwd_bidir, What::forward_backward, false)
    ->Name("floor_gma_fwd_bwd_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_forward_backward, causal, true)->Name("gma_fwd_bwd_causal")->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, fwd_bwd_causal, What::forward_backward, true)
    ->Name("floor_gma_fwd_bwd_causal")
    ->Apply(sweep);
// The target row compares the bidirectional pair at N = 4096 (glibc defaults within 1.1x of
// keeping memory); gma_fwd_bwd_{bidir,causal} over the default-malloc rows at 4096 and 65536 is
// the value-returning forms' cost over the _into forms'. _keep changes the process's malloc
// policy, so it is registered last.
BENCHMARK_CAPTURE(run_train_step_into, default_malloc, false, false)
    ->Name("gma_train_step_into_bidir")
    ->Arg(4096)
    ->Arg(16384)
    ->Arg(65536)
    ->Arg(131072)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(run_train_step_into, causal_default_malloc, false, true)
    ->Name("gma_train_step_into_causal")
    ->Arg(4096)
    ->Arg(16384)
    ->Arg(65536)
    ->Arg(131072)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(run_train_step_into, keep, true, false)
    ->Name("gma_train_step_into_bidir_keep")
    ->Arg(4096)
    ->Arg(16384)
    ->Unit(benchmark::kMillisecond);

}  // namespace

MIXATTN_BENCH_MAIN()
