// bench/bench_linformer.cpp — Linformer (SPEC §11), float, one head, one thread.
//
//   linformer_forward/k:K/N:N   forward_into without a record (inference), output reused
//   linformer_step/k:K/N:N      forward_into with a reused Saved, then backward_into into a reused
//                               Grad: a training step, allocation-free after the warm-up call
// d = d_v = 64, k_proj = K (256 as in the paper's long-sequence runs), the default scale. FLOPs:
// the count of docs/benchmarking.md ("Linformer's FLOP count"); the fraction of peak is the FLOP
// rate over peak_flops_beside.
#include "bench_common.hpp"

#include <mixattn/linformer.hpp>

#include <cmath>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace mb = mixattn::bench;
namespace linformer = mixattn::linformer;

constexpr Index kDim = 64;

double forward_flops(double n, double kp, double d, double dv) {
  return 4 * n * kp * (d + dv);
}
double step_flops(double n, double kp, double d, double dv) {
  return 12 * n * kp * (d + dv);
}

/// q, k, v, dO (N x d) and E, F (k_proj x N, entries of size 1/sqrt(N)): seeded.
struct Inputs : mb::QkvInputs {
  Matrix<float> E, F;
  Inputs(Index n, Index kp)
      : QkvInputs(n, kDim, kDim),
        E(mb::random_matrix<float>(kp, n, 5, 1 / std::sqrt(static_cast<double>(n)))),
        F(mb::random_matrix<float>(kp, n, 6, 1 / std::sqrt(static_cast<double>(n)))) {}
};

void run_forward(benchmark::State& state) {
  const Index kp = state.range(0), n = state.range(1);
  const Inputs in(n, kp);
  const linformer::Options opt;
  Matrix<float> out;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    linformer::forward_into(out, in.q, in.k, in.v, in.E, in.F, opt, nullptr);
    benchmark::DoNotOptimize(out.data());
  });
  mb::set_flops(state, forward_flops(n, kp, kDim, kDim));
  mb::set_bytes(state, mb::qkv_io_bytes(n, kDim, kDim, false));
  mb::set_tokens(state, n);
  mb::finish(state, n, heap);
}

void run_step(benchmark::State& state) {
  const Index kp = state.range(0), n = state.range(1);
  const Inputs in(n, kp);
  const linformer::Options opt;
  Matrix<float> out;
  linformer::Saved<float> saved;
  linformer::Grad<float> grad;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    linformer::forward_into(out, in.q, in.k, in.v, in.E, in.F, opt, &saved);
    linformer::backward_into(grad, in.q, in.k, in.v, in.E, in.F, in.d_out, saved, opt);
    benchmark::DoNotOptimize(grad.q.data());
  });
  mb::set_flops(state, step_flops(n, kp, kDim, kDim));
  mb::set_bytes(state, mb::qkv_io_bytes(n, kDim, kDim, true));
  mb::set_tokens(state, n);
  mb::finish(state, n, heap);
}

void sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"k", "N"});
  for (Index n = 1024; n <= 16384; n *= 2) b->Args({256, n});
  b->Args({128, 4096});
  b->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(run_forward)->Name("linformer_forward")->Apply(sizes);
BENCHMARK(run_step)->Name("linformer_step")->Apply(sizes);

MIXATTN_BENCH_MAIN()
