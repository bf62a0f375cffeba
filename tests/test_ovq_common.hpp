// Shared pieces of the OVQ tests: a token-by-token oracle written straight from SPEC.md §2
// (no blocking, no GEMMs, no scratch), state conversions and comparisons.
#pragma once

#include <mixattn/ovq.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace mixattn::testing {

/// Per-scalar tolerances for comparing two computations of the same quantity. Double: both
/// sides are O(10) flops deep per entry in double, so 1e-10 leaves ample room above 1e-16
/// rounding; float: softmax sums over up to ~10^2 terms rounded at 6e-8 each, with exp
/// amplifying logit rounding by |logit| <= s + log c ~ 5, so 2e-5 is a few hundred ulps.
template <class T>
struct Tol;
template <>
struct Tol<double> {
  static constexpr double rtol = 1e-10, atol = 1e-10;
};
template <>
struct Tol<float> {
  static constexpr double rtol = 2e-5, atol = 2e-5;
};

/// all_close for any two Eigen expressions of any scalar types (compared in double).
template <class DA, class DB>
::testing::AssertionResult close(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b,
                                 double rtol, double atol) {
  return all_close(Matrix<double>(a.template cast<double>()),
                   Matrix<double>(b.template cast<double>()), rtol, atol);
}

/// x / (||x|| + eps), row by row, in double.
inline Matrix<double> unit_rows(const Matrix<double>& x, double eps) {
  Matrix<double> y(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) y.row(i) = x.row(i) / (x.row(i).norm() + eps);
  return y;
}

template <class T>
ovq::State<double> to_double(const ovq::State<T>& s) {
  ovq::State<double> d;
  d.keys = s.keys.template cast<double>();
  d.values = s.values.template cast<double>();
  d.counts = s.counts.template cast<double>();
  d.pending_keys = s.pending_keys.template cast<double>();
  d.pending_values = s.pending_values.template cast<double>();
  d.tokens_seen = s.tokens_seen;
  return d;
}

template <class T>
ovq::State<T> from_double(const ovq::State<double>& s) {
  ovq::State<T> d;
  d.keys = s.keys.template cast<T>();
  d.values = s.values.template cast<T>();
  d.counts = s.counts.template cast<T>();
  d.pending_keys = s.pending_keys.template cast<T>();
  d.pending_values = s.pending_values.template cast<T>();
  d.tokens_seen = s.tokens_seen;
  return d;
}

/// Bitwise equality of two states (used where the library promises identical bits; NaN
/// payloads compare equal to themselves).
template <class T>
bool identical(const ovq::State<T>& a, const ovq::State<T>& b) {
  const auto same = [](const auto& x, const auto& y) {
    return x.rows() == y.rows() && x.cols() == y.cols() &&
           (x.size() == 0 ||
            std::memcmp(x.data(), y.data(),
                        sizeof(*x.data()) * static_cast<std::size_t>(x.size())) == 0);
  };
  return same(a.keys, b.keys) && same(a.values, b.values) && same(a.counts, b.counts) &&
         same(a.pending_keys, b.pending_keys) && same(a.pending_values, b.pending_values) &&
         a.tokens_seen == b.tokens_seen;
}

/// Closeness of two states: counts and shapes exactly, means within tolerance.
inline ::testing::AssertionResult states_close(const ovq::State<double>& a,
                                               const ovq::State<double>& b, double rtol,
                                               double atol) {
  if (a.tokens_seen != b.tokens_seen)
    return ::testing::AssertionFailure()
           << "tokens_seen " << a.tokens_seen << " vs " << b.tokens_seen;
  if (a.keys.rows() != b.keys.rows())
    return ::testing::AssertionFailure()
           << "centroids " << a.keys.rows() << " vs " << b.keys.rows();
  if (a.counts != b.counts) return ::testing::AssertionFailure() << "counts differ";
  for (const auto& [x, y, name] :
       {std::tuple<const Matrix<double>&, const Matrix<double>&, const char*>{a.keys, b.keys,
                                                                              "keys"},
        {a.values, b.values, "values"},
        {a.pending_keys, b.pending_keys, "pending_keys"},
        {a.pending_values, b.pending_values, "pending_values"}}) {
    ::testing::AssertionResult r = all_close(x, y, rtol, atol);
    if (!r) return ::testing::AssertionFailure() << name << ": " << r.message();
  }
  return ::testing::AssertionSuccess();
}

