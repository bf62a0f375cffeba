// mixattn/layer/mixer.hpp — the one interface through which layer::MultiHeadAttention runs its
// heads' sequence mixer (one file per mixer in layer/mixers/, listed in layer/table.hpp), and the
// base that keeps every mixer's per-item records.
//
// A mixer owns its per-head parameters and constants and its slice of the layer's Config, lists
// its parameters as HeadBlocks, and runs one (sequence, head) item at a time, forward and
// backward, into records it keeps in the layer's Cache, Gradients and DecodeState (MixerRecords,
// made and recognised by the mixer itself). Calls are virtual once per item (a whole sequence's
// work), never inside a kernel.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/common/checks.hpp"
#include "mixattn/rope_types.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// The shape and behaviour of a MultiHeadAttention layer that every mixer shares: the part of its
/// Config (layer/config.hpp) that is no mixer's own.
struct CommonConfig {
  Index model_dim = 0;  ///< d_model: columns of X and Y
  Index heads = 1;      ///< H
  Index key_dim = 0;    ///< r: routing/key dimension per head
  Index value_dim = 0;  ///< d_v: value dimension per head
  /// Token i sees only j <= i. Decides for every mixer (the `causal` fields of the mixers'
  /// options are overridden by it); OVQ is causal by construction and requires true.
  bool causal = false;
  int threads = 1;           ///< threads over heads (0: all cores)
  std::uint64_t seed = 0;    ///< initialisation seed (weights and every mixer's per-head values)
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

namespace detail {

/// One per-head parameter of a mixer, or its gradient: "head<h>.<suffix>", rows x cols,
/// row-major at data.
template <class T>
struct HeadBlock {
  const char* suffix = "";
  const T* data = nullptr;
  Index rows = 0, cols = 0;
};
/// The most blocks one head of any mixer has (the gated delta rule's gates: w_beta, b_beta, w_a,
/// b_a, A_log).
inline constexpr std::size_t max_head_blocks = 5;

/// Records a mixer keeps per item or per head between calls; each mixer derives its own.
struct MixerRecords {
  virtual ~MixerRecords() = default;
  virtual std::unique_ptr<MixerRecords> clone() const = 0;
};

/// An owned polymorphic B (a Mixer or MixerRecords) that copies by cloning, so the layer and
/// its Cache, Gradients and DecodeState stay copyable values.
template <class B>
class Cloned {
 public:
  Cloned() = default;
  explicit Cloned(std::unique_ptr<B> p) : p_(std::move(p)) {}
  Cloned(const Cloned& o) : p_(o.p_ ? o.p_->clone() : nullptr) {}
  Cloned(Cloned&&) noexcept = default;
  Cloned& operator=(const Cloned& o) {
    if (this != &o) p_ = o.p_ ? o.p_->clone() : nullptr;
    return *this;
  }
  Cloned& operator=(Cloned&&) noexcept = default;
  B* operator->() const { return p_.get(); }

  /// The object as R, or nullptr when it is another type (or there is none).
  template <class R>
  R* as() const {
    return dynamic_cast<R*>(p_.get());
  }
  /// The object as R, made (default-constructed) first when it is another type.
  template <class R>
  R& make() {
    if (!as<R>()) p_ = std::make_unique<R>();
    return *static_cast<R*>(p_.get());
  }

 private:
  std::unique_ptr<B> p_;
};
using OwnedRecords = Cloned<MixerRecords>;

/// Per-item records in one vector, the shape most mixers need.
template <class Item>
struct ItemRecords final : MixerRecords {
  std::vector<Item> items;
  std::unique_ptr<MixerRecords> clone() const override {
    return std::make_unique<ItemRecords>(*this);
  }
};

/// One (sequence, head) item: head h's columns of rows [t0, t0 + n) of Q, K, V.
template <class T>
struct MixerItem {
  std::size_t index;  ///< b H + h: the item's records
  Index head;
  ConstMatrixRef<T> q, k, v;
};

/// The gradients of one item's q, k and v, which the layer copies into dQ, dK, dV.
template <class T>
struct InputGrads {
  const Matrix<T>* q = nullptr;
  const Matrix<T>* k = nullptr;
  const Matrix<T>* v = nullptr;
};

template <class T>
class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual std::unique_ptr<Mixer> clone() const = 0;

  /// Head h's parameters in parameters() order (at most max_head_blocks); returns how many.
  virtual std::size_t head_blocks(Index h, HeadBlock<T>* out) const = 0;

  /// Sizes the forward's records for `items` items (reused when they are this mixer's).
  virtual void prepare_forward(OwnedRecords& saved, std::size_t items) const = 0;
  /// out (resized to n x d_v) = the mixer on one item; fills its saved record when keep.
  virtual void forward(Matrix<T>& out, const MixerItem<T>& item, OwnedRecords& saved,
                       bool keep) const = 0;
  /// How many items' saved records `saved` holds for this mixer (0: another mixer's).
  virtual std::size_t saved_items(const OwnedRecords& saved) const = 0;

  virtual void prepare_backward(OwnedRecords& grads, std::size_t items) const = 0;
  /// One item's backward from its saved record; dout: n x d_v.
  virtual InputGrads<T> backward(const MixerItem<T>& item, const ConstMatrixRef<T>& dout,
                                 const OwnedRecords& saved, OwnedRecords& grads) const = 0;
  /// The item's gradients of its head's parameters, in head_blocks() order; returns how many.
  virtual std::size_t item_gradients(const OwnedRecords& grads, std::size_t index,
                                     HeadBlock<T>* out) const {
    (void)grads, (void)index, (void)out;
    return 0;
  }

