// mixattn/detail/mixers/mixer.hpp — the one interface through which layer::MultiHeadAttention
// runs its heads' sequence mixer (one file per mixer beside this one, listed in table.hpp).
//
// A mixer owns its per-head parameters and constants, lists them as HeadBlocks, and runs one
// (sequence, head) item at a time, forward and backward, into records it keeps in the layer's
// Cache, Gradients and DecodeState (MixerRecords, made and recognised by the mixer itself).
// Calls are virtual once per item (a whole sequence's work), never inside a kernel.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"
#include "mixattn/layer_config.hpp"

#include <cmath>
#include <cstddef>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// One per-head parameter of a mixer, or its gradient: "head<h>.<suffix>", rows x cols,
/// row-major at data.
template <class T>
struct HeadBlock {
  const char* suffix = "";
  const T* data = nullptr;
  Index rows = 0, cols = 0;
};
/// The most blocks one head of any mixer has (GMA: mean, var_raw, prior_logit).
inline constexpr std::size_t max_head_blocks = 3;

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
