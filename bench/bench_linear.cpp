// bench/bench_linear.cpp — linear attention (SPEC §4, elu + 1 features), Performer (SPEC §5,
// FAVOR+ random features on the same scan) and static-codebook VQ attention (SPEC §6, one-hot
// code features on it), float, one thread.
//
//   linear_forward_{bidir,causal}    SPEC 4.2 (causal with the default chunk shared with GMA)
//   linear_fwd_bwd_{bidir,causal}    forward with Saved, then backward (SPEC 4.3)
//   floor_linear_*                   the Eigen GEMMs of the same shapes: GMA's floor with K = r
//                                    features and no responsibilities (gma_floor.hpp)
//   performer_{forward,fwd_bwd}_{bidir,causal}   SPEC 5.2 / 5.3 with m = 256 orthogonal features
//                                    (the reference's default r ln r = 266, rounded to a multiple
//                                    of 16)
//   floor_performer_*                the GEMMs of the same shapes: the read/write of GMA's floor
//                                    with K = m features, plus the feature projections X W^T
//                                    (N x r x m, for q and k) and, backward, dPhi-weighted W
//                                    (N x m x r, for q and k)
//   vq_{forward,fwd_bwd}_{bidir,causal}          SPEC 6.2 / 6.3 with S = 64 codes (the state
//                                    size of linear attention's r = 64)
//   floor_vq_*                       the read/write with K = S, the code GEMMs Q C^T and K C^T,
//                                    and backward E C, E^T Q and the S per-code straight-through
//                                    states (r x N x (d_v + 1) each)
// N = 256 ... 65536, r = d_v = 64 (GMA's K = r = d_v, so linear and GMA rows compare at equal
// state size). The FLOPS counter is the floor's GEMM work for both an operator and its floor.
#include "bench_common.hpp"
#include "gma_floor.hpp"
#include "linear_floor.hpp"

#include <mixattn/linear.hpp>
#include <mixattn/performer.hpp>
#include <mixattn/vq.hpp>

#include <cmath>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace mb = mixattn::bench;
namespace linear = mixattn::linear;
namespace performer = mixattn::performer;
namespace vq = mixattn::vq;

using mb::linear_floor::kChunk;
using mb::linear_floor::kCodes;
using mb::linear_floor::kDv;
using mb::linear_floor::kFeatures;
using mb::linear_floor::kR;
using mb::linear_floor::performer_flops;
using mb::linear_floor::vq_flops;
constexpr Index kMaxN = 65536;

double floor_flops(Index n, bool causal, bool backward) {
  return mb::linear_floor::linear_flops(n, causal, backward);
}

struct Inputs : mb::QkvInputs {
  explicit Inputs(Index n) : QkvInputs(n, kR, kDv) {}
};

double io_bytes(Index n, bool backward) { return mb::qkv_io_bytes(n, kR, kDv, backward); }

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

void run_performer(benchmark::State& state, bool causal, bool backward) {
  const Index n = state.range(0);
  const Inputs in(n);
  const auto features = performer::Features<float>::random(kFeatures, kR, 7);
  performer::Options opt;
  opt.causal = causal;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    performer::Saved<float> saved;
    Matrix<float> out =
        performer::forward<float>(in.q, in.k, in.v, features, opt, backward ? &saved : nullptr);
    benchmark::DoNotOptimize(out.data());
    if (backward) {
      performer::Grad<float> g =
          performer::backward<float>(in.q, in.k, in.v, features, in.d_out, saved, opt);
      benchmark::DoNotOptimize(g.q.data());
    }
  });
  mb::set_flops(state, performer_flops(n, causal, backward));
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

void run_performer_floor(benchmark::State& state, bool causal, bool backward) {
  const Index n = state.range(0);
  mb::GmaFloor floor(n, kFeatures, kR, kDv, kChunk, /*density=*/false);
  const Matrix<float> x = mb::random_matrix<float>(n, kR, 21);
  const Matrix<float> w = mb::random_matrix<float>(kFeatures, kR, 22);
  const Matrix<float> e = mb::random_matrix<float>(n, kFeatures, 23);
  Matrix<float> phi(n, kFeatures), dx(n, kR);
  double proj_flops = 0;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    floor.reset_flops();
    proj_flops = 0;
    for (int path = 0; path < 2; ++path) {  // q and k
      phi.noalias() = x * w.transpose();
      proj_flops += 2.0 * static_cast<double>(n) * kR * kFeatures;
    }
    if (backward) {
      floor.forward_backward(causal);
      for (int path = 0; path < 2; ++path) {
        dx.noalias() = e * w;
        proj_flops += 2.0 * static_cast<double>(n) * kR * kFeatures;
      }
    } else {
      floor.forward(causal);
    }
    benchmark::DoNotOptimize(floor.sink());
    benchmark::DoNotOptimize(phi.data());
    benchmark::DoNotOptimize(dx.data());
  });
  const double total = floor.flops() + proj_flops, expected = performer_flops(n, causal, backward);
  if (std::abs(total - expected) > 1e-9 * expected)
    state.SkipWithError("Performer floor's closed-form FLOP count disagrees with the issued GEMMs");
  mb::set_flops(state, total);
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

