// mixattn/layer_config.hpp — the shape and behaviour of a layer::MultiHeadAttention (layer.hpp):
// which mixer its heads run and every option of every mixer.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/linear.hpp"
#include "mixattn/ovq.hpp"
#include "mixattn/performer.hpp"
#include "mixattn/reference.hpp"
#include "mixattn/rope.hpp"
#include "mixattn/vq.hpp"

#include <cstdint>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// Which sequence mixer every head runs.
enum class MixerKind {
  gma,        ///< Gaussian Mixture Attention (SPEC §1), bidirectional or causal
  ovq,        ///< Online vector-quantized attention (SPEC §2), always causal
  softmax,    ///< exact softmax attention, tiled (SPEC §3), bidirectional or causal
  linear,     ///< linear attention, elu + 1 features (SPEC §4), bidirectional or causal
  performer,  ///< Performer / FAVOR+ random features (SPEC §5), bidirectional or causal
  vq,         ///< static learned-codebook VQ attention (SPEC §6), bidirectional or causal
};

/// Shape and behaviour of a MultiHeadAttention layer.
struct Config {
  Index model_dim = 0;  ///< d_model: columns of X and Y
  Index heads = 1;      ///< H
  Index key_dim = 0;    ///< r: routing/key dimension per head
  Index value_dim = 0;  ///< d_v: value dimension per head
  MixerKind mixer = MixerKind::gma;
  /// Token i sees only j <= i. Decides for GMA, softmax, linear, Performer and VQ (the `causal`
  /// fields of their options below are overridden by it); OVQ is causal by construction and
  /// requires true.
  bool causal = false;
  Index components = 16;         ///< K, mixture components per head (GMA)
  double gma_mean_scale = 1;     ///< initial component means ~ N(0, 1)·gma_mean_scale (SPEC 1.1)
  gma::Options gma;              ///< eps, chunk, check_finite of every GMA head
  ovq::Options ovq;              ///< block, dictionary size, growth, … of every OVQ head
  reference::Options softmax;    ///< scale (0: 1/sqrt(r)) and check_finite of softmax heads
  linear::Options linear;        ///< eps, chunk, check_finite of linear-attention heads
  performer::Options performer;  ///< eps, chunk, scale (0: r^(-1/4)) of Performer heads
  /// m, random features per Performer head. Head h's directions are
  /// performer::Features::random(features, r, seed + 1 + h, feature_draw), drawn once when the
  /// layer is made and never redrawn by it (features(h).redraw(s) does, between steps); they are
  /// a constant input, not a parameter: no gradient, not in parameters() or the parameter file.
  Index features = 64;
  performer::Draw feature_draw = performer::Draw::orthogonal;  ///< how the directions are drawn
  vq::Options vq;  ///< eps, chunk, scale (0: 1/sqrt(r)) of VQ heads
  /// S, codes per VQ head. Head h's codebook "head<h>.codebook" (S x r) is a learned parameter,
  /// initialised ~ N(0, 1) * codebook_scale from an mt19937_64 seeded with seed + 1 + h (keys
  /// x W_K of unit-variance x are ~ N(0, 1) entrywise at initialisation, so the codes start
  /// where the keys are).
  Index codes = 64;
  double codebook_scale = 1;
  int threads = 1;           ///< threads over heads (0: all cores)
  std::uint64_t seed = 0;    ///< initialisation seed (weights, mixtures, codebooks, features)
  bool check_finite = true;  ///< reject NaN/Inf in X and dY with std::domain_error
  /// Rotate every head's queries and keys by RoPE (SPEC §8, 8.4) before its mixer: row n of a
  /// sequence is at position n (positions restart at each sequence of a packed batch; decode
  /// continues at DecodeState::tokens_seen). Needs an even key_dim. Works with any mixer (it is
  /// how the sliding-window softmax layers of OVQ's hybrids, softmax.window = w, see order); no
  /// parameters and no gradient of its own.
  bool rope = false;
  /// base of the rotation angles (10000); its check_finite is ignored: config.check_finite
  /// decides.
  rope::Options rope_options;
};

}  // namespace layer
MIXATTN_END_NAMESPACE
