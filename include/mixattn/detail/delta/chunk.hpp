// mixattn/detail/delta/chunk.hpp — what the chunked forward and backward of the gated delta rule
// (SPEC.md §9.2, 9.3) compute alike for one chunk: its normalised rows, its decays, P = Q K^T o
// Gamma, A and T = (I + A)^-1.
//
// Internal: included by mixattn/delta.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/delta_types.hpp"
#include "mixattn/detail/delta/kernels.hpp"
#include "mixattn/detail/common/gemm.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// One call's inputs as the workers read them: q, k (N x d_k), v (N x d_v), g and beta (N).
template <class T>
struct DeltaInputs {
  const ConstMatrixRef<T>& q;
  const ConstMatrixRef<T>& k;
  const ConstMatrixRef<T>& v;
  const Eigen::Ref<const Vector<T>>& g;
  const Eigen::Ref<const Vector<T>>& beta;
};

/// The constants of one call: the scale resolved, the chunk length and whether q, k are
/// normalised.
struct DeltaConfig {
  Index chunk;
  double scale;
  bool normalize;
  double norm_eps;
};

inline DeltaConfig delta_config(const delta::Options& opt, Index key_dim) {
  const double scale = opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(key_dim));
  return {opt.chunk, scale, opt.normalize, opt.norm_eps};
}

/// inv(t) = 1 / sqrt(|x_t|^2 + eps): the squares summed in T (vectorised along the row; a float
/// sum of d squares carries d eps at worst, below the rounding the norm's use adds), the root in
/// the wide type. A row whose sum in T overflows or falls where its squares lose their precision
/// (below sqrt of T's smallest normal) is summed again in the wide type: a float row of 1e20
/// still normalises to a unit vector.
template <class T>
void delta_inverse_norms(const ConstMatrixRef<T>& x, double eps, Vector<T>& inv) {
  using W = wide_t<T>;
  const W small = std::sqrt(static_cast<W>(std::numeric_limits<T>::min()));
  inv.resize(x.rows());
  for (Index t = 0; t < x.rows(); ++t) {
    W ss = static_cast<W>(x.row(t).squaredNorm());
    if (!(ss <= static_cast<W>(std::numeric_limits<T>::max())) || ss < small)
      ss = x.row(t).template cast<W>().squaredNorm();
    inv(t) = static_cast<T>(W(1) / std::sqrt(ss + static_cast<W>(eps)));
  }
}

/// Sizes a chunk's buffers for chunks of up to C rows (capacity kept when it repeats).
template <class T>
void delta_size_chunk_buffers(DeltaScratch<T>& s, Index C, Index dk, Index dv) {
  s.qk.resize(2 * C, dk);
  s.kt.resize(dk, C);
  s.prod.resize(2 * C, C);
  s.decay.resize(C, C);
  s.tri.resize(C, delta_tri_width<T>(C));
  s.gamma.resize(C);
  s.eg.resize(C);
  s.ed.resize(C);
  s.w.resize(C);
  s.kd.resize(C, dk);
  s.s.resize(dk, dv);
  s.sw.resize(dk, dv);
  s.upd.resize(dk, dv);
}

/// The chunk's rows [c0, c0 + n) into s.qk: Q = s q^ in rows [0, n), K = k^ in rows [n, 2n)
/// (normalised with the inverse norms, or copied); K^T into s.kt.
template <class T>
void delta_load_chunk(const DeltaInputs<T>& in, const DeltaConfig& cfg, const Vector<T>& inv_q,
                      const Vector<T>& inv_k, Index c0, Index n, DeltaScratch<T>& s) {
  const T scale = static_cast<T>(cfg.scale);
  auto Q = s.qk.topRows(n);
  auto K = s.qk.middleRows(n, n);
  if (cfg.normalize) {
    s.w.head(n) = inv_q.segment(c0, n) * scale;
    Q.array() = in.q.middleRows(c0, n).array().colwise() * s.w.head(n).array();
    K.array() = in.k.middleRows(c0, n).array().colwise() * inv_k.segment(c0, n).array();
  } else {
    Q = in.q.middleRows(c0, n) * scale;
    K = in.k.middleRows(c0, n);
  }
  s.kt.leftCols(n) = K.transpose();
}

/// The chunk's gamma (wide, chunk-local cumulative sum of g), e^gamma and e^(gamma_C - gamma).
template <class T>
void delta_chunk_gamma(const Eigen::Ref<const Vector<T>>& g, Index c0, Index n,
                       DeltaScratch<T>& s) {
  using W = wide_t<T>;
  W acc = 0;
  for (Index r = 0; r < n; ++r) {
    acc += static_cast<W>(g(c0 + r));
    s.gamma(r) = acc;
  }
  for (Index r = 0; r < n; ++r) {
    s.eg(r) = static_cast<T>(std::exp(s.gamma(r)));
    s.ed(r) = static_cast<T>(std::exp(acc - s.gamma(r)));
  }
}

