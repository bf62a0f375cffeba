// Finite inputs up to the scalar type's overflow edge, through the forward and backward of every
// operator, float and double: with check_finite on, each call returns finite results of the
// right shape or throws std::domain_error saying what overflowed -- never NaN or inf, never
// another exception. Inputs are uniform in [-s, s] for s up to the largest finite value; q and k,
// v, grad_out (or the layer's x) are scaled one at a time and all together.
#include "test_util.hpp"

#include <mixattn/gma.hpp>
#include <mixattn/layer.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/reference.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;

/// rows x cols uniform-like in (-s, s): tanh of a seeded normal sample, times s. Finite for
/// every s up to the type's largest value (a normal sample of that scale would overflow).
template <class T>
Matrix<T> random_matrix(Index rows, Index cols, std::uint64_t seed, double s) {
  return (mixattn::testing::random_matrix<double>(rows, cols, seed).array().tanh() * s)
      .matrix()
      .template cast<T>();
}

template <class T>
class Overflow : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Overflow, Scalars);

/// Magnitudes from ordinary to the largest finite value, through the edges where squares, sums
/// over a few hundred terms and products with a weight first overflow.
template <class T>
std::vector<double> ladder() {
  const double top = static_cast<double>(std::numeric_limits<T>::max());
  if (std::is_same<T, float>::value)
    return {1, 1e5, 1e10, 1e19, 1e20, 1e30, 1e36, 1e37, top / 4, top};
  return {1, 1e20, 1e100, 1e153, 1e154, 1e155, 1e200, 1e300, 1e306, top / 4, top};
}

/// Scales of (q and k, v, grad_out) for one rung: one at a time, then all together.
std::vector<std::vector<double>> patterns(double s) {
  return {{s, 1, 1}, {1, s, 1}, {1, 1, s}, {s, s, s}};
}

/// Runs call (which returns the results); passes when they are all finite or the call throws
/// std::domain_error mentioning what overflowed or which argument is at fault. Returns whether
/// the call returned.
template <class F>
bool finite_or_domain_error(const std::string& what, F&& call) {
  try {
    const std::vector<Matrix<double>> results = call();
    for (std::size_t i = 0; i < results.size(); ++i)
      EXPECT_TRUE(results[i].allFinite()) << what << ": result " << i << " is not finite";
    return true;
  } catch (const std::domain_error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("overflow") != std::string::npos ||
                msg.find("not finite") != std::string::npos)
        << what << ": " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": undocumented exception " << e.what();
  }
  return false;
}

template <class D>
Matrix<double> d(const Eigen::MatrixBase<D>& x) {
  return x.template cast<double>();
}

template <class T>
std::string label(const char* op, const std::vector<double>& p) {
  return mixattn::detail::concat(op, " (", mixattn::detail::scalar_name<T>(), ") scales q,k ", p[0],
                                 " v ", p[1], " grad_out ", p[2]);
}

TYPED_TEST(Overflow, GmaForwardAndBackward) {
  using T = TypeParam;
  const Index n = 20, m = 20, r = 6, dv = 5;
  const auto mix = mixattn::gma::Mixture<T>::random(4, r, 5);
  for (const double s : ladder<T>())
    for (const auto& p : patterns(s))
      for (const bool causal : {false, true}) {
        const Matrix<T> q = random_matrix<T>(n, r, 1, p[0]), k = random_matrix<T>(m, r, 2, p[0]);
        const Matrix<T> v = random_matrix<T>(m, dv, 3, p[1]),
                        dout = random_matrix<T>(n, dv, 4, p[2]);
        mixattn::gma::Options opt;
        opt.causal = causal;
        mixattn::gma::Saved<T> saved;
        const std::string what = label<T>(causal ? "gma causal" : "gma", p);
        if (!finite_or_domain_error(what + " forward", [&] {
              return std::vector<Matrix<double>>{
                  d(mixattn::gma::forward(mix, q, k, v, opt, &saved))};
            }))
          continue;
        finite_or_domain_error(what + " backward", [&] {
          const auto g = mixattn::gma::backward(mix, q, k, v, dout, saved, opt);
          return std::vector<Matrix<double>>{d(g.q),
                                             d(g.k),
                                             d(g.v),
                                             d(g.mixture.mean),
                                             d(g.mixture.var_raw),
                                             d(g.mixture.prior_logit)};
        });
      }
}

