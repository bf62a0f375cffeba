// Mamba2's SSD layer (SPEC §10): the chunked forward and backward against their slow, obvious
// twin (the recurrence token by token in double, with its backward through time written out),
// central finite differences for every input, the state over pieces of a sequence and through
// decoding, the records, the errors, and the steady state of the `_into` forms.
#include "counting_heap.hpp"

#include "test_util.hpp"

#include <mixattn/packed.hpp>
#include <mixattn/ssd.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace mixattn;
using mixattn::testing::all_close;
using mixattn::testing::expect_throw;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;

// ---- the slow twin: the recurrence of SPEC 10.1, token by token, in double ---------------------

/// One head's inputs in double; h0 is the start state (S x P; zero when none is continued), and
/// the scalars A, D and dt_bias sit in 1 x 1 matrices so that numeric_gradient can move them.
struct Problem {
  Matrix<double> x, B, C;
  Vector<double> dt;
  Matrix<double> A, D, bias;  // 1 x 1
  Matrix<double> h0;
  Index n() const { return x.rows(); }
  Index P() const { return x.cols(); }
  Index S() const { return B.cols(); }
};

/// Raw steps in [-4, 2] (softplus from 0.02 to 2.1; a few of them 6, with A = -3 a decay of
/// e^-18 that underflows a chunk's float products: L must come from differences), A in
/// [-1.5, -0.1], D in [-1, 1].
Problem random_problem(Index N, Index P, Index S, std::uint64_t seed, bool with_state) {
  Problem p;
  p.x = random_matrix<double>(N, P, seed);
  p.B = random_matrix<double>(N, S, seed + 1);
  p.C = random_matrix<double>(N, S, seed + 2);
  std::mt19937_64 rng(seed + 3);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  p.dt.resize(N);
  for (Index t = 0; t < N; ++t) p.dt(t) = (t % 17 == 5) ? 6.0 : -4.0 + 6.0 * u(rng);
  p.A = Matrix<double>::Constant(1, 1, -(0.1 + 1.4 * u(rng)));
  p.D = Matrix<double>::Constant(1, 1, -1.0 + 2.0 * u(rng));
  p.bias = Matrix<double>::Constant(1, 1, 0.0);
  p.h0 = with_state ? random_matrix<double>(S, P, seed + 4, 0.5) : Matrix<double>::Zero(S, P);
  return p;
}

double softplus(double z) {
  return std::max(z, 0.0) + std::log1p(std::exp(-std::abs(z)));
}

/// Delta_t and dDelta_t/ddt_t as written in SPEC 10.1.
double step_of(const Problem& p, const ssd::Options& opt, Index t, double* slope = nullptr) {
  const double z = p.dt(t) + p.bias(0, 0);
  if (slope) *slope = opt.dt_softplus ? 1 / (1 + std::exp(-z)) : 1.0;
  return opt.dt_softplus ? softplus(z) : z;
}

struct NaiveForward {
  Matrix<double> out, h_end;
  std::vector<Matrix<double>> h;  // h_0 ... h_N
};

/// h_t = e^(Delta_t A) h_(t-1) + B_t (Delta_t x_t)^T, y_t = h_t^T C_t + D x_t, as written.
NaiveForward naive_forward(const Problem& p, const ssd::Options& opt) {
  NaiveForward f;
  f.out.resize(p.n(), p.P());
  f.h.push_back(p.h0);
  for (Index t = 0; t < p.n(); ++t) {
    const double d = step_of(p, opt, t);
    const Matrix<double> h =
        std::exp(d * p.A(0, 0)) * f.h.back() + p.B.row(t).transpose() * (d * p.x.row(t));
    f.out.row(t) = (h.transpose() * p.C.row(t).transpose()).transpose() + p.D(0, 0) * p.x.row(t);
    f.h.push_back(h);
  }
  f.h_end = f.h.back();
  return f;
}

struct NaiveGrad {
  Matrix<double> x, B, C, h0;
  Vector<double> dt;
  double A = 0, D = 0, bias = 0;
};

/// Backpropagation through time of naive_forward: from dh = dh_N, for t = N ... 1,
///   dh += C_t dy_t^T,  dC_t = h_t dy_t,  dB_t = dh u_t,  du_t = dh^T B_t,
///   da_t = <dh, h_(t-1)>,  dx_t = Delta_t du_t + D dy_t,  dDelta_t = x_t . du_t + A a_t da_t,
///   dA += Delta_t a_t da_t,  dD += dy_t . x_t,  dh = a_t dh;
/// then ddt_t = dDelta_t softplus'(z_t), dbias = sum_t ddt_t.
NaiveGrad naive_backward(const Problem& p, const ssd::Options& opt, const Matrix<double>& dY,
                         const Matrix<double>& dh_end) {
  const NaiveForward f = naive_forward(p, opt);
  const Index N = p.n();
  NaiveGrad g;
  g.x.resize(N, p.P());
  g.B.resize(N, p.S());
  g.C.resize(N, p.S());
  g.dt.resize(N);
  Matrix<double> dh = dh_end;
  const double A = p.A(0, 0), D = p.D(0, 0);
  for (Index t = N - 1; t >= 0; --t) {
    double slope = 0;
    const double d = step_of(p, opt, t, &slope), a = std::exp(d * A);
    const Vector<double> dy = dY.row(t).transpose(), x = p.x.row(t).transpose();
    const Vector<double> u = d * x;
    const Matrix<double>& hp = f.h[static_cast<std::size_t>(t)];
    const Matrix<double>& ht = f.h[static_cast<std::size_t>(t + 1)];
    dh += p.C.row(t).transpose() * dy.transpose();
    g.C.row(t) = (ht * dy).transpose();
    g.B.row(t) = (dh * u).transpose();
    const Vector<double> du = dh.transpose() * p.B.row(t).transpose();
    const double da = (dh.array() * hp.array()).sum();
    g.x.row(t) = (d * du + D * dy).transpose();
    const double dd = x.dot(du) + A * a * da;
    g.A += d * a * da;
    g.D += dy.dot(x);
    g.dt(t) = dd * slope;
    g.bias += g.dt(t);
    dh = a * dh;
  }
  g.h0 = dh;
  return g;
}

// ---- helpers ------------------------------------------------------------------------------------

/// ||a - b|| / ||b|| (Frobenius), in double.
template <class A, class B>
double rel_err(const A& a, const B& b) {
  const Matrix<double> x = a.template cast<double>(), y = b.template cast<double>();
  const double den = y.norm();
  return den > 0 ? (x - y).norm() / den : x.norm();
}

