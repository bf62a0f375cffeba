// mixattn/layer/mixers/softmax.hpp — exact softmax attention (SPEC §3, the tiled form) as a layer
// mixer: bidirectional or causal, with a sliding window (options.window, SPEC §7) when causal;
// decodes from a key/value cache per head. Its part of the layer's Config.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/reference.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The softmax mixer's part of the layer's Config.
struct SoftmaxConfig {
  reference::Options softmax;  ///< scale (0: 1/sqrt(r)), window and check_finite of softmax heads
};

}  // namespace layer

namespace detail {

template <class T>
class SoftmaxMixer final
    : public ItemMixer<T, SoftmaxMixer<T>, reference::Saved<T>, reference::Grad<T>> {
 public:
  static constexpr const char* name = "softmax";
  static constexpr bool decoding = true;
  using Slice = layer::SoftmaxConfig;
  static void check(const char*, const layer::CommonConfig&, const Slice&) {}
  SoftmaxMixer(const layer::CommonConfig& cfg, const Slice& own)
      : opt_(with_causality(own.softmax, cfg.causal)),
        key_dim_(cfg.key_dim),
        value_dim_(cfg.value_dim) {}

  const char* kind_name() const override { return name; }
  std::size_t head_blocks(Index, HeadBlock<T>*) const override { return 0; }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    reference::flash_forward_into<T>(out, it.q, it.k, it.v, opt_,
                                     this->saved_item(saved, it, keep));
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    reference::Grad<T>& g = this->grad_item(grads, it.index);
    reference::flash_backward_into<T>(g, it.q, it.k, it.v, dout, this->saved_item(saved, it), opt_);
    return {&g.q, &g.k, &g.v};
  }

  bool decodes() const override { return decoding; }
  void begin_decoding(OwnedRecords& state, Index heads, Index reserve) const override {
    Decoding& d = state.make<Decoding>();
    for (Index h = 0; h < heads; ++h) d.items.emplace_back(key_dim_, value_dim_, reserve);
  }
  std::size_t decoding_heads(const OwnedRecords& state) const override {
    return this->template decoding_items<Decoding>(state);
  }
  void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& it,
              OwnedRecords& state) const override {
    reference::KvCache<T>& c = state.as<Decoding>()->items[static_cast<std::size_t>(it.head)];
    out = reference::decode<T>(c, it.q, it.k, it.v, opt_);
  }

 private:
  using Decoding = ItemRecords<reference::KvCache<T>>;

  reference::Options opt_;
  Index key_dim_, value_dim_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
