// python/csrc/delta_kernels.cpp — the gated delta rule (SPEC 9) over (batch, head) pairs, and a
// packed call's (sequence, head) items through the library's packed entry points
// (delta::forward_packed_into). Every pair continues a state, the call's initial_state or zeros:
// the end states are always written (d_k d_v doubles per pair, against the pair's
// O(N (C + d_v) d_k) work), so one operator serves the plain call and the streaming one.
#include "pairs.hpp"

#include <mixattn/delta.hpp>
#include <mixattn/packed.hpp>

namespace mixattn_torch {
namespace {

template <class T>
using DeltaPacked = PackedRecord<mixattn::delta::PackedSaved<T>>;

/// Pair `pair`'s gates: N entries of a contiguous (B, H, N) tensor, read in place.
template <class T>
Eigen::Map<const mixattn::Vector<T>> gates(const T* base, Index pair, Index n) {
  return Eigen::Map<const mixattn::Vector<T>>(base + pair * n, n);
}

/// A state's S set from item `i` of a (items, d_k, d_v) float64 tensor, or zeros (none given).
template <class T>
void start_from(mixattn::delta::State<T>& st, const double* S0, Index i, Index dk, Index dv) {
  if (S0 != nullptr)
    st.S = slice(S0, i, dk, dv);
  else
    st.S.setZero(dk, dv);
  st.tokens_seen = 0;
}

}  // namespace

template <class T>
SavedPtr delta_forward(const Shape& s, const DeltaConfig& c, const DeltaInputs<T>& in, T* out,
                       const DeltaStateIO& state, bool save) {
  auto rec = save ? make_records<mixattn::delta::Saved<T>>(s) : nullptr;
  const Index N = s.queries, dk = s.key_dim, dv = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    auto& st = thread_scratch<mixattn::delta::State<T>>();
    start_from(st, state.S0, pair, dk, dv);
    mixattn::delta::forward_into<T>(o, slice(in.q, pair, N, dk), slice(in.k, pair, N, dk),
                                    slice(in.v, pair, N, dv), gates(in.g, pair, N),
                                    gates(in.beta, pair, N), c, &st,
                                    save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr);
    slice(out, pair, N, dv) = o;
    slice(state.S, pair, dk, dv) = st.S;
  });
  return rec;
}

template <class T>
void delta_backward(const Shape& s, const DeltaConfig& c, const DeltaInputs<T>& in,
                    const T* grad_out, const SavedPtr& saved, const DeltaGrads<T>& out,
                    const DeltaStateGradIO& state) {
  const auto& rec = record_for<PairRecords<mixattn::delta::Saved<T>>>(
      saved, s, "mixattn.gated_delta_rule (backward)");
  const Index N = s.queries, dk = s.key_dim, dv = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& gr = thread_scratch<mixattn::delta::Grad<T>>();
    auto& end = thread_scratch<mixattn::delta::StateGrad<T>>();
    if (state.dS != nullptr) {
      end.S = slice(state.dS, pair, dk, dv);
      end.state_fingerprint = 0;  // not checked: the tensors carry no fingerprint
    }
    mixattn::delta::backward_into<T>(
        gr, slice(in.q, pair, N, dk), slice(in.k, pair, N, dk), slice(in.v, pair, N, dv),
        gates(in.g, pair, N), gates(in.beta, pair, N), slice(grad_out, pair, N, dv),
        rec.pairs[static_cast<std::size_t>(pair)], c, state.dS != nullptr ? &end : nullptr);
    slice(out.q, pair, N, dk) = gr.q;
    slice(out.k, pair, N, dk) = gr.k;
    slice(out.v, pair, N, dv) = gr.v;
    Eigen::Map<mixattn::Vector<T>>(out.g + pair * N, N) = gr.g;
    Eigen::Map<mixattn::Vector<T>>(out.beta + pair * N, N) = gr.beta;
    slice(state.dS0, pair, dk, dv) = gr.state.S;
  });
}

