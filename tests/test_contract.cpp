// What the README and API.md promise about calling the library: plain matrices deduce T,
// column-major data is either refused at compile time (tests/compile_fail/) or read in place
// through .transpose(), a prepared mixture gives the same responsibilities, and the smaller
// rules (beta > 0, messages that name the dimension, queries without keys, the layer's threads).
#include "test_util.hpp"

#include <mixattn/diagnostics.hpp>
#include <mixattn/gma.hpp>
#include <mixattn/layer.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/reference.hpp>

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

namespace {

using mixattn::ConstMatrixRef;
using mixattn::Index;
using mixattn::Matrix;
using mixattn::testing::random_matrix;
namespace md = mixattn::detail;

template <class T>
class Contract : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Contract, Scalars);

template <class E, class F>
std::string message_of(F&& call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception";
  return {};
}

// Which argument types are read in place and which would be copied (and are refused).
static_assert(!md::copied_layout<float, Matrix<float>>::value, "row-major binds");
static_assert(!md::copied_layout<float, Eigen::Map<const Matrix<float>>>::value, "row-major Map");
static_assert(!md::copied_layout<float, Eigen::Transpose<const Eigen::MatrixXf>>::value,
              "the transpose of a column-major matrix binds");
static_assert(md::copied_layout<float, Eigen::MatrixXf>::value, "column-major is refused");
static_assert(md::copied_layout<double, Eigen::Map<Eigen::MatrixXd>>::value, "its Map too");
static_assert(md::copied_layout<float, Eigen::Block<Eigen::MatrixXf>>::value, "and its blocks");
static_assert(!md::copied_layout<float, Eigen::MatrixXd>::value, "other scalars: Eigen's error");
static_assert(!md::supported_scalar<Eigen::half> && !md::supported_scalar<Eigen::bfloat16>,
              "half and bfloat16 are refused");

// A column-major d x N matrix (tokens in columns) passed as .transpose() is read in place, and
// gives bitwise the results of the same values stored row-major.
TYPED_TEST(Contract, TransposedColumnMajorIsReadInPlace) {
  using T = TypeParam;
  using CM = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;  // column-major
  const Index n = 12, r = 4, dv = 3;
  const CM qt = random_matrix<T>(n, r, 1).transpose(), kt = random_matrix<T>(n, r, 2).transpose();
  const CM vt = random_matrix<T>(n, dv, 3).transpose();
  const ConstMatrixRef<T> view = qt.transpose();
  EXPECT_EQ(view.data(), qt.data()) << "the view must alias the caller's buffer, not a copy";
  const Matrix<T> q = qt.transpose(), k = kt.transpose(), v = vt.transpose();
  const auto mix = mixattn::gma::Mixture<T>::random(3, r, 4);
  EXPECT_TRUE((mixattn::gma::forward(mix, qt.transpose(), kt.transpose(), vt.transpose()).array() ==
               mixattn::gma::forward(mix, q, k, v).array())
                  .all());
  EXPECT_TRUE((mixattn::reference::flash_forward(qt.transpose(), kt.transpose(), vt.transpose())
                   .array() == mixattn::reference::flash_forward<T>(q, k, v).array())
                  .all());
}

// reference:: and diagnostics:: deduce T from plain matrices, and agree with the explicit form.
TYPED_TEST(Contract, ReferenceAndDiagnosticsDeduceT) {
  using T = TypeParam;
  namespace ref = mixattn::reference;
  namespace dg = mixattn::diagnostics;
  const Matrix<T> q = random_matrix<T>(9, 4, 5), k = random_matrix<T>(9, 4, 6);
  const Matrix<T> v = random_matrix<T>(9, 3, 7), d = random_matrix<T>(9, 3, 8);
  ref::Saved<T> s1, s2;
  EXPECT_TRUE((ref::naive_forward(q, k, v, {}, &s1).array() ==
               ref::naive_forward<T>(q, k, v, {}, &s2).array()).all());
  EXPECT_TRUE((ref::naive_backward(q, k, v, d, s1).q.array() ==
               ref::naive_backward<T>(q, k, v, d, s2).q.array()).all());
  EXPECT_TRUE((ref::flash_forward(q, k, v, {}, &s1).array() ==
               ref::flash_forward<T>(q, k, v, {}, &s2).array()).all());
  EXPECT_TRUE((ref::flash_backward(q, k, v, d, s1).k.array() ==
               ref::flash_backward<T>(q, k, v, d, s2).k.array()).all());
  const Matrix<T> g = mixattn::gma::responsibilities(mixattn::gma::Mixture<T>::random(3, 4, 9), q);
  EXPECT_TRUE((dg::mean_usage(g).array() == dg::mean_usage<T>(g).array()).all());
  EXPECT_EQ(dg::components_used(g), dg::components_used<T>(g));
  EXPECT_EQ(dg::usage_entropy(g), dg::usage_entropy<T>(g));
  EXPECT_EQ(dg::hard_assignments(g), dg::hard_assignments<T>(g));
  const std::vector<int> labels{0, 1, 2, 0, 1, 2, 0, 1, 2};
  EXPECT_EQ(dg::assignment_nmi(g, labels), dg::assignment_nmi<T>(g, labels));
  EXPECT_TRUE((dg::affinity(g, g).array() == dg::affinity<T>(g, g).array()).all());
  EXPECT_TRUE((dg::attention_weights(g, g, true).array() ==
               dg::attention_weights<T>(g, g, true).array()).all());
}