// The two cases first reported: q and k at 1e20 (float) must give a finite output (the
// responsibilities are well defined), v at 3e38 a domain_error that names v.
TEST(OverflowCases, GmaQueriesKeysAt1e20AndValuesAt3e38) {
  const auto mix = mixattn::gma::Mixture<float>::random(8, 8, 1);
  const Matrix<float> q = random_matrix<float>(16, 8, 1, 1e20),
                      k = random_matrix<float>(16, 8, 2, 1e20);
  const Matrix<float> v = random_matrix<float>(16, 4, 3, 1);
  EXPECT_TRUE(mixattn::gma::forward(mix, q, k, v).allFinite());
  const Matrix<float> big_v = random_matrix<float>(16, 4, 5, 3e38);
  const Matrix<float> q1 = random_matrix<float>(16, 8, 1, 1),
                      k1 = random_matrix<float>(16, 8, 2, 1);
  try {
    const Matrix<float> out = mixattn::gma::forward(mix, q1, k1, big_v);
    EXPECT_TRUE(out.allFinite());
  } catch (const std::domain_error& e) {
    EXPECT_NE(std::string(e.what()).find("v is too large"), std::string::npos) << e.what();
  }
  auto state = mixattn::ovq::State<float>::empty(8, 4);
  try {
    const Matrix<float> out = mixattn::ovq::forward<float>(q1, k1, big_v, 1.0f, {}, state);
    EXPECT_TRUE(out.allFinite());
  } catch (const std::domain_error& e) {
    EXPECT_NE(std::string(e.what()).find("v is too large"), std::string::npos) << e.what();
    EXPECT_EQ(state.tokens_seen, 0) << "a throwing call must leave the state unchanged";
  }
}

TYPED_TEST(Overflow, OvqForwardAndBackward) {
  using T = TypeParam;
  const Index tn = 24, r = 6, dv = 5;
  mixattn::ovq::Options opt;
  opt.block = 8;
  opt.max_centroids = 4;
  for (const double s : ladder<T>())
    for (const auto& p : patterns(s)) {
      const Matrix<T> q = random_matrix<T>(tn, r, 1, p[0]), k = random_matrix<T>(tn, r, 2, p[0]);
      const Matrix<T> v = random_matrix<T>(tn, dv, 3, p[1]),
                      dout = random_matrix<T>(tn, dv, 4, p[2]);
      auto state = mixattn::ovq::State<T>::empty(r, dv);
      mixattn::ovq::Saved<T> saved;
      const std::string what = label<T>("ovq", p);
      if (!finite_or_domain_error(what + " forward", [&] {
            return std::vector<Matrix<double>>{
                d(mixattn::ovq::forward<T>(q, k, v, T(1), opt, state, &saved)), d(state.values)};
          }))
        continue;
      finite_or_domain_error(what + " backward", [&] {
        const auto g = mixattn::ovq::backward<T>(q, k, v, T(1), dout, saved, opt);
        return std::vector<Matrix<double>>{d(g.q), d(g.k), d(g.v),
                                           Matrix<double>::Constant(1, 1, g.beta)};
      });
    }
}

TYPED_TEST(Overflow, ReferenceForwardAndBackward) {
  using T = TypeParam;
  namespace ref = mixattn::reference;
  const Index n = 20, r = 6, dv = 5;
  for (const double s : ladder<T>())
    for (const auto& p : patterns(s))
      for (const bool flash : {false, true}) {
        const Matrix<T> q = random_matrix<T>(n, r, 1, p[0]), k = random_matrix<T>(n, r, 2, p[0]);
        const Matrix<T> v = random_matrix<T>(n, dv, 3, p[1]),
                        dout = random_matrix<T>(n, dv, 4, p[2]);
        ref::Saved<T> saved;
        const std::string what = label<T>(flash ? "flash" : "naive", p);
        using mixattn::testing::reference_backward;
        using mixattn::testing::reference_forward;
        if (!finite_or_domain_error(what + " forward", [&] {
              return std::vector<Matrix<double>>{d(reference_forward(flash, q, k, v, &saved))};
            }))
          continue;
        finite_or_domain_error(what + " backward", [&] {
          const auto g = reference_backward(flash, q, k, v, dout, saved);
          return std::vector<Matrix<double>>{d(g.q), d(g.k), d(g.v)};
        });
      }
}