void run_vq(benchmark::State& state, bool causal, bool backward) {
  const Index n = state.range(0);
  const Inputs in(n);
  const Matrix<float> codebook = mb::random_matrix<float>(kCodes, kR, 8);
  vq::Options opt;
  opt.causal = causal;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    vq::Saved<float> saved;
    Matrix<float> out =
        vq::forward<float>(in.q, in.k, in.v, codebook, opt, backward ? &saved : nullptr);
    benchmark::DoNotOptimize(out.data());
    if (backward) {
      vq::Grad<float> g = vq::backward<float>(in.q, in.k, in.v, codebook, in.d_out, saved, opt);
      benchmark::DoNotOptimize(g.q.data());
    }
  });
  mb::set_flops(state, vq_flops(n, causal, backward));
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

void run_vq_floor(benchmark::State& state, bool causal, bool backward) {
  const Index n = state.range(0);
  mb::GmaFloor floor(n, kCodes, kR, kDv, kChunk, /*density=*/false);
  const Matrix<float> x = mb::random_matrix<float>(n, kR, 21);
  const Matrix<float> c = mb::random_matrix<float>(kCodes, kR, 22);
  const Matrix<float> e = mb::random_matrix<float>(n, kCodes, 23);
  const Matrix<float> gh = mb::random_matrix<float>(n, kDv + 1, 24);
  Matrix<float> logits(n, kCodes), dx(n, kR), dc(kCodes, kR), t(kR, kDv + 1);
  double extra = 0;
  mb::PeakHeap heap;
  mb::timed_loop(state, heap, [&] {
    floor.reset_flops();
    extra = 0;
    for (int path = 0; path < 2; ++path) {  // q C^T and k C^T
      logits.noalias() = x * c.transpose();
      extra += 2.0 * static_cast<double>(n) * kR * kCodes;
    }
    if (backward) {
      floor.forward_backward(causal);
      dx.noalias() = e * c;
      dc.noalias() = e.transpose() * x;
      extra += 2 * 2.0 * static_cast<double>(n) * kR * kCodes;
      for (Index s = 0; s < kCodes; ++s) {  // the per-code straight-through states
        t.noalias() = x.transpose() * gh;
        extra += 2.0 * static_cast<double>(n) * kR * (kDv + 1);
      }
    } else {
      floor.forward(causal);
    }
    benchmark::DoNotOptimize(floor.sink());
    benchmark::DoNotOptimize(logits.data());
    benchmark::DoNotOptimize(dx.data());
    benchmark::DoNotOptimize(dc.data());
    benchmark::DoNotOptimize(t.data());
  });
  const double total = floor.flops() + extra, expected = vq_flops(n, causal, backward);
  if (std::abs(total - expected) > 1e-9 * expected)
    state.SkipWithError("VQ floor's closed-form FLOP count disagrees with the issued GEMMs");
  mb::set_flops(state, total);
  mb::set_bytes(state, io_bytes(n, backward));
  mb::finish(state, n, heap);
}

void sweep(benchmark::internal::Benchmark* b) {
  mb::sweep(b, 256, kMaxN);
}

// Each operator beside its floor, forward then forward+backward, bidirectional then causal.
BENCHMARK_CAPTURE(run_operator, forward_bidir, false, false)
    ->Name("linear_forward_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, forward_bidir, false, false)
    ->Name("floor_linear_forward_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_operator, forward_causal, true, false)
    ->Name("linear_forward_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, forward_causal, true, false)
    ->Name("floor_linear_forward_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_operator, fwd_bwd_bidir, false, true)
    ->Name("linear_fwd_bwd_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, fwd_bwd_bidir, false, true)
    ->Name("floor_linear_fwd_bwd_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_operator, fwd_bwd_causal, true, true)
    ->Name("linear_fwd_bwd_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_floor, fwd_bwd_causal, true, true)
    ->Name("floor_linear_fwd_bwd_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer, forward_bidir, false, false)
    ->Name("performer_forward_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer_floor, forward_bidir, false, false)
    ->Name("floor_performer_forward_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer, forward_causal, true, false)
    ->Name("performer_forward_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer_floor, forward_causal, true, false)
    ->Name("floor_performer_forward_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer, fwd_bwd_bidir, false, true)
    ->Name("performer_fwd_bwd_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer_floor, fwd_bwd_bidir, false, true)
    ->Name("floor_performer_fwd_bwd_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer, fwd_bwd_causal, true, true)
    ->Name("performer_fwd_bwd_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_performer_floor, fwd_bwd_causal, true, true)
    ->Name("floor_performer_fwd_bwd_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_vq, forward_bidir, false, false)->Name("vq_forward_bidir")->Apply(sweep);
BENCHMARK_CAPTURE(run_vq_floor, forward_bidir, false, false)
    ->Name("floor_vq_forward_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_vq, forward_causal, true, false)->Name("vq_forward_causal")->Apply(sweep);
BENCHMARK_CAPTURE(run_vq_floor, forward_causal, true, false)
    ->Name("floor_vq_forward_causal")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_vq, fwd_bwd_bidir, false, true)->Name("vq_fwd_bwd_bidir")->Apply(sweep);
BENCHMARK_CAPTURE(run_vq_floor, fwd_bwd_bidir, false, true)
    ->Name("floor_vq_fwd_bwd_bidir")
    ->Apply(sweep);
BENCHMARK_CAPTURE(run_vq, fwd_bwd_causal, true, true)->Name("vq_fwd_bwd_causal")->Apply(sweep);
BENCHMARK_CAPTURE(run_vq_floor, fwd_bwd_causal, true, true)
    ->Name("floor_vq_fwd_bwd_causal")
    ->Apply(sweep);

}  // namespace

MIXATTN_BENCH_MAIN()
