// mixattn/reference.hpp — O(N^2) softmax attention, the exact baseline (SPEC.md §3):
//
//     O = softmax(scale Q K^T + mask) V,   scale default 1/sqrt(r),   causal mask j <= i
//
// Sliding-window causal attention (SPEC.md §7) is the option `window`: query i sees keys
// i - window < j <= i, and the tiled form then skips the key tiles outside every window, O(N w).
//
// Two implementations of the same function, each with its backward:
//   naive_*  materialises the N x M probability matrix: the obvious form, the tests' oracle.
//   flash_*  tiles queries and keys with an online softmax (FlashAttention-2 schedule) and keeps
//            O(N) state: the output and one log-sum-exp per row. The honest speed baseline.
//
// Thread safety: every function is reentrant; distinct calls may run concurrently (the forwards'
// working memory is per thread). Each call is single-threaded (Eigen's own threading aside).
// The `_into` forms write into caller-owned outputs, Saved and Grad and reuse their capacity:
// a training step whose shapes repeat performs no heap allocation.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/detail/common/entry.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/softmax.hpp"
#include "mixattn/detail/flash_kernels.hpp"
#include "mixattn/reference_types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

MIXATTN_BEGIN_NAMESPACE

namespace detail {

/// Validates q, k, v and the options (once, at the API boundary); returns the resolved scale.
template <class T>
double reference_check_inputs(const char* fn, const ConstMatrixRef<T>& q,
                              const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                              const reference::Options& opt) {
  mixattn::detail::check_qkv_shapes<T>(fn, q, k, v);
  require(!opt.causal || q.rows() == k.rows(), fn, "causal attention needs as many keys as ",
          "queries, but q has ", q.rows(), " rows and k has ", k.rows());
  require(std::isfinite(opt.scale), fn, "options.scale is ", opt.scale, ", not finite");
  require(opt.window >= 0, fn, "options.window is ", opt.window, ", must be >= 0 (0: no window)");
  require(opt.window == 0 || opt.causal, fn, "options.window is ", opt.window,
          ": a sliding window needs options.causal = true");
  if (opt.check_finite) {
    require_finite(q, fn, "q");
    require_finite(k, fn, "k");
    require_finite(v, fn, "v");
  }
  return opt.scale != 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(q.cols()));
}

/// Validates grad_out and the Saved record against the inputs; returns the resolved scale.
template <class T>
double reference_check_backward(const char* fn, const ConstMatrixRef<T>& q,
                                const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                                const ConstMatrixRef<T>& grad_out, const reference::Saved<T>& saved,
                                const reference::Options& opt,
                                typename reference::Saved<T>::Source expected,
                                const char* forward_name) {
  const double scale = reference_check_inputs<T>(fn, q, k, v, opt);
  require(grad_out.rows() == q.rows() && grad_out.cols() == v.cols(), fn, "grad_out is ",
          shape_str(grad_out), " but the output is ", q.rows(), " x ", v.cols(),
          " (q rows x v columns)");
  if (opt.check_finite) require_finite(grad_out, fn, "grad_out");
  require(saved.source == expected, fn, "saved was not filled by ", forward_name,
          saved.source == reference::Saved<T>::Source::none ? " (it is empty)"
                                                            : " (it comes from the other forward)");
  require(saved.queries == q.rows() && saved.keys == k.rows() && saved.value_dim == v.cols(), fn,
          "saved is for ", saved.queries, " queries, ", saved.keys,
          " keys and d_v = ", saved.value_dim, " but q has ", q.rows(), " rows, k has ", k.rows(),
          " rows and v has ", v.cols(), " columns");
  require(saved.causal == opt.causal && saved.scale == scale, fn,
          "saved was made with causal = ", saved.causal, ", scale = ", saved.scale,
          " but options give causal = ", opt.causal, ", scale = ", scale);
  require(saved.window == opt.window, fn, "saved was made with window = ", saved.window,
          " but options give window = ", opt.window);
  mixattn::detail::check_record(fn, "saved",
                                {{saved.fingerprint[0], mixattn::detail::fingerprint(q), "q"},
                                 {saved.fingerprint[1], mixattn::detail::fingerprint(k), "k"},
                                 {saved.fingerprint[2], mixattn::detail::fingerprint(v), "v"}});
  return scale;
}

