// python/csrc/bindings.hpp — what the binding translation units share (ops.cpp: the registered
// operators; caches.cpp: the decoding caches; bindings.cpp: the Python module): the checks that
// turn the operators' arguments into the kernels' shapes and options, the handles that carry
// the kernels' objects through tensors, dtype dispatch.
//
// Errors: bad shapes, dtypes, devices or options throw std::invalid_argument naming the Python
// function and the argument; the library's own checks (non-finite inputs: std::domain_error)
// pass through. The operators turn both into ValueError (as_torch_errors(), below).
#pragma once

#include "kernels.hpp"

#include <mixattn/detail/common/fingerprint.hpp>

// ATen alone: the operators' translation units need neither pybind11 nor the C++ frontend.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixattn_torch {

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

// --- Handles: the kernels' objects carried by tensors -------------------------------------------
//
// A forward's record (the library's Saved per pair), an OVQ state, a decoding cache and a
// prepared mixture are C++ objects. An operator hands one out as a handle: a 48-byte uint8
// tensor whose storage owns the object (the storage's deleter frees it), so the object lives
// exactly as long as autograd, torch.compile's graphs or Python hold the tensor. A handle is
// recognised by its storage's deleter; its bytes name what it holds (its kind, e.g.
// "gma/Float"), so two handles of one kind compare equal, as a compiled graph's and the eager
// call's must, and a copy of a handle (which owns nothing) still says what it was a copy of: a
// backward given a copy of a record computes the record again where its inputs suffice, and
// refuses by name where they do not. A cache's handle adds a key under which a copy finds the
// cache while the handle itself lives (caches.cpp).

constexpr int64_t kHandleBytes = 48;
constexpr std::size_t kKindBytes = 32;  // then a 16-byte key

struct Held {
  std::string kind;  // what it holds, e.g. "gma/Float" (a GMA record of float32 calls)
  std::shared_ptr<void> object;
  // A prepared mixture found stale by a forward (its tensors changed behind the version
  // counter's back): mixattn.functional then drops it from its cache.
  std::atomic<bool> stale{false};
  unsigned char bytes[kHandleBytes] = {};  // the tensor's contents: the kind, then any key
};

inline void mark_stale(const Held& held) {
  const_cast<Held&>(held).stale.store(true);
}

inline void delete_held(void* held) {
  delete static_cast<Held*>(held);
}

/// A handle owning `object`; its bytes are the kind (a C string of at most 31 characters),
/// then `key` (16 bytes, if given).
inline at::Tensor make_handle(std::string kind, std::shared_ptr<void> object,
                              const unsigned char* key = nullptr) {
  auto* held = new Held{std::move(kind), std::move(object)};
  std::memcpy(held->bytes, held->kind.data(), std::min(held->kind.size(), kKindBytes - 1));
  if (key != nullptr) std::memcpy(held->bytes + kKindBytes, key, 16);
  c10::DataPtr data(held->bytes, held, &delete_held, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), kHandleBytes, std::move(data), nullptr,
                       false);
  return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {kHandleBytes}, {1});
}

/// The object a handle holds, or null if `t` is not a handle.
inline const Held* held_by(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != at::kCPU || !t.has_storage()) return nullptr;
  const c10::DataPtr& data = t.storage().data_ptr();
  if (data.get_deleter() != &delete_held) return nullptr;
  return static_cast<const Held*>(data.get_context());
}

/// The kind a handle or a copy of one names in its bytes; "" for any other tensor.
inline std::string kind_named_by(const at::Tensor& t) {
  if (const Held* held = held_by(t)) return held->kind;
  if (!t.defined() || t.device().type() != at::kCPU || t.layout() != at::kStrided ||
      t.scalar_type() != at::kByte || t.dim() != 1 || t.numel() != kHandleBytes)
    return "";
  const at::Tensor c = t.contiguous();
  const auto* b = reinterpret_cast<const char*>(c.data_ptr<uint8_t>());
  const std::size_t n = strnlen(b, kKindBytes);
  return n < kKindBytes ? std::string(b, n) : std::string();
}

/// The 16-byte key of a handle or of a copy of one (after the kind; kind_named_by(t) != "").
inline void key_named_by(const at::Tensor& t, unsigned char* key) {
  const at::Tensor c = t.contiguous();
  std::memcpy(key, c.data_ptr<uint8_t>() + kKindBytes, 16);
}

