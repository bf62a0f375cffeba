// mixattn/reference_types.hpp — the softmax attention's records (SPEC.md §3, §7): its options,
// what a forward saves for its backward, the gradients, which keep the calls' working memory,
// and the key/value cache of causal decoding. The operations on them are in
// mixattn/reference.hpp.
#pragma once

#include "mixattn/common_types.hpp"
#include "mixattn/core.hpp"

#include <algorithm>
#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Working memory of the tiled kernels and of the naive form's products, reused across calls
/// (capacity kept when shapes repeat).
template <class T>
struct FlashScratch {
  Matrix<T> qs;               // forward: scale * one query tile; backward: scale * q (N x r)
  Matrix<T> s, dp;            // one score / probability tile and its gradient
  Vector<T> row_max;          // forward: per row of a query tile
  Vector<wide_t<T>> row_sum;  // forward: per row of a query tile
  Vector<T> delta;            // backward: D_i = dO_i . O_i (N)
  // SIMD forward only: K^T (r x ldk) and, when d_v is not a whole number of registers, V padded
  // with zero dims, both laid out once per call; the output tile and the rescale of each row.
  Matrix<T> kt, vp, o;
  Vector<T> alpha, next_max;
  Matrix<T> lane_max;  // per row of a query tile, one register of lane maxima of its scores
  GemmSpace<T> gemm;   // the naive form's products
};

}  // namespace detail

namespace reference {

/// Options shared by the naive and tiled forms.
struct Options {
  bool causal = false;       // token i attends to j <= i (requires q.rows() == k.rows())
  double scale = 0;          // logit scale; 0 means 1/sqrt(r)
  bool check_finite = true;  // reject NaN/Inf in q, k, v (and grad_out) with std::domain_error
  /// Sliding window (SPEC §7): query i attends to the `window` keys i - window < j <= i. 0: no
  /// window; >= 1 requires causal; >= N is plain causal attention.
  Index window = 0;
};

/// What a forward keeps for its backward. Filled by naive_forward (the N x M probabilities) or by
/// flash_forward (the N x d_v output and N log-sum-exps, O(N) memory); each backward accepts only
/// what its own forward saved, for the same shapes and options.
template <class T>
struct Saved {
  enum class Source { none, naive, flash };
  Source source = Source::none;  // which forward filled this
  Index queries = 0;             // N
  Index keys = 0;                // M
  Index value_dim = 0;           // d_v
  bool causal = false;           // options the forward ran with (the resolved scale)
  double scale = 0;
  Index window = 0;
  std::uint64_t fingerprint[3] = {0, 0, 0};  // of q, k, v (mixattn::detail::Fingerprint)
  Matrix<T> probs;                           // naive: P = softmax(scale Q K^T + mask), N x M
  Matrix<T> out;                             // flash: O, N x d_v
  Vector<T> lse;  // flash: log sum_j exp(scale q_i . k_j) over visible j, N
  // Working memory of the forwards (used in each thread's own record, not in the caller's).
  detail::FlashScratch<T> scratch;
};

/// Gradients of a scalar loss with respect to q (N x r), k (M x r) and v (M x d_v). The
/// `_into` backwards overwrite them and keep the scratch for the next call.
template <class T>
struct Grad {
  Matrix<T> q, k, v;
  detail::FlashScratch<T> scratch;  // naive: dS (N x M) in s, scale * q in qs
};

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

}  // namespace reference
MIXATTN_END_NAMESPACE