template <class T>
void reference_record(reference::Saved<T>& saved, typename reference::Saved<T>::Source source,
                      const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v, const reference::Options& opt, double scale) {
  saved.source = source;
  saved.queries = q.rows();
  saved.keys = k.rows();
  saved.value_dim = v.cols();
  saved.causal = opt.causal;
  saved.scale = scale;
  saved.window = opt.window;
  saved.fingerprint[0] = mixattn::detail::fingerprint(q);
  saved.fingerprint[1] = mixattn::detail::fingerprint(k);
  saved.fingerprint[2] = mixattn::detail::fingerprint(v);
}

/// With checks on, gradients that overflow T are reported, never returned.
template <class T>
void reference_check_grad(const char* fn, const reference::Grad<T>& g,
                          const reference::Options& opt) {
  if (!opt.check_finite) return;
  const char* culprit = "q, k, v or grad_out is";
  mixattn::detail::require_finite_result(g.q, fn, "the gradient of q", culprit);
  mixattn::detail::require_finite_result(g.k, fn, "the gradient of k", culprit);
  mixattn::detail::require_finite_result(g.v, fn, "the gradient of v", culprit);
}

/// Logits this large overflow T: report it rather than return NaN.
template <class T>
void reference_check_output(const char* fn, const Matrix<T>& out, const reference::Options& opt) {
  if (opt.check_finite && !out.allFinite())
    mixattn::detail::raise_domain_error(mixattn::detail::concat(
        fn, ": the output is not finite although q, k, v are: scale * q . k overflows the ",
        "scalar type (lower options.scale or use double)"));
}

}  // namespace detail

