// OVQ backward (SPEC.md §2.4) against central finite differences in double, for q, k, v, beta
// and the start state's keys, values and pending tokens, in both gradient modes, from an empty
// state and from a state with a partial pending block, with and without a gradient on the end
// state. Perturbations must not move any assignment or seed (checked at every x +- h), since
// those are constants of the gradient.
#include <mixattn/ovq.hpp>

#include "test_ovq_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using namespace mixattn;
namespace mt = mixattn::testing;
using mt::close;
using mt::numeric_gradient;
using mt::random_matrix;

// Central differences with h = 1e-6 on a loss of size ~10: truncation ~h^2 = 1e-12, rounding
// ~1e-16 * 10 / 1e-6 = 1e-9; analytic gradients are exact to ~1e-14. 1e-6 / 1e-7 leaves two
// orders of margin and still catches any missing term (those are O(1e-2) or larger).
constexpr double kRtol = 1e-6, kAtol = 1e-7;

struct Problem {
  ovq::Options opt;
  ovq::State<double> start;
  Matrix<double> q, k, v, w;  // w: weights of the loss L = sum(w o out) [+ <G, end state>]
  double beta = 1.2;
  bool absorbs = true;  // whether a block completes inside the call
};

/// Start state from a prefix of `prefix` tokens (empty when 0), then a call of n tokens.
Problem make_problem(const ovq::Options& opt, Index prefix, Index n, std::uint64_t seed) {
  const Index r = 4, dv = 3;
  Problem p;
  p.opt = opt;
  p.start = ovq::State<double>::empty(r, dv);
  if (prefix > 0)
    ovq::forward<double>(random_matrix<double>(prefix, r, seed + 10),
                         random_matrix<double>(prefix, r, seed + 11),
                         random_matrix<double>(prefix, dv, seed + 12), 0.9, opt, p.start);
  p.q = random_matrix<double>(n, r, seed);
  p.k = random_matrix<double>(n, r, seed + 1);
  p.v = random_matrix<double>(n, dv, seed + 2);
  p.w = random_matrix<double>(n, dv, seed + 3);
  return p;
}

/// The call's block-aligned pieces: the first ends at the first block boundary.
std::vector<Index> block_pieces(const Problem& p) {
  std::vector<Index> pieces;
  const Index c = p.opt.block, n = p.q.rows();
  Index at = 0, fill = p.start.pending_keys.rows();
  while (at < n) {
    const Index len = std::min(c - fill, n - at);
    pieces.push_back(len);
    at += len;
    fill = 0;
  }
  return pieces;
}

/// Loss and the discrete decisions it depended on.
struct Eval {
  double loss = 0;
  std::vector<std::int32_t> assignment;
  std::vector<std::int64_t> seeds;
};

/// <G, end state>: the end-state part of the loss. The dictionary part is left out when `dict`
/// is false (a constant of the gradient: the stopped mode's dictionary after an update). A
/// shape that differs from G's (a moved seed) gives NaN, which the flip count reports.
double end_term(const ovq::StateGrad<double>* G, const ovq::State<double>& end, bool dict) {
  if (G == nullptr) return 0;
  if (G->keys.rows() != end.keys.rows() || G->pending_keys.rows() != end.pending_keys.rows())
    return std::numeric_limits<double>::quiet_NaN();
  double l = G->pending_keys.cwiseProduct(end.pending_keys).sum() +
             G->pending_values.cwiseProduct(end.pending_values).sum();
  if (dict) l += G->keys.cwiseProduct(end.keys).sum() + G->values.cwiseProduct(end.values).sum();
  return l;
}

/// Full gradient mode: one call from the (perturbed) start state.
Eval eval_through(const Problem& p, const ovq::State<double>& start, const Matrix<double>& q,
                  const Matrix<double>& k, const Matrix<double>& v, double beta,
                  const ovq::StateGrad<double>* G) {
  ovq::State<double> st = start;
  ovq::Saved<double> saved;
  const Matrix<double> out = ovq::forward<double>(q, k, v, beta, p.opt, st, &saved);
  return {p.w.cwiseProduct(out).sum() + end_term(G, st, true), saved.assignment, saved.seeds};
}

