// The papers' baselines beyond linear attention: Performer / FAVOR+ (SPEC.md section 5) and
// static-codebook VQ attention (section 6). Forwards against direct double loops over (i, j)
// from the definitions, the random draw's properties, the quantisation, every backward against
// central differences in double (the straight-through key gradient against differences in the
// quantised keys), argument validation.
#include <mixattn/linear.hpp>
#include <mixattn/performer.hpp>
#include <mixattn/vq.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
using mixattn::testing::all_close;
using mixattn::testing::expect_throw;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;
namespace performer = mixattn::performer;

struct Shape {
  Index n, m, r, dv, features;
  bool causal;
  Index chunk;  // 0: default
};

// N != M, N = 1, m < r, m > r and not a multiple of r, causal lengths around the default chunk
// (32) and small explicit chunks that leave a partial last chunk.
const Shape kShapes[] = {{1, 1, 3, 2, 5, false, 0},   {5, 8, 4, 3, 6, false, 0},
                         {9, 3, 2, 5, 1, false, 0},   {1, 1, 3, 2, 4, true, 0},
                         {37, 37, 5, 4, 12, true, 0}, {13, 13, 4, 3, 9, true, 4},
                         {9, 9, 2, 2, 3, true, 1},    {6, 6, 4, 3, 2, true, 0}};

performer::Options options(const Shape& s, double eps = 1e-6) {
  performer::Options o;
  o.causal = s.causal;
  o.chunk = s.chunk;
  o.eps = eps;
  return o;
}

/// The definition in double, term by term, without stabilising the features: with the
/// exponents u(x)_l = s w_l . x - s^2 |x|^2 / 2, a_ij = phi(q_i) . phi(k_j) = (1/m) sum_l
/// e^(u(q_i)_l + u(k_j)_l), and the read-out of SPEC 4.2 with the guard SPEC 5.2 says the
/// stabiliser turns eps into: eps e^(c_i + c_K), c_i = max_l u(q_i)_l, c_K = max_{j,l} u(k_j)_l.
/// Evaluated in log space (log a_ij by log-sum-exp, then a softmax over j and the guard), so it
/// stays exact where e^u overflows.
template <class T>
Matrix<double> twin(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, const Matrix<T>& w,
                    bool causal, double eps, double s = 0) {
  const Index n = q.rows(), m = k.rows(), r = q.cols(), dv = v.cols(), f = w.rows();
  if (s == 0) s = std::pow(double(r), -0.25);
  const auto u = [&](const Matrix<T>& x, Index i, Index l) {
    double a = 0, sq = 0;
    for (Index c = 0; c < r; ++c) {
      a += s * double(w(l, c)) * double(x(i, c));
      sq += double(x(i, c)) * double(x(i, c));
    }
    return a - s * s * sq / 2;
  };
  const double inf = std::numeric_limits<double>::infinity();
  double c_k = -inf;
  for (Index j = 0; j < m; ++j)
    for (Index l = 0; l < f; ++l) c_k = std::max(c_k, u(k, j, l));
  Matrix<double> out = Matrix<double>::Zero(n, dv);
  for (Index i = 0; i < n; ++i) {
    double c_i = -inf;
    for (Index l = 0; l < f; ++l) c_i = std::max(c_i, u(q, i, l));
    const Index visible = causal ? i + 1 : m;
    std::vector<double> log_a(visible);
    double top = std::log(eps) + c_i + c_k;  // the guard's log
    for (Index j = 0; j < visible; ++j) {
      double mx = -inf, sum = 0;
      for (Index l = 0; l < f; ++l) mx = std::max(mx, u(q, i, l) + u(k, j, l));
      for (Index l = 0; l < f; ++l) sum += std::exp(u(q, i, l) + u(k, j, l) - mx);
      log_a[j] = mx + std::log(sum / double(f));
      top = std::max(top, log_a[j]);
    }
    double den = std::exp(std::log(eps) + c_i + c_k - top);
    for (Index j = 0; j < visible; ++j) {
      const double a = std::exp(log_a[j] - top);
      den += a;
      for (Index c = 0; c < dv; ++c) out(i, c) += a * double(v(j, c));
    }
    out.row(i) /= den;
  }
  return out;
}

template <class T>
struct Tol;
// float: the features carry ~r * 6e-8 relative rounding in the exponent (|s w . x| <~ 10, so
// ~1e-6 relative in phi), the sums over M <= 37 keys another 37 * 6e-8, the state is in double,
// and O(1) outputs are ratios of positive sums: 5e-5 relative / 5e-6 absolute leaves ~10x.
template <>
struct Tol<float> {
  static constexpr double rtol = 5e-5, atol = 5e-6;
};
// double: the same argument at 1.1e-16 gives ~1e-14; 1e-11 leaves a margin of ~100 over
// exp's amplification of the exponent's rounding.
template <>
struct Tol<double> {
  static constexpr double rtol = 1e-11, atol = 1e-12;
};

template <class T>
class Performer : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
struct ScalarName {
  template <class T>
  static std::string GetName(int) {
    return std::is_same<T, float>::value ? "float" : "double";
  }
};
TYPED_TEST_SUITE(Performer, Scalars, ScalarName);

