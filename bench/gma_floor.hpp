// bench/gma_floor.hpp — the GEMM floor of Gaussian Mixture Attention: the Eigen GEMMs of the
// shapes the operator must execute (SPEC §1.2–1.5), with operands prepared outside the timed
// region and nothing else (no exp, no softmax, no elementwise glue). An operator's time divided
// by its floor's time is the summary's "ratio to floor".
// Linear attention (SPEC §4) runs the same read/write with elementwise features (K = r) in place
// of Γ: its floor is this one without the responsibilities' GEMMs (R1, F1, F2, B5, B6), built with
// density = false.
//
// Shapes (N queries, M = N keys, K components, r routing dim, d_v value dim, C causal chunk):
// responsibilities (SPEC 1.2), per path:
//   R1  [x∘x | x] (N x 2r) · W (2r x K)          the log-density as one GEMM (the expanded form;
//                                                 the operator may use the stable two-FMA form,
//                                                 which has the same FLOP count)
// forward, bidirectional (SPEC 1.3):
//   F1  R1 for Q,  F2  R1 for K
//   F3  Γ_Kᵀ (K x M) · [V|1] (M x (d_v+1))        write: [Ṽ | Z]
//   F4  Γ_Q (N x K) · [Ṽ|Z] (K x (d_v+1))          read: numerators and denominators
// forward, causal (SPEC 1.4), per chunk R of C tokens, running state [S|z] (K x (d_v+1)):
//   F1, F2, then  A = Γ_Q,R Γ_K,Rᵀ (C x K x C),  O_R = A [V|1]_R (C x C x (d_v+1)),
//   O_R += Γ_Q,R [S|z] (C x K x (d_v+1)),  [S|z] += Γ_K,Rᵀ [V|1]_R (K x C x (d_v+1))
// backward, bidirectional (SPEC 1.5), with [g|h] the scaled output gradient (N x (d_v+1)):
//   B1  dΓ_Q = [g|h] · [Ṽ|Z]ᵀ              (N x (d_v+1) x K)
//   B2  [dṼ|dZ] = Γ_Qᵀ · [g|h]              (K x N x (d_v+1))
//   B3  dΓ_K = [V|1] · [dṼ|dZ]ᵀ             (M x (d_v+1) x K)
//   B4  dV = Γ_K · dṼ                        (M x K x d_v)
//   B5  dx from dS: dS (N x K) · [P | P∘μ] (K x 2r), for Q and for K
//       (dx_im = −x_im Σ_k dS_ik P_km + Σ_k dS_ik P_km μ_km)
//   B6  mixture gradient: dSᵀ (K x N) · [x∘x | x] (N x 2r), for Q and for K
//       (dμ and dσ² need Σ_i dS_ik x_im and Σ_i dS_ik x_im²)
// backward, causal: B5, B6 and per chunk (SPEC 1.5 causal, suffix state [G|u] K x (d_v+1)):
//   [S|z] recomputed (K x C x (d_v+1)), A recomputed (C x K x C), dA = [g|h]_R [V|1]_Rᵀ
//   (C x (d_v+1) x C), dΓ_Q,R = [g|h]_R [S|z]ᵀ + dA Γ_K,R, dΓ_K,R = [V|1]_R [G|u]ᵀ + dAᵀ Γ_Q,R,
//   dV_R = Γ_K,R G + Aᵀ g_R, [G|u] += Γ_Q,Rᵀ [g|h]_R
#pragma once

#include <mixattn/core.hpp>

#include <algorithm>

#include "bench_common.hpp"

