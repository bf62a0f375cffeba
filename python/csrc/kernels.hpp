// python/csrc/kernels.hpp — the extension's kernels over (batch, head) pairs, free of torch and
// pybind11 headers so that each kernel translation unit compiles on its own (and in parallel).
// The calls' options are the library's own Options records (gma::Options, ovq::Options,
// reference::Options), filled once by the bindings from the Python keywords.
//
// Every tensor is contiguous in PyTorch's (batch, heads, tokens, dim) layout; the (b, h) slice
// of one is a row-major tokens x dim block, which the library reads through Eigen maps without a
// copy. The (b, h) pairs run on PyTorch's intra-op pool (at::parallel_for); each library call
// inside is single-threaded (EIGEN_DONT_PARALLELIZE).
#pragma once

#include <mixattn/delta_types.hpp>
#include <mixattn/gma.hpp>
#include <mixattn/linear.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/performer.hpp>
#include <mixattn/reference.hpp>
#include <mixattn/rope.hpp>
#include <mixattn/vq.hpp>
#include <mixattn/window.hpp>

#include <cstdint>
#include <memory>
#include <vector>

namespace mixattn_torch {

using Index = std::int64_t;

/// Sizes of one call: q (B, H, N, r), k (B, H, M, r), v (B, H, M, d_v).
///
/// With `offsets` (the state and cache paths, kernels that say so): the tensors are (1, H, T, .)
/// with B sequences packed along the T tokens (queries = keys = T), sequence b being tokens
/// [offsets[b], offsets[b + 1]); `batch` is then the number of sequences B, and pair b * H + h is
/// sequence b of head h (pair_rows).
struct Shape {
  Index batch = 0, heads = 0, queries = 0, keys = 0, key_dim = 0, value_dim = 0;
  std::vector<Index> offsets;  // empty, or B + 1 entries, 0 first, T last, nondecreasing

  bool operator==(const Shape& o) const {
    return batch == o.batch && heads == o.heads && queries == o.queries && keys == o.keys &&
           key_dim == o.key_dim && value_dim == o.value_dim && offsets == o.offsets;
  }
};

/// What a forward keeps for its backward (the library's Saved records, one per (b, h)), owned
/// behind a type-erased pointer.
using SavedPtr = std::shared_ptr<void>;

/// A record is handed back when its last reference goes, and the next forward of the same
/// operator and scalar type reuses it (up to 16 per kind are kept, with their memory); this
/// frees every kept one. The records still referenced are not affected.
void release_kept_records();

/// The C++ library's version (MIXATTN_VERSION_STRING), the package's __version__.
const char* library_version();

/// The states of a decoding cache or of an OVQ state handed to Python: one library State per
/// (stream, head) pair (pair = stream * H + head, a stream being a batch entry or a packed
/// sequence), all of one operator and scalar type (the bindings keep which, and the kernels
/// check it). Continued in place by the cache forwards; clone() copies every pair's state.
class PairStates {
 public:
  /// The order a cache forward visits its pairs in: the caches alternate it call by call, so
  /// that a call starts with the states the previous one touched last, still in the core's
  /// cache (a full OVQ dictionary is 512 KiB at r = d_v = 64: a few heads fill a core's L2).
  bool reversed = false;

  virtual ~PairStates() = default;
  virtual std::unique_ptr<PairStates> clone() const = 0;
  /// Tokens each pair's state has taken (State::tokens_seen), in pair order.
  virtual std::vector<Index> tokens_seen() const = 0;
  /// A fingerprint of every pair's state, contents and sizes (mixattn::detail::Fingerprint).
  virtual std::uint64_t content_fingerprint() const = 0;
};

// --- Gaussian Mixture Attention (SPEC 1) -----------------------------------------------------
struct GmaConfig {
  Index components = 0;  // K
  double var_floor = 1e-4;
  mixattn::gma::Options options;  // causal, eps, check_finite
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
/// dL/d(start state). A record of gma_forward_cached is read without `state` (the cache's start
/// state is a constant of the call).
template <class T>
void gma_backward(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in, const T* grad_out,
                  const SavedPtr& saved, T* dq, T* dk, T* dv, T* dmean, T* dvar_raw,
                  T* dprior_logit, const GmaStateGradIO* state = nullptr);

/// `pairs` GMA states (gma::State<T>) of K components and d_v value columns: empty, or with the
/// (S, z) of a (pairs, K, d_v) and a (pairs, K) float64 buffer.
template <class T>
std::unique_ptr<PairStates> gma_states(Index pairs, Index K, Index dv, const double* S = nullptr,
                                       const double* z = nullptr);

/// Writes every pair's (S, z) into (pairs, K, d_v) and (pairs, K) float64 buffers.
template <class T>
void gma_read_states(const PairStates& states, double* S, double* z);

/// The decoding cache's forward (causal): every pair continues its own state in `states` in
/// place (gma_states<T>, one per pair of `s`, which may be packed), nothing of it copied. With
/// save = false, `prepared` (gma_prepare's for the call's mixtures, non-null: the bindings keep
/// it current) gives the reduced mixtures and no record is kept; with save = true the mixtures of
/// `in` are used and the record gma_backward reads is returned (with the start states).
template <class T>
SavedPtr gma_forward_cached(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in, T* out,
                            PairStates& states, const SavedPtr& prepared, bool save);

// --- Packed variable-length batches (cu_seqlens; the library's packed.hpp) ---------------------

/// A packed call: B sequences of different lengths stacked along the rows, the heads side by side
/// in the columns (q, k: rows x (H r), v: rows x (H d_v), row-major), sequence b being rows
/// [offsets[b], offsets[b + 1]) of q and of k alike. Each (sequence, head) pair is one call of
/// the single-sequence operator, on the library's pool with torch.get_num_threads() threads.
struct PackedShape {
  Index heads = 0, rows = 0, key_dim = 0, value_dim = 0;
  std::vector<Index> offsets;  // B + 1 entries, 0 first, rows last

