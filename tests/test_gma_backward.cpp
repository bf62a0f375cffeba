// GMA backward (SPEC 1.5) against central finite differences in double, for every input and
// every mixture parameter, bidirectional and causal; float against double.
#include <mixattn/gma.hpp>

#include "test_gma_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cstdint>

namespace {

using namespace mixattn;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;
using mixattn::testing::test_mixture;

template <class A, class B>
::testing::AssertionResult close(const Eigen::MatrixBase<A>& a, const Eigen::MatrixBase<B>& b,
                                 double rtol, double atol) {
  return mixattn::testing::all_close(Matrix<double>(a.template cast<double>()),
                                     Matrix<double>(b.template cast<double>()), rtol, atol);
}


struct Case {
  Index n, m, r, K, dv;
  bool causal;
  Index chunk;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "N " << c.n << " M " << c.m << " r " << c.r << " K " << c.K << " dv " << c.dv
      << (c.causal ? " causal chunk " : " bidirectional ") << c.chunk;
}

class GmaGradient : public ::testing::TestWithParam<Case> {};

// Central differences with h = 1e-6 have error ~ h^2 f''' + eps |L| / h ~ 1e-10 here; the
// tolerance leaves two orders of magnitude above that and is far below any real mistake.
constexpr double kRtol = 1e-6, kAtol = 1e-8;

TEST_P(GmaGradient, MatchesCentralDifferences) {
  const Case c = GetParam();
  const std::uint64_t seed = c.n * 31 + c.m * 7 + c.K * 3 + c.causal;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  gma::Mixture<double> mix = test_mixture<double>(c.K, c.r, seed);
  // inputs near the means so that several components share every token
  Matrix<double> q = random_matrix<double>(c.n, c.r, seed + 3, 0.8);
  Matrix<double> k = random_matrix<double>(c.m, c.r, seed + 4, 0.8);
  Matrix<double> v = random_matrix<double>(c.m, c.dv, seed + 5);
  const Matrix<double> w = random_matrix<double>(c.n, c.dv, seed + 6);  // dL/dO
  gma::Options opt;
  opt.causal = c.causal;
  opt.chunk = c.chunk;
  opt.eps = 1e-3;  // large enough that the eps path of the denominator is exercised too

  gma::Saved<double> saved;
  gma::forward(mix, q, k, v, opt, &saved);
  const gma::Grad<double> grad = gma::backward(mix, q, k, v, w, saved, opt);
  auto loss = [&] { return gma::forward(mix, q, k, v, opt).cwiseProduct(w).sum(); };

  EXPECT_TRUE(close(grad.q, numeric_gradient(q, loss), kRtol, kAtol)) << "q";
  EXPECT_TRUE(close(grad.k, numeric_gradient(k, loss), kRtol, kAtol)) << "k";
  EXPECT_TRUE(close(grad.v, numeric_gradient(v, loss), kRtol, kAtol)) << "v";
  EXPECT_TRUE(close(grad.mixture.mean, numeric_gradient(mix.mean, loss), kRtol, kAtol)) << "mean";
  EXPECT_TRUE(close(grad.mixture.var_raw, numeric_gradient(mix.var_raw, loss), kRtol, kAtol))
      << "var_raw";
  EXPECT_TRUE(close(grad.mixture.prior_logit, numeric_gradient(mix.prior_logit, loss), kRtol,
                    kAtol))
      << "prior_logit";
  // the gradients are not trivially zero (a check on the check); with K = 1 gamma is constant
  // and with N = M = 1 routing only acts through eps, so those cases are exempt
  if (c.K > 1 && c.n > 1) {
    EXPECT_GT(grad.q.norm(), 1e-3);
    EXPECT_GT(grad.mixture.var_raw.norm(), 1e-3);
  } else if (c.K == 1) {
    EXPECT_TRUE(grad.q.isZero(1e-12));  // exact: gamma == 1 whatever q is
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GmaGradient,
    ::testing::Values(Case{7, 7, 3, 4, 2, false, 0}, Case{5, 9, 2, 3, 3, false, 0},
                      Case{11, 4, 4, 6, 2, false, 0}, Case{1, 1, 2, 2, 1, false, 0},
                      Case{9, 9, 3, 4, 2, true, 4},  // N not a multiple of the chunk
                      Case{10, 10, 2, 5, 3, true, 1}, Case{8, 8, 3, 3, 2, true, 100},
                      Case{13, 13, 2, 4, 2, true, 5}, Case{6, 6, 5, 1, 2, true, 2}));

TEST(GmaGradientChunk, ChunkLengthDoesNotChangeGradients) {
  const Index n = 37, r = 4, K = 6, dv = 3;
  const gma::Mixture<double> mix = test_mixture<double>(K, r, 5);
  const Matrix<double> q = random_matrix<double>(n, r, 6), k = random_matrix<double>(n, r, 7);
  const Matrix<double> v = random_matrix<double>(n, dv, 8), w = random_matrix<double>(n, dv, 9);
  gma::Options opt;
  opt.causal = true;
  opt.chunk = 1;
  gma::Saved<double> s1;
  gma::forward(mix, q, k, v, opt, &s1);
  const gma::Grad<double> g1 = gma::backward(mix, q, k, v, w, s1, opt);
  for (Index chunk : {3, 16, 37, 64}) {
    opt.chunk = chunk;
    gma::Saved<double> s;
    gma::forward(mix, q, k, v, opt, &s);
    const gma::Grad<double> g = gma::backward(mix, q, k, v, w, s, opt);
    // same sums in another order: rounding only
    EXPECT_TRUE(close(g.q, g1.q, 1e-10, 1e-12)) << chunk;
    EXPECT_TRUE(close(g.k, g1.k, 1e-10, 1e-12)) << chunk;
    EXPECT_TRUE(close(g.v, g1.v, 1e-10, 1e-12)) << chunk;
    EXPECT_TRUE(close(g.mixture.mean, g1.mixture.mean, 1e-10, 1e-12)) << chunk;
    EXPECT_TRUE(close(g.mixture.var_raw, g1.mixture.var_raw, 1e-10, 1e-12)) << chunk;
    EXPECT_TRUE(close(g.mixture.prior_logit, g1.mixture.prior_logit, 1e-10, 1e-12)) << chunk;
  }
}

/// float gradients against double gradients for the same (float-representable) inputs.
/// Returns the worst entry error relative to the largest entry of each double gradient.
double float_vs_double(const gma::Mixture<double>& md, const Matrix<double>& q,
                       const Matrix<double>& k, const Matrix<double>& v, const Matrix<double>& w,
                       bool causal) {
  gma::Mixture<float> mf;
  mf.mean = md.mean.cast<float>();
  mf.var_raw = md.var_raw.cast<float>();
  mf.prior_logit = md.prior_logit.cast<float>();
  mf.var_floor = float(md.var_floor);
  gma::Mixture<double> mr;  // the double run sees exactly the float inputs
  mr.mean = mf.mean.cast<double>();
  mr.var_raw = mf.var_raw.cast<double>();
  mr.prior_logit = mf.prior_logit.cast<double>();
  mr.var_floor = double(mf.var_floor);
  const Matrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>(),
                      wf = w.cast<float>();
  const Matrix<double> qd = qf.cast<double>(), kd = kf.cast<double>(), vd = vf.cast<double>(),
                       wd = wf.cast<double>();
  gma::Options opt;
  opt.causal = causal;
  gma::Saved<float> sf;
  gma::Saved<double> sd;
  gma::forward(mf, qf, kf, vf, opt, &sf);
  gma::forward(mr, qd, kd, vd, opt, &sd);
  const gma::Grad<float> gf = gma::backward(mf, qf, kf, vf, wf, sf, opt);
  const gma::Grad<double> gd = gma::backward(mr, qd, kd, vd, wd, sd, opt);
  auto rel = [](const auto& a, const auto& b) {
    return (a.template cast<double>() - b).cwiseAbs().maxCoeff() / b.cwiseAbs().maxCoeff();
  };
  double worst = 0;
  worst = std::max(worst, rel(gf.q, gd.q));
  worst = std::max(worst, rel(gf.k, gd.k));
  worst = std::max(worst, rel(gf.v, gd.v));
  worst = std::max(worst, rel(gf.mixture.mean, gd.mixture.mean));
  worst = std::max(worst, rel(gf.mixture.var_raw, gd.mixture.var_raw));
  worst = std::max(worst, rel(Vector<float>(gf.mixture.prior_logit), Vector<double>(gd.mixture.prior_logit)));
  return worst;
}

TEST(GmaGradientPrecision, FloatAgreesWithDouble) {
  const Index n = 200, r = 8, K = 12, dv = 4;
  const gma::Mixture<double> md = test_mixture<double>(K, r, 51);
  const Matrix<double> q = random_matrix<double>(n, r, 52), k = random_matrix<double>(n, r, 53);
  const Matrix<double> v = random_matrix<double>(n, dv, 54), w = random_matrix<double>(n, dv, 55);
  for (bool causal : {false, true})
    // gamma carries ~1e-5 relative float error and dS another cancellation of O(1) terms
    EXPECT_LT(float_vs_double(md, q, k, v, w, causal), 2e-4) << "causal " << causal;
}

TEST(GmaGradientPrecision, FloatAgreesWithDoubleFarFromOrigin) {
  // Means at |mu| ~ 300 with sigma ~ 0.3 and tokens within a few sigma of them: the GEMM form
  // sum_i dS (x^2 - 2 x mu + mu^2) would cancel 1e6-fold; the gradients must still agree.
  const Index n = 120, r = 4, K = 6, dv = 3;
  gma::Mixture<double> md = test_mixture<double>(K, r, 61);
  const Matrix<double> base = random_matrix<double>(1, r, 62, 300.0);
  md.mean = (md.mean * 0.3).rowwise() + base.row(0);
  md.var_raw = Matrix<double>::Constant(K, r, -2.0);  // sigma^2 ~ 0.13
  Matrix<double> q(n, r), k(n, r);
  const Matrix<double> oq = random_matrix<double>(n, r, 63, 0.3), ok = random_matrix<double>(n, r, 64, 0.3);
  for (Index i = 0; i < n; ++i) {
    q.row(i) = md.mean.row(i % K) + oq.row(i);
    k.row(i) = md.mean.row((i + 1) % K) + ok.row(i);
  }
  const Matrix<double> v = random_matrix<double>(n, dv, 65), w = random_matrix<double>(n, dv, 66);
  for (bool causal : {false, true})
    // inputs are rounded to float at |x| ~ 300: 3e-5 absolute, 1e-4 of sigma; gamma and all
    // gradients inherit that relative error, a few times over.
    EXPECT_LT(float_vs_double(md, q, k, v, w, causal), 2e-3) << "causal " << causal;
}

TEST(GmaGradient, ExtremeFiniteInputsGiveFiniteResults) {
  // |x| ~ 1e4, variances at the floor: s ~ -1e12, gamma one-hot, every gradient finite.
  const Index n = 24, r = 6, K = 5, dv = 3;
  for (bool causal : {false, true}) {
    gma::Mixture<float> mix = gma::Mixture<float>::random(K, r, 71);
    mix.var_raw = Matrix<float>::Constant(K, r, -30.0f);
    mix.prior_logit = random_matrix<float>(K, 1, 72, 30.0);
    const Matrix<float> q = random_matrix<float>(n, r, 73, 1e4), k = random_matrix<float>(n, r, 74, 1e4);
    const Matrix<float> v = random_matrix<float>(n, dv, 75, 1e4), w = random_matrix<float>(n, dv, 76);
    gma::Options opt;
    opt.causal = causal;
    gma::Saved<float> saved;
    const Matrix<float> o = gma::forward(mix, q, k, v, opt, &saved);
    EXPECT_TRUE(o.allFinite());
    EXPECT_TRUE(saved.gamma_q.allFinite());
    const gma::Grad<float> g = gma::backward(mix, q, k, v, w, saved, opt);
    EXPECT_TRUE(g.q.allFinite() && g.k.allFinite() && g.v.allFinite());
    EXPECT_TRUE(g.mixture.mean.allFinite() && g.mixture.var_raw.allFinite() &&
                g.mixture.prior_logit.allFinite());
    // very large var_raw: softplus(w) = w, sigmoid = 1, still finite
    mix.var_raw = Matrix<float>::Constant(K, r, 80.0f);
    gma::Saved<float> s2;
    EXPECT_TRUE(gma::forward(mix, q, k, v, opt, &s2).allFinite());
    const gma::Grad<float> g2 = gma::backward(mix, q, k, v, w, s2, opt);
    EXPECT_TRUE(g2.q.allFinite() && g2.mixture.var_raw.allFinite());
  }
}

TEST(GmaGradient, TinyVarFloorUnderVeryNegativeVarRawGivesZeroVarRawGradient) {
  // var_floor 1e-200 and var_raw -1e8: softplus and sigmoid of var_raw are both e^-1e8 = 0 in
  // double, so sigma^2 is the floor and the exact d var_raw = sigmoid(var_raw) . d var is 0.
  // d var itself is a^2 (2 wtt - w) with a^2 = 1/(2 sigma^2) = 5e199 and t = (x - mu) a ~ 1e100
  // for keys O(1) off the means, so a^2 wtt ~ 1e400 overflows double; the gradient must still
  // come out as the exact 0, not as an overflow error.
  const Index n = 6, r = 3, K = 2, dv = 2;
  for (bool causal : {false, true}) {
    gma::Mixture<double> mix = test_mixture<double>(K, r, 81);
    mix.var_floor = 1e-200;
    mix.var_raw.setConstant(-1e8);
    const Matrix<double> q = random_matrix<double>(n, r, 82), k = random_matrix<double>(n, r, 83);
    const Matrix<double> v = random_matrix<double>(n, dv, 84), w = random_matrix<double>(n, dv, 85);
    gma::Options opt;
    opt.causal = causal;
    gma::Saved<double> saved;
    gma::forward(mix, q, k, v, opt, &saved);
    for (Index i = 0; i < n; ++i)  // the widths make gamma one-hot: every key weighs on one
      ASSERT_DOUBLE_EQ(saved.gamma_k.row(i).maxCoeff(), 1.0) << "key " << i;
    gma::Grad<double> g;
    ASSERT_NO_THROW(g = gma::backward(mix, q, k, v, w, saved, opt)) << "causal " << causal;
    EXPECT_TRUE(g.mixture.var_raw.isZero(0)) << g.mixture.var_raw;
  }
}

TEST(GmaGradient, EmptySequence) {
  const gma::Mixture<double> mix = test_mixture<double>(3, 2, 1);
  const Matrix<double> q(0, 2), k(0, 2), v(0, 4), w(0, 4);
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    gma::Saved<double> saved;
    gma::forward(mix, q, k, v, opt, &saved);
    const gma::Grad<double> g = gma::backward(mix, q, k, v, w, saved, opt);
    EXPECT_EQ(g.q.rows(), 0);
    EXPECT_EQ(g.v.cols(), 4);
    EXPECT_TRUE(g.mixture.mean.isZero(0));
    EXPECT_EQ(g.mixture.var_raw.rows(), 3);
    EXPECT_EQ(g.mixture.prior_logit.size(), 3);
  }
}

}  // namespace
