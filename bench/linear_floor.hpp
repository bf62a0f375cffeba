// bench/linear_floor.hpp — the FLOP counts of the linear baselines' GEMM floors, in closed form
// (bench_linear checks them against the GEMMs its floors issue; bench_training reports them):
//   linear attention (SPEC §4)  GMA's floor (gma_floor.hpp) with K = r elementwise features and
//                               no responsibilities
//   Performer (SPEC §5)         the same read/write with m features, plus the feature
//                               projections X Wᵀ (N x r x m, for q and k) and, backward, the
//                               exponents' gradient times W (N x m x r, for q and k)
//   VQ attention (SPEC §6)      the read/write with K = S codes, the code GEMMs Q Cᵀ and K Cᵀ, and
//                               backward E C, Eᵀ Q and the S per-code straight-through states
//                               (r x N x (d_v + 1) each)
// r = d_v = 64, m = 256, S = 64, the causal chunk GMA's.
#pragma once

#include <mixattn/linear.hpp>  // detail::default_scan_chunk, the causal chunk linear attention uses

#include "gma_floor.hpp"

namespace mixattn::bench::linear_floor {

constexpr Index kR = 64;
constexpr Index kDv = 64;
constexpr Index kChunk = mixattn::detail::default_scan_chunk;
constexpr Index kFeatures = 256;  // Performer's m
constexpr Index kCodes = 64;      // VQ attention's S

inline double linear_flops(Index n, bool causal, bool backward) {
  const double f = GmaFloor::forward_flops(n, kR, kR, kDv, kChunk, causal, false);
  return backward ? f + GmaFloor::backward_flops(n, kR, kR, kDv, kChunk, causal, false) : f;
}

// Performer: the same read/write with m features, plus its projection GEMMs.
inline double performer_flops(Index n, bool causal, bool backward) {
  const double proj = 2.0 * 2.0 * static_cast<double>(n) * kR * kFeatures;  // q and k
  double f = GmaFloor::forward_flops(n, kFeatures, kR, kDv, kChunk, causal, false) + proj;
  if (backward) f += GmaFloor::backward_flops(n, kFeatures, kR, kDv, kChunk, causal, false) + proj;
  return f;
}

// VQ attention: the same read/write with S one-hot/code features, the code GEMMs, and backward
// the per-code straight-through states.
inline double vq_flops(Index n, bool causal, bool backward) {
  const double proj = 2.0 * 2.0 * static_cast<double>(n) * kR * kCodes;  // q C^T and k C^T
  double f = GmaFloor::forward_flops(n, kCodes, kR, kDv, kChunk, causal, false) + proj;
  if (backward)  // + E C, E^T Q, and S GEMMs (r x N)(N x (d_v + 1))
    f += GmaFloor::backward_flops(n, kCodes, kR, kDv, kChunk, causal, false) + proj +
         2.0 * static_cast<double>(n) * kCodes * kR * (kDv + 1);
  return f;
}

}  // namespace mixattn::bench::linear_floor
