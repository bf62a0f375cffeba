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

template <class T>
inline const MixerEntry<T> mixer_table[] = {
    mixer_entry<GmaMixer, T>(layer::MixerKind::gma),
    mixer_entry<OvqMixer, T>(layer::MixerKind::ovq),
    mixer_entry<SoftmaxMixer, T>(layer::MixerKind::softmax),
    mixer_entry<LinearMixer, T>(layer::MixerKind::linear),
    mixer_entry<PerformerMixer, T>(layer::MixerKind::performer),
    mixer_entry<VqMixer, T>(layer::MixerKind::vq),
};

/// The table's entry for `kind`; nullptr for a value outside the enumeration.
template <class T>
const MixerEntry<T>* find_mixer(layer::MixerKind kind) {
  for (const MixerEntry<T>& e : mixer_table<T>)
    if (e.kind == kind) return &e;
  return nullptr;
}

}  // namespace detail
MIXATTN_END_NAMESPACE
