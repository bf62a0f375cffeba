// The OVQ dictionary (SPEC.md §2.3): growth schedules, seeding rules on hand-built inputs
// (including the tie rule), nearest-centroid assignment, and running means recomputed from the
// recorded assignments.
#include <mixattn/ovq.hpp>

#include "test_ovq_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace mixattn;
namespace mt = mixattn::testing;
using mt::close;
using mt::random_matrix;
using mt::Tol;
using mt::unit_rows;

template <class T>
class OvqDictionary : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(OvqDictionary, Scalars);

#if MIXATTN_HAS_SIMD
// The nearest-centroid search on register tiles (scores transposed, best row kept in lanes)
// against the GEMM path: the same row for every token (random unit vectors leave no near ties
// at these sizes), the same best score up to the rounding of an r-term dot product in another
// order, and the tie rule. For that, row 5 duplicates row 2 and token 3 equals it: the tiled
// path computes every score with the same instruction sequence, so the two copies tie exactly
// and row 2 wins; Eigen's GEMM may round the copies differently (they can fall in different
// panels of its blocking), so on the GEMM side 2 and 5 count as the same answer.
TYPED_TEST(OvqDictionary, TiledNearestRowsMatchGemmPath) {
  using T = TypeParam;
  struct Shape {
    Index n, r, c;
  };
  for (const Shape sh :
       {Shape{1, 5, 13}, Shape{7, 64, 256}, Shape{300, 64, 256}, Shape{53, 17, 40}}) {
    SCOPED_TRACE(::testing::Message() << "n " << sh.n << " r " << sh.r << " c " << sh.c);
    const std::uint64_t seed = static_cast<std::uint64_t>(sh.n + 5 * sh.r + 11 * sh.c);
    Matrix<T> keys = unit_rows(random_matrix<double>(sh.n, sh.r, seed), 1e-6).template cast<T>();
    Matrix<T> kb = unit_rows(random_matrix<double>(sh.c, sh.r, seed + 1), 1e-6).template cast<T>();
    const bool dup = sh.n >= 7;
    if (dup) {
      keys.row(5) = keys.row(2);
      kb.row(3) = keys.row(2);
    }
    detail::Dictionary<T> dict;
    dict.allocate(sh.n, sh.r, 1);
    dict.load(keys, Matrix<T>::Zero(sh.n, 1), Vector<T>::Ones(sh.n));
    ASSERT_TRUE(detail::BlockQuantizer<T>::tiled_nearest(sh.n));
    detail::BlockQuantizer<T> slow, fast;
    slow.reserve(sh.c, sh.n, sh.r);
    fast.reserve(sh.c, sh.n, sh.r);
    slow.nearest_old_rows(dict, kb);
    fast.nearest_old_rows_tiled(dict, kb);
    for (Index j = 0; j < sh.c; ++j) {
      const Index expect = dup && slow.nearest(j) == 5 ? 2 : slow.nearest(j);
      EXPECT_EQ(fast.nearest(j), expect) << "token " << j;
      EXPECT_NEAR(static_cast<double>(fast.best(j)), static_cast<double>(slow.best(j)),
                  16 * sh.r * static_cast<double>(std::numeric_limits<T>::epsilon()))
          << "token " << j;
    }
    if (dup) {
      EXPECT_EQ(fast.nearest(3), 2);
      // its score is its own squared norm (1 up to the normalisation's rounding)
      EXPECT_NEAR(static_cast<double>(fast.best(3)),
                  keys.row(2).template cast<double>().squaredNorm(),
                  4 * sh.r * static_cast<double>(std::numeric_limits<T>::epsilon()));
    }
  }
}
#endif

