// Checks of layer::MultiHeadAttention that several test files run on their own configurations:
// a packed batch against the layer on each sequence alone, and decoding in pieces against one
// forward. Double precision; the tolerances are justified where the checks are defined.
#pragma once

#include <mixattn/layer.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace mixattn::testing {

/// forward_packed_into + backward_into over x (sequences at `offsets`, gradient dy) into y,
/// cache and g, against forward + backward of the layer on each sequence alone: outputs and
/// input gradients row for row (1e-12 relative: only the projections' and W_O's GEMM blocking,
/// which depends on the row count, differs), parameter gradients as the per-sequence sum
/// (1e-11: the sums over sequences are taken in another order). per_sequence(b, t0, n, cb, gb)
/// adds a caller's checks of sequence b (rows [t0, t0 + n)) against its own cache cb and
/// gradients gb.
template <class PerSequence>
void expect_packed_equals_separate(const layer::MultiHeadAttention<double>& mha,
                                   const Matrix<double>& x, const Matrix<double>& dy,
                                   const Offsets& offsets, const std::string& label,
                                   Matrix<double>& y, layer::Cache<double>& cache,
                                   layer::Gradients<double>& g, PerSequence&& per_sequence) {
  mha.forward_packed_into(y, x, offsets, cache);
  mha.backward_into(g, x, dy, cache);
  std::vector<Matrix<double>> sum;
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    const Index t0 = offsets[b], n = offsets[b + 1] - t0;
    layer::Cache<double> cb;
    const Matrix<double> yb = mha.forward(x.middleRows(t0, n), &cb);
    const layer::Gradients<double> gb = mha.backward(x.middleRows(t0, n), dy.middleRows(t0, n), cb);
    EXPECT_TRUE(all_close(Matrix<double>(y.middleRows(t0, n)), yb, 1e-12, 1e-12))
        << label << " sequence " << b;
    EXPECT_TRUE(all_close(Matrix<double>(g.x.middleRows(t0, n)), gb.x, 1e-12, 1e-12))
        << label << " sequence " << b;
    per_sequence(b, t0, n, cb, gb);
    if (b == 0) {
      sum = gb.params;
    } else {
      for (std::size_t p = 0; p < sum.size(); ++p) sum[p] += gb.params[p];
    }
  }
  ASSERT_EQ(g.params.size(), sum.size()) << label;
  for (std::size_t p = 0; p < sum.size(); ++p)
    EXPECT_TRUE(all_close(g.params[p], sum[p], 1e-11, 1e-12)) << label << " " << g.names[p];
}

/// Decoding x token by token, and in the uneven pieces 7, 1, 9, 3 (x has 20 rows), gives the
/// rows of one forward over the whole sequence. The pieces reorder sums of <= 20 O(1) terms and
/// decode's projections are Eigen's products rather than the layer's GEMM tasks (a few ulps):
/// 1e-12 relative leaves a margin of ~100.
inline void expect_decoding_matches_forward(const layer::MultiHeadAttention<double>& mha,
                                            const Matrix<double>& x, const std::string& label) {
  const Index n = x.rows();
  ASSERT_EQ(n, 20) << label;
  const Matrix<double> whole = mha.forward(x);
  const std::vector<std::vector<Index>> splits = {std::vector<Index>(n, 1), {7, 1, 9, 3}};
  for (const auto& sizes : splits) {
    layer::DecodeState<double> st = mha.begin_decoding();
    Matrix<double> out(n, x.cols());
    Index at = 0;
    for (const Index p : sizes) {
      out.middleRows(at, p) = mha.decode(x.middleRows(at, p), st);
      at += p;
    }
    EXPECT_EQ(st.tokens_seen, n) << label;
    EXPECT_TRUE(all_close(out, whole, 1e-12, 1e-13)) << label << ", " << sizes.size();
  }
}

}  // namespace mixattn::testing
