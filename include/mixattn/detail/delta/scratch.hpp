// mixattn/detail/delta/scratch.hpp — the gated delta rule's working memory (SPEC.md §9): the
// buffers of one chunk, forward and backward, kept in the records (delta::Saved, delta::Grad)
// so that a call whose shapes repeat allocates nothing.
//
// Internal: held by the records of mixattn/delta_types.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/gemm.hpp"

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
MIXATTN_END_NAMESPACE
