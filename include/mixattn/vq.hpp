// mixattn/vq.hpp — static-codebook vector-quantised attention (Transformer-VQ style: Lingle 2023,
// "Transformer-VQ: Linear-Time Transformers via Vector Quantization"), the baseline of SPEC.md
// section 6 that OVQ's online dictionary is compared against; forward and backward,
// bidirectional and causal.
//
// A learned codebook C (S x r). Every key is replaced by its nearest code, k^_j = C_{z_j},
// z_j = argmin_s |k_j - C_s|^2, and every query attends over the quantised keys with softmax
// weights e^(tau q_i . k^_j). Grouping the keys by code, that is attention over the S codes with
// a log-count bias (log of how many visible keys map to each code) and per-code value sums:
//   O_i = sum_s e^(tau q_i . C_s) U_s / (sum_s e^(tau q_i . C_s) n_s + guard),
// U_s, n_s the sum of the values and the number of the visible keys in code s: linear
// attention (SPEC 4.2) with query features e^(tau q_i . C_s - m_i) / sqrt(S) (Performer's
// query features with W = C, performer.hpp) and one-hot key features, on the same read-out and
// causal scan (prefix counts and sums, chunk-wise). Cost O((N + M) S (r + d_v)) forward; the
// straight-through key gradient costs O(N S r d_v) (SPEC 6.3).
//
// Thread safety: every function is reentrant; distinct calls may run concurrently. A forward
// without `saved` works in this thread's own scratch record (kept for the thread's lifetime).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/performer.hpp"
#include "mixattn/vq_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

using CodeVector = Eigen::Matrix<Index, Eigen::Dynamic, 1>;

/// z_j = argmin_s |k_j - C_s|^2 = argmax_s (k_j . C_s - |C_s|^2 / 2), ties to the lowest s.
template <class T>
CodeVector vq_codes(const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& codebook) {
  CodeVector z(k.rows());
  if (k.rows() == 0) return z;
  Matrix<T> score(k.rows(), codebook.rows());
  score.noalias() = k * codebook.transpose();
  score.rowwise() -= (codebook.rowwise().squaredNorm() / T(2)).transpose();
  for (Index j = 0; j < k.rows(); ++j) {
    Index s = 0;
    T best = score(j, 0);
    for (Index c = 1; c < score.cols(); ++c)
      if (score(j, c) > best) {
        best = score(j, c);
        s = c;
      }
    z[j] = s;
  }
  return z;
}

template <class T>
T vq_scale(const vq::Options& opt, Index r) {
  return static_cast<T>(opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(r)));
}

template <class T>
void vq_check(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
              const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& codebook,
              const vq::Options& opt) {
  feature_attention_check_inputs<T>(fn, q, k, v, opt);
  require(codebook.rows() > 0 && codebook.cols() == q.cols(), fn, "codebook is ",
          shape_str(codebook), " but q is ", shape_str(q), ": it must be S x ", q.cols(),
          " with S >= 1");
  require(opt.scale >= 0 && std::isfinite(opt.scale) && std::isfinite(static_cast<T>(opt.scale)),
          fn, "options.scale is ", opt.scale, "; it must be >= 0 and finite (0: 1/sqrt(r))");
  if (opt.check_finite) require_finite(codebook, fn, "codebook");
}

}  // namespace detail

namespace vq {

/// The code of every key (SPEC 6.1): z_j = argmin_s |k_j - C_s|^2, ties to the lowest s.
/// k: M x r, codebook: S x r. Returns M indices in [0, S).
template <class T, detail::enable_if_supported<T> = 0>
Eigen::Matrix<Index, Eigen::Dynamic, 1> assign(const ConstMatrixArg<T>& k,
                                               const ConstMatrixArg<T>& codebook) {
  detail::require(codebook.rows() > 0 && codebook.cols() == k.cols(), "mixattn::vq::assign",
                  "codebook is ", detail::shape_str(codebook), " but k is ", detail::shape_str(k),
                  ": it must be S x ", k.cols(), " with S >= 1");
  return detail::vq_codes<T>(k, codebook);
}

}  // namespace vq

