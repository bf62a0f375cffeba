// mixattn/window_types.hpp — the sliding window's records (SPEC.md §7): its options; what its
// forward keeps for its backward, and the gradients, are the tiled reference's own records
// (mixattn/reference_types.hpp). The operations are in mixattn/window.hpp.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/reference_types.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace window {

/// Options of a sliding-window call.
struct Options {
  Index window = 256;        ///< w >= 1: keys i - w < j <= i; w >= N is causal softmax attention
  double scale = 0;          ///< logit scale; 0: 1/sqrt(r)
  bool check_finite = true;  ///< reject NaN/Inf inputs and report overflowed results
};

/// What forward keeps for backward (the output and N log-sum-exps), and the gradients: the
/// tiled reference's own records.
template <class T>
using Saved = reference::Saved<T>;
template <class T>
using Grad = reference::Grad<T>;

}  // namespace window
MIXATTN_END_NAMESPACE
