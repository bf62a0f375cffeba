// mixattn/ssd_types.hpp — the SSD layer's records (SPEC.md §10): its options, the state continued
// over pieces of a sequence and its gradient, what forward saves for backward, and the gradients,
// each with the working memory it keeps (detail::SsdScratch, data only). The operations are in
// mixattn/ssd.hpp.
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
struct SsdScratch {
  using W = wide_t<T>;
  Matrix<T> u;       // C x P: U = diag(Delta) X
  Matrix<T> prod;    // C x C: C B^T, then P = C B^T o L
  Matrix<T> decay;   // C x C: L
  Matrix<T> bd;      // C x S: diag(e^(gamma_n - gamma)) B
  Matrix<T> h;       // S x P: the chunk's start state in T
  Matrix<T> upd;     // S x P: B_d^T U (float: added to the wide state)
  Matrix<W> hw;      // S x P: the carried state in the wide type
  Vector<W> gamma;   // C: chunk-local cumulative log decay
  Vector<T> eg, ed;  // C: e^gamma, e^(gamma_n - gamma)
  Vector<T> step;    // N: Delta when no record keeps it
  Matrix<W> rows;    // 4 x max(S, P): the recurrence's b, c, u, y (ssd_recurrent_forward)
  // backward
  Matrix<T> states;   // ceil(N / C) S x P: every chunk's start state (recomputed)
  Matrix<T> du;       // C x P: dU
  Matrix<T> z;        // C x P: B dH'
  Matrix<T> dp;       // C x C: dY U^T, then G = dP o L
  Matrix<T> yh;       // C x S: dY H^T
  Matrix<T> ud;       // C x S: U dH'^T
  Matrix<T> ce;       // C x S: diag(e^gamma) C
  Matrix<T> dh;       // S x P: dH' in T
  Matrix<T> dhu;      // S x P: (diag(e^gamma) C)^T dY
  Matrix<W> dhw;      // S x P: the carried state gradient in the wide type
  Vector<W> dgamma;   // C
  Vector<W> dstep;    // N: dDelta (wide: its chunk sums are long)
  GemmSpace<T> gemm;  // the packing buffers of the products Eigen runs
};

}  // namespace detail

namespace ssd {

struct Options {
  /// Chunk length C of the chunked form (SPEC 10.2), >= 1. 64 as in Mamba2's kernels: the
  /// within-chunk work grows like C (per token C (S + P) multiply-adds) and the state products
  /// (2 S P per token) need C rows to run as matrix products; changes only the rounding.
  Index chunk = 64;
  /// Added to dt before the softplus (Mamba2's per-head dt_bias); finite in T.
  double dt_bias = 0;
  /// Delta = softplus(dt + dt_bias), as Mamba2 does; off: Delta = dt + dt_bias, which must be
  /// >= 0.
  bool dt_softplus = true;
  /// Keep every chunk's start state in Saved (ceil(N / C) S P scalars) instead of recomputing
  /// them in backward (one S x C x P product per chunk).
  bool keep_states = false;
  /// Reject NaN/Inf in x, dt, A, B, C, D, the state and grad_out, and overflowed results.
  bool check_finite = true;
};

/// One head's state (SPEC 10.1): h (d_state x d_head) after tokens_seen tokens, in the wide type
/// (double for float), like every prefix state of the library. Its size does not grow with the
/// sequence.
template <class T>
struct State {
  using Wide = detail::wide_t<T>;
  Matrix<Wide> h;  // d_state x d_head
  Index tokens_seen = 0;

  Index state_dim() const { return h.rows(); }
  Index head_dim() const { return h.cols(); }

  /// The state before the first token: zeros, state_dim x head_dim (both >= 1).
  static State empty(Index state_dim, Index head_dim) {
    detail::require(state_dim >= 1 && head_dim >= 1, "mixattn::ssd::State::empty", "state_dim is ",
                    state_dim, " and head_dim is ", head_dim, "; both must be >= 1");
    State st;
    st.h = Matrix<Wide>::Zero(state_dim, head_dim);
    return st;
  }
};

/// Gradient of a scalar loss with respect to a State's h (d_state x d_head), in the wide type.
/// backward of a continued forward returns it for the start state (Grad::state) and takes it for
/// the end state (what later pieces read from it).
template <class T>
struct StateGrad {
  Matrix<detail::wide_t<T>> h;  // d_state x d_head
  /// Fingerprint of the state this is the gradient of, set by backward (Grad::state) and checked
  /// by the previous piece's backward against the state its forward ended with; 0: not checked.
  std::uint64_t state_fingerprint = 0;
};

/// What forward keeps for backward: O(N), plus the chunks' start states with keep_states, never
/// O(N^2). Reusable: forward_into overwrites it and keeps its capacity.
template <class T>
struct Saved {
  Vector<T> step;    // N: Delta, every token's step (SPEC 10.1)
  Matrix<T> states;  // keep_states: chunk c's start state in rows [c S, (c + 1) S)
  // the options the forward ran with
  Index chunk = 0;
  double dt_bias = 0;
  bool dt_softplus = true;
  bool keep_states = false;
  /// Of x, dt, A, B, C, D and the start state (detail::Fingerprint), checked by backward.
  struct Fingerprints {
    std::uint64_t x = 0, dt = 0, A = 0, B = 0, C = 0, D = 0, start_state = 0;
  };
  Fingerprints fingerprint;
  bool valid = false;
  // Set by a forward that continued a State: the state it started from (a copy, S x P).
  bool continued = false;
  Matrix<detail::wide_t<T>> start_h;
  std::uint64_t end_fingerprint = 0;  // of the state the call ended with (continued only)
  detail::SsdScratch<T> scratch;      // the forward's working memory, kept for reuse
};

/// Gradients of a scalar loss with respect to x (N x d_head), dt (N, the raw step: through the
/// softplus), A, B, C (N x d_state), D, dt_bias (the sum of dt's) and, after a continued forward,
/// the start state (else empty). backward_into overwrites them and keeps `scratch` for the next
/// call.
template <class T>
struct Grad {
  Matrix<T> x, B, C;
  Vector<T> dt;
  T A = 0, D = 0, dt_bias = 0;
  StateGrad<T> state;
  detail::SsdScratch<T> scratch;
};

}  // namespace ssd
MIXATTN_END_NAMESPACE
