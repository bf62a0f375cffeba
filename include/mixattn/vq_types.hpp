// mixattn/vq_types.hpp — VQ attention's records (SPEC.md §6): the options, what forward saves
// for backward and the gradients. The operations on them are in mixattn/vq.hpp.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/linear_types.hpp"

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace vq {

/// Linear attention's options (causal, eps, check_finite, chunk; SPEC 4.4) plus the scale.
struct Options : linear::Options {
  /// tau, the softmax scale of q . k^; 0 picks 1/sqrt(r). >= 0 and finite.
  double scale = 0;
};

/// What forward keeps for backward: O((N + M) S + N d_v + S d_v), never O(N M).
template <class T>
struct Saved {
  linear::Saved<T> attn;  // linear attention's record: phi_q N x S, phi_k M x S (one-hot codes)
  Eigen::Matrix<Index, Eigen::Dynamic, 1> q_at;   // N: the code of the largest q_i . C_s
  Eigen::Matrix<Index, Eigen::Dynamic, 1> codes;  // M: z_j, the code of key j
  double scale = 0;                               // options.scale the forward ran with
  std::uint64_t codebook_fingerprint = 0;
};

/// Gradients with respect to q (N x r), k (M x r; straight-through, SPEC 6.3), v (M x d_v) and
/// the codebook (S x r).
template <class T>
struct Grad {
  Matrix<T> q, k, v, codebook;
  detail::LinearScratch<T> scratch;  // backward_into's working memory, kept for reuse
};

}  // namespace vq
MIXATTN_END_NAMESPACE
