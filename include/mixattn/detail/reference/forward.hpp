// mixattn/detail/reference/forward.hpp — the bodies of softmax attention's forwards (SPEC §3, §7):
// the naive form, which materialises the N x M probabilities, the tiled form over the kernels of
// flash.hpp, and causal decoding over a key/value cache.
//
// Internal: part of mixattn/reference.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/softmax.hpp"
#include "mixattn/detail/reference/checks.hpp"
#include "mixattn/detail/reference/flash.hpp"
#include "mixattn/reference_types.hpp"

#include <algorithm>
#include <limits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

// The owners of the forwards' per-thread working memory: the naive form keeps scale * q (N x r)
// and the N x M probabilities in it, the tiled form one query tile and the log-sum-exps, so each
// keeps its own (thread_scratch).
struct NaiveForwardScratch;
struct FlashForwardScratch;

/// naive_forward_into's body (`fn` names the entry point in messages).
template <class T>
void naive_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                        const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                        const reference::Options& opt, reference::Saved<T>* saved) {
  const double scale = reference_check_inputs<T>(fn, q, k, v, opt);
  const Index n = q.rows(), m = k.rows();
  // Working memory is this thread's; P is copied into `saved` (capacity reused) only
  // once the call has succeeded, so a throwing call leaves `saved` untouched.
  reference::Saved<T>& rec = thread_scratch<reference::Saved<T>, NaiveForwardScratch>();
  // S = (scale Q) K^T, associated as flash_forward does: with an extreme scale, Q K^T alone could
  // overflow or underflow where the scaled product does not. Materialised so that the scalar is
  // not folded into the GEMM's alpha (applied after the products).
  Matrix<T>& qs = rec.scratch.qs;
  qs = static_cast<T>(scale) * q;
  Matrix<T>& p = rec.probs;
  p.resize(n, m);
  gemm<T>(p, plain<T>(qs), transposed<T>(k), T(1), false, rec.scratch.gemm);
  for (Index i = 0; i < n; ++i) {
    // Causal: keys j > i get probability 0, set rather than computed. The row's max is finite
    // (key 0 is always visible, scores are finite) unless check_finite is off and a score is
    // not; the row is then NaN either way.
    const Index visible = opt.causal ? i + 1 : m;
    // Sliding window (SPEC §7): keys j <= i - window get probability 0 as well.
    const Index first = opt.window > 0 ? std::max<Index>(0, i + 1 - opt.window) : 0;
    T* row = p.row(i).data() + first;
    const Index seen = visible - first;
    if (!softmax_row(simd_arch{}, row, seen, seen, row))
      p.row(i).segment(first, seen).setConstant(std::numeric_limits<T>::quiet_NaN());
    p.row(i).head(first).setZero();
    p.row(i).tail(m - visible).setZero();
  }
  out.resize(n, v.cols());
  gemm<T>(out, plain<T>(p), plain<T>(v), T(1), false, rec.scratch.gemm);
  reference_check_output(fn, out, opt);
  if (saved) {
    reference_record(*saved, reference::Saved<T>::Source::naive, q, k, v, opt, scale);
    saved->probs = rec.probs;
    saved->out.resize(0, 0);
    saved->lse.resize(0);
  }
}

/// flash_forward_into's body.
template <class T>
void flash_forward_into(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                        const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                        const reference::Options& opt, reference::Saved<T>* saved) {
  const double scale = reference_check_inputs<T>(fn, q, k, v, opt);
  using Tiles = FlashTiles<T>;
  // Working memory is this thread's; the log-sum-exps are copied into `saved` only once the
  // call has succeeded, so a throwing call leaves `saved` untouched.
  reference::Saved<T>& rec = thread_scratch<reference::Saved<T>, FlashForwardScratch>();
  out.resize(q.rows(), v.cols());
  rec.lse.resize(q.rows());
  flash_forward_tiles<T, Tiles::forward_queries, Tiles::forward_keys>(
      q, k, v, static_cast<T>(scale), opt.causal, out, rec.lse, rec.scratch, opt.window);
  reference_check_output(fn, out, opt);
  if (saved) {
    reference_record(*saved, reference::Saved<T>::Source::flash, q, k, v, opt, scale);
    saved->out = out;
    saved->lse = rec.lse;
    saved->probs.resize(0, 0);
  }
}

/// decode's body: appends the n new tokens' k and v to `cache` and writes their outputs (n x
/// d_v) into `out`; the cache is untouched on a throw.
template <class T>
void reference_decode_into(const char* fn, Matrix<T>& out, reference::KvCache<T>& cache,
                           const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                           const ConstMatrixRef<T>& v, const reference::Options& opt) {
  require(opt.causal, fn, "decoding is causal: options.causal must be true");
  require(q.cols() == cache.key_dim() && v.cols() == cache.value_dim(), fn, "q is ", shape_str(q),
          " and v is ", shape_str(v), " but the cache holds keys of width ", cache.key_dim(),
          " and values of width ", cache.value_dim());
  const T scale = static_cast<T>(reference_check_inputs<T>(fn, q, k, v, opt));
  const Index n = q.rows(), d_v = v.cols(), start = cache.size();
  cache.append(k, v);
  const ConstMatrixRef<T> keys = cache.keys(), values = cache.values();
  out.resize(n, d_v);
  Vector<T> s(start + n);
  for (Index i = 0; i < n; ++i) {
    // one softmax row over the visible tokens (the query's own key included)
    const Index end = start + i + 1;
    const Index first = opt.window > 0 ? std::max<Index>(0, end - opt.window) : 0;  // SPEC §7
    const Index vis = end - first;
    auto si = s.head(vis);
    si.noalias() = keys.middleRows(first, vis) * (q.row(i).transpose() * scale);
    if (!softmax_row(simd_arch{}, si.data(), vis, vis, si.data()))
      si.setConstant(std::numeric_limits<T>::quiet_NaN());  // non-finite scores, unchecked
    out.row(i).noalias() = si.transpose() * values.middleRows(first, vis);
  }
  if (opt.check_finite && !out.allFinite()) cache.truncate(start);  // before check_output throws
  reference_check_output(fn, out, opt);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
