// mixattn/detail/mixers/gma.hpp — Gaussian Mixture Attention (SPEC §1) as a layer mixer: one
// routing mixture per head, bidirectional or causal; decodes from a gma::State per head with
// the mixture prepared once.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/detail/mixers/mixer.hpp"
#include "mixattn/gma.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
class GmaMixer final : public Mixer<T> {
 public:
  static constexpr const char* name = "gma";
  static void check(const char* fn, const layer::Config& cfg) {
    require(cfg.components >= 1, fn, "config.components must be >= 1 for GMA, got ",
            cfg.components);
  }
  /// Head h's mixture: gma::Mixture::random(K, r, seed + 1 + h, gma_mean_scale).
  explicit GmaMixer(const layer::Config& cfg)
      : opt_(with_causality(cfg.gma, cfg.causal)),
        components_(cfg.components),
        value_dim_(cfg.value_dim) {
    for (Index h = 0; h < cfg.heads; ++h)
      mixtures_.push_back(gma::Mixture<T>::random(cfg.components, cfg.key_dim,
                                                  cfg.seed + 1 + static_cast<std::uint64_t>(h),
                                                  static_cast<T>(cfg.gma_mean_scale)));
  }
  std::unique_ptr<Mixer<T>> clone() const override { return std::make_unique<GmaMixer>(*this); }

  std::vector<gma::Mixture<T>>& mixtures() { return mixtures_; }
  const std::vector<gma::Mixture<T>>& mixtures() const { return mixtures_; }

  std::size_t head_blocks(Index h, HeadBlock<T>* out) const override {
    return blocks(mixtures_[static_cast<std::size_t>(h)], out);
  }
  void prepare_forward(OwnedRecords& saved, std::size_t items) const override {
    saved.make<Saved>().items.resize(items);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    gma::forward_into(out, mixture(it), it.q, it.k, it.v, opt_,
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
    gma::Grad<T>& g = grads.as<Grads>()->items[it.index];
    gma::backward_into(g, mixture(it), it.q, it.k, it.v, dout, saved.as<Saved>()->items[it.index],
                       opt_);
    return {&g.q, &g.k, &g.v};
  }
  std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                             HeadBlock<T>* out) const override {
    return blocks(grads.as<Grads>()->items[index].mixture, out);
  }

  bool decodes() const override { return true; }
  void begin_decoding(OwnedRecords& state, Index heads, Index) const override {
    Decoding& d = state.make<Decoding>();
    for (Index h = 0; h < heads; ++h) {
      d.prepared.emplace_back(mixtures_[static_cast<std::size_t>(h)]);
      d.states.push_back(gma::State<T>::empty(components_, value_dim_));
    }
  }
  std::size_t decoding_heads(const OwnedRecords& state) const override {
    return state.as<Decoding>() ? state.as<Decoding>()->states.size() : 0;
  }
  /// The mixtures the state prepared must still be the layer's (O(H K r), small next to the
  /// projections of one token).
  void check_decoding(const char* fn, const OwnedRecords& state) const override {
    const Decoding& d = *state.as<Decoding>();
    for (std::size_t i = 0; i < mixtures_.size(); ++i)
      if (i >= d.prepared.size() ||
          mixture_fingerprint(mixtures_[i]) != d.prepared[i].mixture_fingerprint())
        raise_invalid_argument(concat(fn, ": state came from other data: head ", i,
                                      "'s mixture changed since begin_decoding() prepared it; "
                                      "call begin_decoding() again"));
  }
  void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& it,
              OwnedRecords& state) const override {
    Decoding& d = *state.as<Decoding>();
    const std::size_t h = static_cast<std::size_t>(it.head);
    out = gma::forward(d.prepared[h], it.q, it.k, it.v, opt_, d.states[h]);
  }

 private:
  using Saved = ItemRecords<gma::Saved<T>>;
  using Grads = ItemRecords<gma::Grad<T>>;
  struct Decoding final : MixerRecords {
    std::vector<gma::Prepared<T>> prepared;
    std::vector<gma::State<T>> states;
    std::unique_ptr<MixerRecords> clone() const override {
      return std::make_unique<Decoding>(*this);
    }
  };

  /// A Mixture's or a MixtureGrad's three blocks.
  template <class M>
  static std::size_t blocks(const M& m, HeadBlock<T>* out) {
    out[0] = {"mean", m.mean.data(), m.mean.rows(), m.mean.cols()};
    out[1] = {"var_raw", m.var_raw.data(), m.var_raw.rows(), m.var_raw.cols()};
    out[2] = {"prior_logit", m.prior_logit.data(), m.prior_logit.size(), 1};
    return 3;
  }
  const gma::Mixture<T>& mixture(const MixerItem<T>& it) const {
    return mixtures_[static_cast<std::size_t>(it.head)];
  }

  gma::Options opt_;
  Index components_, value_dim_;
  std::vector<gma::Mixture<T>> mixtures_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