namespace mixattn::bench {

class GmaFloor {
 public:
  GmaFloor(Index n, Index components, Index r, Index dv, Index chunk, bool density = true)
      : n_(n), k_(components), dv_(dv), chunk_(chunk), density_(density) {
    xq2_ = random_matrix<float>(n, 2 * r, 11);
    xk2_ = random_matrix<float>(n, 2 * r, 12);
    w_ = random_matrix<float>(2 * r, k_, 13);
    pm_ = random_matrix<float>(k_, 2 * r, 14);
    gq_ = random_matrix<float>(n, k_, 15).cwiseAbs();
    gk_ = random_matrix<float>(n, k_, 16).cwiseAbs();
    v1_ = random_matrix<float>(n, dv + 1, 17);
    gh_ = random_matrix<float>(n, dv + 1, 18);
    rq_.resize(n, k_);
    rk_.resize(n, k_);
    vz_.resize(k_, dv + 1);
    dvz_.resize(k_, dv + 1);
    state_.resize(k_, dv + 1);
    suffix_.resize(k_, dv + 1);
    oq_.resize(n, dv + 1);
    dgq_.resize(n, k_);
    dgk_.resize(n, k_);
    dv_out_.resize(n, dv);
    dxq_.resize(n, 2 * r);
    dxk_.resize(n, 2 * r);
    dpq_.resize(k_, 2 * r);
    dpk_.resize(k_, 2 * r);
    a_.resize(chunk, chunk);
    da_.resize(chunk, chunk);
  }

  /// R1 once: one (N x 2r)·(2r x K) GEMM.
  void responsibilities() { mul(rq_, xq2_, w_, false); }

  void forward(bool causal) {
    if (density_) {
      mul(rq_, xq2_, w_, false);
      mul(rk_, xk2_, w_, false);
    }
    if (!causal) {
      mul(vz_, gk_.transpose(), v1_, false);
      mul(oq_, gq_, vz_, false);
      return;
    }
    state_.setZero();
    for (Index c0 = 0; c0 < n_; c0 += chunk_) {
      const Index c = std::min(chunk_, n_ - c0);
      mul(a_.topLeftCorner(c, c), gq_.middleRows(c0, c), gk_.middleRows(c0, c).transpose(), false);
      mul(oq_.middleRows(c0, c), a_.topLeftCorner(c, c), v1_.middleRows(c0, c), false);
      mul(oq_.middleRows(c0, c), gq_.middleRows(c0, c), state_, true);
      mul(state_, gk_.middleRows(c0, c).transpose(), v1_.middleRows(c0, c), true);
    }
  }

  void forward_backward(bool causal) {
    forward(causal);
    if (!causal) {
      mul(dgq_, gh_, vz_.transpose(), false);
      mul(dvz_, gq_.transpose(), gh_, false);
      mul(dgk_, v1_, dvz_.transpose(), false);
      mul(dv_out_, gk_, dvz_.leftCols(dv_), false);
    } else {
      state_.setZero();
      for (Index c0 = 0; c0 < n_; c0 += chunk_) {  // the prefix states the backward reads
        const Index c = std::min(chunk_, n_ - c0);
        mul(state_, gk_.middleRows(c0, c).transpose(), v1_.middleRows(c0, c), true);
      }
      suffix_.setZero();
      for (Index c0 = ((n_ - 1) / chunk_) * chunk_; c0 >= 0; c0 -= chunk_) {
        const Index c = std::min(chunk_, n_ - c0);
        mul(a_.topLeftCorner(c, c), gq_.middleRows(c0, c), gk_.middleRows(c0, c).transpose(),
            false);
        mul(da_.topLeftCorner(c, c), gh_.middleRows(c0, c), v1_.middleRows(c0, c).transpose(),
            false);
        mul(dgq_.middleRows(c0, c), gh_.middleRows(c0, c), state_.transpose(), false);
        mul(dgq_.middleRows(c0, c), da_.topLeftCorner(c, c), gk_.middleRows(c0, c), true);
        mul(dgk_.middleRows(c0, c), v1_.middleRows(c0, c), suffix_.transpose(), false);
        mul(dgk_.middleRows(c0, c), da_.topLeftCorner(c, c).transpose(), gq_.middleRows(c0, c),
            true);
        mul(dv_out_.middleRows(c0, c), gk_.middleRows(c0, c), suffix_.leftCols(dv_), false);
        mul(dv_out_.middleRows(c0, c), a_.topLeftCorner(c, c).transpose(),
            gh_.middleRows(c0, c).leftCols(dv_), true);
        mul(suffix_, gq_.middleRows(c0, c).transpose(), gh_.middleRows(c0, c), true);
      }
    }
    // Through the log-density, both paths (dS has the shape of Γ; its values do not matter here).
    if (!density_) return;
    mul(dxq_, dgq_, pm_, false);
    mul(dxk_, dgk_, pm_, false);
    mul(dpq_, dgq_.transpose(), xq2_, false);
    mul(dpk_, dgk_.transpose(), xk2_, false);
  }

