// Diagnostics (SPEC 1.7) on hand-built responsibilities and labelings with known answers.
#include <mixattn/diagnostics.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace diag = mixattn::diagnostics;

template <class T>
class DiagnosticsTyped : public ::testing::Test {
 protected:
  // Every answer below is a short sum of a handful of exactly representable values or one log;
  // a few ulps of the type cover it (float ~1e-7, double ~1e-16).
  static constexpr double tol = std::is_same<T, float>::value ? 1e-6 : 1e-13;
};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DiagnosticsTyped, Scalars);

TYPED_TEST(DiagnosticsTyped, MeanUsageIsColumnMean) {
  using T = TypeParam;
  Matrix<T> g(4, 3);
  g << 1, 0, 0,       //
      0.5, 0.5, 0,    //
      0, 0.25, 0.75,  //
      0.5, 0.25, 0.25;
  const Vector<T> p = diag::mean_usage<T>(g);
  ASSERT_EQ(p.size(), 3);
  EXPECT_NEAR(p[0], 2.0 / 4, this->tol);
  EXPECT_NEAR(p[1], 1.0 / 4, this->tol);
  EXPECT_NEAR(p[2], 1.0 / 4, this->tol);
}

TYPED_TEST(DiagnosticsTyped, OneHotUsageHasZeroEntropyAndOneComponent) {
  using T = TypeParam;
  Matrix<T> g = Matrix<T>::Zero(5, 4);
  g.col(2).setOnes();
  EXPECT_NEAR(diag::usage_entropy<T>(g), 0.0, this->tol);
  EXPECT_EQ(diag::components_used<T>(g), 1);
}

TYPED_TEST(DiagnosticsTyped, UniformUsageHasEntropyOne) {
  using T = TypeParam;
  // Uniform rows, and also one-hot rows spread evenly: both give p̄ uniform.
  const Matrix<T> uniform = Matrix<T>::Constant(3, 4, T(0.25));
  EXPECT_NEAR(diag::usage_entropy<T>(uniform), 1.0, this->tol);
  EXPECT_EQ(diag::components_used<T>(uniform), 4);
  const Matrix<T> spread = Matrix<T>::Identity(4, 4);
  EXPECT_NEAR(diag::usage_entropy<T>(spread), 1.0, this->tol);
}

TYPED_TEST(DiagnosticsTyped, HalfTheComponentsGiveEntropyOneHalf) {
  using T = TypeParam;
  // p̄ = (1/2, 1/2, 0, 0): H = log 2, normalised by log 4 = 2 log 2.
  Matrix<T> g = Matrix<T>::Zero(2, 4);
  g(0, 0) = 1;
  g(1, 1) = 1;
  EXPECT_NEAR(diag::usage_entropy<T>(g), 0.5, this->tol);
  EXPECT_EQ(diag::components_used<T>(g), 2);
}

TYPED_TEST(DiagnosticsTyped, SingleComponentEntropyIsDefinedAsZero) {
  using T = TypeParam;
  const Matrix<T> g = Matrix<T>::Ones(3, 1);
  EXPECT_EQ(diag::usage_entropy<T>(g), T(0));
  EXPECT_EQ(diag::components_used<T>(g), 1);
}

TYPED_TEST(DiagnosticsTyped, ComponentsUsedThreshold) {
  using T = TypeParam;
  // p̄ = (0.7, 0.28, 0.02). Default τ = 1/(10·3) = 0.0333 drops the last; τ = 0.01 keeps it;
  // τ = 0.5 keeps only the first.
  Matrix<T> g(1, 3);
  g << T(0.7), T(0.28), T(0.02);
  EXPECT_EQ(diag::components_used<T>(g), 2);
  EXPECT_EQ(diag::components_used<T>(g, 0.01), 3);
  EXPECT_EQ(diag::components_used<T>(g, 0.5), 1);
  EXPECT_THROW(diag::components_used<T>(g, 1.5), std::invalid_argument);
}

TYPED_TEST(DiagnosticsTyped, HardAssignmentsTakeArgmaxTiesToLowest) {
  using T = TypeParam;
  Matrix<T> g(4, 3);
  g << 0.2, 0.5, 0.3,   //
      0.4, 0.2, 0.4,    // tie between 0 and 2 -> 0
      0.1, 0.45, 0.45,  // tie between 1 and 2 -> 1
      0, 0, 1;
  const std::vector<Index> a = diag::hard_assignments<T>(g);
  EXPECT_EQ(a, (std::vector<Index>{1, 0, 1, 2}));
}

