// The gated delta rule (SPEC §9): the chunked forward and backward against their slow, obvious
// twin (the recurrence token by token in double, with its backward through time written out),
// central finite differences for every input, the state over pieces of a sequence and through
// decoding, the records, the errors, and the steady state of the `_into` forms.
#include "counting_heap.hpp"

#include "test_util.hpp"

#include <mixattn/delta.hpp>
#include <mixattn/packed.hpp>

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

// ---- the slow twin: the recurrence of SPEC 9.1, token by token, in double -----------------------

/// One head's inputs in double; S0 is the start state (d_k x d_v; zero when none is continued).
struct Problem {
  Matrix<double> q, k, v;
  Vector<double> g, beta;
  Matrix<double> S0;
  Index dk() const { return q.cols(); }
  Index dv() const { return v.cols(); }
  Index n() const { return q.rows(); }
};

/// Log decays in [-g_max, -g_min] (a few of them much stronger, -30, where e^gamma underflows a
/// chunk's float products: Gamma must come from differences), beta in [0.05, 0.95].
Problem random_problem(Index N, Index dk, Index dv, std::uint64_t seed, bool with_state,
                       double key_scale = 1.0) {
  Problem p;
  p.q = random_matrix<double>(N, dk, seed);
  p.k = random_matrix<double>(N, dk, seed + 1, key_scale);
  p.v = random_matrix<double>(N, dv, seed + 2);
  std::mt19937_64 rng(seed + 3);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  p.g.resize(N);
  p.beta.resize(N);
  for (Index t = 0; t < N; ++t) {
    p.g(t) = (t % 17 == 5) ? -30.0 : -(0.01 + 1.5 * u(rng));
    p.beta(t) = 0.05 + 0.9 * u(rng);
  }
  p.S0 = with_state ? random_matrix<double>(dk, dv, seed + 4, 0.5) : Matrix<double>::Zero(dk, dv);
  return p;
}

double resolved_scale(const delta::Options& opt, Index dk) {
  return opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(dk));
}

/// q~_t = scale q^_t and k^_t (SPEC 9.1), with the inverse norms.
struct Normalised {
  Matrix<double> q, k;
  Vector<double> inv_q, inv_k;
};

Normalised normalise(const Problem& p, const delta::Options& opt) {
  Normalised n{p.q, p.k, Vector<double>::Ones(p.n()), Vector<double>::Ones(p.n())};
  for (Index t = 0; t < p.n(); ++t) {
    if (opt.normalize) {
      n.inv_q(t) = 1 / std::sqrt(p.q.row(t).squaredNorm() + opt.norm_eps);
      n.inv_k(t) = 1 / std::sqrt(p.k.row(t).squaredNorm() + opt.norm_eps);
    }
    n.q.row(t) = p.q.row(t) * n.inv_q(t) * resolved_scale(opt, p.dk());
    n.k.row(t) = p.k.row(t) * n.inv_k(t);
  }
  return n;
}

struct NaiveForward {
  Matrix<double> out, S_end;
  std::vector<Matrix<double>> S;  // S_0 ... S_N
};

/// S_t = e^g_t (I - beta_t k_t k_t^T) S_t-1 + beta_t k_t v_t^T, o_t = S_t^T q~_t, as written.
NaiveForward naive_forward(const Problem& p, const delta::Options& opt) {
  const Normalised x = normalise(p, opt);
  const Index N = p.n(), dk = p.dk();
  NaiveForward f;
  f.out.resize(N, p.dv());
  f.S.push_back(p.S0);
  const Matrix<double> I = Matrix<double>::Identity(dk, dk);
  for (Index t = 0; t < N; ++t) {
    const Vector<double> k = x.k.row(t).transpose(), q = x.q.row(t).transpose();
    const Matrix<double> S = std::exp(p.g(t)) * (I - p.beta(t) * k * k.transpose()) * f.S.back() +
                             p.beta(t) * k * p.v.row(t);
    f.out.row(t) = (S.transpose() * q).transpose();
    f.S.push_back(S);
  }
  f.S_end = f.S.back();
  return f;
}

struct NaiveGrad {
  Matrix<double> q, k, v, S0;
  Vector<double> g, beta;
};

/// Backpropagation through time of naive_forward: from dS_N = dS_end, for t = N ... 1,
///   dS_t += q~_t dO_t^T,  dq~_t = S_t dO_t,
///   with S_t = a S_t-1 + k delta^T, delta = b (v - a S_t-1^T k):  ddelta = dS_t^T k,
///   dk += dS_t delta + S_t-1 (-a b ddelta),  dv = b ddelta,  db = ddelta . (v - a S_t-1^T k),
///   da = <dS_t, S_t-1> - b ddelta . (S_t-1^T k),  dg = a da,
///   dS_t-1 = a dS_t - a b k ddelta^T;
/// then through the scale and the normalisation, dx = (dx^ - x^ (x^ . dx^)) / n_x.
NaiveGrad naive_backward(const Problem& p, const delta::Options& opt, const Matrix<double>& dO,
                         const Matrix<double>& dS_end) {
  const Normalised x = normalise(p, opt);
  const NaiveForward f = naive_forward(p, opt);
  const Index N = p.n();
  NaiveGrad gr{Matrix<double>(N, p.dk()), Matrix<double>(N, p.dk()), Matrix<double>(N, p.dv()),
               Matrix<double>(),          Vector<double>(N),         Vector<double>(N)};
  Matrix<double> dS = dS_end;
  for (Index t = N - 1; t >= 0; --t) {
    const Vector<double> k = x.k.row(t).transpose(), q = x.q.row(t).transpose();
    const Vector<double> v = p.v.row(t).transpose(), dout = dO.row(t).transpose();
    const Matrix<double>& Sp = f.S[static_cast<std::size_t>(t)];
    const Matrix<double>& St = f.S[static_cast<std::size_t>(t + 1)];
    const double a = std::exp(p.g(t)), b = p.beta(t);
    dS += q * dout.transpose();
    gr.q.row(t) = (St * dout).transpose();
    const Vector<double> Spk = Sp.transpose() * k;
    const Vector<double> delta = b * (v - a * Spk);
    const Vector<double> dd = dS.transpose() * k;
    gr.k.row(t) = (dS * delta + Sp * (-a * b * dd)).transpose();
    gr.v.row(t) = (b * dd).transpose();
    gr.beta(t) = dd.dot(v - a * Spk);
    gr.g(t) = a * ((dS.array() * Sp.array()).sum() - b * dd.dot(Spk));
    dS = a * dS - a * b * k * dd.transpose();
  }
  gr.S0 = dS;
  const double scale = resolved_scale(opt, p.dk());
  for (Index t = 0; t < N; ++t) {
    gr.q.row(t) *= scale;
    if (!opt.normalize) continue;
    for (Matrix<double>* d : {&gr.q, &gr.k}) {
      const Matrix<double>& raw = d == &gr.q ? p.q : p.k;
      const double inv = d == &gr.q ? x.inv_q(t) : x.inv_k(t);
      const Vector<double> xh = raw.row(t).transpose() * inv;
      const Vector<double> dxh = d->row(t).transpose();
      d->row(t) = ((dxh - xh * xh.dot(dxh)) * inv).transpose();
    }
  }
  return gr;
}

