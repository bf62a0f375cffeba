// mixattn/performer.hpp — Performer attention with FAVOR+ positive random features (Choromanski
// et al. 2021, "Rethinking Attention with Performers"), the baseline of SPEC.md section 5,
// forward and backward, bidirectional and causal.
//
// With m random directions w_l (the rows of a constant m x r matrix W, drawn from a seed) and the
// scale s (default r^(-1/4)), every row x of q and k gets the m features
//   phi(x)_l = exp(s w_l . x - s^2 |x|^2 / 2 - c) / sqrt(m),
// whose products estimate the softmax kernel: E[phi(q) . phi(k)] = exp(s^2 q . k) e^(-c_q - c_k).
// c is the stabiliser (SPEC 5.2), as in the FAVOR+ reference: per query row the row's largest
// exponent, for keys one largest exponent over the whole call; it changes the result only
// through eps. Then it is linear attention (SPEC 4.2)
// with these features: the read-out, the causal chunked scan (detail/common/causal_scan.hpp) and
// the backward to the features are linear.hpp's, shared, not copied. Cost O((N + M) m (r + d_v)).
//
// Thread safety: every function is reentrant; distinct calls may run concurrently. A forward
// without `saved` works in this thread's own scratch record (kept for the thread's lifetime).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/performer_types.hpp"

#include <Eigen/Core>
#include <Eigen/QR>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// n standard normal draws in double (Box-Muller on 53-bit uniforms: platform-independent,
/// unlike std::normal_distribution).
inline void performer_gaussians(std::mt19937_64& rng, double* out, Index n) {
  const double two_pi = 6.283185307179586476925286766559;
  const auto unit = [&rng] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for (Index i = 0; i < n; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(unit())), angle = two_pi * unit();
    out[i] = radius * std::cos(angle);
    if (i + 1 < n) out[i + 1] = radius * std::sin(angle);
  }
}

/// The resolved scale s (options.scale, or r^(-1/4) for 0).
template <class T>
T performer_scale(const performer::Options& opt, Index r) {
  return static_cast<T>(opt.scale > 0 ? opt.scale : std::pow(static_cast<double>(r), -0.25));
}

template <class T>
void performer_check(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                     const ConstMatrixRef<T>& v, const performer::Features<T>& f,
                     const performer::Options& opt) {
  feature_attention_check_inputs<T>(fn, q, k, v, opt);
  require(f.w.rows() > 0 && f.w.cols() == q.cols(), fn, "features.w is ", shape_str(f.w),
          " but q is ", shape_str(q), ": it must be m x ", q.cols(), " with m >= 1");
  require(opt.scale >= 0 && std::isfinite(opt.scale) && std::isfinite(static_cast<T>(opt.scale)),
          fn, "options.scale is ", opt.scale, "; it must be >= 0 and finite (0: r^(-1/4))");
  if (opt.check_finite) require_finite(f.w, fn, "features.w");
}

}  // namespace detail

namespace performer {

template <class T>
Features<T> Features<T>::random(Index m, Index r, std::uint64_t seed, Draw draw) {
  detail::require(m > 0 && r > 0, "mixattn::performer::Features::random", "m is ", m, " and r is ",
                  r, "; both must be positive");
  std::mt19937_64 rng(seed);
  Matrix<double> w(m, r);
  if (draw == Draw::iid) {
    detail::performer_gaussians(rng, w.data(), w.size());
  } else {
    // Each block of r rows: a Haar-distributed orthogonal matrix (rows exactly orthonormal, each
    // uniform on the sphere), then row l scaled by the norm of an independent Gaussian r-vector, so
    // every row keeps the N(0, I) row's length distribution (the reference's scaling = 0).
    Matrix<double> g(r, r), norms(m, r);
    for (Index b = 0; b < m; b += r) {
      detail::performer_gaussians(rng, g.data(), g.size());
      const Eigen::HouseholderQR<Matrix<double>> qr(g);
      Matrix<double> qm = qr.householderQ();
      // Q diag(sign(R_cc)) is Haar-distributed; Householder's Q alone is not (its columns' signs
      // follow g's), which biases the directions and so the kernel estimate.
      for (Index c = 0; c < r; ++c)
        if (qr.matrixQR()(c, c) < 0) qm.col(c) *= -1.0;
      const Index rows = std::min(r, m - b);
      w.middleRows(b, rows) = qm.topRows(rows);
    }
    detail::performer_gaussians(rng, norms.data(), norms.size());
    w.array().colwise() *= norms.rowwise().norm().array();
  }
  Features f;
  f.w = w.cast<T>();
  f.draw = draw;
  return f;
}

}  // namespace performer

