// python/csrc/kernels.hpp — the extension's kernels over (batch, head) pairs, free of torch and
// pybind11 headers so that each kernel translation unit compiles on its own (and in parallel).
//
// Every tensor is contiguous in PyTorch's (batch, heads, tokens, dim) layout; the (b, h) slice
// of one is a row-major tokens x dim block, which the library reads through Eigen maps without a
// copy. The (b, h) pairs run on PyTorch's intra-op pool (at::parallel_for); each library call
// inside is single-threaded (EIGEN_DONT_PARALLELIZE).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace mixattn_torch {

using Index = std::int64_t;

/// Sizes of one call: q (B, H, N, r), k (B, H, M, r), v (B, H, M, d_v).
///
/// With `offsets` (the state path of GMA, kernels that say so): the tensors are (1, H, T, .)
/// with B sequences packed along the T tokens (queries = keys = T), sequence b being tokens
/// [offsets[b], offsets[b + 1]); `batch` is then the number of sequences B, and pair b * H + h is
/// sequence b of head h (pair_rows).
struct Shape {
  Index batch = 0, heads = 0, queries = 0, keys = 0, key_dim = 0, value_dim = 0;
  std::vector<Index> offsets;  // empty, or B + 1 entries, 0 first, T last, nondecreasing
};

/// What a forward keeps for its backward (the library's Saved records, one per (b, h)), owned
/// behind a type-erased pointer so that the binding code needs none of the library's headers.
using SavedPtr = std::shared_ptr<void>;

/// A record is handed back when its last reference goes, and the next forward of the same
/// operator and scalar type reuses it (up to 16 per kind are kept, with their memory); this
/// frees every kept one. The records still referenced are not affected.
void release_kept_records();

/// The C++ library's version (MIXATTN_VERSION_STRING), the package's __version__.
const char* library_version();

// --- Gaussian Mixture Attention (SPEC 1) -----------------------------------------------------
struct GmaConfig {
  Index components = 0;  // K
  bool causal = false;
  double eps = 1e-6;
  double var_floor = 1e-4;
  bool check_finite = true;
};

/// mean, var_raw: (H, K, r); prior_logit: (H, K).
template <class T>
struct GmaInputs {
  const T *q, *k, *v, *mean, *var_raw, *prior_logit;
};

/// Causal GMA carrying one prefix state per (b, h) pair (SPEC 1.4, library gma::State): S is
/// (B, H, K, d_v) and z (B, H, K), contiguous float64 (the library's wide type for float and
/// double alike, so a state passes between calls without rounding).
struct GmaStateIO {
  const double *S0 = nullptr, *z0 = nullptr;  // the state the call continues
  double *S = nullptr, *z = nullptr;          // the state it ends in (written)
};

/// dL/d(end state) in and dL/d(start state) out, shaped like GmaStateIO's tensors.
struct GmaStateGradIO {
  const double *dS = nullptr, *dz = nullptr;  // null: the end state is not used (zero)
  double *dS0 = nullptr, *dz0 = nullptr;      // written
};

/// Each head's mixture (of `in`; q, k, v unused) reduced once, one library gma::Prepared per
/// head (heads and key_dim of `s`, components, var_floor and check_finite of `c` are read).
/// Immutable: many calls may share it.
template <class T>
SavedPtr gma_prepare(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in);

/// Writes out (B, H, N, d_v); returns the record gma_backward needs. With `state` (causal only)
/// every pair continues its start state and writes its end state (and `s` may be packed: one
/// state per (sequence, head), S (B, H, K, d_v) and z (B, H, K) with B the sequences);
/// `prepared` (gma_prepare's, or null) then replaces the per-pair reduction of the mixture (the
/// decode path: one token per call would otherwise spend most of its time there), but only if
/// every head's mixture in `in` still has the fingerprint it was prepared from; else the call
/// prepares as without it.
/// *used_prepared (if given) says which happened. save = false (no gradient will be asked for)
/// keeps no record and returns null.
template <class T>
SavedPtr gma_forward(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in, T* out,
                     const GmaStateIO* state = nullptr, const SavedPtr& prepared = nullptr,
                     bool* used_prepared = nullptr, bool save = true);

