// python/csrc/bindings.hpp — what the binding translation units share (bindings.cpp: the
// operators and the module; caches.cpp: the decoding caches): the checks that turn Python
// arguments into the kernels' shapes and options, the boxes handed to Python, dtype dispatch.
//
// Errors: bad shapes, dtypes, devices or options raise ValueError naming the Python function
// and the argument (std::invalid_argument); the library's own checks (non-finite inputs:
// ValueError from std::domain_error) pass through.
#pragma once

#include "kernels.hpp"

// torch/python.h (pybind11 with the tensor type casters) and ATen instead of torch/extension.h,
// which adds the whole C++ frontend (nn, optim, data) and doubles the compile time.
#include <ATen/ATen.h>
#include <torch/python.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mixattn_torch {

/// What a forward hands to Python for its backward: the kernels' record and which operator and
/// scalar type made it (a record is only ever read back as the type it was made as). A forward
/// told save=False (no gradient will be asked for) hands back a null record.
struct SavedBox {
  std::string kind;
  SavedPtr record;
};

[[noreturn]] inline void fail(const std::string& fn, const std::string& what) {
  throw std::invalid_argument(fn + ": " + what);
}

inline std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

inline std::string dtype_name(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type()));
}

/// A number as Python writes it in a message (1e-06, 0.0001, 256).
inline std::string number(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

/// What a tensor that is not a dense CPU one is, for messages ("meta", "cuda:0 Sparse").
inline std::string place_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.device();
  if (t.layout() != at::kStrided) os << " " << t.layout();
  return os.str();
}

/// A dense CPU float32/float64 tensor of `dim` dimensions, of the same dtype as `like`, made
/// contiguous (a no-op when it already is; a copy for a strided view or an expanded tensor,
/// whose entries overlap in memory) with any lazy negation resolved.
inline at::Tensor checked(const at::Tensor& t, const std::string& fn, const char* name, int64_t dim,
                          const at::Tensor& like) {
  if (!t.defined()) fail(fn, std::string(name) + " is undefined");
  if (t.device().type() != at::kCPU || t.layout() != at::kStrided)
    fail(fn, std::string(name) + " must be a dense CPU tensor, got a " + place_of(t) + " tensor");
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble)
    fail(fn, std::string(name) + " must be float32 or float64, got " + dtype_name(t));
  if (t.scalar_type() != like.scalar_type())
    fail(fn, std::string(name) + " is " + dtype_name(t) + " but q is " + dtype_name(like));
  if (t.dim() != dim)
    fail(fn, std::string(name) + " must have " + std::to_string(dim) + " dimensions, got shape " +
                 shape_of(t));
  if (t.is_neg() || t.is_conj()) return t.resolve_conj().resolve_neg().contiguous();
  return t.contiguous();
}

inline void expect_size(const std::string& fn, const at::Tensor& t, const char* name, int64_t axis,
                        int64_t want, const char* meaning) {
  if (t.size(axis) != want)
    fail(fn, std::string(name) + " has shape " + shape_of(t) + " but dimension " +
                 std::to_string(axis) + " must be " + std::to_string(want) + " (" + meaning + ")");
}

/// q (B, H, N, r), k (B, H, M, r), v (B, H, M, d_v) checked against each other; r, d_v >= 1.
inline Shape attention_shape(const std::string& fn, at::Tensor& q, at::Tensor& k, at::Tensor& v) {
  q = checked(q, fn, "q", 4, q);
  k = checked(k, fn, "k", 4, q);
  v = checked(v, fn, "v", 4, q);
  Shape s;
  s.batch = q.size(0);
  s.heads = q.size(1);
  s.queries = q.size(2);
  s.key_dim = q.size(3);
  s.keys = k.size(2);
  s.value_dim = v.size(3);
  expect_size(fn, k, "k", 0, s.batch, "batch of q");
  expect_size(fn, k, "k", 1, s.heads, "heads of q");
  expect_size(fn, k, "k", 3, s.key_dim, "key dim of q");
  expect_size(fn, v, "v", 0, s.batch, "batch of q");
  expect_size(fn, v, "v", 1, s.heads, "heads of q");
  expect_size(fn, v, "v", 2, s.keys, "tokens of k");
  if (s.key_dim < 1) fail(fn, "q has shape " + shape_of(q) + ": its key dim (dimension 3) is 0");
  if (s.value_dim < 1)
    fail(fn, "v has shape " + shape_of(v) + ": its value dim (dimension 3) is 0");
  return s;
}

