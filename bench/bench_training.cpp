// bench/bench_training.cpp — the operators at the shapes people train with: B·H (batch, head)
// pairs per call, float, K = r = d_v = 64, on 1 and 2 threads of the library's pool.
//
//   bh<P>_<operator>_forward/N:<N>/threads:<t>   forward_into of every pair (no record)
//   bh<P>_<operator>_step/N:<N>/threads:<t>      a training step: forward_into of every pair with
//                                                its record, then backward_into of every pair (a
//                                                backward needs the loss, which needs every
//                                                forward), outputs, records and gradients reused
// operators: gma_bidir, gma_causal (SPEC §1, one mixture per pair), ovq (SPEC §2, from an empty
// state, C = 256, N_max = 1024), flash_bidir (SPEC §3), linear_, performer_ (m = 256),
// vq_ (S = 64) {bidir, causal} (SPEC §4–6); shapes P × N = 32 × 2048 and 8 × 8192 (OVQ: 8 × 8192
// only; flash also 8 × 2048).
// Every pair's inputs are distinct: pair p reads rows [p N, (p + 1) N) of one 65 536-row matrix per
// tensor, so nothing is cache-hot by accident between pairs or calls.
// Time: CPU time on one thread (the fraction of the FMA peak is taken against the probe beside
// each repetition, bench_common.hpp), wall time on two (names end in /real_time).
// FLOPs per call: GMA's forward N·K·(8r + 4 d_v) per pair, causal counted the same, a step 3× its
// forward; OVQ, flash and the linear baselines as their GEMM floors count them (ovq_floor.hpp,
// softmax_floor.hpp, linear_floor.hpp), forward plus backward for a step.
#include "bench_common.hpp"
#include "linear_floor.hpp"
#include "ovq_floor.hpp"
#include "softmax_floor.hpp"

#include <mixattn/gma.hpp>
#include <mixattn/linear.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/parallel.hpp>
#include <mixattn/performer.hpp>
#include <mixattn/reference.hpp>
#include <mixattn/vq.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using mixattn::ConstMatrixRef;
using mixattn::Index;
using mixattn::Matrix;
namespace mb = mixattn::bench;

constexpr Index kK = 64;
constexpr Index kR = 64;
constexpr Index kDv = 64;
constexpr Index kTokens = 65536;  // P × N of the largest shape

/// q, k (kTokens x r), v and the output gradient (kTokens x d_v): one set for the process.
const mb::QkvInputs& inputs() {
  static const mb::QkvInputs in(kTokens, kR, kDv);
  return in;
}

/// Pair p's rows of one of the inputs.
ConstMatrixRef<float> rows(const Matrix<float>& m, Index p, Index n) {
  return ConstMatrixRef<float>(m.middleRows(p * n, n));
}

std::uint64_t seed_of(Index p) {
  return 100 + static_cast<std::uint64_t>(p);
}

/// The per-pair records every operator keeps between calls.
template <class Saved, class Grad>
struct Records {
  std::vector<Matrix<float>> out;
  std::vector<Saved> saved;
  std::vector<Grad> grad;
  explicit Records(Index pairs)
      : out(static_cast<std::size_t>(pairs)),
        saved(static_cast<std::size_t>(pairs)),
        grad(static_cast<std::size_t>(pairs)) {}
};

struct Gma : Records<mixattn::gma::Saved<float>, mixattn::gma::Grad<float>> {
  std::vector<mixattn::gma::Mixture<float>> mix;
  mixattn::gma::Options opt;
  Gma(Index pairs, bool causal) : Records(pairs) {
    for (Index p = 0; p < pairs; ++p)
      mix.push_back(mixattn::gma::Mixture<float>::random(kK, kR, seed_of(p)));
    opt.causal = causal;
  }
  void forward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
               const ConstMatrixRef<float>& v, bool record) {
    mixattn::gma::forward_into(out[i], mix[i], q, k, v, opt, record ? &saved[i] : nullptr);
  }
  void backward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
                const ConstMatrixRef<float>& v, const ConstMatrixRef<float>& d_out) {
    mixattn::gma::backward_into(grad[i], mix[i], q, k, v, d_out, saved[i], opt);
  }
  static double forward_flops(Index n, bool) {
    return static_cast<double>(n) * kK * (8 * kR + 4 * kDv);
  }
  static double step_flops(Index n, bool causal) { return 3 * forward_flops(n, causal); }
};