/// The inputs of a Problem in T.
template <class T>
struct Inputs {
  Matrix<T> x, B, C;
  Vector<T> dt;
  T A, D;
  explicit Inputs(const Problem& p)
      : x(p.x.cast<T>()),
        B(p.B.cast<T>()),
        C(p.C.cast<T>()),
        dt(p.dt.cast<T>()),
        A(static_cast<T>(p.A(0, 0))),
        D(static_cast<T>(p.D(0, 0))) {}
};

ssd::Options options(Index chunk, const Problem& p, bool softplus = true) {
  ssd::Options opt;
  opt.chunk = chunk;
  opt.dt_bias = p.bias(0, 0);
  opt.dt_softplus = softplus;
  return opt;
}

/// The chunked forward on a Problem (in T), continuing its h0; returns the outputs and leaves
/// the end state in `st`.
template <class T>
Matrix<T> run_forward(const Problem& p, const ssd::Options& opt, ssd::State<T>& st,
                      ssd::Saved<T>* saved = nullptr) {
  st = ssd::State<T>::empty(p.S(), p.P());
  st.h = p.h0.cast<detail::wide_t<T>>();
  const Inputs<T> in(p);
  return ssd::forward<T>(in.x, in.dt, in.A, in.B, in.C, in.D, opt, &st, saved);
}

/// The chunked backward of run_forward's call.
template <class T>
ssd::Grad<T> run_backward(const Problem& p, const ssd::Options& opt, const Matrix<double>& dY,
                          const Matrix<double>& dh_end, const ssd::Saved<T>& saved) {
  const Inputs<T> in(p);
  ssd::StateGrad<T> gs;
  gs.h = dh_end.cast<detail::wide_t<T>>();
  return ssd::backward<T>(in.x, in.dt, in.A, in.B, in.C, in.D, dY.cast<T>(), saved, opt, &gs);
}

// The shapes of the twin comparisons: chunk lengths below, at and above N, one-row chunks, a
// partial last chunk, d_state != d_head, with and without a start state and the softplus.
struct Case {
  Index N, P, S, chunk;
  bool softplus, state;
};
const Case kCases[] = {{1, 3, 2, 64, true, false},   {37, 5, 4, 8, true, true},
                       {37, 5, 4, 1, false, true},   {64, 8, 6, 64, true, false},
                       {100, 6, 9, 16, false, true}, {130, 16, 16, 64, true, true},
                       {50, 4, 7, 200, true, false}, {150, 48, 32, 32, true, true}};

// ---- exactness against the twin, in double ---------------------------------------------------

// Tolerance 1e-12 relative, normwise: both sides run the same arithmetic in another order (the
// chunked form's products sum C + S terms, the recurrence's carry the decayed state); with every
// decay <= 1 nothing is amplified, so the difference is a few hundred eps (1e-16) at these sizes.
TEST(SsdExact, ForwardEqualsRecurrence) {
  std::uint64_t seed = 100;
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.N << " P " << c.P << " S " << c.S << " chunk "
                                      << c.chunk << " softplus " << c.softplus << " seed " << seed);
    Problem p = random_problem(c.N, c.P, c.S, seed++, c.state);
    p.bias(0, 0) = c.softplus ? 0.3 : 4.5;  // without the softplus: dt + bias >= 0.5
    const ssd::Options opt = options(c.chunk, p, c.softplus);
    const NaiveForward want = naive_forward(p, opt);
    ssd::State<double> st;
    const Matrix<double> out = run_forward<double>(p, opt, st);
    EXPECT_LT(rel_err(out, want.out), 1e-12);
    EXPECT_LT(rel_err(st.h, want.h_end), 1e-12);
    EXPECT_EQ(st.tokens_seen, c.N);
    if (!c.state) {  // without a state the start is zero
      const Inputs<double> in(p);
      const Matrix<double> plain = ssd::forward<double>(in.x, in.dt, in.A, in.B, in.C, in.D, opt);
      EXPECT_LT(rel_err(plain, want.out), 1e-12);
    }
  }
}

// The same tolerance for every gradient (the backward is the same products transposed), with a
// gradient of the end state (as a later piece would give) and a start state.
TEST(SsdExact, BackwardEqualsBackpropagationThroughTheRecurrence) {
  std::uint64_t seed = 200;
  for (const Case& c : kCases) {
    for (const bool keep : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "N " << c.N << " P " << c.P << " S " << c.S << " chunk " << c.chunk
                   << " softplus " << c.softplus << " keep_states " << keep << " seed " << seed);
      Problem p = random_problem(c.N, c.P, c.S, seed++, c.state);
      p.bias(0, 0) = c.softplus ? -0.2 : 4.5;
      ssd::Options opt = options(c.chunk, p, c.softplus);
      opt.keep_states = keep;
      const Matrix<double> dY = random_matrix<double>(c.N, c.P, seed + 50);
      const Matrix<double> dh = random_matrix<double>(c.S, c.P, seed + 51);
      const NaiveGrad want = naive_backward(p, opt, dY, dh);
      ssd::State<double> st;
      ssd::Saved<double> saved;
      run_forward<double>(p, opt, st, &saved);
      const ssd::Grad<double> got = run_backward<double>(p, opt, dY, dh, saved);
      EXPECT_LT(rel_err(got.x, want.x), 1e-12);
      EXPECT_LT(rel_err(got.B, want.B), 1e-12);
      EXPECT_LT(rel_err(got.C, want.C), 1e-12);
      EXPECT_LT(rel_err(got.dt, want.dt), 1e-12);
      EXPECT_NEAR(got.A, want.A, 1e-12 * std::abs(want.A));
      EXPECT_NEAR(got.D, want.D, 1e-12 * std::abs(want.D));
      EXPECT_NEAR(got.dt_bias, want.bias, 1e-12 * want.dt.lpNorm<1>());
      EXPECT_LT(rel_err(got.state.h, want.h0), 1e-12);
    }
  }
}

// ---- central finite differences in double ------------------------------------------------------