namespace detail {

/// naive_forward_into's body (`fn` names the entry point in messages).
template <class T>
void naive_forward(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                   const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                   const reference::Options& opt, reference::Saved<T>* saved) {
  const double scale = reference_check_inputs<T>(fn, q, k, v, opt);
  const Index n = q.rows(), m = k.rows();
  // Working memory is this thread's; P is copied into `saved` (capacity reused) only
  // once the call has succeeded, so a throwing call leaves `saved` untouched.
  thread_local reference::Saved<T> rec;
  // S = (scale Q) K^T, associated as flash_forward does: with an extreme scale, Q K^T alone could
  // overflow or underflow where the scaled product does not. Materialised so that the scalar is
  // not folded into the GEMM's alpha (applied after the products).
  Matrix<T>& qs = rec.scratch.qs;
  qs = static_cast<T>(scale) * q;
  Matrix<T>& p = rec.probs;
  p.resize(n, m);
  gemm<T>(p, plain<T>(qs), transposed<T>(k), T(1), false, rec.gemm);
  for (Index i = 0; i < n; ++i) {
    // Causal: keys j > i get probability 0, set rather than computed. The row's max is finite
    // (key 0 is always visible, scores are finite) unless check_finite is off and a score is
    // not; the row is then NaN either way.
    const Index visible = opt.causal ? i + 1 : m;
    // Sliding window (SPEC §7): keys j <= i - window get probability 0 as well.
    const Index first = opt.window > 0 ? std::max<Index>(0, i + 1 - opt.window) : 0;
    T* row = p.row(i).data() + first;
    const Index seen = visible - first;
    if (!mixattn::detail::softmax_row(mixattn::detail::simd_arch{}, row, seen, seen, row))
      p.row(i).segment(first, seen).setConstant(std::numeric_limits<T>::quiet_NaN());
    p.row(i).head(first).setZero();
    p.row(i).tail(m - visible).setZero();
  }
  out.resize(n, v.cols());
  gemm<T>(out, plain<T>(p), plain<T>(v), T(1), false, rec.gemm);
  reference_check_output(fn, out, opt);
  if (saved) {
    reference_record(*saved, reference::Saved<T>::Source::naive, q, k, v, opt, scale);
    saved->probs = rec.probs;
    saved->out.resize(0, 0);
    saved->lse.resize(0);
  }
}

/// naive_backward_into's body.
template <class T>
void naive_backward(const char* fn, reference::Grad<T>& g, const ConstMatrixRef<T>& q,
                    const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                    const ConstMatrixRef<T>& grad_out, const reference::Saved<T>& saved,
                    const reference::Options& opt) {
  const double scale = reference_check_backward<T>(
      fn, q, k, v, grad_out, saved, opt, reference::Saved<T>::Source::naive, "naive_forward");
  const Matrix<T>& p = saved.probs;
  require(p.rows() == q.rows() && p.cols() == k.rows(), fn, "saved.probs is ", shape_str(p),
          " but should be ", q.rows(), " x ", k.rows());
  g.v.resize(k.rows(), v.cols());
  gemm<T>(g.v, transposed<T>(p), plain<T>(grad_out), T(1), false, g.gemm);
  Matrix<T>& ds = g.scratch.s;
  ds.resize(q.rows(), k.rows());
  gemm<T>(ds, plain<T>(grad_out), transposed<T>(v), T(1), false, g.gemm);
  for (Index i = 0; i < ds.rows(); ++i)
    mixattn::detail::softmax_backward_row(mixattn::detail::simd_arch{}, p.row(i).data(),
                                          ds.row(i).data(), ds.cols());
  g.q.resize(q.rows(), q.cols());
  gemm<T>(g.q, plain<T>(ds), plain<T>(k), T(1), false, g.gemm);
  g.q *= static_cast<T>(scale);
  // dK = dS^T (scale Q), associated as flash_backward does (scaling the product afterwards would
  // let dS^T Q underflow first when q is tiny and the scale large).
  Matrix<T>& qs = g.scratch.qs;
  qs = static_cast<T>(scale) * q;
  g.k.resize(k.rows(), k.cols());
  gemm<T>(g.k, transposed<T>(ds), plain<T>(qs), T(1), false, g.gemm);
  reference_check_grad(fn, g, opt);
}

/// flash_forward_into's body.
template <class T>
void flash_forward(const char* fn, Matrix<T>& out, const ConstMatrixRef<T>& q,
                   const ConstMatrixRef<T>& k, const ConstMatrixRef<T>& v,
                   const reference::Options& opt, reference::Saved<T>* saved) {
  const double scale = reference_check_inputs<T>(fn, q, k, v, opt);
  using Tiles = FlashTiles<T>;
  // Working memory is this thread's; the log-sum-exps are copied into `saved` only once the
  // call has succeeded, so a throwing call leaves `saved` untouched.
  thread_local reference::Saved<T> rec;
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

/// flash_backward_into's body.
template <class T>
void flash_backward(const char* fn, reference::Grad<T>& g, const ConstMatrixRef<T>& q,
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

namespace reference {

/// Naive softmax attention (SPEC §3): forms S = (scale Q) K^T (N x M), masks it (causal: j > i is
/// -inf; with options.window w also j <= i - w, SPEC §7), applies a max-subtracted row softmax and
/// returns P V.
///   q: N x r, k: M x r, v: M x d_v (row-major, rows are tokens)  ->  N x d_v.
/// N == 0 gives a 0 x d_v result. `saved` (optional) receives P for naive_backward.
/// Throws std::invalid_argument on bad shapes/options, std::domain_error on non-finite input.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Matrix<T> naive_forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt = {},
                        Saved<T>* saved = nullptr) {
  Matrix<T> out;
  detail::naive_forward<T>("mixattn::reference::naive_forward", out, q, k, v, opt, saved);
  return out;
}

/// naive_forward into a caller-owned `out` (resized to N x d_v); `saved` receives P. The working
/// memory is per thread and kept, so with a reused `out` and `saved` repeated shapes allocate
/// nothing.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void naive_forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt, Saved<T>* saved) {
  detail::naive_forward<T>("mixattn::reference::naive_forward_into", out, q, k, v, opt, saved);
}

/// Backward of naive_forward, from the saved probabilities P (N x M):
///   dV = P^T dO,  dP = dO V^T,  dS_ij = P_ij (dP_ij - sum_l P_il dP_il),
///   dQ = scale (dS K),  dK = dS^T (scale Q)  (the association flash_backward uses).
///   q: N x r, k: M x r, v: M x d_v, grad_out: N x d_v; saved from naive_forward on the same
///   inputs and options.  ->  Grad {q: N x r, k: M x r, v: M x d_v}.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Grad<T> naive_backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                       const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                       const Saved<T>& saved, const Options& opt = {}) {
  Grad<T> g;
  {  // the working memory is this thread's: the returned gradient carries none
    const mixattn::detail::LentScratch<detail::FlashScratch<T>> lent(&g.scratch);
    const mixattn::detail::LentScratch<mixattn::detail::GemmSpace<T>> lent_gemm(&g.gemm);
    detail::naive_backward<T>("mixattn::reference::naive_backward", g, q, k, v, grad_out, saved, opt);
  }
  return g;
}

/// naive_backward into caller-owned gradients (resized; scratch kept in `grad`).
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void naive_backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                         const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                         const Saved<T>& saved, const Options& opt) {
  detail::naive_backward<T>("mixattn::reference::naive_backward_into", grad, q, k, v, grad_out,
                            saved, opt);
}