/// Stopped mode: the first block runs from the (perturbed) start state, each later one from the
/// state the *unperturbed* input left before it, so the dictionary every block but the first
/// sees is a constant while the block's own keys move; the end state's dictionary is then a
/// constant too, unless no block completed (it is the start state's).
Eval eval_stopped(const Problem& p, const ovq::State<double>& start,
                  const std::vector<ovq::State<double>>& before, const Matrix<double>& q,
                  const Matrix<double>& k, const Matrix<double>& v, double beta,
                  const ovq::StateGrad<double>* G) {
  Eval e;
  Index at = 0;
  const std::vector<Index> pieces = block_pieces(p);
  ovq::State<double> st;
  for (std::size_t b = 0; b < pieces.size(); ++b) {
    st = b == 0 ? start : before[b];
    ovq::Saved<double> saved;
    const Index len = pieces[b];
    const Matrix<double> out = ovq::forward<double>(q.middleRows(at, len), k.middleRows(at, len),
                                                    v.middleRows(at, len), beta, p.opt, st, &saved);
    e.loss += p.w.middleRows(at, len).cwiseProduct(out).sum();
    e.assignment.insert(e.assignment.end(), saved.assignment.begin(), saved.assignment.end());
    e.seeds.insert(e.seeds.end(), saved.seeds.begin(), saved.seeds.end());
    at += len;
  }
  e.loss += end_term(G, st, !p.absorbs);
  return e;
}

/// A gradient for the end state `end`, random, of its shapes.
ovq::StateGrad<double> random_state_grad(const ovq::State<double>& end, std::uint64_t seed) {
  const Index r = end.keys.cols(), dv = end.values.cols();
  ovq::StateGrad<double> G;
  G.keys = random_matrix<double>(end.keys.rows(), r, seed);
  G.values = random_matrix<double>(end.keys.rows(), dv, seed + 1);
  G.pending_keys = random_matrix<double>(end.pending_keys.rows(), r, seed + 2);
  G.pending_values = random_matrix<double>(end.pending_keys.rows(), dv, seed + 3);
  return G;
}

/// Compares backward with central differences for every entry of q, k, v, beta and the start
/// state's keys, values, pending_keys and pending_values; with `end_grad`, the loss also reads
/// the end state (L += <G, end state>, G random), whose gradient backward is given.
void check_gradients(Problem p, bool through, bool end_grad = false) {
  p.opt.grad_through_dictionary = through;
  ovq::State<double> st = p.start;
  ovq::Saved<double> saved;
  ovq::forward<double>(p.q, p.k, p.v, p.beta, p.opt, st, &saved);
  const ovq::StateGrad<double> G = random_state_grad(st, 77);
  const ovq::StateGrad<double>* gp = end_grad ? &G : nullptr;
  const ovq::Grad<double> g = ovq::backward<double>(p.q, p.k, p.v, p.beta, p.w, saved, p.opt, gp);

  std::vector<ovq::State<double>> before;
  {
    ovq::State<double> s = p.start;
    Index at = 0;
    for (const Index len : block_pieces(p)) {
      before.push_back(s);
      ovq::forward<double>(p.q.middleRows(at, len), p.k.middleRows(at, len),
                           p.v.middleRows(at, len), p.beta, p.opt, s);
      at += len;
    }
  }
  Matrix<double> q = p.q, k = p.k, v = p.v;
  Matrix<double> beta = Matrix<double>::Constant(1, 1, p.beta);
  ovq::State<double> start = p.start;
  const auto eval = [&] {
    return through ? eval_through(p, start, q, k, v, beta(0, 0), gp)
                   : eval_stopped(p, start, before, q, k, v, beta(0, 0), gp);
  };
  const Eval base = eval();
  // Whether a block is absorbed inside the call (then the running means are differentiated).
  ASSERT_EQ(p.absorbs, std::any_of(base.assignment.begin() + p.start.pending_keys.rows(),
                                   base.assignment.end(), [](std::int32_t a) { return a >= 0; }));
  int flips = 0;
  const auto loss = [&] {
    const Eval e = eval();
    if (e.assignment != base.assignment || e.seeds != base.seeds) ++flips;
    return e.loss;
  };
  EXPECT_TRUE(close(g.q, numeric_gradient(q, loss), kRtol, kAtol)) << "dq";
  EXPECT_TRUE(close(g.k, numeric_gradient(k, loss), kRtol, kAtol)) << "dk";
  EXPECT_TRUE(close(g.v, numeric_gradient(v, loss), kRtol, kAtol)) << "dv";
  const Matrix<double> gb = numeric_gradient(beta, loss);
  EXPECT_NEAR(g.beta, gb(0, 0), kAtol + kRtol * std::abs(gb(0, 0))) << "dbeta";
  EXPECT_EQ(flips, 0) << "an assignment or seed moved under perturbation: pick another input";
  if (!end_grad) return;  // the start state's gradient: checked with the end state's (CI time)
  EXPECT_TRUE(close(g.state.keys, numeric_gradient(start.keys, loss), kRtol, kAtol)) << "dD_k,0";
  EXPECT_TRUE(close(g.state.values, numeric_gradient(start.values, loss), kRtol, kAtol))
      << "dD_v,0";
  EXPECT_TRUE(close(g.state.pending_keys, numeric_gradient(start.pending_keys, loss), kRtol, kAtol))
      << "d pending_keys_0";
  EXPECT_TRUE(
      close(g.state.pending_values, numeric_gradient(start.pending_values, loss), kRtol, kAtol))
      << "d pending_values_0";
  EXPECT_EQ(flips, 0) << "an assignment or seed moved under perturbation: pick another input";
}

