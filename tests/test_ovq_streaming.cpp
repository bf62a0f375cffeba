// OVQ streaming (SPEC.md §2.5): a sequence fed in arbitrary pieces, down to one token at a time,
// gives the outputs of one call up to rounding and the same final state, bit for bit (a block's
// absorption reads only the block and the dictionary, with the same shapes whatever the split).
#include <mixattn/ovq.hpp>

#include "test_ovq_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace {

using namespace mixattn;
namespace mt = mixattn::testing;
using mt::close;
using mt::random_matrix;
using mt::Tol;

template <class T>
class OvqStreaming : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(OvqStreaming, Scalars);

/// Runs forward over consecutive pieces of the given lengths (summing to q.rows()).
template <class T>
Matrix<T> run_pieces(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, T beta,
                     const ovq::Options& opt, ovq::State<T>& st, const std::vector<Index>& pieces) {
  Matrix<T> out(q.rows(), v.cols());
  Index at = 0;
  for (const Index len : pieces) {
    out.middleRows(at, len) = ovq::forward<T>(q.middleRows(at, len), k.middleRows(at, len),
                                              v.middleRows(at, len), beta, opt, st);
    at += len;
  }
  EXPECT_EQ(at, q.rows());
  return out;
}

std::vector<Index> random_pieces(Index total, std::uint64_t seed, Index max_len) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<Index> len(0, max_len);  // zero-length pieces included
  std::vector<Index> pieces;
  for (Index left = total; left > 0;) {
    const Index l = std::min(left, len(rng));
    pieces.push_back(l);
    left -= l;
  }
  return pieces;
}

TYPED_TEST(OvqStreaming, AnySplitGivesSameOutputsAndState) {
  using T = TypeParam;
  const Index n = 150, r = 6, dv = 5;
  const Matrix<T> q = random_matrix<T>(n, r, 51), k = random_matrix<T>(n, r, 52),
                  v = random_matrix<T>(n, dv, 53);
  for (const ovq::Seeding seeding : {ovq::Seeding::greedy_dispersion, ovq::Seeding::one_shot}) {
    ovq::Options opt;
    opt.block = 8;
    opt.max_centroids = 12;
    opt.seeding = seeding;
    ovq::State<T> whole = ovq::State<T>::empty(r, dv);
    const Matrix<T> expect = ovq::forward<T>(q, k, v, T(1.4), opt, whole);
    // 144 tokens absorbed into floor(144 * 12 / 156) = 11 centroids: most tokens were assigned.
    ASSERT_EQ(whole.keys.rows(), mt::schedule_size(144, opt));

    std::vector<std::vector<Index>> splits;
    splits.push_back(std::vector<Index>(static_cast<std::size_t>(n), 1));  // token by token
    splits.push_back({3, 5, 8, 1, 15, 16, 7, 95});                         // uneven, mid-block
    for (std::uint64_t seed = 0; seed < 4; ++seed)
      splits.push_back(random_pieces(n, 600 + seed, seed % 2 == 0 ? 11 : 40));
    for (const std::vector<Index>& pieces : splits) {
      ovq::State<T> st = ovq::State<T>::empty(r, dv);
      const Matrix<T> out = run_pieces<T>(q, k, v, T(1.4), opt, st, pieces);
      EXPECT_TRUE(close(out, expect, Tol<T>::rtol, Tol<T>::atol)) << pieces.size() << " pieces";
      EXPECT_TRUE(mt::identical(st, whole)) << pieces.size() << " pieces";
    }
  }
}

// A split continued from a state that another sequence left with a partial block.
TYPED_TEST(OvqStreaming, ContinuesFromPartialBlock) {
  using T = TypeParam;
  const Index r = 4, dv = 3;
  ovq::Options opt;
  opt.block = 16;
  opt.max_centroids = 20;
  ovq::State<T> start = ovq::State<T>::empty(r, dv);
  ovq::forward<T>(random_matrix<T>(37, r, 61), random_matrix<T>(37, r, 62),
                  random_matrix<T>(37, dv, 63), T(0.9), opt, start);
  ASSERT_EQ(start.pending_keys.rows(), 5);
  const Index n = 90;
  const Matrix<T> q = random_matrix<T>(n, r, 64), k = random_matrix<T>(n, r, 65),
                  v = random_matrix<T>(n, dv, 66);
  ovq::State<T> whole = start;
  const Matrix<T> expect = ovq::forward<T>(q, k, v, T(0.9), opt, whole);
  ovq::State<T> st = start;
  const Matrix<T> out = run_pieces<T>(q, k, v, T(0.9), opt, st, {11, 1, 0, 30, 48});
  EXPECT_TRUE(close(out, expect, Tol<T>::rtol, Tol<T>::atol));
  EXPECT_TRUE(mt::identical(st, whole));
  EXPECT_EQ(st.tokens_seen, 37 + n);
}

}  // namespace