TYPED_TEST(DiagnosticsTyped, AssignmentNmiMatchesLabelsUpToRelabeling) {
  using T = TypeParam;
  // Tokens of category 7 go to component 2, category 3 to component 0.
  Matrix<T> g(4, 3);
  g << 0.1, 0.1, 0.8,  //
      0.6, 0.3, 0.1,   //
      0.2, 0.2, 0.6,   //
      0.9, 0.05, 0.05;
  EXPECT_NEAR(diag::assignment_nmi<T>(g, std::vector<int>{7, 3, 7, 3}), 1.0, 1e-12);
  EXPECT_THROW(diag::assignment_nmi<T>(g, std::vector<int>{7, 3, 7}), std::invalid_argument);
}

TYPED_TEST(DiagnosticsTyped, AffinityIsProductOfResponsibilities) {
  using T = TypeParam;
  Matrix<T> gq(2, 2), gk(3, 2);
  gq << 1, 0,  //
      0.5, 0.5;
  gk << 0.25, 0.75,  //
      1, 0,          //
      0, 1;
  const Matrix<T> a = diag::affinity<T>(gq, gk);
  ASSERT_EQ(a.rows(), 2);
  ASSERT_EQ(a.cols(), 3);
  Matrix<double> expected(2, 3);
  expected << 0.25, 1, 0,  //
      0.5, 0.5, 0.5;
  EXPECT_TRUE(mixattn::testing::all_close(Matrix<double>(a.template cast<double>()), expected, 0.0,
                                          this->tol));
}

TYPED_TEST(DiagnosticsTyped, CausalAttentionWeightsAreMaskedAndNormalised) {
  using T = TypeParam;
  Matrix<T> g(3, 2);
  g << 1, 0,     //
      0.5, 0.5,  //
      0, 1;
  // Γ Γᵀ = [[1, .5, 0], [.5, .5, .5], [0, .5, 1]]; keep j <= i, divide by row sum (+ eps = 0).
  const Matrix<T> w = diag::attention_weights<T>(g, g, /*causal=*/true, /*eps=*/0.0);
  Matrix<double> expected(3, 3);
  expected << 1, 0, 0,  //
      0.5, 0.5, 0,      //
      0, 1.0 / 3, 2.0 / 3;
  EXPECT_TRUE(mixattn::testing::all_close(Matrix<double>(w.template cast<double>()), expected, 0.0,
                                          this->tol));
  const Matrix<T> full = diag::attention_weights<T>(g, g, /*causal=*/false, /*eps=*/0.0);
  expected << 2.0 / 3, 1.0 / 3, 0,  //
      1.0 / 3, 1.0 / 3, 1.0 / 3,    //
      0, 1.0 / 3, 2.0 / 3;
  EXPECT_TRUE(mixattn::testing::all_close(Matrix<double>(full.template cast<double>()), expected,
                                          0.0, this->tol));
}

TYPED_TEST(DiagnosticsTyped, AffinityRefusesLargeOrMismatchedInputs) {
  using T = TypeParam;
  const Matrix<T> gq = Matrix<T>::Constant(10, 2, T(0.5));
  const Matrix<T> gk = Matrix<T>::Constant(11, 2, T(0.5));
  EXPECT_NO_THROW(diag::affinity<T>(gq, gk, 110));
  EXPECT_THROW(diag::affinity<T>(gq, gk, 109), std::invalid_argument);
  const Matrix<T> g3 = Matrix<T>::Constant(11, 3, T(1.0 / 3));
  EXPECT_THROW(diag::affinity<T>(gq, g3), std::invalid_argument);
  EXPECT_THROW(diag::attention_weights<T>(gq, gk, /*causal=*/true), std::invalid_argument);
}

TYPED_TEST(DiagnosticsTyped, BadResponsibilitiesAreRejected) {
  using T = TypeParam;
  const Matrix<T> empty(0, 3);
  EXPECT_THROW(diag::mean_usage<T>(empty), std::invalid_argument);
  Matrix<T> negative = Matrix<T>::Constant(2, 2, T(0.5));
  negative(1, 0) = T(-0.1);
  EXPECT_THROW(diag::usage_entropy<T>(negative), std::invalid_argument);
  Matrix<T> nan = Matrix<T>::Constant(2, 2, T(0.5));
  nan(0, 1) = std::numeric_limits<T>::quiet_NaN();
  EXPECT_THROW(diag::hard_assignments<T>(nan), std::domain_error);
  try {
    diag::usage_entropy<T>(negative);
    ADD_FAILURE() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mixattn::diagnostics::usage_entropy: gamma"),
              std::string::npos)
        << e.what();
  }
}