ovq::Options small_options() {
  ovq::Options opt;
  opt.block = 4;
  opt.max_centroids = 6;  // plateau: 2, 3, 4, 4, 4, ... centroids: seeding and assignment both run
  return opt;
}

TEST(OvqBackward, FiniteDifferencesThroughDictionary) {
  check_gradients(make_problem(small_options(), 0, 19, 1000), true);
}

TEST(OvqBackward, FiniteDifferencesDictionaryStopped) {
  check_gradients(make_problem(small_options(), 0, 19, 1000), false);
}

TEST(OvqBackward, FiniteDifferencesFromPartialPendingBlock) {
  const Problem p = make_problem(small_options(), 14, 17, 2000);
  ASSERT_EQ(p.start.pending_keys.rows(), 2);
  ASSERT_GT(p.start.keys.rows(), 0);
  check_gradients(p, true);
  check_gradients(p, false);
}

TEST(OvqBackward, FiniteDifferencesOtherRules) {
  ovq::Options opt = small_options();
  opt.growth = ovq::Growth::linear;
  opt.max_centroids = 7;
  opt.seeding = ovq::Seeding::one_shot;
  opt.count_bias = false;
  const Problem p = make_problem(opt, 6, 21, 3000);
  check_gradients(p, true);
  check_gradients(p, false);
}

// Existing-only assignment (the public reference's rule): a first block whose non-seeds all
// join row 0, then blocks whose seeds attract no other token; from empty and from a partial
// pending block, both gradient modes.
TEST(OvqBackward, FiniteDifferencesExistingOnlyAssignment) {
  ovq::Options opt = small_options();
  opt.seeding = ovq::Seeding::one_shot;
  opt.assignment = ovq::Assignment::existing_only;
  const Problem fresh = make_problem(opt, 0, 19, 7000);
  check_gradients(fresh, true);
  check_gradients(fresh, false);
  const Problem cont = make_problem(opt, 10, 17, 7100);
  ASSERT_EQ(cont.start.pending_keys.rows(), 2);
  check_gradients(cont, true);
  check_gradients(cont, false);
}

// Many blocks (so several checkpoint groups are replayed) with a long dictionary history.
TEST(OvqBackward, FiniteDifferencesManyBlocks) {
  ovq::Options opt = small_options();
  opt.block = 3;
  opt.max_centroids = 5;
  check_gradients(make_problem(opt, 0, 40, 4000), true);
}

// Across pieces (SPEC 2.4): the start state's dictionary and pending tokens are inputs, and the
// loss also reads the end state. From a state with a dictionary and 2 pending tokens, 11 tokens
// complete 3 blocks (the first one the start's pending tokens began) and leave 1 pending.
TEST(OvqBackward, FiniteDifferencesStartAndEndState) {
  const Problem p = make_problem(small_options(), 14, 11, 2000);
  ASSERT_EQ(p.start.pending_keys.rows(), 2);
  ASSERT_GT(p.start.keys.rows(), 0);
  check_gradients(p, true, true);
  check_gradients(p, false, true);
}

// A call that ends on a block boundary (nothing pending at the end: the end state's gradient is
// all dictionary) from a start with 2 pending tokens, and one from an empty start, whose
// running means are all opened by the call.
TEST(OvqBackward, FiniteDifferencesEndStateOnBlockBoundary) {
  const Problem p = make_problem(small_options(), 6, 10, 2500);
  ASSERT_EQ(p.start.pending_keys.rows(), 2);
  check_gradients(p, true, true);
  check_gradients(p, false, true);
  const Problem fresh = make_problem(small_options(), 0, 8, 2600);
  check_gradients(fresh, true, true);
  check_gradients(fresh, false, true);
}

