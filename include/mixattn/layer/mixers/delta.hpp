// mixattn/layer/mixers/delta.hpp — the gated delta rule (SPEC §9, Gated DeltaNet) as a layer
// mixer: causal only; decodes from a delta::State per head. Its part of the layer's Config, its
// accessor on the layer.
//
// The gates. Gated DeltaNet computes each token's write strength β_t and log decay g_t from the
// layer input. A mixer sees only its head's rows of q, k and v (MixerItem), so each head learns
// its gates from its keys, themselves a projection of the input (k_t = x_t W_K,h), with five
// parameters of its own, the paper's forms on k_t instead of x_t:
//   β_t = sigmoid(k_t · w_β + b_β),   g_t = −exp(A_log) · softplus(k_t · w_a + b_a).
// The keys rather than the values because β_t is how strongly key k_t is written and e^(g_t)
// how much of the memory is kept before it is: both are about the key being written; and
// rather than giving every mixer the layer's input, which would widen the one interface for a
// single mixer. Cost: a gate reads r of the input's d_model directions. With Config::rope the
// mixer sees the rotated keys, so the gates then depend on the position too (Gated DeltaNet
// itself uses no rotary embedding). g_t <= 0 and β_t in [0, 1] for any parameters (the bounds
// reached only by rounding), as delta::forward requires.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/delta.hpp"
#include "mixattn/layer/mixer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The gated-delta-rule mixer's part of the layer's Config.
struct DeltaConfig {
  /// chunk (>= 1; 64), scale (0: 1/sqrt(r)), normalize (q and k L2-normalised inside, Gated
  /// DeltaNet's use_qk_l2norm; true), norm_eps, keep_states, check_finite of every head. The
  /// layer requires Config::causal.
  delta::Options delta;
};

/// One head's gate parameters (the blocks "head<h>.w_beta" (r x 1), "head<h>.b_beta",
/// "head<h>.w_a" (r x 1), "head<h>.b_a", "head<h>.A_log" (1 x 1 each)); initialised from an
/// mt19937_64 seeded with seed + 1 + h as Gated DeltaNet's: w_β, w_a ~ N(0, 1/r) (the keys of
/// unit-variance x are ~ N(0, 1) entrywise, so k · w starts ~ N(0, 1)), b_β = 0, A_log = log A
/// with A ~ U(1, 16), b_a = softplus^-1(dt) with dt log-uniform in [1e-3, 0.1].
template <class T>
struct DeltaGates {
  Vector<T> w_beta, w_a;
  T b_beta = 0, b_a = 0, A_log = 0;
};

}  // namespace layer

