// mixattn/performer_types.hpp — Performer's records (SPEC.md §5): the random features, the options,
// what forward saves for backward and the gradients. The operations are in mixattn/performer.hpp.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/linear_types.hpp"

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace performer {

/// How the m x r directions are drawn (SPEC 5.1).
enum class Draw {
  orthogonal,  // blocks of r exactly orthogonal rows, each scaled by an independent chi_r norm
  iid,         // every entry N(0, 1) independently
};

/// The random features' directions W (m x r), a constant input of forward and backward: no
/// gradient flows to it. Redraw it (a new seed) between training steps as the paper does, or
/// keep it fixed; a backward must be given the W its forward saw.
template <class T>
struct Features {
  Matrix<T> w;  // m x r, row l is the direction w_l
  Draw draw = Draw::orthogonal;

  /// m features for dimension r from `seed`: the same W on every platform for a given seed
  /// (mt19937_64 and Box-Muller in double, rounded to T last, so float and double agree).
  static Features random(Index m, Index r, std::uint64_t seed, Draw draw = Draw::orthogonal);
  /// A new W of the same shape and kind from another seed.
  void redraw(std::uint64_t seed) { *this = random(w.rows(), w.cols(), seed, draw); }
  Index count() const { return w.rows(); }
  Index dim() const { return w.cols(); }
};

/// Linear attention's options (causal, eps, check_finite, chunk; SPEC 4.4) plus the scale.
struct Options : linear::Options {
  /// s, applied to q and k inside the features so that phi(q) . phi(k) estimates
  /// exp(s^2 q . k); 0 picks r^(-1/4), which estimates softmax attention's exp(q . k / sqrt(r))
  /// (the reference's data_normalizer). >= 0 and finite.
  double scale = 0;
};

/// What forward keeps for backward: O((N + M) m + N d_v + m d_v), never O(N M).
template <class T>
struct Saved {
  linear::Saved<T> attn;                         // linear attention's record with phi_q: N x m,
                                                 // phi_k: M x m the stabilised features
  Eigen::Matrix<Index, Eigen::Dynamic, 1> q_at;  // N: the l whose s w_l . q_i was subtracted
  Index k_row = 0, k_col = 0;                    // (j, l) of the key maximum subtracted
  double scale = 0;                              // options.scale the forward ran with
  std::uint64_t w_fingerprint = 0;
};

/// Gradients with respect to q (N x r), k (M x r) and v (M x d_v); W is a constant.
template <class T>
using Grad = linear::Grad<T>;

}  // namespace performer
MIXATTN_END_NAMESPACE
