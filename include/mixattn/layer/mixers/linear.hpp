// mixattn/layer/mixers/linear.hpp — linear attention with elu + 1 features (SPEC §4) as a layer
// mixer: bidirectional or causal, no parameters, no streaming state. Its part of the layer's
// Config.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/linear.hpp"

#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The linear-attention mixer's part of the layer's Config.
struct LinearConfig {
  linear::Options linear;  ///< eps, chunk, check_finite of linear-attention heads
};

}  // namespace layer

namespace detail {

template <class T>
class LinearMixer final : public ItemMixer<T, LinearMixer<T>, linear::Saved<T>, linear::Grad<T>> {
 public:
  static constexpr const char* name = "linear";
  static constexpr bool decoding = false;
  using Slice = layer::LinearConfig;
  static void check(const char* fn, const layer::CommonConfig&, const Slice& own) {
    check_mixer_eps(fn, "linear", own.linear.eps, std::is_same<T, float>::value);
    check_mixer_chunk(fn, "linear", own.linear.chunk);
  }
  LinearMixer(const layer::CommonConfig& cfg, const Slice& own)
      : opt_(with_causality(own.linear, cfg.causal)) {}

  const char* kind_name() const override { return name; }
  std::size_t head_blocks(Index, HeadBlock<T>*) const override { return 0; }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    linear::forward_into<T>(out, it.q, it.k, it.v, opt_, this->saved_item(saved, it, keep));
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    linear::Grad<T>& g = this->grad_item(grads, it.index);
    linear::backward_into<T>(g, it.q, it.k, it.v, dout, this->saved_item(saved, it), opt_);
    return {&g.q, &g.k, &g.v};
  }

 private:
  linear::Options opt_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
