// Linear attention (SPEC.md section 4): forward against a direct double loop over (i, j) in both
// modes, the causal result across chunk lengths, float against double, every backward against
// central differences in double (bidirectional with N != M, N = 1, causal lengths that are not
// multiples of the chunk), argument validation and overflow reporting.
#include <mixattn/linear.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::testing::all_close;
using mixattn::testing::expect_throw;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;
namespace linear = mixattn::linear;

/// elu(x) + 1 written as the paper writes it.
double phi(double x) {
  return (x > 0 ? x : std::exp(x) - 1) + 1;
}

/// The definition, term by term in double: a_ij = phi(q_i) . phi(k_j) over the visible j,
/// out_i = sum_j a_ij v_j / (sum_j a_ij + eps).
template <class T>
Matrix<double> twin(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, bool causal,
                    double eps) {
  const Index n = q.rows(), m = k.rows(), r = q.cols(), dv = v.cols();
  Matrix<double> out = Matrix<double>::Zero(n, dv);
  for (Index i = 0; i < n; ++i) {
    double den = eps;
    for (Index j = 0; j < (causal ? i + 1 : m); ++j) {
      double a = 0;
      for (Index c = 0; c < r; ++c) a += phi(double(q(i, c))) * phi(double(k(j, c)));
      den += a;
      for (Index c = 0; c < dv; ++c) out(i, c) += a * double(v(j, c));
    }
    out.row(i) /= den;
  }
  return out;
}

struct Shape {
  Index n, m, r, dv;
  bool causal;
  Index chunk;  // 0: default
};

linear::Options options(const Shape& s) {
  linear::Options o;
  o.causal = s.causal;
  o.chunk = s.chunk;
  return o;
}

// N != M, N = 1, M = 1, causal lengths around the default chunk (32) and small explicit chunks
// that leave a partial last chunk.
const Shape kShapes[] = {{1, 1, 3, 2, false, 0},  {5, 8, 4, 3, false, 0},  {9, 3, 2, 5, false, 0},
                         {1, 6, 3, 2, false, 0},  {1, 1, 3, 2, true, 0},   {37, 37, 5, 4, true, 0},
                         {70, 70, 3, 6, true, 0}, {13, 13, 4, 3, true, 4}, {9, 9, 2, 2, true, 1}};

// Sums of the causal scan in another order (test_util.hpp).
template <class T>
using Tol = mixattn::testing::ScanTol<T>;

template <class T>
class Linear : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
struct ScalarName {
  template <class T>
  static std::string GetName(int) {
    return std::is_same<T, float>::value ? "float" : "double";
  }
};
TYPED_TEST_SUITE(Linear, Scalars, ScalarName);

TYPED_TEST(Linear, ForwardMatchesDoubleLoop) {
  using T = TypeParam;
  std::uint64_t seed = 100;
  for (const Shape& s : kShapes) {
    const Matrix<T> q = random_matrix<T>(s.n, s.r, ++seed), k = random_matrix<T>(s.m, s.r, ++seed);
    const Matrix<T> v = random_matrix<T>(s.m, s.dv, ++seed);
    const Matrix<T> out = linear::forward<T>(q, k, v, options(s));
    EXPECT_TRUE(all_close(out, twin(q, k, v, s.causal, 1e-6), Tol<T>::rtol, Tol<T>::atol))
        << "seed " << seed << " n " << s.n << " m " << s.m << " causal " << s.causal;
  }
}

// A large eps and inputs far below 0 (phi = e^x, tiny) make eps a visible share of the
// denominator: the twin agrees only if eps enters exactly once, where SPEC 4.2 puts it.
TYPED_TEST(Linear, EpsEntersTheDenominatorOnce) {
  using T = TypeParam;
  for (bool causal : {false, true}) {
    const Matrix<T> q = random_matrix<T>(6, 3, 1, 0.5).array() - T(3);
    const Matrix<T> k = random_matrix<T>(6, 3, 2, 0.5).array() - T(3);
    const Matrix<T> v = random_matrix<T>(6, 2, 3);
    linear::Options o;
    o.causal = causal;
    o.eps = 1e-3;
    EXPECT_TRUE(all_close(linear::forward<T>(q, k, v, o), twin(q, k, v, causal, 1e-3), Tol<T>::rtol,
                          Tol<T>::atol));
  }
}

TYPED_TEST(Linear, CausalChunkChangesOnlyRounding) {
  using T = TypeParam;
  const Matrix<T> q = random_matrix<T>(45, 4, 7), k = random_matrix<T>(45, 4, 8);
  const Matrix<T> v = random_matrix<T>(45, 3, 9);
  linear::Options o;
  o.causal = true;
  const Matrix<T> base = linear::forward<T>(q, k, v, o);
  for (Index chunk : {1, 5, 16, 45, 100}) {
    o.chunk = chunk;
    EXPECT_TRUE(all_close(linear::forward<T>(q, k, v, o), base, Tol<T>::rtol, Tol<T>::atol))
        << "chunk " << chunk;
  }
}