TYPED_TEST(Overflow, LayerForwardAndBackward) {
  using T = TypeParam;
  for (const auto kind : {mixattn::layer::MixerKind::gma, mixattn::layer::MixerKind::ovq,
                          mixattn::layer::MixerKind::softmax}) {
    const mixattn::layer::MultiHeadAttention<T> attn(
        mixattn::testing::small_layer<mixattn::layer::Config>(kind));
    for (const double s : ladder<T>())
      for (const auto& p : patterns(s)) {
        const Matrix<T> x = random_matrix<T>(10, 6, 1, std::max(p[0], p[1])),
                        dy = random_matrix<T>(10, 6, 2, p[2]);
        mixattn::layer::Cache<T> cache;
        const std::string what = label<T>("layer", p);
        // Decoding the same tokens is held to the same rule (its output projection included).
        finite_or_domain_error(what + " decode", [&] {
          auto st = attn.begin_decoding();
          return std::vector<Matrix<double>>{d(attn.decode(x, st))};
        });
        if (!finite_or_domain_error(what + " forward", [&] {
              return std::vector<Matrix<double>>{d(attn.forward(x, &cache))};
            }))
          continue;
        finite_or_domain_error(what + " backward", [&] {
          auto g = attn.backward(x, dy, cache);
          std::vector<Matrix<double>> out{d(g.x)};
          for (const auto& pm : g.params) out.push_back(d(pm));
          return out;
        });
      }
  }
}

template <class T>
bool same_bits(const Matrix<T>& a, const Matrix<T>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::equal(a.data(), a.data() + a.size(), b.data(),
                    [](T x, T y) { return std::memcmp(&x, &y, sizeof(T)) == 0; });
}

// The _into forms that continue a state: values at the type's largest value give a finite
// output or a domain_error, and a throwing call leaves the state as it was, bitwise (GMA with
// and without a record, through a Prepared mixture; OVQ in place and into another state).
TYPED_TEST(Overflow, IntoFormsLeaveTheStateOnOverflow) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  namespace ovq = mixattn::ovq;
  const Index n = 12, r = 6, dv = 5, K = 4;
  const double top = static_cast<double>(std::numeric_limits<T>::max());
  const Matrix<T> q = random_matrix<T>(n, r, 1, 1), k = random_matrix<T>(n, r, 2, 1);
  const Matrix<T> v = random_matrix<T>(n, dv, 3, 1);
  const Matrix<T> big_v = Matrix<T>::Constant(n, dv, static_cast<T>(top));
  Matrix<T> out;
  const auto mix = gma::Mixture<T>::random(K, r, 7);
  const gma::Prepared<T> prep(mix);
  gma::Options opt;
  opt.causal = true;
  int gma_throws = 0;
  for (const bool record : {false, true}) {
    auto st = gma::State<T>::empty(K, dv);
    gma::Saved<T> saved;
    gma::forward_into(out, prep, q, k, v, opt, st, record ? &saved : nullptr);
    const gma::State<T> before = st;
    const std::string what = record ? "gma forward_into with a record" : "gma forward_into";
    if (finite_or_domain_error(what, [&] {
          gma::forward_into(out, prep, q, k, big_v, opt, st, record ? &saved : nullptr);
          return std::vector<Matrix<double>>{d(out)};
        }))
      continue;
    ++gma_throws;
    EXPECT_EQ(st.tokens_seen, before.tokens_seen) << what;
    EXPECT_TRUE(same_bits(st.S, before.S) && st.z == before.z) << what << ": state changed";
  }
  // In double the state's sums of values at the largest double overflow: that must throw.
  if (std::is_same<T, double>::value) {
    EXPECT_EQ(gma_throws, 2);
  }

  ovq::Options oopt;
  oopt.block = 4;
  const auto empty = ovq::State<T>::empty(r, dv);
  for (const bool in_place : {true, false}) {
    ovq::Saved<T> saved;
    auto st = empty, next = empty;
    ovq::forward_into(out, q, k, v, T(1), oopt, st, &saved);
    const ovq::State<T> before = st, next_before = next;
    const std::string what = in_place ? "ovq forward_into in place" : "ovq forward_into to next";
    if (finite_or_domain_error(what, [&] {
          if (in_place)
            ovq::forward_into(out, q, k, big_v, T(1), oopt, st, &saved);
          else
            ovq::forward_into(out, q, k, big_v, T(1), oopt, static_cast<const ovq::State<T>&>(st),
                              next, &saved);
          return std::vector<Matrix<double>>{d(out)};
        }))
      continue;
    const ovq::State<T>& changed = in_place ? st : next;
    const ovq::State<T>& expected = in_place ? before : next_before;
    EXPECT_EQ(changed.tokens_seen, expected.tokens_seen) << what;
    EXPECT_TRUE(same_bits(changed.keys, expected.keys) &&
                same_bits(changed.values, expected.values) && changed.counts == expected.counts &&
                same_bits(changed.pending_keys, expected.pending_keys) &&
                same_bits(changed.pending_values, expected.pending_values))
        << what << ": state changed";
  }
}