TEST(OvqSchedule, PlateauAndLinearValues) {
  using mixattn::detail::linear_size;
  using mixattn::detail::plateau_size;
  // floor(t N / (t + alpha)) by hand.
  EXPECT_EQ(plateau_size(0, 1024, 1024), 0);
  EXPECT_EQ(plateau_size(1, 1024, 1024), 1);      // floor(1024 / 1025) = 0, raised to 1
  EXPECT_EQ(plateau_size(256, 1024, 1024), 204);  // 262144 / 1280 = 204.8
  EXPECT_EQ(plateau_size(1024, 1024, 1024), 512);
  EXPECT_EQ(plateau_size(3, 10, 0.5), 8);  // 30 / 3.5 = 8.57
  EXPECT_EQ(plateau_size(7, 10, 0.5), 9);  // 70 / 7.5 = 9.33
  EXPECT_EQ(plateau_size(3, 7, 4), 3);     // 21 / 7 = 3 exactly: no floor slip
  // t N overflows 64 bits here; the answer is N - ceil(alpha N / (t + alpha)) = 1023.
  EXPECT_EQ(plateau_size(Index(1) << 62, 1024, 1024), 1023);
  EXPECT_EQ(plateau_size(std::numeric_limits<Index>::max() - 4096, 1 << 20, 1 << 20),
            (1 << 20) - 1);
  EXPECT_EQ(linear_size(0, 5), 0);
  EXPECT_EQ(linear_size(3, 5), 3);
  EXPECT_EQ(linear_size(Index(1) << 62, 5), 5);
}

// Dictionary size after each absorbed block follows the schedule (catching up by at most C per
// block when the schedule jumps faster) and never exceeds N_max.
TYPED_TEST(OvqDictionary, GrowthFollowsSchedule) {
  using T = TypeParam;
  const Index r = 3, dv = 2, c = 4;
  struct Case {
    ovq::Growth growth;
    double alpha;
  };
  for (const Case cs : {Case{ovq::Growth::plateau, 0}, Case{ovq::Growth::plateau, 7},
                        Case{ovq::Growth::plateau, 1}, Case{ovq::Growth::linear, 0}}) {
    ovq::Options opt;
    opt.block = c;
    opt.max_centroids = 30;
    opt.growth = cs.growth;
    opt.growth_alpha = cs.alpha;
    ovq::State<T> st = ovq::State<T>::empty(r, dv);
    Index expect = 0;
    for (Index b = 0; b < 60; ++b) {
      ovq::forward<T>(random_matrix<T>(c, r, 700 + b), random_matrix<T>(c, r, 800 + b),
                      random_matrix<T>(c, dv, 900 + b), T(1), opt, st);
      const Index t = (b + 1) * c;
      expect = std::min(expect + c, mt::schedule_size(t, opt));
      ASSERT_EQ(st.keys.rows(), expect) << "block " << b << ", alpha " << cs.alpha;
      ASSERT_LE(st.keys.rows(), opt.max_centroids);
      EXPECT_EQ(st.counts.sum(), T(t));  // every absorbed token counted once
    }
    // At t = 240 plateau is still growing: floor(7200 / 270) = 26 (alpha = N_max = 30),
    // floor(7200 / 247) = 29 (alpha 7), floor(7200 / 241) = 29 (alpha 1).
    const bool slow = cs.growth == ovq::Growth::plateau && cs.alpha == 0;
    EXPECT_EQ(st.keys.rows(), slow ? 26 : cs.growth == ovq::Growth::linear ? 30 : 29);
  }
}