// ---- helpers ------------------------------------------------------------------------------------

/// ||a - b|| / ||b|| (Frobenius), in double.
template <class A, class B>
double rel_err(const A& a, const B& b) {
  const Matrix<double> x = a.template cast<double>(), y = b.template cast<double>();
  const double den = y.norm();
  return den > 0 ? (x - y).norm() / den : x.norm();
}

/// The chunked forward on a Problem (in T), continuing its S0; returns the outputs and leaves
/// the end state in `st`.
template <class T>
Matrix<T> run_forward(const Problem& p, const delta::Options& opt, delta::State<T>& st,
                      delta::Saved<T>* saved = nullptr) {
  st = delta::State<T>::empty(p.dk(), p.dv());
  st.S = p.S0.cast<detail::wide_t<T>>();
  const Matrix<T> q = p.q.cast<T>(), k = p.k.cast<T>(), v = p.v.cast<T>();
  const Vector<T> g = p.g.cast<T>(), b = p.beta.cast<T>();
  return delta::forward<T>(q, k, v, g, b, opt, &st, saved);
}

/// The chunked backward of run_forward's call.
template <class T>
delta::Grad<T> run_backward(const Problem& p, const delta::Options& opt, const Matrix<double>& dO,
                            const Matrix<double>& dS_end, const delta::Saved<T>& saved) {
  const Matrix<T> q = p.q.cast<T>(), k = p.k.cast<T>(), v = p.v.cast<T>();
  const Vector<T> g = p.g.cast<T>(), b = p.beta.cast<T>();
  delta::StateGrad<T> gs;
  gs.S = dS_end.cast<detail::wide_t<T>>();
  return delta::backward<T>(q, k, v, g, b, dO.cast<T>(), saved, opt, &gs);
}

delta::Options options(Index chunk, bool normalize) {
  delta::Options opt;
  opt.chunk = chunk;
  opt.normalize = normalize;
  return opt;
}

// The shapes of the twin comparisons: chunk lengths below, at and above N, one-row chunks, a
// partial last chunk, d_k != d_v, with and without the normalisation and a start state; d_k and
// d_v in whole registers (16, 32, 48) for the register tiles (other widths run Eigen's products),
// with tiles cut short at the end of a chunk (85 = 64 + 21 rows).
struct Case {
  Index N, dk, dv, chunk;
  bool normalize, state;
};
const Case kCases[] = {
    {1, 3, 2, 64, true, false},    {37, 5, 4, 8, true, true},    {37, 5, 4, 1, true, true},
    {64, 8, 6, 64, true, false},   {100, 6, 9, 16, false, true}, {130, 16, 16, 64, true, true},
    {50, 4, 7, 200, false, false}, {85, 32, 48, 64, true, true}, {150, 48, 32, 32, false, true}};

// ---- exactness against the twin, in double ---------------------------------------------------

// Tolerance 1e-12 relative, normwise: both sides run the same arithmetic in another order; the
// chunked form's extra steps are a triangular solve of a well-conditioned unit lower matrix (its
// inverse is a product of the contractions I - beta k k^T in the WY form) and products of C terms,
// so its error is a few hundred eps (1e-16) at these sizes; keys without normalisation are drawn
// with |k|^2 ~ 1 so the recurrence stays a contraction there too.
TEST(DeltaExact, ForwardEqualsRecurrence) {
  std::uint64_t seed = 100;
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message()
                 << "N " << c.N << " dk " << c.dk << " dv " << c.dv << " chunk " << c.chunk
                 << " normalize " << c.normalize << " seed " << seed);
    const Problem p =
        random_problem(c.N, c.dk, c.dv, seed++, c.state, c.normalize ? 1.0 : 1 / std::sqrt(c.dk));
    const delta::Options opt = options(c.chunk, c.normalize);
    const NaiveForward want = naive_forward(p, opt);
    delta::State<double> st;
    const Matrix<double> out = run_forward<double>(p, opt, st);
    EXPECT_LT(rel_err(out, want.out), 1e-12);
    EXPECT_LT(rel_err(st.S, want.S_end), 1e-12);
    EXPECT_EQ(st.tokens_seen, c.N);
    // without a state the start is zero: the same outputs as a zero start state
    if (!c.state) {
      const Matrix<double> plain = delta::forward<double>(p.q, p.k, p.v, p.g, p.beta, opt);
      EXPECT_LT(rel_err(plain, want.out), 1e-12);
    }
  }
}

// The same tolerance for every gradient (the backward is the same products transposed), with a
// gradient of the end state (as a later piece would give) and a start state.
TEST(DeltaExact, BackwardEqualsBackpropagationThroughTheRecurrence) {
  std::uint64_t seed = 200;
  for (const Case& c : kCases) {
    for (const bool keep : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "N " << c.N << " dk " << c.dk << " dv " << c.dv << " chunk " << c.chunk
                   << " normalize " << c.normalize << " keep_states " << keep << " seed " << seed);
      const Problem p =
          random_problem(c.N, c.dk, c.dv, seed++, c.state, c.normalize ? 1.0 : 1 / std::sqrt(c.dk));
      delta::Options opt = options(c.chunk, c.normalize);
      opt.keep_states = keep;
      const Matrix<double> dO = random_matrix<double>(c.N, c.dv, seed + 50);
      const Matrix<double> dS = random_matrix<double>(c.dk, c.dv, seed + 51);
      const NaiveGrad want = naive_backward(p, opt, dO, dS);
      delta::State<double> st;
      delta::Saved<double> saved;
      run_forward<double>(p, opt, st, &saved);
      const delta::Grad<double> got = run_backward<double>(p, opt, dO, dS, saved);
      EXPECT_LT(rel_err(got.q, want.q), 1e-12);
      EXPECT_LT(rel_err(got.k, want.k), 1e-12);
      EXPECT_LT(rel_err(got.v, want.v), 1e-12);
      EXPECT_LT(rel_err(got.g, want.g), 1e-12);
      EXPECT_LT(rel_err(got.beta, want.beta), 1e-12);
      EXPECT_LT(rel_err(got.state.S, want.S0), 1e-12);
    }
  }
}

// ---- central finite differences in double ------------------------------------------------------