// A mixture prepared once gives bitwise the responsibilities of the one-call form, row by row
// as in bulk (the kernel treats every row alike).
TYPED_TEST(Contract, PreparedMixtureMatchesOneCallForm) {
  using T = TypeParam;
  const auto mix = mixattn::gma::Mixture<T>::random(7, 5, 10);
  const Matrix<T> x = random_matrix<T>(11, 5, 11);
  const mixattn::gma::Prepared<T> prepared(mix);
  EXPECT_EQ(prepared.components(), 7);
  EXPECT_EQ(prepared.dim(), 5);
  const Matrix<T> bulk = mixattn::gma::responsibilities(mix, x);
  EXPECT_TRUE((mixattn::gma::responsibilities(prepared, x).array() == bulk.array()).all());
  for (Index i = 0; i < x.rows(); ++i)
    EXPECT_TRUE((mixattn::gma::responsibilities(prepared, x.row(i)).array() ==
                 bulk.row(i).array()).all()) << "row " << i;
  auto bad = mix;
  bad.prior_logit[0] = std::numeric_limits<T>::quiet_NaN();
  EXPECT_THROW(mixattn::gma::Prepared<T>{bad}, std::domain_error);
  EXPECT_THROW(mixattn::gma::responsibilities(prepared, random_matrix<T>(2, 4, 12)),
               std::invalid_argument);
}

TYPED_TEST(Contract, ShapeMessagesNameTheDimension) {
  using T = TypeParam;
  const auto mix = mixattn::gma::Mixture<T>::random(3, 8, 13);
  const Matrix<T> x = random_matrix<T>(8, 1, 14);
  const std::string msg =
      message_of<std::invalid_argument>([&] { mixattn::gma::responsibilities(mix, x); });
  EXPECT_NE(msg.find("x is 8 x 1 but the mixture has dimension 8 (its r: x must have 8 columns)"), std::string::npos)
      << msg;
  const Matrix<T> v = random_matrix<T>(8, 2, 15), q = random_matrix<T>(8, 8, 16);
  const std::string qmsg =
      message_of<std::invalid_argument>([&] { mixattn::gma::forward(mix, x, q, v); });
  EXPECT_NE(qmsg.find("q is 8 x 1 but the mixture has dimension 8 (its r: q must have 8 columns)"), std::string::npos)
      << qmsg;
}

// Cross-attention with no keys: every query needs at least one key, as in reference::
// (before, GMA returned zeros).
TYPED_TEST(Contract, GmaQueriesWithoutKeysAreRejected) {
  using T = TypeParam;
  const auto mix = mixattn::gma::Mixture<T>::random(3, 4, 17);
  const Matrix<T> q = random_matrix<T>(5, 4, 18), k(0, 4), v(0, 2);
  const std::string msg =
      message_of<std::invalid_argument>([&] { mixattn::gma::forward(mix, q, k, v); });
  EXPECT_NE(msg.find("k has 0 rows but q has 5"), std::string::npos) << msg;
  // No queries and no keys is an empty call, not an error.
  EXPECT_EQ(mixattn::gma::forward(mix, Matrix<T>(0, 4), k, v).rows(), 0);
}

TYPED_TEST(Contract, OvqBetaMustBePositive) {
  using T = TypeParam;
  const Matrix<T> q = random_matrix<T>(6, 4, 19), v = random_matrix<T>(6, 2, 20);
  for (const T beta : {T(0), T(-1)}) {
    auto state = mixattn::ovq::State<T>::empty(4, 2);
    const std::string msg = message_of<std::invalid_argument>(
        [&] { mixattn::ovq::forward<T>(q, q, v, beta, {}, state); });
    EXPECT_NE(msg.find("the scale factor must be > 0"), std::string::npos) << msg;
    EXPECT_EQ(state.tokens_seen, 0);
    mixattn::ovq::Saved<T> saved;
    mixattn::ovq::forward<T>(q, q, v, T(1), {}, state, &saved);
    EXPECT_THROW(mixattn::ovq::backward<T>(q, q, v, beta, v, saved, {}), std::invalid_argument);
  }
}