// Strided views (row blocks of a wider buffer) read the same values as compact matrices.
TYPED_TEST(Linear, StridedInputs) {
  using T = TypeParam;
  const Matrix<T> wide = random_matrix<T>(20, 12, 11);
  const Matrix<T> q = wide.block(0, 0, 20, 4), k = wide.block(0, 4, 20, 4);
  const Matrix<T> v = wide.block(0, 8, 20, 3);
  for (bool causal : {false, true}) {
    linear::Options o;
    o.causal = causal;
    linear::Saved<T> s1, s2;
    const Matrix<T> a = linear::forward<T>(q, k, v, o, &s1);
    const Matrix<T> b = linear::forward<T>(wide.block(0, 0, 20, 4), wide.block(0, 4, 20, 4),
                                           wide.block(0, 8, 20, 3), o, &s2);
    EXPECT_TRUE(a == b);  // the same values in the same order: the same bits
    const Matrix<T> g = random_matrix<T>(20, 3, 12);
    const linear::Grad<T> ga = linear::backward<T>(q, k, v, g, s1, o);
    const linear::Grad<T> gb = linear::backward<T>(wide.block(0, 0, 20, 4), wide.block(0, 4, 20, 4),
                                                   wide.block(0, 8, 20, 3), g, s2, o);
    EXPECT_TRUE(ga.q == gb.q && ga.k == gb.k && ga.v == gb.v);
  }
}

// float against double on the same (float-representable) inputs, forward and backward. The
// float path's relative error is ~M * 6e-8 per sum (state in double) and the gradients
// multiply a few such terms: 1e-4 relative / 1e-5 absolute on O(1) values leaves a margin of
// ~10 and still catches any missing term.
TEST(LinearPrecision, FloatAgreesWithDouble) {
  for (bool causal : {false, true}) {
    const Index n = 64, m = causal ? 64 : 48;
    const Matrix<float> qf = random_matrix<float>(n, 8, 21), kf = random_matrix<float>(m, 8, 22);
    const Matrix<float> vf = random_matrix<float>(m, 5, 23), gf = random_matrix<float>(n, 5, 24);
    const Matrix<double> qd = qf.cast<double>(), kd = kf.cast<double>(), vd = vf.cast<double>();
    linear::Options o;
    o.causal = causal;
    linear::Saved<float> sf;
    linear::Saved<double> sd;
    const Matrix<float> of = linear::forward<float>(qf, kf, vf, o, &sf);
    const Matrix<double> od = linear::forward<double>(qd, kd, vd, o, &sd);
    EXPECT_TRUE(all_close(of, od, 1e-4, 1e-5)) << "causal " << causal;
    const linear::Grad<float> gf_ = linear::backward<float>(qf, kf, vf, gf, sf, o);
    const linear::Grad<double> gd = linear::backward<double>(qd, kd, vd, gf.cast<double>(), sd, o);
    EXPECT_TRUE(all_close(gf_.q, gd.q, 1e-4, 1e-5)) << "causal " << causal;
    EXPECT_TRUE(all_close(gf_.k, gd.k, 1e-4, 1e-5)) << "causal " << causal;
    EXPECT_TRUE(all_close(gf_.v, gd.v, 1e-4, 1e-5)) << "causal " << causal;
  }
}

// Central differences in double of L = sum(W . forward(q, k, v)) for every entry of q, k, v.
// h = 1e-6 (test_util.hpp): truncation O(h^2 L''') and rounding O(1e-16 / h) give ~1e-9 absolute;
// phi is C^1 with a jump in phi'' at 0 costing O(h) only for entries within h of 0 (none for
// these seeds' Gaussian draws). 1e-6 relative / 1e-7 absolute leaves a margin of ~100.
TEST(LinearBackward, MatchesCentralDifferences) {
  std::uint64_t seed = 500;
  for (const Shape& s : kShapes) {
    if (s.n > 40) continue;  // the FD loop costs 2 forwards per entry
    Matrix<double> q = random_matrix<double>(s.n, s.r, ++seed);
    Matrix<double> k = random_matrix<double>(s.m, s.r, ++seed);
    Matrix<double> v = random_matrix<double>(s.m, s.dv, ++seed);
    const Matrix<double> w = random_matrix<double>(s.n, s.dv, ++seed);
    const linear::Options o = options(s);
    linear::Saved<double> saved;
    linear::forward<double>(q, k, v, o, &saved);
    const linear::Grad<double> g = linear::backward<double>(q, k, v, w, saved, o);
    const auto loss = [&] { return linear::forward<double>(q, k, v, o).cwiseProduct(w).sum(); };
    const std::string where = "seed " + std::to_string(seed) + " n " + std::to_string(s.n) + " m " +
                              std::to_string(s.m) + " causal " + std::to_string(s.causal);
    EXPECT_TRUE(all_close(g.q, numeric_gradient(q, loss), 1e-6, 1e-7)) << "dq " << where;
    EXPECT_TRUE(all_close(g.k, numeric_gradient(k, loss), 1e-6, 1e-7)) << "dk " << where;
    EXPECT_TRUE(all_close(g.v, numeric_gradient(v, loss), 1e-6, 1e-7)) << "dv " << where;
  }
}

