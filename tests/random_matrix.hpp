// tests/random_matrix.hpp — seeded Gaussian matrices, shared by the tests (test_util.hpp) and the
// benchmarks (bench/bench_common.hpp), so both draw the same inputs from the same seeds.
#pragma once

#include <mixattn/core.hpp>

#include <cstdint>
#include <random>

namespace mixattn::testing {

/// rows x cols with i.i.d. N(0, scale^2) entries from a seeded generator (reproducible runs).
template <class T>
Matrix<T> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<T>(dist(rng));
  return m;
}

}  // namespace mixattn::testing