// Loss L = sum(W o O) + <W_S, S_N> through the chunked forward; every input perturbed by h = 1e-6.
// The difference quotient's error is h^2 |L'''| / 6 (~1e-12 here) plus eps |L| / h (|L| ~ 10:
// ~1e-9); 1e-6 relative and 1e-7 absolute leave a margin of 100 over that.
void check_finite_differences(bool normalize, std::uint64_t seed) {
  const Index N = 11, dk = 4, dv = 3;
  Problem p = random_problem(N, dk, dv, seed, true, normalize ? 1.0 : 0.5);
  const delta::Options opt = options(4, normalize);  // 3 chunks, the last one partial
  const Matrix<double> W = random_matrix<double>(N, dv, seed + 10);
  const Matrix<double> WS = random_matrix<double>(dk, dv, seed + 11);
  const auto loss = [&] {
    delta::State<double> st;
    const Matrix<double> out = run_forward<double>(p, opt, st);
    return (out.array() * W.array()).sum() + (st.S.array() * WS.array()).sum();
  };
  delta::State<double> st;
  delta::Saved<double> saved;
  run_forward<double>(p, opt, st, &saved);
  const delta::Grad<double> gr = run_backward<double>(p, opt, W, WS, saved);
  const double rtol = 1e-6, atol = 1e-7;
  EXPECT_TRUE(all_close(gr.q, numeric_gradient(p.q, loss), rtol, atol)) << "q";
  EXPECT_TRUE(all_close(gr.k, numeric_gradient(p.k, loss), rtol, atol)) << "k";
  EXPECT_TRUE(all_close(gr.v, numeric_gradient(p.v, loss), rtol, atol)) << "v";
  EXPECT_TRUE(all_close(gr.g, numeric_gradient(p.g, loss), rtol, atol)) << "g";
  EXPECT_TRUE(all_close(gr.beta, numeric_gradient(p.beta, loss), rtol, atol)) << "beta";
  EXPECT_TRUE(all_close(gr.state.S, numeric_gradient(p.S0, loss), rtol, atol)) << "state";
  // the twin's backward against the same differences (the oracle itself is checked)
  const NaiveGrad tw = naive_backward(p, opt, W, WS);
  EXPECT_TRUE(all_close(tw.g, numeric_gradient(p.g, loss), rtol, atol)) << "twin g";
  EXPECT_TRUE(all_close(tw.k, numeric_gradient(p.k, loss), rtol, atol)) << "twin k";
}

TEST(DeltaGradient, FiniteDifferencesNormalised) {
  check_finite_differences(true, 300);
}
TEST(DeltaGradient, FiniteDifferencesWithoutNormalisation) {
  check_finite_differences(false, 310);
}

// The scale option and the normalisation's eps enter the gradient: a non-default scale and a
// large eps (where n_x differs from |x|), and a zero key row (k^ = 0, finite).
TEST(DeltaGradient, FiniteDifferencesScaleAndEps) {
  const Index N = 9, dk = 3, dv = 2;
  Problem p = random_problem(N, dk, dv, 320, false);
  p.k.row(4).setZero();
  delta::Options opt = options(4, true);
  opt.scale = 0.7;
  opt.norm_eps = 0.3;
  const Matrix<double> W = random_matrix<double>(N, dv, 321);
  const auto loss = [&] {
    const Matrix<double> out = delta::forward<double>(p.q, p.k, p.v, p.g, p.beta, opt);
    return (out.array() * W.array()).sum();
  };
  delta::Saved<double> saved;
  delta::forward<double>(p.q, p.k, p.v, p.g, p.beta, opt, nullptr, &saved);
  const delta::Grad<double> gr = delta::backward(p.q, p.k, p.v, p.g, p.beta, W, saved, opt);
  EXPECT_TRUE(all_close(gr.q, numeric_gradient(p.q, loss), 1e-6, 1e-7));
  EXPECT_TRUE(all_close(gr.k, numeric_gradient(p.k, loss), 1e-6, 1e-7));
  EXPECT_EQ(gr.state.S.size(), 0);  // no state continued: no start-state gradient
  const NaiveGrad tw = naive_backward(p, opt, W, Matrix<double>::Zero(dk, dv));
  EXPECT_LT(rel_err(gr.q, tw.q), 1e-12);
  EXPECT_LT(rel_err(gr.k, tw.k), 1e-12);
}

// ---- float against the twin ------------------------------------------------------------------

// Normwise relative tolerance of float results: float's own arithmetic (eps 6e-8) on the chunk's
// products, whose sums have C + d terms of O(1) with the wide state between chunks (measured
// about 2e-7 at N = 1000, d = 32, for outputs and every gradient); 1e-5 leaves a margin of 50.
constexpr double kFloatTol = 1e-5;

TEST(DeltaFloat, ForwardAndBackwardAgreeWithTheDoubleTwin) {
  const Index N = 150, dk = 12, dv = 10;
  const Problem p = random_problem(N, dk, dv, 400, true);
  const delta::Options opt = options(32, true);
  const Matrix<double> dO = random_matrix<double>(N, dv, 401);
  const Matrix<double> dS = random_matrix<double>(dk, dv, 402);
  const NaiveForward want = naive_forward(p, opt);
  const NaiveGrad wg = naive_backward(p, opt, dO, dS);
  delta::State<float> st;
  delta::Saved<float> saved;
  const Matrix<float> out = run_forward<float>(p, opt, st, &saved);
  EXPECT_LT(rel_err(out, want.out), kFloatTol);
  EXPECT_LT(rel_err(st.S, want.S_end), kFloatTol);
  const delta::Grad<float> gr = run_backward<float>(p, opt, dO, dS, saved);
  EXPECT_LT(rel_err(gr.q, wg.q), kFloatTol);
  EXPECT_LT(rel_err(gr.k, wg.k), kFloatTol);
  EXPECT_LT(rel_err(gr.v, wg.v), kFloatTol);
  EXPECT_LT(rel_err(gr.g, wg.g), kFloatTol);
  EXPECT_LT(rel_err(gr.beta, wg.beta), kFloatTol);
  EXPECT_LT(rel_err(gr.state.S, wg.S0), kFloatTol);
}

// Normalisation in float of rows whose squares overflow (1e20) or fall below float's normal range
// (1e-20): the rows normalise to the same unit vectors as at scale 1 (norm_eps = 1e-45, a float
// subnormal, is 1e-6 of the tiny rows' |x|^2).
TEST(DeltaFloat, HugeAndTinyRowsNormaliseAsUnitRows) {
  const Index N = 40, dk = 16, dv = 8;
  const Problem p = random_problem(N, dk, dv, 410, false);
  delta::Options opt = options(16, true);
  opt.norm_eps = 1e-45;
  Matrix<float> q = p.q.cast<float>(), k = p.k.cast<float>();
  const Matrix<float> v = p.v.cast<float>();
  const Vector<float> g = p.g.cast<float>(), b = p.beta.cast<float>();
  const Matrix<float> want = delta::forward<float>(q, k, v, g, b, opt);
  for (Index t = 0; t < N; ++t) {
    const float s = t % 2 == 0 ? 1e20f : 1e-20f;
    q.row(t) *= s;
    k.row(t) *= s;
  }
  const Matrix<float> got = delta::forward<float>(q, k, v, g, b, opt);
  EXPECT_LT(rel_err(got, want), kFloatTol);
}

// ---- pieces, decoding, records ------------------------------------------------------------------

template <class T>
class DeltaTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DeltaTyped, Scalars);

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

