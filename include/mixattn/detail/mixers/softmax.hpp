// mixattn/detail/mixers/softmax.hpp — exact softmax attention, tiled (SPEC §3), as a layer
// mixer: bidirectional or causal (with Config::softmax.window), no parameters; decodes from a
// key/value cache per head.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/detail/mixers/mixer.hpp"
#include "mixattn/reference.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
class SoftmaxMixer final : public Mixer<T> {
 public:
  static constexpr const char* name = "softmax";
  static void check(const char*, const layer::Config&) {}
  explicit SoftmaxMixer(const layer::Config& cfg)
      : opt_(with_causality(cfg.softmax, cfg.causal)),
        key_dim_(cfg.key_dim),
        value_dim_(cfg.value_dim) {}
  std::unique_ptr<Mixer<T>> clone() const override { return std::make_unique<SoftmaxMixer>(*this); }

  std::size_t head_blocks(Index, HeadBlock<T>*) const override { return 0; }
  void prepare_forward(OwnedRecords& saved, std::size_t items) const override {
    saved.make<Saved>().items.resize(items);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    reference::flash_forward_into<T>(out, it.q, it.k, it.v, opt_,
                                     keep ? &saved.as<Saved>()->items[it.index] : nullptr);
  }
  std::size_t saved_items(const OwnedRecords& saved) const override {
    return saved.as<Saved>() ? saved.as<Saved>()->items.size() : 0;
  }
  void prepare_backward(OwnedRecords& grads, std::size_t items) const override {
    grads.make<Grads>().items.resize(items);
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    reference::Grad<T>& g = grads.as<Grads>()->items[it.index];
    reference::flash_backward_into<T>(g, it.q, it.k, it.v, dout, saved.as<Saved>()->items[it.index],
                                      opt_);
    return {&g.q, &g.k, &g.v};
  }

  bool decodes() const override { return true; }
  void begin_decoding(OwnedRecords& state, Index heads, Index reserve) const override {
    Decoding& d = state.make<Decoding>();
    for (Index h = 0; h < heads; ++h) d.items.emplace_back(key_dim_, value_dim_, reserve);
  }
  std::size_t decoding_heads(const OwnedRecords& state) const override {
    return state.as<Decoding>() ? state.as<Decoding>()->items.size() : 0;
  }
  void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& it,
              OwnedRecords& state) const override {
    reference::KvCache<T>& c = state.as<Decoding>()->items[static_cast<std::size_t>(it.head)];
    out = reference::decode<T>(c, it.q, it.k, it.v, opt_);
  }

 private:
  using Saved = ItemRecords<reference::Saved<T>>;
  using Grads = ItemRecords<reference::Grad<T>>;
  using Decoding = ItemRecords<reference::KvCache<T>>;

  reference::Options opt_;
  Index key_dim_, value_dim_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