  /// The mixer's name as written in MixerKind, for messages.
  virtual const char* kind_name() const = 0;

  /// Whether the mixer keeps a streaming state (begin_decoding / decode).
  virtual bool decodes() const { return false; }
  /// Fresh per-head decoding states for `heads` heads.
  virtual void begin_decoding(OwnedRecords& state, Index heads, Index reserve) const {
    (void)state, (void)heads, (void)reserve;
  }
  /// How many heads' decoding states of this mixer `state` holds (0: none, or another's).
  virtual std::size_t decoding_heads(const OwnedRecords& state) const {
    (void)state;
    return 0;
  }
  /// Throws std::invalid_argument naming fn when `state` (this mixer's) has gone stale.
  virtual void check_decoding(const char* fn, const OwnedRecords& state) const {
    (void)fn, (void)state;
  }
  /// Head h's rows for the next tokens, advancing its state. out: n x d_v.
  virtual void decode(Eigen::Ref<Matrix<T>> out, const MixerItem<T>& item,
                      OwnedRecords& state) const {
    (void)out, (void)item, (void)state;
  }
};

/// The bookkeeping every mixer shares, with one record of its operator per (sequence, head) item
/// in the layer's Cache (SavedItem) and Gradients (GradItem): making, counting and finding them,
/// and the copy. Derived is the mixer.
template <class T, class Derived, class SavedItem, class GradItem>
class ItemMixer : public Mixer<T> {
 public:
  std::unique_ptr<Mixer<T>> clone() const override {
    return std::make_unique<Derived>(static_cast<const Derived&>(*this));
  }
  void prepare_forward(OwnedRecords& saved, std::size_t items) const override {
    saved.make<Saved>().items.resize(items);
  }
  std::size_t saved_items(const OwnedRecords& saved) const override {
    return saved.as<Saved>() ? saved.as<Saved>()->items.size() : 0;
  }
  void prepare_backward(OwnedRecords& grads, std::size_t items) const override {
    grads.make<Grads>().items.resize(items);
  }

 protected:
  using Saved = ItemRecords<SavedItem>;
  using Grads = ItemRecords<GradItem>;
  /// The item's saved record, or nullptr when the forward keeps none.
  static SavedItem* saved_item(OwnedRecords& saved, const MixerItem<T>& it, bool keep) {
    return keep ? &saved.as<Saved>()->items[it.index] : nullptr;
  }
  static const SavedItem& saved_item(const OwnedRecords& saved, const MixerItem<T>& it) {
    return saved.as<Saved>()->items[it.index];
  }
  static GradItem& grad_item(const OwnedRecords& grads, std::size_t index) {
    return grads.as<Grads>()->items[index];
  }
  /// How many heads' decoding states of type Decoding `state` holds (0: none, or another's).
  template <class Decoding>
  static std::size_t decoding_items(const OwnedRecords& state) {
    return state.as<Decoding>() ? state.as<Decoding>()->items.size() : 0;
  }
};

/// A mixer's options with the layer's causality (Config::causal decides for every mixer).
template <class O>
O with_causality(O o, bool causal) {
  o.causal = causal;
  return o;
}

/// Checks of a mixer's own Config fields, naming the field (before any call).
inline void check_mixer_eps(const char* fn, const char* field, double eps, bool is_float) {
  const bool in_type =
      is_float ? std::isfinite(static_cast<float>(eps)) && static_cast<float>(eps) > 0 : true;
  require(eps > 0 && std::isfinite(eps) && in_type, fn, "config.", field,
          ".eps must be > 0 and finite in the scalar type, got ", eps);
}
inline void check_mixer_scale(const char* fn, const char* field, double scale, bool is_float) {
  const bool in_type = !is_float || std::isfinite(static_cast<float>(scale));
  require(scale >= 0 && std::isfinite(scale) && in_type, fn, "config.", field,
          ".scale must be >= 0 and finite (0: the default), got ", scale);
}
inline void check_mixer_chunk(const char* fn, const char* field, Index chunk) {
  require(chunk >= 0, fn, "config.", field, ".chunk must be >= 0 (0: the default), got ", chunk);
}

/// The layer's input: N x model_dim with N >= 1, and finite with check_finite.
template <class T>
void check_layer_input(const char* fn, const ConstMatrixRef<T>& x, Index model_dim,
                       bool check_finite) {
  require(x.rows() >= 1 && x.cols() == model_dim, fn, "x is ", shape_str(x),
          " but the layer needs N x ", model_dim, " with N >= 1");
  if (check_finite) require_finite(x, fn, "x");
}

/// The layer's mixer as M, for head h of the accessors of M's per-head state; otherwise
/// std::invalid_argument naming fn, the mixer the layer has and its heads.
template <class M, class Layer>
M& mixer_head(const Layer& layer, Index h, const char* fn) {
  M* m = layer.template mixer_as<M>();
  const Index heads = layer.config().heads;
  require(m && h >= 0 && h < heads, fn, "exists for heads 0..H-1 of a ", M::name,
          " layer; asked for head ", h, " of a ", layer.mixer().kind_name(), " layer of ", heads,
          " heads");
  return *m;
}

/// N(0, stddev²) entries from rng, drawn in row-major order.
template <class T, class Rng>
Matrix<T> gaussian_matrix(Index rows, Index cols, double stddev, Rng& rng) {
  std::normal_distribution<double> dist(0.0, stddev);
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(dist(rng));
  return m;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