// Loss L = sum(W o Y) + <W_h, h_N> through the chunked forward; every input perturbed by h = 1e-6.
// The difference quotient's error is h^2 |L'''| / 6 (~1e-12 here) plus eps |L| / h (|L| ~ 10:
// ~1e-9); 1e-6 relative and 1e-7 absolute leave a margin of 100 over that.
void check_finite_differences(bool softplus, std::uint64_t seed) {
  const Index N = 11, P = 4, S = 3;
  Problem p = random_problem(N, P, S, seed, true);
  p.bias(0, 0) = softplus ? 0.4 : 4.5;
  const Matrix<double> W = random_matrix<double>(N, P, seed + 10);
  const Matrix<double> Wh = random_matrix<double>(S, P, seed + 11);
  const auto loss = [&] {
    ssd::State<double> st;
    const Matrix<double> out = run_forward<double>(p, options(4, p, softplus), st);
    return (out.array() * W.array()).sum() + (st.h.array() * Wh.array()).sum();
  };
  const ssd::Options opt = options(4, p, softplus);  // 3 chunks, the last one partial
  ssd::State<double> st;
  ssd::Saved<double> saved;
  run_forward<double>(p, opt, st, &saved);
  const ssd::Grad<double> gr = run_backward<double>(p, opt, W, Wh, saved);
  const double rtol = 1e-6, atol = 1e-7;
  EXPECT_TRUE(all_close(gr.x, numeric_gradient(p.x, loss), rtol, atol)) << "x";
  EXPECT_TRUE(all_close(gr.dt, numeric_gradient(p.dt, loss), rtol, atol)) << "dt";
  EXPECT_TRUE(all_close(gr.B, numeric_gradient(p.B, loss), rtol, atol)) << "B";
  EXPECT_TRUE(all_close(gr.C, numeric_gradient(p.C, loss), rtol, atol)) << "C";
  const Matrix<double> gA = Matrix<double>::Constant(1, 1, gr.A);
  const Matrix<double> gD = Matrix<double>::Constant(1, 1, gr.D);
  const Matrix<double> gb = Matrix<double>::Constant(1, 1, gr.dt_bias);
  EXPECT_TRUE(all_close(gA, numeric_gradient(p.A, loss), rtol, atol)) << "A";
  EXPECT_TRUE(all_close(gD, numeric_gradient(p.D, loss), rtol, atol)) << "D";
  EXPECT_TRUE(all_close(gb, numeric_gradient(p.bias, loss), rtol, atol)) << "dt_bias";
  EXPECT_TRUE(all_close(gr.state.h, numeric_gradient(p.h0, loss), rtol, atol)) << "state";
  // the twin's backward against the same differences (the oracle itself is checked)
  const NaiveGrad tw = naive_backward(p, opt, W, Wh);
  EXPECT_TRUE(all_close(tw.dt, numeric_gradient(p.dt, loss), rtol, atol)) << "twin dt";
  EXPECT_TRUE(all_close(tw.B, numeric_gradient(p.B, loss), rtol, atol)) << "twin B";
}

TEST(SsdGradient, FiniteDifferencesWithSoftplus) {
  check_finite_differences(true, 300);
}
TEST(SsdGradient, FiniteDifferencesWithoutSoftplus) {
  check_finite_differences(false, 310);
}

// A = 0 (no decay: the chunked form's L is all ones below the diagonal) and a steep step (z = 30,
// where softplus' slope is 1 - 1e-13): the gradients still match the differences (A's against
// the twin: A + h > 0 is refused).
TEST(SsdGradient, FiniteDifferencesAtTheEdges) {
  const Index N = 9, P = 3, S = 2;
  Problem p = random_problem(N, P, S, 320, false);
  p.A(0, 0) = 0;
  p.dt(4) = 30;
  const Matrix<double> W = random_matrix<double>(N, P, 321);
  const auto loss = [&] {
    const Inputs<double> in(p);
    const Matrix<double> out =
        ssd::forward<double>(in.x, in.dt, in.A, in.B, in.C, in.D, options(4, p));
    return (out.array() * W.array()).sum();
  };
  const Inputs<double> in(p);
  const ssd::Options opt = options(4, p);
  ssd::Saved<double> saved;
  ssd::forward<double>(in.x, in.dt, in.A, in.B, in.C, in.D, opt, nullptr, &saved);
  const ssd::Grad<double> gr = ssd::backward(in.x, in.dt, in.A, in.B, in.C, in.D, W, saved, opt);
  EXPECT_TRUE(all_close(gr.dt, numeric_gradient(p.dt, loss), 1e-6, 1e-7));
  EXPECT_TRUE(all_close(gr.B, numeric_gradient(p.B, loss), 1e-6, 1e-7));
  EXPECT_EQ(gr.state.h.size(), 0);  // no state continued: no start-state gradient
  const NaiveGrad tw = naive_backward(p, opt, W, Matrix<double>::Zero(S, P));
  EXPECT_LT(rel_err(gr.x, tw.x), 1e-12);
  EXPECT_LT(rel_err(gr.dt, tw.dt), 1e-12);
  EXPECT_NEAR(gr.A, tw.A, 1e-12 * std::abs(tw.A));  // A = 0 + h would be refused: the twin's
}

// ---- float against the twin ------------------------------------------------------------------

// Normwise relative tolerance of float results: float's own arithmetic (eps 6e-8) on the chunk's
// products, whose sums have C + S terms of O(1) with the wide state between chunks; 1e-5 leaves
// a margin of about 50 over the few 1e-7 this shape shows.
constexpr double kFloatTol = 1e-5;

TEST(SsdFloat, ForwardAndBackwardAgreeWithTheDoubleTwin) {
  const Index N = 150, P = 12, S = 10;
  const Problem p = random_problem(N, P, S, 400, true);
  const ssd::Options opt = options(32, p);
  const Matrix<double> dY = random_matrix<double>(N, P, 401);
  const Matrix<double> dh = random_matrix<double>(S, P, 402);
  const NaiveForward want = naive_forward(p, opt);
  const NaiveGrad wg = naive_backward(p, opt, dY, dh);
  ssd::State<float> st;
  ssd::Saved<float> saved;
  const Matrix<float> out = run_forward<float>(p, opt, st, &saved);
  EXPECT_LT(rel_err(out, want.out), kFloatTol);
  EXPECT_LT(rel_err(st.h, want.h_end), kFloatTol);
  const ssd::Grad<float> gr = run_backward<float>(p, opt, dY, dh, saved);
  EXPECT_LT(rel_err(gr.x, wg.x), kFloatTol);
  EXPECT_LT(rel_err(gr.B, wg.B), kFloatTol);
  EXPECT_LT(rel_err(gr.C, wg.C), kFloatTol);
  EXPECT_LT(rel_err(gr.dt, wg.dt), kFloatTol);
  EXPECT_NEAR(gr.A, wg.A, kFloatTol * std::abs(wg.A));
  EXPECT_NEAR(gr.D, wg.D, kFloatTol * std::abs(wg.D));
  EXPECT_LT(rel_err(gr.state.h, wg.h0), kFloatTol);
}

