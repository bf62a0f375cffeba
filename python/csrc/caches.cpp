// python/csrc/caches.cpp — the decoding caches, mixattn.OvqCache and mixattn.GmaCache: one
// library State per (stream, head) that a call continues in place (no copy of a dictionary or
// of a prefix state), the registered forwards that run them (torch.ops.mixattn.*_forward_cached,
// whose schemas mark the cache as mutated) and the functions the Python classes call.
//
// A cache is a handle (bindings.hpp): the Python object holds the tensor whose storage owns the
// cache, and passes it to the operators.
//
// A cache binds to the first call it serves (scalar type, streams, heads, key and value dims,
// the options that shape its states); a later call that differs is refused with ValueError
// naming `cache`. Everything a call can check is checked before any state changes (shapes,
// options, finite inputs and a positive beta), so a refused call leaves the cache as it was; a
// failure after some pairs have advanced (the library's overflow checks, memory) leaves it
// unusable until reset(), and says so. One call at a time: a second thread using the same cache
// meanwhile gets RuntimeError, not a race.
#include "bindings.hpp"

#include <torch/library.h>
#include <torch/python.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <random>
#include <tuple>
#include <unordered_map>

namespace mixattn_torch {
namespace {

namespace py = pybind11;

/// What both caches hold: the binding (scalar type and sizes, "" and zeros until the first
/// call), the states, and whether a failed call left them part-way.
class Cache {
 public:
  std::uint64_t registry_key = 0;  // its entry in cache_registry() (0: none)
  ~Cache();

  std::string dtype;  // e.g. "Float"; empty until bound
  Shape shape;        // batch = streams, heads, key_dim, value_dim (tokens unused)
  std::unique_ptr<PairStates> states;
  std::string broken;  // why calls are refused, if they are
  std::atomic<bool> busy{false};

  bool bound() const { return !dtype.empty(); }

  /// The binding and a copy of the states (for copy()); not the busy flag.
  void copy_into(Cache& to) const {
    to.dtype = dtype;
    to.shape = shape;
    to.states = states ? states->clone() : nullptr;
    to.broken = broken;
  }

  void reset() {
    dtype.clear();
    shape = Shape{};
    states.reset();
    broken.clear();
  }

  /// Tokens each stream has taken (its first head's state: the heads advance together).
  std::vector<Index> tokens_seen() const {
    std::vector<Index> per_stream;
    if (!states) return per_stream;
    if (shape.heads == 0) return std::vector<Index>(static_cast<std::size_t>(shape.batch), 0);
    const std::vector<Index> pairs = states->tokens_seen();
    for (Index b = 0; b < shape.batch; ++b)
      per_stream.push_back(pairs[static_cast<std::size_t>(b * shape.heads)]);
    return per_stream;
  }

  std::string dtype_label() const {
    return dtype == "Float" ? "float32" : dtype == "Double" ? "float64" : dtype;
  }
};

/// The cache for the length of one call or method: a second user meanwhile (another thread, the
/// GIL being released inside the kernels) is refused rather than racing.
class Exclusive {
 public:
  Exclusive(Cache& c, const std::string& fn) : c_(c) {
    if (c.busy.exchange(true))
      throw std::runtime_error(fn +
                               ": cache is in use by a call on another thread; a cache "
                               "serves one call at a time (give each thread its own)");
  }
  ~Exclusive() { c_.busy.store(false); }
  Exclusive(const Exclusive&) = delete;
  Exclusive& operator=(const Exclusive&) = delete;