/// Gamma (lower triangle, Gamma_rj = e^(gamma_r - gamma_j)) from the differences: e^-gamma_j
/// alone overflows for a strong decay. After delta_chunk_gamma.
template <class T>
void delta_chunk_decay_matrix(Index n, DeltaScratch<T>& s) {
  using W = wide_t<T>;
  for (Index r = 0; r < n; ++r) {
    T* row = s.decay.row(r).data();
    const W gr = s.gamma(r);
    for (Index j = 0; j <= r; ++j) row[j] = static_cast<T>(gr - s.gamma(j));
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> d(row, r + 1);
    d = d.exp();
    std::fill(row + r + 1, row + n, T(0));
  }
}

/// The state line of SPEC 9.2 for a chunk of n rows whose K is loaded and gamma computed:
/// S' = e^gamma_C S + (diag(e^(gamma_C - gamma)) K)^T Delta, on the wide state s.sw (the product
/// in T, added in the wide type), s.s its copy in T. The forward and the backward's recomputation
/// of the states run these same operations.
template <class T>
void delta_advance_state(const ConstMatrixRef<T>& delta, Index n, DeltaScratch<T>& s) {
  using W = wide_t<T>;
  s.kd.topRows(n).array() = s.qk.middleRows(n, n).array().colwise() * s.ed.head(n).array();
  delta_product<T>(s.upd, delta_lhs<T>(s.kd.topRows(n), true), delta, false, s.gemm);
  const W decay = std::exp(s.gamma(n - 1));
  W* MIXATTN_RESTRICT sw = s.sw.data();  // one pass: sw = decay sw + upd, s = sw in T
  T* MIXATTN_RESTRICT st = s.s.data();
  const T* MIXATTN_RESTRICT up = s.upd.data();
  for (Index i = 0; i < s.sw.size(); ++i) {
    sw[i] = decay * sw[i] + static_cast<W>(up[i]);
    st[i] = static_cast<T>(sw[i]);
  }
}

/// [Q; K] K^T into s.prod (2n x n), then in place P = lower(Q K^T o Gamma) in its top n rows and
/// A = strictlower(diag(beta) (K K^T) o Gamma) in its bottom n rows; with `b`, also
/// B = strictlower(K K^T o Gamma) (A without beta, which dbeta needs) into b.
template <class T>
void delta_chunk_scores(const Eigen::Ref<const Vector<T>>& beta, Index c0, Index n,
                        DeltaScratch<T>& s, Matrix<T>* b) {
  const ConstMatrixRef<T> kt = s.kt.leftCols(n);  // QK^T's and KK^T's lower triangles
  delta_product<T>(s.prod.topLeftCorner(n, n), delta_lhs<T>(s.qk.topRows(n), false), kt, false,
                   s.gemm, true);
  delta_product<T>(s.prod.block(n, 0, n, n), delta_lhs<T>(s.qk.middleRows(n, n), false), kt, false,
                   s.gemm, true);
  for (Index r = 0; r < n; ++r) {
    T* p = s.prod.row(r).data();
    T* a = s.prod.row(n + r).data();
    const T* d = s.decay.row(r).data();
    const T br = beta(c0 + r);
    for (Index j = 0; j <= r; ++j) p[j] *= d[j];
    std::fill(p + r + 1, p + n, T(0));
    if (b) {
      T* bb = b->row(r).data();
      for (Index j = 0; j < r; ++j) bb[j] = a[j] * d[j];
      std::fill(bb + r, bb + n, T(0));
    }
    for (Index j = 0; j < r; ++j) a[j] *= br * d[j];
    std::fill(a + r, a + n, T(0));
  }
}

/// T = (I + A)^-1 (unit lower triangular) into s.tri by forward substitution, row by row:
/// t_r = e_r - sum_{j<r} A_rj t_j (delta_substitute). A is the bottom half of s.prod
/// (delta_chunk_scores).
template <class T>
void delta_chunk_inverse(Index n, DeltaScratch<T>& s) {
  delta_substitute<T>(s.prod.data() + n * s.prod.outerStride(), s.prod.outerStride(), n,
                      s.tri.data(), s.tri.outerStride());
}

/// Everything of a chunk that does not depend on the state: loads, decays, P, A and T.
template <class T>
void delta_prepare_chunk(const DeltaInputs<T>& in, const DeltaConfig& cfg, const Vector<T>& inv_q,
                         const Vector<T>& inv_k, Index c0, Index n, DeltaScratch<T>& s,
                         Matrix<T>* b = nullptr) {
  delta_load_chunk<T>(in, cfg, inv_q, inv_k, c0, n, s);
  delta_chunk_gamma<T>(in.g, c0, n, s);
  delta_chunk_decay_matrix<T>(n, s);
  delta_chunk_scores<T>(in.beta, c0, n, s, b);
  delta_chunk_inverse<T>(n, s);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