/// The record of a forward of kind `kind` ("gma", "flash", ...) for `like`'s scalar type.
inline at::Tensor record_handle(const std::string& kind, const at::Tensor& like, SavedPtr rec) {
  return make_handle(kind + "/" + dtype_name(like), std::move(rec));
}

/// The record `saved` holds, of kind `kind` for `like`'s dtype. A copy of such a record (its
/// bytes without the object) gives null when `recomputable` (the caller then runs the forward
/// again for it) and is refused otherwise.
inline SavedPtr record_of(const at::Tensor& saved, const std::string& kind, const at::Tensor& like,
                          const std::string& fn, bool recomputable) {
  const std::string want = kind + "/" + dtype_name(like);
  const Held* held = held_by(saved);
  const std::string named = kind_named_by(saved);
  if (named.empty())
    fail(fn, "saved is not a record that a forward of this package made (got a tensor of shape " +
                 (saved.defined() ? shape_of(saved) : std::string("undefined")) + ")");
  if (named != want) fail(fn, "saved was made by " + named + ", not by " + want);
  if (held == nullptr) {
    if (!recomputable)
      fail(fn, "saved is a copy of a " + want +
                   " record, which owns nothing; only the record itself holds what this "
                   "backward needs (the state its forward started from)");
    return nullptr;
  }
  if (!held->object)
    fail(fn, "saved holds no record: its forward ran with no gradient to compute (save=False)");
  return held->object;
}

