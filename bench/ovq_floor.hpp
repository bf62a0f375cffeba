// bench/ovq_floor.hpp — the GEMM floor of Online VQ attention (SPEC §2): the Eigen GEMMs of the
// shapes the operator must execute, block by block, and their FLOP count in closed form, the count
// bench_ovq and bench_training report for OVQ. Options: block C = 256, N_max = 1024 centroids,
// r = d_v = 64, the default plateau growth.
#pragma once

#include <mixattn/core.hpp>

#include <algorithm>
#include <cmath>

#include "bench_common.hpp"

namespace mixattn::bench::ovq_floor {

constexpr Index kR = 64;
constexpr Index kDv = 64;
constexpr Index kBlock = 256;
constexpr Index kMaxCentroids = 1024;

/// Dictionary size after t absorbed tokens under the default plateau schedule (SPEC 2.3 step 1):
/// N(t) = min(max(floor(t N_max / (t + alpha)), 1), N_max), N(0) = 0, alpha = N_max.
inline Index dictionary_size(Index t) {
  if (t == 0) return 0;
  const double alpha = static_cast<double>(kMaxCentroids);
  const auto n = static_cast<Index>(
      std::floor(static_cast<double>(t) * kMaxCentroids / (static_cast<double>(t) + alpha)));
  return std::min(std::max<Index>(n, 1), kMaxCentroids);
}

/// The GEMM floor of OVQ: for block b (C queries; dictionary of N_b = N(bC) rows before it and
/// N_{b+1} after its seeding):
///   forward   scores Q_b D_kᵀ (C x r x N_b), readout P D_v (C x N_b x d_v),
///             intra-block Q_b K_bᵀ (C x r x C) and P_b V_b (C x C x d_v),
///             assignment K_b D_kᵀ (C x r x N_{b+1}) for complete blocks
///   backward  recomputed scores Q_b D_kᵀ and Q_b K_bᵀ (checkpointing, SPEC 2.4),
///             dP = dO_b D_vᵀ (C x d_v x N_b) and dO_b V_bᵀ (C x d_v x C),
///             dQ_b = dS D_k + dS_b K_b (C x (N_b + C) x r),
///             dD_k = dSᵀ Q_b (N_b x C x r), dD_v = Pᵀ dO_b (N_b x C x d_v),
///             dK_b = dS_bᵀ Q_b (C x C x r), dV_b = P_bᵀ dO_b (C x C x d_v)
/// The sparse running-mean updates (one row per token) are not GEMM-shaped and are left out.
class OvqFloor {
 public:
  explicit OvqFloor(Index t)
      : t_(t),
        dk_(random_matrix<float>(kMaxCentroids, kR, 21)),
        dv_(random_matrix<float>(kMaxCentroids, kDv, 22)),
        s_(kBlock, kMaxCentroids),
        sb_(kBlock, kBlock),
        o_(kBlock, kDv),
        dq_(kBlock, kR),
        gdk_(kMaxCentroids, kR),
        gdv_(kMaxCentroids, kDv),
        gk_(kBlock, kR),
        gv_(kBlock, kDv) {}

  void run(const QkvInputs& in, bool backward) {
    flops_ = 0;
    for (Index b0 = 0; b0 < t_; b0 += kBlock) {
      const Index c = std::min(kBlock, t_ - b0);
      const Index nb = dictionary_size(b0);
      const Matrix<float>::ConstRowsBlockXpr q = in.q.middleRows(b0, c);
      const Matrix<float>::ConstRowsBlockXpr k = in.k.middleRows(b0, c);
      const Matrix<float>::ConstRowsBlockXpr v = in.v.middleRows(b0, c);
      forward_block(q, k, v, c, nb);
      if (c == kBlock) {
        const Index n_after = dictionary_size(b0 + c);
        mul(s_.topLeftCorner(c, n_after), k, dk_.topRows(n_after).transpose(), false);
      }
      if (backward) backward_block(q, k, v, in.d_out.middleRows(b0, c), c, nb);
    }
  }
  double flops() const { return flops_; }
  const float* sink() const { return o_.data(); }

 private:
  template <class Q, class K, class V>
  void forward_block(const Q& q, const K& k, const V& v, Index c, Index nb) {
    mul(s_.topLeftCorner(c, nb), q, dk_.topRows(nb).transpose(), false);
    mul(o_.topRows(c), s_.topLeftCorner(c, nb), dv_.topRows(nb), false);
    mul(sb_.topLeftCorner(c, c), q, k.transpose(), false);
    mul(o_.topRows(c), sb_.topLeftCorner(c, c), v, true);
  }

  template <class Q, class K, class V, class G>
  void backward_block(const Q& q, const K& k, const V& v, const G& d_out, Index c, Index nb) {
    mul(s_.topLeftCorner(c, nb), q, dk_.topRows(nb).transpose(), false);  // recompute
    mul(sb_.topLeftCorner(c, c), q, k.transpose(), false);
    mul(s_.topLeftCorner(c, nb), d_out, dv_.topRows(nb).transpose(), false);  // dP
    mul(sb_.topLeftCorner(c, c), d_out, v.transpose(), false);
    mul(dq_.topRows(c), s_.topLeftCorner(c, nb), dk_.topRows(nb), false);
    mul(dq_.topRows(c), sb_.topLeftCorner(c, c), k, true);
    mul(gdk_.topRows(nb), s_.topLeftCorner(c, nb).transpose(), q, false);
    mul(gdv_.topRows(nb), s_.topLeftCorner(c, nb).transpose(), d_out, false);
    mul(gk_.topRows(c), sb_.topLeftCorner(c, c).transpose(), q, false);
    mul(gv_.topRows(c), sb_.topLeftCorner(c, c).transpose(), d_out, false);
  }

  template <class Dst, class A, class B>
  void mul(Dst&& dst, const A& a, const B& b, bool accumulate) {
    if (a.rows() == 0 || a.cols() == 0 || b.cols() == 0) return;  // empty dictionary (block 0)
    flops_ += 2.0 * static_cast<double>(a.rows()) * static_cast<double>(a.cols()) *
              static_cast<double>(b.cols());
    if (accumulate)
      dst.noalias() += a * b;
    else
      dst.noalias() = a * b;
  }

  Index t_;
  double flops_ = 0;
  Matrix<float> dk_, dv_, s_, sb_, o_, dq_, gdk_, gdv_, gk_, gv_;
};

/// The floor's FLOPs for T tokens (one dry pass over the block schedule, no arithmetic).
inline double floor_flops(Index t, bool backward) {
  double f = 0;
  for (Index b0 = 0; b0 < t; b0 += kBlock) {
    const double c = static_cast<double>(std::min(kBlock, t - b0));
    const double nb = static_cast<double>(dictionary_size(b0));
    f += 2 * c * nb * (kR + kDv) + 2 * c * c * (kR + kDv);
    if (c == kBlock) f += 2 * c * kR * static_cast<double>(dictionary_size(b0 + kBlock));
    if (backward)
      f += 2 * c * nb * kR + 2 * c * c * kR  // recompute
           + 2 * c * kDv * (nb + c)          // dP
           + 2 * c * (nb + c) * kR           // dQ
           + 2 * (nb + c) * c * (kR + kDv);  // dD_k, dD_v, dK_b, dV_b
  }
  return f;
}

}  // namespace mixattn::bench::ovq_floor
