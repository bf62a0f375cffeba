// mixattn/common_types.hpp — the records several operators share: the working memory their
// Saved and Grad keep (the GEMMs' packing buffers, the causal scan's buffers), data only; the
// kernels that use it are in detail/common/.
#pragma once

#include "mixattn/core.hpp"

#include <Eigen/Core>

#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Reusable packing buffers for gemm(). Not shareable between concurrent calls; copying one
/// copies its buffers (the pointers are set again by every product).
template <class T>
class GemmSpace : public Eigen::internal::level3_blocking<T, T> {
 public:
  /// Blocking for a row-major rows x cols destination and the given depth: Eigen computes the
  /// transposed (column-major) product, so its m is our cols and its n our rows.
  void plan(Index rows, Index cols, Index depth) {
    Index kc = depth, mc = cols, nc = rows;
    Eigen::internal::computeProductBlockingSizes<T, T, 1, Index>(kc, mc, nc, Index(1));
    this->m_kc = kc;
    this->m_mc = mc;
    this->m_nc = nc;
    grow(a_, kc * mc);
    grow(b_, kc * nc);
    this->m_blockA = a_.data();
    this->m_blockB = b_.data();
  }

 private:
  static void grow(std::vector<T, Eigen::aligned_allocator<T>>& v, Index n) {
    if (static_cast<Index>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
  }
  std::vector<T, Eigen::aligned_allocator<T>> a_, b_;
};

/// Scratch of the causal scans, reused across calls (capacity kept when shapes repeat).
template <class T>
struct ScanScratch {
  Matrix<wide_t<T>> S;      // K x d_v: a whole-sequence forward's state; backward's prefix state
  Vector<wide_t<T>> z;      // K
  Matrix<T> s_t, update;    // K x d_v: the state in T, one chunk's contribution
  Vector<T> z_t, z_update;  // K
  Matrix<T> a_buf, b_buf;   // chunk x padded chunk (padded_to_vectors)
  Matrix<T> gkt;            // K x padded chunk: a chunk's Gamma_K transposed (SIMD)
  Matrix<T> vt;             // d_v x padded chunk: a chunk's V transposed (SIMD backward)
  Matrix<T> st;             // d_v x K: a state transposed, in T (SIMD backward)
};

}  // namespace detail
MIXATTN_END_NAMESPACE
