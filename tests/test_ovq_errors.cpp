// OVQ argument validation: every bad shape, option, inconsistent state and non-finite input is
// rejected with the right exception type and a message naming the argument, and the state is
// left exactly as it was.
#include <mixattn/ovq.hpp>

#include "test_ovq_common.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>

namespace {

using namespace mixattn;
namespace mt = mixattn::testing;
using mt::random_matrix;

constexpr Index r = 4, dv = 3, n = 10;

struct Fixture {
  ovq::Options opt;
  ovq::State<double> st;
  Matrix<double> q = random_matrix<double>(n, r, 1), k = random_matrix<double>(n, r, 2),
                 v = random_matrix<double>(n, dv, 3);
  Fixture() {
    opt.block = 4;
    opt.max_centroids = 5;
    st = ovq::State<double>::empty(r, dv);
    ovq::forward<double>(random_matrix<double>(9, r, 4), random_matrix<double>(9, r, 5),
                         random_matrix<double>(9, dv, 6), 1.0, opt, st);  // 2 blocks + 1 pending
  }
};

/// Expects forward to throw E with a message containing every `needle`, and the state unchanged.
template <class E>
void expect_forward_throws(Fixture f, const std::vector<std::string>& needles, double beta = 1.0) {
  const ovq::State<double> before = f.st;
  ovq::Saved<double> saved;
  saved.tokens = 12345;  // must survive a throw too
  try {
    ovq::forward<double>(f.q, f.k, f.v, beta, f.opt, f.st, &saved);
    ADD_FAILURE() << "no exception; expected one mentioning " << needles.front();
  } catch (const E& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("mixattn::ovq::forward"), std::string::npos) << what;
    for (const std::string& s : needles) EXPECT_NE(what.find(s), std::string::npos) << what;
  }
  EXPECT_TRUE(mt::identical(f.st, before));
  EXPECT_EQ(saved.tokens, 12345);
}

TEST(OvqErrors, BadShapes) {
  using IA = std::invalid_argument;
  {
    Fixture f;
    f.q = random_matrix<double>(n, r + 1, 7);
    expect_forward_throws<IA>(f, {"q has 5 columns", "4"});
  }
  {
    Fixture f;
    f.k = random_matrix<double>(n, r - 1, 7);
    expect_forward_throws<IA>(f, {"k has 3 columns"});
  }
  {
    Fixture f;
    f.v = random_matrix<double>(n, dv + 2, 7);
    expect_forward_throws<IA>(f, {"v has 5 columns"});
  }
  {
    Fixture f;
    f.k = random_matrix<double>(n + 1, r, 7);
    expect_forward_throws<IA>(f, {"k has 11 rows", "q has 10"});
  }
  {
    Fixture f;
    f.v = random_matrix<double>(n - 1, dv, 7);
    expect_forward_throws<IA>(f, {"v has 9 rows"});
  }
}

TEST(OvqErrors, BadOptions) {
  using IA = std::invalid_argument;
  {
    Fixture f;
    f.opt.block = 0;
    expect_forward_throws<IA>(f, {"options.block is 0"});
  }
  {
    Fixture f;
    f.opt.max_centroids = 0;
    expect_forward_throws<IA>(f, {"options.max_centroids is 0"});
  }
  {
    Fixture f;
    f.opt.growth_alpha = -1;
    expect_forward_throws<IA>(f, {"options.growth_alpha is -1"});
  }
  {
    Fixture f;
    f.opt.norm_eps = 0;
    expect_forward_throws<IA>(f, {"options.norm_eps is 0"});
  }
  {
    Fixture f;
    f.opt.norm_eps = -1e-3;
    expect_forward_throws<IA>(f, {"options.norm_eps"});
  }
  {
    Fixture f;
    f.opt.assignment = static_cast<ovq::Assignment>(7);  // e.g. an unchecked integer from a binding
    expect_forward_throws<IA>(f, {"options.assignment is 7"});
  }
  {
    Fixture f;
    f.opt.max_centroids = 2;
    expect_forward_throws<IA>(f, {"more than options.max_centroids = 2"});
  }
  {
    Fixture f;
    f.opt.block = 5;
    expect_forward_throws<IA>(f, {"tokens_seen = 9 leaves 4"});
  }  // 9 % 5 != 1
}

