// mixattn/layer/mixers/performer.hpp — Performer / FAVOR+ (SPEC §5) as a layer mixer:
// bidirectional or causal, with its own constant random features per head (drawn once from
// seed + 1 + h; an input, not a parameter), no streaming state. Its part of the layer's Config,
// its accessor on the layer.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/performer.hpp"

#include <cstdint>
#include <type_traits>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The Performer mixer's part of the layer's Config.
struct PerformerConfig {
  performer::Options performer;  ///< eps, chunk, scale (0: r^(-1/4)) of Performer heads
  /// m, random features per Performer head. Head h's directions are
  /// performer::Features::random(features, r, seed + 1 + h, feature_draw), drawn once when the
  /// layer is made and never redrawn by it (features(h).redraw(s) does, between steps); they are
  /// a constant input, not a parameter: no gradient, not in parameters() or the parameter file.
  Index features = 64;
  performer::Draw feature_draw = performer::Draw::orthogonal;  ///< how the directions are drawn
};

}  // namespace layer

namespace detail {

template <class T>
class PerformerMixer final
    : public ItemMixer<T, PerformerMixer<T>, performer::Saved<T>, performer::Grad<T>> {
 public:
  static constexpr const char* name = "performer";
  static constexpr bool decoding = false;
  using Slice = layer::PerformerConfig;
  static void check(const char* fn, const layer::CommonConfig&, const Slice& own) {
    const bool is_float = std::is_same<T, float>::value;
    check_mixer_eps(fn, "performer", own.performer.eps, is_float);
    check_mixer_chunk(fn, "performer", own.performer.chunk);
    check_mixer_scale(fn, "performer", own.performer.scale, is_float);
    require(own.features >= 1, fn, "config.features must be >= 1 for Performer, got ",
            own.features);
  }
  PerformerMixer(const layer::CommonConfig& cfg, const Slice& own)
      : opt_(with_causality(own.performer, cfg.causal)) {
    for (Index h = 0; h < cfg.heads; ++h)
      features_.push_back(performer::Features<T>::random(
          own.features, cfg.key_dim, cfg.seed + 1 + static_cast<std::uint64_t>(h),
          own.feature_draw));
  }

  std::vector<performer::Features<T>>& features() { return features_; }
  const std::vector<performer::Features<T>>& features() const { return features_; }

  const char* kind_name() const override { return name; }
  std::size_t head_blocks(Index, HeadBlock<T>*) const override { return 0; }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    performer::forward_into<T>(out, it.q, it.k, it.v, head(it), opt_,
                               this->saved_item(saved, it, keep));
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    performer::Grad<T>& g = this->grad_item(grads, it.index);
    performer::backward_into<T>(g, it.q, it.k, it.v, head(it), dout, this->saved_item(saved, it),
                                opt_);
    return {&g.q, &g.k, &g.v};
  }

 private:
  const performer::Features<T>& head(const MixerItem<T>& it) const {
    return features_[static_cast<std::size_t>(it.head)];
  }

  performer::Options opt_;
  std::vector<performer::Features<T>> features_;  // one per head (constant)
};

/// What a layer offers for its Performer heads (MultiHeadAttention derives from it): each head's
/// random feature directions.
template <class Layer, class T>
class PerformerAccessors {
 public:
  /// Head h's random feature directions (Performer layers only; m x r, a constant input).
  performer::Features<T>& features(Index h) { return head(h); }
  const performer::Features<T>& features(Index h) const { return head(h); }

 private:
  performer::Features<T>& head(Index h) const {
    return mixer_head<PerformerMixer<T>>(static_cast<const Layer&>(*this), h,
                                         "mixattn::layer::MultiHeadAttention::features")
        .features()[static_cast<std::size_t>(h)];
  }
};

}  // namespace detail
MIXATTN_END_NAMESPACE
