// mixattn/linear_types.hpp — linear attention's records (SPEC.md §4): its options, what forward
// saves for backward, the gradients, and the working memory they keep (shared with Performer
// and VQ attention, which keep linear attention's record). The operations on them are in
// mixattn/linear.hpp.
#pragma once

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"

#include <cstdint>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Working memory of the `_into` forms of linear attention, Performer and VQ attention, kept in
/// their Saved and Grad records (and per thread for a forward without a record), so that a call
/// whose shapes repeat allocates nothing.
template <class T>
struct LinearScratch {
  Matrix<wide_t<T>> S;            // the causal scan's state: KV (forward), G (backward)
  Vector<wide_t<T>> z;            // and its z (forward), u (backward)
  ScanScratch<T> scan;            // the causal scan's own buffers
  Matrix<T> w;                    // VQ: the codebook as a plain matrix (the features' directions)
  Matrix<T> score;                // VQ: M x S nearest-code scores
  Vector<T> norms;                // VQ: |C_s|^2 / 2; Performer: s^2 |k_j|^2 / 2
  Matrix<T> gh, kvz, dkvz;        // backward: [g | h] (N x (d_v + 1)), [KV | z], [dKV | dz]
  Matrix<T> g;                    // causal backward: g (N x d_v)
  Vector<T> h, inv_den, e;        // h, 1 / den, e_i = sum_l E_il (N)
  Matrix<T> dphi_q, dphi_k;       // dPhi_Q (N x F), dPhi_K (M x F)
  Matrix<T> v1, scaled, block;    // VQ key gradient: [V | 1], scaled queries, one chunk's triangle
  std::vector<Matrix<T>> states;  // VQ key gradient: T_s per code (r x (d_v + 1))
  std::vector<char> used;         // VQ key gradient: which codes some key maps to
  GemmSpace<T> gemm;              // the packing buffers of every product (product_into)
};

}  // namespace detail

namespace linear {

struct Options {
  bool causal = false;  // token i attends to j <= i (requires q.rows() == k.rows())
  /// Added to the read-out denominator, > 0 and finite in the scalar type. 1e-6 as in the
  /// paper's reference implementation (fast-transformers' LinearAttention).
  double eps = 1e-6;
  bool check_finite = true;  // reject NaN/Inf in q, k, v (and grad_out), and overflowed results
  /// Causal chunk length C; 0 picks the default shared with GMA (32). Changes only the rounding.
  Index chunk = 0;
};

/// What forward keeps for backward: O((N + M) r + N d_v + r d_v), never O(N M).
template <class T>
struct Saved {
  Matrix<T> phi_q;      // N x r, phi(Q)
  Matrix<T> phi_k;      // M x r, phi(K)
  Vector<T> den;        // N, phi(q_i) . z_i + eps
  Matrix<T> out;        // N x d_v, the forward output (h_i = -(dO_i . O_i) / den_i needs it)
  Matrix<T> kv;         // r x d_v, Phi_K^T V (bidirectional only)
  Vector<T> ksum;       // r, Phi_K^T 1 (bidirectional only)
  bool causal = false;  // options the forward ran with
  double eps = 0;
  Index chunk = 0;
  std::uint64_t fingerprint[3] = {0, 0, 0};  // of q, k, v (mixattn::detail::Fingerprint)
  bool valid = false;
  detail::LinearScratch<T> scratch;  // forward_into's working memory, kept for reuse
};

/// Gradients of a scalar loss with respect to q (N x r), k (M x r) and v (M x d_v).
template <class T>
struct Grad {
  Matrix<T> q, k, v;
  detail::LinearScratch<T> scratch;  // backward_into's working memory, kept for reuse
};

}  // namespace linear
MIXATTN_END_NAMESPACE