// A state whose values sit at the type's largest value (the dictionary's running means, or the
// unfinished block's values), continued in place with ordinary q, k and v: the call absorbs
// blocks, so it changes the dictionary where it lies, and its output (a convex combination of
// those values) or the running means can round past the largest value. A domain_error must
// leave the state as it was, bitwise, although v alone is small. Each seed gives its own keys and
// queries; whether a seed overflows depends on rounding, so the test only requires (in double,
// where the values are exactly at the limit) that some seed does, for each place.
TYPED_TEST(Overflow, OvqStateAtTheLimitLeavesTheStateOnOverflow) {
  using T = TypeParam;
  namespace ovq = mixattn::ovq;
  const Index n = 12, r = 3, dv = 3, centroids = 4;
  const T top = std::numeric_limits<T>::max();
  ovq::Options opt;
  opt.block = 4;
  for (const bool in_dictionary : {true, false}) {
    const std::string where = in_dictionary ? "dictionary" : "unfinished block";
    int throws = 0;
    for (std::uint64_t seed = 1; seed <= 24; ++seed) {
      auto st = ovq::State<T>::empty(r, dv);
      st.keys = random_matrix<T>(centroids, r, seed, 1);
      st.values = in_dictionary ? Matrix<T>::Constant(centroids, dv, top)
                                : random_matrix<T>(centroids, dv, seed + 400, 1);
      st.counts = mixattn::Vector<T>::Ones(centroids);
      const Index pending = in_dictionary ? 0 : opt.block - 1;
      st.pending_keys = random_matrix<T>(pending, r, seed + 500, 1);
      st.pending_values = Matrix<T>::Constant(pending, dv, top);
      st.tokens_seen = centroids * opt.block + pending;
      const Matrix<T> q = random_matrix<T>(n, r, seed + 100, 1);
      const Matrix<T> k = random_matrix<T>(n, r, seed + 200, 1);
      const Matrix<T> v = random_matrix<T>(n, dv, seed + 300, 1);
      const ovq::State<T> before = st;
      Matrix<T> out;
      ovq::Saved<T> saved;
      const std::string what = where + ", seed " + std::to_string(seed);
      if (finite_or_domain_error(what, [&] {
            ovq::forward_into(out, q, k, v, T(1), opt, st, &saved);
            return std::vector<Matrix<double>>{d(out)};
          }))
        continue;
      ++throws;
      EXPECT_EQ(st.tokens_seen, before.tokens_seen) << what;
      EXPECT_TRUE(same_bits(st.keys, before.keys) && same_bits(st.values, before.values) &&
                  st.counts == before.counts && same_bits(st.pending_keys, before.pending_keys) &&
                  same_bits(st.pending_values, before.pending_values))
          << what << ": state changed";
    }
    if (std::is_same<T, double>::value) {
      EXPECT_GT(throws, 0) << where;
    }
  }
}

}  // namespace