/// The batch dimension of the call's tensors: 1 for sequences packed along the tokens (Shape::
/// offsets, where s.batch counts the sequences).
inline int64_t tensor_batch(const Shape& s) {
  return s.offsets.empty() ? s.batch : 1;
}

/// grad_out (B, H, N, d_v), like the forward's output.
inline at::Tensor checked_grad_out(const std::string& fn, const at::Tensor& grad_out,
                                   const Shape& s, const at::Tensor& like) {
  at::Tensor g = checked(grad_out, fn, "grad_out", 4, like);
  if (g.sizes() != at::IntArrayRef({tensor_batch(s), s.heads, s.queries, s.value_dim}))
    fail(fn, "grad_out has shape " + shape_of(g) + ", not the output's");
  return g;
}

inline SavedBox box(const std::string& kind, const at::Tensor& like, SavedPtr record) {
  return SavedBox{kind + "/" + dtype_name(like), std::move(record)};
}

inline const SavedPtr& unbox(const SavedBox& saved, const std::string& kind, const at::Tensor& like,
                             const std::string& fn) {
  const std::string want = kind + "/" + dtype_name(like);
  if (saved.kind == want && !saved.record)
    fail(fn, "saved holds no record: its forward ran with no gradient to compute (save=False)");
  if (saved.kind != want)
    fail(fn, "saved was made by " + (saved.kind.empty() ? std::string("nothing") : saved.kind) +
                 ", not by " + want);
  return saved.record;
}

/// f(T{}) for the scalar type of `t` (checked() admitted only float32 and float64).
template <class F>
decltype(auto) dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  return f(double{});
}

/// Whether every entry of a contiguous float32/float64 tensor is finite: one branch-free pass
/// over the exponent bits (all set: inf or NaN), for the checks made before a cache changes.
inline bool all_finite(const at::Tensor& t) {
  return dispatch(t, [&](auto x) {
    using T = decltype(x);
    using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    constexpr Bits exponent = sizeof(T) == 4 ? Bits(0x7F800000u) : Bits(0x7FF0000000000000ull);
    const T* p = t.data_ptr<T>();
    Bits bad = 0;
    for (int64_t i = 0, n = t.numel(); i < n; ++i) {
      Bits b;
      std::memcpy(&b, p + i, sizeof(T));
      bad |= static_cast<Bits>((b & exponent) == exponent);
    }
    return bad == 0;
  });
}

// --- GMA ---------------------------------------------------------------------------------------

struct GmaArgs {
  Shape shape;
  GmaConfig config;
  at::Tensor q, k, v, mean, var_raw, prior_logit;
};