template <class T>
SavedPtr delta_forward_packed(const PackedShape& s, const DeltaConfig& c, const DeltaInputs<T>& in,
                              T* out, const DeltaStateIO& state, bool save) {
  std::shared_ptr<DeltaPacked<T>> rec;
  if (save) {
    rec = RecordPool<DeltaPacked<T>>::take();
    rec->shape = s;
  }
  const Index H = s.heads, n = s.rows, dk = s.key_dim, dv = s.value_dim;
  const Index items = H * (static_cast<Index>(s.offsets.size()) - 1);
  auto& states = thread_scratch<std::vector<mixattn::delta::State<T>>>();
  states.resize(static_cast<std::size_t>(items));
  for (Index i = 0; i < items; ++i)
    start_from(states[static_cast<std::size_t>(i)], state.S0, i, dk, dv);
  auto& o = thread_scratch<mixattn::Matrix<T>>();
  mixattn::delta::forward_packed_into<T>(o, H, packed(in.q, n, H * dk), packed(in.k, n, H * dk),
                                         packed(in.v, n, H * dv), packed(in.g, H, n),
                                         packed(in.beta, H, n), s.offsets, c, &states,
                                         save ? &rec->saved : nullptr, at::get_num_threads());
  packed(out, n, H * dv) = o;
  for (Index i = 0; i < items; ++i)
    slice(state.S, i, dk, dv) = states[static_cast<std::size_t>(i)].S;
  return rec;
}

template <class T>
void delta_backward_packed(const PackedShape& s, const DeltaConfig& c, const DeltaInputs<T>& in,
                           const T* grad_out, const SavedPtr& saved, const DeltaGrads<T>& out,
                           const DeltaStateGradIO& state) {
  const auto& rec = record_for<DeltaPacked<T>>(saved, s, "mixattn.gated_delta_rule (backward)");
  const Index H = s.heads, n = s.rows, dk = s.key_dim, dv = s.value_dim;
  const Index items = H * (static_cast<Index>(s.offsets.size()) - 1);
  auto& ends = thread_scratch<std::vector<mixattn::delta::StateGrad<T>>>();
  if (state.dS != nullptr) {
    ends.resize(static_cast<std::size_t>(items));
    for (Index i = 0; i < items; ++i) {
      ends[static_cast<std::size_t>(i)].S = slice(state.dS, i, dk, dv);
      ends[static_cast<std::size_t>(i)].state_fingerprint = 0;
    }
  }
  auto& g = thread_scratch<mixattn::delta::PackedGrad<T>>();
  mixattn::delta::backward_packed_into<T>(
      g, H, packed(in.q, n, H * dk), packed(in.k, n, H * dk), packed(in.v, n, H * dv),
      packed(in.g, H, n), packed(in.beta, H, n), packed(grad_out, n, H * dv), s.offsets, rec.saved,
      c, state.dS != nullptr ? &ends : nullptr, at::get_num_threads());
  packed(out.q, n, H * dk) = g.q;
  packed(out.k, n, H * dk) = g.k;
  packed(out.v, n, H * dv) = g.v;
  packed(out.g, H, n) = g.g;
  packed(out.beta, H, n) = g.beta;
  for (Index i = 0; i < items; ++i)
    slice(state.dS0, i, dk, dv) = g.items[static_cast<std::size_t>(i)].state.S;
}

#define MIXATTN_TORCH_DELTA(T)                                                                     \
  template SavedPtr delta_forward<T>(const Shape&, const DeltaConfig&, const DeltaInputs<T>&, T*,  \
                                     const DeltaStateIO&, bool);                                   \
  template void delta_backward<T>(const Shape&, const DeltaConfig&, const DeltaInputs<T>&,         \
                                  const T*, const SavedPtr&, const DeltaGrads<T>&,                 \
                                  const DeltaStateGradIO&);                                        \
  template SavedPtr delta_forward_packed<T>(const PackedShape&, const DeltaConfig&,                \
                                            const DeltaInputs<T>&, T*, const DeltaStateIO&, bool); \
  template void delta_backward_packed<T>(const PackedShape&, const DeltaConfig&,                   \
                                         const DeltaInputs<T>&, const T*, const SavedPtr&,         \
                                         const DeltaGrads<T>&, const DeltaStateGradIO&);
MIXATTN_TORCH_DELTA(float)
MIXATTN_TORCH_DELTA(double)

}  // namespace mixattn_torch
