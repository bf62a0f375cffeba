// mixattn/layer/body.hpp — the bodies of layer::MultiHeadAttention (layer.hpp): its Config
// checks, the forward and backward over (sequence, head) items through the mixer interface, the
// gradients' blocks and the parameters' fingerprint.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/fingerprint.hpp"
#include "mixattn/detail/common/gemm.hpp"
#include "mixattn/detail/common/parallel_gemm.hpp"
#include "mixattn/layer/config.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/layer/table.hpp"
#include "mixattn/layer/types.hpp"
#include "mixattn/named_block.hpp"
#include "mixattn/parallel.hpp"
#include "mixattn/rope.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// A new mixer for `cfg` (its kind checked by check_layer_config). Out of the layer's class body
/// and in the instance list (layer.hpp), so that a file constructing a layer does not compile
/// every mixer's members.
template <class T>
std::unique_ptr<Mixer<T>> make_mixer(const layer::Config& cfg) {
  return find_mixer<T>(cfg.mixer)->make(cfg, cfg);
}

/// Checks a layer's Config before anything is made: the shape, then the mixer's own fields
/// (naming the field), then the initialisation and RoPE.
template <class T>
void check_layer_config(const layer::Config& cfg) {
  constexpr const char* fn = "mixattn::layer::MultiHeadAttention";
  require(cfg.model_dim >= 1, fn, "config.model_dim must be >= 1, got ", cfg.model_dim);
  require(cfg.heads >= 1, fn, "config.heads must be >= 1, got ", cfg.heads);
  require(cfg.key_dim >= 1, fn, "config.key_dim must be >= 1, got ", cfg.key_dim);
  require(cfg.value_dim >= 1, fn, "config.value_dim must be >= 1, got ", cfg.value_dim);
  require(cfg.threads >= 0, fn, "config.threads must be >= 0, got ", cfg.threads);
  const MixerEntry<T>* mixer = find_mixer<T>(cfg.mixer);
  require(mixer != nullptr, fn, "config.mixer is not one of MixerKind's enumerators");
  mixer->check(fn, cfg, cfg);
  if (cfg.rope) {  // SPEC 8.3, before any call
    require(cfg.key_dim % 2 == 0, fn, "config.key_dim is ", cfg.key_dim,
            ": config.rope rotates column pairs (2i, 2i + 1) and needs an even key_dim");
    rope_check_base(fn, "config.rope_options.base", cfg.rope_options.base);
    // theta_i itself finite (a position's angle p theta_i is checked per call, p unknown here)
    rope_check_angles(fn, "config.rope_options.base", cfg.rope_options.base, cfg.key_dim, 0);
  }
}

/// Item i = b H + h of a batch: head h's columns of sequence b's rows of q, k and v.
template <class T>
MixerItem<T> layer_item(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                        const Offsets& offsets, Index heads, Index item) {
  const Index h = item % heads, r = q.cols() / heads, d_v = v.cols() / heads;
  const std::size_t b = static_cast<std::size_t>(item / heads);
  const Index t0 = offsets[b], n = offsets[b + 1] - offsets[b];
  return {static_cast<std::size_t>(item), h, q.block(t0, h * r, n, r), k.block(t0, h * r, n, r),
          v.block(t0, h * d_v, n, d_v)};
}

/// With checks on, projections of finite x that overflowed T are reported (naming them), not
/// handed to the heads, which would blame q, k or v.
template <class T>
void check_projections(const layer::Config& cfg, const char* fn, const Matrix<T>& q,
                       const Matrix<T>& k, const Matrix<T>& v) {
  if (!cfg.check_finite) return;
  const char* culprit = "x or a projection weight is";
  require_finite_result(q, fn, "the queries x W_Q", culprit);
  require_finite_result(k, fn, "the keys x W_K", culprit);
  require_finite_result(v, fn, "the values x W_V", culprit);
}