namespace detail {

/// phi = exp(s X W^T - s^2 |x|^2 / 2 - c) / sqrt(m) (SPEC 5.2); x: n x r, phi: n x m. The
/// stabiliser c is the largest exponent: per_row (queries) c_i = max_l (s w_l . x_i -
/// s^2 |x_i|^2 / 2), its l in at[i] (the |x_i|^2 term cancels: the exponents are s (w_l -
/// w_l*) . x_i); otherwise (keys) one c over all (j, l), its (j, l) in (row, col). Every
/// exponent is <= 0, so phi <= 1/sqrt(m), and every query row has one feature equal to it.
/// The product's buffers and the keys' squared norms are in `scratch`.
template <class T>
void performer_features_into(const ConstMatrixRef<T>& x, const Matrix<T>& w, T s, bool per_row,
                             Matrix<T>& phi, Eigen::Matrix<Index, Eigen::Dynamic, 1>* at,
                             Index* row, Index* col, LinearScratch<T>& scratch) {
  const Index n = x.rows(), m = w.rows();
  phi.resize(n, m);
  if (n == 0) return;
  product_into<T>(phi, plain<T>(x), transposed<T>(w), T(1), false, scratch.gemm);
  phi *= s;
  // The maxima by Eigen's vectorised reduction, then their first position by a scan in storage
  // order: maxCoeff(&index) is a scalar visitor, which walks a row-major matrix column by column
  // (a cache line per coefficient), most of the forward's time. The positions are those the
  // visitor gives: the first maximum of a row; over all of phi the first in column-major order
  // (least column, then least row). When the scan finds no entry equal to the maximum (a NaN,
  // possible only with check_finite off), the visitor decides, as before: the positions are
  // then always in range.
  if (per_row) {
    at->resize(n);
    for (Index i = 0; i < n; ++i) {
      const T* p = phi.row(i).data();
      T c = phi.row(i).maxCoeff();
      Index l = static_cast<Index>(std::find(p, p + m, c) - p);
      if (l == m) c = phi.row(i).maxCoeff(&l);
      (*at)[i] = l;
      phi.row(i).array() -= c;
    }
  } else {
    scratch.norms = (s * s / T(2)) * x.rowwise().squaredNorm();
    phi.array().colwise() -= scratch.norms.array();
    T c = phi.maxCoeff();
    *row = 0;
    *col = m;
    for (Index i = 0; i < n && *col > 0; ++i) {
      const T* p = phi.row(i).data();
      const Index j = static_cast<Index>(std::find(p, p + *col, c) - p);
      if (j < *col) {
        *row = i;
        *col = j;
      }
    }
    if (*col == m) c = phi.maxCoeff(row, col);
    phi.array() -= c;
  }
  phi = phi.array().exp() * static_cast<T>(1.0 / std::sqrt(static_cast<double>(m)));
}

/// Through the feature map (SPEC 5.3), with E = dphi o phi (the gradient of the exponents)
/// and e_i = sum_l E_il. Queries (exponents s (w_l - w_at[i]) . x_i):
///   dx_i = s E_i W - s e_i w_at[i].
/// Keys (exponents s w_l . x_j - s^2 |x_j|^2 / 2 - c, c that of (row, col)):
///   dx_j = s E_j W - s^2 e_j x_j,  and  dx_row -= (sum_j e_j) (s w_col - s^2 x_row).
/// dphi: n x m on entry (overwritten with E); dx: n x r; e_i in `e`, the product's buffers in
/// `space`.
template <class T>
void performer_feature_backward_into(const ConstMatrixRef<T>& x, const Matrix<T>& w, T s,
                                     const Matrix<T>& phi, Matrix<T>& dphi, Matrix<T>& dx,
                                     Vector<T>& e,
                                     const Eigen::Matrix<Index, Eigen::Dynamic, 1>* at, Index row,
                                     Index col, GemmSpace<T>& space) {
  const Index n = x.rows();
  dx.resize(n, w.cols());
  if (n == 0) return;
  dphi.array() *= phi.array();
  e = dphi.rowwise().sum();
  product_into<T>(dx, plain<T>(dphi), plain<T>(w), s, false, space);
  if (at != nullptr) {
    for (Index i = 0; i < n; ++i) dx.row(i) -= (s * e[i]) * w.row((*at)[i]);
  } else {
    dx.array() -= (s * s) * (x.array().colwise() * e.array());
    dx.row(row) -= e.sum() * (s * w.row(col) - (s * s) * x.row(row));
  }
}

/// forward_into's body (`fn` names the entry point in messages); the value-returning forward runs
/// it too.
template <class T>
void performer_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                            const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                            const performer::Features<T>& features, const performer::Options& opt,
                            performer::Saved<T>* saved) {
  detail::performer_check<T>(fn, q, k, v, features, opt);
  const T s = detail::performer_scale<T>(opt, q.cols());
  performer::Saved<T>& rec = saved ? *saved : detail::thread_scratch<performer::Saved<T>>();
  rec.attn.valid = false;  // until this call has filled it
  detail::performer_features_into<T>(q, features.w, s, true, rec.attn.phi_q, &rec.q_at, nullptr,
                                     nullptr, rec.attn.scratch);
  detail::performer_features_into<T>(k, features.w, s, false, rec.attn.phi_k, nullptr, &rec.k_row,
                                     &rec.k_col, rec.attn.scratch);
  detail::feature_attention_forward<T>(fn, out, q, k, v, opt, rec.attn, saved != nullptr);
  rec.scale = opt.scale;
  if (saved) rec.w_fingerprint = detail::fingerprint(features.w);
}

