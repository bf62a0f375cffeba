// GMA argument validation: every bad shape, option and non-finite input is rejected at the API
// boundary with a message naming the function, the argument and the sizes.
#include <mixattn/gma.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <string>

namespace {

using namespace mixattn;
using mixattn::testing::expect_throw;
using mixattn::testing::random_matrix;

class GmaErrors : public ::testing::Test {
 protected:
  const Index n = 6, r = 3, K = 4, dv = 2;
  gma::Mixture<double> mix = gma::Mixture<double>::random(K, r, 1);
  Matrix<double> q = random_matrix<double>(n, r, 2), k = random_matrix<double>(n, r, 3);
  Matrix<double> v = random_matrix<double>(n, dv, 4), w = random_matrix<double>(n, dv, 5);
  static constexpr const char* fwd = "mixattn::gma::forward";
  static constexpr const char* bwd = "mixattn::gma::backward";
  double nan = std::numeric_limits<double>::quiet_NaN();
  double inf = std::numeric_limits<double>::infinity();
};

TEST_F(GmaErrors, ShapeMismatches) {
  using IA = std::invalid_argument;
  const Matrix<double> q4 = random_matrix<double>(n, 4, 9);
  expect_throw<IA>([&] { gma::forward(mix, q4, k, v); }, {fwd, "q is 6 x 4", "dimension 3"});
  expect_throw<IA>([&] { gma::forward(mix, q, q4, v); }, {fwd, "k is 6 x 4", "dimension 3"});
  const Matrix<double> v5 = random_matrix<double>(5, dv, 9);
  expect_throw<IA>([&] { gma::forward(mix, q, k, v5); }, {fwd, "v has 5 rows but k has 6"});
  gma::Options causal;
  causal.causal = true;
  const Matrix<double> q7 = random_matrix<double>(7, r, 9);
  expect_throw<IA>([&] { gma::forward(mix, q7, k, v, causal); }, {fwd, "causal", "7", "6"});
  EXPECT_NO_THROW(gma::forward(mix, q7, k, v));  // cross-attention is fine bidirectionally
  expect_throw<IA>([&] { gma::responsibilities(mix, q4); },
                   {"mixattn::gma::responsibilities", "x is 6 x 4"});
}

TEST_F(GmaErrors, MixtureInconsistent) {
  using IA = std::invalid_argument;
  gma::Mixture<double> m = mix;
  m.var_raw = Matrix<double>::Zero(K, r + 1);
  expect_throw<IA>([&] { gma::forward(m, q, k, v); }, {fwd, "var_raw is 4 x 4", "mean is 4 x 3"});
  m = mix;
  m.prior_logit = Vector<double>::Zero(K + 2);
  expect_throw<IA>([&] { gma::forward(m, q, k, v); }, {fwd, "prior_logit has 6", "4 components"});
  m = mix;
  m.var_floor = 0;
  expect_throw<IA>([&] { gma::forward(m, q, k, v); }, {fwd, "var_floor"});
  m.var_floor = -1e-4;
  expect_throw<IA>([&] { gma::forward(m, q, k, v); }, {fwd, "var_floor"});
  gma::Mixture<double> empty;  // K == 0
  empty.mean.resize(0, r);
  empty.var_raw.resize(0, r);
  empty.prior_logit.resize(0);
  expect_throw<IA>([&] { gma::forward(empty, q, k, v); }, {fwd, "0 components"});
  gma::Mixture<double> flat;  // r == 0
  flat.mean.resize(K, 0);
  flat.var_raw.resize(K, 0);
  flat.prior_logit = Vector<double>::Zero(K);
  const Matrix<double> q0(n, 0);
  expect_throw<IA>([&] { gma::forward(flat, q0, q0, v); }, {fwd, "dimension 0"});
  expect_throw<IA>([&] { gma::Mixture<double>::random(0, 3, 1); }, {"random", "components is 0"});
}

TEST_F(GmaErrors, BadOptions) {
  using IA = std::invalid_argument;
  gma::Options o;
  o.eps = 0;
  expect_throw<IA>([&] { gma::forward(mix, q, k, v, o); }, {fwd, "eps is 0"});
  o.eps = -1;
  expect_throw<IA>([&] { gma::forward(mix, q, k, v, o); }, {fwd, "eps is -1"});
  o.eps = nan;
  expect_throw<IA>([&] { gma::forward(mix, q, k, v, o); }, {fwd, "eps"});
  o = {};
  o.chunk = -3;
  expect_throw<IA>([&] { gma::forward(mix, q, k, v, o); }, {fwd, "chunk is -3"});
}

TEST_F(GmaErrors, NonFiniteInputs) {
  using DE = std::domain_error;
  auto poisoned = [](Matrix<double> m, double bad) {
    m(m.rows() - 1, m.cols() - 1) = bad;
    return m;
  };
  for (double bad : {nan, inf, -inf}) {
    const Matrix<double> qb = poisoned(q, bad), kb = poisoned(k, bad), vb = poisoned(v, bad);
    expect_throw<DE>([&] { gma::forward(mix, qb, k, v); }, {fwd, "q has a non-finite"});
    expect_throw<DE>([&] { gma::forward(mix, q, kb, v); }, {fwd, "k has a non-finite"});
    expect_throw<DE>([&] { gma::forward(mix, q, k, vb); }, {fwd, "v has a non-finite"});
    gma::Mixture<double> m = mix;
    m.mean(1, 2) = bad;
    expect_throw<DE>([&] { gma::forward(m, q, k, v); }, {fwd, "mixture.mean", "(1, 2)"});
    m = mix;
    m.var_raw(0, 0) = bad;
    expect_throw<DE>([&] { gma::forward(m, q, k, v); }, {fwd, "mixture.var_raw"});
    m = mix;
    m.prior_logit(3) = bad;
    expect_throw<DE>([&] { gma::forward(m, q, k, v); }, {fwd, "mixture.prior_logit"});
    gma::Saved<double> saved;
    gma::forward(mix, q, k, v, {}, &saved);
    const Matrix<double> wb = poisoned(w, bad);
    expect_throw<DE>([&] { gma::backward(mix, q, k, v, wb, saved); }, {bwd, "grad_out"});
    expect_throw<DE>([&] { gma::backward(mix, qb, k, v, w, saved); }, {bwd, "q has"});
    expect_throw<DE>([&] { gma::responsibilities(mix, qb); }, {"responsibilities", "x has"});
  }
  // the check can be switched off: NaN then simply propagates
  gma::Options off;
  off.check_finite = false;
  const Matrix<double> vb = poisoned(v, nan);
  EXPECT_NO_THROW(gma::forward(mix, q, k, vb, off));
}

// Without a record the causal forward probes q, k and v on their own and the bidirectional one
// when its kernels fail (a non-finite q or k row fails its softmax, a non-finite v entry makes
// the output non-finite); with a record each input is probed in the pass that takes its
// fingerprint (Fingerprint::add_checked). Either way a non-finite entry
// anywhere, in either mode and scalar type, gets the domain_error that names its argument and
// position, the first of q, k, v when several are bad.
template <class T>
void expect_named(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                  const gma::Mixture<T>& mix, const gma::Options& opt, const std::string& what) {
  const char* fwd = "mixattn::gma::forward";
  gma::Saved<T> saved;
  Matrix<T> out;
  mixattn::testing::expect_throw<std::domain_error>([&] { gma::forward(mix, q, k, v, opt); },
                                                    {fwd, what.c_str()});
  mixattn::testing::expect_throw<std::domain_error>(
      [&] { gma::forward(mix, q, k, v, opt, &saved); }, {fwd, what.c_str()});
  mixattn::testing::expect_throw<std::domain_error>(
      [&] { gma::forward_into(out, mix, q, k, v, opt, nullptr); }, {"forward_into", what.c_str()});
}

template <class T>
void non_finite_anywhere() {
  const Index n = 43, r = 7, K = 13, dv = 21;  // several density and read/write tiles, tails
  const gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 11);
  const Matrix<T> q = random_matrix<T>(n, r, 12), k = random_matrix<T>(n, r, 13);
  const Matrix<T> v = random_matrix<T>(n, dv, 14);
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    for (T bad : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                  -std::numeric_limits<T>::infinity()})
      for (Index i : {Index(0), Index(21), n - 1}) {
        SCOPED_TRACE(::testing::Message() << "causal " << causal << " row " << i << " " << bad);
        Matrix<T> qb = q, kb = k, vb = v;
        qb(i, 3) = bad;
        kb(i, 0) = bad;
        vb(i, dv - 1) = bad;
        const std::string at = "at (" + std::to_string(i) + ", ";
        expect_named<T>(qb, k, v, mix, opt, "q has a non-finite entry " + at + "3)");
        expect_named<T>(q, kb, v, mix, opt, "k has a non-finite entry " + at + "0)");
        expect_named<T>(q, k, vb, mix, opt,
                        "v has a non-finite entry " + at + std::to_string(dv - 1) + ")");
        expect_named<T>(qb, kb, vb, mix, opt, "q has a non-finite entry");
        expect_named<T>(q, kb, vb, mix, opt, "k has a non-finite entry");
      }
  }
}