// ---- pieces, decoding, records ------------------------------------------------------------------

template <class T>
class SsdTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SsdTyped, Scalars);

/// Pieces (and whole-sequence calls) are the same arithmetic in another order: double to 1e-12,
/// float to kFloatTol, normwise.
template <class T>
double piece_tol() {
  return std::is_same<T, double>::value ? 1e-12 : kFloatTol;
}

/// Random cut points: pieces of 1 .. max_piece rows covering [0, n).
std::vector<Index> random_pieces(Index n, Index max_piece, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Index> sizes;
  for (Index done = 0; done < n;) {
    const Index len = std::min<Index>(n - done, 1 + static_cast<Index>(rng() % max_piece));
    sizes.push_back(len);
    done += len;
  }
  return sizes;
}

// Forward in pieces (pieces of up to 16 rows without a record take the token-by-token path;
// longer ones and pieces with a record the chunked form) gives the one-call outputs and state.
TYPED_TEST(SsdTyped, AnyPiecesGiveTheOneCallOutputsAndState) {
  using T = TypeParam;
  const Index N = 150, P = 7, S = 5;
  const Problem p = random_problem(N, P, S, 500, true);
  const Inputs<T> in(p);
  const ssd::Options opt = options(16, p);
  ssd::State<T> whole_state;
  const Matrix<T> whole = run_forward<T>(p, opt, whole_state);
  std::vector<std::vector<Index>> splits = {std::vector<Index>(N, 1), {N}, {1, N - 1}, {40, 110}};
  for (std::uint64_t seed = 0; seed < 4; ++seed) splits.push_back(random_pieces(N, 40, seed));
  for (const auto& sizes : splits) {
    for (const bool with_record : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << sizes.size() << " pieces, first " << sizes[0] << ", record " << with_record);
      ssd::State<T> st = ssd::State<T>::empty(S, P);
      st.h = p.h0.cast<detail::wide_t<T>>();
      Matrix<T> out(N, P);
      Index at = 0;
      for (const Index n : sizes) {
        ssd::Saved<T> saved;
        out.middleRows(at, n) = ssd::forward<T>(in.x.middleRows(at, n), in.dt.segment(at, n), in.A,
                                                in.B.middleRows(at, n), in.C.middleRows(at, n),
                                                in.D, opt, &st, with_record ? &saved : nullptr);
        at += n;
      }
      EXPECT_LT(rel_err(out, whole), piece_tol<T>());
      EXPECT_LT(rel_err(st.h, whole_state.h), piece_tol<T>());
      EXPECT_EQ(st.tokens_seen, N);
    }
  }
}

// Decoding: forward_into on one row at a time with a reused output, no record, equals the
// one-call forward, and so does the twin.
TYPED_TEST(SsdTyped, DecodingTokenByTokenEqualsTheForward) {
  using T = TypeParam;
  const Index N = 90, P = 16, S = 8;
  const Problem p = random_problem(N, P, S, 510, false);
  const Inputs<T> in(p);
  const ssd::Options opt;
  const Matrix<T> whole = ssd::forward<T>(in.x, in.dt, in.A, in.B, in.C, in.D, opt);
  ssd::State<T> st = ssd::State<T>::empty(S, P);
  Matrix<T> row, out(N, P);
  for (Index t = 0; t < N; ++t) {
    ssd::forward_into(row, in.x.row(t), in.dt.segment(t, 1), in.A, in.B.row(t), in.C.row(t), in.D,
                      opt, &st, nullptr);
    out.row(t) = row;
  }
  EXPECT_LT(rel_err(out, whole), piece_tol<T>());
  EXPECT_LT(rel_err(out, naive_forward(p, opt).out), piece_tol<T>());
  EXPECT_LT(rel_err(st.h, naive_forward(p, opt).h_end), piece_tol<T>());
}

// Backward over pieces: each piece's forward with its own record, the backwards in reverse, each
// given its successor's grad.state (one Grad reused, grad_state_out = grad.state itself), give the
// one call's gradients (dA, dD and d dt_bias summed over the pieces), and the first piece's
// grad.state is the one call's start-state gradient.
TYPED_TEST(SsdTyped, PiecesBackwardGiveTheOneCallGradients) {
  using T = TypeParam;
  const Index N = 120, P = 6, S = 5;
  Problem p = random_problem(N, P, S, 520, true);
  p.bias(0, 0) = 0.25;
  const Inputs<T> in(p);
  for (const bool keep : {false, true}) {
    ssd::Options opt = options(16, p);
    opt.keep_states = keep;
    const Matrix<double> dY = random_matrix<double>(N, P, 521);
    const Matrix<T> dYt = dY.cast<T>();
    const Matrix<double> dh = random_matrix<double>(S, P, 522);
    ssd::State<T> st;
    ssd::Saved<T> saved;
    run_forward<T>(p, opt, st, &saved);
    const ssd::Grad<T> whole = run_backward<T>(p, opt, dY, dh, saved);
    for (std::uint64_t seed = 0; seed < 3; ++seed) {
      const std::vector<Index> sizes = random_pieces(N, 45, seed);
      SCOPED_TRACE(::testing::Message() << sizes.size() << " pieces, keep_states " << keep);
      st = ssd::State<T>::empty(S, P);
      st.h = p.h0.cast<detail::wide_t<T>>();
      std::vector<ssd::Saved<T>> recs(sizes.size());
      std::vector<Index> at(sizes.size() + 1, 0);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        at[i + 1] = at[i] + sizes[i];
        const Index a = at[i], n = sizes[i];
        ssd::forward<T>(in.x.middleRows(a, n), in.dt.segment(a, n), in.A, in.B.middleRows(a, n),
                        in.C.middleRows(a, n), in.D, opt, &st, &recs[i]);
      }
      ssd::Grad<T> gr;
      gr.state.h = dh.cast<detail::wide_t<T>>();
      Matrix<T> dx(N, P), dB(N, S), dC(N, S);
      Vector<T> ddt(N);
      Vector<double> scalars = Vector<double>::Zero(3);  // dA, dD, d dt_bias
      for (std::size_t i = sizes.size(); i-- > 0;) {
        const Index a = at[i], n = sizes[i];
        ssd::backward_into(gr, in.x.middleRows(a, n), in.dt.segment(a, n), in.A,
                           in.B.middleRows(a, n), in.C.middleRows(a, n), in.D, dYt.middleRows(a, n),
                           recs[i], opt, &gr.state);
        dx.middleRows(a, n) = gr.x;
        dB.middleRows(a, n) = gr.B;
        dC.middleRows(a, n) = gr.C;
        ddt.segment(a, n) = gr.dt;
        scalars += Vector<double>(Eigen::Vector3d(gr.A, gr.D, gr.dt_bias));
      }
      EXPECT_LT(rel_err(dx, whole.x), piece_tol<T>());
      EXPECT_LT(rel_err(dB, whole.B), piece_tol<T>());
      EXPECT_LT(rel_err(dC, whole.C), piece_tol<T>());
      EXPECT_LT(rel_err(ddt, whole.dt), piece_tol<T>());
      EXPECT_LT(rel_err(scalars, Eigen::Vector3d(whole.A, whole.D, whole.dt_bias)), piece_tol<T>());
      EXPECT_LT(rel_err(gr.state.h, whole.state.h), piece_tol<T>());
    }
  }
}

