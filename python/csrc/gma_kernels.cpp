// python/csrc/gma_kernels.cpp — GMA (SPEC 1) over (batch, head) pairs: one mixture per head,
// shared by the batch; the mixture gradients of a head are summed over the batch in order.
#include "pairs.hpp"

#include <mixattn/gma.hpp>
#include <mixattn/packed.hpp>

namespace mixattn_torch {
namespace {

template <class T>
using Mixtures = std::vector<mixattn::gma::Mixture<T>>;

/// gma_prepare's object: each head's mixture reduced once (gma::Prepared), for the state path.
template <class T>
struct PreparedHeads {
  std::vector<mixattn::gma::Prepared<T>> heads;
};

template <class T>
using GmaPacked = PackedRecord<mixattn::gma::PackedSaved<T>, Mixtures<T>>;

template <class T>
Mixtures<T> mixtures_of(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in) {
  const Index K = c.components, r = s.key_dim;
  Mixtures<T> mix(static_cast<std::size_t>(s.heads));
  for (Index h = 0; h < s.heads; ++h) {
    auto& m = mix[static_cast<std::size_t>(h)];
    m.mean = slice(in.mean, h, K, r);
    m.var_raw = slice(in.var_raw, h, K, r);
    m.prior_logit = Eigen::Map<const mixattn::Vector<T>>(in.prior_logit + h * K, K);
    m.var_floor = static_cast<T>(c.var_floor);
  }
  return mix;
}

/// The prepared heads a state forward was handed, if they were prepared from the call's
/// mixtures (the library's fingerprint of each head's mean, var_raw, prior_logit and var_floor);
/// null when none were given or any head has changed since (a stale cache entry).
template <class T>
const PreparedHeads<T>* current_prepared(const Shape& s, const SavedPtr& prepared,
                                         const Mixtures<T>& mix) {
  const auto* p = static_cast<const PreparedHeads<T>*>(prepared.get());
  if (p == nullptr) return nullptr;
  if (static_cast<Index>(p->heads.size()) != s.heads) return nullptr;
  for (Index h = 0; h < s.heads; ++h) {
    const auto& one = p->heads[static_cast<std::size_t>(h)];
    const auto& m = mix[static_cast<std::size_t>(h)];
    if (one.components() != m.components() || one.dim() != m.mean.cols() ||
        one.mixture_fingerprint() != mixattn::detail::mixture_fingerprint(m))
      return nullptr;
  }
  return p;
}

}  // namespace

template <class T>
SavedPtr gma_prepare(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in) {
  auto p = std::make_shared<PreparedHeads<T>>();
  p->heads.reserve(static_cast<std::size_t>(s.heads));
  for (const auto& m : mixtures_of(s, c, in)) p->heads.emplace_back(m, c.options.check_finite);
  return p;
}

template <class T>
SavedPtr gma_forward(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in, T* out,
                     const GmaStateIO* state, const SavedPtr& prepared, bool* used_prepared,
                     bool save) {
  auto rec = save ? make_records<mixattn::gma::Saved<T>, Mixtures<T>>(s) : nullptr;
  Mixtures<T> mixtures = mixtures_of(s, c, in);
  const PreparedHeads<T>* prep =
      state != nullptr ? current_prepared<T>(s, prepared, mixtures) : nullptr;
  if (used_prepared != nullptr) *used_prepared = prep != nullptr;
  const mixattn::gma::Options& opt = c.options;
  const Index N = s.queries, M = s.keys, r = s.key_dim, dv = s.value_dim, K = c.components;
  for_each_pair(s, [&](Index pair) {
    const auto head = static_cast<std::size_t>(pair % s.heads);
    const auto& mix = mixtures[head];
    auto* saved = save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr;
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    const auto q = pair_rows(s, in.q, pair, N, r), k = pair_rows(s, in.k, pair, M, r);
    const auto v = pair_rows(s, in.v, pair, M, dv);
    if (state == nullptr) {
      mixattn::gma::forward_into(o, mix, q, k, v, opt, saved);
    } else {
      auto& st = thread_scratch<mixattn::gma::State<T>>();
      st.S = slice(state->S0, pair, K, dv);
      st.z = slice(state->z0, pair, 1, K).transpose();
      st.tokens_seen = 0;
      if (prep != nullptr)
        mixattn::gma::forward_into(o, prep->heads[head], q, k, v, opt, st, saved);
      else
        mixattn::gma::forward_into(o, mix, q, k, v, opt, st, saved);
      slice(state->S, pair, K, dv) = st.S;
      slice(state->z, pair, 1, K) = st.z.transpose();
    }
    pair_rows(s, out, pair, N, dv) = o;
  });
  if (save) rec->shared = std::move(mixtures);  // the backward's mixtures
  return rec;
}

template <class T>
using GmaStatesOf = StatesOf<mixattn::gma::State<T>>;

template <class T>
std::unique_ptr<PairStates> gma_states(Index pairs, Index K, Index dv, const double* S,
                                       const double* z) {
  auto states = std::make_unique<GmaStatesOf<T>>();
  states->pairs.assign(static_cast<std::size_t>(pairs), mixattn::gma::State<T>::empty(K, dv));
  if (S != nullptr)
    for (Index pair = 0; pair < pairs; ++pair) {
      auto& st = states->pairs[static_cast<std::size_t>(pair)];
      st.S = slice(S, pair, K, dv);
      st.z = slice(z, pair, 1, K).transpose();
    }
  return states;
}

template <class T>
void gma_read_states(const PairStates& states, double* S, double* z) {
  const auto* of = dynamic_cast<const GmaStatesOf<T>*>(&states);
  if (of == nullptr) throw std::logic_error("gma_read_states: the states are of another kind");
  for (std::size_t pair = 0; pair < of->pairs.size(); ++pair) {
    const auto& st = of->pairs[pair];
    const Index K = st.components(), dv = st.value_dim(), p = static_cast<Index>(pair);
    slice(S, p, K, dv) = st.S;
    slice(z, p, 1, K) = st.z.transpose();
  }
}

template <class T>
SavedPtr gma_forward_cached(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in, T* out,
                            PairStates& states, const SavedPtr& prepared, bool save) {
  static constexpr const char* fn = "mixattn.gma_attention";
  auto& st = states_of<mixattn::gma::State<T>>(states, s.batch * s.heads, fn);
  auto rec = save ? make_records<mixattn::gma::Saved<T>, Mixtures<T>>(s) : nullptr;
  Mixtures<T> mixtures;
  const auto* prep = static_cast<const PreparedHeads<T>*>(prepared.get());
  if (save) {
    mixtures = mixtures_of(s, c, in);  // the record's: backward checks them against it
  } else if (prep == nullptr || static_cast<Index>(prep->heads.size()) != s.heads) {
    throw std::logic_error(std::string(fn) + ": a cached forward without its prepared mixtures");
  }
  const Index N = s.queries, r = s.key_dim, dv = s.value_dim;
  for_each_pair(
      s,
      [&](Index pair) {
        const auto i = static_cast<std::size_t>(pair),
                   head = static_cast<std::size_t>(pair % s.heads);
        auto& o = thread_scratch<mixattn::Matrix<T>>();
        const auto q = pair_rows(s, in.q, pair, N, r), k = pair_rows(s, in.k, pair, N, r);
        const auto v = pair_rows(s, in.v, pair, N, dv);
        if (save)
          mixattn::gma::forward_into(o, mixtures[head], q, k, v, c.options, st[i], &rec->pairs[i]);
        else
          mixattn::gma::forward_into(o, prep->heads[head], q, k, v, c.options, st[i], nullptr);
        pair_rows(s, out, pair, N, dv) = o;
      },
      states.reversed);
  states.reversed = !states.reversed;
  if (save) rec->shared = std::move(mixtures);
  return rec;
}

template <class T>
void gma_backward(const Shape& s, const GmaConfig& c, const GmaInputs<T>& in, const T* grad_out,
                  const SavedPtr& saved, T* dq, T* dk, T* dv, T* dmean, T* dvar_raw,
                  T* dprior_logit, const GmaStateGradIO* state) {
  const auto& rec = record_for<PairRecords<mixattn::gma::Saved<T>, Mixtures<T>>>(
      saved, s, "mixattn.gma_attention (backward)");
  const mixattn::gma::Options& opt = c.options;
  const Index N = s.queries, M = s.keys, r = s.key_dim, d = s.value_dim, K = c.components;
  std::vector<mixattn::gma::MixtureGrad<T>> mixture_grads(
      static_cast<std::size_t>(s.batch * s.heads));
  for_each_pair(s, [&](Index pair) {
    const auto& mix = rec.shared[static_cast<std::size_t>(pair % s.heads)];
    auto& g = thread_scratch<mixattn::gma::Grad<T>>();
    const auto q = pair_rows(s, in.q, pair, N, r), k = pair_rows(s, in.k, pair, M, r);
    const auto v = pair_rows(s, in.v, pair, M, d), go = pair_rows(s, grad_out, pair, N, d);
    const auto& one = rec.pairs[static_cast<std::size_t>(pair)];
    if (state != nullptr && state->dS != nullptr) {
      auto& end = thread_scratch<mixattn::gma::StateGrad<T>>();
      end.S = slice(state->dS, pair, K, d);
      end.z = slice(state->dz, pair, 1, K).transpose();
      end.state_fingerprint = 0;  // not checked: the tensors carry no fingerprint
      mixattn::gma::backward_into(g, mix, q, k, v, go, one, opt, &end);
    } else {
      mixattn::gma::backward_into(g, mix, q, k, v, go, one, opt);
    }
    pair_rows(s, dq, pair, N, r) = g.q;
    pair_rows(s, dk, pair, M, r) = g.k;
    pair_rows(s, dv, pair, M, d) = g.v;
    if (state != nullptr) {
      slice(state->dS0, pair, K, d) = g.state.S;
      slice(state->dz0, pair, 1, K) = g.state.z.transpose();
    }
    mixture_grads[static_cast<std::size_t>(pair)] = g.mixture;
  });
  // Sum over the batch in batch order: the same bits for any number of threads.
  for (Index h = 0; h < s.heads; ++h) {
    Map<T> mean = slice(dmean, h, K, r), var_raw = slice(dvar_raw, h, K, r);
    Eigen::Map<mixattn::Vector<T>> prior(dprior_logit + h * K, K);
    mean.setZero();
    var_raw.setZero();
    prior.setZero();
    for (Index b = 0; b < s.batch; ++b) {
      const auto& g = mixture_grads[static_cast<std::size_t>(b * s.heads + h)];
      mean += g.mean;
      var_raw += g.var_raw;
      prior += g.prior_logit;
    }
  }
}

template <class T>
SavedPtr gma_forward_packed(const PackedShape& s, const GmaConfig& c, const GmaInputs<T>& in,
                            T* out) {
  auto rec = RecordPool<GmaPacked<T>>::take();
  rec->shape = s;
  Shape heads;
  heads.heads = s.heads;
  heads.key_dim = s.key_dim;
  rec->shared = mixtures_of(heads, c, in);
  const Index H = s.heads, n = s.rows;
  auto& o = thread_scratch<mixattn::Matrix<T>>();
  mixattn::gma::forward_packed_into<T>(o, rec->shared, packed(in.q, n, H * s.key_dim),
                                       packed(in.k, n, H * s.key_dim),
                                       packed(in.v, n, H * s.value_dim), s.offsets, s.offsets,
                                       c.options, &rec->saved, at::get_num_threads());
  packed(out, n, H * s.value_dim) = o;
  return rec;
}

template <class T>
void gma_backward_packed(const PackedShape& s, const GmaConfig& c, const GmaInputs<T>& in,
                         const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv, T* dmean,
                         T* dvar_raw, T* dprior_logit) {
  const auto& rec = record_for<GmaPacked<T>>(saved, s, "mixattn.gma_attention (backward)");
  const Index H = s.heads, n = s.rows, r = s.key_dim, d = s.value_dim, K = c.components;
  auto& g = thread_scratch<mixattn::gma::PackedGrad<T>>();
  mixattn::gma::backward_packed_into<T>(g, rec.shared, packed(in.q, n, H * r),
                                        packed(in.k, n, H * r), packed(in.v, n, H * d),
                                        packed(grad_out, n, H * d), s.offsets, s.offsets, rec.saved,
                                        c.options, at::get_num_threads());
  packed(dq, n, H * r) = g.q;
  packed(dk, n, H * r) = g.k;
  packed(dv, n, H * d) = g.v;
  for (Index h = 0; h < H; ++h) {
    const auto& m = g.mixtures[static_cast<std::size_t>(h)];
    slice(dmean, h, K, r) = m.mean;
    slice(dvar_raw, h, K, r) = m.var_raw;
    Eigen::Map<mixattn::Vector<T>>(dprior_logit + h * K, K) = m.prior_logit;
  }
}

#define MIXATTN_TORCH_GMA(T)                                                                       \
  template SavedPtr gma_prepare<T>(const Shape&, const GmaConfig&, const GmaInputs<T>&);           \
  template SavedPtr gma_forward<T>(const Shape&, const GmaConfig&, const GmaInputs<T>&, T*,        \
                                   const GmaStateIO*, const SavedPtr&, bool*, bool);               \
  template void gma_backward<T>(const Shape&, const GmaConfig&, const GmaInputs<T>&, const T*,     \
                                const SavedPtr&, T*, T*, T*, T*, T*, T*, const GmaStateGradIO*);   \
  template std::unique_ptr<PairStates> gma_states<T>(Index, Index, Index, const double*,           \
                                                     const double*);                               \
  template void gma_read_states<T>(const PairStates&, double*, double*);                           \
  template SavedPtr gma_forward_cached<T>(const Shape&, const GmaConfig&, const GmaInputs<T>&, T*, \
                                          PairStates&, const SavedPtr&, bool);                     \
  template SavedPtr gma_forward_packed<T>(const PackedShape&, const GmaConfig&,                    \
                                          const GmaInputs<T>&, T*);                                \
  template void gma_backward_packed<T>(const PackedShape&, const GmaConfig&, const GmaInputs<T>&,  \
                                       const T*, const SavedPtr&, T*, T*, T*, T*, T*, T*);
MIXATTN_TORCH_GMA(float)
MIXATTN_TORCH_GMA(double)

std::vector<double> gma_decode_seconds(const float* q, const float* k, const float* v, Index heads,
                                       Index rows, Index r, Index dv, const float* mean,
                                       const float* var_raw, const float* prior_logit, Index K,
                                       Index prefill, bool all_heads_per_call) {
  mixattn::gma::Options opt;
  opt.causal = true;
  std::vector<mixattn::gma::Prepared<float>> prepared;  // once per head, not per token
  std::vector<mixattn::gma::State<float>> states;
  for (Index h = 0; h < heads; ++h) {
    mixattn::gma::Mixture<float> mix;
    mix.mean = slice(mean, h, K, r);
    mix.var_raw = slice(var_raw, h, K, r);
    mix.prior_logit = Eigen::Map<const mixattn::Vector<float>>(prior_logit + h * K, K);
    prepared.emplace_back(mix);
    states.push_back(mixattn::gma::State<float>::empty(K, dv));
    mixattn::gma::forward(prepared.back(), slice(q, h, rows, r).topRows(prefill),
                          slice(k, h, rows, r).topRows(prefill),
                          slice(v, h, rows, dv).topRows(prefill), opt, states.back());
  }
  return decode_seconds(heads, prefill, rows, all_heads_per_call, [&](Index h, Index t) {
    const auto i = static_cast<std::size_t>(h);
    const mixattn::Matrix<float> o =
        mixattn::gma::forward(prepared[i], slice(q, h, rows, r).row(t), slice(k, h, rows, r).row(t),
                              slice(v, h, rows, dv).row(t), opt, states[i]);
    return o(0, 0);
  });
}

const char* library_version() {
  return MIXATTN_VERSION_STRING;
}

void release_kept_records() {
  PoolRegistry& registry = pool_registry();
  const std::lock_guard<std::mutex> lock(registry.mutex);
  for (void (*clear)() : registry.clears) clear();
}

}  // namespace mixattn_torch
