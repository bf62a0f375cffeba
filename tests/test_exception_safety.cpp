// Exception safety: for every operator and every kind of bad input, the call throws the
// documented type (std::invalid_argument for shapes/options/inconsistent state or records,
// std::domain_error for non-finite values) and nothing the caller owns changes: inputs, the
// Mixture, the OVQ State (bitwise) and any Saved handed in as an output (bitwise, still usable).
#include <mixattn/gma.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/reference.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace gma = mixattn::gma;
namespace ovq = mixattn::ovq;
namespace ref = mixattn::reference;
using mixattn::testing::random_matrix;

template <class A, class B>
bool same_bits(const Eigen::DenseBase<A>& a, const Eigen::DenseBase<B>& b) {
  using S = typename A::Scalar;
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  const Matrix<S> x = a, y = b;
  return x.size() == 0 || std::memcmp(x.data(), y.data(), sizeof(S) * x.size()) == 0;
}

template <class T>
bool same_state(const ovq::State<T>& a, const ovq::State<T>& b) {
  return same_bits(a.keys, b.keys) && same_bits(a.values, b.values) &&
         same_bits(a.counts, b.counts) && same_bits(a.pending_keys, b.pending_keys) &&
         same_bits(a.pending_values, b.pending_values) && a.tokens_seen == b.tokens_seen;
}

template <class T>
bool same_mixture(const gma::Mixture<T>& a, const gma::Mixture<T>& b) {
  return same_bits(a.mean, b.mean) && same_bits(a.var_raw, b.var_raw) &&
         same_bits(a.prior_logit, b.prior_logit) && a.var_floor == b.var_floor;
}

/// Runs `call`, which must throw exactly E (not merely a base of it), with a message naming fn.
template <class E>
void expect_throw(const std::function<void()>& call, const std::string& fn,
                  const std::string& what) {
  SCOPED_TRACE(what);
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(fn), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

constexpr double nan = std::numeric_limits<double>::quiet_NaN();

template <class T>
class ExceptionSafety : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ExceptionSafety, Scalars);

TYPED_TEST(ExceptionSafety, Reference) {
  using T = TypeParam;
  const Index n = 9, r = 4, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, 1), k = random_matrix<T>(n, r, 2);
  const Matrix<T> v = random_matrix<T>(n, dv, 3), w = random_matrix<T>(n, dv, 4);
  const Matrix<T> q0 = q, k0 = k, v0 = v;
  for (int impl = 0; impl < 2; ++impl) {
    const std::string fn = impl == 0 ? "naive_" : "flash_";
    const auto fwd = [impl](const Matrix<T>& a, const Matrix<T>& b, const Matrix<T>& c,
                            const ref::Options& o, ref::Saved<T>* s) {
      return impl == 0 ? ref::naive_forward<T>(a, b, c, o, s) : ref::flash_forward<T>(a, b, c, o, s);
    };
    const auto bwd = [impl](const Matrix<T>& a, const Matrix<T>& b, const Matrix<T>& c,
                            const Matrix<T>& g, const ref::Saved<T>& s, const ref::Options& o) {
      return impl == 0 ? ref::naive_backward<T>(a, b, c, g, s, o)
                       : ref::flash_backward<T>(a, b, c, g, s, o);
    };
    // A Saved filled by a good call must survive every failing call bitwise.
    ref::Saved<T> saved;
    const Matrix<T> out = fwd(q, k, v, {}, &saved);
    const ref::Saved<T> saved0 = saved;
    const auto saved_intact = [&] {
      return saved.source == saved0.source && saved.queries == saved0.queries &&
             same_bits(saved.probs, saved0.probs) && same_bits(saved.out, saved0.out) &&
             same_bits(saved.lse, saved0.lse);
    };
    Matrix<T> bad = q;
    bad(2, 1) = T(nan);
    ref::Options causal;
    causal.causal = true;
    ref::Options bad_scale;
    bad_scale.scale = nan;
    const Matrix<T> huge = Matrix<T>::Constant(n, r, std::numeric_limits<T>::max() / 2);
    struct Case {
      std::function<void()> call;
      bool domain;
      const char* what;
    };
    const std::vector<Case> cases = {
        {[&] { fwd(q, k.leftCols(r - 1), v, {}, &saved); }, false, "k columns"},
        {[&] { fwd(q, k, v.topRows(n - 1), {}, &saved); }, false, "v rows"},
        {[&] { fwd(q, k.topRows(n - 1), v.topRows(n - 1), causal, &saved); }, false, "causal N != M"},
        {[&] { fwd(q, k, v, bad_scale, &saved); }, false, "scale NaN"},
        {[&] { fwd(bad, k, v, {}, &saved); }, true, "NaN in q"},
        {[&] { fwd(q, bad, v, {}, &saved); }, true, "NaN in k"},
        {[&] { fwd(huge, huge, v, {}, &saved); }, true, "overflowing logits"},
        {[&] { bwd(q, k, v, w.topRows(n - 1), saved, {}); }, false, "grad_out rows"},
        {[&] { bwd(q, k, v, w, ref::Saved<T>{}, {}); }, false, "empty saved"},
        {[&] { bwd(q, k, v, w, saved, causal); }, false, "options differ from saved"},
        {[&] { bwd(q, k, v, bad.leftCols(dv), saved, {}); }, true, "NaN in grad_out"},
    };
    for (const Case& c : cases) {
      if (c.domain)
        expect_throw<std::domain_error>(c.call, fn, fn + c.what);
      else
        expect_throw<std::invalid_argument>(c.call, fn, fn + c.what);
      EXPECT_TRUE(saved_intact()) << fn << c.what;
    }
    EXPECT_TRUE(same_bits(q, q0) && same_bits(k, k0) && same_bits(v, v0));
    // Still usable.
    const ref::Grad<T> g = bwd(q, k, v, w, saved, {});
    EXPECT_TRUE(g.q.allFinite());
  }
}

