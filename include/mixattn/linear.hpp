// mixattn/linear.hpp — linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"),
// the baseline of SPEC.md section 4, forward and backward, bidirectional and causal.
//
// With the feature map phi(x) = elu(x) + 1 applied to each entry of q and k:
//   bidirectional  O_i = (phi(q_i)^T sum_j phi(k_j) v_j^T) / (phi(q_i) . sum_j phi(k_j) + eps)
//   causal         the same with the sums over j <= i, chunk-wise
// Causal GMA is this operator with the responsibilities gamma as features: both run the one
// causal scan of detail/gma_scan.hpp. Cost O((N + M) r d_v); nothing N x M is formed.
//
// Thread safety: every function is reentrant and distinct calls may run concurrently. A forward
// without `saved` (forward, or forward_into with nullptr) works in this thread's own scratch
// record, which stays allocated for the thread's lifetime. GEMMs use the threads Eigen is
// configured with.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/checks.hpp"
#include "mixattn/detail/fingerprint.hpp"
#include "mixattn/detail/gemm.hpp"
#include "mixattn/detail/gma_scan.hpp"
#include "mixattn/detail/refuse.hpp"
#include "mixattn/detail/value_form_scratch.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/linear_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// phi(x) = elu(x) + 1 = max(x, 0) + exp(min(x, 0)) entrywise: x + 1 for x > 0, e^x otherwise.
/// e^x is evaluated directly (not as expm1(x) + 1, which is 0 in float below x = -17), so phi
/// stays positive down to T's underflow, and no e^x of a large positive x is ever formed.
template <class T>
void linear_features(const ConstMatrixRef<T>& x, Matrix<T>& phi) {
  phi.resize(x.rows(), x.cols());
  phi.array() = x.array().max(T(0)) + x.array().min(T(0)).exp();
}

/// dL/dx = dL/dphi * phi'(x), with phi'(x) = 1 for x > 0 and e^x = phi(x) otherwise, i.e.
/// phi'(x) = min(phi(x), 1) (phi(x) > 1 exactly when x > 0). Scales dphi in place.
template <class T>
void linear_feature_backward(const Matrix<T>& phi, Matrix<T>& dphi) {
  dphi.array() *= phi.array().min(T(1));
}

inline Index linear_chunk(const linear::Options& opt) {
  return opt.chunk > 0 ? opt.chunk : gma_default_chunk;
}

template <class T>
void linear_check_inputs(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                         const ConstMatrixRef<T>& v, const linear::Options& opt) {
  check_qkv_shapes<T>(fn, q, k, v);
  // The rest (causal shapes, eps, chunk, finite values) is checked as for GMA, whose options
  // these mirror; r = q.cols() plays the mixture's dimension.
  gma::Options g;
  g.causal = opt.causal;
  g.eps = opt.eps;
  g.check_finite = opt.check_finite;
  g.chunk = opt.chunk;
  gma_check_qkv<T>(fn, q.cols(), q, k, v, g);
}

template <class T>
void linear_fingerprints(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                         const ConstMatrixRef<T>& v, std::uint64_t* out) {
  out[0] = fingerprint(q);
  out[1] = fingerprint(k);
  out[2] = fingerprint(v);
}

