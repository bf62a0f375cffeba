// mixattn/linformer_types.hpp — Linformer's records (SPEC.md §11): its options, what forward saves
// for backward, and the gradients, each with the working memory it keeps
// (detail::LinformerScratch, data only). The operations are in mixattn/linformer.hpp.
#pragma once

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Working memory of the backward: one block of rows' dS and the projected gradients. Nothing
/// here grows with N but the block's rows (at most linformer_block_rows). Not shareable between
/// concurrent calls.
template <class T>
struct LinformerScratch {
  Matrix<T> ds;       // rows x k_proj: dP, then dS, of one block of rows
  Matrix<T> dkpt;     // d x k_proj: dK'^T (SPEC 11.2)
  Matrix<T> dvpt;     // d_v x k_proj: dV'^T
  Matrix<T> xt;       // d or d_v x rows: a block of dk^T or dv^T before its transpose
  GemmSpace<T> gemm;  // the packing buffers of every product
};

}  // namespace detail

namespace linformer {

struct Options {
  /// Multiplies the logits q K'^T; 0 means 1/sqrt(d). Finite and >= 0.
  double scale = 0;
  /// Refused when true: Linformer is bidirectional only, since every projected key E k mixes
  /// every position of the sequence, later ones included (SPEC 11.3).
  bool causal = false;
  /// Reject NaN/Inf in q, k, v, E, F and grad_out, and overflowed results.
  bool check_finite = true;
};

/// What forward keeps for backward: K', V' and the probabilities P (N x k_proj). P rather than
/// the rows' log-sum-exp: the forward forms P anyway, and keeping it spares the backward the
/// product q K'^T (a sixth of a training step's products) and N k_proj exponentials for 4 N
/// k_proj bytes written and read once (4 MiB at N = 4096, k_proj = 256). Reusable: forward_into
/// overwrites it and keeps its capacity.
template <class T>
struct Saved {
  Matrix<T> kp;      // k_proj x d: K' = E k
  Matrix<T> vp;      // k_proj x d_v: V' = F v
  Matrix<T> probs;   // N x k_proj: P = softmax(scale q K'^T), row by row
  double scale = 0;  // the scale applied (the default resolved)
  /// Of q, k, v, E and F (detail::Fingerprint), checked by backward.
  struct Fingerprints {
    std::uint64_t q = 0, k = 0, v = 0, E = 0, F = 0;
  };
  Fingerprints fingerprint;
  bool valid = false;
  detail::LinformerScratch<T> scratch;  // the forward's packing buffers, kept for reuse
};

/// Gradients of a scalar loss with respect to q, k (N x d), v (N x d_v), E and F (k_proj x N).
/// backward_into overwrites them and keeps `scratch` for the next call.
template <class T>
struct Grad {
  Matrix<T> q, k, v, E, F;
  detail::LinformerScratch<T> scratch;
};

}  // namespace linformer
MIXATTN_END_NAMESPACE