template <class T>
void check_layer_input(const layer::Config& cfg, const char* fn, const ConstMatrixRef<T>& x) {
  check_layer_input<T>(fn, x, cfg.model_dim, cfg.check_finite);
}

/// RoPE's options with the layer's check_finite.
inline rope::Options layer_rope_options(const layer::Config& cfg) {
  rope::Options o = cfg.rope_options;
  o.check_finite = cfg.check_finite;
  return o;
}

/// Sum of every item's gradients of its head's parameters into g.params, in sequence order.
template <class T>
void sum_head_gradients(const Mixer<T>& mixer, layer::Gradients<T>& g, Index heads, Index items) {
  HeadBlock<T> blocks[max_head_blocks];
  for (Index h = 0; h < heads; ++h)
    for (Index item = h; item < items; item += heads) {
      const std::size_t n = mixer.item_gradients(g.heads, static_cast<std::size_t>(item), blocks);
      for (std::size_t j = 0; j < n; ++j) {
        const Eigen::Map<const Matrix<T>> d(blocks[j].data, blocks[j].rows, blocks[j].cols);
        Matrix<T>& p = g.params[g.slot_head[static_cast<std::size_t>(h)][j]];
        if (item == h)
          p = d;
        else
          p += d;
      }
    }
}

/// What a layer is made of: its Config, its projection weights and its heads' mixer.
template <class T>
struct LayerParts {
  layer::Config cfg;
  Matrix<T> w_q, w_k, w_v, w_o;
  Cloned<Mixer<T>> mixer;
};

/// Named read-only views of every parameter: w_q, w_k, w_v, w_o, then each head's mixer blocks.
template <class T>
std::vector<layer::ConstNamedBlock<T>> layer_parameters(const LayerParts<T>& p) {
  std::vector<layer::ConstNamedBlock<T>> out;
  out.emplace_back("w_q", p.w_q.data(), p.w_q.rows(), p.w_q.cols());
  out.emplace_back("w_k", p.w_k.data(), p.w_k.rows(), p.w_k.cols());
  out.emplace_back("w_v", p.w_v.data(), p.w_v.rows(), p.w_v.cols());
  out.emplace_back("w_o", p.w_o.data(), p.w_o.rows(), p.w_o.cols());
  HeadBlock<T> blocks[max_head_blocks];
  for (Index h = 0; h < p.cfg.heads; ++h) {
    const std::string prefix = concat("head", h, ".");
    for (std::size_t j = 0, n = p.mixer->head_blocks(h, blocks); j < n; ++j)
      out.emplace_back(prefix + blocks[j].suffix, blocks[j].data, blocks[j].rows, blocks[j].cols);
  }
  return out;
}

template <class T>
void layer_run_forward(const LayerParts<T>& p, const char* fn, Matrix<T>& y,
                       const ConstMatrixRef<T>& x, layer::Cache<T>& c, bool keep) {
  check_layer_input<T>(p.cfg, fn, x);
  constexpr Index block = gemm_task_rows;
  const Index n = x.rows(), heads = p.cfg.heads, r = p.cfg.key_dim, d_v = p.cfg.value_dim;
  c.tokens = -1;  // stays invalid if a head throws
  c.q.resize(n, heads * r);
  c.k.resize(n, heads * r);
  c.v.resize(n, heads * d_v);
  c.gemm.clear();  // the projections in row blocks, on the pool
  c.gemm.add(c.q, {plain<T>(x)}, {plain<T>(p.w_q)}, T(1), false, block);
  c.gemm.add(c.k, {plain<T>(x)}, {plain<T>(p.w_k)}, T(1), false, block);
  c.gemm.add(c.v, {plain<T>(x)}, {plain<T>(p.w_v)}, T(1), false, block);
  c.gemm.run(p.cfg.threads);
  check_projections<T>(p.cfg, fn, c.q, c.k, c.v);
  c.mixed.resize(n, heads * d_v);
  const Index items = (static_cast<Index>(c.offsets.size()) - 1) * heads;
  p.mixer->prepare_forward(c.saved, static_cast<std::size_t>(items));
  c.head_out.resize(static_cast<std::size_t>(items));
  parallel_largest_first(
      items, p.cfg.threads, [&](Index i) { return layer_sequence_length(p, c.offsets, i); },
      [&](Index i) { layer_head_forward(p, c, i, keep); }, c.order);
  y.resize(n, p.cfg.model_dim);
  c.gemm.clear();
  c.gemm.add(y, {plain<T>(c.mixed)}, {plain<T>(p.w_o)}, T(1), false, block);
  c.gemm.run(p.cfg.threads);
  if (p.cfg.check_finite) require_finite_result(y, fn, "the output", "x or a weight is");
  if (keep) {  // recomputed by every forward that fills the cache
    c.fingerprint[0] = fingerprint(x);
    c.fingerprint[1] = layer_parameter_fingerprint(p);
    c.tokens = n;
  }
}

