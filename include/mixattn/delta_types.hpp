// mixattn/delta_types.hpp — the gated delta rule's records (SPEC.md §9): its options, the state
// continued over pieces of a sequence and its gradient, what forward saves for backward, and the
// gradients, each with the working memory it keeps (detail::DeltaScratch, data only). The
// operations are in mixattn/delta.hpp.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Working memory of the chunked forward and backward. One chunk's buffers (C rows) are reused
/// chunk after chunk; only `states` (the backward's recomputed chunk start states) grows with N.
/// Not shareable between concurrent calls; a packed batch can run its sequences one after
/// another through one scratch.
template <class T>
struct DeltaScratch {
  using W = wide_t<T>;
  Matrix<T> qk;      // 2C x d_k: the chunk's scaled, normalised queries over its keys
  Matrix<T> kt;      // d_k x C: the keys transposed (the right operand of [Q; K] K^T)
  Matrix<T> prod;    // 2C x C: [Q; K] K^T, then P = QK^T o Gamma over A
  Matrix<T> decay;   // C x C: Gamma
  Matrix<T> tri;     // C x C: T = (I + A)^-1
  Matrix<T> b;       // C x C: B = strictlower(K K^T o Gamma) (backward)
  Matrix<T> rhs;     // C x (d_v + d_k): [diag(beta) V | diag(beta e^gamma) K]
  Matrix<T> u;       // C x d_v: U, then Delta when no record keeps it; backward: dDelta
  Matrix<T> lhs;     // 2C x d_k: [W; diag(e^gamma) Q]
  Matrix<T> y;       // 2C x d_v: [W; diag(e^gamma) Q] S
  Matrix<T> kd;      // C x d_k: diag(e^(gamma_C - gamma)) K
  Matrix<T> s;       // d_k x d_v: the chunk's start state in T
  Matrix<T> upd;     // d_k x d_v: K_d^T Delta (float: added to the wide state)
  Matrix<W> sw;      // d_k x d_v: the carried state in the wide type
  Vector<W> gamma;   // C: chunk-local cumulative log decay
  Vector<T> eg, ed;  // C: e^gamma, e^(gamma_C - gamma)
  Vector<T> w;       // C: a row factor formed once (an Eigen expression in a colwise
                     // product would be evaluated into a fresh temporary)
  // backward
  Matrix<T> states;        // ceil(N / C) d_k x d_v: every chunk's start state (recomputed)
  Matrix<T> dd;            // 2C x d_v: [dO; dR]
  Matrix<T> x;             // 2C x C: [dO; dR] Delta^T, then [dP o Gamma; M]
  Matrix<T> z;             // 2C x d_k: [dO; dR] S^T
  Matrix<T> e;             // C x d_k: Delta dS'^T
  Matrix<T> dqk;           // 2C x d_k: [dP o Gamma; M] K, then the chunk's dQ and M K
  Matrix<T> dk;            // C x d_k: [dP o Gamma; M]^T [Q; K]
  Matrix<T> ds;            // d_k x d_v: dS' in T
  Matrix<T> dt, st, dst;   // transposed: Delta^T (d_v x C), S^T and dS'^T (d_v x d_k)
  Matrix<T> dsu;           // d_k x d_v: [e^gamma Q; -beta e^gamma K]^T [dO; dR]
  Matrix<W> dsw;           // d_k x d_v: the carried state gradient in the wide type
  Vector<W> dgamma;        // C
  Vector<T> inv_q, inv_k;  // N: inverse norms when no record keeps them
  Matrix<W> rows;          // the recurrence's rows (delta_recurrent_forward)
  GemmSpace<T> gemm;       // the packing buffers of the products Eigen runs (delta_product)
};

}  // namespace detail

