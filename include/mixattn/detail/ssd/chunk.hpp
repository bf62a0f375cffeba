// mixattn/detail/ssd/chunk.hpp — what the SSD layer's forward and backward (SPEC.md §10.2, 10.3)
// compute alike: the steps Delta, one chunk's decays (gamma, L), U = diag(Delta) X,
// P = C B^T o L and the state line, and the products they run.
//
// Internal: included by mixattn/ssd.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/ssd_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// One call's inputs as the workers read them: x (N x P), dt (N), A, B and C (N x S), D.
template <class T>
struct SsdInputs {
  const ConstMatrixRef<T>& x;
  const Eigen::Ref<const Vector<T>>& dt;
  T A;
  const ConstMatrixRef<T>& B;
  const ConstMatrixRef<T>& C;
  T D;
};

/// dst (+)= op(a) op(b), op a transpose when asked: Eigen's products on the scratch's packing
/// buffers (nothing allocated once they have grown).
template <class T>
void ssd_product(MatrixRef<T> dst, const ConstMatrixRef<T>& a, bool ta, const ConstMatrixRef<T>& b,
                 bool tb, bool accumulate, GemmSpace<T>& space) {
  product_into<T>(dst, ta ? transposed<T>(a) : plain<T>(a), tb ? transposed<T>(b) : plain<T>(b),
                  T(1), accumulate, space);
}

/// Chunks of fewer rows run their triangular products as one product: halving a smaller one
/// costs more in the products' fixed overhead than the skipped quarter saves.
constexpr Index ssd_split_rows = 32;

/// The lower triangle of dst = a b^T (n x n; a, b: n rows), in two products that skip the upper
/// right quarter (left as it was: the callers mask above the diagonal).
template <class T>
void ssd_lower_abt(MatrixRef<T> dst, const ConstMatrixRef<T>& a, const ConstMatrixRef<T>& b,
                   GemmSpace<T>& space) {
  const Index n = dst.rows(), h = n / 2;
  if (n < 2 * ssd_split_rows) return ssd_product<T>(dst, a, false, b, true, false, space);
  ssd_product<T>(dst.topLeftCorner(h, h), a.topRows(h), false, b.topRows(h), true, false, space);
  ssd_product<T>(dst.bottomRows(n - h), a.bottomRows(n - h), false, b, true, false, space);
}

/// dst (+)= op(l) x for a lower triangular l (n x n, zeros above the diagonal), op a transpose
/// with `trans`: two products that skip l's zero quarter.
template <class T>
void ssd_triangular_product(MatrixRef<T> dst, const ConstMatrixRef<T>& l, bool trans,
                            const ConstMatrixRef<T>& x, bool accumulate, GemmSpace<T>& space) {
  const Index n = l.rows(), h = n / 2;
  if (n < 2 * ssd_split_rows) return ssd_product<T>(dst, l, trans, x, false, accumulate, space);
  if (trans) {  // top rows of l^T: l[:, :h]^T x; bottom: l[h:, h:]^T x[h:] (l[:h, h:] = 0)
    ssd_product<T>(dst.topRows(h), l.leftCols(h), true, x, false, accumulate, space);
    ssd_product<T>(dst.bottomRows(n - h), l.bottomRightCorner(n - h, n - h), true,
                   x.bottomRows(n - h), false, accumulate, space);
  } else {  // top rows: l[:h, :h] x[:h]; bottom: l[h:, :] x
    ssd_product<T>(dst.topRows(h), l.topLeftCorner(h, h), false, x.topRows(h), false, accumulate,
                   space);
    ssd_product<T>(dst.bottomRows(n - h), l.bottomRows(n - h), false, x, false, accumulate, space);
  }
}

/// z_t = dt_t + dt_bias in the wide type.
template <class T>
wide_t<T> ssd_step_input(const Eigen::Ref<const Vector<T>>& dt, Index t, double bias) {
  return static_cast<wide_t<T>>(dt(t)) + static_cast<wide_t<T>>(bias);
}

/// softplus(z) = max(z, 0) + log1p(e^-|z|): no overflow for any finite z.
template <class W>
W ssd_softplus(W z) {
  return std::max(z, W(0)) + std::log1p(std::exp(-std::abs(z)));
}

/// dsoftplus/dz = the logistic function, without overflow.
template <class W>
W ssd_sigmoid(W z) {
  if (z >= W(0)) return W(1) / (W(1) + std::exp(-z));
  const W e = std::exp(z);
  return e / (W(1) + e);
}