// Both draws, both modes; eps = 1e-6 (the default) and 0.05, where eps e^(c_i + c_K) is a
// visible share of the denominator: the twin agrees only if the library's features carry
// exactly the definition's 1/sqrt(m), |x|^2 / 2 and stabilisers.
TYPED_TEST(Performer, ForwardMatchesDoubleLoop) {
  using T = TypeParam;
  std::uint64_t seed = 100;
  for (const Shape& s : kShapes)
    for (double eps : {1e-6, 5e-2})
      for (performer::Draw draw : {performer::Draw::orthogonal, performer::Draw::iid}) {
        const Matrix<T> q = random_matrix<T>(s.n, s.r, ++seed),
                        k = random_matrix<T>(s.m, s.r, ++seed);
        const Matrix<T> v = random_matrix<T>(s.m, s.dv, ++seed);
        const auto f = performer::Features<T>::random(s.features, s.r, ++seed, draw);
        const Matrix<T> out = performer::forward<T>(q, k, v, f, options(s, eps));
        EXPECT_TRUE(all_close(out, twin(q, k, v, f.w, s.causal, eps), Tol<T>::rtol, Tol<T>::atol))
            << "seed " << seed << " n " << s.n << " m " << s.m << " causal " << s.causal << " eps "
            << eps;
      }
}

// Directions of equal length a (a times orthonormal rows, m = r = 4) and q, k near w_l / s:
// the unstabilised features reach e^(a^2 / 2), beyond T's range (a^2 = 400 in float, 2000 in
// double); the stabilised ones stay <= 1/sqrt(m) and the output matches the log-space twin.
// Tolerance: the exponents (~a^2) carry ~a^2 * r * 6e-8 ~ 1e-4 absolute rounding in float
// (~1e-12 in double), which is the relative error of the weights: 1e-3 / 1e-9 leave ~10x.
TYPED_TEST(Performer, LargeExponentsStayExact) {
  using T = TypeParam;
  const bool is_float = std::is_same<T, float>::value;
  const double a = is_float ? 20 : std::sqrt(2000.0);
  ASSERT_GT(a * a / 2, std::log(double(std::numeric_limits<T>::max())));
  const auto unit = performer::Features<double>::random(4, 4, 30);
  const Matrix<double> rows = unit.w.rowwise().normalized();
  performer::Features<T> f;
  f.w = (a * rows).template cast<T>();
  const double s = std::pow(4.0, -0.25);
  Matrix<T> q(8, 4), k(8, 4);
  const Matrix<double> nq = random_matrix<double>(8, 4, 31, 0.05);
  const Matrix<double> nk = random_matrix<double>(8, 4, 32, 0.05);
  for (Index i = 0; i < 8; ++i) {
    q.row(i) = (a * rows.row(i % 4) / s + nq.row(i)).template cast<T>();
    k.row(i) = (a * rows.row((i * 3) % 4) / s + nk.row(i)).template cast<T>();
  }
  const Matrix<T> v = random_matrix<T>(8, 3, 33);
  for (bool causal : {false, true}) {
    performer::Options o;
    o.causal = causal;
    const Matrix<T> out = performer::forward<T>(q, k, v, f, o);
    const double tol = is_float ? 1e-3 : 1e-9;
    EXPECT_TRUE(all_close(out, twin(q, k, v, f.w, causal, o.eps), tol, tol)) << "causal " << causal;
  }
}

// The stabilisers' positions (Saved::q_at, k_row, k_col), which the backward differentiates
// through: with exact ties, the first maximum of a query's row (least l) and, over the keys, the
// least column and then the least row. r = 16 makes s = r^(-1/4) = 1/2, and small integer
// entries make every exponent exact in float and double: w_l = 2 e_l (l < 4); keys 2 and 5 are
// 4 e_1 and 4 e_0, whose exponents s w_l . k - s^2 |k|^2 / 2 reach the largest possible value,
// 4 - 2 = 2, at (2, 1) and (5, 0) only (the others are at most 0.875): the answer is (5, 0),
// where the first maximum in row order would be (2, 1). Query rows tie at l = 0, 1 or at 2, 3
// (first: 0, 2) or have one maximum.
TYPED_TEST(Performer, StabiliserPositionsAreTheFirstMaxima) {
  using T = TypeParam;
  const Index m = 4, r = 16, n = 8;
  performer::Features<T> f;
  f.w = Matrix<T>::Zero(m, r);
  for (Index l = 0; l < m; ++l) f.w(l, l) = 2;
  Matrix<T> q = Matrix<T>::Zero(n, r), k = Matrix<T>::Zero(n, r);
  for (Index j = 0; j < n; ++j)
    for (Index c = 4; c < r; ++c) k(j, c) = static_cast<T>((j * 7 + c * 3) % 3 - 1);
  k.row(2).setZero();
  k.row(5).setZero();
  k(2, 1) = 4;
  k(5, 0) = 4;
  for (Index j : {0, 3, 6}) k(j, (j / 3) % 4) = 1;  // lower exponents elsewhere
  const Index ties[][2] = {{0, 1}, {2, 3}};
  for (Index i = 0; i < n; ++i) {
    if (i < 2) {
      q(i, ties[i][0]) = q(i, ties[i][1]) = 4;
    } else {
      q(i, i % 4) = static_cast<T>(1 + i);
      q(i, (i + 1) % 4) = static_cast<T>(i % 3);
    }
  }
  const Matrix<T> v = random_matrix<T>(n, 3, 53);
  const Index want_q[] = {0, 2, 2, 3, 0, 1, 2, 3};
  for (bool causal : {false, true}) {
    performer::Options o;
    o.causal = causal;
    performer::Saved<T> saved;
    performer::forward<T>(q, k, v, f, o, &saved);
    for (Index i = 0; i < n; ++i)
      EXPECT_EQ(saved.q_at[i], want_q[i]) << "query " << i << " causal " << causal;
    EXPECT_EQ(saved.k_row, 5) << "causal " << causal;
    EXPECT_EQ(saved.k_col, 0) << "causal " << causal;
  }
}