namespace delta {

struct Options {
  /// Chunk length C of the chunked form (SPEC 9.2), >= 1. 64 as in the paper's kernels: the
  /// within-chunk work grows like C (per token C (3 d_k + 2 d_v)) and the state products
  /// (6 d_k d_v per token) need C rows to run as matrix products; changes only the rounding.
  Index chunk = 64;
  /// Multiplies the queries; 0 means 1/sqrt(d_k). Finite and >= 0.
  double scale = 0;
  /// L2-normalise q and k inside (x / sqrt(|x|^2 + norm_eps)), as Gated DeltaNet does; the
  /// gradient goes through it. Off: the keys' norms are the caller's (SPEC 9.4).
  bool normalize = true;
  double norm_eps = 1e-6;  // > 0 and finite
  /// Keep every chunk's start state in Saved (ceil(N / C) d_k d_v scalars) instead of
  /// recomputing them in backward from the kept Delta (one d_k x C x d_v product per chunk).
  bool keep_states = false;
  /// Reject NaN/Inf in q, k, v, g, beta, the state and grad_out, and overflowed results.
  bool check_finite = true;
};

/// One head's state (SPEC 9.1): S (d_k x d_v) after tokens_seen tokens, in the wide type (double
/// for float), like every prefix state of the library. Its size does not grow with the sequence.
template <class T>
struct State {
  using Wide = detail::wide_t<T>;
  Matrix<Wide> S;  // d_k x d_v
  Index tokens_seen = 0;

  Index key_dim() const { return S.rows(); }
  Index value_dim() const { return S.cols(); }

  /// The state before the first token: zeros, key_dim x value_dim (both >= 1).
  static State empty(Index key_dim, Index value_dim) {
    detail::require(key_dim >= 1 && value_dim >= 1, "mixattn::delta::State::empty", "key_dim is ",
                    key_dim, " and value_dim is ", value_dim, "; both must be >= 1");
    State st;
    st.S = Matrix<Wide>::Zero(key_dim, value_dim);
    return st;
  }
};

/// Gradient of a scalar loss with respect to a State's S (d_k x d_v), in the wide type. backward
/// of a continued forward returns it for the start state (Grad::state) and takes it for the end
/// state (what later pieces read from it).
template <class T>
struct StateGrad {
  Matrix<detail::wide_t<T>> S;  // d_k x d_v
  /// Fingerprint of the state this is the gradient of, set by backward (Grad::state) and checked
  /// by the previous piece's backward against the state its forward ended with; 0: not checked.
  std::uint64_t state_fingerprint = 0;
};

/// What forward keeps for backward: O(N (d_v + 2)), plus the chunks' start states with
/// keep_states, never O(N^2). Reusable: forward_into overwrites it and keeps its capacity.
template <class T>
struct Saved {
  Matrix<T> delta;       // N x d_v: Delta, every token's innovation (SPEC 9.2)
  Vector<T> inv_norm_q;  // N: 1 / sqrt(|q_t|^2 + norm_eps) (normalize only)
  Vector<T> inv_norm_k;  // N: the same for k
  Matrix<T> states;      // keep_states: chunk c's start state in rows [c d_k, (c + 1) d_k)
  // the options the forward ran with
  Index chunk = 0;
  double scale = 0;  // the scale applied (the default resolved)
  bool normalize = false;
  double norm_eps = 0;
  bool keep_states = false;
  /// Of q, k, v, g, beta and the start state (detail::Fingerprint), checked by backward.
  struct Fingerprints {
    std::uint64_t q = 0, k = 0, v = 0, g = 0, beta = 0, start_state = 0;
  };
  Fingerprints fingerprint;
  bool valid = false;
  // Set by a forward that continued a State: the state it started from (a copy, d_k x d_v).
  bool continued = false;
  Matrix<detail::wide_t<T>> start_S;
  std::uint64_t end_fingerprint = 0;  // of the state the call ended with (continued only)
  detail::DeltaScratch<T> scratch;    // the forward's working memory, kept for reuse
};

/// Gradients of a scalar loss with respect to q, k (N x d_k), v (N x d_v), g and beta (N), and,
/// after a continued forward, the start state (else empty). backward_into overwrites them and
/// keeps `scratch` for the next call.
template <class T>
struct Grad {
  Matrix<T> q, k, v;
  Vector<T> g, beta;
  StateGrad<T> state;
  detail::DeltaScratch<T> scratch;
};

}  // namespace delta
MIXATTN_END_NAMESPACE