namespace detail {

/// vq_codes into z (M) with the scores and the halved code norms in `s`.
template <class T>
void vq_codes_into(const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& codebook, CodeVector& z,
                   LinearScratch<T>& s) {
  z.resize(k.rows());
  if (k.rows() == 0) return;
  s.score.resize(k.rows(), codebook.rows());
  product_into<T>(s.score, plain<T>(k), transposed<T>(codebook), T(1), false, s.gemm);
  s.norms = codebook.rowwise().squaredNorm() / T(2);
  s.score.rowwise() -= s.norms.transpose();
  for (Index j = 0; j < k.rows(); ++j) {
    Index c_best = 0;
    T best = s.score(j, 0);
    for (Index c = 1; c < s.score.cols(); ++c)
      if (s.score(j, c) > best) {
        best = s.score(j, c);
        c_best = c;
      }
    z[j] = c_best;
  }
}

/// Straight-through key gradient (SPEC 6.3): dk^_j = tau sum_i w_ij (g_i . v_j + h_i) q_i over
/// the queries that see key j, w_ij = phi_q(i, z_j). Per code s a state
/// T_s = sum_i phi_q(i, s) q_i [g_i | h_i]^T (r x (d_v + 1)) over the queries already passed,
/// read as dk^_j += T_{z_j} [v_j; 1]: bidirectionally over all queries at once; causally in
/// reverse chunks (the later chunks' state, plus the chunk's own lower triangle explicitly).
/// gh: N x (d_v + 1) = [g | h]; writes dk (M x r), with its states and buffers in `x`. The
/// scaled queries and
/// the chunk's triangle are views of buffers sized once for the largest chunk, so the partial
/// chunk does not resize them.
template <class T>
void vq_key_gradient_into(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& v,
                          const Matrix<T>& gh, const Matrix<T>& phi_q, const CodeVector& codes,
                          T tau, bool causal, Index chunk, Matrix<T>& dk, LinearScratch<T>& x) {
  const Index N = q.rows(), M = v.rows(), r = q.cols(), d_v = v.cols(), S = phi_q.cols();
  const Index rows = causal ? std::min(chunk, N) : N;
  dk.setZero(M, r);
  x.v1.resize(M, d_v + 1);
  x.v1.leftCols(d_v) = v;
  x.v1.col(d_v).setOnes();
  x.scaled.resize(rows, r);
  if (causal) x.block.resize(rows, rows);
  x.used.assign(static_cast<std::size_t>(S), 0);
  for (Index j = 0; j < M; ++j) x.used[static_cast<std::size_t>(codes[j])] = 1;
  x.states.resize(static_cast<std::size_t>(S));
  for (Index s = 0; s < S; ++s)
    if (x.used[static_cast<std::size_t>(s)])
      x.states[static_cast<std::size_t>(s)].setZero(r, d_v + 1);
  const auto absorb = [&](Index i0, Index c) {  // queries [i0, i0 + c) into every used T_s
    Eigen::Map<Matrix<T>> scaled(x.scaled.data(), c, r);
    for (Index s = 0; s < S; ++s) {
      if (!x.used[static_cast<std::size_t>(s)]) continue;
      scaled = q.middleRows(i0, c).array().colwise() * phi_q.col(s).segment(i0, c).array();
      product_into<T>(x.states[static_cast<std::size_t>(s)], transposed<T>(scaled),
                      plain<T>(gh.middleRows(i0, c)), T(1), true, x.gemm);
    }
  };
  const auto read = [&](Index j0, Index c) {  // keys [j0, j0 + c) from the states
    for (Index j = j0; j < j0 + c; ++j)
      dk.row(j).noalias() += x.v1.row(j) * x.states[static_cast<std::size_t>(codes[j])].transpose();
  };
  if (!causal) {
    absorb(0, N);
    read(0, M);
  } else {
    for (Index c0 = ((N - 1) / chunk) * chunk; N > 0 && c0 >= 0; c0 -= chunk) {
      const Index c = std::min(chunk, N - c0);
      read(c0, c);
      Eigen::Map<Matrix<T>> b(x.block.data(), c, c);
      b.noalias() = gh.middleRows(c0, c).leftCols(d_v) * v.middleRows(c0, c).transpose();
      b.colwise() += gh.col(d_v).segment(c0, c);
      for (Index i = 0; i < c; ++i)
        for (Index j = 0; j < c; ++j) b(i, j) *= j <= i ? phi_q(c0 + i, codes[c0 + j]) : T(0);
      dk.middleRows(c0, c).noalias() += b.transpose() * q.middleRows(c0, c);
      absorb(c0, c);
    }
  }
  dk *= tau;
}

/// forward_into's body (`fn` names the entry point in messages); the value-returning forward runs
/// it too.
template <class T>
void vq_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                     const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                     const ConstMatrixRef<T>& codebook, const vq::Options& opt,
                     vq::Saved<T>* saved) {
  detail::vq_check<T>(fn, q, k, v, codebook, opt);
  const T tau = detail::vq_scale<T>(opt, q.cols());
  vq::Saved<T>& rec = saved ? *saved : detail::thread_scratch<vq::Saved<T>>();
  linear::Saved<T>& a = rec.attn;
  a.valid = false;  // until this call has filled it
  a.scratch.w = codebook;
  detail::vq_codes_into<T>(k, codebook, rec.codes, a.scratch);
  detail::performer_features_into<T>(q, a.scratch.w, tau, true, a.phi_q, &rec.q_at, nullptr,
                                     nullptr, a.scratch);
  a.phi_k.setZero(k.rows(), codebook.rows());
  for (Index j = 0; j < k.rows(); ++j) a.phi_k(j, rec.codes[j]) = T(1);
  detail::feature_attention_forward<T>(fn, out, q, k, v, opt, a, saved != nullptr);
  rec.scale = opt.scale;
  if (saved) rec.codebook_fingerprint = detail::fingerprint(codebook);
}

