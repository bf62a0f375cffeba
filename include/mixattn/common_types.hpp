// mixattn/common_types.hpp — the records several operators share: the working memory their
// Saved and Grad keep (the GEMMs' packing buffers, the causal scan's buffers), data only, and
// Workspace, the handle of working memory whose type a records header does not see; the kernels
// that use them are in detail/common/.
#pragma once

#include "mixattn/core.hpp"

#include <Eigen/Core>

#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE

/// Row offsets of a packed batch of B sequences (B + 1 entries; packed.hpp).
using Offsets = std::vector<Index>;

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

/// Working memory a record keeps whose type its records header does not define (S is made of a
/// kernel's objects, e.g. OVQ's dictionary machinery, defined in detail/<op>/): an owning handle,
/// empty until the first get(), which is instantiated where S is complete and supplies the
/// copy and the destruction. Copies copy S; a swap (the value forms' lending) moves no S.
template <class S>
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace& o) : ops_(o.ops_), p_(o.p_ ? o.ops_->copy(o.p_) : nullptr) {}
  Workspace(Workspace&& o) noexcept : ops_(o.ops_), p_(std::exchange(o.p_, nullptr)) {}
  Workspace& operator=(Workspace o) noexcept {
    swap(*this, o);
    return *this;
  }
  ~Workspace() {
    if (p_ != nullptr) ops_->destroy(p_);
  }
  friend void swap(Workspace& a, Workspace& b) noexcept {
    std::swap(a.ops_, b.ops_);
    std::swap(a.p_, b.p_);
  }

  /// The working memory, made (value-initialised) on first use.
  S& get() {
    if (p_ == nullptr) {
      static constexpr Ops ops{&copy_of, &destroy};
      p_ = new S();
      ops_ = &ops;
    }
    return *p_;
  }

 private:
  struct Ops {
    S* (*copy)(const S*);
    void (*destroy)(S*);
  };
  static S* copy_of(const S* s) { return new S(*s); }
  static void destroy(S* s) { delete s; }

  const Ops* ops_ = nullptr;
  S* p_ = nullptr;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