// The estimator's purpose: with many features phi(q) . phi(k) estimates exp(q . k / sqrt(r)),
// so the output approaches softmax attention's. r = 4, entries N(0, 0.5^2), m = 65536: the
// relative standard deviation of one pair's estimate is sqrt((e^(s^2 |q + k|^2) - 1) / m)
// ~ 0.005 for typical pairs (iid; orthogonal rows only lower it). In a model of this computation
// over 20 draws of such inputs the output error averaged 0.004 and peaked at 0.011 (the
// estimate is heavy-tailed in |q + k|). 0.025 absolute is ~6x the mean; an error in the
// definition (a missing |x|^2 / 2, the wrong scale, or directions not uniform on the sphere:
// Householder's Q without the sign fix errs by ~0.05 here) fails it.
TEST(PerformerKernel, ApproximatesSoftmaxAttention) {
  const Matrix<double> q = random_matrix<double>(6, 4, 41, 0.5);
  const Matrix<double> k = random_matrix<double>(6, 4, 42, 0.5);
  const Matrix<double> v = random_matrix<double>(6, 3, 43);
  const auto f = performer::Features<double>::random(65536, 4, 44);
  const Matrix<double> out = performer::forward<double>(q, k, v, f);
  Matrix<double> a = (q * k.transpose() / 2.0).array().exp();  // 1 / sqrt(r) = 1 / 2
  a.array().colwise() /= a.rowwise().sum().array();
  EXPECT_TRUE(all_close(out, a * v, 0, 0.025));
}

TEST(PerformerFeatures, SeededRedrawableAndOrthogonal) {
  const auto a = performer::Features<double>::random(10, 4, 7);
  const auto b = performer::Features<double>::random(10, 4, 7);
  EXPECT_TRUE(a.w == b.w);
  EXPECT_EQ(a.count(), 10);
  EXPECT_EQ(a.dim(), 4);
  // Rows within a block of r = 4 are orthogonal (the blocks are rows 0-3, 4-7, 8-9).
  for (Index b0 : {0, 4, 8}) {
    const Index rows = std::min<Index>(4, 10 - b0);
    const Matrix<double> blk = a.w.middleRows(b0, rows);
    Matrix<double> gram = blk * blk.transpose();
    const Matrix<double> diag = gram.diagonal().asDiagonal();
    EXPECT_TRUE(all_close(gram, diag, 0, 1e-12)) << "block " << b0;
    EXPECT_GT(gram.diagonal().minCoeff(), 0.0);
  }
  auto c = a;
  c.redraw(8);
  EXPECT_EQ(c.w.rows(), 10);
  EXPECT_EQ(c.w.cols(), 4);
  EXPECT_FALSE(c.w == a.w);
  c.redraw(7);
  EXPECT_TRUE(c.w == a.w);
  const auto iid = performer::Features<double>::random(10, 4, 7, performer::Draw::iid);
  EXPECT_FALSE(iid.w == a.w);
  const Matrix<double> g = iid.w.topRows(4) * iid.w.topRows(4).transpose();
  EXPECT_GT(std::abs(g(0, 1)), 1e-3);  // iid rows are not orthogonal
  // float is the double draw rounded
  EXPECT_TRUE(performer::Features<float>::random(10, 4, 7).w == a.w.cast<float>());
}

// Central differences in double of L = sum(G . forward(q, k, v)) for every entry of q, k, v,
// both modes. h = 1e-6: truncation O(h^2 L''') and rounding O(1e-16 / h) give ~1e-9 absolute;
// the stabilisers' argmax never changes within h for these seeds (no ties in the draws).
// 1e-6 relative / 1e-7 absolute leaves ~100x. eps = 0.05 makes the stabilisers' own gradient
// (it acts through eps e^(c_i + c_K)) a part of dq and dk well above the tolerance.
TEST(PerformerBackward, MatchesCentralDifferences) {
  std::uint64_t seed = 500;
  for (const Shape& s : kShapes)
    for (double eps : {1e-6, 5e-2}) {
      Matrix<double> q = random_matrix<double>(s.n, s.r, ++seed);
      Matrix<double> k = random_matrix<double>(s.m, s.r, ++seed);
      Matrix<double> v = random_matrix<double>(s.m, s.dv, ++seed);
      const Matrix<double> g = random_matrix<double>(s.n, s.dv, ++seed);
      const auto f = performer::Features<double>::random(s.features, s.r, ++seed);
      const performer::Options o = options(s, eps);
      performer::Saved<double> saved;
      performer::forward<double>(q, k, v, f, o, &saved);
      const performer::Grad<double> gr = performer::backward<double>(q, k, v, f, g, saved, o);
      const auto loss = [&] {
        return performer::forward<double>(q, k, v, f, o).cwiseProduct(g).sum();
      };
      const std::string where = "seed " + std::to_string(seed) + " n " + std::to_string(s.n) +
                                " causal " + std::to_string(s.causal) + " eps " +
                                std::to_string(eps);
      EXPECT_TRUE(all_close(gr.q, numeric_gradient(q, loss), 1e-6, 1e-7)) << "dq " << where;
      EXPECT_TRUE(all_close(gr.k, numeric_gradient(k, loss), 1e-6, 1e-7)) << "dk " << where;
      EXPECT_TRUE(all_close(gr.v, numeric_gradient(v, loss), 1e-6, 1e-7)) << "dv " << where;
    }
}