/// The inputs of a Problem in T.
template <class T>
struct Inputs {
  Matrix<T> q, k, v;
  Vector<T> g, beta;
  explicit Inputs(const Problem& p)
      : q(p.q.cast<T>()),
        k(p.k.cast<T>()),
        v(p.v.cast<T>()),
        g(p.g.cast<T>()),
        beta(p.beta.cast<T>()) {}
};

// Forward in pieces (one-row pieces without a record take the token-by-token path; longer ones
// and pieces with a record the chunked form) gives the one-call outputs and end state.
TYPED_TEST(DeltaTyped, AnyPiecesGiveTheOneCallOutputsAndState) {
  using T = TypeParam;
  const Index N = 150, dk = 7, dv = 5;
  const Problem p = random_problem(N, dk, dv, 500, true);
  const Inputs<T> in(p);
  const delta::Options opt = options(16, true);
  delta::State<T> whole_state;
  const Matrix<T> whole = run_forward<T>(p, opt, whole_state);
  std::vector<std::vector<Index>> splits = {std::vector<Index>(N, 1), {N}, {1, N - 1}, {40, 110}};
  for (std::uint64_t seed = 0; seed < 4; ++seed) splits.push_back(random_pieces(N, 40, seed));
  for (const auto& sizes : splits) {
    for (const bool with_record : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << sizes.size() << " pieces, first " << sizes[0] << ", record " << with_record);
      delta::State<T> st = delta::State<T>::empty(dk, dv);
      st.S = p.S0.cast<detail::wide_t<T>>();
      Matrix<T> out(N, dv);
      Index at = 0;
      for (const Index n : sizes) {
        delta::Saved<T> saved;
        out.middleRows(at, n) = delta::forward<T>(
            in.q.middleRows(at, n), in.k.middleRows(at, n), in.v.middleRows(at, n),
            in.g.segment(at, n), in.beta.segment(at, n), opt, &st, with_record ? &saved : nullptr);
        at += n;
      }
      EXPECT_LT(rel_err(out, whole), piece_tol<T>());
      EXPECT_LT(rel_err(st.S, whole_state.S), piece_tol<T>());
      EXPECT_EQ(st.tokens_seen, N);
    }
  }
}

// Decoding: forward_into on one row at a time with a reused output, no record, equals the
// one-call forward, and so does the twin (double); so do pieces of 5 rows (several tokens per
// call, the state written in place after the first). d_v = 37 takes every column kind of the
// decoding kernel: whole strips of 2 and 1 registers and a scalar tail, at every instruction set.
TYPED_TEST(DeltaTyped, DecodingTokenByTokenEqualsTheForward) {
  using T = TypeParam;
  const Index N = 90, dk = 16, dv = 37;
  const Problem p = random_problem(N, dk, dv, 510, false);
  const Inputs<T> in(p);
  const delta::Options opt;
  const Matrix<T> whole = delta::forward<T>(in.q, in.k, in.v, in.g, in.beta, opt);
  const Matrix<double> twin = naive_forward(p, opt).out;
  for (const Index len : {1, 5}) {
    delta::State<T> st = delta::State<T>::empty(dk, dv);
    Matrix<T> rows, out(N, dv);
    for (Index t = 0; t < N; t += len) {
      delta::forward_into(rows, in.q.middleRows(t, len), in.k.middleRows(t, len),
                          in.v.middleRows(t, len), in.g.segment(t, len), in.beta.segment(t, len),
                          opt, &st, nullptr);
      out.middleRows(t, len) = rows;
    }
    EXPECT_LT(rel_err(out, whole), piece_tol<T>()) << "pieces of " << len;
    EXPECT_LT(rel_err(out, twin), piece_tol<T>()) << "pieces of " << len;
    EXPECT_EQ(st.tokens_seen, N);
  }
}

// Backward over pieces: each piece's forward with its own record, the backwards in reverse, each
// given its successor's grad.state (one Grad reused, grad_state_out = grad.state itself), give the
// one call's gradients, and the first piece's grad.state is the one call's start-state gradient.
TYPED_TEST(DeltaTyped, PiecesBackwardGiveTheOneCallGradients) {
  using T = TypeParam;
  const Index N = 120, dk = 6, dv = 5;
  const Problem p = random_problem(N, dk, dv, 520, true);
  const Inputs<T> in(p);
  for (const bool keep : {false, true}) {
    delta::Options opt = options(16, true);
    opt.keep_states = keep;
    const Matrix<double> dO = random_matrix<double>(N, dv, 521);
    const Matrix<T> dOt = dO.cast<T>();
    const Matrix<double> dS = random_matrix<double>(dk, dv, 522);
    delta::State<T> st;
    delta::Saved<T> saved;
    run_forward<T>(p, opt, st, &saved);
    const delta::Grad<T> whole = run_backward<T>(p, opt, dO, dS, saved);
    for (std::uint64_t seed = 0; seed < 3; ++seed) {
      const std::vector<Index> sizes = random_pieces(N, 45, seed);
      SCOPED_TRACE(::testing::Message() << sizes.size() << " pieces, keep_states " << keep);
      st = delta::State<T>::empty(dk, dv);
      st.S = p.S0.cast<detail::wide_t<T>>();
      std::vector<delta::Saved<T>> recs(sizes.size());
      std::vector<Index> at(sizes.size() + 1, 0);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        at[i + 1] = at[i] + sizes[i];
        delta::forward<T>(in.q.middleRows(at[i], sizes[i]), in.k.middleRows(at[i], sizes[i]),
                          in.v.middleRows(at[i], sizes[i]), in.g.segment(at[i], sizes[i]),
                          in.beta.segment(at[i], sizes[i]), opt, &st, &recs[i]);
      }
      delta::Grad<T> gr;
      gr.state.S = dS.cast<detail::wide_t<T>>();
      Matrix<T> dq(N, dk), dk_(N, dk), dv_(N, dv);
      Vector<T> dg(N), db(N);
      for (std::size_t i = sizes.size(); i-- > 0;) {
        const Index a = at[i], n = sizes[i];
        delta::backward_into(gr, in.q.middleRows(a, n), in.k.middleRows(a, n),
                             in.v.middleRows(a, n), in.g.segment(a, n), in.beta.segment(a, n),
                             dOt.middleRows(a, n), recs[i], opt, &gr.state);
        dq.middleRows(a, n) = gr.q;
        dk_.middleRows(a, n) = gr.k;
        dv_.middleRows(a, n) = gr.v;
        dg.segment(a, n) = gr.g;
        db.segment(a, n) = gr.beta;
      }
      EXPECT_LT(rel_err(dq, whole.q), piece_tol<T>());
      EXPECT_LT(rel_err(dk_, whole.k), piece_tol<T>());
      EXPECT_LT(rel_err(dv_, whole.v), piece_tol<T>());
      EXPECT_LT(rel_err(dg, whole.g), piece_tol<T>());
      EXPECT_LT(rel_err(db, whole.beta), piece_tol<T>());
      EXPECT_LT(rel_err(gr.state.S, whole.state.S), piece_tol<T>());
    }
  }
}

