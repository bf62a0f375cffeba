// Linformer (SPEC §11): the forward and backward against their slow, obvious twins in double (the
// formula with every matrix materialised, and a per-row loop that forms no matrix product),
// central finite differences for q, k, v, E and F, packed batches against separate calls, the
// records, the errors, and the steady state of the `_into` forms.
#include "counting_heap.hpp"

#include "test_util.hpp"

#include <mixattn/linformer.hpp>
#include <mixattn/packed.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace {

using namespace mixattn;
using mixattn::testing::all_close;
using mixattn::testing::expect_throw;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;

/// One head's inputs in double. E and F are drawn with standard deviation 1/sqrt(N), so that
/// K' = E k and V' = F v have entries of the size of k's and v's.
struct Problem {
  Matrix<double> q, k, v, E, F;
  Index n() const { return q.rows(); }
  Index d() const { return q.cols(); }
  Index dv() const { return v.cols(); }
  Index kp() const { return E.rows(); }
};

Problem random_problem(Index N, Index d, Index dv, Index kp, std::uint64_t seed) {
  const double s = 1 / std::sqrt(static_cast<double>(std::max<Index>(N, 1)));
  return {random_matrix<double>(N, d, seed), random_matrix<double>(N, d, seed + 1),
          random_matrix<double>(N, dv, seed + 2), random_matrix<double>(kp, N, seed + 3, s),
          random_matrix<double>(kp, N, seed + 4, s)};
}

double resolved_scale(const linformer::Options& opt, Index d) {
  return opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(d));
}

/// ||a - b|| / ||b|| (Frobenius), in double.
template <class A, class B>
double rel_err(const A& a, const B& b) {
  const Matrix<double> x = a.template cast<double>(), y = b.template cast<double>();
  const double den = y.norm();
  return den > 0 ? (x - y).norm() / den : x.norm();
}

// ---- the slow twins, in double
// -------------------------------------------------------------------

/// The formula of SPEC 11.1 and 11.2 with every intermediate materialised by plain Eigen.
struct Twin {
  Matrix<double> out, dq, dk, dv, dE, dF;
};

Matrix<double> row_softmax(const Matrix<double>& s) {
  Matrix<double> p(s.rows(), s.cols());
  for (Index i = 0; i < s.rows(); ++i) {
    const Eigen::RowVectorXd e = (s.row(i).array() - s.row(i).maxCoeff()).exp().matrix();
    p.row(i) = e / e.sum();
  }
  return p;
}

Twin twin(const Problem& p, const linformer::Options& opt, const Matrix<double>& dO) {
  const double scale = resolved_scale(opt, p.d());
  const Matrix<double> Kp = p.E * p.k, Vp = p.F * p.v;
  const Matrix<double> P = row_softmax(scale * p.q * Kp.transpose());
  Twin t;
  t.out = P * Vp;
  const Matrix<double> dP = dO * Vp.transpose();
  const Eigen::VectorXd rowsum = (dP.array() * P.array()).rowwise().sum();
  const Matrix<double> dS = (P.array() * (dP.colwise() - rowsum).array()).matrix();
  t.dq = scale * dS * Kp;
  const Matrix<double> dKp = scale * dS.transpose() * p.q, dVp = P.transpose() * dO;
  t.dE = dKp * p.k.transpose();
  t.dk = p.E.transpose() * dKp;
  t.dF = dVp * p.v.transpose();
  t.dv = p.F.transpose() * dVp;
  return t;
}