/// Growth schedule straight from SPEC 2.3 step 1, for integral alpha and small t.
inline Index schedule_size(Index t, const ovq::Options& opt) {
  if (t <= 0) return 0;
  if (opt.growth == ovq::Growth::linear) return std::min(t, opt.max_centroids);
  const Index alpha =
      opt.growth_alpha > 0 ? static_cast<Index>(opt.growth_alpha) : opt.max_centroids;
  return std::min(std::max((t * opt.max_centroids) / (t + alpha), Index(1)), opt.max_centroids);
}

/// OVQ written token by token from SPEC 2.2-2.3, in double: each query scans the dictionary and
/// the block's keys so far; a block is absorbed the moment its last token has been answered.
/// Records, for each token of the call (start pending tokens first), the centroid it joined.
struct Oracle {
  std::vector<Index> assignment;
  std::vector<Index> seeds;  // sequence index of each new centroid's seed, in row order

  Matrix<double> run(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                     double beta, const ovq::Options& opt, ovq::State<double>& st) {
    const Index r = q.cols(), dv = v.cols(), c = opt.block;
    const double s = beta * std::sqrt(static_cast<double>(r));
    const Matrix<double> qh = unit_rows(q, opt.norm_eps), kh = unit_rows(k, opt.norm_eps);
    const Index p0 = st.pending_keys.rows();
    assignment.assign(static_cast<std::size_t>(p0 + q.rows()), -1);
    seeds.clear();
    Matrix<double> out(q.rows(), dv);
    for (Index i = 0; i < q.rows(); ++i) {
      append(st.pending_keys, kh.row(i));
      append(st.pending_values, v.row(i));
      ++st.tokens_seen;
      const Index n = st.keys.rows(), p = st.pending_keys.rows();
      std::vector<double> logit;
      for (Index a = 0; a < n; ++a)
        logit.push_back(s * qh.row(i).dot(st.keys.row(a)) +
                        (opt.count_bias ? std::log(st.counts[a]) : 0.0));
      for (Index j = 0; j < p; ++j) logit.push_back(s * qh.row(i).dot(st.pending_keys.row(j)));
      const double mx = *std::max_element(logit.begin(), logit.end());
      double z = 0;
      for (double& x : logit) z += (x = std::exp(x - mx));
      out.row(i).setZero();
      for (Index a = 0; a < n; ++a) out.row(i) += logit[a] / z * st.values.row(a);
      for (Index j = 0; j < p; ++j) out.row(i) += logit[n + j] / z * st.pending_values.row(j);
      if (p == c) absorb(st, opt, p0 + i + 1 - c);
    }
    return out;
  }

 private:
  static void append(Matrix<double>& m, const Eigen::Ref<const Matrix<double>>& row) {
    m.conservativeResize(m.rows() + 1, Eigen::NoChange);
    m.row(m.rows() - 1) = row;
  }

