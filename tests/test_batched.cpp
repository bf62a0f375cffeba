// Multi-head entry points and parallel_for: every head equals its single-head call, any thread
// count gives bitwise the same result, errors surface from the calling thread.
#include <mixattn/batched.hpp>
#include <mixattn/parallel.hpp>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "test_util.hpp"

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::testing::random_matrix;
namespace gma = mixattn::gma;

TEST(ParallelFor, VisitsEveryIndexOnce) {
  for (int threads : {1, 2, 3, 0}) {
    std::vector<std::atomic<int>> hits(37);
    mixattn::parallel_for(37, threads, [&](Index i) { hits[static_cast<std::size_t>(i)]++; });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1) << "threads " << threads;
  }
}

TEST(ParallelFor, RethrowsTheLowestFailingIndex) {
  try {
    mixattn::parallel_for(10, 2, [](Index i) {
      if (i == 7) throw std::runtime_error("seven");
      if (i == 3) throw std::runtime_error("three");
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "three");
  }
  EXPECT_THROW(mixattn::parallel_for(1, -1, [](Index) {}), std::invalid_argument);
}

struct Heads {
  std::vector<gma::Mixture<double>> mix;
  Matrix<double> q, k, v, dout;
};

Heads make_heads(Index heads, Index n, Index r, Index dv, Index comps, std::uint64_t seed) {
  Heads h;
  for (Index i = 0; i < heads; ++i) h.mix.push_back(gma::Mixture<double>::random(comps, r, seed + i));
  h.q = random_matrix<double>(n, heads * r, seed + 100);
  h.k = random_matrix<double>(n, heads * r, seed + 101);
  h.v = random_matrix<double>(n, heads * dv, seed + 102);
  h.dout = random_matrix<double>(n, heads * dv, seed + 103);
  return h;
}

class BatchedGma : public ::testing::TestWithParam<bool> {};

TEST_P(BatchedGma, EachHeadEqualsItsSingleHeadCallForAnyThreadCount) {
  const Index heads = 5, n = 40, r = 6, dv = 3;
  Heads h = make_heads(heads, n, r, dv, 4, 17);
  gma::Options opt;
  opt.causal = GetParam();
  gma::HeadsSaved<double> saved1, saved2;
  const Matrix<double> out1 = gma::forward_heads(h.mix, h.q, h.k, h.v, opt, 1, &saved1);
  const Matrix<double> out2 = gma::forward_heads(h.mix, h.q, h.k, h.v, opt, 2, &saved2);
  EXPECT_EQ(out1, out2);  // bitwise: each head's arithmetic does not depend on the thread
  const gma::HeadsGrad<double> g1 =
      gma::backward_heads(h.mix, h.q, h.k, h.v, h.dout, saved1, opt, 1);
  const gma::HeadsGrad<double> g2 =
      gma::backward_heads(h.mix, h.q, h.k, h.v, h.dout, saved2, opt, 2);
  EXPECT_EQ(g1.q, g2.q);
  EXPECT_EQ(g1.k, g2.k);
  EXPECT_EQ(g1.v, g2.v);
  for (Index i = 0; i < heads; ++i) {
    const auto s = static_cast<std::size_t>(i);
    gma::Saved<double> saved;
    const Matrix<double> q = h.q.middleCols(i * r, r), k = h.k.middleCols(i * r, r);
    const Matrix<double> v = h.v.middleCols(i * dv, dv), dout = h.dout.middleCols(i * dv, dv);
    const Matrix<double> o = gma::forward(h.mix[s], q, k, v, opt, &saved);
    EXPECT_EQ(Matrix<double>(out1.middleCols(i * dv, dv)), o) << "head " << i;
    const gma::Grad<double> g = gma::backward(h.mix[s], q, k, v, dout, saved, opt);
    EXPECT_EQ(Matrix<double>(g1.q.middleCols(i * r, r)), g.q) << "head " << i;
    EXPECT_EQ(Matrix<double>(g1.k.middleCols(i * r, r)), g.k) << "head " << i;
    EXPECT_EQ(Matrix<double>(g1.v.middleCols(i * dv, dv)), g.v) << "head " << i;
    EXPECT_EQ(g1.mixtures[s].mean, g.mixture.mean) << "head " << i;
    EXPECT_EQ(g1.mixtures[s].var_raw, g.mixture.var_raw) << "head " << i;
    EXPECT_EQ(g1.mixtures[s].prior_logit, g.mixture.prior_logit) << "head " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, BatchedGma, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "causal" : "bidirectional"; });

TEST(BatchedGma, RejectsBadLayouts) {
  Heads h = make_heads(3, 8, 4, 2, 3, 5);
  auto message_of = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  std::vector<gma::Mixture<double>> none;
  EXPECT_NE(message_of([&] { gma::forward_heads(none, h.q, h.k, h.v); }).find("mixtures"),
            std::string::npos);
  Matrix<double> q_bad = h.q.leftCols(11);
  EXPECT_NE(message_of([&] { gma::forward_heads(h.mix, q_bad, h.k, h.v); }).find("q has 11"),
            std::string::npos);
  Matrix<double> v_bad = h.v.leftCols(5);
  EXPECT_NE(message_of([&] { gma::forward_heads(h.mix, h.q, h.k, v_bad); }).find("v has 5"),
            std::string::npos);
  auto mixed = h.mix;
  mixed[1] = gma::Mixture<double>::random(3, 5, 1);
  EXPECT_NE(message_of([&] { gma::forward_heads(mixed, h.q, h.k, h.v); }).find("mixtures[1]"),
            std::string::npos);
  gma::HeadsSaved<double> saved;
  gma::forward_heads(h.mix, h.q, h.k, h.v, {}, 1, &saved);
  saved.heads.pop_back();
  EXPECT_NE(message_of([&] { gma::backward_heads(h.mix, h.q, h.k, h.v, h.dout, saved); })
                .find("saved has 2 heads"),
            std::string::npos);
}

}  // namespace
