// mixattn/detail/linformer/backward.hpp — Linformer's backward (SPEC.md §11.2): through the
// softmax attention over the projected keys a block of rows at a time, then through the
// projections, and the body behind the entry points, linformer_backward_into.
//
// Internal: included by mixattn/linformer.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/detail/common/softmax.hpp"
#include "mixattn/detail/linformer/checks.hpp"
#include "mixattn/detail/linformer/forward.hpp"
#include "mixattn/linformer_types.hpp"

#include <Eigen/Core>

#include <algorithm>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// The attention's backward, a block of rows at a time (the block's dS stays in cache):
///   dV'^T = dO^T P,  dP = dO V'^T,  dS = P o (dP - rowsum(dP o P)),
///   dq = scale dS K',  dK'^T = scale q^T dS,
/// dq into grad.q, dK'^T and dV'^T into the scratch (summed over the blocks): transposed, so that
/// the projections' backward has them as plain left operands.
template <class T>
void linformer_backward_attention(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& grad_out,
                                  const linformer::Saved<T>& saved, T scale,
                                  linformer::Grad<T>& grad) {
  LinformerScratch<T>& s = grad.scratch;
  GemmSpace<T>& g = s.gemm;
  const Index N = q.rows(), kp = saved.kp.rows();
  s.dkpt.resize(q.cols(), kp);
  s.dvpt.resize(grad_out.cols(), kp);
  if (N == 0) {
    s.dkpt.setZero();
    s.dvpt.setZero();
  }
  s.ds.resize(std::min(linformer_block_rows, N), kp);
  for (Index i0 = 0; i0 < N; i0 += linformer_block_rows) {
    const Index n = std::min(linformer_block_rows, N - i0);
    const bool acc = i0 > 0;
    const ConstMatrixRef<T> p = saved.probs.middleRows(i0, n);
    const ConstMatrixRef<T> dout = grad_out.middleRows(i0, n);
    MatrixRef<T> ds = s.ds.topRows(n);
    product_into<T>(s.dvpt, transposed<T>(dout), plain<T>(p), T(1), acc, g);
    product_into<T>(ds, plain<T>(dout), transposed<T>(saved.vp), T(1), false, g);
    for (Index i = 0; i < n; ++i)
      softmax_backward_row(simd_arch{}, p.row(i).data(), ds.row(i).data(), kp);
    product_into<T>(grad.q.middleRows(i0, n), plain<T>(ds), plain<T>(saved.kp), scale, false, g);
    product_into<T>(s.dkpt, transposed<T>(q.middleRows(i0, n)), plain<T>(ds), scale, acc, g);
  }
}

/// dx = P^T dX' (N x c) from dX'^T (c x k_proj), a block of positions at a time: the block of
/// dx^T = dX'^T P[:, block] (P: E or F, read untransposed), then transposed into place. Eigen
/// packs a transposed left operand (P^T) element by element, strided: as P^T dX' the product ran
/// at 63 GFLOP/s, in these blocks at 73 (float, N = 4096, k_proj = 256, d = 64, AVX-512).
template <class T>
void linformer_position_grad(const ConstMatrixRef<T>& proj, const Matrix<T>& dxpt, Matrix<T>& dx,
                             LinformerScratch<T>& s) {
  const Index N = proj.cols();
  s.xt.resize(dxpt.rows(), std::min(linformer_block_rows, N));
  for (Index t0 = 0; t0 < N; t0 += linformer_block_rows) {
    const Index n = std::min(linformer_block_rows, N - t0);
    MatrixRef<T> xt = s.xt.leftCols(n);
    product_into<T>(xt, plain<T>(dxpt), plain<T>(proj.middleCols(t0, n)), T(1), false, s.gemm);
    dx.middleRows(t0, n) = xt.transpose();
  }
}

/// Through the projections: dE = dK' k^T, dk = E^T dK', dF = dV' v^T, dv = F^T dV' (dK', dV'
/// held transposed).
template <class T>
void linformer_backward_projections(const LinformerInputs<T>& in, linformer::Grad<T>& grad) {
  LinformerScratch<T>& s = grad.scratch;
  product_into<T>(grad.E, transposed<T>(s.dkpt), transposed<T>(in.k), T(1), false, s.gemm);
  product_into<T>(grad.F, transposed<T>(s.dvpt), transposed<T>(in.v), T(1), false, s.gemm);
  linformer_position_grad<T>(in.E, s.dkpt, grad.k, s);
  linformer_position_grad<T>(in.F, s.dvpt, grad.v, s);
}

/// backward's body (SPEC 11.2; `fn` names the entry point in messages): validation once (the
/// record against the inputs), then the attention's backward and the projections'.
template <class T>
void linformer_backward_into(const char* fn, linformer::Grad<T>& grad, const ConstMatrixRef<T>& q,
                             const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                             const ConstMatrixRef<T>& E, const ConstMatrixRef<T>& F,
                             const ConstMatrixRef<T>& grad_out, const linformer::Saved<T>& saved,
                             const linformer::Options& opt) {
  const LinformerInputs<T> in{q, k, v, E, F};
  linformer_check_backward<T>(fn, in, grad_out, saved, opt);
  const Index N = q.rows();
  grad.q.resize(N, q.cols());
  grad.k.resize(N, k.cols());
  grad.v.resize(N, v.cols());
  grad.E.resize(E.rows(), N);
  grad.F.resize(F.rows(), N);
  linformer_backward_attention<T>(q, grad_out, saved, static_cast<T>(saved.scale), grad);
  linformer_backward_projections<T>(in, grad);
  if (!opt.check_finite) return;
  const char* culprit = "q, k, v, E, F or grad_out is";
  require_finite_result(grad.q, fn, "the gradient of q", culprit);
  require_finite_result(grad.k, fn, "the gradient of k", culprit);
  require_finite_result(grad.v, fn, "the gradient of v", culprit);
  require_finite_result(grad.E, fn, "the gradient of E", culprit);
  require_finite_result(grad.F, fn, "the gradient of F", culprit);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