/// backward_into's body (`fn` names the entry point in messages); the value-returning backward runs
/// it too.
template <class T>
void performer_backward_into(const char* fn, performer::Grad<T>& grad, const ConstMatrixRef<T>& q,
                             const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                             const ConstMatrixRef<T>& grad_out,
                             const performer::Features<T>& features,
                             const performer::Saved<T>& saved, const performer::Options& opt) {
  detail::performer_check<T>(fn, q, k, v, features, opt);
  detail::feature_attention_check_backward<T>(fn, q, k, v, grad_out, saved.attn, opt,
                                              features.count());
  detail::require(saved.scale == opt.scale && saved.q_at.size() == q.rows(), fn,
                  "saved was made with scale = ", saved.scale,
                  " but options give scale = ", opt.scale);
  if (detail::fingerprint(features.w) != saved.w_fingerprint)
    detail::raise_other_data(fn, "saved", "features.w");
  const T s = detail::performer_scale<T>(opt, q.cols());
  detail::LinearScratch<T>& x = grad.scratch;
  detail::feature_attention_backward<T>(
      fn, q.cols(), k.rows(), v, grad_out, saved.attn, opt, grad.q, grad.k, grad.v, x, [&] {
        detail::performer_feature_backward_into<T>(q, features.w, s, saved.attn.phi_q, x.dphi_q,
                                                   grad.q, x.e, &saved.q_at, 0, 0, x.gemm);
        detail::performer_feature_backward_into<T>(k, features.w, s, saved.attn.phi_k, x.dphi_k,
                                                   grad.k, x.e, nullptr, saved.k_row, saved.k_col,
                                                   x.gemm);
      });
}

}  // namespace detail

