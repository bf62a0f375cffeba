// mixattn/layer/mixers/vq.hpp — static learned-codebook VQ attention (SPEC §6) as a layer mixer:
// bidirectional or causal, one codebook per head ("head<h>.codebook", S x r, initially
// N(0, 1) · codebook_scale from seed + 1 + h); no streaming state. Its part of the layer's
// Config, its accessor on the layer.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/vq.hpp"

#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The VQ mixer's part of the layer's Config.
struct VqConfig {
  vq::Options vq;  ///< eps, chunk, scale (0: 1/sqrt(r)) of VQ heads
  /// S, codes per VQ head. Head h's codebook "head<h>.codebook" (S x r) is a learned parameter,
  /// initialised ~ N(0, 1) * codebook_scale from an mt19937_64 seeded with seed + 1 + h (keys
  /// x W_K of unit-variance x are ~ N(0, 1) entrywise at initialisation, so the codes start
  /// where the keys are).
  Index codes = 64;
  double codebook_scale = 1;
};

}  // namespace layer

namespace detail {

template <class T>
class VqMixer final : public ItemMixer<T, VqMixer<T>, vq::Saved<T>, vq::Grad<T>> {
 public:
  static constexpr const char* name = "vq";
  static constexpr bool decoding = false;
  using Slice = layer::VqConfig;
  static void check(const char* fn, const layer::CommonConfig&, const Slice& own) {
    const bool is_float = std::is_same<T, float>::value;
    check_mixer_eps(fn, "vq", own.vq.eps, is_float);
    check_mixer_chunk(fn, "vq", own.vq.chunk);
    check_mixer_scale(fn, "vq", own.vq.scale, is_float);
    require(own.codes >= 1, fn, "config.codes must be >= 1 for VQ, got ", own.codes);
    require(own.codebook_scale > 0 && std::isfinite(own.codebook_scale), fn,
            "config.codebook_scale must be > 0 and finite, got ", own.codebook_scale);
  }
  VqMixer(const layer::CommonConfig& cfg, const Slice& own)
      : opt_(with_causality(own.vq, cfg.causal)) {
    for (Index h = 0; h < cfg.heads; ++h) {
      std::mt19937_64 rng(cfg.seed + 1 + static_cast<std::uint64_t>(h));
      codebooks_.push_back(gaussian_matrix<T>(own.codes, cfg.key_dim, own.codebook_scale, rng));
    }
  }

  std::vector<Matrix<T>>& codebooks() { return codebooks_; }
  const std::vector<Matrix<T>>& codebooks() const { return codebooks_; }

  const char* kind_name() const override { return name; }
  std::size_t head_blocks(Index h, HeadBlock<T>* out) const override {
    const Matrix<T>& c = codebooks_[static_cast<std::size_t>(h)];
    out[0] = {"codebook", c.data(), c.rows(), c.cols()};
    return 1;
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    vq::forward_into<T>(out, it.q, it.k, it.v, head(it), opt_, this->saved_item(saved, it, keep));
  }
  /// dk is the straight-through gradient (SPEC 6.3).
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    vq::Grad<T>& g = this->grad_item(grads, it.index);
    vq::backward_into<T>(g, it.q, it.k, it.v, head(it), dout, this->saved_item(saved, it), opt_);
    return {&g.q, &g.k, &g.v};
  }
  std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                             HeadBlock<T>* out) const override {
    const Matrix<T>& c = this->grad_item(grads, index).codebook;
    out[0] = {"codebook", c.data(), c.rows(), c.cols()};
    return 1;
  }

 private:
  const Matrix<T>& head(const MixerItem<T>& it) const {
    return codebooks_[static_cast<std::size_t>(it.head)];
  }

  vq::Options opt_;
  std::vector<Matrix<T>> codebooks_;  // one per head
};

/// What a layer offers for its VQ heads (MultiHeadAttention derives from it): each head's
/// codebook.
template <class Layer, class T>
class VqAccessors {
 public:
  /// Head h's codebook (VQ layers only; S x r, the parameter "head<h>.codebook").
  Matrix<T>& codebook(Index h) { return head(h); }
  const Matrix<T>& codebook(Index h) const { return head(h); }

 private:
  Matrix<T>& head(Index h) const {
    return mixer_head<VqMixer<T>>(static_cast<const Layer&>(*this), h,
                                  "mixattn::layer::MultiHeadAttention::codebook")
        .codebooks()[static_cast<std::size_t>(h)];
  }
};

}  // namespace detail
MIXATTN_END_NAMESPACE
