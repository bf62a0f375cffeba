// mixattn/detail/common/gemm.hpp — matrix products whose packing buffers are owned by the caller.
//
// Eigen's GEMM packs panels of both operands into buffers of kc x mc and kc x nc scalars, sized
// from the cache sizes. Below EIGEN_STACK_ALLOCATION_LIMIT (128 KiB) they live on the stack;
// above it, every product mallocs and frees them (measured: a 4096 x 64 by 64 x 64 float product
// packs 132 KiB, one allocation per call; 1024 x 256 by 256 x 256, two). A loop that repeats
// the same products would page-fault fresh memory on every call. GemmSpace keeps the buffers
// and grows them only when a larger product comes, so products of repeated shapes allocate
// nothing; the arithmetic is Eigen's own kernel, with the blocking Eigen itself would choose.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"

#include <Eigen/Core>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// One operand of gemm(): a row-major block (rows x cols, row stride `stride`) or the transpose
/// of one (then `row_major` is false and the storage is column-major with that stride).
template <class T>
struct GemmOperand {
  const T* data;
  Index rows, cols, stride;
  bool row_major;
};

template <class T>
GemmOperand<T> plain(const ConstMatrixRef<T>& m) {
  return {m.data(), m.rows(), m.cols(), m.outerStride(), true};
}
template <class T>
GemmOperand<T> transposed(const ConstMatrixRef<T>& m) {
  return {m.data(), m.cols(), m.rows(), m.outerStride(), false};
}

template <class T, int LhsOrder, int RhsOrder>
void gemm_run(MatrixRef<T>& dst, const GemmOperand<T>& a, const GemmOperand<T>& b, T alpha,
              GemmSpace<T>& space) {
  Eigen::internal::general_matrix_matrix_product<Index, T, LhsOrder, false, T, RhsOrder, false,
                                                 Eigen::RowMajor, 1>::run(dst.rows(), dst.cols(),
                                                                          a.cols, a.data, a.stride,
                                                                          b.data, b.stride,
                                                                          dst.data(), 1,
                                                                          dst.outerStride(), alpha,
                                                                          space, nullptr);
}

/// dst = alpha a b (accumulate: dst += alpha a b) through Eigen's GEMM kernel with the packing
/// buffers of `space`. dst: a.rows x b.cols, row-major (any outer stride).
template <class T>
void gemm(MatrixRef<T> dst, const GemmOperand<T>& a, const GemmOperand<T>& b, T alpha,
          bool accumulate, GemmSpace<T>& space) {
  MIXATTN_ASSERT(a.cols == b.rows && dst.rows() == a.rows && dst.cols() == b.cols);
  if (!accumulate) dst.setZero();
  if (a.rows == 0 || b.cols == 0 || a.cols == 0) return;
  space.plan(dst.rows(), dst.cols(), a.cols);
  constexpr int R = Eigen::RowMajor, C = Eigen::ColMajor;
  if (a.row_major && b.row_major)
    gemm_run<T, R, R>(dst, a, b, alpha, space);
  else if (a.row_major)
    gemm_run<T, R, C>(dst, a, b, alpha, space);
  else if (b.row_major)
    gemm_run<T, C, R>(dst, a, b, alpha, space);
  else
    gemm_run<T, C, C>(dst, a, b, alpha, space);
}

/// dst = alpha a b (accumulate: dst += alpha a b) as Eigen's `dst.noalias() = alpha * a * b`
/// evaluates it (dst: a.rows x b.cols, sized by the caller): Eigen's GEMM kernel with Eigen's
/// blocking, but on the packing buffers of `space` (gemm() above), which Eigen itself would
/// allocate on every call above 128 KiB; below Eigen's GEMM threshold and for a single row or
/// column, Eigen's own coefficient-based or matrix-vector product (they allocate nothing).
template <class T>
void product_into(MatrixRef<T> dst, const GemmOperand<T>& a, const GemmOperand<T>& b, T alpha,
                  bool accumulate, GemmSpace<T>& space) {
  const Index depth = a.cols;
  const bool small = depth + dst.rows() + dst.cols() < EIGEN_GEMM_TO_COEFFBASED_THRESHOLD;
  if (!((small && depth > 0) || dst.rows() == 1 || dst.cols() == 1)) {
    gemm<T>(dst, a, b, alpha, accumulate, space);
    return;
  }
  using Stride = Eigen::OuterStride<>;
  using Map = Eigen::Map<const Matrix<T>, 0, Stride>;
  // A transposed operand is the row-major storage of its transpose (GemmOperand).
  const Map am(a.data, a.row_major ? a.rows : a.cols, a.row_major ? a.cols : a.rows,
               Stride(a.stride));
  const Map bm(b.data, b.row_major ? b.rows : b.cols, b.row_major ? b.cols : b.rows,
               Stride(b.stride));
  const auto run = [&](const auto& x, const auto& y) {
    // alpha 1 is left out: a scalar factor on a single row makes Eigen's GEMV copy it (malloc)
    if (alpha == T(1) && accumulate)
      dst.noalias() += x * y;
    else if (alpha == T(1))
      dst.noalias() = x * y;
    else if (accumulate)
      dst.noalias() += alpha * x * y;
    else
      dst.noalias() = alpha * x * y;
  };
  if (a.row_major && b.row_major)
    run(am, bm);
  else if (a.row_major)
    run(am, bm.transpose());
  else if (b.row_major)
    run(am.transpose(), bm);
  else
    run(am.transpose(), bm.transpose());
}

}  // namespace detail
MIXATTN_END_NAMESPACE