// float against double on the same (float-representable) inputs and features, backward. The
// float path's relative error is ~1e-6 in the features and ~M * 6e-8 per sum: 2e-4 relative /
// 2e-5 absolute on O(1) gradients leaves ~10x and still catches any missing term.
TEST(PerformerBackward, FloatAgreesWithDouble) {
  for (bool causal : {false, true}) {
    const Matrix<float> qf = random_matrix<float>(40, 6, 21), kf = random_matrix<float>(40, 6, 22);
    const Matrix<float> vf = random_matrix<float>(40, 5, 23), gf = random_matrix<float>(40, 5, 24);
    const auto ff = performer::Features<float>::random(16, 6, 25);
    const auto fd = performer::Features<double>::random(16, 6, 25);
    performer::Options o;
    o.causal = causal;
    performer::Saved<float> sf;
    performer::Saved<double> sd;
    performer::forward<float>(qf, kf, vf, ff, o, &sf);
    const Matrix<double> qd = qf.cast<double>(), kd = kf.cast<double>(), vd = vf.cast<double>();
    performer::forward<double>(qd, kd, vd, fd, o, &sd);
    const auto a = performer::backward<float>(qf, kf, vf, ff, gf, sf, o);
    const auto b = performer::backward<double>(qd, kd, vd, fd, gf.cast<double>(), sd, o);
    EXPECT_TRUE(all_close(a.q, b.q, 2e-4, 2e-5)) << "causal " << causal;
    EXPECT_TRUE(all_close(a.k, b.k, 2e-4, 2e-5)) << "causal " << causal;
    EXPECT_TRUE(all_close(a.v, b.v, 2e-4, 2e-5)) << "causal " << causal;
  }
}

// The earlier order of backward's arguments (features after grad_out), deprecated and kept for
// one release, gives the new order's gradients bit for bit, value form and _into form.
TEST(PerformerBackward, EarlierArgumentOrderGivesTheSameGradients) {
  const Matrix<double> q = random_matrix<double>(12, 4, 31), k = random_matrix<double>(12, 4, 32);
  const Matrix<double> v = random_matrix<double>(12, 3, 33), g = random_matrix<double>(12, 3, 34);
  const auto f = performer::Features<double>::random(8, 4, 35);
  for (bool causal : {false, true}) {
    performer::Options o;
    o.causal = causal;
    performer::Saved<double> s;
    performer::forward<double>(q, k, v, f, o, &s);
    const auto now = performer::backward<double>(q, k, v, f, g, s, o);
    performer::Grad<double> now_into, before_into;
    performer::backward_into<double>(now_into, q, k, v, f, g, s, o);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    const auto before = performer::backward<double>(q, k, v, g, f, s, o);
    performer::backward_into<double>(before_into, q, k, v, g, f, s, o);
#pragma GCC diagnostic pop
    EXPECT_TRUE(before.q == now.q && before.k == now.k && before.v == now.v) << "causal " << causal;
    EXPECT_TRUE(before_into.q == now_into.q && before_into.k == now_into.k &&
                before_into.v == now_into.v)
        << "causal " << causal;
    EXPECT_TRUE(now_into.q == now.q && now_into.k == now.k && now_into.v == now.v);
  }
}

TEST(PerformerEdges, EmptySequences) {
  const Matrix<double> none(0, 3), v0(0, 2);
  const auto f = performer::Features<double>::random(5, 3, 1);
  for (bool causal : {false, true}) {
    performer::Options o;
    o.causal = causal;
    performer::Saved<double> s;
    EXPECT_EQ(performer::forward<double>(none, none, v0, f, o, &s).rows(), 0);
    const auto g = performer::backward<double>(none, none, v0, f, Matrix<double>(0, 2), s, o);
    EXPECT_EQ(g.q.rows(), 0);
    EXPECT_EQ(g.k.cols(), 3);
  }
  const Matrix<double> k = random_matrix<double>(4, 3, 1), v = random_matrix<double>(4, 2, 2);
  performer::Saved<double> s;
  EXPECT_EQ(performer::forward<double>(none, k, v, f, {}, &s).rows(), 0);
  const auto g = performer::backward<double>(none, k, v, f, Matrix<double>(0, 2), s);
  EXPECT_TRUE(g.k == Matrix<double>::Zero(4, 3) && g.v == Matrix<double>::Zero(4, 2));
}

