// mixattn/detail/reference/backward.hpp — the bodies of softmax attention's backwards (SPEC §3,
// §7): from the naive form's saved probabilities, and the tiled form's recomputation from the
// saved log-sum-exps.
//
// Internal: part of mixattn/reference.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/softmax.hpp"
#include "mixattn/detail/reference/checks.hpp"
#include "mixattn/detail/reference/flash.hpp"
#include "mixattn/reference_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// naive_backward_into's body.
template <class T>
void naive_backward_into(const char* fn, reference::Grad<T>& g, const ConstMatrixRef<T>& q,
                         const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                         const ConstMatrixRef<T>& grad_out, const reference::Saved<T>& saved,
                         const reference::Options& opt) {
  const double scale = reference_check_backward<T>(
      fn, q, k, v, grad_out, saved, opt, reference::Saved<T>::Source::naive, "naive_forward");
  const Matrix<T>& p = saved.probs;
  require(p.rows() == q.rows() && p.cols() == k.rows(), fn, "saved.probs is ", shape_str(p),
          " but should be ", q.rows(), " x ", k.rows());
  g.v.resize(k.rows(), v.cols());
  gemm<T>(g.v, transposed<T>(p), plain<T>(grad_out), T(1), false, g.scratch.gemm);
  Matrix<T>& ds = g.scratch.s;
  ds.resize(q.rows(), k.rows());
  gemm<T>(ds, plain<T>(grad_out), transposed<T>(v), T(1), false, g.scratch.gemm);
  for (Index i = 0; i < ds.rows(); ++i)
    softmax_backward_row(simd_arch{}, p.row(i).data(), ds.row(i).data(), ds.cols());
  g.q.resize(q.rows(), q.cols());
  gemm<T>(g.q, plain<T>(ds), plain<T>(k), T(1), false, g.scratch.gemm);
  g.q *= static_cast<T>(scale);
  // dK = dS^T (scale Q), associated as flash_backward does (scaling the product afterwards would
  // let dS^T Q underflow first when q is tiny and the scale large).
  Matrix<T>& qs = g.scratch.qs;
  qs = static_cast<T>(scale) * q;
  g.k.resize(k.rows(), k.cols());
  gemm<T>(g.k, transposed<T>(ds), plain<T>(qs), T(1), false, g.scratch.gemm);
  reference_check_grad(fn, g, opt);
}

/// flash_backward_into's body.
template <class T>
void flash_backward_into(const char* fn, reference::Grad<T>& g, const ConstMatrixRef<T>& q,
                         const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                         const ConstMatrixRef<T>& grad_out, const reference::Saved<T>& saved,
                         const reference::Options& opt) {
  const double scale = reference_check_backward<T>(
      fn, q, k, v, grad_out, saved, opt, reference::Saved<T>::Source::flash, "flash_forward");
  require(
      saved.out.rows() == q.rows() && saved.out.cols() == v.cols() && saved.lse.size() == q.rows(),
      fn, "saved.out is ", shape_str(saved.out), " and saved.lse has ", saved.lse.size(),
      " entries but q has ", q.rows(), " rows and v has ", v.cols(), " columns");
  using Tiles = FlashTiles<T>;
  g.q.resize(q.rows(), q.cols());
  g.k.resize(k.rows(), k.cols());
  g.v.resize(v.rows(), v.cols());
  flash_backward_tiles<T, Tiles::backward_queries, Tiles::backward_keys>(
      q, k, v, saved.out, grad_out, saved.lse, static_cast<T>(scale), opt.causal, g.q, g.k, g.v,
      g.scratch, opt.window);
  reference_check_grad(fn, g, opt);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