/// Tiled softmax attention with an online softmax (SPEC §3; FlashAttention-2 forward): the same
/// function as naive_forward in O(N + tile) extra memory. Causal tiles wholly above the diagonal
/// are skipped and only diagonal tiles are masked; with options.window w (SPEC §7) so are the
/// tiles wholly before every row's window, so the cost is O(N w r), not O(N^2 r).
///   q: N x r, k: M x r, v: M x d_v (row-major, rows are tokens)  ->  N x d_v.
/// N == 0 gives a 0 x d_v result. `saved` (optional) receives the output and the per-row
/// log-sum-exp for flash_backward.
/// Throws std::invalid_argument on bad shapes/options, std::domain_error on non-finite input.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Matrix<T> flash_forward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt = {},
                        Saved<T>* saved = nullptr) {
  Matrix<T> out;
  detail::flash_forward<T>("mixattn::reference::flash_forward", out, q, k, v, opt, saved);
  return out;
}

/// flash_forward into a caller-owned `out` (resized to N x d_v); `saved` receives the output and
/// the log-sum-exps. The working memory is per thread and kept, so with a reused `out` and
/// `saved` repeated shapes allocate nothing.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void flash_forward_into(Matrix<T>& out, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                        const ConstMatrixArg<T>& v, const Options& opt, Saved<T>* saved) {
  detail::flash_forward<T>("mixattn::reference::flash_forward_into", out, q, k, v, opt, saved);
}

/// Backward of flash_forward (FlashAttention-2 backward): recomputes each probability tile from
/// the saved log-sum-exp, P = exp(scale Q K^T - lse), and accumulates
///   dV += P^T dO,  dS = P o (dP - D) with dP = dO V^T and D_i = dO_i . O_i,
///   dQ += scale dS K,  dK += scale dS^T Q,
/// in O(N + M + tile) extra memory; with options.window, over the forward's tiles only (SPEC §7).
///   q: N x r, k: M x r, v: M x d_v, grad_out: N x d_v; saved from flash_forward on the same
///   inputs and options.  ->  Grad {q: N x r, k: M x r, v: M x d_v}.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Grad<T> flash_backward(const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                       const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                       const Saved<T>& saved, const Options& opt = {}) {
  Grad<T> g;
  {  // the working memory is this thread's: the returned gradient carries none
    const mixattn::detail::LentScratch<detail::FlashScratch<T>> lent(&g.scratch);
    const mixattn::detail::LentScratch<mixattn::detail::GemmSpace<T>> lent_gemm(&g.gemm);
    detail::flash_backward<T>("mixattn::reference::flash_backward", g, q, k, v, grad_out, saved, opt);
  }
  return g;
}