// A record filled by a call with queries, then reused by one with none (an empty sequence of a
// batch): the backward must accept it, as it accepts a fresh record (it keeps per-query
// positions; VQ's twin test is VqEdges.RecordReusedForNoQueries).
TEST(PerformerEdges, RecordReusedForNoQueries) {
  const Matrix<double> q = random_matrix<double>(5, 3, 11), none(0, 3);
  const Matrix<double> k = random_matrix<double>(4, 3, 12), v = random_matrix<double>(4, 2, 13);
  const auto f = performer::Features<double>::random(5, 3, 1);
  performer::Saved<double> s;
  performer::forward<double>(q, k, v, f, {}, &s);
  EXPECT_EQ(performer::forward<double>(none, k, v, f, {}, &s).rows(), 0);
  const auto g = performer::backward<double>(none, k, v, f, Matrix<double>(0, 2), s);
  EXPECT_TRUE(g.k == Matrix<double>::Zero(4, 3) && g.v == Matrix<double>::Zero(4, 2));
}

class PerformerErrors : public ::testing::Test {
 protected:
  Matrix<double> q = random_matrix<double>(6, 3, 2), k = random_matrix<double>(6, 3, 3);
  Matrix<double> v = random_matrix<double>(6, 2, 4), g = random_matrix<double>(6, 2, 5);
  performer::Features<double> f = performer::Features<double>::random(4, 3, 6);
  static constexpr const char* fwd = "mixattn::performer::forward";
  static constexpr const char* bwd = "mixattn::performer::backward";
  using IA = std::invalid_argument;
  using DE = std::domain_error;
};