// keep_states only chooses where the chunks' start states come from: the backward recomputes
// them with the forward's own operations, so the gradients are the same bits.
TYPED_TEST(DeltaTyped, KeptAndRecomputedStatesGiveTheSameBits) {
  using T = TypeParam;
  const Index N = 200, dk = 8, dv = 8;
  const Problem p = random_problem(N, dk, dv, 530, true);
  const Matrix<double> dO = random_matrix<double>(N, dv, 531);
  const Matrix<double> dS = random_matrix<double>(dk, dv, 532);
  delta::Grad<T> grads[2];
  for (const bool keep : {false, true}) {
    delta::Options opt = options(64, true);
    opt.keep_states = keep;
    delta::State<T> st;
    delta::Saved<T> saved;
    run_forward<T>(p, opt, st, &saved);
    EXPECT_EQ(saved.states.rows(), keep ? 4 * dk : 0);
    grads[keep] = run_backward<T>(p, opt, dO, dS, saved);
  }
  EXPECT_TRUE(grads[0].q == grads[1].q && grads[0].k == grads[1].k && grads[0].v == grads[1].v);
  EXPECT_TRUE(grads[0].g == grads[1].g && grads[0].beta == grads[1].beta);
  EXPECT_TRUE(grads[0].state.S == grads[1].state.S);
}

// The value-returning and the _into forms run one body: the same bits, with records reused
// across calls of other shapes.
TYPED_TEST(DeltaTyped, IntoFormsEqualValueForms) {
  using T = TypeParam;
  const delta::Options opt;
  Matrix<T> out;
  delta::Saved<T> saved;
  delta::Grad<T> grad;
  for (const Index N : {70, 5, 130}) {
    const Problem p = random_problem(N, 8, 4, 540 + N, false);
    const Inputs<T> in(p);
    const Matrix<T> dO = random_matrix<T>(N, 4, 541);
    delta::Saved<T> fresh;
    const Matrix<T> want = delta::forward<T>(in.q, in.k, in.v, in.g, in.beta, opt, nullptr, &fresh);
    delta::forward_into(out, in.q, in.k, in.v, in.g, in.beta, opt, nullptr, &saved);
    EXPECT_TRUE(out == want);
    const delta::Grad<T> wg = delta::backward(in.q, in.k, in.v, in.g, in.beta, dO, fresh, opt);
    delta::backward_into(grad, in.q, in.k, in.v, in.g, in.beta, dO, saved, opt);
    EXPECT_TRUE(grad.q == wg.q && grad.k == wg.k && grad.v == wg.v);
    EXPECT_TRUE(grad.g == wg.g && grad.beta == wg.beta);
    // a forward without a record gives the same outputs
    EXPECT_TRUE(delta::forward<T>(in.q, in.k, in.v, in.g, in.beta, opt) == want);
  }
}

// N = 0: an empty output, the state unchanged, empty gradients.
TYPED_TEST(DeltaTyped, EmptySequence) {
  using T = TypeParam;
  const Matrix<T> q(0, 4), v(0, 3);
  const Vector<T> g(0);
  delta::State<T> st = delta::State<T>::empty(4, 3);
  st.S.setConstant(0.5);
  delta::Saved<T> saved;
  const Matrix<T> out = delta::forward<T>(q, q, v, g, g, {}, &st, &saved);
  EXPECT_EQ(out.rows(), 0);
  EXPECT_EQ(out.cols(), 3);
  EXPECT_TRUE((st.S.array() == 0.5).all());
  delta::StateGrad<T> gs;
  gs.S = Matrix<detail::wide_t<T>>::Constant(4, 3, 2.0);
  const delta::Grad<T> gr = delta::backward(q, q, v, g, g, v, saved, {}, &gs);
  EXPECT_EQ(gr.q.rows(), 0);
  EXPECT_EQ(gr.g.size(), 0);
  EXPECT_TRUE(gr.state.S == gs.S);  // the end state is the start state
}

// ---- packed batches
// -------------------------------------------------------------------------------

/// Gates of a packed call, H x total: log decays in [-1.51, -0.01], beta in [0.05, 0.95].
template <class T>
void random_gates(Index heads, Index total, std::uint64_t seed, Matrix<T>& g, Matrix<T>& beta) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  g.resize(heads, total);
  beta.resize(heads, total);
  for (Index h = 0; h < heads; ++h)
    for (Index t = 0; t < total; ++t) {
      g(h, t) = static_cast<T>(-(0.01 + 1.5 * u(rng)));
      beta(h, t) = static_cast<T>(0.05 + 0.9 * u(rng));
    }
}

// A packed call (cu_seqlens offsets, H heads side by side, the gates H x total) is one call of
// the single-sequence operator per (sequence, head): the same bits as the separate calls for the
// outputs, the end states, every gradient and the start states' gradients, with and without
// states, on one and two threads, empty sequences included.
TYPED_TEST(DeltaTyped, PackedEqualsSeparateCalls) {
  using T = TypeParam;
  using W = detail::wide_t<T>;
  const Index H = 2, dk = 5, dv = 3;
  const Offsets off = {0, 37, 37, 100, 101};
  const Index total = off.back(), B = static_cast<Index>(off.size()) - 1;
  const Matrix<T> q = random_matrix<T>(total, H * dk, 600),
                  k = random_matrix<T>(total, H * dk, 601);
  const Matrix<T> v = random_matrix<T>(total, H * dv, 602),
                  dO = random_matrix<T>(total, H * dv, 603);
  Matrix<T> g, beta;
  random_gates<T>(H, total, 604, g, beta);
  const delta::Options opt = options(16, true);
  for (const bool with_states : {false, true}) {
    for (const int threads : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "states " << with_states << " threads " << threads);
      std::vector<delta::State<T>> states;
      std::vector<delta::StateGrad<T>> dS(static_cast<std::size_t>(B * H));
      for (Index i = 0; i < B * H; ++i) {
        states.push_back(delta::State<T>::empty(dk, dv));
        states.back().S = random_matrix<W>(dk, dv, 610 + i, 0.5);
        dS[static_cast<std::size_t>(i)].S = random_matrix<W>(dk, dv, 630 + i);
      }
      const std::vector<delta::State<T>> start = states;
      Matrix<T> out;
      delta::PackedSaved<T> saved;
      delta::PackedGrad<T> grad;
      delta::forward_packed_into(out, H, q, k, v, g, beta, off, opt,
                                 with_states ? &states : nullptr, &saved, threads);
      delta::backward_packed_into(grad, H, q, k, v, g, beta, dO, off, saved, opt,
                                  with_states ? &dS : nullptr, threads);
      ASSERT_EQ(out.rows(), total);
      ASSERT_EQ(grad.g.rows(), H);
      ASSERT_EQ(grad.beta.cols(), total);
      for (Index b = 0; b < B; ++b) {
        for (Index h = 0; h < H; ++h) {
          const std::size_t i = static_cast<std::size_t>(b * H + h);
          const Index a = off[static_cast<std::size_t>(b)];
          const Index n = off[static_cast<std::size_t>(b) + 1] - a;
          delta::State<T> st = start[i];
          delta::Saved<T> rec;
          const Matrix<T> o =
              delta::forward<T>(q.block(a, h * dk, n, dk), k.block(a, h * dk, n, dk),
                                v.block(a, h * dv, n, dv), g.row(h).segment(a, n),
                                beta.row(h).segment(a, n), opt, with_states ? &st : nullptr, &rec);
          EXPECT_TRUE(out.block(a, h * dv, n, dv) == o) << "item " << i;
          if (with_states) {
            EXPECT_TRUE(states[i].S == st.S) << "item " << i;
            EXPECT_EQ(states[i].tokens_seen, n);
          }
          const delta::Grad<T> gr = delta::backward<T>(
              q.block(a, h * dk, n, dk), k.block(a, h * dk, n, dk), v.block(a, h * dv, n, dv),
              g.row(h).segment(a, n), beta.row(h).segment(a, n), dO.block(a, h * dv, n, dv), rec,
              opt, with_states ? &dS[i] : nullptr);
          EXPECT_TRUE(grad.q.block(a, h * dk, n, dk) == gr.q) << "item " << i;
          EXPECT_TRUE(grad.k.block(a, h * dk, n, dk) == gr.k) << "item " << i;
          EXPECT_TRUE(grad.v.block(a, h * dv, n, dv) == gr.v) << "item " << i;
          EXPECT_TRUE(grad.g.row(h).segment(a, n).transpose() == gr.g) << "item " << i;
          EXPECT_TRUE(grad.beta.row(h).segment(a, n).transpose() == gr.beta) << "item " << i;
          EXPECT_TRUE(grad.items[i].state.S == gr.state.S) << "item " << i;
        }
      }
    }
  }
}