/// backward_into's body (`fn` names the entry point in messages); the value-returning backward runs
/// it too.
template <class T>
void vq_backward_into(const char* fn, vq::Grad<T>& grad, const ConstMatrixRef<T>& q,
                      const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                      const ConstMatrixRef<T>& codebook, const ConstMatrixRef<T>& grad_out,
                      const vq::Saved<T>& saved, const vq::Options& opt) {
  detail::vq_check<T>(fn, q, k, v, codebook, opt);
  detail::feature_attention_check_backward<T>(fn, q, k, v, grad_out, saved.attn, opt,
                                              codebook.rows());
  detail::require(
      saved.scale == opt.scale && saved.q_at.size() == q.rows() && saved.codes.size() == k.rows(),
      fn, "saved was made with scale = ", saved.scale, " but options give scale = ", opt.scale);
  if (detail::fingerprint(codebook) != saved.codebook_fingerprint)
    detail::raise_other_data(fn, "saved", "codebook");
  const T tau = detail::vq_scale<T>(opt, q.cols());
  detail::LinearScratch<T>& x = grad.scratch;
  x.w = codebook;
  grad.codebook.setZero(codebook.rows(), codebook.cols());
  const linear::Saved<T>& a = saved.attn;
  const Index d_v = v.cols();
  detail::feature_attention_backward<T>(
      fn, q.cols(), k.rows(), v, grad_out, a, opt, grad.q, grad.k, grad.v, x, [&] {
        Matrix<T>& e = x.dphi_q;  // dPhi_Q, then E = dPhi_Q o Phi_Q
        detail::performer_feature_backward_into<T>(q, x.w, tau, a.phi_q, e, grad.q, x.e,
                                                   &saved.q_at, 0, 0, x.gemm);
        // dC through the query exponents tau (C_s - C_{s*_i}) . q_i
        detail::product_into<T>(grad.codebook, detail::transposed<T>(e), detail::plain<T>(q), tau,
                                false, x.gemm);
        for (Index i = 0; i < q.rows(); ++i)
          grad.codebook.row(saved.q_at[i]) -= (tau * x.e[i]) * q.row(i);
        x.gh.resize(q.rows(), d_v + 1);  // [g | h] of SPEC 4.3
        x.gh.leftCols(d_v) = grad_out;
        x.gh.col(d_v) = -grad_out.cwiseProduct(a.out).rowwise().sum();
        x.gh.array().colwise() /= a.den.array();
        detail::vq_key_gradient_into<T>(q, v, x.gh, a.phi_q, saved.codes, tau, opt.causal, a.chunk,
                                        grad.k, x);
      });
  if (opt.check_finite)
    detail::require_finite_result(grad.codebook, fn, "the gradient of the codebook",
                                  "q, k, v or grad_out is");
}

}  // namespace detail