/// Every token's step Delta_t (SPEC 10.1) into `step` (N).
template <class T>
void ssd_steps(const Eigen::Ref<const Vector<T>>& dt, const ssd::Options& opt, Vector<T>& step) {
  step.resize(dt.size());
  for (Index t = 0; t < dt.size(); ++t) {
    const wide_t<T> z = ssd_step_input<T>(dt, t, opt.dt_bias);
    step(t) = static_cast<T>(opt.dt_softplus ? ssd_softplus(z) : z);
  }
}

/// Sizes a chunk's buffers for chunks of up to C rows (capacity kept when it repeats).
template <class T>
void ssd_size_chunk_buffers(SsdScratch<T>& s, Index C, Index S, Index P) {
  s.u.resize(C, P);
  s.prod.resize(C, C);
  s.decay.resize(C, C);
  s.bd.resize(C, S);
  s.h.resize(S, P);
  s.upd.resize(S, P);
  s.gamma.resize(C);
  s.eg.resize(C);
  s.ed.resize(C);
}

/// The chunk's gamma (wide, chunk-local cumulative sum of Delta A), e^gamma, e^(gamma_n - gamma)
/// and U = diag(Delta) X.
template <class T>
void ssd_load_chunk(const SsdInputs<T>& in, const Vector<T>& step, Index c0, Index n,
                    SsdScratch<T>& s) {
  using W = wide_t<T>;
  const W a = static_cast<W>(in.A);
  W acc = 0;
  for (Index r = 0; r < n; ++r) {
    acc += static_cast<W>(step(c0 + r)) * a;
    s.gamma(r) = acc;
  }
  for (Index r = 0; r < n; ++r) {
    s.eg(r) = static_cast<T>(std::exp(s.gamma(r)));
    s.ed(r) = static_cast<T>(std::exp(acc - s.gamma(r)));
  }
  s.u.topRows(n).array() = in.x.middleRows(c0, n).array().colwise() * step.segment(c0, n).array();
}

/// P = C B^T o L into s.prod (lower, zeros above), L into s.decay (L_rj = e^(gamma_r - gamma_j),
/// from the differences: e^-gamma_j alone overflows for a strong decay). After ssd_load_chunk.
template <class T>
void ssd_chunk_scores(const SsdInputs<T>& in, Index c0, Index n, SsdScratch<T>& s) {
  using W = wide_t<T>;
  ssd_lower_abt<T>(s.prod.topLeftCorner(n, n), in.C.middleRows(c0, n), in.B.middleRows(c0, n),
                   s.gemm);
  for (Index r = 0; r < n; ++r) {
    T* l = s.decay.row(r).data();
    T* p = s.prod.row(r).data();
    const W gr = s.gamma(r);
    for (Index j = 0; j <= r; ++j) l[j] = static_cast<T>(gr - s.gamma(j));
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> d(l, r + 1);
    d = d.exp();
    for (Index j = 0; j <= r; ++j) p[j] *= l[j];
    std::fill(l + r + 1, l + n, T(0));
    std::fill(p + r + 1, p + n, T(0));
  }
}

/// The state line of SPEC 10.2 for a chunk of n rows after ssd_load_chunk:
/// H' = e^gamma_n H + (diag(e^(gamma_n - gamma)) B)^T U on the wide state s.hw (the product in T,
/// added in the wide type), s.h its copy in T. The forward and the backward's recomputation of
/// the states run these same operations.
template <class T>
void ssd_advance_state(const SsdInputs<T>& in, Index c0, Index n, SsdScratch<T>& s) {
  using W = wide_t<T>;
  s.bd.topRows(n).array() = in.B.middleRows(c0, n).array().colwise() * s.ed.head(n).array();
  ssd_product<T>(s.upd, s.bd.topRows(n), true, s.u.topRows(n), false, false, s.gemm);
  const W decay = std::exp(s.gamma(n - 1));
  W* MIXATTN_RESTRICT hw = s.hw.data();  // one pass: hw = decay hw + upd, h = hw in T
  T* MIXATTN_RESTRICT h = s.h.data();
  const T* MIXATTN_RESTRICT up = s.upd.data();
  for (Index i = 0; i < s.hw.size(); ++i) {
    hw[i] = decay * hw[i] + static_cast<W>(up[i]);
    h[i] = static_cast<T>(hw[i]);
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
