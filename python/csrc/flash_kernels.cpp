// python/csrc/flash_kernels.cpp — tiled softmax attention (SPEC 3, reference::flash_*) over
// (batch, head) pairs, and sliding-window attention (SPEC 7, window::*, the same tiled kernels
// with a band mask) over (batch, head) pairs or the (sequence, head) pairs of a packed shape.
#include "pairs.hpp"

#include <mixattn/packed.hpp>

namespace mixattn_torch {

template <class T>
SavedPtr flash_forward(const Shape& s, const FlashConfig& c, const T* q, const T* k, const T* v,
                       T* out, bool save) {
  auto rec = save ? make_records<mixattn::reference::Saved<T>>(s) : nullptr;
  const Index N = s.queries, M = s.keys, r = s.key_dim, dv = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    mixattn::reference::flash_forward_into<T>(
        o, slice(q, pair, N, r), slice(k, pair, M, r), slice(v, pair, M, dv), c,
        save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr);
    slice(out, pair, N, dv) = o;
  });
  return rec;
}

template <class T>
void flash_backward(const Shape& s, const FlashConfig& c, const T* q, const T* k, const T* v,
                    const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv) {
  const auto& rec = record_for<PairRecords<mixattn::reference::Saved<T>>>(
      saved, s, "mixattn.flash_attention (backward)");
  const Index N = s.queries, M = s.keys, r = s.key_dim, d = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& g = thread_scratch<mixattn::reference::Grad<T>>();
    mixattn::reference::flash_backward_into<T>(g, slice(q, pair, N, r), slice(k, pair, M, r),
                                               slice(v, pair, M, d), slice(grad_out, pair, N, d),
                                               rec.pairs[static_cast<std::size_t>(pair)], c);
    slice(dq, pair, N, r) = g.q;
    slice(dk, pair, M, r) = g.k;
    slice(dv, pair, M, d) = g.v;
  });
}

template <class T>
using FlashPacked = PackedRecord<mixattn::reference::PackedSaved<T>>;

template <class T>
SavedPtr flash_forward_packed(const PackedShape& s, const FlashConfig& c, const T* q, const T* k,
                              const T* v, T* out) {
  auto rec = RecordPool<FlashPacked<T>>::take();
  rec->shape = s;
  const Index H = s.heads, n = s.rows, r = s.key_dim, d = s.value_dim;
  auto& o = thread_scratch<mixattn::Matrix<T>>();
  mixattn::reference::flash_forward_packed_into<T>(
      o, H, H, packed(q, n, H * r), packed(k, n, H * r), packed(v, n, H * d), s.offsets, s.offsets,
      c, &rec->saved, at::get_num_threads());
  packed(out, n, H * d) = o;
  return rec;
}

template <class T>
void flash_backward_packed(const PackedShape& s, const FlashConfig& c, const T* q, const T* k,
                           const T* v, const T* grad_out, const SavedPtr& saved, T* dq, T* dk,
                           T* dv) {
  const auto& rec = record_for<FlashPacked<T>>(saved, s, "mixattn.flash_attention (backward)");
  const Index H = s.heads, n = s.rows, r = s.key_dim, d = s.value_dim;
  auto& g = thread_scratch<mixattn::reference::PackedGrad<T>>();
  mixattn::reference::flash_backward_packed_into<T>(
      g, H, H, packed(q, n, H * r), packed(k, n, H * r), packed(v, n, H * d),
      packed(grad_out, n, H * d), s.offsets, s.offsets, rec.saved, c, at::get_num_threads());
  packed(dq, n, H * r) = g.q;
  packed(dk, n, H * r) = g.k;
  packed(dv, n, H * d) = g.v;
}

template <class T>
SavedPtr window_forward(const Shape& s, const WindowConfig& c, const T* q, const T* k, const T* v,
                        T* out, bool save) {
  auto rec = save ? make_records<mixattn::window::Saved<T>>(s) : nullptr;
  const Index N = s.queries, r = s.key_dim, dv = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    mixattn::window::forward_into<T>(o, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, N, r),
                                     pair_rows(s, v, pair, N, dv), c,
                                     save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr);
    pair_rows(s, out, pair, N, dv) = o;
  });
  return rec;
}

template <class T>
void window_backward(const Shape& s, const WindowConfig& c, const T* q, const T* k, const T* v,
                     const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv) {
  const auto& rec = record_for<PairRecords<mixattn::window::Saved<T>>>(
      saved, s, "mixattn.sliding_window_attention (backward)");
  const Index N = s.queries, r = s.key_dim, d = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& g = thread_scratch<mixattn::window::Grad<T>>();
    mixattn::window::backward_into<T>(
        g, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, N, r), pair_rows(s, v, pair, N, d),
        pair_rows(s, grad_out, pair, N, d), rec.pairs[static_cast<std::size_t>(pair)], c);
    pair_rows(s, dq, pair, N, r) = g.q;
    pair_rows(s, dk, pair, N, r) = g.k;
    pair_rows(s, dv, pair, N, d) = g.v;
  });
}

#define MIXATTN_TORCH_FLASH(T)                                                                    \
  template SavedPtr flash_forward<T>(const Shape&, const FlashConfig&, const T*, const T*,        \
                                     const T*, T*, bool);                                         \
  template void flash_backward<T>(const Shape&, const FlashConfig&, const T*, const T*, const T*, \
                                  const T*, const SavedPtr&, T*, T*, T*);                         \
  template SavedPtr flash_forward_packed<T>(const PackedShape&, const FlashConfig&, const T*,     \
                                            const T*, const T*, T*);                              \
  template void flash_backward_packed<T>(const PackedShape&, const FlashConfig&, const T*,        \
                                         const T*, const T*, const T*, const SavedPtr&, T*, T*,   \
                                         T*);                                                     \
  template SavedPtr window_forward<T>(const Shape&, const WindowConfig&, const T*, const T*,      \
                                      const T*, T*, bool);                                        \
  template void window_backward<T>(const Shape&, const WindowConfig&, const T*, const T*,         \
                                   const T*, const T*, const SavedPtr&, T*, T*, T*);
MIXATTN_TORCH_FLASH(float)
MIXATTN_TORCH_FLASH(double)

}  // namespace mixattn_torch