TEST(OvqErrors, InconsistentState) {
  using IA = std::invalid_argument;
  {
    Fixture f;
    f.st.values.conservativeResize(f.st.values.rows() - 1, Eigen::NoChange);
    expect_forward_throws<IA>(f, {"state.values has"});
  }
  {
    Fixture f;
    f.st.counts.conservativeResize(f.st.counts.size() + 1);
    f.st.counts[f.st.counts.size() - 1] = 1;
    expect_forward_throws<IA>(f, {"state.counts has"});
  }
  {
    Fixture f;
    f.st.pending_values.resize(0, dv);
    expect_forward_throws<IA>(f, {"state.pending_values has 0 rows"});
  }
  {
    Fixture f;
    f.st.pending_keys.resize(1, r + 1);
    expect_forward_throws<IA>(f, {"state.pending_keys is 1 x 5"});
  }
  {
    Fixture f;
    f.st.pending_values.resize(1, dv + 1);
    expect_forward_throws<IA>(f, {"state.pending_values is 1 x 4"});
  }
  {
    Fixture f;  // pending >= block
    f.st.pending_keys = random_matrix<double>(4, r, 8);
    f.st.pending_values = random_matrix<double>(4, dv, 9);
    f.st.tokens_seen = 12;
    expect_forward_throws<IA>(f, {"fewer than options.block = 4"});
  }
  {
    Fixture f;
    f.st.tokens_seen = 10;
    expect_forward_throws<IA>(f, {"tokens_seen = 10"});
  }
  {
    Fixture f;
    f.st.tokens_seen = -3;
    expect_forward_throws<IA>(f, {"state.tokens_seen is -3"});
  }
  {
    Fixture f;
    f.st.counts[0] = 0.5;
    expect_forward_throws<IA>(f, {"state.counts[0] is 0.5"});
  }
  {
    Fixture f;
    f.st = ovq::State<double>{};
    expect_forward_throws<IA>(f, {"State<T>::empty"});
  }
}

TEST(OvqErrors, NonFinite) {
  using DE = std::domain_error;
  const double nan = std::numeric_limits<double>::quiet_NaN(),
               inf = std::numeric_limits<double>::infinity();
  {
    Fixture f;
    f.q(3, 1) = nan;
    expect_forward_throws<DE>(f, {"q has a non-finite entry at (3, 1)"});
  }
  {
    Fixture f;
    f.k(0, 0) = inf;
    expect_forward_throws<DE>(f, {"k has a non-finite"});
  }
  {
    Fixture f;
    f.v(9, 2) = -inf;
    expect_forward_throws<DE>(f, {"v has a non-finite"});
  }
  {
    Fixture f;
    expect_forward_throws<DE>(f, {"beta is nan"}, nan);
  }
  {
    Fixture f;
    f.st.keys(0, 0) = nan;
    expect_forward_throws<DE>(f, {"state.keys has a non-finite"});
  }
  {
    Fixture f;
    f.st.values(0, 0) = inf;
    expect_forward_throws<DE>(f, {"state.values"});
  }
  {
    Fixture f;
    f.st.counts[0] = inf;
    expect_forward_throws<DE>(f, {"state.counts"});
  }
  {
    Fixture f;
    f.st.pending_keys(0, 0) = nan;
    expect_forward_throws<DE>(f, {"state.pending_keys"});
  }
  {
    Fixture f;
    f.st.pending_values(0, 0) = nan;
    expect_forward_throws<DE>(f, {"state.pending_values"});
  }
  // With the check off, a NaN input is the caller's business: no throw.
  Fixture f;
  f.opt.check_finite = false;
  f.q(0, 0) = nan;
  EXPECT_NO_THROW(ovq::forward<double>(f.q, f.k, f.v, 1.0, f.opt, f.st));
}

TEST(OvqErrors, EmptyStateDimensions) {
  EXPECT_THROW(ovq::State<float>::empty(0, 3), std::invalid_argument);
  EXPECT_THROW(ovq::State<float>::empty(3, 0), std::invalid_argument);
}

TEST(OvqErrors, Backward) {
  Fixture f;
  ovq::Saved<double> saved;
  ovq::State<double> st = f.st;
  ovq::forward<double>(f.q, f.k, f.v, 1.0, f.opt, st, &saved);
  const Matrix<double> go = random_matrix<double>(n, dv, 10);
  const auto msg = [&](const std::function<void()>& call) -> std::string {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      return e.what();
    } catch (const std::domain_error& e) {
      return std::string("domain: ") + e.what();
    }
    return "no exception";
  };
  const auto has = [](const std::string& s, const char* needle) {
    return s.find(needle) != std::string::npos;
  };
  EXPECT_NO_THROW(ovq::backward<double>(f.q, f.k, f.v, 1.0, go, saved, f.opt));
  EXPECT_TRUE(has(msg([&] {
                    ovq::backward<double>(f.q, f.k, f.v, 1.0, random_matrix<double>(n, dv + 1, 1),
                                          saved, f.opt);
                  }),
                  "grad_out is 10 x 4"));
  EXPECT_TRUE(has(msg([&] {
                    ovq::backward<double>(f.q.topRows(5), f.k.topRows(5), f.v.topRows(5), 1.0,
                                          go.topRows(5), saved, f.opt);
                  }),
                  "saved is for 10 tokens"));
  EXPECT_TRUE(
      has(msg([&] { ovq::backward<double>(f.q, f.k, f.v, 2.0, go, saved, f.opt); }), "beta is 2"));
  ovq::Options other = f.opt;
  other.block = 8;
  EXPECT_TRUE(has(msg([&] { ovq::backward<double>(f.q, f.k, f.v, 1.0, go, saved, other); }),
                  "differ from the forward"));
  EXPECT_TRUE(
      has(msg([&] { ovq::backward<double>(f.q, f.k, f.v, 1.0, go, ovq::Saved<double>{}, f.opt); }),
          "not filled"));
  Matrix<double> bad = go;
  bad(2, 2) = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(has(msg([&] { ovq::backward<double>(f.q, f.k, f.v, 1.0, bad, saved, f.opt); }),
                  "domain: mixattn::ovq::backward: grad_out"));
}

}  // namespace