namespace detail {

template <class T>
struct DeltaItem {  // one item's gates (kept for backward) and the operator's record
  Vector<T> g, beta;
  Vector<T> sig_a;  // sigmoid(k w_a + b_a): softplus' derivative
  delta::Saved<T> saved;
};

template <class T>
struct DeltaGradItem {  // one item's gradients: the operator's, dk with the gates', the gates'
  delta::Grad<T> grad;
  Matrix<T> k;
  Vector<T> dz_beta, dz_a;  // of the gates' pre-activations
  layer::DeltaGates<T> gates;
};

template <class T>
struct DeltaDecoding {  // one head's decoding: its state and the gates of the new tokens
  delta::State<T> state;
  Vector<T> g, beta, sig_a;
};

/// σ(z) without overflow for either sign of z.
template <class T>
T delta_sigmoid(T z) {
  if (z >= 0) return T(1) / (T(1) + std::exp(-z));
  const T e = std::exp(z);
  return e / (T(1) + e);
}

/// The gates of keys k (n x r): beta, g and sigmoid(k w_a + b_a), each n (resized).
template <class T>
void delta_gates_forward(const layer::DeltaGates<T>& p, const ConstMatrixRef<T>& k, Vector<T>& g,
                         Vector<T>& beta, Vector<T>& sig_a) {
  const Index n = k.rows();
  beta.resize(n);
  g.resize(n);
  sig_a.resize(n);
  beta.noalias() = k * p.w_beta;
  g.noalias() = k * p.w_a;
  const T decay = std::exp(p.A_log);
  for (Index t = 0; t < n; ++t) {
    beta(t) = delta_sigmoid(beta(t) + p.b_beta);
    const T z = g(t) + p.b_a;
    sig_a(t) = delta_sigmoid(z);
    const T softplus = std::max(z, T(0)) + std::log1p(std::exp(-std::abs(z)));
    g(t) = -decay * softplus;
  }
}

/// The gates' backward: from the operator's dg and dbeta (in gi.grad), gi.k = dk (the
/// operator's plus the gates') and the gradients of the head's gate parameters.
///   dz_β = dβ β (1 − β),  dz_a = −e^(A_log) σ(z_a) dg,  dA_log = Σ dg g,
///   dk = dk_op + dz_β w_βᵀ + dz_a w_aᵀ,  dw = kᵀ dz,  db = Σ dz.
template <class T>
void delta_gates_backward(const layer::DeltaGates<T>& p, const ConstMatrixRef<T>& k,
                          const DeltaItem<T>& item, DeltaGradItem<T>& gi) {
  const Vector<T>& dg = gi.grad.g;
  const Vector<T>& dbeta = gi.grad.beta;
  const T decay = std::exp(p.A_log);
  gi.dz_beta = dbeta.cwiseProduct(item.beta).cwiseProduct((T(1) - item.beta.array()).matrix());
  gi.dz_a = (-decay) * dg.cwiseProduct(item.sig_a);
  gi.k = gi.grad.k;
  gi.k.noalias() += gi.dz_beta * p.w_beta.transpose();
  gi.k.noalias() += gi.dz_a * p.w_a.transpose();
  gi.gates.w_beta.noalias() = k.transpose() * gi.dz_beta;
  gi.gates.w_a.noalias() = k.transpose() * gi.dz_a;
  gi.gates.b_beta = gi.dz_beta.sum();
  gi.gates.b_a = gi.dz_a.sum();
  gi.gates.A_log = dg.dot(item.g);
}

template <class T>
class DeltaMixer final : public ItemMixer<T, DeltaMixer<T>, DeltaItem<T>, DeltaGradItem<T>> {
 public:
  static constexpr const char* name = "delta";
  static constexpr bool decoding = true;
  using Slice = layer::DeltaConfig;
  static void check(const char* fn, const layer::CommonConfig& cfg, const Slice& own) {
    require(cfg.causal, fn, "the gated delta rule is causal: set config.causal = true");
    require(own.delta.chunk >= 1, fn, "config.delta.chunk must be >= 1, got ", own.delta.chunk);
    check_mixer_scale(fn, "delta", own.delta.scale, std::is_same<T, float>::value);
    require(own.delta.norm_eps > 0 && std::isfinite(own.delta.norm_eps), fn,
            "config.delta.norm_eps must be > 0 and finite, got ", own.delta.norm_eps);
  }
  DeltaMixer(const layer::CommonConfig& cfg, const Slice& own)
      : opt_(own.delta), key_dim_(cfg.key_dim), value_dim_(cfg.value_dim) {
    for (Index h = 0; h < cfg.heads; ++h)
      gates_.push_back(initial_gates(cfg.key_dim, cfg.seed + 1 + static_cast<std::uint64_t>(h)));
  }

  std::vector<layer::DeltaGates<T>>& gates() { return gates_; }
  const std::vector<layer::DeltaGates<T>>& gates() const { return gates_; }

  const char* kind_name() const override { return name; }
  std::size_t head_blocks(Index h, HeadBlock<T>* out) const override {
    return blocks(gates_[static_cast<std::size_t>(h)], out);
  }
  void forward(Matrix<T>& out, const MixerItem<T>& it, OwnedRecords& saved,
               bool keep) const override {
    DeltaItem<T>& item = *this->saved_item(saved, it, true);  // the gates, kept or not
    delta_gates_forward(head(it), it.k, item.g, item.beta, item.sig_a);
    delta::forward_into<T>(out, it.q, it.k, it.v, item.g, item.beta, opt_, nullptr,
                           keep ? &item.saved : nullptr);
  }
  InputGrads<T> backward(const MixerItem<T>& it, const ConstMatrixRef<T>& dout,
                         const OwnedRecords& saved, OwnedRecords& grads) const override {
    const DeltaItem<T>& item = this->saved_item(saved, it);
    DeltaGradItem<T>& gi = this->grad_item(grads, it.index);
    delta::backward_into<T>(gi.grad, it.q, it.k, it.v, item.g, item.beta, dout, item.saved, opt_);
    delta_gates_backward(head(it), it.k, item, gi);
    return {&gi.grad.q, &gi.k, &gi.grad.v};
  }
  std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                             HeadBlock<T>* out) const override {
    return blocks(this->grad_item(grads, index).gates, out);
  }

