// bench/bench_ssd.cpp — Mamba2's SSD layer (SPEC §10), float, one head, one thread.
//
//   ssd_forward/d:D/N:N      forward_into without a record (inference), output reused
//   ssd_step/d:D/N:N         forward_into with a reused Saved, then backward_into into a reused
//                            Grad: a training step, allocation-free after the warm-up call
//   ssd_recurrence/d:D/N:N   the same forward as decoding computes it: forward_into on one row at
//                            a time continuing a State (the token-by-token recurrence on the wide
//                            state, per call its checks), over the whole sequence
//   ssd_decode/d:D/P:P       one token per call after P tokens (the state prefilled), each
//                            iteration one more token; counters mean_s, p99_s, max_s per token
// d_state = d_head = D (64, 128), the default options (C = 64, the softplus, the states
// recomputed in backward). FLOPs: the chunked algorithm's count of docs/benchmarking.md ("The SSD
// layer's FLOP count"), 4 d_state d_head per token for the recurrence and decoding.
#include "bench_common.hpp"

#include <mixattn/ssd.hpp>

#include <algorithm>
#include <chrono>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace mb = mixattn::bench;
namespace ssd = mixattn::ssd;

constexpr Index kChunk = 64;  // ssd::Options' default

/// Per token, SPEC 10.2 / 10.3 as counted in docs/benchmarking.md.
double forward_flops_per_token(double s, double p, double c) {
  return 4 * s * p + c * (s + p);
}
double step_flops_per_token(double s, double p, double c) {
  return 14 * s * p + c * (4 * s + 3 * p);
}
double recurrence_flops_per_token(double s, double p) {
  return 4 * s * p;
}

/// C, B (N x d_state), x, dY (N x d_head) as the attention benchmarks' q, k, v, dO; raw steps in
/// [-4, 0] (Delta from 0.02 to 0.69), A = -1, D = 0.5: seeded.
struct Inputs : mb::QkvInputs {
  Vector<float> dt;
  float A = -1, D = 0.5f;
  Inputs(Index n, Index d) : QkvInputs(n, d, d), dt(n) {
    std::mt19937_64 rng(5);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (Index t = 0; t < n; ++t) dt(t) = static_cast<float>(-4.0 * u(rng));
  }
  const Matrix<float>& x() const { return v; }
  const Matrix<float>& B() const { return k; }
  const Matrix<float>& C() const { return q; }
};

void run_forward(benchmark::State& state) {
  const Index d = state.range(0), n = state.range(1);
  const Inputs in(n, d);
  const ssd::Options opt;
  Matrix<float> out;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    ssd::forward_into(out, in.x(), in.dt, in.A, in.B(), in.C(), in.D, opt, nullptr, nullptr);
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
  const ssd::Options opt;
  Matrix<float> out;
  ssd::Saved<float> saved;
  ssd::Grad<float> grad;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    ssd::forward_into(out, in.x(), in.dt, in.A, in.B(), in.C(), in.D, opt, nullptr, &saved);
    ssd::backward_into(grad, in.x(), in.dt, in.A, in.B(), in.C(), in.D, in.d_out, saved, opt);
    benchmark::DoNotOptimize(grad.x.data());
  });
  mb::set_flops(state, step_flops_per_token(d, d, kChunk) * static_cast<double>(n));
  mb::set_bytes(state, mb::qkv_io_bytes(n, d, d, true));
  mb::set_tokens(state, n);
  mb::finish(state, n, heap);
}

void run_recurrence(benchmark::State& state) {
  const Index d = state.range(0), n = state.range(1);
  const Inputs in(n, d);
  const ssd::Options opt;
  Matrix<float> out(n, d), row;
  ssd::State<float> st = ssd::State<float>::empty(d, d);
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    st.h.setZero();
    st.tokens_seen = 0;
    for (Index t = 0; t < n; ++t) {
      ssd::forward_into(row, in.x().row(t), in.dt.segment(t, 1), in.A, in.B().row(t), in.C().row(t),
                        in.D, opt, &st, nullptr);
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
  const ssd::Options opt;
  ssd::State<float> st = ssd::State<float>::empty(d, d);
  Matrix<float> row;
  std::vector<double> times;
  times.reserve(1 << 16);
  Index next = p;
  const auto reset = [&] {
    st = ssd::State<float>::empty(d, d);
    ssd::forward_into(row, in.x().topRows(p), in.dt.head(p), in.A, in.B().topRows(p),
                      in.C().topRows(p), in.D, opt, &st, nullptr);
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
    ssd::forward_into(row, in.x().row(next), in.dt.segment(next, 1), in.A, in.B().row(next),
                      in.C().row(next), in.D, opt, &st, nullptr);
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
  b->Args({64, 131072});
  b->Args({128, 131072});
  b->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(run_forward)->Name("ssd_forward")->Apply(sizes);
BENCHMARK(run_step)->Name("ssd_step")->Apply(sizes);
BENCHMARK(run_recurrence)
    ->Name("ssd_recurrence")
    ->ArgNames({"d", "N"})
    ->Args({64, 4096})
    ->Args({128, 4096})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(run_decode)
    ->Name("ssd_decode")
    ->ArgNames({"d", "P"})
    ->Args({64, 4096})
    ->Args({128, 4096})
    ->Args({128, 32768})
    ->Unit(benchmark::kMicrosecond);

MIXATTN_BENCH_MAIN()