// keep_states only chooses where the chunks' start states come from: the backward recomputes
// them with the forward's own operations, so the gradients are the same bits.
TYPED_TEST(SsdTyped, KeptAndRecomputedStatesGiveTheSameBits) {
  using T = TypeParam;
  const Index N = 200, P = 8, S = 8;
  const Problem p = random_problem(N, P, S, 530, true);
  const Matrix<double> dY = random_matrix<double>(N, P, 531);
  const Matrix<double> dh = random_matrix<double>(S, P, 532);
  ssd::Grad<T> grads[2];
  for (const bool keep : {false, true}) {
    ssd::Options opt = options(64, p);
    opt.keep_states = keep;
    ssd::State<T> st;
    ssd::Saved<T> saved;
    run_forward<T>(p, opt, st, &saved);
    EXPECT_EQ(saved.states.rows(), keep ? 4 * S : 0);
    grads[keep] = run_backward<T>(p, opt, dY, dh, saved);
  }
  EXPECT_TRUE(grads[0].x == grads[1].x && grads[0].B == grads[1].B && grads[0].C == grads[1].C);
  EXPECT_TRUE(grads[0].dt == grads[1].dt && grads[0].A == grads[1].A);
  EXPECT_TRUE(grads[0].state.h == grads[1].state.h);
}

// The value-returning and the _into forms run one body: the same bits, with records reused
// across calls of other shapes.
TYPED_TEST(SsdTyped, IntoFormsEqualValueForms) {
  using T = TypeParam;
  const ssd::Options opt;
  Matrix<T> out;
  ssd::Saved<T> saved;
  ssd::Grad<T> grad;
  for (const Index N : {70, 5, 130}) {
    const Problem p = random_problem(N, 8, 4, 540 + N, false);
    const Inputs<T> in(p);
    const Matrix<T> dY = random_matrix<T>(N, 8, 541);
    ssd::Saved<T> fresh;
    const Matrix<T> want =
        ssd::forward<T>(in.x, in.dt, in.A, in.B, in.C, in.D, opt, nullptr, &fresh);
    ssd::forward_into(out, in.x, in.dt, in.A, in.B, in.C, in.D, opt, nullptr, &saved);
    EXPECT_TRUE(out == want);
    const ssd::Grad<T> wg = ssd::backward(in.x, in.dt, in.A, in.B, in.C, in.D, dY, fresh, opt);
    ssd::backward_into(grad, in.x, in.dt, in.A, in.B, in.C, in.D, dY, saved, opt);
    EXPECT_TRUE(grad.x == wg.x && grad.B == wg.B && grad.C == wg.C && grad.dt == wg.dt);
    EXPECT_TRUE(grad.A == wg.A && grad.D == wg.D && grad.dt_bias == wg.dt_bias);
    // a forward without a record gives the same outputs
    EXPECT_TRUE(ssd::forward<T>(in.x, in.dt, in.A, in.B, in.C, in.D, opt) == want);
  }
}

// N = 0: an empty output, the state unchanged, empty gradients.
TYPED_TEST(SsdTyped, EmptySequence) {
  using T = TypeParam;
  const Matrix<T> x(0, 4), B(0, 3);
  const Vector<T> dt(0);
  ssd::State<T> st = ssd::State<T>::empty(3, 4);
  st.h.setConstant(0.5);
  ssd::Saved<T> saved;
  const Matrix<T> out = ssd::forward<T>(x, dt, T(-1), B, B, T(1), {}, &st, &saved);
  EXPECT_EQ(out.rows(), 0);
  EXPECT_EQ(out.cols(), 4);
  EXPECT_TRUE((st.h.array() == 0.5).all());
  ssd::StateGrad<T> gs;
  gs.h = Matrix<detail::wide_t<T>>::Constant(3, 4, 2.0);
  const ssd::Grad<T> gr = ssd::backward(x, dt, T(-1), B, B, T(1), x, saved, {}, &gs);
  EXPECT_EQ(gr.x.rows(), 0);
  EXPECT_EQ(gr.dt.size(), 0);
  EXPECT_EQ(gr.A, T(0));
  EXPECT_TRUE(gr.state.h == gs.h);  // the end state is the start state
}

// ---- packed batches
// -------------------------------------------------------------------------------

/// Raw steps of a packed call, H x total, in [-4, 2].
template <class T>
Matrix<T> random_steps(Index heads, Index total, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  Matrix<T> dt(heads, total);
  for (Index h = 0; h < heads; ++h)
    for (Index t = 0; t < total; ++t) dt(h, t) = static_cast<T>(-4.0 + 6.0 * u(rng));
  return dt;
}

