// bench/bench_reference.cpp — the O(N²) softmax attention baselines (SPEC §3), float, one thread.
//
//   naive_*  materialises N x N (the oracle): N = 256 ... 4096 (N² floats must fit, twice for
//            backward)
//   flash_*  tiled online softmax (the honest baseline): N = 256 ... 16384
//   floor_softmax_*  the Eigen GEMMs of the same shapes (softmax_floor.hpp), so that flash's
//            fraction of the GEMM rate is time(floor) / time(flash)
// each bidirectional and causal, forward and forward+backward; r = d_v = 64.
// FLOPS counters use the nominal GEMM work (4 N² r forward, 14 N² r forward+backward
// bidirectional, about half causal), identical for an operator and its floor.
//   flash_window<w>_*  sliding-window causal flash attention (SPEC §7), windows of w = 256 and
//            512 keys, N = 2048, 4096, 8192: the time should grow with N w, not N². FLOPS count
//            the visible (query, key) pairs only, V = sum_i min(i + 1, w) = N w - w (w - 1) / 2
//            (N >= w), at the full kernels' per-pair rates: 2 V (r + d_v) forward (about
//            4 N w r for r = d_v and N >> w), 2 V (3 r + 2 d_v) more for the backward. The
//            masked parts of edge tiles (up to a tile's width per row) are not counted: the
//            count is the useful work, not the work done.
#include "bench_common.hpp"
#include "softmax_floor.hpp"

#include <mixattn/reference.hpp>
#include <mixattn/window.hpp>

#include <algorithm>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace mb = mixattn::bench;
namespace ref = mixattn::reference;

constexpr Index kR = 64;
constexpr Index kDv = 64;

struct Inputs : mb::QkvInputs {
  explicit Inputs(Index n) : QkvInputs(n, kR, kDv) {}
};

double io_bytes(Index n, bool backward) { return mb::qkv_io_bytes(n, kR, kDv, backward); }

enum class Impl { naive, flash };

void run_forward(benchmark::State& state, Impl impl, bool causal) {
  const Index n = state.range(0);
  const Inputs in(n);
  ref::Options opt;
  opt.causal = causal;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    Matrix<float> out = impl == Impl::naive ? ref::naive_forward<float>(in.q, in.k, in.v, opt)
                                            : ref::flash_forward<float>(in.q, in.k, in.v, opt);
    benchmark::DoNotOptimize(out.data());
  });
  mb::set_flops(state, mb::SoftmaxFloor::forward_flops(n, kR, kDv, causal));
  mb::set_bytes(state, io_bytes(n, false));
  mb::finish(state, n, heap);
}

void run_forward_backward(benchmark::State& state, Impl impl, bool causal) {
  const Index n = state.range(0);
  const Inputs in(n);
  ref::Options opt;
  opt.causal = causal;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    ref::Saved<float> saved;
    if (impl == Impl::naive) {
      Matrix<float> out = ref::naive_forward<float>(in.q, in.k, in.v, opt, &saved);
      benchmark::DoNotOptimize(out.data());
      ref::Grad<float> g = ref::naive_backward<float>(in.q, in.k, in.v, in.d_out, saved, opt);
      benchmark::DoNotOptimize(g.q.data());
    } else {
      Matrix<float> out = ref::flash_forward<float>(in.q, in.k, in.v, opt, &saved);
      benchmark::DoNotOptimize(out.data());
      ref::Grad<float> g = ref::flash_backward<float>(in.q, in.k, in.v, in.d_out, saved, opt);
      benchmark::DoNotOptimize(g.q.data());
    }
  });
  mb::set_flops(state, mb::SoftmaxFloor::forward_flops(n, kR, kDv, causal) +
                           mb::SoftmaxFloor::backward_flops(n, kR, kDv, causal));
  mb::set_bytes(state, io_bytes(n, true));
  mb::finish(state, n, heap);
}

void run_floor(benchmark::State& state, bool causal, bool backward) {
  const Index n = state.range(0);
  const Inputs in(n);
  mb::SoftmaxFloor floor(n, kR, kDv);
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    if (backward)
      floor.forward_backward(in.q, in.k, in.v, in.d_out, causal);
    else
      floor.forward(in.q, in.k, in.v, causal);
    benchmark::DoNotOptimize(floor.out().data());
  });
  double flops = mb::SoftmaxFloor::forward_flops(n, kR, kDv, causal);
  if (backward) flops += mb::SoftmaxFloor::backward_flops(n, kR, kDv, causal);
  mb::set_flops(state, flops);
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