template <class T>
Index layer_sequence_length(const LayerParts<T>& p, const Offsets& offsets, Index item) {
  const std::size_t b = static_cast<std::size_t>(item / p.cfg.heads);
  return offsets[b + 1] - offsets[b];
}

/// The mixer of item i = b H + h: head h on sequence b.
template <class T>
void layer_head_forward(const LayerParts<T>& p, layer::Cache<T>& c, Index item, bool keep) {
  const Index r = p.cfg.key_dim, d_v = p.cfg.value_dim, h = item % p.cfg.heads;
  const Index t0 = c.offsets[static_cast<std::size_t>(item / p.cfg.heads)];
  const Index n = layer_sequence_length(p, c.offsets, item);
  if (p.cfg.rope) {  // the item's own blocks, positions from 0: the cache keeps the rotated q, k
    const rope::Options ro = layer_rope_options(p.cfg);
    rope::apply_in_place<T>(c.q.block(t0, h * r, n, r), 0, ro);
    rope::apply_in_place<T>(c.k.block(t0, h * r, n, r), 0, ro);
  }
  Matrix<T>& out = c.head_out[static_cast<std::size_t>(item)];
  p.mixer->forward(out, layer_item<T>(c.q, c.k, c.v, c.offsets, p.cfg.heads, item), c.saved, keep);
  c.mixed.block(t0, h * d_v, n, d_v) = out;
}

template <class T>
void layer_check_backward(const LayerParts<T>& p, const char* fn, const ConstMatrixRef<T>& x,
                          const ConstMatrixRef<T>& grad_y, const layer::Cache<T>& cache) {
  check_layer_input<T>(p.cfg, fn, x);
  require(grad_y.rows() == x.rows() && grad_y.cols() == x.cols(), fn, "grad_y is ",
          shape_str(grad_y), " but x is ", shape_str(x));
  if (p.cfg.check_finite) require_finite(grad_y, fn, "grad_y");
  if (cache.tokens != x.rows())  // the message is built only on failure
    require(false, fn, "cache ",
            cache.tokens < 0 ? std::string("is empty")
                             : concat("holds a forward of ", cache.tokens, " tokens"),
            " but x has ", x.rows(), " rows (call forward(x, &cache) first)");
  const std::size_t expected_saved =
      static_cast<std::size_t>(p.cfg.heads) * (cache.offsets.size() - 1);
  const std::size_t saved = p.mixer->saved_items(cache.saved);
  require(saved == expected_saved, fn, "cache holds ", saved,
          " head records of this mixer but the layer has ", p.cfg.heads,
          " heads (was it filled by another layer?)");
  if (fingerprint(x) != cache.fingerprint[0]) raise_other_data(fn, "cache", "x");
  if (layer_parameter_fingerprint(p) != cache.fingerprint[1])
    raise_other_data(fn, "cache", "a parameter of the layer");
}