namespace performer {

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, features, opt, saved); with a reused `out` and `saved` (or
/// none), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Features<T>& features, const Options& opt,
                  Saved<T>* saved) {
  detail::performer_forward_into<T>("mixattn::performer::forward_into", out, q, k, v, features, opt,
                                    saved);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, grad_out, features, saved, opt), allocating nothing when
/// shapes repeat.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                   const Features<T>& features, const Saved<T>& saved, const Options& opt) {
  detail::performer_backward_into<T>("mixattn::performer::backward_into", grad, q, k, v, grad_out,
                                     features, saved, opt);
}

/// Performer forward (SPEC 5.2). q: N x r, k: M x r, v: M x d_v, row-major (M == N when causal;
/// M == 0 only with N == 0); features.w: m x r. Returns N x d_v. If `saved` is given it receives
/// what backward needs. T is not deduced: write performer::forward<float>(q, k, v, features).
/// Throws std::invalid_argument for bad shapes or options; with check_finite, std::domain_error
/// for non-finite q, k, v or W, or for an output that overflowed T.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Features<T>& features, const Options& opt = {},
                  Saved<T>* saved = nullptr) {
  Matrix<T> out;
  detail::performer_forward_into<T>("mixattn::performer::forward", out, q, k, v, features, opt,
                                    saved);
  return out;
}

/// Performer backward (SPEC 5.3): gradients of sum(grad_out . forward(q, k, v, features)) with
/// respect to q (N x r), k (M x r) and v (M x d_v); W is a constant. grad_out: N x d_v; saved:
/// filled by forward with the same q, k, v, features and options. With check_finite,
/// non-finite grad_out or overflowed gradients throw std::domain_error.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& grad_out, const Features<T>& features,
                 const Saved<T>& saved, const Options& opt = {}) {
  Grad<T> grad;
  {  // the working memory is this thread's: the returned gradient carries none
    const detail::LentScratch<decltype(grad.scratch)> lent(&grad.scratch);
    detail::performer_backward_into<T>("mixattn::performer::backward", grad, q, k, v, grad_out,
                                       features, saved, opt);
  }
  return grad;
}

}  // namespace performer

#ifdef MIXATTN_TEMPLATE_INSTANCE
// core.hpp: compiling the operators once.
namespace performer {
#define MIXATTN_PERFORMER_INSTANCES(T)                                              \
  MIXATTN_TEMPLATE_INSTANCE Matrix<T> forward<T, 0>(                                \
      const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, \
      const Features<T>&, const Options&, Saved<T>*);                               \
  MIXATTN_TEMPLATE_INSTANCE Grad<T> backward<T, 0>(                                 \
      const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, \
      const ConstMatrixArg<T>&, const Features<T>&, const Saved<T>&, const Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_PERFORMER_INSTANCES)
#undef MIXATTN_PERFORMER_INSTANCES
}  // namespace performer
// The workers behind every form (the _into forms and the layer call them directly).
namespace detail {
#define MIXATTN_PERFORMER_WORKERS(T)                                                              \
  MIXATTN_TEMPLATE_INSTANCE void performer_forward_into<T>(                                       \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,                \
      const ConstMatrixRef<T>&, const performer::Features<T>&, const performer::Options&,         \
      performer::Saved<T>*);                                                                      \
  MIXATTN_TEMPLATE_INSTANCE void performer_backward_into<T>(                                      \
      const char*, performer::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,       \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const performer::Features<T>&,          \
      const performer::Saved<T>&, const performer::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_PERFORMER_WORKERS)
#undef MIXATTN_PERFORMER_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
