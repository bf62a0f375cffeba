// Shared helpers for the test suite: seeded random inputs, central finite differences, and
// a closeness check that reports where the largest error is.
#pragma once

#include <mixattn/core.hpp>

#include "random_matrix.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <initializer_list>
#include <random>
#include <string>

namespace mixattn::testing {

/// Central finite difference of the scalar `loss()` with respect to every entry of `x`
/// (any Eigen lvalue: matrix, vector, Map). `x` is perturbed in place and restored.
/// Truncation error is O(h^2 f'''), rounding O(eps/h): h = 1e-6 balances them in double.
template <class Derived, class Loss>
Matrix<double> numeric_gradient(Eigen::DenseBase<Derived>& x, Loss&& loss, double h = 1e-6) {
  Matrix<double> g(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i)
    for (Index j = 0; j < x.cols(); ++j) {
      const double saved = x(i, j);
      x(i, j) = saved + h;
      const double up = loss();
      x(i, j) = saved - h;
      const double down = loss();
      x(i, j) = saved;
      g(i, j) = (up - down) / (2 * h);
    }
  return g;
}

namespace detail {
inline ::testing::AssertionResult all_close_double(const Matrix<double>& a, const Matrix<double>& b,
                                                   double rtol, double atol) {
  if (a.rows() != b.rows() || a.cols() != b.cols())
    return ::testing::AssertionFailure()
           << "shape " << a.rows() << "x" << a.cols() << " vs " << b.rows() << "x" << b.cols();
  double worst = 0;
  Index wi = 0, wj = 0;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j) {
      const double e = std::abs(a(i, j) - b(i, j)) / (atol + rtol * std::abs(b(i, j)));
      if (!(e <= worst)) {  // also catches NaN
        worst = e;
        wi = i;
        wj = j;
        if (std::isnan(e)) break;
      }
    }
  if (worst <= 1) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "worst entry (" << wi << ", " << wj << "): " << a(wi, wj) << " vs " << b(wi, wj)
         << " (rtol " << rtol << ", atol " << atol << ", ratio " << worst << ")";
}
}  // namespace detail

/// Largest |a - b| / (atol + rtol * |b|) over all entries (compared in double); <= 1 means close.
template <class DA, class DB>
::testing::AssertionResult all_close(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b,
                                     double rtol, double atol) {
  return detail::all_close_double(Matrix<double>(a.template cast<double>()),
                                  Matrix<double>(b.template cast<double>()), rtol, atol);
}

/// Runs f and expects exception E whose message contains every fragment.
template <class E, class F>
void expect_throw(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    const std::string what = e.what();
    for (const char* frag : fragments)
      EXPECT_NE(what.find(frag), std::string::npos) << "'" << frag << "' not in: " << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

/// Tolerances of the causal scan's results (GMA, linear attention) against the same sums taken
/// in another order: in pieces, with another chunk length, or by an O(N^2) double twin. The
/// in-chunk and feature sums (at most ~70 terms here) carry ~70 eps relative rounding, the
/// prefix state is kept in double either way, and outputs are ratios of positive sums of O(1)
/// values (no cancellation in the denominator).
template <class T>
struct ScanTol;
// float: 70 * 6e-8 = 4e-6 relative; 2e-5 relative / 2e-6 absolute leaves a margin of ~5-10.
template <>
struct ScanTol<float> {
  static constexpr double rtol = 2e-5, atol = 2e-6;
};
// double: the same argument at 1.1e-16 gives ~1e-14; 1e-12 relative / 1e-13 absolute.
template <>
struct ScanTol<double> {
  static constexpr double rtol = 1e-12, atol = 1e-13;
};

/// A small causal layer: d_model 6, 2 heads, r 3, d_v 2, K 4, OVQ blocks of 4. Config is
/// mixattn::layer::Config (a parameter, so that this header needs no operator header).
template <class Config>
Config small_layer(decltype(Config::mixer) kind) {
  Config cfg;
  cfg.model_dim = 6;
  cfg.heads = 2;
  cfg.key_dim = 3;
  cfg.value_dim = 2;
  cfg.components = 4;
  cfg.mixer = kind;
  cfg.causal = true;
  cfg.ovq.block = 4;
  return cfg;
}

/// reference::flash_forward when `flash`, else naive_forward, with default options: for tests
/// that hold both forms to one body. Found through the record's namespace (Saved is
/// reference::Saved<T>), so that this header needs no operator header.
template <class T, class Saved>
Matrix<T> reference_forward(bool flash, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                            Saved* saved) {
  return flash ? flash_forward(q, k, v, {}, saved) : naive_forward(q, k, v, {}, saved);
}

/// The backward matching reference_forward(flash, ...).
template <class T, class Saved>
auto reference_backward(bool flash, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                        const Matrix<T>& grad_out, const Saved& saved) {
  return flash ? flash_backward(q, k, v, grad_out, saved)
               : naive_backward(q, k, v, grad_out, saved);
}

}  // namespace mixattn::testing
