// bench/bench_linear.cpp — linear attention (SPEC §4, elu + 1 features), float, one thread.
//
//   linear_forward_{bidir,causal}    SPEC 4.2 (causal with the default chunk shared with GMA)
//   linear_fwd_bwd_{bidir,causal}    forward with Saved, then backward (SPEC 4.3)
//   floor_linear_*                   the Eigen GEMMs of the same shapes: GMA's floor with K = r
//                                    features and no responsibilities (gma_floor.hpp)
// N = 256 ... 65536, r = d_v = 64 (GMA's K = r = d_v, so linear and GMA rows compare at equal
// state size). The FLOPS counter is the floor's GEMM work for both an operator and its floor.
#include "bench_common.hpp"
#include "gma_floor.hpp"

#include <mixattn/linear.hpp>

#include <cmath>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace mb = mixattn::bench;
namespace linear = mixattn::linear;

constexpr Index kR = 64;
constexpr Index kDv = 64;
constexpr Index kMaxN = 65536;
constexpr Index kQuickSet[] = {256, 1024, 4096, 16384, 65536};
constexpr Index kChunk = mixattn::detail::gma_default_chunk;

struct Inputs : mb::QkvInputs {
  explicit Inputs(Index n) : QkvInputs(n, kR, kDv) {}
};

double io_bytes(Index n, bool backward) { return mb::qkv_io_bytes(n, kR, kDv, backward); }

double floor_flops(Index n, bool causal, bool backward) {
  const double f = mb::GmaFloor::forward_flops(n, kR, kR, kDv, kChunk, causal, false);
  return backward ? f + mb::GmaFloor::backward_flops(n, kR, kR, kDv, kChunk, causal, false) : f;
}

void run_operator(benchmark::State& state, bool causal, bool backward) {
  const Index n = state.range(0);
  const Inputs in(n);
  linear::Options opt;
  opt.causal = causal;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    linear::Saved<float> saved;
    Matrix<float> out = linear::forward<float>(in.q, in.k, in.v, opt, backward ? &saved : nullptr);
    benchmark::DoNotOptimize(out.data());
    if (backward) {
      linear::Grad<float> g = linear::backward<float>(in.q, in.k, in.v, in.d_out, saved, opt);
      benchmark::DoNotOptimize(g.q.data());
    }
  });
  mb::set_flops(state, floor_flops(n, causal, backward));
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

void run_floor(benchmark::State& state, bool causal, bool backward) {
  const Index n = state.range(0);
  mb::GmaFloor floor(n, kR, kR, kDv, kChunk, /*density=*/false);
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    floor.reset_flops();
    if (backward)
      floor.forward_backward(causal);
    else
      floor.forward(causal);
    benchmark::DoNotOptimize(floor.sink());
  });
  const double expected = floor_flops(n, causal, backward);
  if (std::abs(floor.flops() - expected) > 1e-9 * expected)
    state.SkipWithError("GmaFloor closed-form FLOP count disagrees with the issued GEMMs");
  mb::set_flops(state, floor.flops());
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

void linear_forward_bidir(benchmark::State& s) {
  run_operator(s, false, false);
}
void linear_forward_causal(benchmark::State& s) {
  run_operator(s, true, false);
}
void linear_fwd_bwd_bidir(benchmark::State& s) {
  run_operator(s, false, true);
}
void linear_fwd_bwd_causal(benchmark::State& s) {
  run_operator(s, true, true);
}
void floor_linear_forward_bidir(benchmark::State& s) {
  run_floor(s, false, false);
}
void floor_linear_forward_causal(benchmark::State& s) {
  run_floor(s, true, false);
}
void floor_linear_fwd_bwd_bidir(benchmark::State& s) {
  run_floor(s, false, true);
}
void floor_linear_fwd_bwd_causal(benchmark::State& s) {
  run_floor(s, true, true);
}

void sweep(benchmark::internal::Benchmark* b) {
  mb::sweep(b, 256, kMaxN, kQuickSet);
}

BENCHMARK(linear_forward_bidir)->Apply(sweep);
BENCHMARK(floor_linear_forward_bidir)->Apply(sweep);
BENCHMARK(linear_forward_causal)->Apply(sweep);
BENCHMARK(floor_linear_forward_causal)->Apply(sweep);
BENCHMARK(linear_fwd_bwd_bidir)->Apply(sweep);
BENCHMARK(floor_linear_fwd_bwd_bidir)->Apply(sweep);
BENCHMARK(linear_fwd_bwd_causal)->Apply(sweep);
BENCHMARK(floor_linear_fwd_bwd_causal)->Apply(sweep);

}  // namespace

MIXATTN_BENCH_MAIN()
