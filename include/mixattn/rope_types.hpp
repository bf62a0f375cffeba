// mixattn/rope_types.hpp — the rotary position embedding's records (SPEC.md §8): its options. The
// operations are in mixattn/rope.hpp.
#pragma once

#include "mixattn/core.hpp"

MIXATTN_BEGIN_NAMESPACE
namespace rope {

struct Options {
  /// theta_i = base^(-2i/r): finite and > 0. 10000 as in RoFormer.
  double base = 10000;
  /// Reject NaN/Inf in x (or grad_out) with std::domain_error, and report a result that
  /// overflows T (inputs near T's largest value) rather than return it.
  bool check_finite = true;
};

}  // namespace rope
MIXATTN_END_NAMESPACE