  /// The FLOPs the floor issues, in closed form (so operator benchmarks need no floor instance);
  /// the floor benchmarks check it against the counted figure.
  static double responsibilities_flops(Index n, Index components, Index r) {
    return 4.0 * static_cast<double>(n) * static_cast<double>(r) * static_cast<double>(components);
  }
  static double forward_flops(Index n, Index kc, Index r, Index dv, Index chunk, bool causal,
                              bool density = true) {
    const double K = static_cast<double>(kc), D = static_cast<double>(dv + 1);
    double f = density ? 2 * responsibilities_flops(n, kc, r) : 0;
    if (!causal) return f + 4.0 * static_cast<double>(n) * K * D;
    for (Index c0 = 0; c0 < n; c0 += chunk) {
      const double c = static_cast<double>(std::min(chunk, n - c0));
      f += 2 * c * K * c + 2 * c * c * D + 4 * c * K * D;
    }
    return f;
  }
  static double backward_flops(Index n, Index kc, Index r, Index dv, Index chunk, bool causal,
                               bool density = true) {
    const double N = static_cast<double>(n), K = static_cast<double>(kc),
                 D = static_cast<double>(dv + 1), Dv = static_cast<double>(dv);
    // B5 + B6, both paths
    double f = density ? 2 * (2 * N * K * 2.0 * static_cast<double>(r)) * 2 : 0;
    if (!causal) return f + 6 * N * K * D + 2 * N * K * Dv;
    for (Index c0 = 0; c0 < n; c0 += chunk) {
      const double c = static_cast<double>(std::min(chunk, n - c0));
      f += 2 * K * c * D                      // prefix state
           + 2 * c * K * c                    // A
           + 2 * c * D * c                    // dA
           + 4 * c * D * K                    // dΓ_Q, dΓ_K inter-chunk
           + 4 * c * c * K                    // dΓ_Q, dΓ_K intra-chunk
           + 2 * c * K * Dv + 2 * c * c * Dv  // dV
           + 2 * K * c * D;                   // suffix state
    }
    return f;
  }

  /// FLOPs of the GEMMs issued since the last reset (2 m n k each).
  double flops() const { return flops_; }
  void reset_flops() { flops_ = 0; }
  const float* sink() const { return oq_.data(); }

 private:
  template <class Dst, class A, class B>
  void mul(Dst&& dst, const A& a, const B& b, bool accumulate) {
    flops_ += 2.0 * static_cast<double>(a.rows()) * static_cast<double>(a.cols()) *
              static_cast<double>(b.cols());
    if (accumulate)
      dst.noalias() += a * b;
    else
      dst.noalias() = a * b;
  }

  Index n_, k_, dv_, chunk_;
  bool density_;
  double flops_ = 0;
  Matrix<float> xq2_, xk2_, w_, pm_, gq_, gk_, v1_, gh_;
  Matrix<float> rq_, rk_, vz_, dvz_, state_, suffix_, oq_, dgq_, dgk_, dv_out_;
  Matrix<float> dxq_, dxk_, dpq_, dpk_, a_, da_;
};

}  // namespace mixattn::bench
