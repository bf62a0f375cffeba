// OVQ with one-shot seeding and existing-only assignment (SPEC.md §2.3) against a token-by-token
// model of the rules of the OVQ published with the KVM paper, written here from those rules:
//   - block sizes N(t) = min(floor(t N_max / (t + N_max)), N_max) (or min(t, N_max)), a block
//     opening nu = N(t + C) - N(t) centroids;
//   - empty dictionary: token 0 opens row 0, the nu - 1 tokens least similar to it open rows
//     1.. in ascending order of that similarity, and every other token joins row 0;
//   - otherwise: the nu tokens whose best similarity to the old rows is lowest open rows n0..
//     in ascending order, every other token joins its most similar old row (first on ties);
//   - the hard update D[n] += (k_j - D_old[n]) / c_new[n] for each j -> n, new rows from zero.
// A hand-built block pins down ties (the first-block rule on a hand-built block is in
// test_ovq_dictionary.cpp); random sequences cover a first block, a block that fills the
// dictionary and streaming in uneven pieces; the gradient of the model (central differences)
// must equal ovq::backward with gradients through the dictionary.
#include <mixattn/ovq.hpp>

#include "test_ovq_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using namespace mixattn;
namespace mt = mixattn::testing;
using mt::close;
using mt::random_matrix;
using mt::Tol;
using Row = Eigen::RowVectorXd;

/// The options under test: the reference's rule, everything else from `base`.
ovq::Options reference_options(ovq::Options base) {
  base.seeding = ovq::Seeding::one_shot;
  base.assignment = ovq::Assignment::existing_only;
  return base;
}

/// The reference's rules, one token at a time, in double. Valid for block >= 2 and
/// max_centroids >= 2 (where its schedule and the library's agree) and default alpha.
class ReferenceRules {
 public:
  explicit ReferenceRules(const ovq::Options& opt) : opt_(opt) {}

  std::vector<Index> assignment;  // centroid row of every token seen, -1 while pending
  std::vector<Index> seeds;       // token index that opened each row, in row order
  std::vector<Row> keys, values;
  std::vector<double> counts;

  /// Appends the rows of q, k, v to the sequence and returns their outputs.
  Matrix<double> run(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                     double beta) {
    const double s = beta * std::sqrt(static_cast<double>(q.cols()));
    Matrix<double> out(q.rows(), v.cols());
    for (Index i = 0; i < q.rows(); ++i) {
      const Row qh = q.row(i) / (q.row(i).norm() + opt_.norm_eps);
      block_k_.push_back(k.row(i) / (k.row(i).norm() + opt_.norm_eps));
      block_v_.push_back(v.row(i));
      assignment.push_back(-1);
      // One softmax over (centroid, log-count bias) and (block key so far, no bias) slots.
      std::vector<std::pair<double, Row>> slots;
      for (std::size_t n = 0; n < keys.size(); ++n)
        slots.push_back({s * qh.dot(keys[n]) + (opt_.count_bias ? std::log(counts[n]) : 0.0),
                         values[n]});
      for (std::size_t j = 0; j < block_k_.size(); ++j)
        slots.push_back({s * qh.dot(block_k_[j]), block_v_[j]});
      double top = slots[0].first, z = 0;
      for (const auto& sl : slots) top = std::max(top, sl.first);
      Row o = Row::Zero(v.cols());
      for (const auto& sl : slots) {
        const double w = std::exp(sl.first - top);
        z += w;
        o += w * sl.second;
      }
      out.row(i) = o / z;
      if (static_cast<Index>(block_k_.size()) == opt_.block) absorb();
    }
    return out;
  }

 private:
  Index schedule(Index t) const {
    const Index n = opt_.max_centroids;
    if (t <= 0) return 0;
    return opt_.growth == ovq::Growth::linear ? std::min(t, n) : std::min(t * n / (t + n), n);
  }