// docs/training.md, the layer's Config: `threads` is 1 by default (the calling thread alone).
// The decoding entry points keep the contract: shape messages name the argument, overflow of
// finite inputs is a domain_error naming v that leaves the state or cache as it was.
TYPED_TEST(Contract, DecodingEntryPoints) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  namespace ref = mixattn::reference;
  const Index r = 4, dv = 3, K = 5;
  const auto mix = gma::Mixture<T>::random(K, r, 3);
  const gma::Prepared<T> prep(mix);
  gma::Options opt;
  opt.causal = true;
  auto st = gma::State<T>::empty(K, dv);
  const Matrix<T> q = random_matrix<T>(2, r, 1), k = random_matrix<T>(2, r, 2);
  const Matrix<T> v = random_matrix<T>(2, dv, 3);
  const Matrix<T> q5 = random_matrix<T>(2, r + 1, 4);
  std::string what = message_of<std::invalid_argument>([&] { gma::forward(prep, q5, k, v, opt, st); });
  EXPECT_NE(what.find("q is 2 x 5 but the mixture has dimension 4 (its r"), std::string::npos)
      << what;
  // Values at the type's limit: the running sums overflow (v + v), never returned as inf.
  gma::forward(prep, q, k, v, opt, st);
  const auto before = st;
  Matrix<T> huge = Matrix<T>::Constant(2, dv, std::numeric_limits<T>::max());
  for (const bool with_saved : {false, true}) {
    gma::Saved<T> saved;
    try {
      const Matrix<T> out = gma::forward(prep, q, k, huge, opt, st, with_saved ? &saved : nullptr);
      EXPECT_TRUE(out.allFinite());
      EXPECT_TRUE(st.S.allFinite());
      st = before;
    } catch (const std::domain_error& e) {
      EXPECT_NE(std::string(e.what()).find("v is too large"), std::string::npos) << e.what();
      EXPECT_EQ(st.tokens_seen, before.tokens_seen);
      EXPECT_TRUE(st.S == before.S && st.z == before.z) << "a throw must leave the state as it was";
    }
  }
  // reference::decode: the cache's widths in the message; overflow leaves the cache as it was.
  ref::Options sopt;
  sopt.causal = true;
  ref::KvCache<T> cache(r, dv);
  what = message_of<std::invalid_argument>([&] { ref::decode(cache, q5, q5, v, sopt); });
  EXPECT_NE(what.find("keys of width 4"), std::string::npos) << what;
  ref::decode(cache, q, k, v, sopt);
  // The output is a convex combination of value rows, so values at the type's largest overflow
  // only through the rounding of the weights: either the result is finite, or decode throws and
  // leaves the cache as it was.
  try {
    const Matrix<T> out = ref::decode(cache, q, k, huge, sopt);
    EXPECT_TRUE(out.allFinite());
    EXPECT_EQ(cache.size(), 4);
  } catch (const std::domain_error&) {
    EXPECT_EQ(cache.size(), 2) << "a throw must leave the cache as it was";
  }
  // ovq::forward decoding: a block of values at the limit either stays finite or throws with
  // the state as it was (dictionary, counts, unfinished block, token count).
  mixattn::ovq::Options oopt;
  oopt.block = 2;
  auto ost = mixattn::ovq::State<T>::empty(r, dv);
  mixattn::ovq::forward<T>(q, k, v, T(1), oopt, ost);
  mixattn::ovq::forward<T>(q.topRows(1), k.topRows(1), v.topRows(1), T(1), oopt, ost);
  const auto obefore = ost;
  huge.row(1) = -huge.row(1);
  try {
    const Matrix<T> out = mixattn::ovq::forward<T>(q, k, huge, T(1), oopt, ost);
    EXPECT_TRUE(out.allFinite() && ost.values.allFinite());
  } catch (const std::domain_error& e) {
    EXPECT_NE(std::string(e.what()).find("v is too large"), std::string::npos) << e.what();
    EXPECT_EQ(ost.tokens_seen, obefore.tokens_seen);
    EXPECT_TRUE(ost.keys == obefore.keys && ost.values == obefore.values &&
                ost.counts == obefore.counts && ost.pending_keys == obefore.pending_keys &&
                ost.pending_values == obefore.pending_values)
        << "a throw must leave the state as it was";
  }
}

TEST(ContractLayer, ThreadsDefaultIsTheReadmes) {
  EXPECT_EQ(mixattn::layer::Config{}.threads, 1);
}

}  // namespace