// A packed sequence continued by a second packed call (its states carried) equals one packed
// call over the whole sequences, up to rounding: the state crosses calls in packed batches too.
TEST(DeltaPacked, StatesContinueAcrossPackedCalls) {
  const Index H = 2, dk = 4, dv = 3;
  const Offsets whole = {0, 30, 80}, first = {0, 12, 40}, second = {0, 18, 40};
  const Matrix<double> q = random_matrix<double>(80, H * dk, 650);
  const Matrix<double> k = random_matrix<double>(80, H * dk, 651);
  const Matrix<double> v = random_matrix<double>(80, H * dv, 652);
  Matrix<double> g, beta;
  random_gates<double>(H, 80, 653, g, beta);
  const delta::Options opt = options(8, true);
  const auto fresh = [&] {
    return std::vector<delta::State<double>>(4, delta::State<double>::empty(dk, dv));
  };
  std::vector<delta::State<double>> one = fresh(), two = fresh();
  Matrix<double> out_one, out_a, out_b;
  delta::forward_packed_into(out_one, H, q, k, v, g, beta, whole, opt, &one, nullptr);
  // rows of sequence 0: [0, 12) then [12, 30); of sequence 1: [30, 58) then [58, 80)
  Matrix<double> qa(40, H * dk), ka(40, H * dk), va(40, H * dv), ga(H, 40), ba(H, 40);
  Matrix<double> qb = qa, kb = ka, vb = va, gb = ga, bb = ba;
  const auto gather = [&](Index at, Index len, Index dst, Matrix<double>& qq, Matrix<double>& kk,
                          Matrix<double>& vv, Matrix<double>& gg, Matrix<double>& bt) {
    qq.middleRows(dst, len) = q.middleRows(at, len);
    kk.middleRows(dst, len) = k.middleRows(at, len);
    vv.middleRows(dst, len) = v.middleRows(at, len);
    gg.middleCols(dst, len) = g.middleCols(at, len);
    bt.middleCols(dst, len) = beta.middleCols(at, len);
  };
  gather(0, 12, 0, qa, ka, va, ga, ba);
  gather(30, 28, 12, qa, ka, va, ga, ba);
  gather(12, 18, 0, qb, kb, vb, gb, bb);
  gather(58, 22, 18, qb, kb, vb, gb, bb);
  delta::forward_packed_into(out_a, H, qa, ka, va, ga, ba, first, opt, &two, nullptr);
  delta::forward_packed_into(out_b, H, qb, kb, vb, gb, bb, second, opt, &two, nullptr);
  EXPECT_LT(rel_err(out_a.topRows(12), out_one.topRows(12)), 1e-12);
  EXPECT_LT(rel_err(out_b.topRows(18), out_one.middleRows(12, 18)), 1e-12);
  EXPECT_LT(rel_err(out_a.bottomRows(28), out_one.middleRows(30, 28)), 1e-12);
  EXPECT_LT(rel_err(out_b.bottomRows(22), out_one.bottomRows(22)), 1e-12);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_LT(rel_err(two[i].S, one[i].S), 1e-12) << "item " << i;
    EXPECT_EQ(two[i].tokens_seen, one[i].tokens_seen);
  }
}

TEST(DeltaPacked, ErrorsNameTheArgument) {
  const Index H = 2, dk = 4, dv = 3;
  const Offsets off = {0, 5, 9};
  const Matrix<double> q = random_matrix<double>(9, H * dk, 660);
  const Matrix<double> v = random_matrix<double>(9, H * dv, 661);
  Matrix<double> g, beta;
  random_gates<double>(H, 9, 662, g, beta);
  const char* fn = "mixattn::delta::forward_packed_into";
  Matrix<double> out;
  using IA = std::invalid_argument;
  expect_throw<IA>(
      [&] {
        delta::forward_packed_into(out, H, q, q, v, g.topRows(1), beta, off, {}, nullptr, nullptr);
      },
      {fn, "g is 1 x 9", "2 x 9"});
  expect_throw<IA>(
      [&] {
        delta::forward_packed_into(out, H, q, q, v, g, beta.leftCols(8), off, {}, nullptr, nullptr);
      },
      {fn, "beta is 2 x 8"});
  std::vector<delta::State<double>> states(3, delta::State<double>::empty(dk, dv));
  expect_throw<IA>(
      [&] { delta::forward_packed_into(out, H, q, q, v, g, beta, off, {}, &states, nullptr); },
      {fn, "states has 3 entries", "need 4"});
  expect_throw<IA>(
      [&] {
        delta::forward_packed_into(out, H, q, q, v, g, beta, {0, 5, 10}, {}, nullptr, nullptr);
      },
      {fn, "offsets"});
  delta::PackedSaved<double> saved;
  delta::forward_packed_into(out, H, q, q, v, g, beta, off, {}, nullptr, &saved);
  delta::PackedGrad<double> grad;
  expect_throw<IA>(
      [&] {
        delta::backward_packed_into(grad, H, q, q, v, g, beta, out, {0, 4, 9}, saved, {});
      },
      {"mixattn::delta::backward_packed_into", "saved holds"});
}

// ---- errors
// ---------------------------------------------------------------------------------------

