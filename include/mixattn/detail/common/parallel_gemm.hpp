// mixattn/detail/common/parallel_gemm.hpp — a list of GEMMs run as tasks on the library's pool.
//
// The layer's projections are a handful of large products (N x d_model by d_model x H·r and the
// like) that would otherwise run on the calling thread while the pool's workers wait. A GemmTask
// is one block of rows of a destination, dst = Σ_t a_t b_t over up to three terms (added in term
// order); a product split into row blocks is several tasks. The split depends only on the shapes,
// never on the thread count, and each task is computed whole by one thread, so the results are
// bitwise the same for any number of threads. Tasks run in list order, each worker taking the
// next one when it finishes one, with its own GEMM packing buffers.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/parallel.hpp"

#include <atomic>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Rows of a destination per task when a product is split by rows: large enough that the
/// repacking of the right operand per block stays small next to the block's arithmetic
/// (d_model = 256: 1/256 of it), small enough to balance a few products over a few threads.
constexpr Index gemm_task_rows = 256;

/// Rows [row0, row0 + rows) of a GEMM operand (of its logical, possibly transposed, shape).
template <class T>
GemmOperand<T> operand_rows(const GemmOperand<T>& a, Index row0, Index rows) {
  return {a.row_major ? a.data + row0 * a.stride : a.data + row0, rows, a.cols, a.stride,
          a.row_major};
}

/// dst (rows x cols, row stride ld) = Σ_t alpha a[t] b[t], t < terms (accumulate: +=).
template <class T>
struct GemmTask {
  T* dst;
  Index rows, cols, ld;
  GemmOperand<T> a[3], b[3];
  int terms;
  T alpha;
  bool accumulate;
};

/// Reusable task list and per-worker packing buffers.
template <class T>
struct GemmTasks {
  std::vector<GemmTask<T>> tasks;
  std::vector<GemmSpace<T>> spaces;

  void clear() { tasks.clear(); }

  /// dst = alpha Σ_t a_t b_t (accumulate: +=) as one task per `block` rows of dst (the whole
  /// product in one task when block <= 0).
  void add(MatrixRef<T> dst, std::initializer_list<GemmOperand<T>> as,
           std::initializer_list<GemmOperand<T>> bs, T alpha, bool accumulate, Index block) {
    MIXATTN_ASSERT(as.size() == bs.size() && as.size() >= 1 && as.size() <= 3);
    const Index rows = dst.rows(), step = block > 0 ? block : std::max<Index>(rows, 1);
    for (Index r0 = 0; r0 < rows; r0 += step) {
      const Index n = std::min(step, rows - r0);
      GemmTask<T> t{
          dst.data() + r0 * dst.outerStride(), n,     dst.cols(), dst.outerStride(), {}, {},
          static_cast<int>(as.size()),         alpha, accumulate};
      int i = 0;
      for (const GemmOperand<T>& a : as) t.a[i++] = operand_rows(a, r0, n);
      i = 0;
      for (const GemmOperand<T>& b : bs) t.b[i++] = b;
      tasks.push_back(t);
    }
  }

  /// Runs every task on up to `threads` threads (0: all cores) of the library's pool.
  void run(int threads) {
    const Index count = static_cast<Index>(tasks.size());
    if (count == 0) return;
    const Index workers = std::min<Index>(resolve_threads(threads), count);
    if (static_cast<Index>(spaces.size()) < workers)
      spaces.resize(static_cast<std::size_t>(workers));
    std::atomic<Index> next{0};
    parallel_for(workers, threads, [&](Index w) {
      GemmSpace<T>& space = spaces[static_cast<std::size_t>(w)];
      for (Index i = next++; i < count; i = next++)
        run_task(tasks[static_cast<std::size_t>(i)], space);
    });
  }

 private:
  static void run_task(const GemmTask<T>& t, GemmSpace<T>& space) {
    Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> map(t.dst, t.rows, t.cols,
                                                       Eigen::OuterStride<>(t.ld));
    for (int i = 0; i < t.terms; ++i)
      gemm<T>(map, t.a[i], t.b[i], t.alpha, t.accumulate || i > 0, space);
  }
};

}  // namespace detail
MIXATTN_END_NAMESPACE