  void absorb() {
    const Index c = opt_.block, n0 = static_cast<Index>(keys.size());
    const Index first = static_cast<Index>(assignment.size()) - c;  // sequence index of token 0
    const Index nu = schedule(absorbed_ + c) - schedule(absorbed_);
    std::vector<Index> to(static_cast<std::size_t>(c), 0);
    std::vector<std::pair<double, Index>> rank;  // (score, token): lowest scores open rows
    Index opened = 0;
    if (n0 == 0) {
      opened = 1;  // token 0 opens row 0, where every other token goes unless it seeds
      seeds.push_back(first);
      for (Index j = 1; j < c; ++j) rank.push_back({block_k_[j].dot(block_k_[0]), j});
    } else {
      for (Index j = 0; j < c; ++j) {
        Index best = 0;
        for (Index n = 1; n < n0; ++n)
          if (block_k_[j].dot(keys[n]) > block_k_[j].dot(keys[best])) best = n;
        to[j] = best;
        rank.push_back({block_k_[j].dot(keys[best]), j});
      }
    }
    std::sort(rank.begin(), rank.end());  // ties: lower token first
    for (Index p = 0; opened < nu; ++p, ++opened) {
      to[rank[p].second] = n0 + opened;
      seeds.push_back(first + rank[p].second);
    }
    // Hard update with learning rate 1 / (count after the block), new rows from zero.
    keys.resize(n0 + nu, Row::Zero(block_k_[0].size()));
    values.resize(n0 + nu, Row::Zero(block_v_[0].size()));
    counts.resize(n0 + nu, 0.0);
    const std::vector<Row> old_k = keys, old_v = values;
    for (Index j = 0; j < c; ++j) counts[to[j]] += 1;
    for (Index j = 0; j < c; ++j) {
      const Index n = to[j];
      keys[n] += (block_k_[j] - old_k[n]) / counts[n];
      values[n] += (block_v_[j] - old_v[n]) / counts[n];
      assignment[first + j] = n;
    }
    block_k_.clear();
    block_v_.clear();
    absorbed_ += c;
  }

  ovq::Options opt_;
  std::vector<Row> block_k_, block_v_;
  Index absorbed_ = 0;
};

/// The library's state against the model's dictionary: same size, exact counts, close means.
template <class T>
::testing::AssertionResult state_matches(const ovq::State<T>& st, const ReferenceRules& m,
                                         double rtol, double atol) {
  const Index n = static_cast<Index>(m.keys.size());
  if (st.keys.rows() != n)
    return ::testing::AssertionFailure() << st.keys.rows() << " centroids vs " << n;
  Matrix<double> k(n, st.keys.cols()), v(n, st.values.cols());
  for (Index a = 0; a < n; ++a) {
    if (static_cast<double>(st.counts[a]) != m.counts[a])
      return ::testing::AssertionFailure() << "count of row " << a << ": " << st.counts[a]
                                           << " vs " << m.counts[a];
    k.row(a) = m.keys[a];
    v.row(a) = m.values[a];
  }
  ::testing::AssertionResult rk = close(st.keys, k, rtol, atol);
  if (!rk) return rk << " (keys)";
  ::testing::AssertionResult rv = close(st.values, v, rtol, atol);
  if (!rv) return rv << " (values)";
  return ::testing::AssertionSuccess();
}

std::vector<Index> as_index(const std::vector<std::int32_t>& a) {
  return std::vector<Index>(a.begin(), a.end());
}
std::vector<Index> as_index(const std::vector<std::int64_t>& a) {
  return std::vector<Index>(a.begin(), a.end());
}

template <class T>
class OvqReferenceRules : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(OvqReferenceRules, Scalars);

// Old rows (1, 0) of count 5 and (0, 1) of count 2; linear schedule, N_max = 3: one new row.
//   k0 = (-1, 0): best old 0 (row 1); nearest of all is the seed k1 (0.8).
//   k1 = (-0.8, -0.6), k2 = (-0.6, -0.8): best old -0.6 for both, an exact tie: k1 seeds.
//   k2 then joins row 0 (-0.6 > -0.8), although the seed k1 is at 0.96.
//   k3 = (0.6, 0.8): row 1.   k4 = (1, 1): exactly as close to rows 0 and 1: the lower, 0.
TYPED_TEST(OvqReferenceRules, NonSeedsIgnoreNewRowsAndTiesTakeLowest) {
  using T = TypeParam;
  Matrix<T> k(5, 2);
  k << T(-1), T(0), T(-0.8), T(-0.6), T(-0.6), T(-0.8), T(0.6), T(0.8), T(1), T(1);
  const Matrix<T> v = random_matrix<T>(5, 3, 12);
  ovq::Options opt;
  opt.block = 5;
  opt.max_centroids = 3;
  opt.growth = ovq::Growth::linear;
  opt = reference_options(opt);
  ovq::State<T> st = ovq::State<T>::empty(2, 3);
  st.keys.resize(2, 2);
  st.keys << T(1), T(0), T(0), T(1);
  st.values = random_matrix<T>(2, 3, 13);
  st.counts.resize(2);
  st.counts << T(5), T(2);
  st.tokens_seen = 10;
  const ovq::State<T> start = st;
  ovq::Saved<T> saved;
  ovq::forward<T>(k, k, v, T(1), opt, st, &saved);
  EXPECT_EQ(saved.seeds, (std::vector<std::int64_t>{1}));
  EXPECT_EQ(saved.assignment, (std::vector<std::int32_t>{1, 2, 0, 1, 0}));
  ASSERT_EQ(st.counts.size(), 3);
  EXPECT_EQ(st.counts[0], T(7));
  EXPECT_EQ(st.counts[1], T(4));
  EXPECT_EQ(st.counts[2], T(1));
  const Matrix<double> kh = mt::unit_rows(k.template cast<double>(), opt.norm_eps);
  const Matrix<double> row1 =
      (2.0 * start.keys.row(1).template cast<double>() + kh.row(0) + kh.row(3)) / 4.0;
  EXPECT_TRUE(close(st.keys.row(1), row1, Tol<T>::rtol, Tol<T>::atol));
  EXPECT_TRUE(close(st.keys.row(2), kh.row(1), Tol<T>::rtol, Tol<T>::atol));

  opt.assignment = ovq::Assignment::all_centroids;
  ovq::State<T> other = start;
  ovq::forward<T>(k, k, v, T(1), opt, other, &saved);
  EXPECT_EQ(saved.assignment, (std::vector<std::int32_t>{2, 2, 2, 1, 0}));
}

