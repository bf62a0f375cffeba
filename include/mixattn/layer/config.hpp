// mixattn/layer/config.hpp — the shape and behaviour of a layer::MultiHeadAttention (layer.hpp):
// what every mixer shares (layer::CommonConfig), which mixer its heads run, and each mixer's own
// part, declared by the mixer (layer/mixers/) and gathered here through the mixer table.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/layer/table.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// Shape and behaviour of a MultiHeadAttention layer: the fields every mixer shares, the mixer,
/// and every mixer's own fields (GmaConfig: components, gma_mean_scale, gma; OvqConfig: ovq;
/// SoftmaxConfig: softmax; LinearConfig: linear; PerformerConfig: performer, features,
/// feature_draw; VqConfig: vq, codes, codebook_scale; DeltaConfig: delta), read only when that
/// mixer is chosen.
struct Config : CommonConfig, ::mixattn::detail::MixerSlices {
  MixerKind mixer = MixerKind::gma;  ///< the mixer every head runs
};

}  // namespace layer
MIXATTN_END_NAMESPACE
