// mixattn/detail/common/feature_attention.hpp — linear attention over given feature maps (SPEC 4.2,
// 4.3): the read-out, the record it keeps, its checks, and the backward to the features. Linear
// attention (elu + 1), Performer (random features) and VQ attention (code features) are this
// with their own features, kept in linear attention's record (mixattn/linear_types.hpp).
//
// Internal.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/causal_scan.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/linear_types.hpp"

#include <Eigen/Core>

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// The q, k, v shapes and the options (causal shapes, eps, chunk; the values with check_finite).
template <class T>
void feature_attention_check_inputs(const char* fn, const ConstMatrixRef<T>& q,
                                    const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                                    const linear::Options& opt) {
  check_qkv_shapes<T>(fn, q, k, v);
  check_scan_options<T>(fn, q.rows(), k.rows(), opt.causal, opt.eps, opt.chunk);
  if (opt.check_finite) require_finite_qkv<T>(fn, q, k, v);
}

/// A backward's inputs and record: grad_out's shape and values, the record's shapes (`features`
/// per row) and options, and the fingerprints of the data it was filled from.
template <class T>
void feature_attention_check_backward(const char* fn, const ConstMatrixRef<T>& q,
                                      const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                                      const ConstMatrixRef<T>& grad_out,
                                      const linear::Saved<T>& saved, const linear::Options& opt,
                                      Index features) {
  feature_attention_check_inputs<T>(fn, q, k, v, opt);
  const Index N = q.rows(), M = k.rows(), r = features, d_v = v.cols();
  require(grad_out.rows() == N && grad_out.cols() == d_v, fn, "grad_out is ", shape_str(grad_out),
          " but the output is ", N, " x ", d_v, " (q rows x v columns)");
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.valid, fn, "saved was not filled by forward");
  require(saved.phi_q.rows() == N && saved.phi_q.cols() == r && saved.phi_k.rows() == M &&
              saved.phi_k.cols() == r && saved.den.size() == N && saved.out.rows() == N &&
              saved.out.cols() == d_v,
          fn, "saved is for N = ", saved.phi_q.rows(), ", M = ", saved.phi_k.rows(),
          ", features = ", saved.phi_q.cols(), ", d_v = ", saved.out.cols(),
          " but the inputs have N = ", N, ", M = ", M, ", features = ", r, ", d_v = ", d_v);
  require(saved.causal == opt.causal && saved.eps == opt.eps &&
              saved.chunk == resolved_chunk(opt.chunk),
          fn, "saved was made with causal = ", saved.causal, ", eps = ", saved.eps,
          ", chunk = ", saved.chunk, " but options give causal = ", opt.causal, ", eps = ", opt.eps,
          ", chunk = ", resolved_chunk(opt.chunk));
  std::uint64_t now[3];
  qkv_fingerprints<T>(q, k, v, now);
  check_record(fn, "saved",
               {{saved.fingerprint[0], now[0], "q"},
                {saved.fingerprint[1], now[1], "k"},
                {saved.fingerprint[2], now[2], "v"}});
}

/// The read-out of SPEC 4.2 given feature matrices (phi_q: N x F, phi_k: M x F, non-negative):
/// writes out (N x d_v, sized by the caller), den (N) and, bidirectionally, kv = Phi_K^T V and
/// ksum = Phi_K^T 1; the products' buffers and the causal scan's state are in `s`.
template <class T>
void feature_attend_into(const Matrix<T>& phi_q, const Matrix<T>& phi_k, const ConstMatrixRef<T>& v,
                         const linear::Options& opt, Matrix<T>& out, Vector<T>& den, Matrix<T>& kv,
                         Vector<T>& ksum, LinearScratch<T>& s) {
  den.resize(phi_q.rows());
  if (!opt.causal) {  // KV = Phi_K^T V, z = Phi_K^T 1; numerators by GEMM, denominators by GEMV
    const Index r = phi_q.cols(), d_v = v.cols();
    kv.resize(r, d_v);
    product_into<T>(kv, transposed<T>(phi_k), plain<T>(v), T(1), false, s.gemm);
    ksum.setZero(r);
    if (phi_k.rows() > 0) ksum = phi_k.colwise().sum().transpose();  // (no columns of empty data)
    product_into<T>(out, plain<T>(phi_q), plain<T>(kv), T(1), false, s.gemm);
    den.noalias() = phi_q * ksum;
    den.array() += static_cast<T>(opt.eps);
    out.array().colwise() /= den.array();
    return;
  }
  s.S.setZero(phi_q.cols(), v.cols());
  s.z.setZero(phi_q.cols());
  causal_scan_forward<T>(phi_q, phi_k, v, static_cast<T>(opt.eps), resolved_chunk(opt.chunk), out,
                         den, s.S, s.z, s.scan);
}