  bool operator==(const PackedShape& o) const {
    return heads == o.heads && rows == o.rows && key_dim == o.key_dim && value_dim == o.value_dim &&
           offsets == o.offsets;
  }
};

/// Writes out (rows x (H d_v)); the mixture tensors are those of GmaInputs.
template <class T>
SavedPtr gma_forward_packed(const PackedShape& s, const GmaConfig& c, const GmaInputs<T>& in,
                            T* out);

/// dq, dk, dv like q, k, v; dmean, dvar_raw, dprior_logit summed over the sequences in order.
template <class T>
void gma_backward_packed(const PackedShape& s, const GmaConfig& c, const GmaInputs<T>& in,
                         const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv, T* dmean,
                         T* dvar_raw, T* dprior_logit);

// --- Online Vector-Quantized attention (SPEC 2) ----------------------------------------------
using OvqConfig = mixattn::ovq::Options;

/// `pairs` empty OVQ states (ovq::State<T>) for keys of width r and values of width d_v.
template <class T>
std::unique_ptr<PairStates> ovq_states(Index pairs, Index r, Index dv);

/// q, k (B, H, T, r), v (B, H, T, d_v), beta (H); `s` may be packed (Shape::offsets: one state
/// per (sequence, head)). Every pair continues its state in `states` (ovq_states<T>, one per
/// pair) in place; with `copy_from` (states of the same kind and count) each pair's state is
/// first set to a copy of that one's (the copying form: `copy_from` is left as it was).
/// save = false keeps no record and returns null.
template <class T>
SavedPtr ovq_forward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                     const T* beta, T* out, PairStates& states,
                     const PairStates* copy_from = nullptr, bool save = true);

/// dbeta: (H), summed over the batch.
template <class T>
void ovq_backward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                  const T* beta, const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv,
                  T* dbeta);

// --- Softmax attention, tiled (SPEC 3) -------------------------------------------------------
using FlashConfig = mixattn::reference::Options;  // causal, scale (0: 1/sqrt(r)), check_finite

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

// --- The papers' baselines (SPEC 4-7) and RoPE (SPEC 8) -------------------------------------
//
// None of them has a state: every (b, h) pair, or (sequence, head) pair of a packed shape
// (Shape::offsets, queries = keys = T), is one call of the library's single-sequence operator.

/// Linear attention (SPEC 4): linear::forward_into per pair. save = false keeps no record.
using LinearConfig = mixattn::linear::Options;  // causal, eps, check_finite (chunk: 0)

template <class T>
SavedPtr linear_forward(const Shape& s, const LinearConfig& c, const T* q, const T* k, const T* v,
                        T* out, bool save);

template <class T>
void linear_backward(const Shape& s, const LinearConfig& c, const T* q, const T* k, const T* v,
                     const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv);

/// Performer (SPEC 5): `features` (H, m, r), head h's directions W_h (a constant: no gradient).
using PerformerConfig = mixattn::performer::Options;  // linear's plus scale (0: r^(-1/4))

template <class T>
SavedPtr performer_forward(const Shape& s, const PerformerConfig& c, Index m, const T* q,
                           const T* k, const T* v, const T* features, T* out, bool save);

template <class T>
void performer_backward(const Shape& s, const PerformerConfig& c, Index m, const T* q, const T* k,
                        const T* v, const T* features, const T* grad_out, const SavedPtr& saved,
                        T* dq, T* dk, T* dv);

/// `heads` draws of performer::Features<double>::random(m, r, seed + h, draw) into out
/// (heads, m, r): the directions of every head, in double (a float call rounds them).
void performer_draw(Index heads, Index m, Index r, std::uint64_t seed, bool orthogonal,
                    double* out);

/// Static-codebook VQ attention (SPEC 6): `codebook` (H, S, r), head h's codes; dcodebook
/// (H, S, r) summed over the batch (in batch order, whatever the thread count).
using VqConfig = mixattn::vq::Options;  // linear's plus scale (0: 1/sqrt(r))

template <class T>
SavedPtr vq_forward(const Shape& s, const VqConfig& c, Index codes, const T* q, const T* k,
                    const T* v, const T* codebook, T* out, bool save);

