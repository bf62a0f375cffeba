// bench/bench_delta.cpp — the gated delta rule (SPEC §9), float, one head, one thread.
//
//   delta_forward/d:D/N:N      forward_into without a record (inference), output reused
//   delta_step/d:D/N:N         forward_into with a reused Saved, then backward_into into a reused
//                              Grad: a training step, allocation-free after the warm-up call
//   delta_recurrence/d:D/N:N   the same forward as decoding computes it: forward_into on one row
//                              at a time continuing a State (the token-by-token recurrence on the
//                              wide state, per call its checks), over the whole sequence
//   delta_decode/d:D/P:P       one token per call after P tokens (the state prefilled), each
//                              iteration one more token; counters mean_s, p99_s, max_s per token
// d_k = d_v = D (64, 128), the default options (C = 64, q and k normalised inside, the states
// recomputed in backward). FLOPs: the chunked algorithm's count of docs/benchmarking.md
// ("The gated delta rule's FLOP count"), 6 d_k d_v per token for the recurrence and decoding.
#include "bench_common.hpp"

#include <mixattn/delta.hpp>

#include <algorithm>
#include <chrono>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace mb = mixattn::bench;
namespace delta = mixattn::delta;

constexpr Index kChunk = 64;  // delta::Options' default

/// Per token, SPEC 9.2 / 9.3 as counted in docs/benchmarking.md.
double forward_flops_per_token(double dk, double dv, double c) {
  return 6 * dk * dv + c * (3 * dk + 2 * dv) + c * c / 3;
}
double step_flops_per_token(double dk, double dv, double c) {
  return 20 * dk * dv + c * (9 * dk + 6 * dv) + 2 * c * c / 3;
}
double recurrence_flops_per_token(double dk, double dv) { return 6 * dk * dv; }

/// q, k, v (N x d), dO, g (log decays in [-0.5, 0)), beta in (0.05, 0.95): seeded.
struct Inputs : mb::QkvInputs {
  Vector<float> g, beta;
  Inputs(Index n, Index d) : QkvInputs(n, d, d), g(n), beta(n) {
    std::mt19937_64 rng(5);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (Index t = 0; t < n; ++t) {
      g(t) = static_cast<float>(-0.5 * u(rng) - 1e-3);
      beta(t) = static_cast<float>(0.05 + 0.9 * u(rng));
    }
  }
};

void run_forward(benchmark::State& state) {
  const Index d = state.range(0), n = state.range(1);
  const Inputs in(n, d);
  const delta::Options opt;
  Matrix<float> out;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    delta::forward_into(out, in.q, in.k, in.v, in.g, in.beta, opt, nullptr, nullptr);
    benchmark::DoNotOptimize(out.data());
  });
  mb::set_flops(state, forward_flops_per_token(d, d, kChunk) * static_cast<double>(n));
  mb::set_bytes(state, mb::qkv_io_bytes(n, d, d, false));
  mb::set_tokens(state, n);
  mb::finish(state, n, heap);
}

void run_step(benchmark::State& state) {
  const Index d = state.range(0), n = state.range(1);
  const Inputs in(n, d);
  const delta::Options opt;
  Matrix<float> out;
  delta::Saved<float> saved;
  delta::Grad<float> grad;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    delta::forward_into(out, in.q, in.k, in.v, in.g, in.beta, opt, nullptr, &saved);
    delta::backward_into(grad, in.q, in.k, in.v, in.g, in.beta, in.d_out, saved, opt);
    benchmark::DoNotOptimize(grad.q.data());
  });
  mb::set_flops(state, step_flops_per_token(d, d, kChunk) * static_cast<double>(n));
  mb::set_bytes(state, mb::qkv_io_bytes(n, d, d, true));
  mb::set_tokens(state, n);
  mb::finish(state, n, heap);
}

void run_recurrence(benchmark::State& state) {
  const Index d = state.range(0), n = state.range(1);
  const Inputs in(n, d);
  const delta::Options opt;
  Matrix<float> out(n, d), row;
  delta::State<float> st = delta::State<float>::empty(d, d);
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    st.S.setZero();
    st.tokens_seen = 0;
    for (Index t = 0; t < n; ++t) {
      delta::forward_into(row, in.q.row(t), in.k.row(t), in.v.row(t), in.g.segment(t, 1),
                          in.beta.segment(t, 1), opt, &st, nullptr);
      out.row(t) = row;
    }
    benchmark::DoNotOptimize(out.data());
  });
  mb::set_flops(state, recurrence_flops_per_token(d, d) * static_cast<double>(n));
  mb::set_bytes(state, mb::qkv_io_bytes(n, d, d, false));
  mb::set_tokens(state, n);
  mb::finish(state, n, heap);
}

void run_decode(benchmark::State& state) {
  const Index d = state.range(0), p = state.range(1);
  constexpr Index kGenerate = 4096;
  const Inputs in(p + kGenerate, d);
  const delta::Options opt;
  delta::State<float> st = delta::State<float>::empty(d, d);
  Matrix<float> row;
  std::vector<double> times;
  times.reserve(1 << 16);
  Index next = p;
  const auto reset = [&] {
    st = delta::State<float>::empty(d, d);
    delta::forward_into(row, in.q.topRows(p), in.k.topRows(p), in.v.topRows(p), in.g.head(p),
                        in.beta.head(p), opt, &st, nullptr);
    next = p;
  };
  reset();
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    if (next == p + kGenerate) {
      state.PauseTiming();
      reset();
      state.ResumeTiming();
    }
    const auto t0 = std::chrono::steady_clock::now();
    delta::forward_into(row, in.q.row(next), in.k.row(next), in.v.row(next), in.g.segment(next, 1),
                        in.beta.segment(next, 1), opt, &st, nullptr);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    ++next;
    benchmark::DoNotOptimize(row.data());
  });
  std::sort(times.begin(), times.end());
  double mean = 0;
  for (const double x : times) mean += x;
  mean /= static_cast<double>(std::max<std::size_t>(times.size(), 1));
  state.counters["mean_s"] = benchmark::Counter(mean);
  state.counters["p99_s"] = benchmark::Counter(times.empty() ? 0 : times[times.size() * 99 / 100]);
  state.counters["max_s"] = benchmark::Counter(times.empty() ? 0 : times.back());
  mb::set_flops(state, recurrence_flops_per_token(d, d));
  mb::finish(state, p, heap);
}

void sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"d", "N"});
  for (const Index d : {64, 128})
    for (Index n = 1024; n <= 16384; n *= 2) b->Args({d, n});
  b->Args({128, 131072});
  b->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(run_forward)->Name("delta_forward")->Apply(sizes);
BENCHMARK(run_step)->Name("delta_step")->Apply(sizes);
BENCHMARK(run_recurrence)
    ->Name("delta_recurrence")
    ->ArgNames({"d", "N"})
    ->Args({64, 4096})
    ->Args({128, 4096})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(run_decode)
    ->Name("delta_decode")
    ->ArgNames({"d", "P"})
    ->Args({64, 4096})
    ->Args({128, 4096})
    ->Args({128, 32768})
    ->Unit(benchmark::kMicrosecond);

MIXATTN_BENCH_MAIN()