/// flash_backward into caller-owned gradients (resized; scratch kept in `grad`).
template <class T, mixattn::detail::enable_if_supported<T> = 0>
void flash_backward_into(Grad<T>& grad, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                         const ConstMatrixArg<T>& v, const ConstMatrixArg<T>& grad_out,
                         const Saved<T>& saved, const Options& opt) {
  detail::flash_backward<T>("mixattn::reference::flash_backward_into", grad, q, k, v, grad_out,
                            saved, opt);
}

/// The key/value cache of causal softmax decoding (SPEC §3, causal mask): the keys (size x r)
/// and values (size x d_v) of every token seen so far, in buffers whose capacity at least
/// doubles when full, so appending is amortised O(r + d_v) per token; reserve() up front makes
/// every append copy-free. Memory grows with the sequence: O(size (r + d_v)), the cost that
/// GMA's and OVQ's constant-size states avoid. Not thread-safe for concurrent decode calls.
template <class T>
class KvCache {
 public:
  /// An empty cache for keys of width key_dim (>= 1) and values of width value_dim (>= 1).
  KvCache(Index key_dim, Index value_dim, Index reserve_tokens = 0) {
    constexpr const char* fn = "mixattn::reference::KvCache";
    detail::require(key_dim >= 1 && value_dim >= 1, fn, "key_dim is ", key_dim,
                    " and value_dim is ", value_dim, "; both must be >= 1");
    detail::require(reserve_tokens >= 0, fn, "reserve_tokens is ", reserve_tokens,
                    ", must be >= 0");
    keys_.resize(reserve_tokens, key_dim);
    values_.resize(reserve_tokens, value_dim);
  }

  Index size() const { return size_; }
  Index key_dim() const { return keys_.cols(); }
  Index value_dim() const { return values_.cols(); }
  Index capacity() const { return keys_.rows(); }
  /// Cached keys (size x r) and values (size x d_v), oldest first.
  ConstMatrixRef<T> keys() const { return keys_.topRows(size_); }
  ConstMatrixRef<T> values() const { return values_.topRows(size_); }

  /// Room for `tokens` tokens in all (the cached ones included) without another copy.
  void reserve(Index tokens) {
    if (tokens <= capacity()) return;
    keys_.conservativeResize(tokens, keys_.cols());
    values_.conservativeResize(tokens, values_.cols());
  }
  void clear() { size_ = 0; }
  /// Keeps the oldest `tokens` tokens (0 <= tokens <= size), dropping the newer ones.
  void truncate(Index tokens) {
    detail::require(tokens >= 0 && tokens <= size_, "mixattn::reference::KvCache::truncate",
                    "tokens is ", tokens, " but the cache holds ", size_);
    size_ = tokens;
  }

  /// Appends n tokens: k is n x r, v is n x d_v (validated by the caller, decode()).
  void append(const ConstMatrixArg<T>& k, const ConstMatrixArg<T>& v) {
    const Index n = k.rows();
    if (size_ + n > capacity()) reserve(std::max(size_ + n, 2 * capacity()));
    keys_.middleRows(size_, n) = k;
    values_.middleRows(size_, n) = v;
    size_ += n;
  }

 private:
  Matrix<T> keys_, values_;  // capacity x r, capacity x d_v; rows [0, size) live
  Index size_ = 0;
};