// The bidirectional forward without a record learns of a non-finite v from its output: that
// holds where Gamma is one-hot too (widths at the floor, keys on distinct means), since a zero
// responsibility times inf or NaN is NaN. Every key row's v carries the bad entry in turn.
TEST(GmaNonFinite, ValueNamedWhereGammaIsOneHot) {
  const Index K = 3, r = 4, dv = 5;
  gma::Mixture<float> mix = gma::Mixture<float>::random(K, r, 31);
  mix.var_raw.setConstant(-40.0f);  // sigma^2 = var_floor = 1e-4
  for (Index c = 0; c < K; ++c) mix.mean.row(c).setConstant(static_cast<float>(c));
  const Matrix<float> q = mix.mean, k = mix.mean;  // token i sits on component i
  const Matrix<float> gamma = gma::responsibilities(mix, k);
  ASSERT_TRUE(gamma.isIdentity(0)) << gamma;
  const Matrix<float> v = random_matrix<float>(K, dv, 32);
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()})
    for (Index i = 0; i < K; ++i) {
      SCOPED_TRACE(::testing::Message() << "row " << i << " " << bad);
      Matrix<float> vb = v;
      vb(i, 2) = bad;
      expect_named<float>(q, k, vb, mix, gma::Options{},
                          "v has a non-finite entry at (" + std::to_string(i) + ", 2)");
    }
}

