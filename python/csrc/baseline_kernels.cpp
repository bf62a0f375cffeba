// python/csrc/baseline_kernels.cpp — linear attention (SPEC 4), Performer (SPEC 5), static VQ
// attention (SPEC 6) and RoPE (SPEC 8) over (batch, head) pairs, or the (sequence, head) pairs of
// a packed shape: each pair is one call of the library's single-sequence operator, reading its
// block of the tensors in place (pair_rows). The parameters a head's pairs share (Performer's
// directions, VQ's codebook) are read in place too; VQ's codebook gradient is summed over the
// batch in batch order. Sliding-window attention runs on the tiled softmax kernels, in
// flash_kernels.cpp.
#include "pairs.hpp"

#include <cstdint>

namespace mixattn_torch {

// --- linear attention ----------------------------------------------------------------------------

template <class T>
SavedPtr linear_forward(const Shape& s, const LinearConfig& c, const T* q, const T* k, const T* v,
                        T* out, bool save) {
  auto rec = save ? make_records<mixattn::linear::Saved<T>>(s) : nullptr;
  const Index N = s.queries, M = s.keys, r = s.key_dim, dv = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    mixattn::linear::forward_into<T>(o, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, M, r),
                                     pair_rows(s, v, pair, M, dv), c,
                                     save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr);
    pair_rows(s, out, pair, N, dv) = o;
  });
  return rec;
}

template <class T>
void linear_backward(const Shape& s, const LinearConfig& c, const T* q, const T* k, const T* v,
                     const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv) {
  const auto& rec = record_for<PairRecords<mixattn::linear::Saved<T>>>(
      saved, s, "mixattn.linear_attention (backward)");
  const Index N = s.queries, M = s.keys, r = s.key_dim, d = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& g = thread_scratch<mixattn::linear::Grad<T>>();
    mixattn::linear::backward_into<T>(
        g, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, M, r), pair_rows(s, v, pair, M, d),
        pair_rows(s, grad_out, pair, N, d), rec.pairs[static_cast<std::size_t>(pair)], c);
    pair_rows(s, dq, pair, N, r) = g.q;
    pair_rows(s, dk, pair, M, r) = g.k;
    pair_rows(s, dv, pair, M, d) = g.v;
  });
}

// --- Performer -----------------------------------------------------------------------------------

namespace {

/// A pair without queries (an empty packed sequence, or N = 0): the output is empty, so the keys
/// and values get zero gradients without a call to the library's backward.
template <class T>
bool no_queries(const Shape& s, Index pair, Index N, Index M, Index d, T* dk, T* dv) {
  const auto b = static_cast<std::size_t>(pair / s.heads);
  if ((s.offsets.empty() ? N : s.offsets[b + 1] - s.offsets[b]) != 0) return false;
  pair_rows(s, dk, pair, M, s.key_dim).setZero();
  pair_rows(s, dv, pair, M, d).setZero();
  return true;
}

/// Each head's directions as the library's Features (the m x r W_h copied: Features owns a
/// Matrix; m r entries per head, against the pairs' O(N m (r + d_v)) work).
template <class T>
std::vector<mixattn::performer::Features<T>> features_of(const Shape& s, Index m,
                                                         const T* features) {
  std::vector<mixattn::performer::Features<T>> f(static_cast<std::size_t>(s.heads));
  for (Index h = 0; h < s.heads; ++h)
    f[static_cast<std::size_t>(h)].w = slice(features, h, m, s.key_dim);
  return f;
}

}  // namespace

template <class T>
SavedPtr performer_forward(const Shape& s, const PerformerConfig& c, Index m, const T* q,
                           const T* k, const T* v, const T* features, T* out, bool save) {
  auto rec = save ? make_records<mixattn::performer::Saved<T>>(s) : nullptr;
  const auto f = features_of(s, m, features);
  const Index N = s.queries, M = s.keys, r = s.key_dim, dv = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    mixattn::performer::forward_into<T>(
        o, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, M, r), pair_rows(s, v, pair, M, dv),
        f[static_cast<std::size_t>(pair % s.heads)], c,
        save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr);
    pair_rows(s, out, pair, N, dv) = o;
  });
  return rec;
}

template <class T>
void performer_backward(const Shape& s, const PerformerConfig& c, Index m, const T* q, const T* k,
                        const T* v, const T* features, const T* grad_out, const SavedPtr& saved,
                        T* dq, T* dk, T* dv) {
  const auto& rec = record_for<PairRecords<mixattn::performer::Saved<T>>>(
      saved, s, "mixattn.performer_attention (backward)");
  // The directions given to the backward: the library compares them with its record's
  // fingerprint of the forward's (a redraw in between is refused by name).
  const auto f = features_of(s, m, features);
  const Index N = s.queries, M = s.keys, r = s.key_dim, d = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    if (no_queries(s, pair, N, M, d, dk, dv)) return;
    auto& g = thread_scratch<mixattn::performer::Grad<T>>();
    mixattn::performer::backward_into<T>(
        g, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, M, r), pair_rows(s, v, pair, M, d),
        f[static_cast<std::size_t>(pair % s.heads)], pair_rows(s, grad_out, pair, N, d),
        rec.pairs[static_cast<std::size_t>(pair)], c);
    pair_rows(s, dq, pair, N, r) = g.q;
    pair_rows(s, dk, pair, M, r) = g.k;
    pair_rows(s, dv, pair, M, d) = g.v;
  });
}