/// The forward of SPEC 11.1 as loops, one query row at a time: each logit's projected key and
/// each projected value summed over the sequence directly, no matrix product anywhere.
Matrix<double> row_loop_forward(const Problem& p, const linformer::Options& opt) {
  const double scale = resolved_scale(opt, p.d());
  const Index N = p.n(), d = p.d(), dv = p.dv(), kp = p.kp();
  Matrix<double> out(N, dv);
  std::vector<double> s(static_cast<std::size_t>(kp));
  for (Index i = 0; i < N; ++i) {
    for (Index j = 0; j < kp; ++j) {
      double logit = 0;
      for (Index c = 0; c < d; ++c) {
        double kjc = 0;  // K'(j, c) = sum_t E(j, t) k(t, c)
        for (Index t = 0; t < N; ++t) kjc += p.E(j, t) * p.k(t, c);
        logit += p.q(i, c) * kjc;
      }
      s[static_cast<std::size_t>(j)] = scale * logit;
    }
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double& x : s) z += (x = std::exp(x - m));
    for (Index c = 0; c < dv; ++c) {
      double o = 0;
      for (Index j = 0; j < kp; ++j) {
        double vjc = 0;  // V'(j, c) = sum_t F(j, t) v(t, c)
        for (Index t = 0; t < N; ++t) vjc += p.F(j, t) * p.v(t, c);
        o += s[static_cast<std::size_t>(j)] / z * vjc;
      }
      out(i, c) = o;
    }
  }
  return out;
}

// ---- exactness against the twins, in double
// ------------------------------------------------------

// Shapes: one row, k_proj 1 (every probability 1), k_proj above and below N, d != d_v, and
// N beyond one block of rows (linformer_block_rows = 256: 300 and 600 have a partial last block).
struct Case {
  Index N, d, dv, kp;
  double scale;
};
const Case kCases[] = {{1, 3, 2, 1, 0},    {7, 4, 5, 16, 0},    {33, 8, 3, 1, 0.7},
                       {64, 16, 16, 8, 0}, {300, 12, 7, 20, 0}, {600, 5, 9, 33, 2.5}};

// Tolerance 1e-12 relative, normwise: both sides run the same arithmetic in another order (sums of
// at most N = 600 terms of O(1) and a softmax whose denominator is >= 1), so their difference is
// a few hundred eps (2e-16) at most.
TEST(LinformerExact, ForwardAndBackwardEqualTheTwin) {
  std::uint64_t seed = 100;
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.N << " d " << c.d << " dv " << c.dv << " kp "
                                      << c.kp << " seed " << seed);
    const Problem p = random_problem(c.N, c.d, c.dv, c.kp, seed);
    const Matrix<double> dO = random_matrix<double>(c.N, c.dv, seed + 10);
    seed += 20;
    linformer::Options opt;
    opt.scale = c.scale;
    const Twin want = twin(p, opt, dO);
    linformer::Saved<double> saved;
    const Matrix<double> out = linformer::forward<double>(p.q, p.k, p.v, p.E, p.F, opt, &saved);
    EXPECT_LT(rel_err(out, want.out), 1e-12);
    const linformer::Grad<double> g = linformer::backward(p.q, p.k, p.v, p.E, p.F, dO, saved, opt);
    EXPECT_LT(rel_err(g.q, want.dq), 1e-12);
    EXPECT_LT(rel_err(g.k, want.dk), 1e-12);
    EXPECT_LT(rel_err(g.v, want.dv), 1e-12);
    EXPECT_LT(rel_err(g.E, want.dE), 1e-12);
    EXPECT_LT(rel_err(g.F, want.dF), 1e-12);
  }
}

// The per-row loop is independent of the matrix twin (no product, no materialised P): it holds
// the twin's forward, and so the operator's, to the same 1e-12.
TEST(LinformerExact, ForwardEqualsTheRowLoop) {
  for (const Case& c : {kCases[0], kCases[1], kCases[2], kCases[4]}) {
    SCOPED_TRACE(::testing::Message() << "N " << c.N << " kp " << c.kp);
    const Problem p = random_problem(c.N, c.d, c.dv, c.kp, 150 + c.N);
    linformer::Options opt;
    opt.scale = c.scale;
    const Matrix<double> want = row_loop_forward(p, opt);
    EXPECT_LT(rel_err(twin(p, opt, Matrix<double>::Zero(c.N, c.dv)).out, want), 1e-12);
    EXPECT_LT(rel_err(linformer::forward<double>(p.q, p.k, p.v, p.E, p.F, opt), want), 1e-12);
  }
}

// ---- central finite differences in double
// ----------------------------------------------------------