 private:
  Cache& c_;
};

void check_usable(const Cache& c, const std::string& fn) {
  if (!c.broken.empty())
    fail(fn,
         "cache is unusable: an earlier call failed after some of its (stream, head) pairs "
         "had advanced (" +
             c.broken + "); reset() it or make a new one");
}

/// The call's streams and sizes against the cache's (bound already).
void check_sizes(const Cache& c, const std::string& fn, const Shape& s, const at::Tensor& q,
                 const at::Tensor& v) {
  if (c.dtype != dtype_name(q))
    fail(fn, "cache holds the states of " + c.dtype + " calls but q is " + dtype_name(q));
  if (!same_streams(c.shape, s))
    fail(fn, "cache was made for (batch or sequences, heads, key dim, value dim) = " +
                 stream_sizes(c.shape) + " but q has shape " + shape_of(q) + " and v has " +
                 shape_of(v) +
                 (s.offsets.empty() ? std::string()
                                    : " with " + std::to_string(s.batch) + " sequences"));
}

void bind_sizes(Cache& c, const Shape& s, const at::Tensor& q) {
  c.dtype = dtype_name(q);
  c.shape = s;
  c.shape.queries = c.shape.keys = 0;
  c.shape.offsets.clear();
}

/// Runs a cache forward; if it throws after some pairs advanced, the cache is marked unusable.
template <class Run>
SavedPtr guarded(Cache& c, Run&& run) {
  const std::vector<Index> before = c.states->tokens_seen();
  try {
    return run();
  } catch (const std::exception& e) {
    if (c.states->tokens_seen() != before) c.broken = e.what();
    throw;
  } catch (...) {
    if (c.states->tokens_seen() != before) c.broken = "an unknown error";
    throw;
  }
}

/// q, k, v (and beta) finite, checked before a cache changes (the kernels check them again per
/// pair, but by then other pairs may have advanced).
void check_finite_inputs(const std::string& fn,
                         std::initializer_list<std::pair<const char*, const at::Tensor*>> ts) {
  for (const auto& [name, t] : ts)
    if (!all_finite(*t))
      throw std::domain_error(fn + ": " + name +
                              " has a non-finite entry (check_finite=True); the cache is left "
                              "as it was");
}

// --- OVQ ---------------------------------------------------------------------------------------

class OvqCache : public Cache {
 public:
  OvqConfig config;

