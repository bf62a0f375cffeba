// bench/softmax_floor.hpp — the GEMM floor of softmax attention (SPEC §3): the Eigen GEMMs of
// the shapes FlashAttention must execute, tiled by query rows so the N x N matrix never exists
// (it would not fit at N = 65536), with nothing else (no exp, no max, no scaling).
//
// Forward, per row block R of B queries, over the visible keys J (all of them, or j < end of R
// when causal):  S = Q_R K_Jᵀ (B x |J| x r),  O_R = S V_J (B x |J| x d_v)
//   -> 2 N² (r + d_v) FLOPs bidirectional, about half that causal.
// Backward (flash recomputes S from the saved log-sum-exp):
//   S = Q_R K_Jᵀ,  dP = dO_R V_Jᵀ,  dV_J += Sᵀ dO_R,  dQ_R = dS K_J,  dK_J += dSᵀ Q_R
//   -> 2 N² (3 r + 2 d_v) FLOPs bidirectional.
#pragma once

#include <mixattn/core.hpp>

#include <algorithm>

namespace mixattn::bench {

class SoftmaxFloor {
 public:
  // Query rows per tile. Causal tiles compute their diagonal block in full, so they are smaller
  // to keep that excess (1 / (2 N / block) of the triangle) near 3% at N = 4096.
  static constexpr Index block_bidir = 256;
  static constexpr Index block_causal = 128;

  SoftmaxFloor(Index n, Index r, Index dv)
      : s_(block_bidir, n), dp_(block_bidir, n), o_(n, dv), dq_(n, r), dk_(n, r), dv_(n, dv) {}

  /// q, k: N x r; v, d_out: N x d_v.
  void forward(const Matrix<float>& q, const Matrix<float>& k, const Matrix<float>& v,
               bool causal) {
    const Index n = q.rows(), block = causal ? block_causal : block_bidir;
    for (Index r0 = 0; r0 < n; r0 += block) {
      const Index b = std::min(block, n - r0);
      const Index m = causal ? r0 + b : n;
      s_.topLeftCorner(b, m).noalias() = q.middleRows(r0, b) * k.topRows(m).transpose();
      o_.middleRows(r0, b).noalias() = s_.topLeftCorner(b, m) * v.topRows(m);
    }
  }

  void forward_backward(const Matrix<float>& q, const Matrix<float>& k, const Matrix<float>& v,
                        const Matrix<float>& d_out, bool causal) {
    forward(q, k, v, causal);
    const Index n = q.rows(), block = causal ? block_causal : block_bidir;
    dk_.setZero();
    dv_.setZero();
    for (Index r0 = 0; r0 < n; r0 += block) {
      const Index b = std::min(block, n - r0);
      const Index m = causal ? r0 + b : n;
      s_.topLeftCorner(b, m).noalias() = q.middleRows(r0, b) * k.topRows(m).transpose();
      dp_.topLeftCorner(b, m).noalias() = d_out.middleRows(r0, b) * v.topRows(m).transpose();
      dv_.topRows(m).noalias() += s_.topLeftCorner(b, m).transpose() * d_out.middleRows(r0, b);
      dq_.middleRows(r0, b).noalias() = dp_.topLeftCorner(b, m) * k.topRows(m);
      dk_.topRows(m).noalias() += dp_.topLeftCorner(b, m).transpose() * q.middleRows(r0, b);
    }
  }

  const Matrix<float>& out() const { return o_; }
  const Matrix<float>& grad_q() const { return dq_; }

  /// FLOPs of the nominal algorithm (exact causal triangle, inclusive diagonal).
  static double forward_flops(Index n, Index r, Index dv, bool causal) {
    return 2.0 * pairs(n, causal) * static_cast<double>(r + dv);
  }
  static double backward_flops(Index n, Index r, Index dv, bool causal) {
    return 2.0 * pairs(n, causal) * static_cast<double>(3 * r + 2 * dv);
  }

 private:
  static double pairs(Index n, bool causal) {
    const double nd = static_cast<double>(n);
    return causal ? nd * (nd + 1) / 2 : nd * nd;
  }
  Matrix<float> s_, dp_, o_, dq_, dk_, dv_;
};

}  // namespace mixattn::bench
