// bench/bench_decode.cpp — generation: one token per call, float, one thread.
//
//   decode_gma/P         gma::forward on a prepared mixture (gma::Prepared, once), continuing a
//                        gma::State; K = r = d_v = 64 (one head)
//   decode_gma_mixture/P the same through gma::forward on the gma::Mixture itself (the State
//                        keeps it prepared while it is unchanged)
//   decode_ovq/P         ovq::forward continuing an ovq::State; N_max = 1024, C = 256,
//                        r = d_v = 64, linear growth (the dictionary is full from token 1024)
//   decode_softmax_kv/P  reference::decode over a reference::KvCache, r = d_v = 64 (reserved up
//                        front: no append copies): the baseline whose cost grows with position
// P = 1024 … 32768 is the position: the state (or cache) first takes P tokens in one call, then
// every benchmark iteration decodes one more token. GMA and OVQ generate kGenerate consecutive
// tokens from P on (a whole generation, every OVQ block completion included: C divides P and
// kGenerate); softmax decodes at exactly position P each time (the cache is cut back to P after
// every call), since its cost depends on the position alone.
// Each call is also timed on its own (steady_clock), for the counters (seconds per token):
//   mean_s, p99_s, max_s        over the point's calls
//   ovq: block_max_s            the slowest block-completing call (every C-th token)
//        other_max_s            the slowest of the other calls
//        after_block_max_s      the slowest of the two calls after each block completion
//        after_block_best_max_s the same, with each call's time the least over kPasses
//                               identical passes (the generation replayed from the same prefilled
//                               state, untimed by the framework): an interruption of the machine
//                               lands on a given call in one pass, not in all of them, while any
//                               cost of the call itself is in every pass
//   noise: the same counters for a fixed amount of scalar arithmetic per call (2000 dependent
//        multiply-adds), no memory traffic:
//        what the machine's own interruptions do to a max over many short calls
// bench/summary.py reads these (decode target rows; the latency-vs-position panel).
#include "bench_common.hpp"

#include <mixattn/gma.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/reference.hpp>

#include <algorithm>
#include <chrono>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace mb = mixattn::bench;
namespace gma = mixattn::gma;
namespace ovq = mixattn::ovq;
namespace ref = mixattn::reference;

constexpr Index kDim = 64;  // K = r = d_v = 64
constexpr Index kBlock = 256;
constexpr Index kMaxCentroids = 1024;
constexpr Index kGenerate = 80 * kBlock;  // 20 480 tokens generated per GMA / OVQ point
constexpr Index kSoftmaxCalls = 256;      // softmax calls per point (each at position P)
constexpr Index kMaxPosition = 32768;
constexpr int kPasses = 3;  // identical OVQ generation passes behind after_block_best_max_s

/// N(0, 1) tokens for every position a point reaches (prefill and generation).
struct Tokens {
  static constexpr Index rows = kMaxPosition + kGenerate + 1;
  Matrix<float> q = mb::random_matrix<float>(rows, kDim, 1);
  Matrix<float> k = mb::random_matrix<float>(rows, kDim, 2);
  Matrix<float> v = mb::random_matrix<float>(rows, kDim, 3);
};
const Tokens& tokens() {
  static const Tokens t;
  return t;
}

struct Stats {
  double mean = 0, p99 = 0, max = 0;
};
Stats stats(std::vector<double> s) {
  Stats r;
  if (s.empty()) return r;
  for (const double x : s) r.mean += x;
  r.mean /= static_cast<double>(s.size());
  const std::size_t k99 = (s.size() * 99) / 100;
  std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(k99), s.end());
  r.p99 = s[k99];
  r.max = *std::max_element(s.begin(), s.end());
  return r;
}

