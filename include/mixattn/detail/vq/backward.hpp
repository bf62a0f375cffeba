// mixattn/detail/vq/backward.hpp — the body of VQ attention's backward (SPEC 6.3): linear
// attention's backward to the features, the queries' and the codebook's through the exponential
// features, and the keys' straight through the quantiser.
//
// Internal: part of mixattn/vq.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/exp_features.hpp"
#include "mixattn/detail/common/feature_attention.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/vq/codes.hpp"
#include "mixattn/detail/vq/forward.hpp"
#include "mixattn/vq_types.hpp"

#include <algorithm>
#include <cstddef>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

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

/// backward_into's body (`fn` names the entry point in messages); the value-returning backward runs
/// it too.
template <class T>
void vq_backward_into(const char* fn, vq::Grad<T>& grad, const ConstMatrixRef<T>& q,
                      const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                      const ConstMatrixRef<T>& codebook, const ConstMatrixRef<T>& grad_out,
                      const vq::Saved<T>& saved, const vq::Options& opt) {
  vq_check<T>(fn, q, k, v, codebook, opt);
  feature_attention_check_backward<T>(fn, q, k, v, grad_out, saved.attn, opt, codebook.rows());
  require(saved.scale == opt.scale, fn, "saved was made with scale = ", saved.scale,
          " but options give scale = ", opt.scale);
  require(saved.q_at.size() == q.rows() && saved.codes.size() == k.rows(), fn, "saved holds ",
          saved.q_at.size(), " query positions and ", saved.codes.size(), " key codes but q has ",
          q.rows(), " rows and k ", k.rows());
  if (fingerprint(codebook) != saved.codebook_fingerprint)
    raise_other_data(fn, "saved", "codebook");
  const T tau = vq_scale<T>(opt, q.cols());
  LinearScratch<T>& x = grad.scratch;
  x.w = codebook;
  grad.codebook.setZero(codebook.rows(), codebook.cols());
  const linear::Saved<T>& a = saved.attn;
  const Index d_v = v.cols();
  feature_attention_backward<T>(
      fn, q.cols(), k.rows(), v, grad_out, a, opt, grad.q, grad.k, grad.v, x, [&] {
        Matrix<T>& e = x.dphi_q;  // dPhi_Q, then E = dPhi_Q o Phi_Q
        exp_feature_backward_into<T>(q, x.w, tau, a.phi_q, e, grad.q, x.e, &saved.q_at, 0, 0,
                                     x.gemm);
        // dC through the query exponents tau (C_s - C_{s*_i}) . q_i
        product_into<T>(grad.codebook, transposed<T>(e), plain<T>(q), tau, false, x.gemm);
        for (Index i = 0; i < q.rows(); ++i)
          grad.codebook.row(saved.q_at[i]) -= (tau * x.e[i]) * q.row(i);
        x.gh.resize(q.rows(), d_v + 1);  // [g | h] of SPEC 4.3
        x.gh.leftCols(d_v) = grad_out;
        x.gh.col(d_v) = -grad_out.cwiseProduct(a.out).rowwise().sum();
        x.gh.array().colwise() /= a.den.array();
        vq_key_gradient_into<T>(q, v, x.gh, a.phi_q, saved.codes, tau, opt.causal, a.chunk, grad.k,
                                x);
      });
  if (opt.check_finite)
    require_finite_result(grad.codebook, fn, "the gradient of the codebook",
                          "q, k, v or grad_out is");
}

}  // namespace detail
MIXATTN_END_NAMESPACE