namespace vq {

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, codebook, opt, saved); with a reused `out` and `saved` (or
/// none), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& codebook, const Options& opt,
                  Saved<T>* saved) {
  detail::vq_forward_into<T>("mixattn::vq::forward_into", out, q, k, v, codebook, opt, saved);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, codebook, grad_out, saved, opt), allocating nothing when
/// shapes (and the set of codes the keys use) repeat.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& codebook,
                   const ConstMatrixArg<T>& grad_out, const Saved<T>& saved, const Options& opt) {
  detail::vq_backward_into<T>("mixattn::vq::backward_into", grad, q, k, v, codebook, grad_out,
                              saved, opt);
}

/// VQ attention forward (SPEC 6.2). q: N x r, k: M x r, v: M x d_v, codebook: S x r, row-major
/// (M == N when causal; M == 0 only with N == 0). Returns N x d_v. If `saved` is given it
/// receives what backward needs. T is not deduced: write vq::forward<float>(...).
/// Throws std::invalid_argument for bad shapes or options; with check_finite, std::domain_error
/// for non-finite q, k, v or codebook, or for an output that overflowed T.
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& codebook,
                  const Options& opt = {}, Saved<T>* saved = nullptr) {
  Matrix<T> out;
  detail::vq_forward_into<T>("mixattn::vq::forward", out, q, k, v, codebook, opt, saved);
  return out;
}

/// VQ attention backward (SPEC 6.3): gradients of sum(grad_out . forward(q, k, v, codebook))
/// with respect to q (N x r), k (M x r, straight-through: the gradient of the quantised key),
/// v (M x d_v) and the codebook (S x r). grad_out: N x d_v; saved: filled by forward with the
/// same inputs and options. With check_finite, non-finite grad_out or overflowed gradients
/// throw std::domain_error.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& codebook, const ConstMatrixArg<T>& grad_out,
                 const Saved<T>& saved, const Options& opt = {}) {
  Grad<T> grad;
  {  // the working memory is this thread's: the returned gradient carries none
    const detail::LentScratch<decltype(grad.scratch)> lent(&grad.scratch);
    detail::vq_backward_into<T>("mixattn::vq::backward", grad, q, k, v, codebook, grad_out, saved,
                                opt);
  }
  return grad;
}

}  // namespace vq

#ifdef MIXATTN_TEMPLATE_INSTANCE
// core.hpp: compiling the operators once.
namespace vq {
#define MIXATTN_VQ_INSTANCES(T)                                                     \
  MIXATTN_TEMPLATE_INSTANCE Matrix<T> forward<T, 0>(                                \
      const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, \
      const ConstMatrixArg<T>&, const Options&, Saved<T>*);                         \
  MIXATTN_TEMPLATE_INSTANCE Grad<T> backward<T, 0>(                                 \
      const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, \
      const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, const Saved<T>&, const Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_VQ_INSTANCES)
#undef MIXATTN_VQ_INSTANCES
}  // namespace vq
// The workers behind every form (the _into forms and the layer call them directly).
namespace detail {
#define MIXATTN_VQ_WORKERS(T)                                                                     \
  MIXATTN_TEMPLATE_INSTANCE void vq_forward_into<T>(                                              \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,                \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const vq::Options&, vq::Saved<T>*);     \
  MIXATTN_TEMPLATE_INSTANCE void vq_backward_into<T>(                                             \
      const char*, vq::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,              \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,              \
      const vq::Saved<T>&, const vq::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_VQ_WORKERS)
#undef MIXATTN_VQ_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