/// Gradients of sum(grad_out . out): dq, dk, dv like q, k, v; dmean, dvar_raw (H, K, r) and
/// dprior_logit (H, K) summed over the batch (in batch order, whatever the thread count).
/// `state` (only for a record of a forward given a GmaStateIO) adds dL/d(end state) and writes
/// dL/d(start state).
template <class T>
void gma_backward(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in, const T* grad_out,
                  const SavedPtr& saved, T* dq, T* dk, T* dv, T* dmean, T* dvar_raw,
                  T* dprior_logit, const GmaStateGradIO* state = nullptr);

// --- Packed variable-length batches (cu_seqlens; the library's packed.hpp) ---------------------

/// A packed call: B sequences of different lengths stacked along the rows, the heads side by side
/// in the columns (q, k: rows x (H r), v: rows x (H d_v), row-major), sequence b being rows
/// [offsets[b], offsets[b + 1]) of q and of k alike. Each (sequence, head) pair is one call of
/// the single-sequence operator, on the library's pool with torch.get_num_threads() threads.
struct PackedShape {
  Index heads = 0, rows = 0, key_dim = 0, value_dim = 0;
  std::vector<Index> offsets;  // B + 1 entries, 0 first, rows last
};

/// Writes out (rows x (H d_v)); the mixture tensors are those of GmaInputs.
template <class T>
SavedPtr gma_forward_packed(const PackedShape& s, const GmaConfig& c, const GmaInputs<T>& in,
                            T* out);

/// dq, dk, dv like q, k, v; dmean, dvar_raw, dprior_logit summed over the sequences in order.
template <class T>
void gma_backward_packed(const PackedShape& s, const GmaConfig& c, const GmaInputs<T>& in,
                         const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv,
                         T* dmean, T* dvar_raw, T* dprior_logit);

// --- Online Vector-Quantized attention (SPEC 2) ----------------------------------------------
struct OvqConfig {
  Index block = 256;
  Index max_centroids = 1024;
  bool linear_growth = false;     // ovq::Growth::linear instead of plateau
  double growth_alpha = 0;
  bool one_shot_seeding = false;  // ovq::Seeding::one_shot instead of greedy_dispersion
  bool existing_only = false;     // ovq::Assignment::existing_only instead of all_centroids
  bool count_bias = true;
  bool grad_through_dictionary = true;
  double norm_eps = 1e-5;
  bool check_finite = true;
};

/// The dictionaries of a batch: one library ovq::State per (b, h) pair (pair = b * H + h),
/// behind a type-erased pointer (the binding records the scalar type it was made for).
struct OvqStates {
  Shape shape;  // batch, heads, key_dim, value_dim (tokens unused)
  std::shared_ptr<void> states;
};

/// q, k (B, H, T, r), v (B, H, T, d_v), beta (H); `s` may be packed (Shape::offsets: one state
/// per (sequence, head)). Every (b, h) starts from an empty state, or
/// from `start`'s (copied: `start` is left as it was), and its end state goes to `end` if given.
/// save = false keeps no record and returns null.
template <class T>
SavedPtr ovq_forward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                     const T* beta, T* out, const OvqStates* start = nullptr,
                     OvqStates* end = nullptr, bool save = true);

/// dbeta: (H), summed over the batch.
template <class T>
void ovq_backward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                  const T* beta, const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv,
                  T* dbeta);

// --- Softmax attention, tiled (SPEC 3) -------------------------------------------------------
struct FlashConfig {
  bool causal = false;
  double scale = 0;  // 0: 1/sqrt(r)
  bool check_finite = true;
};

template <class T>
SavedPtr flash_forward(const Shape& s, const FlashConfig& c, const T* q, const T* k, const T* v,
                       T* out, bool save = true);

template <class T>
void flash_backward(const Shape& s, const FlashConfig& c, const T* q, const T* k, const T* v,
                    const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv);

/// Packed (PackedShape) tiled softmax attention, one key/value head per query head.
template <class T>
SavedPtr flash_forward_packed(const PackedShape& s, const FlashConfig& c, const T* q, const T* k,
                              const T* v, T* out);

template <class T>
void flash_backward_packed(const PackedShape& s, const FlashConfig& c, const T* q, const T* k,
                           const T* v, const T* grad_out, const SavedPtr& saved, T* dq, T* dk,
                           T* dv);

}  // namespace mixattn_torch