template <class T>
void vq_backward(const Shape& s, const VqConfig& c, Index codes, const T* q, const T* k, const T* v,
                 const T* codebook, const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv,
                 T* dcodebook);

/// Sliding-window causal softmax attention (SPEC 7): window::forward_into per pair.
using WindowConfig = mixattn::window::Options;  // window, scale (0: 1/sqrt(r)), check_finite

template <class T>
SavedPtr window_forward(const Shape& s, const WindowConfig& c, const T* q, const T* k, const T* v,
                        T* out, bool save);

template <class T>
void window_backward(const Shape& s, const WindowConfig& c, const T* q, const T* k, const T* v,
                     const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv);

/// RoPE (SPEC 8) of x (B, H, N, r) into out (same shape): every pair's row n at position
/// start + n (a packed shape: row n of each sequence), rope::apply_into; `backward` rotates back
/// (rope::backward_into, the gradient). s.queries and s.key_dim are N and r.
using RopeConfig = mixattn::rope::Options;  // base, check_finite

template <class T>
void rope_rotate(const Shape& s, const RopeConfig& c, Index start, const T* x, T* out,
                 bool backward);

// --- The gated delta rule (SPEC 9) -------------------------------------------------------------
using DeltaConfig = mixattn::delta::Options;  // chunk, scale (0: 1/sqrt(d_k)), normalize, ...

/// q, k (B, H, N, d_k), v (B, H, N, d_v), g and beta (B, H, N); for a packed call (the _packed
/// kernels) q, k (T, H, d_k) and v (T, H, d_v), the library's packed layout, and g, beta (H, T).
template <class T>
struct DeltaInputs {
  const T *q, *k, *v, *g, *beta;
};

/// The gradients, shaped as the inputs of DeltaInputs (written).
template <class T>
struct DeltaGrads {
  T *q, *k, *v, *g, *beta;
};

/// Every pair's start state S0 (null: zeros) and end state S (written), (streams, H, d_k, d_v)
/// contiguous float64 (the library's wide type for float and double alike, so a state passes
/// between calls unrounded); a stream is a batch entry or a packed sequence.
struct DeltaStateIO {
  const double* S0 = nullptr;
  double* S = nullptr;
};

/// dL/d(end state) in (null: the end state is not used) and dL/d(start state) out (written),
/// shaped as DeltaStateIO's.
struct DeltaStateGradIO {
  const double* dS = nullptr;
  double* dS0 = nullptr;
};

/// Writes out (B, H, N, d_v) and every pair's end state, delta::forward_into per pair continuing
/// its start state. save = false keeps no record and returns null.
template <class T>
SavedPtr delta_forward(const Shape& s, const DeltaConfig& c, const DeltaInputs<T>& in, T* out,
                       const DeltaStateIO& state, bool save);

/// Gradients of sum(grad_out . out) + <dS, end states>: of q, k, v, g, beta and the start states.
template <class T>
void delta_backward(const Shape& s, const DeltaConfig& c, const DeltaInputs<T>& in,
                    const T* grad_out, const SavedPtr& saved, const DeltaGrads<T>& out,
                    const DeltaStateGradIO& state);

/// The packed call (delta::forward_packed_into, on torch.get_num_threads() threads): out
/// (T, H, d_v), one state per (sequence, head), item b H + h.
template <class T>
SavedPtr delta_forward_packed(const PackedShape& s, const DeltaConfig& c, const DeltaInputs<T>& in,
                              T* out, const DeltaStateIO& state, bool save);

template <class T>
void delta_backward_packed(const PackedShape& s, const DeltaConfig& c, const DeltaInputs<T>& in,
                           const T* grad_out, const SavedPtr& saved, const DeltaGrads<T>& out,
                           const DeltaStateGradIO& state);

// --- Timing (the decode benchmark, bench/torch_decode_bench.py) --------------------------------

/// Heads decoded by the library directly, as bench/bench_decode.cpp does: q, k (heads, rows, r)
/// and v (heads, rows, d_v), float, contiguous; each head's state takes its first `prefill` rows
/// in one call, then each following row in one call of its own. Returns the seconds of those
/// one-token calls (steady_clock): head after head (heads x (rows - prefill) times, each head's
/// state hot in the core's caches), or, with all_heads_per_call, one time per row covering that
/// row's call on every head (what one Python call per token does; the heads' states then take
/// turns in the caches). GMA: gma::forward on a gma::Prepared made once per head, causal,
/// continuing a gma::State; mean, var_raw (heads, K, r), prior_logit (heads, K).
std::vector<double> gma_decode_seconds(const float* q, const float* k, const float* v, Index heads,
                                       Index rows, Index r, Index dv, const float* mean,
                                       const float* var_raw, const float* prior_logit, Index K,
                                       Index prefill, bool all_heads_per_call);

/// The same for OVQ: ovq::forward continuing an ovq::State with options `c` and scale beta.
std::vector<double> ovq_decode_seconds(const float* q, const float* k, const float* v, Index heads,
                                       Index rows, Index r, Index dv, float beta,
                                       const OvqConfig& c, Index prefill, bool all_heads_per_call);

}  // namespace mixattn_torch
