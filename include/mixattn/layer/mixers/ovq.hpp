// mixattn/layer/mixers/ovq.hpp — online vector-quantized attention (SPEC §2) as a layer mixer:
// always causal, one scale factor beta per head (a 1 x 1 parameter, initially 1); every forward
// processes a sequence from an empty State; decodes from an ovq::State per head. Its part of the
// layer's Config, its accessor on the layer.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/ovq.hpp"

#include <memory>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The OVQ mixer's part of the layer's Config.
struct OvqConfig {
  ovq::Options ovq;  ///< block, dictionary size, growth, … of every OVQ head
};

}  // namespace layer

namespace detail {

template <class T>
struct OvqItem {  // one item's record and the sequence's end state, kept to reuse its memory
  ovq::Saved<T> saved;
  ovq::State<T> end;
};

template <class T>
class OvqMixer final : public ItemMixer<T, OvqMixer<T>, OvqItem<T>, ovq::Grad<T>> {
 public:
  static constexpr const char* name = "ovq";
  static constexpr bool decoding = true;
  using Slice = layer::OvqConfig;
  static void check(const char* fn, const layer::CommonConfig& cfg, const Slice&) {
    require(cfg.causal, fn, "OVQ attention is causal: set config.causal = true");
  }
  OvqMixer(const layer::CommonConfig& cfg, const Slice& own)
      : opt_(own.ovq),
        key_dim_(cfg.key_dim),
        value_dim_(cfg.value_dim),
        beta_(Vector<T>::Ones(cfg.heads)) {}

  Vector<T>& beta() { return beta_; }
  const Vector<T>& beta() const { return beta_; }

  const char* kind_name() const override { return name; }
  std::size_t head_blocks(Index h, HeadBlock<T>* out) const override {
    out[0] = {"beta", beta_.data() + h, 1, 1};
    return 1;
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    OvqItem<T>& item = *this->saved_item(saved, it, true);
    const ovq::State<T> empty = ovq::State<T>::empty(key_dim_, value_dim_);  // 0-row: no heap
    ovq::forward_into(out, it.q, it.k, it.v, beta_[it.head], opt_, empty, item.end,
                      keep ? &item.saved : nullptr);
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    ovq::Grad<T>& g = this->grad_item(grads, it.index);
    ovq::backward_into(g, it.q, it.k, it.v, beta_[it.head], dout, this->saved_item(saved, it).saved,
                       opt_);
    return {&g.q, &g.k, &g.v};
  }
  std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                             HeadBlock<T>* out) const override {
    out[0] = {"beta", &this->grad_item(grads, index).beta, 1, 1};
    return 1;
  }

  bool decodes() const override { return decoding; }
  void begin_decoding(OwnedRecords& state, Index heads, Index) const override {
    Decoding& d = state.make<Decoding>();
    for (Index h = 0; h < heads; ++h) d.items.push_back(ovq::State<T>::empty(key_dim_, value_dim_));
  }
  std::size_t decoding_heads(const OwnedRecords& state) const override {
    return this->template decoding_items<Decoding>(state);
  }
  void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& it,
              OwnedRecords& state) const override {
    ovq::State<T>& st = state.as<Decoding>()->items[static_cast<std::size_t>(it.head)];
    out = ovq::forward(it.q, it.k, it.v, beta_[it.head], opt_, st);
  }

 private:
  using Decoding = ItemRecords<ovq::State<T>>;

  ovq::Options opt_;
  Index key_dim_, value_dim_;
  Vector<T> beta_;  // one per head
};

/// What a layer offers for its OVQ heads (MultiHeadAttention derives from it): each head's scale
/// factor.
template <class Layer, class T>
class OvqAccessors {
 public:
  /// Head h's scale factor beta (OVQ layers only).
  T& beta(Index h) { return head_beta(h); }
  T beta(Index h) const { return head_beta(h); }

 private:
  T& head_beta(Index h) const {
    const Layer& layer = static_cast<const Layer&>(*this);
    OvqMixer<T>* m = layer.template mixer_as<OvqMixer<T>>();
    require(m && h >= 0 && h < layer.config().heads, "mixattn::layer::MultiHeadAttention::beta",
            "beta exists for heads 0..H-1 of an OVQ layer; asked for head ", h);
    return m->beta()[h];
  }
};

}  // namespace detail
MIXATTN_END_NAMESPACE