template <class T>
void linear_check_backward(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                           const ConstMatrixRef<T>& v, const ConstMatrixRef<T>& grad_out,
                           const linear::Saved<T>& saved, const linear::Options& opt,
                           Index features) {
  linear_check_inputs<T>(fn, q, k, v, opt);
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
  require(saved.causal == opt.causal && saved.eps == opt.eps && saved.chunk == linear_chunk(opt),
          fn, "saved was made with causal = ", saved.causal, ", eps = ", saved.eps,
          ", chunk = ", saved.chunk, " but options give causal = ", opt.causal, ", eps = ", opt.eps,
          ", chunk = ", linear_chunk(opt));
  std::uint64_t now[3];
  linear_fingerprints<T>(q, k, v, now);
  check_record(fn, "saved",
               {{saved.fingerprint[0], now[0], "q"},
                {saved.fingerprint[1], now[1], "k"},
                {saved.fingerprint[2], now[2], "v"}});
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// The bodies. Every result and working buffer lives in caller-owned records (LinearScratch in
// Saved and Grad), so that a training loop whose shapes repeat allocates nothing; the
// value-returning forms above run the same bodies. Performer and VQ attention build theirs on
// these.
// ---------------------------------------------------------------------------------------------

namespace detail {

/// The read-out of SPEC 4.2 given feature matrices (phi_q: N x F, phi_k: M x F, non-negative;
/// elu + 1 here, Performer's random features in performer.hpp): writes out (N x d_v, sized by
/// the caller), den (N) and, bidirectionally, kv = Phi_K^T V and ksum = Phi_K^T 1; the products'
/// buffers and the causal scan's state are in `s`.
template <class T>
void linear_attend_into(const Matrix<T>& phi_q, const Matrix<T>& phi_k, const ConstMatrixRef<T>& v,
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
  gma_causal_forward<T>(phi_q, phi_k, v, static_cast<T>(opt.eps), linear_chunk(opt), out, den, s.S,
                        s.z, s.scan);
}

/// The forward from feature matrices (SPEC 4.2 read-out, overflow check, the record for
/// backward) into `out` and the record `rec`, whose phi_q and phi_k already hold the features;
/// with keep = false only the read-out is kept valid (a thread's scratch record). q, k, v: only
/// fingerprinted.
template <class T>
void linear_forward_record(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                           const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                           const linear::Options& opt, linear::Saved<T>& rec, bool keep) {
  out.resize(q.rows(), v.cols());
  linear_attend_into<T>(rec.phi_q, rec.phi_k, v, opt, out, rec.den, rec.kv, rec.ksum, rec.scratch);
  if (opt.check_finite) require_finite_result(out, fn, "the output", "q, k or v is");
  if (!keep) return;
  rec.out = out;
  rec.causal = opt.causal;
  rec.eps = opt.eps;
  rec.chunk = linear_chunk(opt);
  linear_fingerprints<T>(q, k, v, rec.fingerprint);
  rec.valid = true;
}

/// This thread's record for a forward_into without `saved` (kept for the thread's lifetime).
template <class Saved>
Saved& linear_thread_record() {
  thread_local Saved rec;
  return rec;
}

/// The backward around a feature map (SPEC 4.3): dPhi_Q and dPhi_K into s.dphi_q and s.dphi_k
/// and dV into dv, then feature_backward() (which writes dQ, dK from them), then the
/// overflow checks of dq, dk and dv. With [g | h] (g_i = dO_i / den_i, h_i = -(dO_i . O_i) /
/// den_i): causally the scan shared with GMA (SPEC 1.5) from a zero start state; bidirectionally,
/// with [KV | z] the saved Phi_K^T V and Phi_K^T 1,
///   dPhi_Q = [g | h] [KV | z]^T,  [dKV | dz] = Phi_Q^T [g | h],
///   dPhi_K = V dKV^T + 1 dz^T,    dV = Phi_K dKV.
template <class T, class FeatureBackward>
void linear_backward_features_into(const char* fn, Index r, Index M, const ConstMatrixRef<T>& v,
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
  if (opt.causal) {  // linear_backward_causal
    s.g = grad_out;
    s.g.array().colwise() *= s.inv_den.array();
    s.h = -(grad_out.cwiseProduct(saved.out).rowwise().sum().array() * s.inv_den.array()).matrix();
    s.dphi_q.resize(N, F);
    s.dphi_k.resize(N, F);
    s.S.setZero(F, d_v);
    s.z.setZero(F);
    gma_causal_backward<T>(saved.phi_q, saved.phi_k, v, s.g, s.h, saved.chunk, s.dphi_q, s.dphi_k,
                           dv, nullptr, nullptr, s.S, s.z, s.scan);
  } else {  // linear_backward_bidirectional
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

/// forward_into's body (`fn` names the entry point in messages); the value-returning forward runs
/// it too.
template <class T>
void linear_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                         const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                         const linear::Options& opt, linear::Saved<T>* saved) {
  detail::linear_check_inputs<T>(fn, q, k, v, opt);
  linear::Saved<T>& rec = saved ? *saved : detail::linear_thread_record<linear::Saved<T>>();
  rec.valid = false;  // until this call has filled it
  detail::linear_features<T>(q, rec.phi_q);
  detail::linear_features<T>(k, rec.phi_k);
  detail::linear_forward_record<T>(fn, out, q, k, v, opt, rec, saved != nullptr);
}

/// backward_into's body (`fn` names the entry point in messages); the value-returning backward runs
/// it too.
template <class T>
void linear_backward_into(const char* fn, linear::Grad<T>& grad, const ConstMatrixRef<T>& q,
                          const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                          const ConstMatrixRef<T>& grad_out, const linear::Saved<T>& saved,
                          const linear::Options& opt) {
  detail::linear_check_backward<T>(fn, q, k, v, grad_out, saved, opt, q.cols());
  detail::LinearScratch<T>& s = grad.scratch;
  detail::linear_backward_features_into<T>(
      fn, q.cols(), k.rows(), v, grad_out, saved, opt, grad.q, grad.k, grad.v, s, [&] {
        grad.q = s.dphi_q;
        grad.k = s.dphi_k;
        detail::linear_feature_backward<T>(saved.phi_q, grad.q);
        detail::linear_feature_backward<T>(saved.phi_k, grad.k);
      });
}

}  // namespace detail

namespace linear {

/// forward into a caller-owned `out` (resized to N x d_v) and record: the result of
/// forward(q, k, v, opt, saved). With a reused `out` and `saved` (or none: this
/// thread's scratch record), a call whose shapes repeat performs no heap allocation.
template <class T, detail::enable_if_supported<T> = 0>
void forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt, Saved<T>* saved) {
  detail::linear_forward_into<T>("mixattn::linear::forward_into", out, q, k, v, opt, saved);
}

/// backward into caller-owned gradients (resized; scratch kept in `grad`): the result of
/// backward(q, k, v, grad_out, saved, opt), allocating nothing when shapes repeat.
template <class T, detail::enable_if_supported<T> = 0>
void backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                   const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                   const Saved<T>& saved, const Options& opt) {
  detail::linear_backward_into<T>("mixattn::linear::backward_into", grad, q, k, v, grad_out, saved,
                                  opt);
}

/// Linear attention forward (SPEC 4.2). q: N x r, k: M x r, v: M x d_v, row-major (M == N when
/// causal; M == 0 only with N == 0). Returns N x d_v. If `saved` is given it receives what
/// backward needs. T is not deduced: write linear::forward<float>(q, k, v).
/// Throws std::invalid_argument for bad shapes or options; with check_finite, std::domain_error
/// for non-finite q, k, v, or for an output that overflowed T (q, k, v near T's range).
template <class T, detail::enable_if_supported<T> = 0>
Matrix<T> forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                  const ConstMatrixArg<T>& v, const Options& opt = {}, Saved<T>* saved = nullptr) {
  Matrix<T> out;
  detail::linear_forward_into<T>("mixattn::linear::forward", out, q, k, v, opt, saved);
  return out;
}