// Loss L = sum(W o O); every entry of q, k, v, E, F perturbed by h = 1e-6. The difference
// quotient's error is h^2 |L'''| / 6 (~1e-12 here) plus eps |L| / h (|L| ~ 10: ~1e-9); 1e-6
// relative and 1e-7 absolute leave a margin of 100 over that. The twin's backward is held to the
// same differences, so the oracle is checked too.
void check_finite_differences(double scale, std::uint64_t seed) {
  const Index N = 9, d = 3, dv = 2, kp = 4;
  Problem p = random_problem(N, d, dv, kp, seed);
  linformer::Options opt;
  opt.scale = scale;
  const Matrix<double> W = random_matrix<double>(N, dv, seed + 10);
  const auto loss = [&] {
    const Matrix<double> out = linformer::forward<double>(p.q, p.k, p.v, p.E, p.F, opt);
    return (out.array() * W.array()).sum();
  };
  linformer::Saved<double> saved;
  linformer::forward<double>(p.q, p.k, p.v, p.E, p.F, opt, &saved);
  const linformer::Grad<double> gr = linformer::backward(p.q, p.k, p.v, p.E, p.F, W, saved, opt);
  const Twin tw = twin(p, opt, W);
  const double rtol = 1e-6, atol = 1e-7;
  const Matrix<double> dq = numeric_gradient(p.q, loss), dk = numeric_gradient(p.k, loss);
  const Matrix<double> dv_ = numeric_gradient(p.v, loss), dE = numeric_gradient(p.E, loss);
  const Matrix<double> dF = numeric_gradient(p.F, loss);
  EXPECT_TRUE(all_close(gr.q, dq, rtol, atol)) << "q";
  EXPECT_TRUE(all_close(gr.k, dk, rtol, atol)) << "k";
  EXPECT_TRUE(all_close(gr.v, dv_, rtol, atol)) << "v";
  EXPECT_TRUE(all_close(gr.E, dE, rtol, atol)) << "E";
  EXPECT_TRUE(all_close(gr.F, dF, rtol, atol)) << "F";
  EXPECT_TRUE(all_close(tw.dq, dq, rtol, atol) && all_close(tw.dk, dk, rtol, atol) &&
              all_close(tw.dv, dv_, rtol, atol) && all_close(tw.dE, dE, rtol, atol) &&
              all_close(tw.dF, dF, rtol, atol))
      << "twin";
}

TEST(LinformerGradient, FiniteDifferencesDefaultScale) {
  check_finite_differences(0, 300);
}
TEST(LinformerGradient, FiniteDifferencesOtherScale) {
  check_finite_differences(1.7, 310);
}

// ---- float against the twin
// --------------------------------------------------------------------------

// Normwise relative tolerance of float results: the projections sum N = 300 terms of O(1/sqrt(N))
// (rounding ~sqrt(N) eps = 1e-6 of the result for random signs, N eps = 2e-5 at worst) and the
// gradients sum as many with cancellation between signs; 1e-4 sits above the worst case.
TEST(LinformerFloat, ForwardAndBackwardAgreeWithTheDoubleTwin) {
  const Problem p = random_problem(300, 16, 12, 32, 400);
  const Matrix<double> dO = random_matrix<double>(300, 12, 401);
  const Twin want = twin(p, {}, dO);
  const Matrix<float> q = p.q.cast<float>(), k = p.k.cast<float>(), v = p.v.cast<float>();
  const Matrix<float> E = p.E.cast<float>(), F = p.F.cast<float>();
  linformer::Saved<float> saved;
  const Matrix<float> out = linformer::forward<float>(q, k, v, E, F, {}, &saved);
  const linformer::Grad<float> g =
      linformer::backward<float>(q, k, v, E, F, dO.cast<float>(), saved);
  constexpr double tol = 1e-4;
  EXPECT_LT(rel_err(out, want.out), tol);
  EXPECT_LT(rel_err(g.q, want.dq), tol);
  EXPECT_LT(rel_err(g.k, want.dk), tol);
  EXPECT_LT(rel_err(g.v, want.dv), tol);
  EXPECT_LT(rel_err(g.E, want.dE), tol);
  EXPECT_LT(rel_err(g.F, want.dF), tol);
}

// ---- forms, records, packed batches
// --------------------------------------------------------------------

template <class T>
class LinformerTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(LinformerTyped, Scalars);

