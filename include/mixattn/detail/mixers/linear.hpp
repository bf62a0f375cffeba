// mixattn/detail/mixers/linear.hpp — linear attention with elu + 1 features (SPEC §4) as a layer
// mixer: bidirectional or causal, no parameters, no streaming state.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/detail/mixers/mixer.hpp"
#include "mixattn/linear.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
class LinearMixer final : public Mixer<T> {
 public:
  static constexpr const char* name = "linear";
  static void check(const char* fn, const layer::Config& cfg) {
    check_mixer_eps(fn, "linear", cfg.linear.eps, std::is_same<T, float>::value);
    check_mixer_chunk(fn, "linear", cfg.linear.chunk);
  }
  explicit LinearMixer(const layer::Config& cfg) : opt_(with_causality(cfg.linear, cfg.causal)) {}
  std::unique_ptr<Mixer<T>> clone() const override { return std::make_unique<LinearMixer>(*this); }

  std::size_t head_blocks(Index, HeadBlock<T>*) const override { return 0; }
  void prepare_forward(OwnedRecords& saved, std::size_t items) const override {
    saved.make<Saved>().items.resize(items);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    linear::forward_into<T>(out, it.q, it.k, it.v, opt_,
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
    linear::Grad<T>& g = grads.as<Grads>()->items[it.index];
    linear::backward_into<T>(g, it.q, it.k, it.v, dout, saved.as<Saved>()->items[it.index], opt_);
    return {&g.q, &g.k, &g.v};
  }

 private:
  using Saved = ItemRecords<linear::Saved<T>>;
  using Grads = ItemRecords<linear::Grad<T>>;

  linear::Options opt_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
