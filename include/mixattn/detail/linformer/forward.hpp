// mixattn/detail/linformer/forward.hpp — Linformer's forward (SPEC.md §11.1): the projections
// K' = E k, V' = F v, then softmax attention of the N queries over the k_proj projected keys,
// block of rows by block of rows, and the body behind the entry points, linformer_forward_into.
//
// Internal: included by mixattn/linformer.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/simd.hpp"
#include "mixattn/detail/common/softmax.hpp"
#include "mixattn/detail/linformer/checks.hpp"
#include "mixattn/linformer_types.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Rows of P formed, normalised and read (P V') before the next block: 256 rows of k_proj = 256
/// floats are 256 KiB, which stay in L2 between the logits' product, the softmax and the read.
constexpr Index linformer_block_rows = 256;

/// K' = E k (k_proj x d) and V' = F v (k_proj x d_v) into the record.
template <class T>
void linformer_project(const LinformerInputs<T>& in, linformer::Saved<T>& rec) {
  GemmSpace<T>& g = rec.scratch.gemm;
  rec.kp.resize(in.E.rows(), in.k.cols());
  rec.vp.resize(in.F.rows(), in.v.cols());
  product_into<T>(rec.kp, plain<T>(in.E), plain<T>(in.k), T(1), false, g);
  product_into<T>(rec.vp, plain<T>(in.F), plain<T>(in.v), T(1), false, g);
}

/// P = softmax(scale q K'^T) row by row into rec.probs and out = P V', a block of rows at a time.
/// A row without a finite logit (only from non-finite inputs left unchecked) gives NaN.
template <class T>
void linformer_attend(const ConstMatrixRef<T>& q, T scale, linformer::Saved<T>& rec,
                      Matrix<T>& out) {
  const Index N = q.rows(), kp = rec.kp.rows();
  GemmSpace<T>& g = rec.scratch.gemm;
  rec.probs.resize(N, kp);
  for (Index i0 = 0; i0 < N; i0 += linformer_block_rows) {
    const Index n = std::min(linformer_block_rows, N - i0);
    MatrixRef<T> p = rec.probs.middleRows(i0, n);
    product_into<T>(p, plain<T>(q.middleRows(i0, n)), transposed<T>(rec.kp), scale, false, g);
    for (Index i = 0; i < n; ++i) {
      T* row = p.row(i).data();
      if (!softmax_row(simd_arch{}, row, kp, kp, row))
        std::fill(row, row + kp, std::numeric_limits<T>::quiet_NaN());
    }
    product_into<T>(out.middleRows(i0, n), plain<T>(p), plain<T>(rec.vp), T(1), false, g);
  }
}

/// forward's body (SPEC 11.1; `fn` names the entry point in messages): validation once, the
/// projections, the attention, the record completed with the fingerprints of the inputs. Without
/// a record the call works in this thread's.
template <class T>
void linformer_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                            const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                            const ConstMatrixRef<T>& E, const ConstMatrixRef<T>& F,
                            const linformer::Options& opt, linformer::Saved<T>* saved) {
  const LinformerInputs<T> in{q, k, v, E, F};
  if (saved) {  // the fingerprints and the finiteness in one read
    linformer_check_options<T>(fn, opt);
    linformer_check_shapes<T>(fn, in);
    saved->valid = false;  // until this call has filled it
    linformer_scan_inputs<T>(fn, in, opt.check_finite, saved->fingerprint);
  } else {
    linformer_check_inputs<T>(fn, in, opt);
  }
  linformer::Saved<T>& rec = saved ? *saved : thread_scratch<linformer::Saved<T>>();
  const double scale = linformer_scale(opt, q.cols());
  out.resize(q.rows(), v.cols());
  linformer_project<T>(in, rec);
  linformer_attend<T>(q, static_cast<T>(scale), rec, out);
  if (opt.check_finite) require_finite_result(out, fn, "the output", "q, k, v, E or F is");
  if (!saved) return;
  rec.scale = scale;
  rec.valid = true;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