// A packed call (cu_seqlens offsets, H heads side by side, dt H x total, A and D per head) is one
// call of the single-sequence operator per (sequence, head): the same bits as the separate calls
// for the outputs, the end states, every gradient and the start states' gradients, with and
// without states, on one and two threads, empty sequences included; dA, dD and d dt_bias of a
// head are the separate calls' summed in sequence order.
TYPED_TEST(SsdTyped, PackedEqualsSeparateCalls) {
  using T = TypeParam;
  using W = detail::wide_t<T>;
  const Index H = 2, P = 5, S = 3;
  const Offsets off = {0, 37, 37, 100, 101};
  const Index total = off.back(), nb = static_cast<Index>(off.size()) - 1;
  const Matrix<T> x = random_matrix<T>(total, H * P, 600), dY = random_matrix<T>(total, H * P, 603);
  const Matrix<T> B = random_matrix<T>(total, H * S, 601), C = random_matrix<T>(total, H * S, 602);
  const Matrix<T> dt = random_steps<T>(H, total, 604);
  const std::vector<T> A = {T(-0.5), T(-1.25)}, D = {T(0.75), T(-0.25)};
  ssd::Options opt;
  opt.chunk = 16;
  opt.dt_bias = 0.3;
  for (const bool with_states : {false, true}) {
    for (const int threads : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "states " << with_states << " threads " << threads);
      std::vector<ssd::State<T>> states;
      std::vector<ssd::StateGrad<T>> dh(static_cast<std::size_t>(nb * H));
      for (Index i = 0; i < nb * H; ++i) {
        states.push_back(ssd::State<T>::empty(S, P));
        states.back().h = random_matrix<W>(S, P, 610 + i, 0.5);
        dh[static_cast<std::size_t>(i)].h = random_matrix<W>(S, P, 630 + i);
      }
      const std::vector<ssd::State<T>> start = states;
      Matrix<T> out;
      ssd::PackedSaved<T> saved;
      ssd::PackedGrad<T> grad;
      ssd::forward_packed_into(out, H, x, dt, A, B, C, D, off, opt, with_states ? &states : nullptr,
                               &saved, threads);
      ssd::backward_packed_into(grad, H, x, dt, A, B, C, D, dY, off, saved, opt,
                                with_states ? &dh : nullptr, threads);
      ASSERT_EQ(out.rows(), total);
      ASSERT_EQ(grad.dt.rows(), H);
      std::vector<T> sums(3 * H, T(0));
      for (Index b = 0; b < nb; ++b) {
        for (Index h = 0; h < H; ++h) {
          const std::size_t i = static_cast<std::size_t>(b * H + h),
                            hh = static_cast<std::size_t>(h);
          const Index a = off[static_cast<std::size_t>(b)];
          const Index n = off[static_cast<std::size_t>(b) + 1] - a;
          ssd::State<T> st = start[i];
          ssd::Saved<T> rec;
          const auto xs = x.block(a, h * P, n, P), dys = dY.block(a, h * P, n, P);
          const auto bs = B.block(a, h * S, n, S), cs = C.block(a, h * S, n, S);
          const Matrix<T> o = ssd::forward<T>(xs, dt.row(h).segment(a, n), A[hh], bs, cs, D[hh],
                                              opt, with_states ? &st : nullptr, &rec);
          EXPECT_TRUE(out.block(a, h * P, n, P) == o) << "item " << i;
          if (with_states) {
            EXPECT_TRUE(states[i].h == st.h) << "item " << i;
            EXPECT_EQ(states[i].tokens_seen, n);
          }
          const ssd::Grad<T> gr =
              ssd::backward<T>(xs, dt.row(h).segment(a, n), A[hh], bs, cs, D[hh], dys, rec, opt,
                               with_states ? &dh[i] : nullptr);
          EXPECT_TRUE(grad.x.block(a, h * P, n, P) == gr.x) << "item " << i;
          EXPECT_TRUE(grad.B.block(a, h * S, n, S) == gr.B) << "item " << i;
          EXPECT_TRUE(grad.C.block(a, h * S, n, S) == gr.C) << "item " << i;
          EXPECT_TRUE(grad.dt.row(h).segment(a, n).transpose() == gr.dt) << "item " << i;
          EXPECT_TRUE(grad.items[i].state.h == gr.state.h) << "item " << i;
          sums[3 * hh] += gr.A;
          sums[3 * hh + 1] += gr.D;
          sums[3 * hh + 2] += gr.dt_bias;
        }
      }
      for (std::size_t h = 0; h < static_cast<std::size_t>(H); ++h) {
        EXPECT_EQ(grad.A[h], sums[3 * h]);
        EXPECT_EQ(grad.D[h], sums[3 * h + 1]);
        EXPECT_EQ(grad.dt_bias[h], sums[3 * h + 2]);
      }
    }
  }
}

TEST(SsdPacked, ErrorsNameTheArgument) {
  const Index H = 2, P = 4, S = 3;
  const Offsets off = {0, 5, 9};
  const Matrix<double> x = random_matrix<double>(9, H * P, 660);
  const Matrix<double> B = random_matrix<double>(9, H * S, 661);
  const Matrix<double> dt = random_steps<double>(H, 9, 662);
  const std::vector<double> A = {-1, -2}, D = {1, 1};
  const char* fn = "mixattn::ssd::forward_packed_into";
  Matrix<double> out;
  using IA = std::invalid_argument;
  expect_throw<IA>(
      [&] {
        ssd::forward_packed_into(out, H, x, dt.topRows(1), A, B, B, D, off, {}, nullptr, nullptr);
      },
      {fn, "dt is 1 x 9", "2 x 9"});
  expect_throw<IA>(
      [&] {
        ssd::forward_packed_into(out, H, x, dt, A, B, B.leftCols(5), D, off, {}, nullptr, nullptr);
      },
      {fn, "C is 9 x 5", "B is 9 x 6"});
  expect_throw<IA>(
      [&] { ssd::forward_packed_into(out, H, x, dt, {-1.0}, B, B, D, off, {}, nullptr, nullptr); },
      {fn, "A has 1", "2 heads"});
  std::vector<ssd::State<double>> states(3, ssd::State<double>::empty(S, P));
  expect_throw<IA>(
      [&] { ssd::forward_packed_into(out, H, x, dt, A, B, B, D, off, {}, &states, nullptr); },
      {fn, "states has 3 entries", "need 4"});
  expect_throw<IA>(
      [&] {
        ssd::forward_packed_into(out, H, x, dt, A, B, B, D, {0, 5, 10}, {}, nullptr, nullptr);
      },
      {fn, "offsets"});
  ssd::PackedSaved<double> saved;
  ssd::forward_packed_into(out, H, x, dt, A, B, B, D, off, {}, nullptr, &saved);
  ssd::PackedGrad<double> grad;
  expect_throw<IA>(
      [&] {
        ssd::backward_packed_into(grad, H, x, dt, A, B, B, D, out, {0, 4, 9}, saved, {});
      },
      {"mixattn::ssd::backward_packed_into", "saved holds"});
}

// ---- errors
// ---------------------------------------------------------------------------------------