  std::string describe() const {
    if (!bound()) return "OvqCache(empty: binds to its first call)";
    return "OvqCache(" + dtype_label() +
           ", (batch or sequences, heads, key dim, value dim) = " + stream_sizes(shape) + ", " +
           state_options(config) + ")";
  }
};

void bind_cache(OvqCache& c, const std::string& fn, const Shape& s, const at::Tensor& q,
                const at::Tensor& v, const OvqConfig& config) {
  if (!c.bound()) {
    bind_sizes(c, s, q);
    c.config = config;
    c.states = dispatch(q, [&](auto t) {
      return ovq_states<decltype(t)>(s.batch * s.heads, s.key_dim, s.value_dim);
    });
    return;
  }
  check_sizes(c, fn, s, q, v);
  if (!same_state_options(c.config, config))
    fail(fn, "cache was made with " + state_options(c.config) + " but this call has " +
                 state_options(config));
}

/// Each head's beta positive and, with check_finite, finite with beta sqrt(r) finite: what the
/// library requires of every pair, checked for all heads before any pair runs.
void check_beta(const std::string& fn, const at::Tensor& beta, Index r, bool check_finite) {
  dispatch(beta, [&](auto x) {
    using T = decltype(x);
    const T* b = beta.data_ptr<T>();
    const T root = static_cast<T>(std::sqrt(static_cast<double>(r)));
    for (int64_t h = 0; h < beta.numel(); ++h) {
      if (b[h] <= 0 || (check_finite && !std::isfinite(b[h] * root)))
        fail(fn, "beta[" + std::to_string(h) + "] is " + number(static_cast<double>(b[h])) +
                     "; the scale factor must be > 0" +
                     (check_finite ? " with beta * sqrt(r) finite" : "") +
                     " (the cache is left as it was)");
    }
  });
}

constexpr const char* kOvqCache = "cache/ovq";
constexpr const char* kGmaCache = "cache/gma";

/// Every live cache under its key (its handle's bytes after the kind: a serial number and a
/// random nonce), so that a copy of a handle (a schema check's, a deep copy's) reaches the cache
/// while the handle that owns it lives; the entry goes with the cache.
struct CacheRegistry {
  std::mutex mutex;
  std::unordered_map<std::uint64_t, std::pair<std::uint64_t, std::weak_ptr<Cache>>> caches;
  std::uint64_t next = 1;
  std::mt19937_64 nonces{std::random_device{}()};
};

// Never destroyed: a cache may be dropped while the interpreter shuts down.
CacheRegistry& cache_registry() {
  static auto* const registry = new CacheRegistry;
  return *registry;
}

Cache::~Cache() {
  if (registry_key == 0) return;
  CacheRegistry& registry = cache_registry();
  const std::lock_guard<std::mutex> lock(registry.mutex);
  registry.caches.erase(registry_key);
}

/// The cache a handle (or a copy of one) names, checked to be of the kind the call needs.
template <class C>
C& cache_of(const at::Tensor& handle, const char* kind, const std::string& fn) {
  const std::string what = std::string("cache must be a mixattn.") +
                           (std::string(kind) == kOvqCache ? "OvqCache" : "GmaCache") + "'s handle";
  if (kind_named_by(handle) != kind) fail(fn, what);
  if (const Held* held = held_by(handle))
    return *static_cast<C*>(static_cast<Cache*>(held->object.get()));
  std::uint64_t key[2];
  key_named_by(handle, reinterpret_cast<unsigned char*>(key));
  CacheRegistry& registry = cache_registry();
  const std::lock_guard<std::mutex> lock(registry.mutex);
  const auto it = registry.caches.find(key[0]);
  std::shared_ptr<Cache> cache;
  if (it != registry.caches.end() && it->second.first == key[1]) cache = it->second.second.lock();
  if (!cache) fail(fn, what + " (a copy of one whose cache is gone)");
  return *static_cast<C*>(cache.get());  // the handle's owner keeps it alive for the call
}

std::tuple<at::Tensor, at::Tensor> ovq_forward_cached_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& beta_in, int64_t block, int64_t max_centroids, c10::string_view growth,
    double growth_alpha, c10::string_view seeding, c10::string_view assignment, bool count_bias,
    bool grad_through_dictionary, double norm_eps, bool check_finite, const at::Tensor& handle,
    bool save, const std::optional<at::Tensor>& cu_seqlens) {
  return as_torch_errors([&]() -> std::tuple<at::Tensor, at::Tensor> {
    const std::string fn = "mixattn.ovq_attention";
    const OvqConfig c = ovq_config(fn, block, max_centroids, std::string(growth), growth_alpha,
                                   std::string(seeding), std::string(assignment), count_bias,
                                   grad_through_dictionary, norm_eps, check_finite);
    OvqCache& cache = cache_of<OvqCache>(handle, kOvqCache, fn);
    at::Tensor q = q_in, k = k_in, v = v_in, beta = beta_in;
    const Shape s =
        sequences_shape(fn, ovq_shape(fn, q, k, v, beta), offsets_of(fn, cu_seqlens, q));
    Exclusive lock(cache, fn);
    check_usable(cache, fn);
    bind_cache(cache, fn, s, q, v, c);
    if (c.check_finite) check_finite_inputs(fn, {{"q", &q}, {"k", &k}, {"v", &v}, {"beta", &beta}});
    check_beta(fn, beta, s.key_dim, c.check_finite);
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, q.options());
    SavedPtr rec = guarded(cache, [&] {
      return dispatch(q, [&](auto t) {
        using T = decltype(t);
        return ovq_forward<T>(s, c, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                              beta.data_ptr<T>(), out.data_ptr<T>(), *cache.states, nullptr, save);
      });
    });
    return {out, record_handle("ovq-cache", q, std::move(rec))};
  });
}

std::shared_ptr<OvqCache> ovq_cache_from(const OvqStateBox& state) {
  auto c = std::make_shared<OvqCache>();
  c->dtype = state.kind.substr(state.kind.find('/') + 1);
  c->shape = state.shape;
  c->config = state.config;
  c->states = state.states->clone();
  return c;
}

std::optional<at::Tensor> ovq_cache_state(OvqCache& c) {
  Exclusive lock(c, "mixattn.OvqCache.state");
  if (!c.bound()) return std::nullopt;
  check_usable(c, "mixattn.OvqCache.state");
  return ovq_state_handle(OvqStateBox{"ovq-state/" + c.dtype, c.shape, c.config,
                                      std::shared_ptr<const PairStates>(c.states->clone())});
}

// --- GMA ---------------------------------------------------------------------------------------

/// Which tensor a prepared mixture was made from, and its version: the same TensorImpl (held
/// weakly, so it cannot be another tensor at a reused address), data pointer and version counter
/// (bumped by every in-place change: an optimizer step, copy_, load_state_dict).
struct ParamStamp {
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;
  uint32_t version = 0;
  const void* data = nullptr;