// Inputs on both sides of 0 with a wide spread: the e^x branch (x << 0, phi' = phi) and the
// x + 1 branch (phi' = 1) both carry gradient.
TEST(LinearBackward, BothBranchesOfTheFeatureMap) {
  for (bool causal : {false, true}) {
    Matrix<double> q = random_matrix<double>(7, 3, 61, 3.0),
                   k = random_matrix<double>(7, 3, 62, 3.0);
    Matrix<double> v = random_matrix<double>(7, 2, 63);
    const Matrix<double> w = random_matrix<double>(7, 2, 64);
    ASSERT_LT(q.minCoeff(), -2.0);
    ASSERT_GT(q.maxCoeff(), 2.0);
    linear::Options o;
    o.causal = causal;
    o.chunk = 3;
    linear::Saved<double> saved;
    linear::forward<double>(q, k, v, o, &saved);
    const linear::Grad<double> g = linear::backward<double>(q, k, v, w, saved, o);
    const auto loss = [&] { return linear::forward<double>(q, k, v, o).cwiseProduct(w).sum(); };
    EXPECT_TRUE(all_close(g.q, numeric_gradient(q, loss), 1e-6, 1e-7)) << "causal " << causal;
    EXPECT_TRUE(all_close(g.k, numeric_gradient(k, loss), 1e-6, 1e-7)) << "causal " << causal;
    EXPECT_TRUE(all_close(g.v, numeric_gradient(v, loss), 1e-6, 1e-7)) << "causal " << causal;
  }
}

TEST(LinearEdges, EmptySequences) {
  const Matrix<double> none(0, 3), v0(0, 2);
  for (bool causal : {false, true}) {
    linear::Options o;
    o.causal = causal;
    linear::Saved<double> s;
    const Matrix<double> out = linear::forward<double>(none, none, v0, o, &s);
    EXPECT_EQ(out.rows(), 0);
    EXPECT_EQ(out.cols(), 2);
    const linear::Grad<double> g =
        linear::backward<double>(none, none, v0, Matrix<double>(0, 2), s, o);
    EXPECT_EQ(g.q.rows(), 0);
    EXPECT_EQ(g.k.cols(), 3);
    EXPECT_EQ(g.v.cols(), 2);
  }
  // Keys without queries are fine in the bidirectional form.
  const Matrix<double> k = random_matrix<double>(4, 3, 1), v = random_matrix<double>(4, 2, 2);
  linear::Saved<double> s;
  EXPECT_EQ(linear::forward<double>(none, k, v, {}, &s).rows(), 0);
  const linear::Grad<double> g = linear::backward<double>(none, k, v, Matrix<double>(0, 2), s);
  EXPECT_TRUE(g.k == Matrix<double>::Zero(4, 3) && g.v == Matrix<double>::Zero(4, 2));
  EXPECT_EQ(g.q.rows(), 0);
}

class LinearErrors : public ::testing::Test {
 protected:
  Matrix<double> q = random_matrix<double>(6, 3, 2), k = random_matrix<double>(6, 3, 3);
  Matrix<double> v = random_matrix<double>(6, 2, 4), w = random_matrix<double>(6, 2, 5);
  static constexpr const char* fwd = "mixattn::linear::forward";
  static constexpr const char* bwd = "mixattn::linear::backward";
  using IA = std::invalid_argument;
  using DE = std::domain_error;
};

