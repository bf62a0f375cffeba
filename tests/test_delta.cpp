// The gated delta rule (SPEC §9): the chunked forward and backward against their slow, obvious
// twin (the recurrence token by token in double, with its backward through time written out),
// central finite differences for every input, the state over pieces of a sequence and through
// decoding, the records, the errors, and the steady state of the `_into` forms.
#include "counting_heap.hpp"

#include "test_util.hpp"

#include <mixattn/delta.hpp>

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
               Matrix<double>(), Vector<double>(N), Vector<double>(N)};
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
// partial last chunk, d_k != d_v, with and without the normalisation and a start state.
struct Case {
  Index N, dk, dv, chunk;
  bool normalize, state;
};
const Case kCases[] = {{1, 3, 2, 64, true, false},   {37, 5, 4, 8, true, true},
                       {37, 5, 4, 1, true, true},    {64, 8, 6, 64, true, false},
                       {100, 6, 9, 16, false, true}, {130, 16, 16, 64, true, true},
                       {50, 4, 7, 200, false, false}};

// ---- exactness against the twin, in double ---------------------------------------------------

// Tolerance 1e-12 relative, normwise: both sides run the same arithmetic in another order; the
// chunked form's extra steps are a triangular solve of a well-conditioned unit lower matrix (its
// inverse is a product of the contractions I - beta k k^T in the WY form) and products of C terms,
// so its error is a few hundred eps (1e-16) at these sizes; keys without normalisation are drawn
// with |k|^2 ~ 1 so the recurrence stays a contraction there too.
TEST(DeltaExact, ForwardEqualsRecurrence) {
  std::uint64_t seed = 100;
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.N << " dk " << c.dk << " dv " << c.dv
                                      << " chunk " << c.chunk << " normalize " << c.normalize
                                      << " seed " << seed);
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
      SCOPED_TRACE(::testing::Message() << "N " << c.N << " dk " << c.dk << " dv " << c.dv
                                        << " chunk " << c.chunk << " normalize " << c.normalize
                                        << " keep_states " << keep << " seed " << seed);
      const Problem p = random_problem(c.N, c.dk, c.dv, seed++, c.state,
                                       c.normalize ? 1.0 : 1 / std::sqrt(c.dk));
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

TEST(DeltaGradient, FiniteDifferencesNormalised) { check_finite_differences(true, 300); }
TEST(DeltaGradient, FiniteDifferencesWithoutNormalisation) { check_finite_differences(false, 310); }

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

}  // namespace