  static ParamStamp of(const at::Tensor& t) {
    ParamStamp s;
    if (!t.unsafeGetTensorImpl()->version_counter().enabled()) return s;  // an inference tensor
    s.impl.emplace(t.getIntrusivePtr());
    s.version = t.unsafeGetTensorImpl()->version_counter().current_version();
    s.data = t.data_ptr();
    return s;
  }
  bool matches(const at::Tensor& t) const {
    const auto* impl_of_t = t.unsafeGetTensorImpl();
    return impl && !impl->expired() && impl->_unsafe_get_target() == impl_of_t &&
           impl_of_t->version_counter().enabled() &&
           impl_of_t->version_counter().current_version() == version && t.data_ptr() == data;
  }
};

class GmaCache : public Cache {
 public:
  Index components = 0;
  double eps = 0, var_floor = 0;
  at::Tensor start_S, start_z;  // an initial state given at construction, until the first call
  SavedPtr prepared;            // gma_prepare's, of the mixture tensors stamped below
  ParamStamp stamps[3];
  bool prepared_checked = false;  // prepared with check_finite

  std::string describe() const {
    if (!bound())
      return std::string("GmaCache(empty") + (start_S.defined() ? ", with an initial state" : "") +
             ": binds to its first call)";
    return "GmaCache(" + dtype_label() +
           ", (batch or sequences, heads, key dim, value dim) = " + stream_sizes(shape) +
           ", components=" + std::to_string(components) + ", eps=" + number(eps) +
           ", var_floor=" + number(var_floor) + ")";
  }
};

void bind_cache(GmaCache& c, const std::string& fn, const Shape& s, const GmaArgs& a) {
  const GmaConfig& g = a.config;
  const Index K = g.components;
  if (!c.bound()) {
    if (c.start_S.defined() &&
        (c.start_S.sizes() != at::IntArrayRef({s.batch, s.heads, K, s.value_dim})))
      fail(fn, "cache starts from an initial state S of shape " + shape_of(c.start_S) +
                   " but this call has (batch or sequences, heads, components, value dim) = (" +
                   std::to_string(s.batch) + ", " + std::to_string(s.heads) + ", " +
                   std::to_string(K) + ", " + std::to_string(s.value_dim) + ")");
    bind_sizes(c, s, a.q);
    c.components = K;
    c.eps = g.options.eps;
    c.var_floor = g.var_floor;
    const double* S = c.start_S.defined() ? c.start_S.data_ptr<double>() : nullptr;
    const double* z = c.start_z.defined() ? c.start_z.data_ptr<double>() : nullptr;
    c.states = dispatch(a.q, [&](auto t) {
      return gma_states<decltype(t)>(s.batch * s.heads, K, s.value_dim, S, z);
    });
    c.start_S = c.start_z = at::Tensor();
    return;
  }
  check_sizes(c, fn, s, a.q, a.v);
  if (c.components != K)
    fail(fn, "cache was made for " + std::to_string(c.components) +
                 " components but mean has shape " + shape_of(a.mean));
  if (c.eps != g.options.eps || c.var_floor != g.var_floor)
    fail(fn, "cache was made with eps=" + number(c.eps) + ", var_floor=" + number(c.var_floor) +
                 " but this call has eps=" + number(g.options.eps) +
                 ", var_floor=" + number(g.var_floor));
}

/// The cache's prepared mixtures made current: kept while mean, var_raw and prior_logit are the
/// very tensors they were made from, unchanged (ParamStamp), else prepared again (the mixtures
/// checked finite first, so that the error names the tensor).
void ensure_prepared(GmaCache& c, const std::string& fn, const GmaArgs& a,
                     const at::Tensor (&params)[3]) {
  const bool check = a.config.options.check_finite;
  bool current = c.prepared && (c.prepared_checked || !check);
  for (int i = 0; current && i < 3; ++i) current = c.stamps[i].matches(params[i]);
  if (current) return;
  if (check)
    check_finite_inputs(
        fn, {{"mean", &a.mean}, {"var_raw", &a.var_raw}, {"prior_logit", &a.prior_logit}});
  c.prepared = dispatch(a.q, [&](auto t) {
    using T = decltype(t);
    return gma_prepare<T>(a.shape, a.config, gma_inputs<T>(a));
  });
  c.prepared_checked = check;
  for (int i = 0; i < 3; ++i) c.stamps[i] = ParamStamp::of(params[i]);
}