// ---- NMI on labelings (not typed: labels are integers) ----

TEST(Nmi, IdenticalUpToRelabelingIsOne) {
  const std::vector<int> a{0, 0, 1, 1, 2, 2, 2};
  const std::vector<long> b{5, 5, -1, -1, 9, 9, 9};
  EXPECT_NEAR(diag::normalized_mutual_information(a, a), 1.0, 1e-12);
  EXPECT_NEAR(diag::normalized_mutual_information(a, b), 1.0, 1e-12);
}

TEST(Nmi, ProductConstructionIsExactlyIndependent) {
  // Every (a, b) pair appears equally often, so p_ab = p_a p_b and every log term is log 1 = 0.
  std::vector<int> a, b;
  for (int rep = 0; rep < 2; ++rep)
    for (int x = 0; x < 3; ++x)
      for (int y = 0; y < 4; ++y) {
        a.push_back(x);
        b.push_back(10 * y);
      }
  EXPECT_NEAR(diag::normalized_mutual_information(a, b), 0.0, 1e-15);
}

TEST(Nmi, RandomIndependentLargeSampleIsNearZero) {
  // Plug-in MI of independent labelings is biased up by about (La-1)(Lb-1)/(2N) nats
  // = 24/200000 ≈ 1.2e-4; divided by (H(A)+H(B))/2 ≈ 1.78 that is ≈ 7e-5. 1e-3 leaves a wide
  // margin for sampling noise while any real dependence (NMI ≥ 0.01) fails.
  const std::uint64_t seed = 20240607;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> da(0, 4), db(0, 6);
  std::vector<int> a(100000), b(100000);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = da(rng);
    b[i] = db(rng);
  }
  const double nmi = diag::normalized_mutual_information(a, b);
  EXPECT_LT(nmi, 1e-3) << "seed " << seed;
  EXPECT_GE(nmi, 0.0);
}

TEST(Nmi, HandComputedCase) {
  // A = [0 0 1 1], B = [0 0 0 1]. Joint counts: (0,0)=2, (1,0)=1, (1,1)=1; N = 4.
  // H(A) = log 2; H(B) = -(3/4 log 3/4 + 1/4 log 1/4);
  // I = 2/4 log(4·2/(2·3)) + 1/4 log(4·1/(2·3)) + 1/4 log(4·1/(2·1)).
  const double ha = std::log(2.0);
  const double hb = -(0.75 * std::log(0.75) + 0.25 * std::log(0.25));
  const double mi = 0.5 * std::log(4.0 / 3) + 0.25 * std::log(2.0 / 3) + 0.25 * std::log(2.0);
  const double expected = mi / (0.5 * (ha + hb));
  EXPECT_NEAR(expected, 0.343711, 1e-6);  // 0.2157616 / 0.6277411, evaluated by hand
  EXPECT_NEAR(diag::normalized_mutual_information(std::vector<int>{0, 0, 1, 1},
                                                  std::vector<int>{0, 0, 0, 1}),
              expected, 1e-14);
  // Symmetric in its arguments.
  EXPECT_NEAR(diag::normalized_mutual_information(std::vector<int>{0, 0, 0, 1},
                                                  std::vector<int>{0, 0, 1, 1}),
              expected, 1e-14);
}

TEST(Nmi, ConstantLabelings) {
  const std::vector<int> constant{3, 3, 3, 3};
  const std::vector<int> varied{0, 1, 0, 1};
  EXPECT_EQ(diag::normalized_mutual_information(constant, constant), 1.0);  // same partition
  EXPECT_EQ(diag::normalized_mutual_information(constant, varied), 0.0);
  EXPECT_EQ(diag::normalized_mutual_information(varied, constant), 0.0);
}

TEST(Nmi, BadInputsAreRejected) {
  EXPECT_THROW(diag::normalized_mutual_information(std::vector<int>{}, std::vector<int>{}),
               std::invalid_argument);
  try {
    diag::normalized_mutual_information(std::vector<int>{1, 2}, std::vector<int>{1});
    ADD_FAILURE() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("a has 2 labels but b has 1"), std::string::npos)
        << e.what();
  }
}

}  // namespace