  bool decodes() const override { return decoding; }
  void begin_decoding(OwnedRecords& state, Index heads, Index) const override {
    Decoding& d = state.make<Decoding>();
    for (Index h = 0; h < heads; ++h)
      d.items.push_back({delta::State<T>::empty(key_dim_, value_dim_), {}, {}, {}});
  }
  std::size_t decoding_heads(const OwnedRecords& state) const override {
    return this->template decoding_items<Decoding>(state);
  }
  /// The gates are computed from the parameters as they are now, token by token, and the state
  /// is S alone: nothing goes stale when the parameters change between calls.
  void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& it,
              OwnedRecords& state) const override {
    DeltaDecoding<T>& d = state.as<Decoding>()->items[static_cast<std::size_t>(it.head)];
    delta_gates_forward(head(it), it.k, d.g, d.beta, d.sig_a);
    out = delta::forward<T>(it.q, it.k, it.v, d.g, d.beta, opt_, &d.state);
  }

 private:
  using Decoding = ItemRecords<DeltaDecoding<T>>;

  static layer::DeltaGates<T> initial_gates(Index r, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    layer::DeltaGates<T> p;
    p.w_beta = gaussian_matrix<T>(r, 1, 1 / std::sqrt(static_cast<double>(r)), rng);
    p.w_a = gaussian_matrix<T>(r, 1, 1 / std::sqrt(static_cast<double>(r)), rng);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    p.A_log = static_cast<T>(std::log(1 + 15 * unit(rng)));
    const double lo = std::log(1e-3), hi = std::log(0.1);
    const double dt = std::exp(lo + (hi - lo) * unit(rng));
    p.b_a = static_cast<T>(dt + std::log(-std::expm1(-dt)));  // softplus^-1(dt)
    return p;
  }
  /// A DeltaGates' five blocks (the parameters, or their gradients).
  static std::size_t blocks(const layer::DeltaGates<T>& p, HeadBlock<T>* out) {
    out[0] = {"w_beta", p.w_beta.data(), p.w_beta.size(), 1};
    out[1] = {"b_beta", &p.b_beta, 1, 1};
    out[2] = {"w_a", p.w_a.data(), p.w_a.size(), 1};
    out[3] = {"b_a", &p.b_a, 1, 1};
    out[4] = {"A_log", &p.A_log, 1, 1};
    return 5;
  }
  const layer::DeltaGates<T>& head(const MixerItem<T>& it) const {
    return gates_[static_cast<std::size_t>(it.head)];
  }

  delta::Options opt_;
  Index key_dim_, value_dim_;
  std::vector<layer::DeltaGates<T>> gates_;  // one per head
};

/// What a layer offers for its gated-delta-rule heads (MultiHeadAttention derives from it):
/// each head's gate parameters.
template <class Layer, class T>
class DeltaAccessors {
 public:
  /// Head h's gate parameters (delta layers only), aliasing the parameter blocks.
  layer::DeltaGates<T>& delta_gates(Index h) { return head(h); }
  const layer::DeltaGates<T>& delta_gates(Index h) const { return head(h); }

 private:
  layer::DeltaGates<T>& head(Index h) const {
    return mixer_head<DeltaMixer<T>>(static_cast<const Layer&>(*this), h,
                                     "mixattn::layer::MultiHeadAttention::delta_gates")
        .gates()[static_cast<std::size_t>(h)];
  }
};

}  // namespace detail
MIXATTN_END_NAMESPACE