std::tuple<at::Tensor, at::Tensor> gma_forward_cached_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mean,
    const at::Tensor& var_raw, const at::Tensor& prior_logit, const at::Tensor& handle, double eps,
    double var_floor, bool check_finite, bool save, const std::optional<at::Tensor>& cu_seqlens) {
  return as_torch_errors([&]() -> std::tuple<at::Tensor, at::Tensor> {
    const std::string fn = "mixattn.gma_attention";
    GmaCache& cache = cache_of<GmaCache>(handle, kGmaCache, fn);
    const GmaArgs a =
        gma_args(fn, q, k, v, mean, var_raw, prior_logit, true, eps, var_floor, check_finite);
    const Shape s = sequences_shape(fn, a.shape, offsets_of(fn, cu_seqlens, a.q));
    Exclusive lock(cache, fn);
    check_usable(cache, fn);
    bind_cache(cache, fn, s, a);
    if (check_finite) check_finite_inputs(fn, {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}});
    if (!save) ensure_prepared(cache, fn, a, {mean, var_raw, prior_logit});
    at::Tensor out = at::empty({tensor_batch(s), s.heads, s.queries, s.value_dim}, a.q.options());
    SavedPtr rec = guarded(cache, [&] {
      return dispatch(a.q, [&](auto t) {
        using T = decltype(t);
        return gma_forward_cached<T>(s, a.config, gma_inputs<T>(a), out.data_ptr<T>(),
                                     *cache.states, cache.prepared, save);
      });
    });
    return {out, record_handle("gma-cache", a.q, std::move(rec))};
  });
}

std::shared_ptr<GmaCache> gma_cache_from(at::Tensor S, at::Tensor z) {
  const std::string fn = "mixattn.GmaCache";
  if (!S.defined() || S.dim() != 4)
    fail(fn,
         "initial_state[0] (S) must be a 4-dimensional (batch, heads, components, value dim) "
         "tensor, got shape " +
             (S.defined() ? shape_of(S) : std::string("undefined")));
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2), dv = S.size(3);
  auto c = std::make_shared<GmaCache>();
  c->start_S = checked_state(fn, S, "initial_state[0] (S)", {B, H, K, dv}).clone();
  c->start_z = checked_state(fn, z, "initial_state[1] (z)", {B, H, K}).clone();
  return c;
}

/// The cache's (S, z) as float64 tensors (copies), or None before its first call (and without
/// an initial state).
std::optional<std::tuple<at::Tensor, at::Tensor>> gma_cache_state(GmaCache& c) {
  Exclusive lock(c, "mixattn.GmaCache.state");
  if (!c.bound()) {
    if (!c.start_S.defined()) return std::nullopt;
    return std::make_tuple(c.start_S.clone(), c.start_z.clone());
  }
  check_usable(c, "mixattn.GmaCache.state");
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  at::Tensor S = at::empty({c.shape.batch, c.shape.heads, c.components, c.shape.value_dim}, opt);
  at::Tensor z = at::empty({c.shape.batch, c.shape.heads, c.components}, opt);
  if (c.dtype == "Float")
    gma_read_states<float>(*c.states, S.data_ptr<double>(), z.data_ptr<double>());
  else
    gma_read_states<double>(*c.states, S.data_ptr<double>(), z.data_ptr<double>());
  return std::make_tuple(S, z);
}

template <class C>
std::shared_ptr<C> copy_of(C& c) {
  Exclusive lock(
      c, std::is_same<C, GmaCache>::value ? "mixattn.GmaCache.copy" : "mixattn.OvqCache.copy");
  auto to = std::make_shared<C>();
  c.copy_into(*to);
  if constexpr (std::is_same<C, GmaCache>::value) {
    to->components = c.components;
    to->eps = c.eps;
    to->var_floor = c.var_floor;
    if (c.start_S.defined()) to->start_S = c.start_S.clone(), to->start_z = c.start_z.clone();
    to->prepared = c.prepared;  // immutable, shared
    for (int i = 0; i < 3; ++i) to->stamps[i] = c.stamps[i];
    to->prepared_checked = c.prepared_checked;
  } else {
    to->config = c.config;
  }
  return to;
}