inline GmaArgs gma_args(const std::string& fn, at::Tensor q, at::Tensor k, at::Tensor v,
                        at::Tensor mean, at::Tensor var_raw, at::Tensor prior_logit, bool causal,
                        double eps, double var_floor, bool check_finite) {
  GmaArgs a;
  a.shape = attention_shape(fn, q, k, v);
  a.mean = checked(mean, fn, "mean", 3, q);
  a.var_raw = checked(var_raw, fn, "var_raw", 3, q);
  a.prior_logit = checked(prior_logit, fn, "prior_logit", 2, q);
  a.config.components = a.mean.size(1);
  expect_size(fn, a.mean, "mean", 0, a.shape.heads, "heads of q");
  expect_size(fn, a.mean, "mean", 2, a.shape.key_dim, "key dim of q");
  if (a.config.components < 1) fail(fn, "mean has shape " + shape_of(a.mean) + ": no components");
  if (a.var_raw.sizes() != a.mean.sizes())
    fail(fn, "var_raw has shape " + shape_of(a.var_raw) + " but mean has " + shape_of(a.mean));
  expect_size(fn, a.prior_logit, "prior_logit", 0, a.shape.heads, "heads of q");
  expect_size(fn, a.prior_logit, "prior_logit", 1, a.config.components, "components of mean");
  if (causal && a.shape.queries != a.shape.keys)
    fail(fn, "causal needs as many queries as keys, but q has shape " + shape_of(q) +
                 " and k has " + shape_of(k));
  a.config.options.causal = causal;
  a.config.options.eps = eps;
  a.config.options.check_finite = check_finite;
  a.config.var_floor = var_floor;
  a.q = q;
  a.k = k;
  a.v = v;
  return a;
}

template <class T>
GmaInputs<T> gma_inputs(const GmaArgs& a) {
  return {a.q.data_ptr<T>(),    a.k.data_ptr<T>(),       a.v.data_ptr<T>(),
          a.mean.data_ptr<T>(), a.var_raw.data_ptr<T>(), a.prior_logit.data_ptr<T>()};
}

/// A causal prefix state tensor (S: (B, H, K, d_v), z: (B, H, K)): dense CPU float64 of exactly
/// `sizes`, made contiguous.
inline at::Tensor checked_state(const std::string& fn, const at::Tensor& t, const char* name,
                                const std::vector<int64_t>& sizes) {
  if (!t.defined()) fail(fn, std::string(name) + " is undefined");
  if (t.device().type() != at::kCPU || t.layout() != at::kStrided)
    fail(fn, std::string(name) + " must be a dense CPU tensor, got a " + place_of(t) + " tensor");
  if (t.scalar_type() != at::kDouble)
    fail(fn, std::string(name) +
                 " must be float64 (the state's type for float32 and float64 "
                 "inputs), got " +
                 dtype_name(t));
  if (t.sizes() != at::IntArrayRef(sizes)) {
    std::ostringstream want;
    want << at::IntArrayRef(sizes);
    fail(fn, std::string(name) + " has shape " + shape_of(t) + " but must be " + want.str() +
                 " (batch, heads, components" + (sizes.size() == 4 ? ", value dim)" : ")"));
  }
  return t.contiguous();
}

/// The packed call of (1, H, T, .) tensors already checked against each other (q and k with the
/// same T); the library checks the offsets.
inline PackedShape packed_shape(const std::string& fn, const Shape& s,
                                const std::vector<int64_t>& offsets) {
  if (s.batch != 1 || s.queries != s.keys)
    fail(fn,
         "cu_seqlens packs the sequences along the tokens of one batch entry: q and k must "
         "be (1, H, T, .) with the same T, got batch " +
             std::to_string(s.batch) + ", " + std::to_string(s.queries) + " queries and " +
             std::to_string(s.keys) + " keys");
  PackedShape p;
  p.heads = s.heads;
  p.rows = s.queries;
  p.key_dim = s.key_dim;
  p.value_dim = s.value_dim;
  p.offsets.assign(offsets.begin(), offsets.end());
  return p;
}

/// The state and cache paths' shape: as is without cu_seqlens (`offsets` empty); with them,
/// (1, H, T, .) tensors holding offsets.size() - 1 sequences, one state each (Shape::offsets),
/// the offsets checked here (0 first, T last, nondecreasing).
inline Shape sequences_shape(const std::string& fn, Shape s, const std::vector<int64_t>& offsets) {
  if (offsets.empty()) return s;
  const PackedShape p = packed_shape(fn, s, offsets);  // batch 1, as many keys as queries
  bool ok = p.offsets.size() >= 2 && p.offsets.front() == 0 && p.offsets.back() == p.rows;
  for (std::size_t i = 1; ok && i < p.offsets.size(); ++i) ok = p.offsets[i - 1] <= p.offsets[i];
  if (!ok)
    fail(fn, "cu_seqlens must hold N + 1 >= 2 nondecreasing offsets from 0 to the " +
                 std::to_string(p.rows) + " tokens of q");
  s.batch = static_cast<Index>(p.offsets.size()) - 1;
  s.offsets = p.offsets;
  return s;
}

