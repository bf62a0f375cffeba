// mixattn/reference_types.hpp — the softmax attention's records (SPEC.md §3, §7): its options,
// what a forward saves for its backward and the gradients, which keep the calls' working memory.
// The operations on them are in mixattn/reference.hpp.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/flash_kernels.hpp"

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
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
  mixattn::detail::GemmSpace<T> gemm;
};

/// Gradients of a scalar loss with respect to q (N x r), k (M x r) and v (M x d_v). The
/// `_into` backwards overwrite them and keep the scratch for the next call.
template <class T>
struct Grad {
  Matrix<T> q, k, v;
  detail::FlashScratch<T> scratch;  // naive: dS (N x M) in s, scale * q in qs
  mixattn::detail::GemmSpace<T> gemm;
};

}  // namespace reference
MIXATTN_END_NAMESPACE
