// python/csrc/ovq_kernels.cpp — OVQ (SPEC 2) over (batch, head) pairs, or (sequence, head) pairs
// of a packed call: every pair processes its sequence from an empty state (or the one it is
// given) with its head's beta; dbeta of a head is summed over the batch.
#include "pairs.hpp"

#include <mixattn/ovq.hpp>

namespace mixattn_torch {
namespace {

mixattn::ovq::Options options_of(const OvqConfig& c) {
  mixattn::ovq::Options opt;
  opt.block = c.block;
  opt.max_centroids = c.max_centroids;
  opt.growth = c.linear_growth ? mixattn::ovq::Growth::linear : mixattn::ovq::Growth::plateau;
  opt.growth_alpha = c.growth_alpha;
  opt.seeding = c.one_shot_seeding ? mixattn::ovq::Seeding::one_shot
                                   : mixattn::ovq::Seeding::greedy_dispersion;
  opt.assignment = c.existing_only ? mixattn::ovq::Assignment::existing_only
                                   : mixattn::ovq::Assignment::all_centroids;
  opt.count_bias = c.count_bias;
  opt.grad_through_dictionary = c.grad_through_dictionary;
  opt.norm_eps = c.norm_eps;
  opt.check_finite = c.check_finite;
  return opt;
}

}  // namespace

template <class T>
SavedPtr ovq_forward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                     const T* beta, T* out, const OvqStates* start, OvqStates* end, bool save) {
  using States = std::vector<mixattn::ovq::State<T>>;
  auto rec = save ? make_records<mixattn::ovq::Saved<T>>(s) : nullptr;
  const mixattn::ovq::Options opt = options_of(c);
  const Index n = s.queries, r = s.key_dim, dv = s.value_dim;
  const auto* from = start != nullptr ? static_cast<const States*>(start->states.get()) : nullptr;
  auto to = std::make_shared<States>(static_cast<std::size_t>(s.batch * s.heads));
  for_each_pair(s, [&](Index pair) {
    auto& state = (*to)[static_cast<std::size_t>(pair)];
    state = from != nullptr ? (*from)[static_cast<std::size_t>(pair)]
                            : mixattn::ovq::State<T>::empty(r, dv);
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    mixattn::ovq::forward_into<T>(o, pair_rows(s, q, pair, n, r), pair_rows(s, k, pair, n, r),
                                  pair_rows(s, v, pair, n, dv), beta[pair % s.heads], opt, state,
                                  save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr);
    pair_rows(s, out, pair, n, dv) = o;
  });
  if (end != nullptr) {
    end->shape = s;
    end->states = std::move(to);
  }
  return rec;
}

template <class T>
void ovq_backward(const Shape& s, const OvqConfig& c, const T* q, const T* k, const T* v,
                  const T* beta, const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv,
                  T* dbeta) {
  const auto& rec =
      records_for<mixattn::ovq::Saved<T>>(saved, s, "mixattn.ovq_attention (backward)");
  const mixattn::ovq::Options opt = options_of(c);
  const Index n = s.queries, r = s.key_dim, d = s.value_dim;
  std::vector<T> beta_grads(static_cast<std::size_t>(s.batch * s.heads));
  for_each_pair(s, [&](Index pair) {
    auto& g = thread_scratch<mixattn::ovq::Grad<T>>();
    mixattn::ovq::backward_into<T>(g, pair_rows(s, q, pair, n, r), pair_rows(s, k, pair, n, r),
                                   pair_rows(s, v, pair, n, d), beta[pair % s.heads],
                                   pair_rows(s, grad_out, pair, n, d),
                                   rec.pairs[static_cast<std::size_t>(pair)], opt);
    pair_rows(s, dq, pair, n, r) = g.q;
    pair_rows(s, dk, pair, n, r) = g.k;
    pair_rows(s, dv, pair, n, d) = g.v;
    beta_grads[static_cast<std::size_t>(pair)] = g.beta;
  });
  for (Index h = 0; h < s.heads; ++h) {  // batch order: the same bits for any thread count
    T sum = 0;
    for (Index b = 0; b < s.batch; ++b) sum += beta_grads[static_cast<std::size_t>(b * s.heads + h)];
    dbeta[h] = sum;
  }
}

#define MIXATTN_TORCH_OVQ(T)                                                                      \
  template SavedPtr ovq_forward<T>(const Shape&, const OvqConfig&, const T*, const T*, const T*, \
                                   const T*, T*, const OvqStates*, OvqStates*, bool);             \
  template void ovq_backward<T>(const Shape&, const OvqConfig&, const T*, const T*, const T*,     \
                                const T*, const T*, const SavedPtr&, T*, T*, T*, T*);
MIXATTN_TORCH_OVQ(float)
MIXATTN_TORCH_OVQ(double)

}  // namespace mixattn_torch
