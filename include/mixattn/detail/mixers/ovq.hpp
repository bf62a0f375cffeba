// mixattn/detail/mixers/ovq.hpp — online vector-quantized attention (SPEC §2) as a layer mixer:
// always causal, one scale factor beta per head (a 1 x 1 parameter, initially 1); every forward
// processes a sequence from an empty State; decodes from an ovq::State per head.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/detail/mixers/mixer.hpp"
#include "mixattn/ovq.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
class OvqMixer final : public Mixer<T> {
 public:
  static constexpr const char* name = "ovq";
  static void check(const char* fn, const layer::Config& cfg) {
    require(cfg.causal, fn, "OVQ attention is causal: set config.causal = true");
  }
  explicit OvqMixer(const layer::Config& cfg)
      : opt_(cfg.ovq),
        key_dim_(cfg.key_dim),
        value_dim_(cfg.value_dim),
        beta_(Vector<T>::Ones(cfg.heads)) {}
  std::unique_ptr<Mixer<T>> clone() const override { return std::make_unique<OvqMixer>(*this); }

  Vector<T>& beta() { return beta_; }
  const Vector<T>& beta() const { return beta_; }

  std::size_t head_blocks(Index h, HeadBlock<T>* out) const override {
    out[0] = {"beta", beta_.data() + h, 1, 1};
    return 1;
  }
  void prepare_forward(OwnedRecords& saved, std::size_t items) const override {
    saved.make<Saved>().items.resize(items);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    Item& item = saved.as<Saved>()->items[it.index];
    const ovq::State<T> empty = ovq::State<T>::empty(key_dim_, value_dim_);  // 0-row: no heap
    ovq::forward_into(out, it.q, it.k, it.v, beta_[it.head], opt_, empty, item.end,
                      keep ? &item.saved : nullptr);
  }
  std::size_t saved_items(const OwnedRecords& saved) const override {
    return saved.as<Saved>() ? saved.as<Saved>()->items.size() : 0;
  }
  void prepare_backward(OwnedRecords& grads, std::size_t items) const override {
    grads.make<Grads>().items.resize(items);
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    ovq::Grad<T>& g = grads.as<Grads>()->items[it.index];
    ovq::backward_into(g, it.q, it.k, it.v, beta_[it.head], dout,
                       saved.as<Saved>()->items[it.index].saved, opt_);
    return {&g.q, &g.k, &g.v};
  }
  std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                             HeadBlock<T>* out) const override {
    out[0] = {"beta", &grads.as<Grads>()->items[index].beta, 1, 1};
    return 1;
  }

  bool decodes() const override { return true; }
  void begin_decoding(OwnedRecords& state, Index heads, Index) const override {
    Decoding& d = state.make<Decoding>();
    for (Index h = 0; h < heads; ++h) d.items.push_back(ovq::State<T>::empty(key_dim_, value_dim_));
  }
  std::size_t decoding_heads(const OwnedRecords& state) const override {
    return state.as<Decoding>() ? state.as<Decoding>()->items.size() : 0;
  }
  void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& it,
              OwnedRecords& state) const override {
    ovq::State<T>& st = state.as<Decoding>()->items[static_cast<std::size_t>(it.head)];
    out = ovq::forward(it.q, it.k, it.v, beta_[it.head], opt_, st);
  }

 private:
  struct Item {
    ovq::Saved<T> saved;
    ovq::State<T> end;  // the sequence's end state, kept to reuse its memory
  };
  using Saved = ItemRecords<Item>;
  using Grads = ItemRecords<ovq::Grad<T>>;
  using Decoding = ItemRecords<ovq::State<T>>;

  ovq::Options opt_;
  Index key_dim_, value_dim_;
  Vector<T> beta_;  // one per head
};

}  // namespace detail
MIXATTN_END_NAMESPACE
