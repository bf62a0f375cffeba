// mixattn/detail/gma/blocks.hpp — how GMA's passes block their tokens: the rows of Gamma a forward
// holds at a time, the backward's panels and the length of its sums in T.
//
// Internal: part of mixattn/gma.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/simd.hpp"

#include <algorithm>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Rows of Gamma a bidirectional forward computes before their write or read (with a record or
/// without, when it holds only these rows at a time): a multiple of the density tile's 5 and 3
/// tokens, 15 KiB at K = 64 in float, in L1 beside the kernel's 32 KiB of coefficients.
constexpr Index gma_gamma_block = 60;

/// Tokens of Gamma a causal forward without a record holds at a time (rounded up to whole
/// chunks): Gamma_Q and Gamma_K of 256 tokens are 128 KiB at K = 64 in float, in L2.
constexpr Index gma_causal_block = 256;

/// Rows per panel of the backward: the panel's dGamma/dS (panel x K), [g | h] (panel x (d_v+1))
/// and padded x / dx tiles stay in L2 while the log-density kernel streams them once per tile of
/// components, and the kernel's in-panel float sums stay short (the sweep: bench/results/tuning.md,
/// "GMA backward panel").
constexpr Index gma_backward_panel = 256;

/// The panel for Arch: with 16 registers the kernel's tile holds one component (by two registers
/// of dims), so each register of x and dx passes through it K times a panel; 30 rows keep both in
/// L1 (15 KiB at r = 64 in float), where 256 rows streamed them from L2 at the rate of its
/// bandwidth (bench/results/tuning.md, "Register tiles on 16 registers"), and are whole 5-row
/// tiles of the panel's reads and writes (row_tile_tokens), which a 32-row panel ended with a
/// 2-row tile of a third of the FMA chains: per row 4% slower reads and 3% slower writes (Zen 3).
/// The kernel's sums in T run over several such panels (density_grad_fold_tokens).
template <class Arch>
constexpr Index gma_backward_panel_rows() {
  return !std::is_same<Arch, scalar_arch>::value && simd_registers<Arch>() < 32
             ? 30
             : gma_backward_panel;
}

/// Queries whose terms of the bidirectional backward's dVt are summed in T before they are added
/// to its wide sum: whole panels, about 256 rows (a sum in T as long as the density backward's
/// in-panel sums at gma_backward_panel; the sum over all N queries is wide).
constexpr Index gma_backward_fold_rows(Index panel) {
  return std::max<Index>(1, 256 / panel) * panel;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