template <class C>
void reset(C& c) {
  Exclusive lock(
      c, std::is_same<C, GmaCache>::value ? "mixattn.GmaCache.reset" : "mixattn.OvqCache.reset");
  C fresh;
  static_cast<Cache&>(c).reset();
  if constexpr (std::is_same<C, GmaCache>::value) {
    c.components = 0;
    c.eps = c.var_floor = 0;
    c.start_S = c.start_z = at::Tensor();
    c.prepared.reset();
    for (auto& s : c.stamps) s = ParamStamp{};
    c.prepared_checked = false;
  } else {
    c.config = fresh.config;
  }
}

/// f(cache) for the cache a handle holds, whichever kind (the Python classes' methods).
template <class F>
auto with_cache(const at::Tensor& handle, const char* method, F f) {
  const Held* held = held_by(handle);
  if (held != nullptr && held->object && held->kind == kOvqCache)
    return f(*static_cast<OvqCache*>(static_cast<Cache*>(held->object.get())),
             std::string("mixattn.OvqCache.") + method);
  if (held != nullptr && held->object && held->kind == kGmaCache)
    return f(*static_cast<GmaCache*>(static_cast<Cache*>(held->object.get())),
             std::string("mixattn.GmaCache.") + method);
  throw std::invalid_argument(std::string("mixattn cache.") + method + ": not a cache's handle");
}

at::Tensor cache_handle(std::shared_ptr<Cache> c, const char* kind) {
  std::uint64_t key[2];
  {
    CacheRegistry& registry = cache_registry();
    const std::lock_guard<std::mutex> lock(registry.mutex);
    key[0] = registry.next++;
    key[1] = registry.nonces();
    registry.caches[key[0]] = {key[1], c};
  }
  c->registry_key = key[0];
  return make_handle(kind, std::move(c), reinterpret_cast<const unsigned char*>(key));
}

}  // namespace

void define_caches(py::module_& m) {
  m.def("ovq_cache", [] { return cache_handle(std::make_shared<OvqCache>(), kOvqCache); });
  m.def("gma_cache", [] { return cache_handle(std::make_shared<GmaCache>(), kGmaCache); });
  m.def("ovq_cache_from_state", [](const at::Tensor& state) {
    std::shared_ptr<const OvqStateBox> keep;
    const OvqStateBox* box = ovq_state_named_by(state, keep);
    if (box == nullptr)
      throw std::invalid_argument(
          "mixattn.OvqCache: initial_state must be the state an earlier ovq_attention(..., "
          "output_final_state=True) returned");
    return cache_handle(ovq_cache_from(*box), kOvqCache);
  });
  m.def("gma_cache_from", [](at::Tensor S, at::Tensor z) {
    return cache_handle(gma_cache_from(std::move(S), std::move(z)), kGmaCache);
  });
  m.def("cache_copy", [](const at::Tensor& h) {
    return with_cache(h, "copy", [](auto& c, const std::string&) {
      using C = std::decay_t<decltype(c)>;
      return cache_handle(copy_of(c), std::is_same<C, GmaCache>::value ? kGmaCache : kOvqCache);
    });
  });
  m.def("cache_reset", [](const at::Tensor& h) {
    with_cache(h, "reset", [](auto& c, const std::string&) {
      reset(c);
      return 0;
    });
  });
  m.def("cache_tokens_seen", [](const at::Tensor& h) {
    return with_cache(h, "tokens_seen", [](auto& c, const std::string& fn) {
      Exclusive lock(c, fn);
      return c.tokens_seen();
    });
  });
  m.def("cache_bound", [](const at::Tensor& h) {
    return with_cache(h, "bound", [](auto& c, const std::string& fn) {
      Exclusive lock(c, fn);
      return c.bound();
    });
  });
  m.def("cache_repr", [](const at::Tensor& h) {
    return with_cache(h, "__repr__", [](auto& c, const std::string& fn) {
      Exclusive lock(c, fn);
      return c.describe();
    });
  });
  m.def("ovq_cache_state", [](const at::Tensor& h) {
    return ovq_cache_state(cache_of<OvqCache>(h, kOvqCache, "state"));
  });
  m.def("gma_cache_state", [](const at::Tensor& h) {
    return gma_cache_state(cache_of<GmaCache>(h, kGmaCache, "state"));
  });
}

}  // namespace mixattn_torch

TORCH_LIBRARY_IMPL(mixattn, CPU, m) {
  m.impl("ovq_forward_cached", &mixattn_torch::ovq_forward_cached_op);
  m.impl("gma_forward_cached", &mixattn_torch::gma_forward_cached_op);
}
