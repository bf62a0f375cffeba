// OVQ streaming (SPEC.md §2.5): a sequence fed in arbitrary pieces, down to one token at a time,
// gives the outputs of one call up to rounding and the same final state, bit for bit (a block's
// absorption reads only the block and the dictionary, with the same shapes whatever the split).
// Training piecewise (SPEC.md §2.4, across pieces): the pieces' backwards run in reverse, each
// given its successor's start-state gradient, give the one-call gradients.
#include <mixattn/ovq.hpp>

#include "test_ovq_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <stdexcept>
#include <string>
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

// Gradients of one piece or of the whole call, gathered over the pieces.
struct PieceGrads {
  Matrix<double> q, k, v;
  double beta = 0;
  ovq::StateGrad<double> start;  // dL/d(the state the first piece started from)
};

/// One call over the whole sequence from `start`: L = sum(w o out) + <G, end state>.
PieceGrads one_call_grads(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                          const Matrix<double>& w, double beta, const ovq::Options& opt,
                          const ovq::State<double>& start, const ovq::StateGrad<double>& G) {
  ovq::State<double> st = start;
  ovq::Saved<double> saved;
  ovq::forward<double>(q, k, v, beta, opt, st, &saved);
  ovq::Grad<double> g = ovq::backward<double>(q, k, v, beta, w, saved, opt, &G);
  return {g.q, g.k, g.v, g.beta, g.state};
}

/// The same loss over consecutive pieces: forward through them with the state, then backward
/// in reverse with one Grad, each piece given the grad.state its successor left (the last one
/// G), through backward_into with grad_state_out aliasing grad.state.
PieceGrads piecewise_grads(const Matrix<double>& q, const Matrix<double>& k,
                           const Matrix<double>& v, const Matrix<double>& w, double beta,
                           const ovq::Options& opt, const ovq::State<double>& start,
                           const ovq::StateGrad<double>& G, const std::vector<Index>& pieces) {
  std::vector<ovq::Saved<double>> saved(pieces.size());
  std::vector<Index> at(pieces.size() + 1, 0);
  ovq::State<double> st = start;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    at[i + 1] = at[i] + pieces[i];
    ovq::forward<double>(q.middleRows(at[i], pieces[i]), k.middleRows(at[i], pieces[i]),
                         v.middleRows(at[i], pieces[i]), beta, opt, st, &saved[i]);
  }
  PieceGrads out{Matrix<double>(q.rows(), q.cols()),
                 Matrix<double>(k.rows(), k.cols()),
                 Matrix<double>(v.rows(), v.cols()),
                 0,
                 {}};
  ovq::Grad<double> g;
  for (std::size_t i = pieces.size(); i-- > 0;) {
    const ovq::StateGrad<double>* next = i + 1 == pieces.size() ? &G : &g.state;
    const Index a = at[i], len = pieces[i];
    ovq::backward_into<double>(g, q.middleRows(a, len), k.middleRows(a, len), v.middleRows(a, len),
                               beta, w.middleRows(a, len), saved[i], opt, next);
    out.q.middleRows(a, len) = g.q;
    out.k.middleRows(a, len) = g.k;
    out.v.middleRows(a, len) = g.v;
    out.beta += g.beta;
  }
  out.start = g.state;
  return out;
}

// Three pieces backpropagated in reverse equal one call over the whole sequence, for every
// input (q, k, v, beta and the start state's keys, values and pending tokens), with a gradient
// on the final state too, in both gradient modes: splits inside blocks, on block boundaries,
// and a first piece that completes no block. Both sides compute the same sums in double, in
// orders that differ only by the tiling of the pieces' queries and by the split of the
// running-mean chain at the pieces' ends: rounding ~1e-15 relative, so 1e-10 (relative, with a
// 1e-12 floor for entries near zero) catches any missing term, which would be O(1e-2).
TEST(OvqStreamingGrad, PiecesInReverseEqualOneCall) {
  const Index r = 4, dv = 3, n = 70;
  ovq::Options opt;
  opt.block = 8;
  opt.max_centroids = 12;
  ovq::State<double> start = ovq::State<double>::empty(r, dv);
  ovq::forward<double>(random_matrix<double>(37, r, 71), random_matrix<double>(37, r, 72),
                       random_matrix<double>(37, dv, 73), 1.1, opt, start);
  ASSERT_EQ(start.pending_keys.rows(), 5);
  ASSERT_GT(start.keys.rows(), 0);
  const Matrix<double> q = random_matrix<double>(n, r, 74), k = random_matrix<double>(n, r, 75),
                       v = random_matrix<double>(n, dv, 76), w = random_matrix<double>(n, dv, 77);
  ovq::State<double> end = start;
  ovq::forward<double>(q, k, v, 1.1, opt, end);
  ASSERT_EQ(end.pending_keys.rows(), (5 + n) % 8);
  ovq::StateGrad<double> G;
  G.keys = random_matrix<double>(end.keys.rows(), r, 78);
  G.values = random_matrix<double>(end.keys.rows(), dv, 79);
  G.pending_keys = random_matrix<double>(end.pending_keys.rows(), r, 80);
  G.pending_values = random_matrix<double>(end.pending_keys.rows(), dv, 81);
  const double rtol = 1e-10, atol = 1e-12;
  // Sequence positions (5 pending first) of the splits: 18 and 45 (inside blocks), 16 and 40
  // (boundaries), 7 (inside the first block) then 8 (its end).
  const std::vector<std::vector<Index>> splits = {{13, 27, 30}, {11, 24, 35}, {2, 1, 67}};
  for (const bool through : {true, false}) {
    opt.grad_through_dictionary = through;
    const PieceGrads one = one_call_grads(q, k, v, w, 1.1, opt, start, G);
    EXPECT_GT(one.start.keys.cwiseAbs().maxCoeff(), 1e-3);  // the start dictionary is read
    for (const std::vector<Index>& pieces : splits) {
      const PieceGrads p = piecewise_grads(q, k, v, w, 1.1, opt, start, G, pieces);
      const std::string what = (through ? "through, split " : "stopped, split ") +
                               std::to_string(pieces[0]) + "+" + std::to_string(pieces[1]);
      EXPECT_TRUE(close(p.q, one.q, rtol, atol)) << what << ": dq";
      EXPECT_TRUE(close(p.k, one.k, rtol, atol)) << what << ": dk";
      EXPECT_TRUE(close(p.v, one.v, rtol, atol)) << what << ": dv";
      EXPECT_NEAR(p.beta, one.beta, atol + rtol * std::abs(one.beta)) << what << ": dbeta";
      EXPECT_TRUE(close(p.start.keys, one.start.keys, rtol, atol)) << what << ": dD_k,0";
      EXPECT_TRUE(close(p.start.values, one.start.values, rtol, atol)) << what << ": dD_v,0";
      EXPECT_TRUE(close(p.start.pending_keys, one.start.pending_keys, rtol, atol))
          << what << ": d pending_keys_0";
      EXPECT_TRUE(close(p.start.pending_values, one.start.pending_values, rtol, atol))
          << what << ": d pending_values_0";
    }
  }
}