struct Case {
  Index block, max_centroids, tokens, r, dv;
  ovq::Growth growth;
  bool count_bias;
};

// Random sequences from an empty state: outputs, assignments, seeds and the final dictionary.
TYPED_TEST(OvqReferenceRules, RandomSequencesMatchModel) {
  using T = TypeParam;
  const Case cases[] = {
      {4, 6, 61, 4, 3, ovq::Growth::plateau, true},    // first block opens 2 of 4
      {4, 10, 45, 3, 2, ovq::Growth::linear, true},    // blocks open 4, 4, 2 (fills), then 0
      {5, 12, 93, 5, 4, ovq::Growth::plateau, false},  // no count bias
      {8, 16, 203, 6, 5, ovq::Growth::plateau, true},  // plateau, 25 blocks
  };
  std::uint64_t seed = 100;
  for (const Case& cs : cases) {
    ovq::Options opt;
    opt.block = cs.block;
    opt.max_centroids = cs.max_centroids;
    opt.growth = cs.growth;
    opt.count_bias = cs.count_bias;
    opt = reference_options(opt);
    const Matrix<T> q = random_matrix<T>(cs.tokens, cs.r, seed),
                    k = random_matrix<T>(cs.tokens, cs.r, seed + 1),
                    v = random_matrix<T>(cs.tokens, cs.dv, seed + 2);
    seed += 10;
    ovq::State<T> st = ovq::State<T>::empty(cs.r, cs.dv);
    ovq::Saved<T> saved;
    const Matrix<T> out = ovq::forward<T>(q, k, v, T(1.3), opt, st, &saved);
    ReferenceRules model(opt);
    const Matrix<double> expect = model.run(q.template cast<double>(), k.template cast<double>(),
                                            v.template cast<double>(), static_cast<double>(T(1.3)));
    SCOPED_TRACE(::testing::Message() << "block " << cs.block << ", N_max " << cs.max_centroids);
    EXPECT_EQ(as_index(saved.assignment), model.assignment);
    EXPECT_EQ(as_index(saved.seeds), model.seeds);
    EXPECT_TRUE(close(out, expect, Tol<T>::rtol, Tol<T>::atol));
    EXPECT_TRUE(state_matches(st, model, Tol<T>::rtol, Tol<T>::atol));
    if (cs.growth == ovq::Growth::linear) {
      EXPECT_EQ(st.keys.rows(), cs.max_centroids);
    }

    // The test can tell the rules apart: the default one assigns differently on this input
    // (not in the linear case, whose only block with both seeds and other tokens is the one
    // that fills the dictionary, and there its two other tokens are nearest to old rows).
    if (cs.growth == ovq::Growth::linear) continue;
    ovq::Options dflt = opt;
    dflt.assignment = ovq::Assignment::all_centroids;
    ovq::State<T> other = ovq::State<T>::empty(cs.r, cs.dv);
    ovq::Saved<T> other_saved;
    ovq::forward<T>(q, k, v, T(1.3), dflt, other, &other_saved);
    EXPECT_NE(other_saved.assignment, saved.assignment);
  }
}