TEST(SsdErrors, ShapesAndOptionsAreNamed) {
  const Index N = 6, P = 4, S = 3;
  const Matrix<double> x = random_matrix<double>(N, P, 1), B = random_matrix<double>(N, S, 2);
  const Vector<double> dt = Vector<double>::Constant(N, 0.1);
  const char* fn = "mixattn::ssd::forward";
  const auto fwd = [&](const Matrix<double>& x_, const Vector<double>& dt_,
                       const Matrix<double>& B_, const Matrix<double>& C_,
                       const ssd::Options& o = {}) {
    return [=] { ssd::forward<double>(x_, dt_, -1.0, B_, C_, 0.5, o); };
  };
  using IA = std::invalid_argument;
  expect_throw<IA>(fwd(x, dt.head(5), B, B), {fn, "dt has 5 entries", "x has 6 rows"});
  expect_throw<IA>(fwd(x, dt, B.topRows(5), B), {fn, "B is 5 x 3", "6 rows"});
  expect_throw<IA>(fwd(x, dt, B, B.leftCols(2)), {fn, "C is 6 x 2", "B is 6 x 3", "6 x 3"});
  expect_throw<IA>(fwd(x, dt, B.leftCols(0), B.leftCols(0)), {fn, "B is 6 x 0"});
  expect_throw<IA>(fwd(x.leftCols(0), dt, B, B), {fn, "x has 0 columns"});
  ssd::Options o;
  o.chunk = 0;
  expect_throw<IA>(fwd(x, dt, B, B, o), {fn, "options.chunk is 0"});
  o = {};
  o.dt_bias = std::numeric_limits<double>::infinity();
  expect_throw<IA>(fwd(x, dt, B, B, o), {fn, "options.dt_bias is inf"});
  o.dt_bias = 1e300;
  expect_throw<IA>(
      [&] {
        ssd::forward<float>(x.cast<float>(), dt.cast<float>(), -1.0f, B.cast<float>(),
                            B.cast<float>(), 0.5f, o);
      },
      {fn, "options.dt_bias is 1e+300", "finite in float"});
  ssd::State<double> wrong = ssd::State<double>::empty(S, P + 1);
  expect_throw<IA>([&] { ssd::forward<double>(x, dt, -1.0, B, B, 0.5, {}, &wrong); },
                   {fn, "state.h is 3 x 5", "empty(3, 4)"});
  expect_throw<IA>([] { ssd::State<float>::empty(0, 3); }, {"State::empty", "state_dim is 0"});
  Matrix<double> out;
  expect_throw<IA>(
      [&] { ssd::forward_into(out, x, dt.head(2), -1.0, B, B, 0.5, {}, nullptr, nullptr); },
      {"mixattn::ssd::forward_into", "dt has 2 entries"});
}

TEST(SsdErrors, ValuesOutOfDomainAndNonFinite) {
  const Index N = 6, P = 4, S = 3;
  const Matrix<float> x = random_matrix<float>(N, P, 1), B = random_matrix<float>(N, S, 2);
  const Vector<float> dt = Vector<float>::Constant(N, 0.1f);
  using DE = std::domain_error;
  const char* fn = "mixattn::ssd::forward";
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, 0.5f, B, B, 1.0f); },
                   {fn, "A is 0.5", "A must be <= 0", "A = -exp(A_log)"});
  ssd::Options raw;
  raw.dt_softplus = false;
  raw.dt_bias = -0.5;
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, -1.0f, B, B, 1.0f, raw); },
                   {fn, "dt + dt_bias is -0.4", "row 0 of 6", "must be >= 0"});
  raw.dt_bias = 0;  // a zero step and A = 0 are in the domain
  EXPECT_NO_THROW(ssd::forward<float>(x, Vector<float>::Zero(N), 0.0f, B, B, 1.0f, raw));
  // negative raw steps are what the softplus is for
  EXPECT_NO_THROW(ssd::forward<float>(x, Vector<float>::Constant(N, -3.0f), -1.0f, B, B, 1.0f));
  Matrix<float> nan = B;
  nan(4, 1) = std::numeric_limits<float>::quiet_NaN();
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, -1.0f, B, nan, 1.0f); },
                   {fn, "C has a non-finite entry at (4, 1)"});
  Vector<float> bad = dt;
  bad(1) = std::numeric_limits<float>::infinity();
  expect_throw<DE>([&] { ssd::forward<float>(x, bad, -1.0f, B, B, 1.0f); },
                   {fn, "dt has a non-finite"});
  const float inf = std::numeric_limits<float>::infinity();
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, -inf, B, B, 1.0f); }, {fn, "A is -inf"});
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, -1.0f, B, B, inf); }, {fn, "D is inf"});
  ssd::Options off;
  off.check_finite = false;
  EXPECT_NO_THROW(ssd::forward<float>(x, dt, -1.0f, B, nan, 1.0f, off));
  // a non-finite state, and the state untouched by a refused call
  ssd::State<float> st = ssd::State<float>::empty(S, P);
  ssd::forward<float>(x, dt, -1.0f, B, B, 1.0f, {}, &st);
  const ssd::State<float> before = st;
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, -1.0f, nan, B, 1.0f, {}, &st); }, {"B"});
  EXPECT_TRUE(st.h == before.h && st.tokens_seen == before.tokens_seen);
  ssd::State<float> nan_state = st;
  nan_state.h(1, 1) = std::numeric_limits<double>::infinity();
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, -1.0f, B, B, 1.0f, {}, &nan_state); },
                   {fn, "state.h has a non-finite entry at (1, 1)"});
  // the same refusal on every path: decoding one token, an empty piece, the chunked form
  for (const Index rows : {1, 0}) {
    expect_throw<DE>(
        [&] {
          ssd::forward<float>(x.topRows(rows), dt.head(rows), -1.0f, B.topRows(rows),
                              B.topRows(rows), 1.0f, {}, &nan_state);
        },
        {fn, "state.h has a non-finite entry at (1, 1)"});
  }
  ssd::Saved<float> rec;
  expect_throw<DE>([&] { ssd::forward<float>(x, dt, -1.0f, B, B, 1.0f, {}, &nan_state, &rec); },
                   {fn, "state.h has a non-finite entry at (1, 1)"});
  // an output that overflows float although every input is finite
  const Matrix<float> huge = Matrix<float>::Constant(N, P, 3e38f);
  expect_throw<DE>([&] { ssd::forward<float>(huge, dt, -1.0f, B, B, 2.0f); },
                   {fn, "overflows float"});
}