// An end-state gradient of other shapes, with a non-finite entry, or carrying the fingerprint
// of another state than the one the call ended in, is rejected; grad.state carries the start
// state's fingerprint, so the previous piece accepts it.
TEST(OvqStreamingGrad, RejectsMismatchedStateGradients) {
  const Index r = 4, dv = 3;
  ovq::Options opt;
  opt.block = 4;
  opt.max_centroids = 6;
  const Matrix<double> q = random_matrix<double>(10, r, 91), k = random_matrix<double>(10, r, 92),
                       v = random_matrix<double>(10, dv, 93), w = random_matrix<double>(10, dv, 94);
  ovq::State<double> st = ovq::State<double>::empty(r, dv);
  ovq::Saved<double> first, second;
  ovq::forward<double>(q.topRows(6), k.topRows(6), v.topRows(6), 1.0, opt, st, &first);
  ovq::forward<double>(q.bottomRows(4), k.bottomRows(4), v.bottomRows(4), 1.0, opt, st, &second);
  ASSERT_EQ(st.pending_keys.rows(), 2);
  ovq::StateGrad<double> G;
  G.keys = Matrix<double>::Ones(st.keys.rows(), r);
  G.values = Matrix<double>::Ones(st.keys.rows(), dv);
  G.pending_keys = Matrix<double>::Ones(2, r);
  G.pending_values = Matrix<double>::Ones(2, dv);
  const auto back = [&](const ovq::StateGrad<double>& gs) {
    return ovq::backward<double>(q.bottomRows(4), k.bottomRows(4), v.bottomRows(4), 1.0,
                                 w.bottomRows(4), second, opt, &gs);
  };
  const ovq::Grad<double> g2 = back(G);
  const auto expect_bad = [&](ovq::StateGrad<double> bad, std::initializer_list<const char*> frag) {
    mt::expect_throw<std::invalid_argument>([&] { back(bad); }, frag);
  };
  ovq::StateGrad<double> bad = G;
  bad.keys = Matrix<double>::Ones(st.keys.rows() + 1, r);
  expect_bad(bad,
             {"mixattn::ovq::backward", "grad_state_out.keys is", "end state's dictionary is"});
  bad = G;
  bad.values = Matrix<double>::Ones(st.keys.rows(), dv + 1);
  expect_bad(bad, {"grad_state_out.values is"});
  bad = G;
  bad.pending_keys = Matrix<double>::Ones(3, r);
  expect_bad(bad, {"grad_state_out.pending_keys is 3 x 4", "unfinished block is 2 x 4"});
  bad = G;
  bad.pending_values = Matrix<double>::Ones(2, dv - 1);
  expect_bad(bad, {"grad_state_out.pending_values is 2 x 2"});
  bad = G;
  bad.pending_values(1, 1) = std::numeric_limits<double>::quiet_NaN();
  mt::expect_throw<std::domain_error>([&] { back(bad); }, {"grad_state_out.pending_values"});
  // g2.state is the gradient of the state `second` started from = the state `first` ended in.
  EXPECT_NO_THROW(ovq::backward<double>(q.topRows(6), k.topRows(6), v.topRows(6), 1.0, w.topRows(6),
                                        first, opt, &g2.state));
  EXPECT_NE(g2.state.state_fingerprint, 0u);
  bad = G;
  bad.state_fingerprint = g2.state.state_fingerprint;  // the start of `second`, not its end
  expect_bad(bad, {"grad_state_out came from other data"});
}

}  // namespace