/// The forward from feature matrices (SPEC 4.2 read-out, overflow check, the record for
/// backward) into `out` and the record `rec`, whose phi_q and phi_k already hold the features;
/// with keep = false only the read-out is kept valid (a thread's scratch record). q, k, v: only
/// fingerprinted.
template <class T>
void feature_attention_forward(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                               const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                               const linear::Options& opt, linear::Saved<T>& rec, bool keep) {
  out.resize(q.rows(), v.cols());
  feature_attend_into<T>(rec.phi_q, rec.phi_k, v, opt, out, rec.den, rec.kv, rec.ksum, rec.scratch);
  if (opt.check_finite) require_finite_result(out, fn, "the output", "q, k or v is");
  if (!keep) return;
  rec.out = out;
  rec.causal = opt.causal;
  rec.eps = opt.eps;
  rec.chunk = resolved_chunk(opt.chunk);
  qkv_fingerprints<T>(q, k, v, rec.fingerprint);
  rec.valid = true;
}

/// The backward around a feature map (SPEC 4.3): dPhi_Q and dPhi_K into s.dphi_q and s.dphi_k
/// and dV into dv, then feature_backward() (which writes dQ, dK from them), then the
/// overflow checks of dq, dk and dv. With [g | h] (g_i = dO_i / den_i, h_i = -(dO_i . O_i) /
/// den_i): causally the scan shared with GMA (SPEC 1.5) from a zero start state; bidirectionally,
/// with [KV | z] the saved Phi_K^T V and Phi_K^T 1,
///   dPhi_Q = [g | h] [KV | z]^T,  [dKV | dz] = Phi_Q^T [g | h],
///   dPhi_K = V dKV^T + 1 dz^T,    dV = Phi_K dKV.
template <class T, class FeatureBackward>
void feature_attention_backward(const char* fn, Index r, Index M, const ConstMatrixRef<T>& v,
                                const ConstMatrixRef<T>& grad_out, const linear::Saved<T>& saved,
                                const linear::Options& opt, Matrix<T>& dq, Matrix<T>& dk,
                                Matrix<T>& dv, LinearScratch<T>& s,
                                FeatureBackward&& feature_backward) {
  const Index N = saved.phi_q.rows(), F = saved.phi_q.cols(), d_v = v.cols();
  if (N == 0) {  // no query reads anything (and an empty matrix has no columns)
    dq.resize(0, r);
    dk.setZero(M, r);
    dv.setZero(M, d_v);
    return;
  }
  dv.resize(M, d_v);
  s.inv_den = saved.den.cwiseInverse();
  if (opt.causal) {
    s.g = grad_out;
    s.g.array().colwise() *= s.inv_den.array();
    s.h = -(grad_out.cwiseProduct(saved.out).rowwise().sum().array() * s.inv_den.array()).matrix();
    s.dphi_q.resize(N, F);
    s.dphi_k.resize(N, F);
    s.S.setZero(F, d_v);
    s.z.setZero(F);
    causal_scan_backward<T>(saved.phi_q, saved.phi_k, v, s.g, s.h, saved.chunk, s.dphi_q, s.dphi_k,
                            dv, nullptr, nullptr, s.S, s.z, s.scan);
  } else {
    s.gh.resize(N, d_v + 1);
    s.gh.leftCols(d_v) = grad_out;
    s.gh.leftCols(d_v).array().colwise() *= s.inv_den.array();
    s.gh.col(d_v) =
        -(grad_out.cwiseProduct(saved.out).rowwise().sum().array() * s.inv_den.array()).matrix();
    s.kvz.resize(F, d_v + 1);
    s.kvz.leftCols(d_v) = saved.kv;
    s.kvz.col(d_v) = saved.ksum;
    s.dphi_q.resize(N, F);
    product_into<T>(s.dphi_q, plain<T>(s.gh), transposed<T>(s.kvz), T(1), false, s.gemm);
    s.dkvz.resize(F, d_v + 1);
    product_into<T>(s.dkvz, transposed<T>(saved.phi_q), plain<T>(s.gh), T(1), false, s.gemm);
    s.dphi_k.resize(M, F);
    const ConstMatrixRef<T> dkv = s.dkvz.leftCols(d_v);
    product_into<T>(s.dphi_k, plain<T>(v), transposed<T>(dkv), T(1), false, s.gemm);
    s.dphi_k.rowwise() += s.dkvz.col(d_v).transpose();
    product_into<T>(dv, plain<T>(saved.phi_k), plain<T>(dkv), T(1), false, s.gemm);
  }
  feature_backward();
  if (opt.check_finite) {  // overflow: q, k, v or grad_out near T's range, or a tiny eps
    const char* culprit = "q, k, v or grad_out is";
    require_finite_result(dq, fn, "the gradient of q", culprit);
    require_finite_result(dk, fn, "the gradient of k", culprit);
    require_finite_result(dv, fn, "the gradient of v", culprit);
  }
}

}  // namespace detail
MIXATTN_END_NAMESPACE