void performer_draw(Index heads, Index m, Index r, std::uint64_t seed, bool orthogonal,
                    double* out) {
  const auto draw =
      orthogonal ? mixattn::performer::Draw::orthogonal : mixattn::performer::Draw::iid;
  for (Index h = 0; h < heads; ++h)
    slice(out, h, m, r) = mixattn::performer::Features<double>::random(
                              m, r, seed + static_cast<std::uint64_t>(h), draw)
                              .w;
}

// --- static-codebook VQ --------------------------------------------------------------------------

template <class T>
SavedPtr vq_forward(const Shape& s, const VqConfig& c, Index codes, const T* q, const T* k,
                    const T* v, const T* codebook, T* out, bool save) {
  auto rec = save ? make_records<mixattn::vq::Saved<T>>(s) : nullptr;
  const Index N = s.queries, M = s.keys, r = s.key_dim, dv = s.value_dim;
  for_each_pair(s, [&](Index pair) {
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    mixattn::vq::forward_into<T>(o, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, M, r),
                                 pair_rows(s, v, pair, M, dv),
                                 slice(codebook, pair % s.heads, codes, r), c,
                                 save ? &rec->pairs[static_cast<std::size_t>(pair)] : nullptr);
    pair_rows(s, out, pair, N, dv) = o;
  });
  return rec;
}

template <class T>
void vq_backward(const Shape& s, const VqConfig& c, Index codes, const T* q, const T* k, const T* v,
                 const T* codebook, const T* grad_out, const SavedPtr& saved, T* dq, T* dk, T* dv,
                 T* dcodebook) {
  const auto& rec =
      record_for<PairRecords<mixattn::vq::Saved<T>>>(saved, s, "mixattn.vq_attention (backward)");
  const Index N = s.queries, M = s.keys, r = s.key_dim, d = s.value_dim;
  std::vector<mixattn::Matrix<T>> code_grads(static_cast<std::size_t>(s.batch * s.heads));
  for_each_pair(s, [&](Index pair) {
    if (no_queries(s, pair, N, M, d, dk, dv)) {
      code_grads[static_cast<std::size_t>(pair)].setZero(codes, r);
      return;
    }
    auto& g = thread_scratch<mixattn::vq::Grad<T>>();
    mixattn::vq::backward_into<T>(
        g, pair_rows(s, q, pair, N, r), pair_rows(s, k, pair, M, r), pair_rows(s, v, pair, M, d),
        slice(codebook, pair % s.heads, codes, r), pair_rows(s, grad_out, pair, N, d),
        rec.pairs[static_cast<std::size_t>(pair)], c);
    pair_rows(s, dq, pair, N, r) = g.q;
    pair_rows(s, dk, pair, M, r) = g.k;
    pair_rows(s, dv, pair, M, d) = g.v;
    code_grads[static_cast<std::size_t>(pair)] = g.codebook;
  });
  // Sum over the batch in batch order: the same bits for any number of threads.
  for (Index h = 0; h < s.heads; ++h) {
    Map<T> sum = slice(dcodebook, h, codes, r);
    sum.setZero();
    for (Index b = 0; b < s.batch; ++b)
      sum += code_grads[static_cast<std::size_t>(b * s.heads + h)];
  }
}

// --- RoPE ----------------------------------------------------------------------------------------

template <class T>
void rope_rotate(const Shape& s, const RopeConfig& c, Index start, const T* x, T* out,
                 bool backward) {
  const Index N = s.queries, r = s.key_dim;
  for_each_pair(s, [&](Index pair) {
    auto& o = thread_scratch<mixattn::Matrix<T>>();
    const auto in = pair_rows(s, x, pair, N, r);
    if (backward)
      mixattn::rope::backward_into<T>(o, in, start, c);
    else
      mixattn::rope::apply_into<T>(o, in, start, c);
    pair_rows(s, out, pair, N, r) = o;
  });
}

#define MIXATTN_TORCH_BASELINES(T)                                                                 \
  template SavedPtr linear_forward<T>(const Shape&, const LinearConfig&, const T*, const T*,       \
                                      const T*, T*, bool);                                         \
  template void linear_backward<T>(const Shape&, const LinearConfig&, const T*, const T*,          \
                                   const T*, const T*, const SavedPtr&, T*, T*, T*);               \
  template SavedPtr performer_forward<T>(const Shape&, const PerformerConfig&, Index, const T*,    \
                                         const T*, const T*, const T*, T*, bool);                  \
  template void performer_backward<T>(const Shape&, const PerformerConfig&, Index, const T*,       \
                                      const T*, const T*, const T*, const T*, const SavedPtr&, T*, \
                                      T*, T*);                                                     \
  template SavedPtr vq_forward<T>(const Shape&, const VqConfig&, Index, const T*, const T*,        \
                                  const T*, const T*, T*, bool);                                   \
  template void vq_backward<T>(const Shape&, const VqConfig&, Index, const T*, const T*, const T*, \
                               const T*, const T*, const SavedPtr&, T*, T*, T*, T*);               \
  template void rope_rotate<T>(const Shape&, const RopeConfig&, Index, const T*, T*, bool);
MIXATTN_TORCH_BASELINES(float)
MIXATTN_TORCH_BASELINES(double)

}  // namespace mixattn_torch