/// The inputs of a Problem in T.
template <class T>
struct Inputs {
  Matrix<T> q, k, v, E, F;
  explicit Inputs(const Problem& p)
      : q(p.q.cast<T>()), k(p.k.cast<T>()), v(p.v.cast<T>()), E(p.E.cast<T>()), F(p.F.cast<T>()) {}
};

// The value-returning and the _into forms run one body: the same bits, with records reused across
// calls of other shapes; a forward without a record gives the same outputs.
TYPED_TEST(LinformerTyped, IntoFormsEqualValueForms) {
  using T = TypeParam;
  const linformer::Options opt;
  Matrix<T> out;
  linformer::Saved<T> saved;
  linformer::Grad<T> grad;
  for (const Index N : {70, 5, 300}) {
    const Inputs<T> in(random_problem(N, 8, 4, 10 + N % 7, 540 + N));
    const Matrix<T> dO = random_matrix<T>(N, 4, 541);
    linformer::Saved<T> fresh;
    const Matrix<T> want = linformer::forward<T>(in.q, in.k, in.v, in.E, in.F, opt, &fresh);
    linformer::forward_into(out, in.q, in.k, in.v, in.E, in.F, opt, &saved);
    EXPECT_TRUE(out == want);
    EXPECT_TRUE(linformer::forward<T>(in.q, in.k, in.v, in.E, in.F, opt) == want);
    const linformer::Grad<T> wg = linformer::backward(in.q, in.k, in.v, in.E, in.F, dO, fresh, opt);
    linformer::backward_into(grad, in.q, in.k, in.v, in.E, in.F, dO, saved, opt);
    EXPECT_TRUE(grad.q == wg.q && grad.k == wg.k && grad.v == wg.v);
    EXPECT_TRUE(grad.E == wg.E && grad.F == wg.F);
  }
}

// N = 0 (E and F with no columns): an empty output, empty gradients of q, k, v, and zero
// gradients of E, F (k_proj x 0).
TYPED_TEST(LinformerTyped, EmptySequence) {
  using T = TypeParam;
  const Matrix<T> q(0, 4), v(0, 3), E(5, 0);
  linformer::Saved<T> saved;
  const Matrix<T> out = linformer::forward<T>(q, q, v, E, E, {}, &saved);
  EXPECT_EQ(out.rows(), 0);
  EXPECT_EQ(out.cols(), 3);
  const linformer::Grad<T> g = linformer::backward<T>(q, q, v, E, E, v, saved);
  EXPECT_EQ(g.q.rows(), 0);
  EXPECT_EQ(g.v.cols(), 3);
  EXPECT_EQ(g.E.rows(), 5);
  EXPECT_EQ(g.F.cols(), 0);
}

// A packed call (cu_seqlens offsets, H heads side by side, E and F shared) is one call of the
// single-sequence operator per (sequence, head): the same bits as the separate calls for the
// outputs and dq, dk, dv; dE and dF are the items' gradients summed in item order, on one and two
// threads.
TYPED_TEST(LinformerTyped, PackedEqualsSeparateCalls) {
  using T = TypeParam;
  const Index H = 2, d = 5, dv = 3, N = 37, kp = 6;
  const Offsets off = {0, N, 2 * N, 3 * N};
  const Index total = off.back(), B = 3;
  const Matrix<T> q = random_matrix<T>(total, H * d, 600), k = random_matrix<T>(total, H * d, 601);
  const Matrix<T> v = random_matrix<T>(total, H * dv, 602),
                  dO = random_matrix<T>(total, H * dv, 603);
  const Matrix<T> E = random_matrix<T>(kp, N, 604, 0.2), F = random_matrix<T>(kp, N, 605, 0.2);
  const linformer::Options opt;
  for (const int threads : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "threads " << threads);
    Matrix<T> out;
    linformer::PackedSaved<T> saved;
    linformer::PackedGrad<T> grad;
    linformer::forward_packed_into(out, H, q, k, v, E, F, off, opt, &saved, threads);
    linformer::backward_packed_into(grad, H, q, k, v, E, F, dO, off, saved, opt, threads);
    ASSERT_EQ(out.rows(), total);
    Matrix<T> dE = Matrix<T>::Zero(kp, N), dF = Matrix<T>::Zero(kp, N);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        const Index a = off[static_cast<std::size_t>(b)], i = b * H + h;
        linformer::Saved<T> rec;
        const Matrix<T> o = linformer::forward<T>(q.block(a, h * d, N, d), k.block(a, h * d, N, d),
                                                  v.block(a, h * dv, N, dv), E, F, opt, &rec);
        EXPECT_TRUE(out.block(a, h * dv, N, dv) == o) << "item " << i;
        const linformer::Grad<T> gr = linformer::backward<T>(
            q.block(a, h * d, N, d), k.block(a, h * d, N, d), v.block(a, h * dv, N, dv), E, F,
            dO.block(a, h * dv, N, dv), rec, opt);
        EXPECT_TRUE(grad.q.block(a, h * d, N, d) == gr.q) << "item " << i;
        EXPECT_TRUE(grad.k.block(a, h * d, N, d) == gr.k) << "item " << i;
        EXPECT_TRUE(grad.v.block(a, h * dv, N, dv) == gr.v) << "item " << i;
        dE += gr.E;
        dF += gr.F;
      }
    EXPECT_TRUE(grad.E == dE);
    EXPECT_TRUE(grad.F == dF);
  }
}