TEST(DeltaErrors, ShapesAndOptionsAreNamed) {
  const Index N = 6, dk = 4, dv = 3;
  const Matrix<double> q = random_matrix<double>(N, dk, 1), v = random_matrix<double>(N, dv, 2);
  const Vector<double> g = Vector<double>::Constant(N, -0.1), b = Vector<double>::Constant(N, 0.5);
  const char* fn = "mixattn::delta::forward";
  const auto fwd = [&](const Matrix<double>& q_, const Matrix<double>& k_, const Matrix<double>& v_,
                       const Vector<double>& g_, const Vector<double>& b_,
                       const delta::Options& o = {}) {
    return [=] { delta::forward<double>(q_, k_, v_, g_, b_, o); };
  };
  using IA = std::invalid_argument;
  expect_throw<IA>(fwd(q, q.topRows(5), v, g, b), {fn, "k is 5 x 4", "q is 6 x 4"});
  expect_throw<IA>(fwd(q, q.leftCols(3), v, g, b), {fn, "k is 6 x 3"});
  expect_throw<IA>(fwd(q, q, v.topRows(4), g, b), {fn, "v is 4 x 3", "6 rows"});
  expect_throw<IA>(fwd(q, q, v, g.head(5), b), {fn, "g has 5 entries", "6 rows"});
  expect_throw<IA>(fwd(q, q, v, g, b.head(7 - 2)), {fn, "beta has 5 entries"});
  expect_throw<IA>(fwd(q.leftCols(0), q.leftCols(0), v, g, b), {fn, "q has 0 columns"});
  delta::Options o;
  o.chunk = 0;
  expect_throw<IA>(fwd(q, q, v, g, b, o), {fn, "options.chunk is 0"});
  o = {};
  o.scale = -1;
  expect_throw<IA>(fwd(q, q, v, g, b, o), {fn, "options.scale is -1"});
  o.scale = std::numeric_limits<double>::quiet_NaN();
  expect_throw<IA>(fwd(q, q, v, g, b, o), {fn, "options.scale"});
  o = {};
  o.norm_eps = 0;
  expect_throw<IA>(fwd(q, q, v, g, b, o), {fn, "options.norm_eps is 0"});
  delta::State<double> wrong = delta::State<double>::empty(dk, dv + 1);
  expect_throw<IA>([&] { delta::forward<double>(q, q, v, g, b, {}, &wrong); },
                   {fn, "state.S is 4 x 4", "empty(4, 3)"});
  expect_throw<IA>([] { delta::State<float>::empty(0, 3); }, {"State::empty", "key_dim is 0"});
  Matrix<double> out;
  expect_throw<IA>([&] { delta::forward_into(out, q, q, v, g, b.head(2), {}, nullptr, nullptr); },
                   {"mixattn::delta::forward_into", "beta has 2 entries"});
}

TEST(DeltaErrors, ValuesOutOfDomainAndNonFinite) {
  const Index N = 6, dk = 4, dv = 3;
  const Matrix<float> q = random_matrix<float>(N, dk, 1), v = random_matrix<float>(N, dv, 2);
  const Vector<float> g = Vector<float>::Constant(N, -0.1f), b = Vector<float>::Constant(N, 0.5f);
  using DE = std::domain_error;
  const char* fn = "mixattn::delta::forward";
  Vector<float> bad = g;
  bad(3) = 0.25f;
  expect_throw<DE>([&] { delta::forward<float>(q, q, v, bad, b); }, {fn, "g has 0.25 at row 3"});
  bad = b;
  bad(2) = 1.5f;
  expect_throw<DE>([&] { delta::forward<float>(q, q, v, g, bad); }, {fn, "beta has 1.5 at row 2"});
  bad(2) = -0.01f;
  expect_throw<DE>([&] { delta::forward<float>(q, q, v, g, bad); }, {fn, "beta", "row 2"});
  // beta = 0 and 1 and g = 0 are in the domain
  Vector<float> edge = b;
  edge(0) = 0;
  edge(1) = 1;
  EXPECT_NO_THROW(delta::forward<float>(q, q, v, Vector<float>::Zero(N), edge));
  Matrix<float> nan = q;
  nan(4, 1) = std::numeric_limits<float>::quiet_NaN();
  expect_throw<DE>([&] { delta::forward<float>(q, nan, v, g, b); },
                   {fn, "k has a non-finite entry at (4, 1)"});
  bad = g;
  bad(1) = -std::numeric_limits<float>::infinity();
  expect_throw<DE>([&] { delta::forward<float>(q, q, v, bad, b); }, {fn, "g has a non-finite"});
  delta::Options off;
  off.check_finite = false;
  EXPECT_NO_THROW(delta::forward<float>(q, nan, v, g, b, off));
  // a non-finite state, and the state untouched by a refused call
  delta::State<float> st = delta::State<float>::empty(dk, dv);
  delta::forward<float>(q, q, v, g, b, {}, &st);
  const delta::State<float> before = st;
  expect_throw<DE>([&] { delta::forward<float>(q, nan, v, g, b, {}, &st); }, {"k"});
  EXPECT_TRUE(st.S == before.S && st.tokens_seen == before.tokens_seen);
  delta::State<float> nan_state = st;
  nan_state.S(1, 1) = std::numeric_limits<double>::infinity();
  expect_throw<DE>([&] { delta::forward<float>(q, q, v, g, b, {}, &nan_state); },
                   {fn, "state.S has a non-finite entry at (1, 1)"});
  // a decoding step (one row, no record) whose output overflows float leaves the state as it was
  // (unnormalised keys of 10s: k . q~ = 200, the output about 6e40, the state about 3e39)
  const Matrix<float> huge_row = Matrix<float>::Constant(1, dv, 3e38f);
  const Matrix<float> tens = Matrix<float>::Constant(1, dk, 10.0f);
  delta::Options raw;
  raw.normalize = false;
  expect_throw<DE>([&] {
    delta::forward<float>(tens, tens, huge_row, g.head(1), Vector<float>::Ones(1), raw, &st);
  }, {fn, "overflows float"});
  EXPECT_TRUE(st.S == before.S && st.tokens_seen == before.tokens_seen);
  // an output that overflows float although every input is finite
  const Matrix<float> huge = Matrix<float>::Constant(N, dv, 3e38f);
  expect_throw<DE>([&] { delta::forward<float>(q, q, huge, g, Vector<float>::Ones(N)); },
                   {fn, "overflows float"});
}