/// Seconds that step(i) takes (steady_clock).
template <class Step>
double seconds_of(Step& step, Index i) {
  const auto t0 = std::chrono::steady_clock::now();
  step(i);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

/// One untimed call, then one timed call per iteration (each also timed on its own into
/// `seconds`), then the counters every decode point reports.
template <class Step>
void decode_loop(benchmark::State& state, Step&& step, std::vector<double>& seconds) {
  Index i = 0;
  step(i++);  // warm: the first call touches the output and scratch pages
  seconds.clear();
  seconds.reserve(static_cast<std::size_t>(state.max_iterations));
  for (auto _ : state) seconds.push_back(seconds_of(step, i++));
  const Stats s = stats(seconds);
  state.counters["mean_s"] = s.mean;
  state.counters["p99_s"] = s.p99;
  state.counters["max_s"] = s.max;
  state.counters["warm_up_calls"] = benchmark::Counter(1);
  state.counters["N"] = benchmark::Counter(static_cast<double>(state.range(0)));
}

/// One GMA head decoding through `head`: a gma::Prepared (decode_gma) or the gma::Mixture itself
/// (decode_gma_mixture), continuing one gma::State.
template <class Head>
void decode_gma_through(benchmark::State& state, const Head& head) {
  const Index p = state.range(0);
  const Tokens& in = tokens();
  gma::Options opt;
  opt.causal = true;
  gma::State<float> st = gma::State<float>::empty(kDim, kDim);
  gma::forward(head, in.q.topRows(p - 1), in.k.topRows(p - 1), in.v.topRows(p - 1), opt, st);
  std::vector<double> seconds;
  decode_loop(
      state,
      [&](Index i) {
        const Index t = p - 1 + i;  // the warm-up call is token P - 1, the timed ones P, P + 1 …
        Matrix<float> o = gma::forward(head, in.q.row(t), in.k.row(t), in.v.row(t), opt, st);
        benchmark::DoNotOptimize(o.data());
      },
      seconds);
}

void decode_gma(benchmark::State& state) {
  const gma::Mixture<float> mix = gma::Mixture<float>::random(kDim, kDim, 7);
  const gma::Prepared<float> prep(mix);  // once, not per token
  decode_gma_through(state, prep);
}

/// decode_gma's twin through the Mixture overload, the loop a user writes first: the State keeps
/// the mixture prepared while it is unchanged, so this should cost about what decode_gma costs.
void decode_gma_mixture(benchmark::State& state) {
  decode_gma_through(state, gma::Mixture<float>::random(kDim, kDim, 7));
}

/// Whether timed call j of an OVQ point at position P (it decodes token P + j) completes a block.
bool completes_block(Index p, std::size_t j) {
  return (p + static_cast<Index>(j) + 1) % kBlock == 0;
}

/// Times (seconds) of the two calls after each OVQ block completion, in order.
std::vector<double> ovq_after_block(Index p, const std::vector<double>& seconds) {
  std::vector<double> after;
  Index since = kBlock;
  for (std::size_t j = 0; j < seconds.size(); ++j) {
    const bool completes = completes_block(p, j);
    if (!completes && since < 2) after.push_back(seconds[j]);
    since = completes ? 0 : since + 1;
  }
  return after;
}

void decode_ovq(benchmark::State& state) {
  const Index p = state.range(0);
  const Tokens& in = tokens();
  ovq::Options opt;
  opt.block = kBlock;
  opt.max_centroids = kMaxCentroids;
  opt.growth = ovq::Growth::linear;
  ovq::State<float> st = ovq::State<float>::empty(kDim, kDim);
  ovq::forward(in.q.topRows(p - 1), in.k.topRows(p - 1), in.v.topRows(p - 1), 1.0f, opt, st);
  const ovq::State<float> prefilled = st;  // token P - 1 (the warm-up call) comes next
  const auto step = [&](Index i) {
    const Index t = p - 1 + i;
    Matrix<float> o = ovq::forward(in.q.row(t), in.k.row(t), in.v.row(t), 1.0f, opt, st);
    benchmark::DoNotOptimize(o.data());
  };
  std::vector<double> seconds;
  decode_loop(state, step, seconds);
  std::vector<double> block, other;
  for (std::size_t j = 0; j < seconds.size(); ++j)
    (completes_block(p, j) ? block : other).push_back(seconds[j]);
  state.counters["block_max_s"] = stats(block).max;
  state.counters["other_max_s"] = stats(other).max;
  state.counters["after_block_max_s"] = stats(ovq_after_block(p, seconds)).max;
  // The same generation again, from the same state: each call's least time over the passes.
  std::vector<double> best = seconds;
  for (int pass = 1; pass < kPasses; ++pass) {
    st = prefilled;
    step(0);
    for (std::size_t j = 0; j < best.size(); ++j)
      best[j] = std::min(best[j], seconds_of(step, static_cast<Index>(j) + 1));
  }
  state.counters["after_block_best_max_s"] = stats(ovq_after_block(p, best)).max;
  state.counters["passes"] = benchmark::Counter(kPasses);
}

/// The machine's own share of a max over short calls: a fixed amount of dependent scalar
/// arithmetic per call (no memory traffic, no allocation), timed like a decoded token.
void decode_noise(benchmark::State& state) {
  std::vector<double> seconds;
  double x = 1.0;
  decode_loop(
      state,
      [&](Index) {
        for (int j = 0; j < 2000; ++j) {
          x = x * 1.0000001 + 1e-9;
          benchmark::DoNotOptimize(x);
        }
      },
      seconds);
}

void decode_softmax_kv(benchmark::State& state) {
  const Index p = state.range(0);
  const Tokens& in = tokens();
  ref::Options opt;
  opt.causal = true;
  ref::KvCache<float> cache(kDim, kDim, p + 1);
  cache.append(in.k.topRows(p), in.v.topRows(p));  // the first P tokens' keys and values
  std::vector<double> seconds;
  decode_loop(
      state,
      [&](Index) {
        Matrix<float> o = ref::decode<float>(cache, in.q.row(p), in.k.row(p), in.v.row(p), opt);
        cache.truncate(p);  // every call at position P
        benchmark::DoNotOptimize(o.data());
      },
      seconds);
}

void positions(benchmark::internal::Benchmark* b, Index iterations) {
  for (Index p = 1024; p <= kMaxPosition; p *= 2) b->Arg(p);
  b->Iterations(iterations)->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK(decode_gma)->Apply([](benchmark::internal::Benchmark* b) { positions(b, kGenerate); });
BENCHMARK(decode_gma_mixture)->Apply([](benchmark::internal::Benchmark* b) {
  positions(b, kGenerate);
});
BENCHMARK(decode_ovq)->Apply([](benchmark::internal::Benchmark* b) { positions(b, kGenerate); });
BENCHMARK(decode_noise)->Arg(0)->Iterations(kGenerate)->Unit(benchmark::kMicrosecond);
BENCHMARK(decode_softmax_kv)->Apply([](benchmark::internal::Benchmark* b) {
  positions(b, kSoftmaxCalls);
});

MIXATTN_BENCH_MAIN()