/// Runs an operator's body, turning the checks' exceptions into PyTorch's: std::invalid_argument
/// and std::domain_error (bad arguments, non-finite inputs) into ValueError, anything else
/// (a cache in use on another thread, the library's overflow checks) into RuntimeError.
template <class F>
decltype(auto) as_torch_errors(F&& f) {
  try {
    return f();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::domain_error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

/// The message of offsets that do not split `tokens` tokens, as the Python side words it.
inline void check_offsets(const std::string& fn, const std::vector<int64_t>& o, int64_t tokens) {
  bool ok = o.size() >= 2 && o.front() == 0 && o.back() == tokens;
  for (std::size_t i = 1; ok && i < o.size(); ++i) ok = o[i - 1] <= o[i];
  if (ok) return;
  std::ostringstream os;
  os << "cu_seqlens is [";
  for (std::size_t i = 0; i < o.size(); ++i) os << (i ? ", " : "") << o[i];
  os << "]; it must hold N + 1 >= 2 nondecreasing offsets from 0 to the " << tokens
     << " tokens of q";
  fail(fn, os.str());
}

/// cu_seqlens (None: an empty list, no packing) as the offsets of a packed call: a 1-D int32 or
/// int64 CPU tensor.
/// A given cu_seqlens with fewer than 2 entries is refused here (an empty list means no packing
/// to the kernels' shapes).
inline std::vector<int64_t> offsets_of(const std::string& fn,
                                       const std::optional<at::Tensor>& cu_seqlens,
                                       const at::Tensor& q) {
  std::vector<int64_t> offsets;
  if (!cu_seqlens.has_value() || !cu_seqlens->defined()) return offsets;
  const at::Tensor& t = *cu_seqlens;
  if (t.device().type() != at::kCPU || t.layout() != at::kStrided)
    fail(fn, "cu_seqlens must be a CPU tensor, got a " + place_of(t) + " tensor");
  if (t.dim() != 1 || (t.scalar_type() != at::kInt && t.scalar_type() != at::kLong))
    fail(fn, "cu_seqlens must be a 1-D int32 or int64 tensor, got " + dtype_name(t) + " of shape " +
                 shape_of(t));
  const at::Tensor c = t.to(at::kLong).contiguous();
  offsets.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  if (offsets.size() < 2) check_offsets(fn, offsets, q.dim() == 4 ? q.size(2) : -1);
  return offsets;
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
  check_offsets(fn, offsets, s.queries);
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
  const PackedShape p = packed_shape(fn, s, offsets);
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

inline OvqConfig ovq_config(const std::string& fn, int64_t block, int64_t max_centroids,
                            const std::string& growth, double growth_alpha,
                            const std::string& seeding, const std::string& assignment,
                            bool count_bias, bool grad_through_dictionary, double norm_eps,
                            bool check_finite) {
  using mixattn::ovq::Assignment;
  using mixattn::ovq::Growth;
  using mixattn::ovq::Seeding;
  OvqConfig c;
  c.block = block;
  c.max_centroids = max_centroids;
  if (growth != "plateau" && growth != "linear")
    fail(fn, "growth is '" + growth + "'; it must be 'plateau' or 'linear'");
  c.growth = growth == "linear" ? Growth::linear : Growth::plateau;
  c.growth_alpha = growth_alpha;
  if (seeding != "greedy_dispersion" && seeding != "one_shot")
    fail(fn, "seeding is '" + seeding + "'; it must be 'greedy_dispersion' or 'one_shot'");
  c.seeding = seeding == "one_shot" ? Seeding::one_shot : Seeding::greedy_dispersion;
  if (assignment != "all_centroids" && assignment != "existing_only")
    fail(fn, "assignment is '" + assignment + "'; it must be 'all_centroids' or 'existing_only'");
  c.assignment =
      assignment == "existing_only" ? Assignment::existing_only : Assignment::all_centroids;
  c.count_bias = count_bias;
  c.grad_through_dictionary = grad_through_dictionary;
  c.norm_eps = norm_eps;
  c.check_finite = check_finite;
  return c;
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

/// Every live OVQ state under its key, a fingerprint of its contents and of what it was made
/// with, so that a copy of its handle (a deep copy, opcheck's) reaches it while the handle that
/// owns it lives. A state never changes, and two states with one key hold the same dictionaries,
/// so the key also makes the handles of an eager call and of its compiled twin compare equal.
struct OvqStateRegistry {
  std::mutex mutex;
  std::unordered_map<std::uint64_t, std::pair<std::uint64_t, std::weak_ptr<const OvqStateBox>>>
      boxes;
};

// Never destroyed: a state may be dropped while the interpreter shuts down.
inline OvqStateRegistry& ovq_state_registry() {
  static auto* const registry = new OvqStateRegistry;
  return *registry;
}

inline at::Tensor ovq_state_handle(OvqStateBox box_value) {
  std::uint64_t key[2];
  key[0] = box_value.states->content_fingerprint();
  key[1] = mixattn::detail::Fingerprint()
               .add(static_cast<Index>(std::hash<std::string>{}(box_value.kind + " " +
                                                                state_options(box_value.config))))
               .add(box_value.shape.batch)
               .add(box_value.shape.heads)
               .add(box_value.shape.key_dim)
               .add(box_value.shape.value_dim)
               .value();
  const std::uint64_t id = key[0], check = key[1];
  // The entry goes with the box (if it is still the box's: a twin may have taken the key).
  std::shared_ptr<const OvqStateBox> box(new OvqStateBox(std::move(box_value)),
                                         [id](const OvqStateBox* b) {
                                           {
                                             OvqStateRegistry& r = ovq_state_registry();
                                             const std::lock_guard<std::mutex> lock(r.mutex);
                                             const auto it = r.boxes.find(id);
                                             if (it != r.boxes.end()) {
                                               const auto live = it->second.second.lock();
                                               if (!live || live.get() == b) r.boxes.erase(it);
                                             }
                                           }
                                           delete b;
                                         });
  {
    OvqStateRegistry& r = ovq_state_registry();
    const std::lock_guard<std::mutex> lock(r.mutex);
    auto& entry = r.boxes[id];
    if (entry.second.expired()) entry = {check, box};
  }
  const std::string kind = box->kind;
  return make_handle(kind, std::const_pointer_cast<OvqStateBox>(box),
                     reinterpret_cast<const unsigned char*>(key));
}

/// The OVQ state a handle (or a copy of one) names, null if it names none that lives; `keep`
/// holds it for the caller.
inline const OvqStateBox* ovq_state_named_by(const at::Tensor& t,
                                             std::shared_ptr<const OvqStateBox>& keep) {
  if (kind_named_by(t).rfind("ovq-state/", 0) != 0) return nullptr;
  if (const Held* held = held_by(t)) return static_cast<const OvqStateBox*>(held->object.get());
  std::uint64_t key[2];
  key_named_by(t, reinterpret_cast<unsigned char*>(key));
  OvqStateRegistry& r = ovq_state_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.boxes.find(key[0]);
  if (it == r.boxes.end() || it->second.first != key[1]) return nullptr;
  keep = it->second.second.lock();
  return keep.get();
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

}  // namespace mixattn_torch
