// mixattn/layer/table.hpp — the one list of the layer's mixers: its MixerKind, and the type (a file
// in layer/mixers/) that runs it, with its part of the Config and its accessors on the layer.
// Adding a mixer adds its file, its enumerator and its line here.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/layer/mixers/delta.hpp"
#include "mixattn/layer/mixers/gma.hpp"
#include "mixattn/layer/mixers/linear.hpp"
#include "mixattn/layer/mixers/ovq.hpp"
#include "mixattn/layer/mixers/performer.hpp"
#include "mixattn/layer/mixers/softmax.hpp"
#include "mixattn/layer/mixers/vq.hpp"

#include <array>
#include <memory>
#include <string>
#include <vector>

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
  delta,      ///< the gated delta rule (SPEC §9, Gated DeltaNet), always causal
};

}  // namespace layer

namespace detail {

/// The accessors of a mixer that adds none to the layer.
template <class Layer, class T>
class NoAccessors {};

/// A table line: the MixerKind, the mixer type that runs it and the accessors it adds to the
/// layer.
template <layer::MixerKind K, template <class> class M,
          template <class, class> class Accessors = NoAccessors>
struct MixerRow {
  static constexpr layer::MixerKind kind = K;
  template <class T>
  using type = M<T>;
  template <class Layer, class T>
  using accessors = Accessors<Layer, T>;
};
template <class... Row>
struct MixerRows {};

// The table.
using mixer_rows =
    MixerRows<MixerRow<layer::MixerKind::gma, GmaMixer, GmaAccessors>,
              MixerRow<layer::MixerKind::ovq, OvqMixer, OvqAccessors>,
              MixerRow<layer::MixerKind::softmax, SoftmaxMixer>,
              MixerRow<layer::MixerKind::linear, LinearMixer>,
              MixerRow<layer::MixerKind::performer, PerformerMixer, PerformerAccessors>,
              MixerRow<layer::MixerKind::vq, VqMixer, VqAccessors>,
              MixerRow<layer::MixerKind::delta, DeltaMixer, DeltaAccessors>>;

/// Every mixer's part of the Config, side by side (layer::Config derives from it).
template <class Rows>
struct MixerSlicesOf;
template <class... Row>
struct MixerSlicesOf<MixerRows<Row...>> : Row::template type<float>::Slice... {};
using MixerSlices = MixerSlicesOf<mixer_rows>;

/// One row's accessors, a base of its own type for each row (two rows that add none would
/// otherwise name NoAccessors twice as a direct base).
template <class Row, class Accessors>
struct RowAccessors : Accessors {};

/// Every mixer's accessors (layer::MultiHeadAttention derives from it).
template <class Layer, class T, class Rows>
struct MixerAccessorsOf;
template <class Layer, class T, class... Row>
struct MixerAccessorsOf<Layer, T, MixerRows<Row...>>
    : RowAccessors<Row, typename Row::template accessors<Layer, T>>... {};
template <class Layer, class T>
using MixerAccessors = MixerAccessorsOf<Layer, T, mixer_rows>;

template <class T>
struct MixerEntry {
  layer::MixerKind kind;
  const char* name;
  /// The mixer's own part of the Config (before anything is made), naming the field.
  void (*check)(const char* fn, const layer::CommonConfig& cfg, const MixerSlices& slices);
  std::unique_ptr<Mixer<T>> (*make)(const layer::CommonConfig& cfg, const MixerSlices& slices);
};

template <template <class> class M, class T>
MixerEntry<T> mixer_entry(layer::MixerKind kind) {
  using Slice = typename M<T>::Slice;
  return {
      kind, M<T>::name,
      [](const char* fn, const layer::CommonConfig& cfg, const MixerSlices& slices) {
        M<T>::check(fn, cfg, static_cast<const Slice&>(slices));
      },
      [](const layer::CommonConfig& cfg, const MixerSlices& slices) -> std::unique_ptr<Mixer<T>> {
        return std::make_unique<M<T>>(cfg, static_cast<const Slice&>(slices));
      }};
}

template <class T, class... Row>
std::array<MixerEntry<T>, sizeof...(Row)> mixer_entries(MixerRows<Row...>) {
  return {{mixer_entry<Row::template type, T>(Row::kind)...}};
}
template <class T>
inline const auto mixer_table = mixer_entries<T>(mixer_rows{});

/// A mixer's kind, name and whether it decodes, read from its type's declaration alone: a name
/// looked up from non-template code must not instantiate the mixers' members (every file that
/// includes the layer would compile them all).
struct MixerName {
  layer::MixerKind kind;
  const char* name;
  bool decoding;
};
template <class... Row>
constexpr std::array<MixerName, sizeof...(Row)> mixer_name_entries(MixerRows<Row...>) {
  return {{MixerName{Row::kind, Row::template type<float>::name,
                     Row::template type<float>::decoding}...}};
}
inline constexpr auto mixer_names = mixer_name_entries(mixer_rows{});

/// The table's entry for `kind`; nullptr for a value outside the enumeration.
template <class T>
const MixerEntry<T>* find_mixer(layer::MixerKind kind) {
  for (const MixerEntry<T>& e : mixer_table<T>)
    if (e.kind == kind) return &e;
  return nullptr;
}

/// The names of the mixers that decode, for messages: "gma, ovq, softmax and delta".
inline std::string decoding_mixers() {
  std::vector<const char*> names;
  for (const MixerName& e : mixer_names)
    if (e.decoding) names.push_back(e.name);
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " and " : ", ";
    out += names[i];
  }
  return out;
}

}  // namespace detail

namespace layer {

/// The mixer's name as written in MixerKind ("gma", "ovq", "softmax", "linear", "performer",
/// "vq", "delta"), for messages.
inline const char* mixer_name(MixerKind kind) {
  for (const ::mixattn::detail::MixerName& e : ::mixattn::detail::mixer_names)
    if (e.kind == kind) return e.name;
  return "unknown";
}

}  // namespace layer
MIXATTN_END_NAMESPACE