TYPED_TEST(ExceptionSafety, Gma) {
  using T = TypeParam;
  const Index n = 10, m = 10, r = 3, dv = 2, K = 4;
  const gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 5);
  const gma::Mixture<T> mix0 = mix;
  const Matrix<T> q = random_matrix<T>(n, r, 6), k = random_matrix<T>(m, r, 7);
  const Matrix<T> v = random_matrix<T>(m, dv, 8), w = random_matrix<T>(n, dv, 9);
  const Matrix<T> q0 = q, k0 = k, v0 = v;
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    gma::Saved<T> saved;
    gma::forward(mix, q, k, v, opt, &saved);
    const gma::Saved<T> saved0 = saved;
    const auto saved_intact = [&] {
      return same_bits(saved.gamma_q, saved0.gamma_q) && same_bits(saved.gamma_k, saved0.gamma_k) &&
             same_bits(saved.den, saved0.den) && same_bits(saved.out, saved0.out) &&
             same_bits(saved.vt, saved0.vt) && same_bits(saved.z, saved0.z) &&
             saved.valid == saved0.valid && saved.causal == saved0.causal;
    };
    gma::Mixture<T> nan_mean = mix;
    nan_mean.mean(1, 1) = T(nan);
    gma::Mixture<T> bad_floor = mix;
    bad_floor.var_floor = T(0);
    gma::Mixture<T> bad_prior = mix;
    bad_prior.prior_logit.resize(K + 1);
    bad_prior.prior_logit.setZero();
    Matrix<T> bad = q;
    bad(0, 0) = T(nan);
    gma::Options bad_eps = opt, bad_chunk = opt, other = opt;
    bad_eps.eps = -1;
    bad_chunk.chunk = -2;
    other.causal = !causal;
    const std::string fn = "mixattn::gma::";
    struct Case {
      std::function<void()> call;
      bool domain;
      const char* what;
    };
    const std::vector<Case> cases = {
        {[&] { gma::forward(mix, q.leftCols(r - 1), k, v, opt, &saved); }, false, "q columns"},
        {[&] { gma::forward(mix, q, k, v.topRows(m - 1), opt, &saved); }, false, "v rows"},
        {[&] { gma::forward(bad_floor, q, k, v, opt, &saved); }, false, "var_floor 0"},
        {[&] { gma::forward(bad_prior, q, k, v, opt, &saved); }, false, "prior_logit size"},
        {[&] { gma::forward(mix, q, k, v, bad_eps, &saved); }, false, "eps < 0"},
        {[&] { gma::forward(mix, q, k, v, bad_chunk, &saved); }, false, "chunk < 0"},
        {[&] { gma::forward(nan_mean, q, k, v, opt, &saved); }, true, "NaN in mean"},
        {[&] { gma::forward(mix, bad, k, v, opt, &saved); }, true, "NaN in q"},
        {[&] { gma::forward(mix, q, k, bad.leftCols(dv), opt, &saved); }, true, "NaN in v"},
        {[&] { gma::responsibilities(mix, q.leftCols(r - 1)); }, false, "responsibilities cols"},
        {[&] { gma::responsibilities(mix, bad); }, true, "responsibilities NaN"},
        {[&] { gma::backward(mix, q, k, v, w.leftCols(dv - 1), saved, opt); }, false, "grad_out"},
        {[&] { gma::backward(mix, q, k, v, w, gma::Saved<T>{}, opt); }, false, "empty saved"},
        {[&] { gma::backward(mix, q, k, v, w, saved, other); }, false, "options differ"},
        {[&] { gma::backward(mix, q, k, v, bad.leftCols(dv), saved, opt); }, true, "NaN grad_out"},
    };
    for (const Case& c : cases) {
      if (c.domain)
        expect_throw<std::domain_error>(c.call, fn, c.what);
      else
        expect_throw<std::invalid_argument>(c.call, fn, c.what);
      EXPECT_TRUE(saved_intact()) << c.what;
    }
    EXPECT_TRUE(same_mixture(mix, mix0));
    EXPECT_TRUE(same_bits(q, q0) && same_bits(k, k0) && same_bits(v, v0));
    const gma::Grad<T> g = gma::backward(mix, q, k, v, w, saved, opt);
    EXPECT_TRUE(g.mixture.mean.allFinite());
  }
}