TEST(LinformerPacked, ErrorsNameTheArgument) {
  const Index H = 2, d = 4, dv = 3, N = 5;
  const Offsets off = {0, N, 2 * N};
  const Matrix<double> q = random_matrix<double>(2 * N, H * d, 660);
  const Matrix<double> v = random_matrix<double>(2 * N, H * dv, 661);
  const Matrix<double> E = random_matrix<double>(3, N, 662);
  const char* fn = "mixattn::linformer::forward_packed_into";
  Matrix<double> out;
  using IA = std::invalid_argument;
  expect_throw<IA>(
      [&] {
        linformer::forward_packed_into(out, H, q, q, v, E, E, {0, 4, 10}, {}, nullptr);
      },
      {fn, "sequence 0 has length 4", "length 5"});
  expect_throw<IA>(
      [&] {
        linformer::forward_packed_into(out, H, q, q, v, E, E, {0, 5, 5, 10}, {}, nullptr);
      },
      {fn, "sequence 1 has length 0", "length 5"});
  expect_throw<IA>(
      [&] { linformer::forward_packed_into(out, H, q, q, v, E, E.topRows(2), off, {}, nullptr); },
      {fn, "E is 3 x 5 and F is 2 x 5"});
  linformer::Options causal;
  causal.causal = true;
  expect_throw<IA>(
      [&] { linformer::forward_packed_into(out, H, q, q, v, E, E, off, causal, nullptr); },
      {fn, "options.causal is true"});
  linformer::PackedSaved<double> saved;
  linformer::forward_packed_into(out, H, q, q, v, E, E, off, {}, &saved);
  linformer::PackedGrad<double> grad;
  expect_throw<IA>(
      [&] {
        linformer::backward_packed_into(grad, 1, q.leftCols(d), q.leftCols(d), v.leftCols(dv), E, E,
                                        out.leftCols(dv), off, saved, {});
      },
      {"mixattn::linformer::backward_packed_into", "saved holds"});
}

// ---- errors
// ------------------------------------------------------------------------------------------