/// Visible (query, key) pairs of causal attention with a window of w keys over n tokens.
double window_pairs(Index n, Index w) {
  double v = 0;
  for (Index i = 0; i < n; ++i) v += static_cast<double>(std::min(i + 1, w));
  return v;
}

/// Through window.hpp's `_into` forms with the output, record and gradients reused across calls,
/// as a training loop runs it: the time is the kernels', not the allocator's.
void run_window(benchmark::State& state, Index window, bool backward) {
  const Index n = state.range(0);
  const Inputs in(n);
  mixattn::window::Options opt;
  opt.window = window;
  Matrix<float> out;
  mixattn::window::Saved<float> saved;
  mixattn::window::Grad<float> grad;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    mixattn::window::forward_into<float>(out, in.q, in.k, in.v, opt, backward ? &saved : nullptr);
    benchmark::DoNotOptimize(out.data());
    if (backward) {
      mixattn::window::backward_into<float>(grad, in.q, in.k, in.v, in.d_out, saved, opt);
      benchmark::DoNotOptimize(grad.q.data());
    }
  });
  const double pairs = window_pairs(n, window);
  double flops = 2 * pairs * static_cast<double>(kR + kDv);
  if (backward) flops += 2 * pairs * static_cast<double>(3 * kR + 2 * kDv);
  mb::set_flops(state, flops);
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

constexpr Index kNaiveMax = 4096;
constexpr Index kFlashMax = 16384;

void naive_sweep(benchmark::internal::Benchmark* b) {
  mb::sweep(b, 256, kNaiveMax);
}
void flash_sweep(benchmark::internal::Benchmark* b) {
  mb::sweep(b, 256, kFlashMax);
}
/// N = 2048 ... 8192: the per-token target compares the two ends (time linear in N for a fixed
/// window).
void window_sweep(benchmark::internal::Benchmark* b) {
  mb::sweep(b, 2048, 8192);
}

BENCHMARK_CAPTURE(run_forward, naive_bidir, Impl::naive, false)
    ->Name("naive_forward_bidir")
    ->Apply(naive_sweep);
BENCHMARK_CAPTURE(run_forward, naive_causal, Impl::naive, true)
    ->Name("naive_forward_causal")
    ->Apply(naive_sweep);
BENCHMARK_CAPTURE(run_forward_backward, naive_bidir, Impl::naive, false)
    ->Name("naive_fwd_bwd_bidir")
    ->Apply(naive_sweep);
BENCHMARK_CAPTURE(run_forward_backward, naive_causal, Impl::naive, true)
    ->Name("naive_fwd_bwd_causal")
    ->Apply(naive_sweep);
BENCHMARK_CAPTURE(run_forward, flash_bidir, Impl::flash, false)
    ->Name("flash_forward_bidir")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_forward, flash_causal, Impl::flash, true)
    ->Name("flash_forward_causal")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_forward_backward, flash_bidir, Impl::flash, false)
    ->Name("flash_fwd_bwd_bidir")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_forward_backward, flash_causal, Impl::flash, true)
    ->Name("flash_fwd_bwd_causal")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_floor, forward_bidir, false, false)
    ->Name("floor_softmax_forward_bidir")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_floor, forward_causal, true, false)
    ->Name("floor_softmax_forward_causal")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_floor, fwd_bwd_bidir, false, true)
    ->Name("floor_softmax_fwd_bwd_bidir")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_floor, fwd_bwd_causal, true, true)
    ->Name("floor_softmax_fwd_bwd_causal")
    ->Apply(flash_sweep);
BENCHMARK_CAPTURE(run_window, w256_forward, 256, false)
    ->Name("flash_window256_forward_causal")
    ->Apply(window_sweep);
BENCHMARK_CAPTURE(run_window, w512_forward, 512, false)
    ->Name("flash_window512_forward_causal")
    ->Apply(window_sweep);
BENCHMARK_CAPTURE(run_window, w256_fwd_bwd, 256, true)
    ->Name("flash_window256_fwd_bwd_causal")
    ->Apply(window_sweep);
BENCHMARK_CAPTURE(run_window, w512_fwd_bwd, 512, true)
    ->Name("flash_window512_fwd_bwd_causal")
    ->Apply(window_sweep);

}  // namespace

MIXATTN_BENCH_MAIN()
