// mixattn/detail/mixers/performer.hpp — Performer / FAVOR+ (SPEC §5) as a layer mixer:
// bidirectional or causal, with its own constant random features per head (drawn once from
// seed + 1 + h; an input, not a parameter), no streaming state.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/detail/mixers/mixer.hpp"
#include "mixattn/performer.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
class PerformerMixer final : public Mixer<T> {
 public:
  static constexpr const char* name = "performer";
  static void check(const char* fn, const layer::Config& cfg) {
    const bool is_float = std::is_same<T, float>::value;
    check_mixer_eps(fn, "performer", cfg.performer.eps, is_float);
    check_mixer_chunk(fn, "performer", cfg.performer.chunk);
    check_mixer_scale(fn, "performer", cfg.performer.scale, is_float);
    require(cfg.features >= 1, fn, "config.features must be >= 1 for Performer, got ",
            cfg.features);
  }
  explicit PerformerMixer(const layer::Config& cfg)
      : opt_(with_causality(cfg.performer, cfg.causal)) {
    for (Index h = 0; h < cfg.heads; ++h)
      features_.push_back(performer::Features<T>::random(
          cfg.features, cfg.key_dim, cfg.seed + 1 + static_cast<std::uint64_t>(h),
          cfg.feature_draw));
  }
  std::unique_ptr<Mixer<T>> clone() const override {
    return std::make_unique<PerformerMixer>(*this);
  }

  std::vector<performer::Features<T>>& features() { return features_; }
  const std::vector<performer::Features<T>>& features() const { return features_; }

  std::size_t head_blocks(Index, HeadBlock<T>*) const override { return 0; }
  void prepare_forward(OwnedRecords& saved, std::size_t items) const override {
    saved.make<Saved>().items.resize(items);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    performer::forward_into<T>(out, it.q, it.k, it.v, head(it), opt_,
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
    performer::Grad<T>& g = grads.as<Grads>()->items[it.index];
    performer::backward_into<T>(g, it.q, it.k, it.v, head(it), dout,
                                saved.as<Saved>()->items[it.index], opt_);
    return {&g.q, &g.k, &g.v};
  }

 private:
  using Saved = ItemRecords<performer::Saved<T>>;
  using Grads = ItemRecords<performer::Grad<T>>;
  const performer::Features<T>& head(const MixerItem<T>& it) const {
    return features_[static_cast<std::size_t>(it.head)];
  }

  performer::Options opt_;
  std::vector<performer::Features<T>> features_;  // one per head (constant)
};

}  // namespace detail
MIXATTN_END_NAMESPACE