// Empty dictionary, linear schedule, C = 4, N_max = 3: three picks from four tokens.
//   k0 = (1, 0), k1 = (-1, 0.05), k2 = (-1, -0.05), k3 = (0, 1)
// Greedy: k0 (first token), then k1 (k1, k2 tie at k . k0 = -0.9988: lowest index), then k3
// (k2 is now close to k1: 0.995 > 0.05). Token 2 joins k1's centroid.
// One-shot: k0, then ascending by similarity to k0 alone: k1, k2 (tie: index order). Token 3
// joins k1's centroid (0.05 vs 0 and -0.05), or row 0 under existing-only assignment.
TYPED_TEST(OvqDictionary, SeedingRulesOnHandBuiltBlock) {
  using T = TypeParam;
  Matrix<T> k(4, 2);
  k << T(1), T(0), T(-1), T(0.05), T(-1), T(-0.05), T(0), T(1);
  const Matrix<T> v = random_matrix<T>(4, 3, 71);
  ovq::Options opt;
  opt.block = 4;
  opt.max_centroids = 3;
  opt.growth = ovq::Growth::linear;
  const Matrix<double> kh = mt::unit_rows(k.template cast<double>(), opt.norm_eps);
  {
    ovq::State<T> st = ovq::State<T>::empty(2, 3);
    ovq::Saved<T> saved;
    ovq::forward<T>(k, k, v, T(1), opt, st, &saved);
    EXPECT_EQ(saved.seeds, (std::vector<std::int64_t>{0, 1, 3}));
    EXPECT_EQ(saved.assignment, (std::vector<std::int32_t>{0, 1, 1, 2}));
    ASSERT_EQ(st.counts.size(), 3);
    EXPECT_EQ(st.counts[0], T(1));
    EXPECT_EQ(st.counts[1], T(2));
    EXPECT_EQ(st.counts[2], T(1));
    EXPECT_TRUE(close(st.keys.row(1), 0.5 * (kh.row(1) + kh.row(2)), Tol<T>::rtol, Tol<T>::atol));
    EXPECT_TRUE(close(st.values.row(1), 0.5 * (v.row(1) + v.row(2)), Tol<T>::rtol, Tol<T>::atol));
    EXPECT_TRUE(close(st.keys.row(2), kh.row(3), Tol<T>::rtol, Tol<T>::atol));
  }
  {
    opt.seeding = ovq::Seeding::one_shot;
    ovq::State<T> st = ovq::State<T>::empty(2, 3);
    ovq::Saved<T> saved;
    ovq::forward<T>(k, k, v, T(1), opt, st, &saved);
    EXPECT_EQ(saved.seeds, (std::vector<std::int64_t>{0, 1, 2}));
    EXPECT_EQ(saved.assignment, (std::vector<std::int32_t>{0, 1, 2, 1}));
    EXPECT_TRUE(close(st.keys.row(1), 0.5 * (kh.row(1) + kh.row(3)), Tol<T>::rtol, Tol<T>::atol));
    EXPECT_TRUE(close(st.keys.row(2), kh.row(2), Tol<T>::rtol, Tol<T>::atol));
  }
  {
    // Existing-only assignment, same seeds: with no old row, token 3 joins row 0 (token 0's).
    opt.assignment = ovq::Assignment::existing_only;
    ovq::State<T> st = ovq::State<T>::empty(2, 3);
    ovq::Saved<T> saved;
    ovq::forward<T>(k, k, v, T(1), opt, st, &saved);
    EXPECT_EQ(saved.seeds, (std::vector<std::int64_t>{0, 1, 2}));
    EXPECT_EQ(saved.assignment, (std::vector<std::int32_t>{0, 1, 2, 0}));
    EXPECT_EQ(st.counts, (Vector<T>(3) << T(2), T(1), T(1)).finished());
    EXPECT_TRUE(close(st.keys.row(0), 0.5 * (kh.row(0) + kh.row(3)), Tol<T>::rtol, Tol<T>::atol));
    EXPECT_TRUE(close(st.values.row(0), 0.5 * (v.row(0) + v.row(3)), Tol<T>::rtol, Tol<T>::atol));
    EXPECT_TRUE(close(st.keys.row(1), kh.row(1), Tol<T>::rtol, Tol<T>::atol));
  }
}

