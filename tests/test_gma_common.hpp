// Shared by the GMA tests: a mixture away from the default initialisation.
#pragma once

#include <mixattn/gma.hpp>

#include "test_util.hpp"

#include <cstdint>

namespace mixattn::testing {

/// A mixture with non-trivial variances and priors (K components of dimension r).
template <class T>
gma::Mixture<T> test_mixture(Index K, Index r, std::uint64_t seed) {
  gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, seed);
  mix.var_raw = random_matrix<T>(K, r, seed + 1, 0.7);
  mix.prior_logit = random_matrix<T>(K, 1, seed + 2, 0.5);
  return mix;
}

}  // namespace mixattn::testing