// A call inside one block: no update, so the end state's dictionary is the start's (its
// gradient passes straight through, in both modes) and its pending tokens are the start's
// followed by the call's.
TEST(OvqBackward, FiniteDifferencesStateWithinOneBlock) {
  Problem p = make_problem(small_options(), 13, 2, 2700);
  ASSERT_EQ(p.start.pending_keys.rows(), 1);
  ASSERT_GT(p.start.keys.rows(), 0);
  p.absorbs = false;
  check_gradients(p, true, true);
  check_gradients(p, false, true);
}

// The two modes must differ once a dictionary built inside the call is read (else one of the
// checks above could not tell them apart).
TEST(OvqBackward, ModesDiffer) {
  Problem p = make_problem(small_options(), 0, 19, 1000);
  ovq::State<double> st = p.start;
  ovq::Saved<double> saved;
  ovq::forward<double>(p.q, p.k, p.v, p.beta, p.opt, st, &saved);
  ovq::Options stop = p.opt;
  stop.grad_through_dictionary = false;
  const ovq::Grad<double> a = ovq::backward<double>(p.q, p.k, p.v, p.beta, p.w, saved, p.opt);
  const ovq::Grad<double> b = ovq::backward<double>(p.q, p.k, p.v, p.beta, p.w, saved, stop);
  EXPECT_FALSE(close(a.k, b.k, 1e-3, 1e-3));
  EXPECT_TRUE(close(a.q, b.q, 1e-14, 1e-14));  // queries never feed the dictionary
}

// Float backward agrees with double on the same inputs (float rounding: ~1e-6 relative per
// step over a few dozen steps; 2e-4 keeps clear of it).
TEST(OvqBackward, FloatMatchesDouble) {
  ovq::Options opt;
  opt.block = 16;
  opt.max_centroids = 24;
  const Index n = 150, r = 8, dv = 5;
  const Matrix<double> q = random_matrix<double>(n, r, 5000), k = random_matrix<double>(n, r, 5001),
                       v = random_matrix<double>(n, dv, 5002),
                       w = random_matrix<double>(n, dv, 5003);
  ovq::State<double> sd = ovq::State<double>::empty(r, dv);
  ovq::State<float> sf = ovq::State<float>::empty(r, dv);
  ovq::Saved<double> vd;
  ovq::Saved<float> vf;
  ovq::forward<double>(q, k, v, 1.0, opt, sd, &vd);
  const Matrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vvf = v.cast<float>(),
                      wf = w.cast<float>();
  ovq::forward<float>(qf, kf, vvf, 1.0f, opt, sf, &vf);
  ASSERT_EQ(vd.assignment, vf.assignment);
  const ovq::Grad<double> gd = ovq::backward<double>(q, k, v, 1.0, w, vd, opt);
  const ovq::Grad<float> gf = ovq::backward<float>(qf, kf, vvf, 1.0f, wf, vf, opt);
  EXPECT_TRUE(close(gf.q, gd.q, 2e-4, 2e-4));
  EXPECT_TRUE(close(gf.k, gd.k, 2e-4, 2e-4));
  EXPECT_TRUE(close(gf.v, gd.v, 2e-4, 2e-4));
  EXPECT_NEAR(gf.beta, gd.beta, 2e-4 * (1 + std::abs(gd.beta)));
}

// Saved holds the start state and one int per token, never a dictionary per block.
TEST(OvqBackward, SavedStaysWellBelowInputs) {
  ovq::Options opt;
  opt.block = 64;
  opt.max_centroids = 64;
  const Index n = 4096, r = 16, dv = 16;
  ovq::State<float> st = ovq::State<float>::empty(r, dv);
  ovq::Saved<float> saved;
  const Matrix<float> q = random_matrix<float>(n, r, 6000), k = random_matrix<float>(n, r, 6001),
                      v = random_matrix<float>(n, dv, 6002);
  ovq::forward<float>(q, k, v, 1.0f, opt, st, &saved);
  const std::size_t inputs = sizeof(float) * static_cast<std::size_t>(n * (2 * r + dv));
  EXPECT_LT(saved.bytes(), inputs / 8) << saved.bytes() << " vs " << inputs;
  // A dictionary snapshot per block alone would be 64 blocks x 64 x 32 floats = 512 KiB.
  EXPECT_GT(saved.bytes(), sizeof(std::int32_t) * static_cast<std::size_t>(n));
}

}  // namespace