/// Linear attention backward (SPEC 4.3): gradients of sum(grad_out . forward(q, k, v)) with
/// respect to q (N x r), k (M x r) and v (M x d_v). grad_out: N x d_v; saved: filled by forward
/// with the same q, k, v and options. With check_finite, non-finite grad_out or overflowed
/// gradients throw std::domain_error.
template <class T, detail::enable_if_supported<T> = 0>
Grad<T> backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v,
                 const ConstMatrixArg<T>& grad_out, const Saved<T>& saved,
                 const Options& opt = {}) {
  Grad<T> grad;
  {  // the working memory is this thread's: the returned gradient carries none
    const detail::LentScratch<decltype(grad.scratch)> lent(&grad.scratch);
    detail::linear_backward_into<T>("mixattn::linear::backward", grad, q, k, v, grad_out, saved, opt);
  }
  return grad;
}

}  // namespace linear

#ifdef MIXATTN_TEMPLATE_INSTANCE
// core.hpp: compiling the operators once.
namespace linear {
#define MIXATTN_LINEAR_INSTANCES(T)                                                 \
  MIXATTN_TEMPLATE_INSTANCE Matrix<T> forward<T, 0>(                                \
      const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, \
      const Options&, Saved<T>*);                                                   \
  MIXATTN_TEMPLATE_INSTANCE Grad<T> backward<T, 0>(                                 \
      const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, const ConstMatrixArg<T>&, \
      const ConstMatrixArg<T>&, const Saved<T>&, const Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_LINEAR_INSTANCES)
#undef MIXATTN_LINEAR_INSTANCES
}  // namespace linear
// The workers behind every form (the _into forms and the layer call them directly).
namespace detail {
#define MIXATTN_LINEAR_WORKERS(T)                                                                 \
  MIXATTN_TEMPLATE_INSTANCE void linear_forward_into<T>(                                          \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,                \
      const ConstMatrixRef<T>&, const linear::Options&, linear::Saved<T>*);                       \
  MIXATTN_TEMPLATE_INSTANCE void linear_backward_into<T>(                                         \
      const char*, linear::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,          \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const linear::Saved<T>&,                \
      const linear::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_LINEAR_WORKERS)
#undef MIXATTN_LINEAR_WORKERS
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
