// mixattn/detail/mixers/vq.hpp — static learned-codebook VQ attention (SPEC §6) as a layer
// mixer: bidirectional or causal, one codebook per head ("head<h>.codebook", S x r, initially
// N(0, 1) · codebook_scale from seed + 1 + h); no streaming state.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/detail/mixers/mixer.hpp"
#include "mixattn/vq.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
class VqMixer final : public Mixer<T> {
 public:
  static constexpr const char* name = "vq";
  static void check(const char* fn, const layer::Config& cfg) {
    const bool is_float = std::is_same<T, float>::value;
    check_mixer_eps(fn, "vq", cfg.vq.eps, is_float);
    check_mixer_chunk(fn, "vq", cfg.vq.chunk);
    check_mixer_scale(fn, "vq", cfg.vq.scale, is_float);
    require(cfg.codes >= 1, fn, "config.codes must be >= 1 for VQ, got ", cfg.codes);
    require(cfg.codebook_scale > 0 && std::isfinite(cfg.codebook_scale), fn,
            "config.codebook_scale must be > 0 and finite, got ", cfg.codebook_scale);
  }
  explicit VqMixer(const layer::Config& cfg) : opt_(with_causality(cfg.vq, cfg.causal)) {
    for (Index h = 0; h < cfg.heads; ++h) {
      std::mt19937_64 rng(cfg.seed + 1 + static_cast<std::uint64_t>(h));
      codebooks_.push_back(gaussian_matrix<T>(cfg.codes, cfg.key_dim, cfg.codebook_scale, rng));
    }
  }
  std::unique_ptr<Mixer<T>> clone() const override { return std::make_unique<VqMixer>(*this); }

  std::vector<Matrix<T>>& codebooks() { return codebooks_; }
  const std::vector<Matrix<T>>& codebooks() const { return codebooks_; }

  std::size_t head_blocks(Index h, HeadBlock<T>* out) const override {
    const Matrix<T>& c = codebooks_[static_cast<std::size_t>(h)];
    out[0] = {"codebook", c.data(), c.rows(), c.cols()};
    return 1;
  }
  void prepare_forward(OwnedRecords& saved, std::size_t items) const override {
    saved.make<Saved>().items.resize(items);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    vq::forward_into<T>(out, it.q, it.k, it.v, head(it), opt_,
                        keep ? &saved.as<Saved>()->items[it.index] : nullptr);
  }
  std::size_t saved_items(const OwnedRecords& saved) const override {
    return saved.as<Saved>() ? saved.as<Saved>()->items.size() : 0;
  }
  void prepare_backward(OwnedRecords& grads, std::size_t items) const override {
    grads.make<Grads>().items.resize(items);
  }
  /// dk is the straight-through gradient (SPEC 6.3).
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    vq::Grad<T>& g = grads.as<Grads>()->items[it.index];
    vq::backward_into<T>(g, it.q, it.k, it.v, head(it), dout, saved.as<Saved>()->items[it.index],
                         opt_);
    return {&g.q, &g.k, &g.v};
  }
  std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                             HeadBlock<T>* out) const override {
    const Matrix<T>& c = grads.as<Grads>()->items[index].codebook;
    out[0] = {"codebook", c.data(), c.rows(), c.cols()};
    return 1;
  }

 private:
  using Saved = ItemRecords<vq::Saved<T>>;
  using Grads = ItemRecords<vq::Grad<T>>;
  const Matrix<T>& head(const MixerItem<T>& it) const {
    return codebooks_[static_cast<std::size_t>(it.head)];
  }

  vq::Options opt_;
  std::vector<Matrix<T>> codebooks_;  // one per head
};

}  // namespace detail
MIXATTN_END_NAMESPACE