TEST(LinformerErrors, ShapesAndOptionsAreNamed) {
  const Index N = 6, d = 4, dv = 3, kp = 2;
  const Matrix<double> q = random_matrix<double>(N, d, 1), v = random_matrix<double>(N, dv, 2);
  const Matrix<double> E = random_matrix<double>(kp, N, 3);
  const char* fn = "mixattn::linformer::forward";
  const auto fwd = [&](const Matrix<double>& q_, const Matrix<double>& k_, const Matrix<double>& v_,
                       const Matrix<double>& E_, const Matrix<double>& F_,
                       const linformer::Options& o = {}) {
    return [=] { linformer::forward<double>(q_, k_, v_, E_, F_, o); };
  };
  using IA = std::invalid_argument;
  expect_throw<IA>(fwd(q, q.topRows(5), v, E, E), {fn, "k is 5 x 4", "q is 6 x 4"});
  expect_throw<IA>(fwd(q, q.leftCols(3), v, E, E), {fn, "k is 6 x 3"});
  expect_throw<IA>(fwd(q, q, v.topRows(4), E, E), {fn, "v is 4 x 3", "6 rows"});
  expect_throw<IA>(fwd(q.leftCols(0), q.leftCols(0), v, E, E), {fn, "q has 0 columns"});
  expect_throw<IA>(fwd(q, q, v, E.leftCols(5), E),
                   {fn, "E has 5 columns but the sequence has length 6", "length 5 only"});
  expect_throw<IA>(fwd(q, q, v, E, E.leftCols(5)),
                   {fn, "F has 5 columns but the sequence has length 6"});
  expect_throw<IA>(fwd(q, q, v, E, E.topRows(1)),
                   {fn, "F has 1 rows but E has 2", "the same k_proj"});
  expect_throw<IA>(fwd(q, q, v, E.topRows(0), E.topRows(0)), {fn, "E has 0 rows"});
  linformer::Options o;
  o.causal = true;
  expect_throw<IA>(fwd(q, q, v, E, E, o),
                   {fn, "options.causal is true", "bidirectional only", "later ones"});
  o = {};
  o.scale = -1;
  expect_throw<IA>(fwd(q, q, v, E, E, o), {fn, "options.scale is -1"});
  o.scale = std::numeric_limits<double>::infinity();
  expect_throw<IA>(fwd(q, q, v, E, E, o), {fn, "options.scale is inf"});
  Matrix<double> out;
  expect_throw<IA>(
      [&] { linformer::forward_into<double>(out, q, q, v, E.leftCols(5), E, {}, nullptr); },
      {"mixattn::linformer::forward_into", "E has 5 columns"});
}

TEST(LinformerErrors, NonFiniteInputsAndOverflow) {
  const Index N = 6, d = 4, dv = 3, kp = 2;
  const Matrix<float> q = random_matrix<float>(N, d, 1), v = random_matrix<float>(N, dv, 2);
  const Matrix<float> E = random_matrix<float>(kp, N, 3);
  using DE = std::domain_error;
  const char* fn = "mixattn::linformer::forward";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const char* names[] = {"q has a non-finite entry at (4, 1)", "k has", "v has", "E has a non",
                         "F has a non"};
  for (int which = 0; which < 5; ++which) {
    Matrix<float> x[5] = {q, q, v, E, E};
    x[which](which < 3 ? 4 : 1, 1) = which % 2 ? inf : nan;
    expect_throw<DE>([&] { linformer::forward<float>(x[0], x[1], x[2], x[3], x[4]); },
                     {fn, names[which]});
    linformer::Options off;
    off.check_finite = false;
    EXPECT_NO_THROW(linformer::forward<float>(x[0], x[1], x[2], x[3], x[4], off));
  }
  // a grad_out with a NaN
  linformer::Saved<float> saved;
  linformer::forward<float>(q, q, v, E, E, {}, &saved);
  Matrix<float> dO = v;
  dO(2, 2) = nan;
  expect_throw<DE>([&] { linformer::backward<float>(q, q, v, E, E, dO, saved); },
                   {"mixattn::linformer::backward", "grad_out has a non-finite entry at (2, 2)"});
  // an output that overflows float although every input is finite
  const Matrix<float> huge = Matrix<float>::Constant(N, dv, 3e38f);
  expect_throw<DE>([&] { linformer::forward<float>(q, q, huge, Matrix<float>::Ones(kp, N), E); },
                   {fn, "overflows float"});
}