TYPED_TEST(ExceptionSafety, Ovq) {
  using T = TypeParam;
  const Index r = 4, dv = 3, t = 37;
  ovq::Options opt;
  opt.block = 8;
  opt.max_centroids = 6;
  // A state with centroids and pending tokens: the interesting one to corrupt.
  ovq::State<T> state = ovq::State<T>::empty(r, dv);
  ovq::forward<T>(random_matrix<T>(29, r, 10), random_matrix<T>(29, r, 11),
                  random_matrix<T>(29, dv, 12), T(1), opt, state);
  ASSERT_GT(state.keys.rows(), 0);
  ASSERT_GT(state.pending_keys.rows(), 0);
  const Matrix<T> q = random_matrix<T>(t, r, 13), k = random_matrix<T>(t, r, 14);
  const Matrix<T> v = random_matrix<T>(t, dv, 15), w = random_matrix<T>(t, dv, 16);
  const Matrix<T> q0 = q, k0 = k, v0 = v;

  ovq::Saved<T> saved;
  {
    ovq::State<T> scratch = state;
    ovq::forward<T>(q, k, v, T(1), opt, scratch, &saved);
  }
  const ovq::Saved<T> saved0 = saved;
  const auto saved_intact = [&] {
    return same_state(saved.start, saved0.start) && saved.assignment == saved0.assignment &&
           saved.seeds == saved0.seeds && saved.new_centroids == saved0.new_centroids &&
           saved.tokens == saved0.tokens && saved.recorded == saved0.recorded;
  };

  Matrix<T> bad = q;
  bad(5, 2) = T(nan);
  struct Corrupt {
    std::function<void(ovq::State<T>&)> apply;
    bool domain;
    const char* what;
  };
  const std::vector<Corrupt> states = {
      {[](ovq::State<T>&) {}, false, "(valid state)"},
      {[](ovq::State<T>& s) { s.counts[0] = T(0.5); }, false, "count < 1"},
      {[](ovq::State<T>& s) { s.tokens_seen += 1; }, false, "tokens_seen vs pending"},
      {[](ovq::State<T>& s) { s.values.conservativeResize(s.values.rows() - 1, Eigen::NoChange); },
       false, "values rows"},
      {[](ovq::State<T>& s) { s.keys(0, 0) = T(nan); }, true, "NaN centroid"},
      {[](ovq::State<T>& s) { s.pending_values(0, 0) = T(nan); }, true, "NaN pending value"},
  };
  ovq::Options bad_block = opt, bad_cap = opt, bad_eps = opt, bad_alpha = opt, small_cap = opt;
  bad_block.block = 0;
  bad_cap.max_centroids = 0;
  bad_eps.norm_eps = 0;
  bad_alpha.growth_alpha = -1;
  small_cap.max_centroids = 1;  // fewer than the state already holds
  const std::string fn = "mixattn::ovq::";
  for (const Corrupt& c : states) {
    ovq::State<T> st = state;
    c.apply(st);
    const ovq::State<T> st0 = st;
    struct Case {
      std::function<void()> call;
      bool domain;
      std::string what;
    };
    const bool valid = std::string(c.what) == "(valid state)";
    std::vector<Case> cases;
    if (valid) {
      cases = {
          {[&] { ovq::forward<T>(q.leftCols(r - 1), k, v, T(1), opt, st, &saved); }, false, "q cols"},
          {[&] { ovq::forward<T>(q, k.topRows(t - 1), v, T(1), opt, st, &saved); }, false, "k rows"},
          {[&] { ovq::forward<T>(q, k, v.leftCols(dv - 1), T(1), opt, st, &saved); }, false, "v cols"},
          {[&] { ovq::forward<T>(q, k, v, T(1), bad_block, st, &saved); }, false, "block 0"},
          {[&] { ovq::forward<T>(q, k, v, T(1), bad_cap, st, &saved); }, false, "max_centroids 0"},
          {[&] { ovq::forward<T>(q, k, v, T(1), bad_eps, st, &saved); }, false, "norm_eps 0"},
          {[&] { ovq::forward<T>(q, k, v, T(1), bad_alpha, st, &saved); }, false, "alpha < 0"},
          {[&] { ovq::forward<T>(q, k, v, T(1), small_cap, st, &saved); }, false, "cap < centroids"},
          {[&] { ovq::forward<T>(bad, k, v, T(1), opt, st, &saved); }, true, "NaN in q"},
          {[&] { ovq::forward<T>(q, bad, v, T(1), opt, st, &saved); }, true, "NaN in k"},
          {[&] { ovq::forward<T>(q, k, bad.leftCols(dv), T(1), opt, st, &saved); }, true, "NaN in v"},
          {[&] { ovq::forward<T>(q, k, v, T(nan), opt, st, &saved); }, true, "NaN beta"},
          {[&] { ovq::backward<T>(q, k, v, T(1), w.topRows(t - 1), saved, opt); }, false, "grad_out"},
          {[&] { ovq::backward<T>(q, k, v, T(2), w, saved, opt); }, false, "beta differs"},
          {[&] { ovq::backward<T>(q, k, v, T(1), w, saved, bad_eps); }, false, "bad options"},
          {[&] { ovq::backward<T>(q, k, v, T(1), w, ovq::Saved<T>{}, opt); }, false, "empty saved"},
          {[&] { ovq::backward<T>(q, k, v, T(1), bad.leftCols(dv), saved, opt); }, true, "NaN dO"},
      };
    } else {
      cases = {{[&] { ovq::forward<T>(q, k, v, T(1), opt, st, &saved); }, c.domain, c.what}};
    }
    for (const Case& cs : cases) {
      if (cs.domain)
        expect_throw<std::domain_error>(cs.call, fn, cs.what);
      else
        expect_throw<std::invalid_argument>(cs.call, fn, cs.what);
      EXPECT_TRUE(same_state(st, st0)) << cs.what << ": the state changed";
      EXPECT_TRUE(saved_intact()) << cs.what << ": saved changed";
    }
  }
  EXPECT_TRUE(same_bits(q, q0) && same_bits(k, k0) && same_bits(v, v0));
  // The untouched state and saved still work, and give what they gave before.
  ovq::State<T> a = state, b = state;
  const Matrix<T> oa = ovq::forward<T>(q, k, v, T(1), opt, a);
  const Matrix<T> ob = ovq::forward<T>(q, k, v, T(1), opt, b);
  EXPECT_TRUE(same_bits(oa, ob));
  const ovq::Grad<T> g = ovq::backward<T>(q, k, v, T(1), w, saved, opt);
  EXPECT_TRUE(g.q.allFinite());
}

}  // namespace