// Uneven pieces (empty ones, single tokens, pieces across several blocks), continued from a
// state with a partial block: the same outputs as one call and the model, a bit-identical state.
TYPED_TEST(OvqReferenceRules, StreamingInUnevenPieces) {
  using T = TypeParam;
  const Index r = 4, dv = 3, prefix = 13, n = 110;
  ovq::Options opt;
  opt.block = 6;
  opt.max_centroids = 14;
  opt = reference_options(opt);
  const Matrix<T> q = random_matrix<T>(prefix + n, r, 200), k = random_matrix<T>(prefix + n, r, 201),
                  v = random_matrix<T>(prefix + n, dv, 202);
  ovq::State<T> start = ovq::State<T>::empty(r, dv);
  ovq::forward<T>(q.topRows(prefix), k.topRows(prefix), v.topRows(prefix), T(0.8), opt, start);
  ASSERT_EQ(start.pending_keys.rows(), 1);

  ovq::State<T> whole = start;
  const Matrix<T> one = ovq::forward<T>(q.bottomRows(n), k.bottomRows(n), v.bottomRows(n), T(0.8),
                                        opt, whole);
  ReferenceRules model(opt);
  const Matrix<double> expect = model.run(q.template cast<double>(), k.template cast<double>(),
                                          v.template cast<double>(), static_cast<double>(T(0.8)));
  EXPECT_TRUE(close(one, expect.bottomRows(n), Tol<T>::rtol, Tol<T>::atol));
  EXPECT_TRUE(state_matches(whole, model, Tol<T>::rtol, Tol<T>::atol));

  for (const std::vector<Index>& pieces :
       {std::vector<Index>{5, 0, 1, 1, 17, 2, 9, 30, 3, 42}, std::vector<Index>(n, 1)}) {
    ovq::State<T> st = start;
    Matrix<T> out(n, dv);
    Index at = prefix;
    for (const Index len : pieces) {
      out.middleRows(at - prefix, len) = ovq::forward<T>(
          q.middleRows(at, len), k.middleRows(at, len), v.middleRows(at, len), T(0.8), opt, st);
      at += len;
    }
    ASSERT_EQ(at, prefix + n);
    EXPECT_TRUE(close(out, one, Tol<T>::rtol, Tol<T>::atol)) << pieces.size() << " pieces";
    EXPECT_TRUE(mt::identical(st, whole)) << pieces.size() << " pieces";
  }
}

// The gradient of the model's loss sum(w o out) by central differences in double equals
// ovq::backward with gradients through the running means, for q, k, v and beta; no assignment
// or seed of the model moves under the perturbations. Tolerances as in test_ovq_backward.cpp:
// truncation ~h^2 = 1e-12, rounding ~1e-16 * 10 / h = 1e-9, against 1e-6 relative / 1e-7.
TEST(OvqReferenceRulesGradient, MatchesFiniteDifferencesOfModel) {
  const Index n = 23, r = 4, dv = 3;
  ovq::Options opt;
  opt.block = 4;
  opt.max_centroids = 6;  // blocks open 2, 1, 1, 0, ...: first block, seeding and assignment
  opt = reference_options(opt);
  Matrix<double> q = random_matrix<double>(n, r, 300), k = random_matrix<double>(n, r, 301),
                 v = random_matrix<double>(n, dv, 302);
  const Matrix<double> w = random_matrix<double>(n, dv, 303);
  Matrix<double> beta = Matrix<double>::Constant(1, 1, 1.1);

  ovq::State<double> st = ovq::State<double>::empty(r, dv);
  ovq::Saved<double> saved;
  ovq::forward<double>(q, k, v, beta(0, 0), opt, st, &saved);
  const ovq::Grad<double> g = ovq::backward<double>(q, k, v, beta(0, 0), w, saved, opt);

  ReferenceRules base_model(opt);
  base_model.run(q, k, v, beta(0, 0));
  ASSERT_EQ(as_index(saved.assignment), base_model.assignment);
  int flips = 0;
  const auto loss = [&] {
    ReferenceRules m(opt);
    const double l = w.cwiseProduct(m.run(q, k, v, beta(0, 0))).sum();
    if (m.assignment != base_model.assignment || m.seeds != base_model.seeds) ++flips;
    return l;
  };
  constexpr double rtol = 1e-6, atol = 1e-7;
  EXPECT_TRUE(close(g.q, mt::numeric_gradient(q, loss), rtol, atol)) << "dq";
  EXPECT_TRUE(close(g.k, mt::numeric_gradient(k, loss), rtol, atol)) << "dk";
  EXPECT_TRUE(close(g.v, mt::numeric_gradient(v, loss), rtol, atol)) << "dv";
  const double gb = mt::numeric_gradient(beta, loss)(0, 0);
  EXPECT_NEAR(g.beta, gb, atol + rtol * std::abs(gb)) << "dbeta";
  EXPECT_EQ(flips, 0) << "an assignment or seed moved under perturbation: pick another input";
}

}  // namespace