/// Names and shapes of g's blocks and where each parameter's block is, set once by name: a
/// reused Gradients of this layer's shapes keeps them.
template <class T>
void layer_prepare_gradients(const LayerParts<T>& p, layer::Gradients<T>& g) {
  if (layer_gradients_fit(p, g)) return;
  const std::vector<layer::ConstNamedBlock<T>> params = layer_parameters(p);
  g.names.clear();
  g.params.resize(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    g.names.push_back(params[i].name);
    g.params[i].resize(params[i].rows, params[i].cols);
  }
  const char* weights[4] = {"w_q", "w_k", "w_v", "w_o"};
  for (std::size_t i = 0; i < 4; ++i) g.slot_w[i] = g.index_of(weights[i]);
  g.slot_head.assign(static_cast<std::size_t>(p.cfg.heads), {});
  HeadBlock<T> blocks[max_head_blocks];
  for (Index h = 0; h < p.cfg.heads; ++h) {
    const std::string prefix = concat("head", h, ".");
    for (std::size_t j = 0, n = p.mixer->head_blocks(h, blocks); j < n; ++j)
      g.slot_head[static_cast<std::size_t>(h)][j] = g.index_of(prefix + blocks[j].suffix);
  }
}

/// Whether g's blocks were set up for this layer's parameters (count and every slot's shape).
template <class T>
bool layer_gradients_fit(const LayerParts<T>& p, const layer::Gradients<T>& g) {
  if (g.names.size() != g.params.size() ||
      g.slot_head.size() != static_cast<std::size_t>(p.cfg.heads))
    return false;
  const auto fits = [&](std::size_t slot, Index rows, Index cols) {
    return slot < g.params.size() && g.params[slot].rows() == rows && g.params[slot].cols() == cols;
  };
  const Matrix<T>* w[4] = {&p.w_q, &p.w_k, &p.w_v, &p.w_o};
  for (std::size_t i = 0; i < 4; ++i)
    if (!fits(g.slot_w[i], w[i]->rows(), w[i]->cols())) return false;
  std::size_t count = 4;
  HeadBlock<T> blocks[max_head_blocks];
  for (Index h = 0; h < p.cfg.heads; ++h) {
    const std::size_t n = p.mixer->head_blocks(h, blocks);
    count += n;
    for (std::size_t j = 0; j < n; ++j)
      if (!fits(g.slot_head[static_cast<std::size_t>(h)][j], blocks[j].rows, blocks[j].cols))
        return false;
  }
  return count == g.params.size();
}