struct Ovq : Records<mixattn::ovq::Saved<float>, mixattn::ovq::Grad<float>> {
  std::vector<mixattn::ovq::State<float>> next;
  const mixattn::ovq::State<float> start = mixattn::ovq::State<float>::empty(kR, kDv);
  mixattn::ovq::Options opt;
  Ovq(Index pairs, bool) : Records(pairs), next(static_cast<std::size_t>(pairs)) {
    opt.block = mb::ovq_floor::kBlock;
    opt.max_centroids = mb::ovq_floor::kMaxCentroids;
  }
  void forward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
               const ConstMatrixRef<float>& v, bool record) {
    mixattn::ovq::forward_into(out[i], q, k, v, 1.0f, opt, start, next[i],
                               record ? &saved[i] : nullptr);
  }
  void backward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
                const ConstMatrixRef<float>& v, const ConstMatrixRef<float>& d_out) {
    mixattn::ovq::backward_into(grad[i], q, k, v, 1.0f, d_out, saved[i], opt);
  }
  static double forward_flops(Index n, bool) { return mb::ovq_floor::floor_flops(n, false); }
  static double step_flops(Index n, bool) { return mb::ovq_floor::floor_flops(n, true); }
};

struct Flash : Records<mixattn::reference::Saved<float>, mixattn::reference::Grad<float>> {
  mixattn::reference::Options opt;
  Flash(Index pairs, bool causal) : Records(pairs) { opt.causal = causal; }
  void forward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
               const ConstMatrixRef<float>& v, bool record) {
    mixattn::reference::flash_forward_into(out[i], q, k, v, opt, record ? &saved[i] : nullptr);
  }
  void backward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
                const ConstMatrixRef<float>& v, const ConstMatrixRef<float>& d_out) {
    mixattn::reference::flash_backward_into(grad[i], q, k, v, d_out, saved[i], opt);
  }
  static double forward_flops(Index n, bool causal) {
    return mb::SoftmaxFloor::forward_flops(n, kR, kDv, causal);
  }
  static double step_flops(Index n, bool causal) {
    return forward_flops(n, causal) + mb::SoftmaxFloor::backward_flops(n, kR, kDv, causal);
  }
};

struct Linear : Records<mixattn::linear::Saved<float>, mixattn::linear::Grad<float>> {
  mixattn::linear::Options opt;
  Linear(Index pairs, bool causal) : Records(pairs) { opt.causal = causal; }
  void forward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
               const ConstMatrixRef<float>& v, bool record) {
    mixattn::linear::forward_into(out[i], q, k, v, opt, record ? &saved[i] : nullptr);
  }
  void backward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
                const ConstMatrixRef<float>& v, const ConstMatrixRef<float>& d_out) {
    mixattn::linear::backward_into(grad[i], q, k, v, d_out, saved[i], opt);
  }
  static double forward_flops(Index n, bool c) {
    return mb::linear_floor::linear_flops(n, c, false);
  }
  static double step_flops(Index n, bool c) { return mb::linear_floor::linear_flops(n, c, true); }
};

struct Performer : Records<mixattn::performer::Saved<float>, mixattn::performer::Grad<float>> {
  std::vector<mixattn::performer::Features<float>> features;
  mixattn::performer::Options opt;
  Performer(Index pairs, bool causal) : Records(pairs) {
    for (Index p = 0; p < pairs; ++p)
      features.push_back(
          mixattn::performer::Features<float>::random(mb::linear_floor::kFeatures, kR, seed_of(p)));
    opt.causal = causal;
  }
  void forward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
               const ConstMatrixRef<float>& v, bool record) {
    mixattn::performer::forward_into(out[i], q, k, v, features[i], opt,
                                     record ? &saved[i] : nullptr);
  }
  void backward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
                const ConstMatrixRef<float>& v, const ConstMatrixRef<float>& d_out) {
    mixattn::performer::backward_into(grad[i], q, k, v, features[i], d_out, saved[i], opt);
  }
  static double forward_flops(Index n, bool c) {
    return mb::linear_floor::performer_flops(n, c, false);
  }
  static double step_flops(Index n, bool c) {
    return mb::linear_floor::performer_flops(n, c, true);
  }
};

