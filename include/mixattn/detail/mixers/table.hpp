// mixattn/detail/mixers/table.hpp — the one list of the layer's mixers: its MixerKind, and the
// type (a file beside this one) that runs it. Adding a mixer adds its file and one line here
// (and its enumerator in layer_config.hpp's MixerKind).
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/detail/mixers/gma.hpp"
#include "mixattn/detail/mixers/linear.hpp"
#include "mixattn/detail/mixers/mixer.hpp"
#include "mixattn/detail/mixers/ovq.hpp"
#include "mixattn/detail/mixers/performer.hpp"
#include "mixattn/detail/mixers/softmax.hpp"
#include "mixattn/detail/mixers/vq.hpp"

#include <array>
#include <memory>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
struct MixerEntry {
  layer::MixerKind kind;
  const char* name;
  void (*check)(const char* fn, const layer::Config& cfg);  ///< the mixer's own Config fields
  std::unique_ptr<Mixer<T>> (*make)(const layer::Config& cfg);
};

template <template <class> class M, class T>
MixerEntry<T> mixer_entry(layer::MixerKind kind) {
  return {kind, M<T>::name, &M<T>::check,
          [](const layer::Config& cfg) -> std::unique_ptr<Mixer<T>> {
            return std::make_unique<M<T>>(cfg);
          }};
}

/// A table line: the MixerKind and the mixer type that runs it.
template <layer::MixerKind K, template <class> class M>
struct MixerRow {
  static constexpr layer::MixerKind kind = K;
  template <class T>
  using type = M<T>;
};
template <class... Row>
struct MixerRows {};

// The table.
using mixer_rows =
    MixerRows<MixerRow<layer::MixerKind::gma, GmaMixer>, MixerRow<layer::MixerKind::ovq, OvqMixer>,
              MixerRow<layer::MixerKind::softmax, SoftmaxMixer>,
              MixerRow<layer::MixerKind::linear, LinearMixer>,
              MixerRow<layer::MixerKind::performer, PerformerMixer>,
              MixerRow<layer::MixerKind::vq, VqMixer>>;

template <class T, class... Row>
std::array<MixerEntry<T>, sizeof...(Row)> mixer_entries(MixerRows<Row...>) {
  return {{mixer_entry<Row::template type, T>(Row::kind)...}};
}
template <class T>
inline const auto mixer_table = mixer_entries<T>(mixer_rows{});

/// A mixer's kind and name, read from its type's declaration alone: a name looked up from
/// non-template code must not instantiate the mixers' members (every file that includes the
/// layer would compile them all).
struct MixerName {
  layer::MixerKind kind;
  const char* name;
};
template <class... Row>
constexpr std::array<MixerName, sizeof...(Row)> mixer_name_entries(MixerRows<Row...>) {
  return {{MixerName{Row::kind, Row::template type<float>::name}...}};
}
inline constexpr auto mixer_names = mixer_name_entries(mixer_rows{});

/// The table's entry for `kind`; nullptr for a value outside the enumeration.
template <class T>
const MixerEntry<T>* find_mixer(layer::MixerKind kind) {
  for (const MixerEntry<T>& e : mixer_table<T>)
    if (e.kind == kind) return &e;
  return nullptr;
}

/// A new mixer for `cfg` (its kind checked by check_layer_config). Out of the layer's class body
/// and in the instance list (layer.hpp), so that a file constructing a layer does not compile
/// every mixer's members.
template <class T>
std::unique_ptr<Mixer<T>> make_mixer(const layer::Config& cfg) {
  return find_mixer<T>(cfg.mixer)->make(cfg);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