TEST_F(PerformerErrors, BadShapesAndOptions) {
  const Matrix<double> k4 = random_matrix<double>(6, 4, 6), v5 = random_matrix<double>(5, 2, 7);
  expect_throw<IA>([&] { performer::forward<double>(q, k4, v, f); },
                   {fwd, "k has 4 columns but q has 3"});
  expect_throw<IA>([&] { performer::forward<double>(q, k, v5, f); },
                   {fwd, "v has 5 rows but k has 6"});
  performer::Features<double> wrong = performer::Features<double>::random(4, 5, 1);
  expect_throw<IA>([&] { performer::forward<double>(q, k, v, wrong); },
                   {fwd, "features.w is 4 x 5 but q is 6 x 3"});
  performer::Features<double> none;
  none.w.resize(0, 3);
  expect_throw<IA>([&] { performer::forward<double>(q, k, v, none); },
                   {fwd, "features.w is 0 x 3", "m >= 1"});
  for (double sc :
       {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    performer::Options o;
    o.scale = sc;
    expect_throw<IA>([&] { performer::forward<double>(q, k, v, f, o); }, {fwd, "options.scale"});
  }
  performer::Options causal;
  causal.causal = true;
  const Matrix<double> q7 = random_matrix<double>(7, 3, 8);
  expect_throw<IA>([&] { performer::forward<double>(q7, k, v, f, causal); },
                   {fwd, "q has 7 rows and k has 6"});
  performer::Options eps;
  eps.eps = 0;
  expect_throw<IA>([&] { performer::forward<double>(q, k, v, f, eps); }, {fwd, "options.eps"});
  expect_throw<IA>([&] { performer::Features<double>::random(0, 3, 1); },
                   {"performer::Features::random", "m is 0"});
}

TEST_F(PerformerErrors, NonFiniteInputs) {
  performer::Features<double> bad = f;
  bad.w(1, 2) = std::numeric_limits<double>::quiet_NaN();
  expect_throw<DE>([&] { performer::forward<double>(q, k, v, bad); },
                   {fwd, "features.w has a non-finite entry at (1, 2)"});
  Matrix<double> qb = q;
  qb(2, 1) = std::numeric_limits<double>::infinity();
  expect_throw<DE>([&] { performer::forward<double>(qb, k, v, f); },
                   {fwd, "q has a non-finite entry at (2, 1)"});
}

TEST_F(PerformerErrors, BackwardRecordMismatches) {
  performer::Saved<double> saved, empty;
  performer::forward<double>(q, k, v, f, {}, &saved);
  expect_throw<IA>([&] { performer::backward<double>(q, k, v, f, g, empty); },
                   {bwd, "saved was not filled"});
  performer::Features<double> other = f;
  other.redraw(99);
  expect_throw<IA>([&] { performer::backward<double>(q, k, v, other, g, saved); },
                   {bwd, "saved came from other data: features.w is different"});
  performer::Options scaled;
  scaled.scale = 0.5;
  expect_throw<IA>([&] { performer::backward<double>(q, k, v, f, g, saved, scaled); },
                   {bwd, "scale = 0 but options give scale = 0.5"});
  const auto more = performer::Features<double>::random(5, 3, 6);
  expect_throw<IA>([&] { performer::backward<double>(q, k, v, more, g, saved); },
                   {bwd, "saved is for", "features = 4", "features = 5"});
  Matrix<double> k2 = k;
  k2(0, 0) += 1;
  expect_throw<IA>([&] { performer::backward<double>(q, k2, v, f, g, saved); },
                   {bwd, "saved came from other data: k is different"});
  const Matrix<double> g3 = random_matrix<double>(6, 3, 9);
  expect_throw<IA>([&] { performer::backward<double>(q, k, v, f, g3, saved); },
                   {bwd, "grad_out is 6 x 3"});
}

// ---------------------------------------------------------------------------------------------
// Static-codebook VQ attention (SPEC.md section 6).

namespace vq = mixattn::vq;

/// Nearest code by brute force in double, ties to the lowest index; also the gap between the
/// best and the second-best squared distance (how far the key is from a tie).
template <class T>
Index nearest(const Matrix<T>& k, Index j, const Matrix<T>& c, double* gap = nullptr) {
  Index best = 0;
  double d0 = std::numeric_limits<double>::infinity(), d1 = d0;
  for (Index s = 0; s < c.rows(); ++s) {
    const double d =
        (k.row(j).template cast<double>() - c.row(s).template cast<double>()).squaredNorm();
    if (d < d0) {
      d1 = d0;
      d0 = d;
      best = s;
    } else if (d < d1) {
      d1 = d;
    }
  }
  if (gap) *gap = d1 - d0;
  return best;
}

/// The definition in double, term by term: softmax-style weights of the quantised keys
/// w_ij = e^(tau q_i . k^_j - m_i) / sqrt(S), m_i = max_s tau q_i . C_s (SPEC 6.2), and
/// out_i = sum_j w_ij v_j / (sum_j w_ij + eps). kq: the quantised keys k^ (M x r), free here so
/// that central differences in them give the straight-through gradient.
template <class T>
Matrix<double> vq_twin(const Matrix<T>& q, const Matrix<double>& kq, const Matrix<T>& v,
                       const Matrix<T>& c, bool causal, double eps) {
  const Index n = q.rows(), m = kq.rows(), dv = v.cols(), S = c.rows();
  const double tau = 1 / std::sqrt(double(q.cols()));
  const Matrix<double> qd = q.template cast<double>(), cd = c.template cast<double>();
  Matrix<double> out = Matrix<double>::Zero(n, dv);
  for (Index i = 0; i < n; ++i) {
    const double mi = tau * (cd * qd.row(i).transpose()).maxCoeff();
    double den = eps;
    for (Index j = 0; j < (causal ? i + 1 : m); ++j) {
      const double w = std::exp(tau * qd.row(i).dot(kq.row(j)) - mi) / std::sqrt(double(S));
      den += w;
      out.row(i) += w * v.row(j).template cast<double>();
    }
    out.row(i) /= den;
  }
  return out;
}

template <class T>
Matrix<double> quantised(const Matrix<T>& k, const Matrix<T>& c) {
  Matrix<double> kq(k.rows(), k.cols());
  for (Index j = 0; j < k.rows(); ++j) kq.row(j) = c.row(nearest(k, j, c)).template cast<double>();
  return kq;
}

struct VqShape {
  Index n, m, r, dv, codes;
  bool causal;
  Index chunk;
};
const VqShape kVqShapes[] = {{1, 1, 3, 2, 4, false, 0},  {5, 8, 4, 3, 3, false, 0},
                             {9, 3, 2, 5, 1, false, 0},  {1, 1, 3, 2, 5, true, 0},
                             {37, 37, 5, 4, 6, true, 0}, {13, 13, 4, 3, 4, true, 4},
                             {9, 9, 2, 2, 3, true, 1}};

vq::Options vq_options(const VqShape& s, double eps = 1e-6) {
  vq::Options o;
  o.causal = s.causal;
  o.chunk = s.chunk;
  o.eps = eps;
  return o;
}

template <class T>
class Vq : public ::testing::Test {};
TYPED_TEST_SUITE(Vq, Scalars, ScalarName);

// Both modes, eps = 1e-6 and 0.05 (where the guard is a visible share of the denominator).
// Tolerances as for Performer above: the weights' exponents tau q . C are O(1) here.
TYPED_TEST(Vq, ForwardMatchesDoubleLoop) {
  using T = TypeParam;
  std::uint64_t seed = 700;
  for (const VqShape& s : kVqShapes)
    for (double eps : {1e-6, 5e-2}) {
      const Matrix<T> q = random_matrix<T>(s.n, s.r, ++seed),
                      k = random_matrix<T>(s.m, s.r, ++seed);
      const Matrix<T> v = random_matrix<T>(s.m, s.dv, ++seed);
      const Matrix<T> c = random_matrix<T>(s.codes, s.r, ++seed);
      const Matrix<T> out = vq::forward<T>(q, k, v, c, vq_options(s, eps));
      EXPECT_TRUE(all_close(out, vq_twin(q, quantised(k, c), v, c, s.causal, eps), Tol<T>::rtol,
                            Tol<T>::atol))
          << "seed " << seed << " n " << s.n << " causal " << s.causal << " eps " << eps;
      const auto z = vq::assign<T>(k, c);
      for (Index j = 0; j < s.m; ++j) EXPECT_EQ(z[j], nearest(k, j, c)) << "key " << j;
    }
}

// SPEC 6.2's other form: attention over the S codes with a log-count bias and per-code value
// means, o_i = sum_s e^(tau q_i . C_s + log n_s) vbar_s / sum_s e^(tau q_i . C_s + log n_s),
// codes without keys left out. eps = 1e-300 makes the guard negligible (relative 1e-299).
TEST(VqForward, AttentionOverCodesWithLogCountBias) {
  const Index n = 7, m = 20, r = 3, S = 5;
  const Matrix<double> q = random_matrix<double>(n, r, 81), k = random_matrix<double>(m, r, 82);
  const Matrix<double> v = random_matrix<double>(m, 2, 83), c = random_matrix<double>(S, r, 84);
  Vector<double> count = Vector<double>::Zero(S);
  Matrix<double> sum = Matrix<double>::Zero(S, 2);
  for (Index j = 0; j < m; ++j) {
    const Index s = nearest(k, j, c);
    count[s] += 1;
    sum.row(s) += v.row(j);
  }
  ASSERT_GE((count.array() > 0).count(), 3);  // several codes in use, at least one count > 1
  ASSERT_GT(count.maxCoeff(), 1);
  Matrix<double> expect(n, 2);
  for (Index i = 0; i < n; ++i) {
    double den = 0;
    expect.row(i).setZero();
    for (Index s = 0; s < S; ++s) {
      if (count[s] == 0) continue;
      const double w = std::exp(q.row(i).dot(c.row(s)) / std::sqrt(double(r)) + std::log(count[s]));
      den += w;
      expect.row(i) += w * sum.row(s) / count[s];
    }
    expect.row(i) /= den;
  }
  vq::Options o;
  o.eps = 1e-300;
  EXPECT_TRUE(all_close(vq::forward<double>(q, k, v, c, o), expect, 1e-12, 1e-13));
}

TEST(VqForward, TiesGoToTheLowestCode) {
  Matrix<double> c(3, 2);
  c << 1, 0, -1, 0, 1, 0;  // codes 0 and 2 equal; (0, 1) is equidistant from all three
  Matrix<double> k(3, 2);
  k << 0, 1, 2, 0, 0.5, 0;
  const auto z = vq::assign<double>(k, c);
  EXPECT_EQ(z[0], 0);
  EXPECT_EQ(z[1], 0);
  EXPECT_EQ(z[2], 0);
}

// Central differences in double for q, v and the codebook (the quantisation is piecewise
// constant: every key is at least 1e-3 in squared distance from a tie, so a step of h = 1e-6 in
// k or C never changes a code, and the forward is smooth in the step); for k, the forward is
// constant in such steps (its central difference is exactly 0) and the straight-through gradient
// is checked against central differences of the twin in the quantised keys k^ instead.
// Tolerances as for Performer's check.
TEST(VqBackward, MatchesCentralDifferences) {
  std::uint64_t seed = 900;
  for (const VqShape& s : kVqShapes)
    for (double eps : {1e-6, 5e-2}) {
      Matrix<double> q = random_matrix<double>(s.n, s.r, ++seed);
      Matrix<double> k = random_matrix<double>(s.m, s.r, ++seed);
      Matrix<double> v = random_matrix<double>(s.m, s.dv, ++seed);
      Matrix<double> c = random_matrix<double>(s.codes, s.r, ++seed);
      const Matrix<double> g = random_matrix<double>(s.n, s.dv, ++seed);
      for (Index j = 0; j < s.m; ++j) {
        double gap = 0;
        nearest(k, j, c, &gap);
        ASSERT_GT(gap, 1e-3) << "seed " << seed << " key " << j << " is near a tie";
      }
      const vq::Options o = vq_options(s, eps);
      vq::Saved<double> saved;
      vq::forward<double>(q, k, v, c, o, &saved);
      const vq::Grad<double> gr = vq::backward<double>(q, k, v, c, g, saved, o);
      const auto loss = [&] { return vq::forward<double>(q, k, v, c, o).cwiseProduct(g).sum(); };
      const std::string where = "seed " + std::to_string(seed) + " n " + std::to_string(s.n) +
                                " causal " + std::to_string(s.causal);
      EXPECT_TRUE(all_close(gr.q, numeric_gradient(q, loss), 1e-6, 1e-7)) << "dq " << where;
      EXPECT_TRUE(all_close(gr.v, numeric_gradient(v, loss), 1e-6, 1e-7)) << "dv " << where;
      EXPECT_TRUE(all_close(gr.codebook, numeric_gradient(c, loss), 1e-6, 1e-7)) << "dC " << where;
      EXPECT_TRUE(numeric_gradient(k, loss).isZero(0.0)) << "forward not constant in k " << where;
      Matrix<double> kq = quantised(k, c);
      const auto twin_loss = [&] {
        return vq_twin(q, kq, v, c, s.causal, eps).cwiseProduct(g).sum();
      };
      EXPECT_TRUE(all_close(gr.k, numeric_gradient(kq, twin_loss), 1e-6, 1e-7)) << "dk " << where;
    }
}

// As PerformerEdges.RecordReusedForNoQueries: VQ keeps per-query positions too.
TEST(VqEdges, RecordReusedForNoQueries) {
  const Matrix<double> q = random_matrix<double>(5, 3, 11), none(0, 3);
  const Matrix<double> k = random_matrix<double>(4, 3, 12), v = random_matrix<double>(4, 2, 13);
  const Matrix<double> c = random_matrix<double>(4, 3, 14);
  vq::Saved<double> vs;
  vq::forward<double>(q, k, v, c, {}, &vs);
  EXPECT_EQ(vq::forward<double>(none, k, v, c, {}, &vs).rows(), 0);
  const auto gv = vq::backward<double>(none, k, v, c, Matrix<double>(0, 2), vs);
  EXPECT_EQ(gv.q.rows(), 0);
  EXPECT_TRUE(gv.v == Matrix<double>::Zero(4, 2));
}

class VqErrors : public ::testing::Test {
 protected:
  Matrix<double> q = random_matrix<double>(6, 3, 2), k = random_matrix<double>(6, 3, 3);
  Matrix<double> v = random_matrix<double>(6, 2, 4), g = random_matrix<double>(6, 2, 5);
  Matrix<double> c = random_matrix<double>(4, 3, 6);
  static constexpr const char* fwd = "mixattn::vq::forward";
  static constexpr const char* bwd = "mixattn::vq::backward";
  using IA = std::invalid_argument;
  using DE = std::domain_error;
};

TEST_F(VqErrors, BadShapesOptionsAndRecords) {
  const Matrix<double> c5 = random_matrix<double>(4, 5, 1), c0(0, 3);
  expect_throw<IA>([&] { vq::forward<double>(q, k, v, c5); },
                   {fwd, "codebook is 4 x 5 but q is 6 x 3"});
  expect_throw<IA>([&] { vq::forward<double>(q, k, v, c0); }, {fwd, "codebook is 0 x 3", "S >= 1"});
  expect_throw<IA>([&] { vq::assign<double>(k, c5); },
                   {"mixattn::vq::assign", "codebook is 4 x 5"});
  const Matrix<double> v5 = random_matrix<double>(5, 2, 7);
  expect_throw<IA>([&] { vq::forward<double>(q, k, v5, c); }, {fwd, "v has 5 rows but k has 6"});
  vq::Options neg;
  neg.scale = -1;
  expect_throw<IA>([&] { vq::forward<double>(q, k, v, c, neg); }, {fwd, "options.scale is -1"});
  Matrix<double> cb = c;
  cb(1, 1) = std::numeric_limits<double>::quiet_NaN();
  expect_throw<DE>([&] { vq::forward<double>(q, k, v, cb); },
                   {fwd, "codebook has a non-finite entry at (1, 1)"});
  vq::Saved<double> saved, empty;
  vq::forward<double>(q, k, v, c, {}, &saved);
  expect_throw<IA>([&] { vq::backward<double>(q, k, v, c, g, empty); },
                   {bwd, "saved was not filled"});
  Matrix<double> c2 = c;
  c2(0, 0) += 1;
  expect_throw<IA>([&] { vq::backward<double>(q, k, v, c2, g, saved); },
                   {bwd, "saved came from other data: codebook is different"});
  vq::Options scaled;
  scaled.scale = 0.5;
  expect_throw<IA>([&] { vq::backward<double>(q, k, v, c, g, saved, scaled); },
                   {bwd, "scale = 0 but options give scale = 0.5"});
  const Matrix<double> g3 = random_matrix<double>(6, 3, 9);
  expect_throw<IA>([&] { vq::backward<double>(q, k, v, c, g3, saved); },
                   {bwd, "grad_out is 6 x 3"});
}

// The caller-owned-output forms validate as the value-returning ones do, naming themselves: a key
// matrix of the wrong width, and a backward given a record no forward filled.
TEST(BaselineIntoForms, RejectBadShapesAndEmptyRecordsWithTheirNames) {
  using IA = std::invalid_argument;
  namespace linear = mixattn::linear;
  const Matrix<double> q = random_matrix<double>(6, 4, 1), k = random_matrix<double>(6, 4, 2);
  const Matrix<double> v = random_matrix<double>(6, 3, 3), g = random_matrix<double>(6, 3, 4);
  const Matrix<double> k5 = random_matrix<double>(6, 5, 5);
  const Matrix<double> c = random_matrix<double>(7, 4, 6);
  const performer::Features<double> f = performer::Features<double>::random(8, 4, 7);
  Matrix<double> out;
  const char* wide = "k has 5 columns but q has 4";
  const char* empty = "saved was not filled by forward";

  linear::Saved<double> ls;
  linear::Grad<double> lg;
  expect_throw<IA>([&] { linear::forward_into<double>(out, q, k5, v, {}, &ls); },
                   {"mixattn::linear::forward_into", wide});
  expect_throw<IA>([&] { linear::backward_into<double>(lg, q, k, v, g, ls, {}); },
                   {"mixattn::linear::backward_into", empty});

  performer::Saved<double> ps;
  performer::Grad<double> pg;
  expect_throw<IA>([&] { performer::forward_into<double>(out, q, k5, v, f, {}, &ps); },
                   {"mixattn::performer::forward_into", wide});
  expect_throw<IA>([&] { performer::backward_into<double>(pg, q, k, v, f, g, ps, {}); },
                   {"mixattn::performer::backward_into", empty});

  vq::Saved<double> vs;
  vq::Grad<double> vg;
  expect_throw<IA>([&] { vq::forward_into<double>(out, q, k5, v, c, {}, &vs); },
                   {"mixattn::vq::forward_into"});
  expect_throw<IA>([&] { vq::backward_into<double>(vg, q, k, v, c, g, vs, {}); },
                   {"mixattn::vq::backward_into", empty});
}

}  // namespace