TEST(SsdErrors, RecordsAreRefusedForOtherData) {
  const Index N = 20, P = 4, S = 3;
  const Problem p = random_problem(N, P, S, 600, false);
  const Inputs<double> in(p);
  const Matrix<double> dY = random_matrix<double>(N, P, 601);
  const ssd::Options opt = options(8, p);
  ssd::Saved<double> saved;
  ssd::forward<double>(in.x, in.dt, in.A, in.B, in.C, in.D, opt, nullptr, &saved);
  const char* fn = "mixattn::ssd::backward";
  using IA = std::invalid_argument;
  const auto bwd = [&](const Inputs<double>& v, const ssd::Options& o) {
    return [&, v, o] { ssd::backward(v.x, v.dt, v.A, v.B, v.C, v.D, dY, saved, o); };
  };
  EXPECT_NO_THROW(bwd(in, opt)());
  const char* names[] = {"x", "dt", "A", "B", "C", "D"};
  for (int which = 0; which < 6; ++which) {
    Inputs<double> other = in;
    switch (which) {
      case 0:
        other.x(3, 1) += 1;
        break;
      case 1:
        other.dt(3) -= 0.5;
        break;
      case 2:
        other.A *= 0.5;
        break;
      case 3:
        other.B(3, 1) += 1;
        break;
      case 4:
        other.C(3, 1) += 1;
        break;
      default:
        other.D += 1;
        break;
    }
    expect_throw<IA>(bwd(other, opt), {fn, "saved came from other data", names[which]});
  }
  ssd::Options other_opt = opt;
  other_opt.chunk = 4;
  expect_throw<IA>(bwd(in, other_opt), {fn, "saved was made with chunk = 8"});
  other_opt = opt;
  other_opt.dt_bias = 0.5;
  expect_throw<IA>(bwd(in, other_opt), {fn, "dt_bias = 0.5"});
  other_opt = opt;
  other_opt.keep_states = true;
  expect_throw<IA>(bwd(in, other_opt), {fn, "keep_states = 0"});
  ssd::Saved<double> empty;
  expect_throw<IA>([&] { ssd::backward(in.x, in.dt, in.A, in.B, in.C, in.D, dY, empty, opt); },
                   {fn, "saved was not filled by forward"});
  expect_throw<IA>(
      [&] {
        ssd::backward(in.x, in.dt, in.A, in.B, in.C, in.D, Matrix<double>(dY.topRows(5)), saved,
                      opt);
      },
      {fn, "grad_out is 5 x 4", "20 x 4"});
  // a gradient of the end state needs a continued forward, of this state
  ssd::StateGrad<double> gs;
  gs.h = Matrix<double>::Zero(S, P);
  expect_throw<IA>([&] { ssd::backward(in.x, in.dt, in.A, in.B, in.C, in.D, dY, saved, opt, &gs); },
                   {fn, "grad_state_out is given but saved is from a forward without a State"});
  ssd::State<double> st = ssd::State<double>::empty(S, P);
  ssd::Saved<double> first, second;
  const auto piece = [&](Index a, ssd::Saved<double>& rec) {
    ssd::forward<double>(in.x.middleRows(a, 10), in.dt.segment(a, 10), in.A, in.B.middleRows(a, 10),
                         in.C.middleRows(a, 10), in.D, opt, &st, &rec);
  };
  const auto back = [&](Index a, const ssd::Saved<double>& rec, const ssd::StateGrad<double>* g) {
    return ssd::backward(in.x.middleRows(a, 10), in.dt.segment(a, 10), in.A, in.B.middleRows(a, 10),
                         in.C.middleRows(a, 10), in.D, dY.middleRows(a, 10), rec, opt, g);
  };
  piece(0, first);
  piece(10, second);
  const ssd::Grad<double> g2 = back(10, second, nullptr);
  EXPECT_NO_THROW(back(0, first, &g2.state));
  // the first piece's own grad.state is the gradient of another state (its start)
  const ssd::Grad<double> g1 = back(0, first, nullptr);
  expect_throw<IA>([&] { back(0, first, &g1.state); }, {fn, "grad_state_out came from other data"});
  // the record keeps the start state: another start state is other data
  ssd::Saved<double> changed = second;
  changed.start_h(0, 0) += 1;
  expect_throw<IA>([&] { back(10, changed, nullptr); }, {fn, "the start state"});
}

// ---- steady state
// ----------------------------------------------------------------------------------

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

// A training step through the _into forms (forward with a record, backward into a reused Grad)
// and a decoding step allocate nothing once their shapes have been seen, at the default options
// and with keep_states; d = 128 and N = 1000 (15 full chunks and a partial one) make Eigen's GEMM
// pack more than 128 KiB where a product is large enough.
TYPED_TEST(SsdTyped, SteadyStateAllocatesNothing) {
  using T = TypeParam;
  const Index N = 1000, d = 128;
  const Problem p = random_problem(N, d, d, 700, false);
  const Inputs<T> in(p);
  const Matrix<T> dY = random_matrix<T>(N, d, 701);
  for (const bool keep : {false, true}) {
    ssd::Options opt;
    opt.keep_states = keep;
    Matrix<T> out;
    ssd::Saved<T> saved;
    ssd::Grad<T> grad;
    ssd::State<T> st = ssd::State<T>::empty(d, d);
    const auto step = [&] {
      ssd::forward_into(out, in.x, in.dt, in.A, in.B, in.C, in.D, opt, &st, &saved);
      ssd::backward_into(grad, in.x, in.dt, in.A, in.B, in.C, in.D, dY, saved, opt);
    };
    step();
    EXPECT_EQ(allocations_of(step), 0) << "keep_states " << keep;
    Matrix<T> row;
    const auto decode = [&](Index t) {
      ssd::forward_into(row, in.x.row(t), in.dt.segment(t, 1), in.A, in.B.row(t), in.C.row(t), in.D,
                        opt, &st, nullptr);
    };
    decode(0);
    EXPECT_EQ(allocations_of([&] { decode(1); }), 0);
  }
  // a packed training step of three sequences with states (one thread)
  const Offsets off = {0, N / 4, N / 4, N};
  Matrix<T> dt(1, N);
  dt.row(0) = in.dt.transpose();
  const std::vector<T> A = {in.A}, D = {in.D};
  std::vector<ssd::State<T>> states(3, ssd::State<T>::empty(d, d));
  Matrix<T> pout;
  ssd::PackedSaved<T> psaved;
  ssd::PackedGrad<T> pgrad;
  const ssd::Options opt;
  const auto packed_step = [&] {
    ssd::forward_packed_into(pout, 1, in.x, dt, A, in.B, in.C, D, off, opt, &states, &psaved);
    ssd::backward_packed_into(pgrad, 1, in.x, dt, A, in.B, in.C, D, dY, off, psaved, opt);
  };
  packed_step();
  EXPECT_EQ(allocations_of(packed_step), 0) << "packed";
}

}  // namespace