  void absorb(ovq::State<double>& st, const ovq::Options& opt, Index seq0) {
    const Index c = opt.block, n_old = st.keys.rows();
    const Matrix<double> kb = st.pending_keys, vb = st.pending_values;
    const Index t = st.tokens_seen - c;
    const Index nu = std::clamp<Index>(schedule_size(t + c, opt) - n_old, 0, c);
    const double inf = std::numeric_limits<double>::infinity();
    // Highest similarity of token j to the rows of `cents`.
    const auto closest = [&](Index j, const std::vector<Eigen::RowVectorXd>& cents) {
      double best = -inf;
      for (const auto& x : cents) best = std::max(best, kb.row(j).dot(x));
      return best;
    };
    std::vector<Eigen::RowVectorXd> old_rows;
    for (Index a = 0; a < n_old; ++a) old_rows.push_back(st.keys.row(a));
    std::vector<Index> picks;
    const auto picked = [&](Index j) {
      return std::find(picks.begin(), picks.end(), j) != picks.end();
    };
    if (opt.seeding == ovq::Seeding::greedy_dispersion) {
      std::vector<Eigen::RowVectorXd> cents = old_rows;
      for (Index p = 0; p < nu; ++p) {
        Index best_j = -1;
        double best = inf;
        for (Index j = 0; j < c; ++j) {
          if (picked(j)) continue;
          const double score = closest(j, cents);
          if (best_j < 0 || score < best) best = score, best_j = j;
        }
        picks.push_back(best_j);
        cents.push_back(kb.row(best_j));
      }
    } else if (nu > 0) {
      std::vector<Eigen::RowVectorXd> ref = old_rows;
      if (n_old == 0) {
        picks.push_back(0);
        ref.push_back(kb.row(0));
      }
      std::vector<std::pair<double, Index>> cand;
      for (Index j = 0; j < c; ++j)
        if (!picked(j)) cand.push_back({closest(j, ref), j});
      std::sort(cand.begin(), cand.end());
      for (std::size_t a = 0; static_cast<Index>(picks.size()) < nu; ++a)
        picks.push_back(cand[a].second);
    }
    // Centroids after seeding, then assignment (ties -> lowest row).
    Matrix<double> cents(n_old + nu, kb.cols());
    cents.topRows(n_old) = st.keys;
    for (Index p = 0; p < nu; ++p) cents.row(n_old + p) = kb.row(picks[p]);
    std::vector<Index> to(static_cast<std::size_t>(c));
    for (Index j = 0; j < c; ++j) {
      const auto it = std::find(picks.begin(), picks.end(), j);
      if (it != picks.end()) {
        to[j] = n_old + (it - picks.begin());
        continue;
      }
      Index arg = 0;
      for (Index a = 1; a < cents.rows(); ++a)
        if (kb.row(j).dot(cents.row(a)) > kb.row(j).dot(cents.row(arg))) arg = a;
      to[j] = arg;
    }
    // Running means.
    Matrix<double> keys(n_old + nu, kb.cols()), values(n_old + nu, vb.cols());
    Vector<double> counts(n_old + nu);
    for (Index a = 0; a < n_old + nu; ++a) {
      const double c_old = a < n_old ? st.counts[a] : 0.0;
      Eigen::RowVectorXd sk = a < n_old ? Eigen::RowVectorXd(c_old * st.keys.row(a))
                                        : Eigen::RowVectorXd::Zero(kb.cols());
      Eigen::RowVectorXd sv = a < n_old ? Eigen::RowVectorXd(c_old * st.values.row(a))
                                        : Eigen::RowVectorXd::Zero(vb.cols());
      double m = 0;
      for (Index j = 0; j < c; ++j)
        if (to[j] == a) sk += kb.row(j), sv += vb.row(j), m += 1;
      counts[a] = c_old + m;
      keys.row(a) = sk / counts[a];
      values.row(a) = sv / counts[a];
    }
    st.keys = keys;
    st.values = values;
    st.counts = counts;
    st.pending_keys.resize(0, kb.cols());
    st.pending_values.resize(0, vb.cols());
    for (Index j = 0; j < c; ++j) assignment[static_cast<std::size_t>(seq0 + j)] = to[j];
    for (Index p = 0; p < nu; ++p) seeds.push_back(seq0 + picks[p]);
  }
};

}  // namespace mixattn::testing