// Non-empty dictionary: one centroid (1, 0) of count 5; linear schedule with N_max = 3 opens two.
//   k0 = (0.9, 0.1), k1 = (0, 1), k2 = (0, -1), k3 = (-1, 0)
// Both rules pick k3 first (-1 against the old centroid); greedy then has k1, k2 tied at 0
// (against (1,0) and k3) and takes k1; one-shot takes k1 as the lower index of the tie.
// Assignment: k0 -> row 0; k2 is at dot 0 with rows 0 and 1 (a tie: lowest row, 0).
TYPED_TEST(OvqDictionary, SeedingAndTiesAgainstExistingCentroids) {
  using T = TypeParam;
  Matrix<T> k(4, 2);
  k << T(0.9), T(0.1), T(0), T(1), T(0), T(-1), T(-1), T(0);
  const Matrix<T> v = random_matrix<T>(4, 3, 72);
  for (const ovq::Seeding seeding : {ovq::Seeding::greedy_dispersion, ovq::Seeding::one_shot}) {
    ovq::Options opt;
    opt.block = 4;
    opt.max_centroids = 3;
    opt.growth = ovq::Growth::linear;
    opt.seeding = seeding;
    ovq::State<T> st = ovq::State<T>::empty(2, 3);
    st.keys.resize(1, 2);
    st.keys << T(1), T(0);
    st.values = random_matrix<T>(1, 3, 73);
    st.counts = Vector<T>::Constant(1, T(5));
    st.tokens_seen = 4;
    const ovq::State<T> start = st;
    ovq::Saved<T> saved;
    ovq::forward<T>(k, k, v, T(1), opt, st, &saved);
    EXPECT_EQ(saved.seeds, (std::vector<std::int64_t>{3, 1}));
    EXPECT_EQ(saved.assignment, (std::vector<std::int32_t>{0, 2, 0, 1}));
    ASSERT_EQ(st.counts.size(), 3);
    EXPECT_EQ(st.counts[0], T(7));
    const Matrix<double> kh = mt::unit_rows(k.template cast<double>(), opt.norm_eps);
    const Matrix<double> row0 =
        (5.0 * start.keys.row(0).template cast<double>() + kh.row(0) + kh.row(2)) / 7.0;
    EXPECT_TRUE(close(st.keys.row(0), row0, Tol<T>::rtol, Tol<T>::atol));
    const Matrix<double> val0 =
        (5.0 * start.values.row(0).template cast<double>() + v.row(0).template cast<double>() +
         v.row(2).template cast<double>()) /
        7.0;
    EXPECT_TRUE(close(st.values.row(0), val0, Tol<T>::rtol, Tol<T>::atol));
  }
}

// A full dictionary of 600 rows is scored in tiles of 256 rows: every token still joins the
// first row attaining its largest score over all of them. Rows 100, 300, 520 (three tiles) are
// one key and rows 400, 590 another, so the tie rule must hold across tiles; the other tokens
// are checked against an argmax in double wherever its best row beats every other key by more
// than 1e-5 (float rounding of an r = 4 dot product of unit vectors is ~1e-7).
TYPED_TEST(OvqDictionary, NearestCentroidAcrossScoreTiles) {
  using T = TypeParam;
  const Index r = 4, dv = 2, n = 600, c = 64;
  ovq::Options opt;
  opt.block = c;
  opt.max_centroids = n;  // full: the block opens nothing, every token joins an old row
  opt.growth = ovq::Growth::linear;
  ovq::State<T> st = ovq::State<T>::empty(r, dv);
  st.keys = mt::unit_rows(random_matrix<double>(n, r, 91), 0.0).template cast<T>();
  st.keys.row(300) = st.keys.row(520) = st.keys.row(100);
  st.keys.row(590) = st.keys.row(400);
  st.values = random_matrix<T>(n, dv, 92);
  st.counts = Vector<T>::Constant(n, T(3));
  st.tokens_seen = 10 * c;
  Matrix<T> k = random_matrix<T>(c, r, 93);
  k.row(5) = T(2) * st.keys.row(100);  // the same unit key, scored alike in every tile
  k.row(40) = T(3) * st.keys.row(400);
  const Matrix<double> dk = st.keys.template cast<double>();
  ovq::Saved<T> saved;
  ovq::forward<T>(k, k, random_matrix<T>(c, dv, 94), T(1), opt, st, &saved);
  ASSERT_EQ(saved.seeds.size(), 0u);
  EXPECT_EQ(saved.assignment[5], 100);
  EXPECT_EQ(saved.assignment[40], 400);
  const Matrix<double> scores =
      mt::unit_rows(k.template cast<double>(), opt.norm_eps) * dk.transpose();
  Index checked = 0;
  for (Index j = 0; j < c; ++j) {
    Index best = 0;
    for (Index a = 1; a < n; ++a)
      if (scores(j, a) > scores(j, best)) best = a;
    double runner_up = -2;
    for (Index a = 0; a < n; ++a)
      if (dk.row(a) != dk.row(best)) runner_up = std::max(runner_up, scores(j, a));
    if (scores(j, best) - runner_up < 1e-5) continue;
    EXPECT_EQ(saved.assignment[static_cast<std::size_t>(j)], best) << "token " << j;
    ++checked;
  }
  EXPECT_GE(checked, c - 8);
}