/// Causal softmax decoding: appends the n new tokens' k (n x r) and v (n x d_v) to `cache` and
/// returns their outputs (n x d_v) for q (n x r): new token i attends to every cached token and
/// to the new ones up to itself (with options.window w, to the last w of those, itself
/// included). Over any pieces of a sequence, the rows of
/// naive_forward(q, k, v, causal) up to rounding. options.causal must be true (decoding is
/// causal); options.scale as for the forwards. O(n (size + n) (r + d_v)) time, O(size + n)
/// scratch. On a throw (invalid_argument for shapes or options, domain_error for non-finite
/// input) the cache is untouched.
template <class T, mixattn::detail::enable_if_supported<T> = 0>
Matrix<T> decode(KvCache<T>& cache, const ConstMatrixArg<T>& q, const ConstMatrixArg<T>& k,
                 const ConstMatrixArg<T>& v, const Options& opt) {
  constexpr const char* fn = "mixattn::reference::decode";
  detail::require(opt.causal, fn, "decoding is causal: options.causal must be true");
  detail::require(q.cols() == cache.key_dim() && v.cols() == cache.value_dim(), fn, "q is ",
                  detail::shape_str(q), " and v is ", detail::shape_str(v),
                  " but the cache holds keys of width ", cache.key_dim(), " and values of width ",
                  cache.value_dim());
  const T scale = static_cast<T>(detail::reference_check_inputs<T>(fn, q, k, v, opt));
  const Index n = q.rows(), d_v = v.cols(), start = cache.size();
  cache.append(k, v);
  const ConstMatrixRef<T> keys = cache.keys(), values = cache.values();
  Matrix<T> out(n, d_v);
  Vector<T> s(start + n);
  for (Index i = 0; i < n; ++i) {
    // one softmax row over the visible tokens (the query's own key included)
    const Index end = start + i + 1;
    const Index first = opt.window > 0 ? std::max<Index>(0, end - opt.window) : 0;  // SPEC §7
    const Index vis = end - first;
    auto si = s.head(vis);
    si.noalias() = keys.middleRows(first, vis) * (q.row(i).transpose() * scale);
    if (!mixattn::detail::softmax_row(mixattn::detail::simd_arch{}, si.data(), vis, vis, si.data()))
      si.setConstant(std::numeric_limits<T>::quiet_NaN());  // non-finite scores, unchecked
    out.row(i).noalias() = si.transpose() * values.middleRows(first, vis);
  }
  if (opt.check_finite && !out.allFinite()) cache.truncate(start);  // before check_output throws
  detail::reference_check_output(fn, out, opt);
  return out;
}

// Deduced calls: naive_forward(q, k, v) with plain matrices takes T from q (the forms above take
// it written, naive_forward<float>(q, k, v); the backwards take it from `saved`). The arguments
// then bind to the ConstMatrixArg<T> parameters above, which refuse what they would copy.
template <class Q, class K, class V, mixattn::detail::enable_if_deduced<Q, K, V> = 0>
Matrix<typename Q::Scalar> naive_forward(const Q& q, const K& k, const V& v,
                                         const Options& opt = {},
                                         Saved<typename Q::Scalar>* saved = nullptr) {
  return naive_forward<typename Q::Scalar>(q, k, v, opt, saved);
}
template <class Q, class K, class V, mixattn::detail::enable_if_deduced<Q, K, V> = 0>
Matrix<typename Q::Scalar> flash_forward(const Q& q, const K& k, const V& v,
                                         const Options& opt = {},
                                         Saved<typename Q::Scalar>* saved = nullptr) {
  return flash_forward<typename Q::Scalar>(q, k, v, opt, saved);
}

}  // namespace reference

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The workers behind every forward and backward form (core.hpp: compiling the operators once).
namespace detail {
#define MIXATTN_REFERENCE_INSTANCES(T)                                                      \
  MIXATTN_TEMPLATE_INSTANCE void naive_forward<T>(                                          \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,          \
      const ConstMatrixRef<T>&, const reference::Options&, reference::Saved<T>*);           \
  MIXATTN_TEMPLATE_INSTANCE void flash_forward<T>(                                          \
      const char*, Matrix<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&,          \
      const ConstMatrixRef<T>&, const reference::Options&, reference::Saved<T>*);           \
  MIXATTN_TEMPLATE_INSTANCE void naive_backward<T>(                                         \
      const char*, reference::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const reference::Saved<T>&,       \
      const reference::Options&);                                                           \
  MIXATTN_TEMPLATE_INSTANCE void flash_backward<T>(                                         \
      const char*, reference::Grad<T>&, const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, \
      const ConstMatrixRef<T>&, const ConstMatrixRef<T>&, const reference::Saved<T>&,       \
      const reference::Options&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_REFERENCE_INSTANCES)
#undef MIXATTN_REFERENCE_INSTANCES
}  // namespace detail
#endif
MIXATTN_END_NAMESPACE
