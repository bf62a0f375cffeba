// python/csrc/ovq_kernels.cpp — OVQ (SPEC 2) over (batch, head) pairs, or (sequence, head) pairs
// of a packed call: every pair continues its own state (empty, a copy of one it is given, or a
// cache's, in place) with its head's beta; dbeta of a head is summed over the batch.
#include "pairs.hpp"

namespace mixattn_torch {

template <class T>
using OvqStatesOf = StatesOf<mixattn::ovq::State<T>>;

template <class T>
std::unique_ptr<PairStates> ovq_states(Index pairs, Index r, Index dv) {
  auto states = std::make_unique<OvqStatesOf<T>>();
  states->pairs.assign(static_cast<std::size_t>(pairs), mixattn::ovq::State<T>::empty(r, dv));
  return states;
}

template <class T>
SavedPtr ovq_forward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                     const T* beta, T* out, PairStates& states, const PairStates* copy_from,
                     bool save) {
  static constexpr const char* fn = "mixattn.ovq_attention";
  const Index pairs = s.batch * s.heads;
  auto& to = states_of<mixattn::ovq::State<T>>(states, pairs, fn);
  const auto* from =
      copy_from != nullptr ? &states_of<mixattn::ovq::State<T>>(*copy_from, pairs, fn) : nullptr;
  auto rec = save ? make_records<mixattn::ovq::Saved<T>>(s) : nullptr;
  const Index n = s.queries, r = s.key_dim, dv = s.value_dim;
  for_each_pair(
      s,
      [&](Index pair) {
        const auto i = static_cast<std::size_t>(pair);
        if (from != nullptr) to[i] = (*from)[i];
        auto& o = thread_scratch<mixattn::Matrix<T>>();
        mixattn::ovq::forward_into<T>(o, pair_rows(s, q, pair, n, r), pair_rows(s, k, pair, n, r),
                                      pair_rows(s, v, pair, n, dv), beta[pair % s.heads], c, to[i],
                                      save ? &rec->pairs[i] : nullptr);
        pair_rows(s, out, pair, n, dv) = o;
      },
      states.reversed);
  states.reversed = !states.reversed;
  return rec;
}

template <class T>
void ovq_backward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                  const T* beta, const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv,
                  T* dbeta) {
  const auto& rec =
      record_for<PairRecords<mixattn::ovq::Saved<T>>>(saved, s, "mixattn.ovq_attention (backward)");
  const Index n = s.queries, r = s.key_dim, d = s.value_dim;
  std::vector<T> beta_grads(static_cast<std::size_t>(s.batch * s.heads));
  for_each_pair(s, [&](Index pair) {
    auto& g = thread_scratch<mixattn::ovq::Grad<T>>();
    mixattn::ovq::backward_into<T>(g, pair_rows(s, q, pair, n, r), pair_rows(s, k, pair, n, r),
                                   pair_rows(s, v, pair, n, d), beta[pair % s.heads],
                                   pair_rows(s, grad_out, pair, n, d),
                                   rec.pairs[static_cast<std::size_t>(pair)], c);
    pair_rows(s, dq, pair, n, r) = g.q;
    pair_rows(s, dk, pair, n, r) = g.k;
    pair_rows(s, dv, pair, n, d) = g.v;
    beta_grads[static_cast<std::size_t>(pair)] = g.beta;
  });
  for (Index h = 0; h < s.heads; ++h) {  // batch order: the same bits for any thread count
    T sum = 0;
    for (Index b = 0; b < s.batch; ++b)
      sum += beta_grads[static_cast<std::size_t>(b * s.heads + h)];
    dbeta[h] = sum;
  }
}

std::vector<double> ovq_decode_seconds(const float* q, const float* k, const float* v, Index heads,
                                       Index rows, Index r, Index dv, float beta,
                                       const OvqConfig& c, Index prefill, bool all_heads_per_call) {
  std::vector<mixattn::ovq::State<float>> states;
  for (Index h = 0; h < heads; ++h) {
    states.push_back(mixattn::ovq::State<float>::empty(r, dv));
    mixattn::ovq::forward(slice(q, h, rows, r).topRows(prefill),
                          slice(k, h, rows, r).topRows(prefill),
                          slice(v, h, rows, dv).topRows(prefill), beta, c, states.back());
  }
  return decode_seconds(heads, prefill, rows, all_heads_per_call, [&](Index h, Index t) {
    const mixattn::Matrix<float> o = mixattn::ovq::forward(
        slice(q, h, rows, r).row(t), slice(k, h, rows, r).row(t), slice(v, h, rows, dv).row(t),
        beta, c, states[static_cast<std::size_t>(h)]);
    return o(0, 0);
  });
}

#define MIXATTN_TORCH_OVQ(T)                                                                     \
  template std::unique_ptr<PairStates> ovq_states<T>(Index, Index, Index);                       \
  template SavedPtr ovq_forward<T>(const Shape&, const OvqConfig&, const T*, const T*, const T*, \
                                   const T*, T*, PairStates&, const PairStates*, bool);          \
  template void ovq_backward<T>(const Shape&, const OvqConfig&, const T*, const T*, const T*,    \
                                const T*, const T*, const SavedPtr&, T*, T*, T*, T*);
MIXATTN_TORCH_OVQ(float)
MIXATTN_TORCH_OVQ(double)

}  // namespace mixattn_torch