TEST(LinformerErrors, RecordsAreRefusedForOtherData) {
  const Index N = 20, d = 4, dv = 3, kp = 5;
  const Problem p = random_problem(N, d, dv, kp, 600);
  const Matrix<double> dO = random_matrix<double>(N, dv, 601);
  linformer::Options opt;
  linformer::Saved<double> saved;
  linformer::forward<double>(p.q, p.k, p.v, p.E, p.F, opt, &saved);
  const char* fn = "mixattn::linformer::backward";
  using IA = std::invalid_argument;
  const auto bwd = [&](const Problem& x, const linformer::Options& o) {
    return [&, x, o] { linformer::backward(x.q, x.k, x.v, x.E, x.F, dO, saved, o); };
  };
  EXPECT_NO_THROW(bwd(p, opt)());
  const char* names[] = {"q", "k", "v", "E", "F"};
  for (int which = 0; which < 5; ++which) {
    Problem other = p;
    Matrix<double>* m[] = {&other.q, &other.k, &other.v, &other.E, &other.F};
    (*m[which])(3, 1) += 1;
    expect_throw<IA>(bwd(other, opt), {fn, "saved came from other data", names[which]});
  }
  linformer::Options other_opt;
  other_opt.scale = 0.25;
  expect_throw<IA>(bwd(p, other_opt), {fn, "saved was made with scale = 0.5", "scale = 0.25"});
  linformer::Saved<double> empty;
  expect_throw<IA>([&] { linformer::backward(p.q, p.k, p.v, p.E, p.F, dO, empty, opt); },
                   {fn, "saved was not filled by forward"});
  expect_throw<IA>(
      [&] {
        linformer::backward(p.q, p.k, p.v, p.E, p.F, Matrix<double>(dO.topRows(5)), saved, opt);
      },
      {fn, "grad_out is 5 x 3", "20 x 3"});
  const Problem shorter = random_problem(N - 1, d, dv, kp, 602);
  expect_throw<IA>(
      [&] {
        linformer::backward(shorter.q, shorter.k, shorter.v, shorter.E, shorter.F,
                            Matrix<double>(dO.topRows(N - 1)), saved, opt);
      },
      {fn, "saved is for N = 20", "N = 19"});
}

// ---- steady state
// --------------------------------------------------------------------------------------

/// Heap allocations made by fn() (0 under the sanitizers, whose runtimes own malloc).
template <class Fn>
std::int64_t allocations_of(Fn&& fn) {
#ifndef MIXATTN_TEST_SANITIZED
  const std::int64_t before = mixattn::bench::heap_counters().allocs.load();
  fn();
  return mixattn::bench::heap_counters().allocs.load() - before;
#else
  fn();
  return 0;
#endif
}

// A training step through the _into forms (forward with a record or without, backward into a
// reused Grad) and a packed step allocate nothing once their shapes have been seen. N = 1000,
// k_proj = 256, d = 64 make Eigen's GEMM pack more than 128 KiB (the projections' depth N, the
// logits' 256 x 256 blocks), where Eigen alone would allocate.
TYPED_TEST(LinformerTyped, SteadyStateAllocatesNothing) {
  using T = TypeParam;
  const Index N = 1000, d = 64, kp = 256;
  const Inputs<T> in(random_problem(N, d, d, kp, 700));
  const Matrix<T> dO = random_matrix<T>(N, d, 701);
  const linformer::Options opt;
  Matrix<T> out;
  linformer::Saved<T> saved;
  linformer::Grad<T> grad;
  const auto step = [&] {
    linformer::forward_into(out, in.q, in.k, in.v, in.E, in.F, opt, &saved);
    linformer::backward_into(grad, in.q, in.k, in.v, in.E, in.F, dO, saved, opt);
  };
  step();
  EXPECT_EQ(allocations_of(step), 0);
  const auto no_record = [&] {
    linformer::forward_into(out, in.q, in.k, in.v, in.E, in.F, opt, nullptr);
  };
  no_record();
  EXPECT_EQ(allocations_of(no_record), 0);
  const Offsets off = {0, N / 4, N / 2};
  const Matrix<T> E = in.E.leftCols(N / 4), F = in.F.leftCols(N / 4);
  Matrix<T> pout;
  linformer::PackedSaved<T> psaved;
  linformer::PackedGrad<T> pgrad;
  const auto packed_step = [&] {
    linformer::forward_packed_into(pout, 1, in.q.topRows(N / 2), in.k.topRows(N / 2),
                                   in.v.topRows(N / 2), E, F, off, opt, &psaved);
    linformer::backward_packed_into(pgrad, 1, in.q.topRows(N / 2), in.k.topRows(N / 2),
                                    in.v.topRows(N / 2), E, F, dO.topRows(N / 2), off, psaved, opt);
  };
  packed_step();
  EXPECT_EQ(allocations_of(packed_step), 0);
}

}  // namespace