struct Vq : Records<mixattn::vq::Saved<float>, mixattn::vq::Grad<float>> {
  std::vector<Matrix<float>> codebook;
  mixattn::vq::Options opt;
  Vq(Index pairs, bool causal) : Records(pairs) {
    for (Index p = 0; p < pairs; ++p)
      codebook.push_back(mb::random_matrix<float>(mb::linear_floor::kCodes, kR, seed_of(p)));
    opt.causal = causal;
  }
  void forward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
               const ConstMatrixRef<float>& v, bool record) {
    mixattn::vq::forward_into(out[i], q, k, v, codebook[i], opt, record ? &saved[i] : nullptr);
  }
  void backward(std::size_t i, const ConstMatrixRef<float>& q, const ConstMatrixRef<float>& k,
                const ConstMatrixRef<float>& v, const ConstMatrixRef<float>& d_out) {
    mixattn::vq::backward_into(grad[i], q, k, v, codebook[i], d_out, saved[i], opt);
  }
  static double forward_flops(Index n, bool c) { return mb::linear_floor::vq_flops(n, c, false); }
  static double step_flops(Index n, bool c) { return mb::linear_floor::vq_flops(n, c, true); }
};

/// One call over `pairs` pairs of N = range(0) tokens on range(1) threads: every pair's forward,
/// then (a step) every pair's backward, each spread over the threads as the packed batches
/// spread their pairs.
template <class Op>
void run_pairs(benchmark::State& state, Index pairs, bool causal, bool step) {
  const Index n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const mb::QkvInputs& in = inputs();
  Op op(pairs, causal);
  const auto each_pair = [&](auto&& fn) {
    mixattn::parallel_for(pairs, threads, [&](Index p) {
      fn(static_cast<std::size_t>(p), rows(in.q, p, n), rows(in.k, p, n), rows(in.v, p, n),
         rows(in.d_out, p, n));
    });
  };
  const auto call = [&] {
    each_pair([&](std::size_t i, const auto& q, const auto& k, const auto& v, const auto&) {
      op.forward(i, q, k, v, step);
    });
    if (step)
      each_pair([&](std::size_t i, const auto& q, const auto& k, const auto& v, const auto& d) {
        op.backward(i, q, k, v, d);
      });
  };
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {  // the untimed first call sizes the outputs and records
    call();
    benchmark::DoNotOptimize(op.out[0].data());
  });
  const double per_pair = step ? Op::step_flops(n, causal) : Op::forward_flops(n, causal);
  mb::set_flops(state, static_cast<double>(pairs) * per_pair);
  mb::set_bytes(state, static_cast<double>(pairs) * mb::qkv_io_bytes(n, kR, kDv, step));
  state.counters["worker_threads"] = benchmark::Counter(threads);
  state.counters["pairs"] = benchmark::Counter(static_cast<double>(pairs));
  mb::finish(state, n, heap);
}

using Runner = void (*)(benchmark::State&, Index, bool, bool);

struct Operator {
  const char* name;
  Runner run;
  bool causal;
  std::vector<std::pair<Index, Index>> shapes;  // (pairs, N)
};

/// Registers bh<P>_<name>_<kind>/N:<N>/threads:1 and .../threads:2/real_time, next to each
/// other, so that the two sides of the thread ratio run one after the other in every round.
void register_operator(const Operator& op) {
  for (const bool step : {false, true})
    for (const auto& [pairs, n] : op.shapes)
      for (const Index threads : {1, 2}) {
        const std::string name =
            "bh" + std::to_string(pairs) + "_" + op.name + (step ? "_step" : "_forward");
        benchmark::internal::Benchmark* b =
            benchmark::RegisterBenchmark(name.c_str(), op.run, pairs, op.causal, step);
        b->Args({n, threads})->ArgNames({"N", "threads"})->Unit(benchmark::kMillisecond);
        if (threads > 1) b->UseRealTime();
      }
}

[[maybe_unused]] const bool registered = [] {
  const std::vector<std::pair<Index, Index>> shapes = {{32, 2048}, {8, 8192}};
  const std::vector<Operator> operators = {
      {"gma_bidir", &run_pairs<Gma>, false, shapes},
      {"gma_causal", &run_pairs<Gma>, true, shapes},
      {"ovq", &run_pairs<Ovq>, true, {{8, 8192}}},
      {"flash_bidir", &run_pairs<Flash>, false, {{8, 2048}, {32, 2048}, {8, 8192}}},
      {"linear_bidir", &run_pairs<Linear>, false, shapes},
      {"linear_causal", &run_pairs<Linear>, true, shapes},
      {"performer_bidir", &run_pairs<Performer>, false, shapes},
      {"performer_causal", &run_pairs<Performer>, true, shapes},
      {"vq_bidir", &run_pairs<Vq>, false, shapes},
      {"vq_causal", &run_pairs<Vq>, true, shapes},
  };
  for (const Operator& op : operators) register_operator(op);
  return true;
}();

}  // namespace

MIXATTN_BENCH_MAIN()