TEST_F(LinearErrors, BadShapesAndOptions) {
  const Matrix<double> k4 = random_matrix<double>(6, 4, 6), v5 = random_matrix<double>(5, 2, 7);
  const Matrix<double> q7 = random_matrix<double>(7, 3, 8), r0(6, 0), k0(0, 3), v0(0, 2);
  expect_throw<IA>([&] { linear::forward<double>(q, k4, v); },
                   {fwd, "k has 4 columns but q has 3"});
  expect_throw<IA>([&] { linear::forward<double>(q, k, v5); }, {fwd, "v has 5 rows but k has 6"});
  expect_throw<IA>([&] { linear::forward<double>(r0, r0, v); }, {fwd, "q has 0 columns"});
  expect_throw<IA>([&] { linear::forward<double>(q, k0, v0); }, {fwd, "k has 0 rows but q has 6"});
  linear::Options causal;
  causal.causal = true;
  expect_throw<IA>([&] { linear::forward<double>(q7, k, v, causal); },
                   {fwd, "causal", "q has 7 rows and k has 6"});
  EXPECT_NO_THROW(linear::forward<double>(q7, k, v));  // N != M is fine bidirectionally
  for (double eps : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity()}) {
    linear::Options o;
    o.eps = eps;
    expect_throw<IA>([&] { linear::forward<double>(q, k, v, o); }, {fwd, "options.eps"});
  }
  linear::Options tiny;  // positive in double, 0 in float
  tiny.eps = 1e-300;
  EXPECT_NO_THROW(linear::forward<double>(q, k, v, tiny));
  const Matrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>();
  expect_throw<IA>([&] { linear::forward<float>(qf, kf, vf, tiny); },
                   {fwd, "options.eps is 1e-300"});
  linear::Options chunk;
  chunk.chunk = -2;
  expect_throw<IA>([&] { linear::forward<double>(q, k, v, chunk); }, {fwd, "options.chunk is -2"});
}

TEST_F(LinearErrors, NonFiniteInputs) {
  const double bad[] = {std::numeric_limits<double>::quiet_NaN(),
                        std::numeric_limits<double>::infinity()};
  for (double x : bad) {
    Matrix<double> qb = q, kb = k, vb = v;
    qb(2, 1) = x;
    kb(4, 0) = x;
    vb(5, 1) = x;
    expect_throw<DE>([&] { linear::forward<double>(qb, k, v); },
                     {fwd, "q has a non-finite entry at (2, 1)"});
    expect_throw<DE>([&] { linear::forward<double>(q, kb, v); },
                     {fwd, "k has a non-finite entry at (4, 0)"});
    expect_throw<DE>([&] { linear::forward<double>(q, k, vb); },
                     {fwd, "v has a non-finite entry at (5, 1)"});
    linear::Options off;
    off.check_finite = false;
    EXPECT_NO_THROW(linear::forward<double>(qb, kb, vb, off));
    linear::Saved<double> s;
    linear::forward<double>(q, k, v, {}, &s);
    Matrix<double> wb = w;
    wb(0, 0) = x;
    expect_throw<DE>([&] { linear::backward<double>(q, k, v, wb, s); },
                     {bwd, "grad_out has a non-finite"});
  }
}

// Finite inputs whose sums overflow T are reported, never returned as inf or NaN.
TEST_F(LinearErrors, OverflowIsReported) {
  const Matrix<float> big = Matrix<float>::Constant(4, 3, 1e13f);
  for (bool causal : {false, true}) {
    linear::Options o;
    o.causal = causal;
    expect_throw<DE>([&] { linear::forward<float>(big, big, big, o); },
                     {fwd, "the output overflows float although every input is finite"});
  }
}

TEST_F(LinearErrors, BackwardRecordMismatches) {
  linear::Saved<double> saved, empty;
  linear::forward<double>(q, k, v, {}, &saved);
  expect_throw<IA>([&] { linear::backward<double>(q, k, v, w, empty); },
                   {bwd, "saved was not filled"});
  const Matrix<double> w3 = random_matrix<double>(6, 3, 9);
  expect_throw<IA>([&] { linear::backward<double>(q, k, v, w3, saved); },
                   {bwd, "grad_out is 6 x 3 but the output is 6 x 2"});
  linear::Options causal;
  causal.causal = true;
  expect_throw<IA>([&] { linear::backward<double>(q, k, v, w, saved, causal); },
                   {bwd, "saved was made with causal = 0"});
  linear::Options eps;
  eps.eps = 1e-3;
  expect_throw<IA>([&] { linear::backward<double>(q, k, v, w, saved, eps); }, {bwd, "eps = 1e-06"});
  Matrix<double> q2 = q;
  q2.row(0).swap(q2.row(1));
  q2(0, 0) += 1;
  expect_throw<IA>([&] { linear::backward<double>(q2, k, v, w, saved); },
                   {bwd, "saved came from other data: q is different"});
  const Matrix<double> q5 = q.topRows(5);
  expect_throw<IA>([&] { linear::backward<double>(q5, k, v, w.topRows(5), saved); },
                   {bwd, "saved is for N = 6", "N = 5"});
}

}  // namespace