template <class T>
void layer_run_backward(const LayerParts<T>& p, const char* fn, layer::Gradients<T>& g,
                        const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& grad_y,
                        const layer::Cache<T>& cache) {
  layer_check_backward(p, fn, x, grad_y, cache);
  const Index n = x.rows(), heads = p.cfg.heads, r = p.cfg.key_dim, d_v = p.cfg.value_dim;
  layer_prepare_gradients(p, g);
  // Y = M W_O: dW_O = Mᵀ dY (one task: its depth is N), dM = dY W_Oᵀ (row blocks).
  constexpr Index block = gemm_task_rows;
  g.d_mixed.resize(n, heads * d_v);
  g.gemm.clear();
  g.gemm.add(g.params[g.slot_w[3]], {transposed<T>(cache.mixed)}, {plain<T>(grad_y)}, T(1), false,
             0);
  g.gemm.add(g.d_mixed, {plain<T>(grad_y)}, {transposed<T>(p.w_o)}, T(1), false, block);
  g.gemm.run(p.cfg.threads);
  if (p.cfg.check_finite)
    require_finite_result(g.d_mixed, fn, "the heads' output gradient dY W_O^T", "grad_y or w_o is");
  g.dq.resize(n, heads * r);
  g.dk.resize(n, heads * r);
  g.dv.resize(n, heads * d_v);
  const Index items = (static_cast<Index>(cache.offsets.size()) - 1) * heads;
  p.mixer->prepare_backward(g.heads, static_cast<std::size_t>(items));
  parallel_largest_first(
      items, p.cfg.threads, [&](Index i) { return layer_sequence_length(p, cache.offsets, i); },
      [&](Index i) { layer_head_backward(p, g, cache, i); }, g.order);
  sum_head_gradients<T>(*p.mixer.operator->(), g, heads, items);
  // Q = X W_Q etc.: dW = Xᵀ dQ (one task each), dX = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ (row
  // blocks, the three terms in this order).
  g.x.resize(n, p.cfg.model_dim);
  g.gemm.clear();
  g.gemm.add(g.params[g.slot_w[0]], {transposed<T>(x)}, {plain<T>(g.dq)}, T(1), false, 0);
  g.gemm.add(g.params[g.slot_w[1]], {transposed<T>(x)}, {plain<T>(g.dk)}, T(1), false, 0);
  g.gemm.add(g.params[g.slot_w[2]], {transposed<T>(x)}, {plain<T>(g.dv)}, T(1), false, 0);
  g.gemm.add(g.x, {plain<T>(g.dq), plain<T>(g.dk), plain<T>(g.dv)},
             {transposed<T>(p.w_q), transposed<T>(p.w_k), transposed<T>(p.w_v)}, T(1), false,
             block);
  g.gemm.run(p.cfg.threads);
  if (p.cfg.check_finite) {
    const char* culprit = "x, grad_y or a parameter is";
    require_finite_result(g.x, fn, "the gradient of x", culprit);
    for (std::size_t i = 0; i < g.params.size(); ++i)
      require_finite_result(g.params[i], fn, "a parameter's gradient", culprit);
  }
}

/// The backward of item i = b H + h into its own record and its rows of dQ, dK, dV.
template <class T>
void layer_head_backward(const LayerParts<T>& p, layer::Gradients<T>& g,
                         const layer::Cache<T>& cache, Index item) {
  const Index r = p.cfg.key_dim, d_v = p.cfg.value_dim, h = item % p.cfg.heads;
  const Index t0 = cache.offsets[static_cast<std::size_t>(item / p.cfg.heads)];
  const Index n = layer_sequence_length(p, cache.offsets, item);
  const InputGrads<T> d =
      p.mixer->backward(layer_item<T>(cache.q, cache.k, cache.v, cache.offsets, p.cfg.heads, item),
                        g.d_mixed.block(t0, h * d_v, n, d_v), cache.saved, g.heads);
  g.dq.block(t0, h * r, n, r) = *d.q;
  g.dk.block(t0, h * r, n, r) = *d.k;
  g.dv.block(t0, h * d_v, n, d_v) = *d.v;
  if (p.cfg.rope) {  // the mixer saw R q and R k: dq = R^T d(Rq), dk = R^T d(Rk) (SPEC 8.2)
    const rope::Options ro = layer_rope_options(p.cfg);
    rope::backward_in_place<T>(g.dq.block(t0, h * r, n, r), 0, ro);
    rope::backward_in_place<T>(g.dk.block(t0, h * r, n, r), 0, ro);
  }
}

/// Fingerprint of every parameter, in layer_parameters(p) order (without building the list:
/// forward and backward take it on every call).
template <class T>
std::uint64_t layer_parameter_fingerprint(const LayerParts<T>& p) {
  Fingerprint f;
  for (const Matrix<T>* w : {&p.w_q, &p.w_k, &p.w_v, &p.w_o})
    f.add(w->data(), w->rows(), w->cols(), w->cols());
  HeadBlock<T> blocks[max_head_blocks];
  for (Index h = 0; h < p.cfg.heads; ++h)
    for (std::size_t j = 0, n = p.mixer->head_blocks(h, blocks); j < n; ++j)
      f.add(blocks[j].data, blocks[j].rows, blocks[j].cols, blocks[j].cols);
  return f.value();
}

}  // namespace detail
MIXATTN_END_NAMESPACE
