// mixattn/detail/gma_scratch.hpp — GMA's working memory (the forward and backward scratch kept in
// Saved and Grad for reuse).
//
// Internal: held by the records of mixattn/gma_types.hpp (Saved, Grad).
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/causal_scan.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/log_density.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Scratch of a forward call: the mixture's packed constants, the bidirectional read-out's
/// buffers (when no Saved holds them), the causal scan's state and the GEMM packing buffers.
template <class T>
struct GmaForwardScratch {
  MixtureConstants<wide_t<T>> constants;
  PackedDensity<T> packed;
  std::vector<T> scores;  // the density kernel's rows of scores
  Vector<T> den, z, ones;
  Matrix<T> vt;
  Matrix<T> block_q, block_k;  // Gamma's rows in passing (no record): gma_gamma_block or
                               // gma_causal_block x K
  // A continued forward's start state, kept (without a Saved to hold it) after values large
  // enough to overflow the state, so that an overflow gives the State back untouched.
  Matrix<wide_t<T>> start_S;
  Vector<wide_t<T>> start_z;
  ScanScratch<T> scan;
  GemmSpace<T> gemm;
};

/// A mixture as the decoding forward last received it, and what preparing it gave: the Mixture
/// overloads of the continued forward reuse the preparation while the mixture stays bit for bit
/// the same (one comparison of its parameters per call instead of K r softplus and logs and the
/// packing), so the obvious decoding loop costs about what the Prepared overload costs.
template <class T>
struct GmaPreparedMixture {
  Matrix<T> mean, var_raw;  // K x r, copies of the mixture's
  Vector<T> prior_logit;    // K
  T var_floor = T(0);
  bool valid = false;
  bool checked_finite = false;  // its values were checked finite
  bool fingerprinted = false;   // `fingerprint` is set (computed when a record first needs it)
  std::uint64_t fingerprint = 0;
  MixtureConstants<wide_t<T>> constants;
  PackedDensity<T> packed;
};

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

/// Scratch of one backward call, reused by every panel and, through Grad, by later calls.
template <class T>
struct GmaBackwardScratch {
  using W = wide_t<T>;
  Matrix<T> gh;             // panel x d_v: g = dO / den (bidirectional)
  Vector<T> z_eps;          // K: z + eps (bidirectional)
  Matrix<T> ds;             // panel x K: dGamma, then dS in place (bidirectional)
  Matrix<T> xpad;           // panel x padded r: x, zero beyond r
  Matrix<T> acc;            // panel x padded r: dx, when r is not a whole number of registers
  Vector<T> panel_w;        // K: one panel's sum of dS
  Vector<T> panel_dz;       // K: one panel's dZ (bidirectional), then the whole dZ
  Matrix<T> upd;            // K x d_v: one panel's dVt
  Matrix<T> dvz;            // K x d_v: the summed dVt (bidirectional)
  Matrix<T> vzt, dvt;       // SIMD builds: d_v x K, Vt and dVt transposed
  Matrix<W> dvz_wide;       // K x d_v
  Vector<W> dz_wide;        // K: the summed dZ
  Matrix<T> g, dgq, dgk;    // causal: N x d_v, N x K, M x K
  Vector<T> h, inv_den;     // causal: N
  Matrix<W> dmu, dvar_raw;  // K x r
  MixtureConstants<W> constants;
  PackedDensityDims<T> packed;
  DensityGradSums<T> sums;
  Matrix<W> G;  // causal: K x d_v, the suffix state dL/dS (when grad.state does not hold it)
  Vector<W> u;  // causal: K, dL/dz
  ScanScratch<T> scan;
  GemmSpace<T> gemm;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