// --- OVQ ---------------------------------------------------------------------------------------

/// q, k (B, H, T, r), v (B, H, T, d_v) and beta (H) checked; beta made contiguous like q.
inline Shape ovq_shape(const std::string& fn, at::Tensor& q, at::Tensor& k, at::Tensor& v,
                       at::Tensor& beta) {
  const Shape s = attention_shape(fn, q, k, v);
  if (s.keys != s.queries)
    fail(fn, "OVQ is causal self-attention: k has shape " + shape_of(k) + " but q has " +
                 shape_of(q) + " (as many tokens needed)");
  beta = checked(beta, fn, "beta", 1, q);
  expect_size(fn, beta, "beta", 0, s.heads, "heads of q");
  return s;
}

/// The options that shape an OVQ dictionary (all but check_finite and grad_through_dictionary,
/// which a continuation may change), written as the Python keywords.
inline std::string state_options(const OvqConfig& c) {
  using mixattn::ovq::Assignment;
  using mixattn::ovq::Growth;
  using mixattn::ovq::Seeding;
  std::ostringstream os;
  os << "block=" << c.block << ", max_centroids=" << c.max_centroids
     << ", growth=" << (c.growth == Growth::linear ? "linear" : "plateau")
     << ", growth_alpha=" << c.growth_alpha
     << ", seeding=" << (c.seeding == Seeding::one_shot ? "one_shot" : "greedy_dispersion")
     << ", assignment="
     << (c.assignment == Assignment::existing_only ? "existing_only" : "all_centroids")
     << ", count_bias=" << (c.count_bias ? "True" : "False") << ", norm_eps=" << c.norm_eps;
  return os.str();
}

/// Whether two OVQ options agree on everything state_options() names.
inline bool same_state_options(const OvqConfig& a, const OvqConfig& b) {
  return a.block == b.block && a.max_centroids == b.max_centroids && a.growth == b.growth &&
         a.growth_alpha == b.growth_alpha && a.seeding == b.seeding &&
         a.assignment == b.assignment && a.count_bias == b.count_bias && a.norm_eps == b.norm_eps;
}

/// The dictionaries an ovq_attention call ended with (its copying form), one library ovq::State
/// per (stream, head): opaque to Python and never changed; the next call given it continues a
/// copy. Also a decoding cache's snapshot (OvqCache.state()) and its starting point.
struct OvqStateBox {
  std::string kind;  // scalar type it holds, e.g. "ovq-state/Double"
  Shape shape;       // streams (batch entries or sequences), heads, key dim, value dim
  OvqConfig config;  // the options it was made with
  std::shared_ptr<const PairStates> states;
};

inline std::string ovq_state_kind(const at::Tensor& q) {
  return "ovq-state/" + dtype_name(q);
}

/// (streams, heads, key dim, value dim) of a state or cache, for messages.
inline std::string stream_sizes(const Shape& s) {
  return "(" + std::to_string(s.batch) + ", " + std::to_string(s.heads) + ", " +
         std::to_string(s.key_dim) + ", " + std::to_string(s.value_dim) + ")";
}

inline bool same_streams(const Shape& a, const Shape& b) {
  return a.batch == b.batch && a.heads == b.heads && a.key_dim == b.key_dim &&
         a.value_dim == b.value_dim;
}

/// Registers OvqCache and GmaCache and the cache forwards (caches.cpp) on the module.
void define_caches(pybind11::module_& m);

}  // namespace mixattn_torch