TEST(GmaNonFinite, NamedWhereverItIsInFloat) {
  non_finite_anywhere<float>();
}
TEST(GmaNonFinite, NamedWhereverItIsInDouble) {
  non_finite_anywhere<double>();
}

TEST_F(GmaErrors, BackwardRejectsMismatchedSavedAndGradOut) {
  using IA = std::invalid_argument;
  gma::Saved<double> saved;
  gma::forward(mix, q, k, v, {}, &saved);
  EXPECT_NO_THROW(gma::backward(mix, q, k, v, w, saved));
  const Matrix<double> w3 = random_matrix<double>(n, 3, 9);
  expect_throw<IA>([&] { gma::backward(mix, q, k, v, w3, saved); },
                   {bwd, "grad_out is 6 x 3", "6 x 2"});
  gma::Saved<double> never;
  expect_throw<IA>([&] { gma::backward(mix, q, k, v, w, never); }, {bwd, "saved"});
  // saved from other shapes
  const Matrix<double> q8 = random_matrix<double>(8, r, 9), w8 = random_matrix<double>(8, dv, 9);
  expect_throw<IA>([&] { gma::backward(mix, q8, k, v, w8, saved); },
                   {bwd, "saved is for N = 6", "N = 8"});
  // saved from other values of the same shapes
  const Matrix<double> k2 = random_matrix<double>(n, r, 99);
  expect_throw<IA>([&] { gma::backward(mix, q, k2, v, w, saved); }, {bwd, "different"});
  gma::Mixture<double> m2 = mix;
  m2.mean(0, 0) += 1;
  expect_throw<IA>([&] { gma::backward(m2, q, k, v, w, saved); }, {bwd, "different"});
  // saved from the other mode or eps
  gma::Options causal;
  causal.causal = true;
  expect_throw<IA>([&] { gma::backward(mix, q, k, v, w, saved, causal); }, {bwd, "causal"});
  gma::Options eps;
  eps.eps = 1e-3;
  expect_throw<IA>([&] { gma::backward(mix, q, k, v, w, saved, eps); }, {bwd, "eps"});
}

// With check_finite = false a NaN input is the caller's business: backward must accept the Saved
// its own forward made from the same (NaN-holding) inputs, not mistake it for another one.
TEST_F(GmaErrors, UncheckedNanInputsStillMatchTheirSaved) {
  gma::Options unchecked;
  unchecked.check_finite = false;
  Matrix<double> qn = q;
  qn(1, 0) = std::numeric_limits<double>::quiet_NaN();
  gma::Saved<double> saved;
  gma::forward(mix, qn, k, v, unchecked, &saved);
  EXPECT_NO_THROW(gma::backward(mix, qn, k, v, w, saved, unchecked));
  // ...while a different, finite q is still recognised as different.
  expect_throw<std::invalid_argument>([&] { gma::backward(mix, q, k, v, w, saved, unchecked); },
                                      {bwd, "different"});
}

}  // namespace