// Every centroid equals the count-weighted mean of the start centroid and the normalised keys
// (and raw values) assigned to it, recomputed here from Saved::assignment in double.
TYPED_TEST(OvqDictionary, RunningMeansMatchRecordedAssignments) {
  using T = TypeParam;
  const Index r = 5, dv = 4;
  ovq::Options opt;
  opt.block = 8;
  opt.max_centroids = 16;
  ovq::State<T> st = ovq::State<T>::empty(r, dv);
  ovq::forward<T>(random_matrix<T>(45, r, 81), random_matrix<T>(45, r, 82),
                  random_matrix<T>(45, dv, 83), T(1), opt, st);  // non-empty start, 5 pending
  const Index n = 300;
  const Matrix<T> q = random_matrix<T>(n, r, 84), k = random_matrix<T>(n, r, 85),
                  v = random_matrix<T>(n, dv, 86);
  const ovq::State<T> start = st;
  ovq::Saved<T> saved;
  ovq::forward<T>(q, k, v, T(1), opt, st, &saved);
  ASSERT_EQ(st.keys.rows(), mt::schedule_size(344, opt));  // floor(344 * 16 / 360) = 15

  // Sequence = start's pending tokens (already normalised), then the call's tokens.
  const Index p0 = start.pending_keys.rows();
  Matrix<double> seq_k(p0 + n, r), seq_v(p0 + n, dv);
  seq_k << start.pending_keys.template cast<double>(),
      mt::unit_rows(k.template cast<double>(), opt.norm_eps);
  seq_v << start.pending_values.template cast<double>(), v.template cast<double>();
  const Index n_start = start.keys.rows(), n_end = st.keys.rows();
  Matrix<double> sum_k = Matrix<double>::Zero(n_end, r), sum_v = Matrix<double>::Zero(n_end, dv);
  Vector<double> cnt = Vector<double>::Zero(n_end);
  for (Index a = 0; a < n_start; ++a) {
    cnt[a] = start.counts[a];
    sum_k.row(a) = cnt[a] * start.keys.row(a).template cast<double>();
    sum_v.row(a) = cnt[a] * start.values.row(a).template cast<double>();
  }
  Index absorbed = 0;
  for (Index j = 0; j < p0 + n; ++j) {
    const std::int32_t a = saved.assignment[static_cast<std::size_t>(j)];
    if (a < 0) continue;
    ASSERT_LT(a, n_end);
    ++absorbed;
    cnt[a] += 1;
    sum_k.row(a) += seq_k.row(j);
    sum_v.row(a) += seq_v.row(j);
  }
  EXPECT_EQ(absorbed, (p0 + n) / 8 * 8);
  EXPECT_TRUE(st.counts.template cast<double>() == cnt);  // integers: exact
  EXPECT_TRUE(close(st.keys, cnt.cwiseInverse().asDiagonal() * sum_k, Tol<T>::rtol, Tol<T>::atol));
  EXPECT_TRUE(
      close(st.values, cnt.cwiseInverse().asDiagonal() * sum_v, Tol<T>::rtol, Tol<T>::atol));
  // Each seed opened its row: the seed is assigned to the row it created.
  for (std::size_t p = 0; p < saved.seeds.size(); ++p)
    EXPECT_EQ(saved.assignment[static_cast<std::size_t>(saved.seeds[p])],
              static_cast<std::int32_t>(n_start + static_cast<Index>(p)));
}

}  // namespace
