// mixattn/layer/mixers/gma.hpp — Gaussian Mixture Attention (SPEC §1) as a layer mixer: one
// routing mixture per head, bidirectional or causal; decodes from a gma::State per head with
// the mixture prepared once. Its part of the layer's Config, its accessors on the layer.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/layer/mixer.hpp"

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The GMA mixer's part of the layer's Config.
struct GmaConfig {
  Index components = 16;      ///< K, mixture components per head (GMA)
  double gma_mean_scale = 1;  ///< initial component means ~ N(0, 1)·gma_mean_scale (SPEC 1.1)
  gma::Options gma;           ///< eps, chunk, check_finite of every GMA head
};

}  // namespace layer

namespace detail {

template <class T>
struct GmaDecoding {  // one head's decoding: its mixture prepared once, its state
  gma::Prepared<T> prepared;
  gma::State<T> state;
};

template <class T>
class GmaMixer final : public ItemMixer<T, GmaMixer<T>, gma::Saved<T>, gma::Grad<T>> {
 public:
  static constexpr const char* name = "gma";
  static constexpr bool decoding = true;
  using Slice = layer::GmaConfig;
  static void check(const char* fn, const layer::CommonConfig&, const Slice& own) {
    require(own.components >= 1, fn, "config.components must be >= 1 for GMA, got ",
            own.components);
    require(std::isfinite(own.gma_mean_scale), fn, "config.gma_mean_scale must be finite, got ",
            own.gma_mean_scale);
  }
  /// Head h's mixture: gma::Mixture::random(K, r, seed + 1 + h, gma_mean_scale).
  GmaMixer(const layer::CommonConfig& cfg, const Slice& own)
      : opt_(with_causality(own.gma, cfg.causal)),
        components_(own.components),
        value_dim_(cfg.value_dim) {
    for (Index h = 0; h < cfg.heads; ++h)
      mixtures_.push_back(gma::Mixture<T>::random(own.components, cfg.key_dim,
                                                  cfg.seed + 1 + static_cast<std::uint64_t>(h),
                                                  static_cast<T>(own.gma_mean_scale)));
  }

  std::vector<gma::Mixture<T>>& mixtures() { return mixtures_; }
  const std::vector<gma::Mixture<T>>& mixtures() const { return mixtures_; }

  const char* kind_name() const override { return name; }
  std::size_t head_blocks(Index h, HeadBlock<T>* out) const override {
    return blocks(mixtures_[static_cast<std::size_t>(h)], out);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    gma::forward_into(out, mixture(it), it.q, it.k, it.v, opt_, this->saved_item(saved, it, keep));
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    gma::Grad<T>& g = this->grad_item(grads, it.index);
    gma::backward_into(g, mixture(it), it.q, it.k, it.v, dout, this->saved_item(saved, it), opt_);
    return {&g.q, &g.k, &g.v};
  }
  std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                             HeadBlock<T>* out) const override {
    return blocks(this->grad_item(grads, index).mixture, out);
  }

  bool decodes() const override { return decoding; }
  void begin_decoding(OwnedRecords& state, Index heads, Index) const override {
    Decoding& d = state.make<Decoding>();
    for (Index h = 0; h < heads; ++h)
      d.items.push_back({gma::Prepared<T>(mixtures_[static_cast<std::size_t>(h)]),
                         gma::State<T>::empty(components_, value_dim_)});
  }
  std::size_t decoding_heads(const OwnedRecords& state) const override {
    return this->template decoding_items<Decoding>(state);
  }
  /// The mixtures the state prepared must still be the layer's (O(H K r), small next to the
  /// projections of one token).
  void check_decoding(const char* fn, const OwnedRecords& state) const override {
    const Decoding& d = *state.as<Decoding>();
    for (std::size_t i = 0; i < mixtures_.size(); ++i)
      if (i >= d.items.size() ||
          mixture_fingerprint(mixtures_[i]) != d.items[i].prepared.mixture_fingerprint())
        raise_invalid_argument(concat(fn, ": state came from other data: head ", i,
                                      "'s mixture changed since begin_decoding() prepared it; "
                                      "call begin_decoding() again"));
  }
  void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& it,
              OwnedRecords& state) const override {
    GmaDecoding<T>& d = state.as<Decoding>()->items[static_cast<std::size_t>(it.head)];
    out = gma::forward(d.prepared, it.q, it.k, it.v, opt_, d.state);
  }

 private:
  using Decoding = ItemRecords<GmaDecoding<T>>;

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

/// What a layer offers for its GMA heads (MultiHeadAttention derives from it): each head's
/// mixture, and its responsibilities.
template <class Layer, class T>
class GmaAccessors {
 public:
  /// Head h's routing mixture (GMA layers only; std::out_of_range otherwise).
  gma::Mixture<T>& mixture(Index h) { return mixtures().at(static_cast<std::size_t>(h)); }
  const gma::Mixture<T>& mixture(Index h) const {
    return mixtures().at(static_cast<std::size_t>(h));
  }
  /// Head h's query responsibilities Γ_Q = γ(X W_Q,h) (N x K) — for diagnostics (GMA only).
  Matrix<T> query_responsibilities(const ConstMatrixArg<T>& x, Index h) const {
    return head_responsibilities("query_responsibilities", x, h, layer().w_q());
  }
  /// Head h's key responsibilities Γ_K = γ(X W_K,h) (N x K) — for diagnostics (GMA only).
  Matrix<T> key_responsibilities(const ConstMatrixArg<T>& x, Index h) const {
    return head_responsibilities("key_responsibilities", x, h, layer().w_k());
  }

 private:
  const Layer& layer() const { return static_cast<const Layer&>(*this); }
  std::vector<gma::Mixture<T>>& mixtures() const {
    static std::vector<gma::Mixture<T>> none;  // empty: at() throws std::out_of_range
    GmaMixer<T>* m = layer().template mixer_as<GmaMixer<T>>();
    return m ? m->mixtures() : none;
  }
  Matrix<T> head_responsibilities(const char* name, const ConstMatrixRef<T>& x, Index h,
                                  const Matrix<T>& w) const {
    const std::string fn = concat("mixattn::layer::MultiHeadAttention::", name);
    const Index heads = layer().config().heads, r = layer().config().key_dim;
    require(!mixtures().empty(), fn.c_str(), "responsibilities exist only for GMA layers");
    require(h >= 0 && h < heads, fn.c_str(), "head ", h, " is out of range [0, ", heads, ")");
    check_layer_input<T>(fn.c_str(), x, layer().config().model_dim, layer().config().check_finite);
    Matrix<T> proj(x.rows(), r);
    proj.noalias() = x * w.middleCols(h * r, r);
    return gma::responsibilities(mixtures()[static_cast<std::size_t>(h)], proj);
  }
};

}  // namespace detail
MIXATTN_END_NAMESPACE