TEST(DeltaErrors, RecordsAreRefusedForOtherData) {
  const Index N = 20, dk = 4, dv = 3;
  const Problem p = random_problem(N, dk, dv, 600, false);
  const Inputs<double> in(p);
  const Matrix<double> dO = random_matrix<double>(N, dv, 601);
  const delta::Options opt = options(8, true);
  delta::Saved<double> saved;
  delta::forward<double>(in.q, in.k, in.v, in.g, in.beta, opt, nullptr, &saved);
  const char* fn = "mixattn::delta::backward";
  using IA = std::invalid_argument;
  const auto bwd = [&](const Inputs<double>& x, const delta::Options& o) {
    return [&, x, o] { delta::backward(x.q, x.k, x.v, x.g, x.beta, dO, saved, o); };
  };
  EXPECT_NO_THROW(bwd(in, opt)());
  const char* names[] = {"q", "k", "v", "g", "beta"};
  for (int which = 0; which < 5; ++which) {
    Inputs<double> other = in;
    switch (which) {
      case 0:
        other.q(3, 1) += 1;
        break;
      case 1:
        other.k(3, 1) += 1;
        break;
      case 2:
        other.v(3, 1) += 1;
        break;
      case 3:
        other.g(3) -= 0.5;
        break;
      default:
        other.beta(3) *= 0.5;
        break;
    }
    expect_throw<IA>(bwd(other, opt), {fn, "saved came from other data", names[which]});
  }
  delta::Options other_opt = opt;
  other_opt.chunk = 4;
  expect_throw<IA>(bwd(in, other_opt), {fn, "saved was made with chunk = 8"});
  other_opt = opt;
  other_opt.keep_states = true;
  expect_throw<IA>(bwd(in, other_opt), {fn, "keep_states = 0"});
  delta::Saved<double> empty;
  expect_throw<IA>([&] { delta::backward(in.q, in.k, in.v, in.g, in.beta, dO, empty, opt); },
                   {fn, "saved was not filled by forward"});
  expect_throw<IA>(
      [&] {
        delta::backward(in.q, in.k, in.v, in.g, in.beta, Matrix<double>(dO.topRows(5)), saved, opt);
      },
      {fn, "grad_out is 5 x 3", "20 x 3"});
  // a gradient of the end state needs a continued forward, of this state
  delta::StateGrad<double> gs;
  gs.S = Matrix<double>::Zero(dk, dv);
  expect_throw<IA>([&] { delta::backward(in.q, in.k, in.v, in.g, in.beta, dO, saved, opt, &gs); },
                   {fn, "grad_state_out is given but saved is from a forward without a State"});
  delta::State<double> st = delta::State<double>::empty(dk, dv);
  delta::Saved<double> first, second;
  delta::forward<double>(in.q.topRows(10), in.k.topRows(10), in.v.topRows(10), in.g.head(10),
                         in.beta.head(10), opt, &st, &first);
  delta::forward<double>(in.q.bottomRows(10), in.k.bottomRows(10), in.v.bottomRows(10),
                         in.g.tail(10), in.beta.tail(10), opt, &st, &second);
  const delta::Grad<double> g2 =
      delta::backward(in.q.bottomRows(10), in.k.bottomRows(10), in.v.bottomRows(10), in.g.tail(10),
                      in.beta.tail(10), dO.bottomRows(10), second, opt);
  EXPECT_NO_THROW(delta::backward(in.q.topRows(10), in.k.topRows(10), in.v.topRows(10),
                                  in.g.head(10), in.beta.head(10), dO.topRows(10), first, opt,
                                  &g2.state));
  // the first piece's own grad.state is the gradient of another state (its start)
  const delta::Grad<double> g1 =
      delta::backward(in.q.topRows(10), in.k.topRows(10), in.v.topRows(10), in.g.head(10),
                      in.beta.head(10), dO.topRows(10), first, opt);
  expect_throw<IA>(
      [&] {
        delta::backward(in.q.topRows(10), in.k.topRows(10), in.v.topRows(10), in.g.head(10),
                        in.beta.head(10), dO.topRows(10), first, opt, &g1.state);
      },
      {fn, "grad_state_out came from other data"});
  // the record keeps the start state: another start state is other data
  delta::Saved<double> changed = second;
  changed.start_S(0, 0) += 1;
  expect_throw<IA>(
      [&] {
        delta::backward(in.q.bottomRows(10), in.k.bottomRows(10), in.v.bottomRows(10),
                        in.g.tail(10), in.beta.tail(10), dO.bottomRows(10), changed, opt);
      },
      {fn, "the start state"});
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
TYPED_TEST(DeltaTyped, SteadyStateAllocatesNothing) {
  using T = TypeParam;
  const Index N = 1000, d = 128;
  const Problem p = random_problem(N, d, d, 700, false);
  const Inputs<T> in(p);
  const Matrix<T> dO = random_matrix<T>(N, d, 701);
  for (const bool keep : {false, true}) {
    delta::Options opt;
    opt.keep_states = keep;
    Matrix<T> out;
    delta::Saved<T> saved;
    delta::Grad<T> grad;
    delta::State<T> st = delta::State<T>::empty(d, d);
    const auto step = [&] {
      delta::forward_into(out, in.q, in.k, in.v, in.g, in.beta, opt, &st, &saved);
      delta::backward_into(grad, in.q, in.k, in.v, in.g, in.beta, dO, saved, opt);
    };
    step();
    EXPECT_EQ(allocations_of(step), 0) << "keep_states " << keep;
    Matrix<T> row;
    const auto decode = [&](Index t) {
      delta::forward_into(row, in.q.row(t), in.k.row(t), in.v.row(t), in.g.segment(t, 1),
                          in.beta.segment(t, 1), opt, &st, nullptr);
    };
    decode(0);
    EXPECT_EQ(allocations_of([&] { decode(1); }), 0);
  }
}

// At the training lengths of the other operators' steady-state checks (N = 2048 and 8192) and
// the defaults, a repeated training step allocates nothing, one sequence or a packed batch of
// three with states (one thread).
TYPED_TEST(DeltaTyped, TrainingLengthsAllocateNothing) {
  using T = TypeParam;
  const Index d = 64;
  for (const Index N : {2048, 8192}) {
    const Problem p = random_problem(N, d, d, 710 + N, false);
    const Inputs<T> in(p);
    const Matrix<T> dO = random_matrix<T>(N, d, 711);
    const delta::Options opt;
    Matrix<T> out;
    delta::Saved<T> saved;
    delta::Grad<T> grad;
    const auto step = [&] {
      delta::forward_into(out, in.q, in.k, in.v, in.g, in.beta, opt, nullptr, &saved);
      delta::backward_into(grad, in.q, in.k, in.v, in.g, in.beta, dO, saved, opt);
    };
    step();
    EXPECT_EQ(allocations_of(step), 0) << "N " << N;
    const Offsets off = {0, N / 4, N / 4, N};
    Matrix<T> g(1, N), beta(1, N);
    g.row(0) = in.g.transpose();
    beta.row(0) = in.beta.transpose();
    std::vector<delta::State<T>> states(3, delta::State<T>::empty(d, d));
    Matrix<T> pout;
    delta::PackedSaved<T> psaved;
    delta::PackedGrad<T> pgrad;
    const auto packed_step = [&] {
      delta::forward_packed_into(pout, 1, in.q, in.k, in.v, g, beta, off, opt, &states, &psaved);
      delta::backward_packed_into(pgrad, 1, in.q, in.k, in.v, g, beta, dO, off, psaved, opt);
    };
    packed_step();
    EXPECT_EQ(allocations_of(packed_step), 0) << "packed, N " << N;
  }
}

}  // namespace
