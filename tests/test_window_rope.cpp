// Sliding-window causal softmax attention (SPEC.md §7) and rotary position embedding (SPEC.md §8).
//
// Window: the naive (masked) form against a direct triple loop; the tiled form against the naive
// one (output and all three gradients, at the public tile sizes and at small tile sizes that cut
// windows at every offset); window >= N is plain causal attention bit for bit; tiles outside
// every window are skipped (shown with NaN inputs there, not with timings); the windowed flash
// backward against central differences in double; decoding with a window; argument errors.
// RoPE: against the direct formula, its backward against central differences, pair norms kept,
// position offsets, relative-position dot products, argument errors.
#include <mixattn/reference.hpp>
#include <mixattn/rope.hpp>
#include <mixattn/window.hpp>

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
namespace ref = mixattn::reference;
namespace rope = mixattn::rope;
// The namespace of the tile kernels (detail/flash_kernels.hpp), named once here.
namespace kern = mixattn::detail;

template <class T>
class Window : public ::testing::Test {};
template <class T>
class Rope : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
struct ScalarName {
  template <class T>
  static std::string GetName(int) {
    return std::is_same<T, float>::value ? "float" : "double";
  }
};
TYPED_TEST_SUITE(Window, Scalars, ScalarName);
TYPED_TEST_SUITE(Rope, Scalars, ScalarName);

/// Exact equality, entry by entry (NaN never equal), with the first difference in the message.
template <class A, class B>
::testing::AssertionResult same_bits(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols())
    return ::testing::AssertionFailure() << "shapes differ";
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j)
      if (!(a(i, j) == b(i, j)))
        return ::testing::AssertionFailure()
               << "(" << i << ", " << j << "): " << a(i, j) << " vs " << b(i, j);
  return ::testing::AssertionSuccess();
}

// =============================================================================================
// Sliding window

// The tolerances of tests/test_reference.cpp, whose argument holds here a fortiori (a window
// only shortens the softmax sums). float: logits and probabilities carry ~1e-7 relative
// rounding, amplified by sums over r, the window and d_v (<= a few hundred terms) and by exp
// near 1: 1e-4 relative / 2e-5 absolute on O(1) outputs and gradients leaves a margin of ~10
// while catching any wrong term (a key wrongly in or out of a window of w moves a row by
// O(1/w) >= 1/700). double: the same at 1.1e-16 gives ~1e-13; 1e-11 leaves a margin of ~100.
template <class T>
struct Tol;
template <>
struct Tol<float> {
  static constexpr double rtol = 1e-4, atol = 2e-5;
};
template <>
struct Tol<double> {
  static constexpr double rtol = 1e-11, atol = 1e-11;
};

ref::Options windowed(Index w) {
  ref::Options o;
  o.causal = true;
  o.window = w;
  return o;
}

std::string where(Index n, Index w, std::uint64_t seed) {
  return "N=" + std::to_string(n) + " window=" + std::to_string(w) +
         " seed=" + std::to_string(seed);
}

/// The definition term by term in double: o_i = sum_{i-w < j <= i} softmax_j(scale q_i . k_j) v_j.
template <class T>
Matrix<double> window_triple_loop(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                                  Index w) {
  const Index n = q.rows(), r = q.cols(), dv = v.cols();
  const double scale = 1 / std::sqrt(double(r));
  Matrix<double> out = Matrix<double>::Zero(n, dv);
  for (Index i = 0; i < n; ++i) {
    std::vector<double> logit;
    double mx = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j <= i; ++j) {
      if (!(i - w < j)) continue;
      double s = 0;
      for (Index c = 0; c < r; ++c) s += double(q(i, c)) * double(k(j, c));
      logit.push_back(scale * s);
      mx = std::max(mx, logit.back());
    }
    double sum = 0;
    for (double l : logit) sum += std::exp(l - mx);
    const Index first = i + 1 - Index(logit.size());
    for (Index t = 0; t < Index(logit.size()); ++t)
      for (Index c = 0; c < dv; ++c)
        out(i, c) += std::exp(logit[t] - mx) / sum * double(v(first + t, c));
  }
  return out;
}

// The masked naive form is the oracle of the tiled one: hold it to the definition first, and
// check that its saved probabilities vanish exactly outside the window.
TYPED_TEST(Window, NaiveMatchesTripleLoop) {
  using T = TypeParam;
  std::uint64_t seed = 10;
  for (Index n : {1, 7, 100})
    for (Index w : {Index(1), Index(5), Index(64), n, n + 3}) {
      ++seed;
      SCOPED_TRACE(where(n, w, seed));
      const Matrix<T> q = random_matrix<T>(n, 12, seed), k = random_matrix<T>(n, 12, seed + 100);
      const Matrix<T> v = random_matrix<T>(n, 5, seed + 200);
      ref::Saved<T> saved;
      const Matrix<T> got = ref::naive_forward<T>(q, k, v, windowed(w), &saved);
      EXPECT_TRUE(all_close(got, window_triple_loop(q, k, v, w), Tol<T>::rtol, Tol<T>::atol));
      for (Index i = 0; i < n; ++i)
        for (Index j = 0; j < n; ++j) {
          const bool seen = j <= i && i - w < j;
          if (!seen) {
            EXPECT_EQ(saved.probs(i, j), T(0)) << i << ", " << j;
          } else if (w == 1) {
            EXPECT_EQ(saved.probs(i, j), T(1)) << i << ", " << j;
          }
        }
    }
}

// The tiled form against the naive one, forward and the three gradients, at the public tiles
// (64 x 256 forward; 64 x 256 float / 64 x 128 double backward): windows of one key, shorter
// than, equal to and one either side of a key tile, the whole sequence and beyond it.
TYPED_TEST(Window, FlashMatchesNaive) {
  using T = TypeParam;
  std::uint64_t seed = 1000;
  for (Index n : {1, 7, 100, 300, 700})
    for (Index w : {Index(1), Index(5), Index(64), Index(255), Index(256), Index(257), n, n + 3}) {
      ++seed;
      SCOPED_TRACE(where(n, w, seed));
      const Matrix<T> q = random_matrix<T>(n, 20, seed), k = random_matrix<T>(n, 20, seed + 1);
      const Matrix<T> v = random_matrix<T>(n, 12, seed + 2), go = random_matrix<T>(n, 12, seed + 3);
      const ref::Options opt = windowed(w);
      ref::Saved<T> ns, fs;
      const Matrix<T> naive = ref::naive_forward<T>(q, k, v, opt, &ns);
      const Matrix<T> flash = ref::flash_forward<T>(q, k, v, opt, &fs);
      EXPECT_TRUE(all_close(flash, naive, Tol<T>::rtol, Tol<T>::atol)) << "out";
      const ref::Grad<T> ng = ref::naive_backward(q, k, v, go, ns, opt);
      const ref::Grad<T> fg = ref::flash_backward(q, k, v, go, fs, opt);
      EXPECT_TRUE(all_close(fg.q, ng.q, Tol<T>::rtol, Tol<T>::atol)) << "dq";
      EXPECT_TRUE(all_close(fg.k, ng.k, Tol<T>::rtol, Tol<T>::atol)) << "dk";
      EXPECT_TRUE(all_close(fg.v, ng.v, Tol<T>::rtol, Tol<T>::atol)) << "dv";
      // The caller-owned forms run the same body.
      Matrix<T> out_into;
      ref::Saved<T> s_into;
      ref::flash_forward_into<T>(out_into, q, k, v, opt, &s_into);
      EXPECT_TRUE(same_bits(out_into, flash));
      ref::Grad<T> g_into;
      ref::flash_backward_into<T>(g_into, q, k, v, go, s_into, opt);
      EXPECT_TRUE(same_bits(g_into.k, fg.k));
    }
}

// Small tiles: windows shorter than, equal to and longer than the tiles, with query tiles longer,
// shorter and coprime to key tiles, so a window starts at every offset inside a tile.
template <class T, Index BQ, Index BK>
void check_small_tiles(std::uint64_t seed) {
  for (Index n : {1, 7, 37, 40})
    for (Index w : {Index(1), Index(2), Index(3), Index(5), Index(8), Index(13), n, n + 3}) {
      ++seed;
      SCOPED_TRACE(where(n, w, seed) + " tiles " + std::to_string(BQ) + " x " + std::to_string(BK));
      const Matrix<T> q = random_matrix<T>(n, 6, seed), k = random_matrix<T>(n, 6, seed + 1);
      const Matrix<T> v = random_matrix<T>(n, 5, seed + 2), go = random_matrix<T>(n, 5, seed + 3);
      ref::Options opt = windowed(w);
      opt.scale = 0.6;
      ref::Saved<T> ns;
      const Matrix<T> naive = ref::naive_forward<T>(q, k, v, opt, &ns);
      const ref::Grad<T> ng = ref::naive_backward(q, k, v, go, ns, opt);
      Matrix<T> out(n, 5);
      Vector<T> lse(n);
      kern::flash_forward_tiles<T, BQ, BK>(q, k, v, T(0.6), true, out, lse, w);
      EXPECT_TRUE(all_close(out, naive, Tol<T>::rtol, Tol<T>::atol)) << "out";
      Matrix<T> dq(n, 6), dk(n, 6), dv(n, 5);
      kern::flash_backward_tiles<T, BQ, BK>(q, k, v, out, go, lse, T(0.6), true, dq, dk, dv, w);
      EXPECT_TRUE(all_close(dq, ng.q, Tol<T>::rtol, Tol<T>::atol)) << "dq";
      EXPECT_TRUE(all_close(dk, ng.k, Tol<T>::rtol, Tol<T>::atol)) << "dk";
      EXPECT_TRUE(all_close(dv, ng.v, Tol<T>::rtol, Tol<T>::atol)) << "dv";
    }
}

TYPED_TEST(Window, SmallTilesMatchNaive) {
  check_small_tiles<TypeParam, 4, 4>(3000);
  check_small_tiles<TypeParam, 8, 3>(4000);
  check_small_tiles<TypeParam, 3, 8>(5000);
  check_small_tiles<TypeParam, 5, 7>(6000);
}

// A window of N or more keys hides nothing: both forms run their unwindowed code on the same
// numbers, so the results are the very same bits as plain causal attention's.
TYPED_TEST(Window, WindowOfAtLeastNIsPlainCausal) {
  using T = TypeParam;
  std::uint64_t seed = 7000;
  for (Index n : {1, 7, 100, 300})
    for (Index w : {n, n + 3, 10 * n}) {
      ++seed;
      SCOPED_TRACE(where(n, w, seed));
      const Matrix<T> q = random_matrix<T>(n, 16, seed), k = random_matrix<T>(n, 16, seed + 1);
      const Matrix<T> v = random_matrix<T>(n, 8, seed + 2), go = random_matrix<T>(n, 8, seed + 3);
      ref::Options causal;
      causal.causal = true;
      const ref::Options opt = windowed(w);
      ref::Saved<T> fc, fw, nc, nw;
      EXPECT_TRUE(same_bits(ref::flash_forward<T>(q, k, v, opt, &fw),
                            ref::flash_forward<T>(q, k, v, causal, &fc)));
      EXPECT_TRUE(same_bits(fw.lse, fc.lse));
      const ref::Grad<T> gw = ref::flash_backward(q, k, v, go, fw, opt);
      const ref::Grad<T> gc = ref::flash_backward(q, k, v, go, fc, causal);
      EXPECT_TRUE(same_bits(gw.q, gc.q) && same_bits(gw.k, gc.k) && same_bits(gw.v, gc.v));
      EXPECT_TRUE(same_bits(ref::naive_forward<T>(q, k, v, opt, &nw),
                            ref::naive_forward<T>(q, k, v, causal, &nc)));
      const ref::Grad<T> hw = ref::naive_backward(q, k, v, go, nw, opt);
      const ref::Grad<T> hc = ref::naive_backward(q, k, v, go, nc, causal);
      EXPECT_TRUE(same_bits(hw.q, hc.q) && same_bits(hw.k, hc.k) && same_bits(hw.v, hc.v));
    }
}

// Tile skipping, shown without a clock. A NaN in a key or value poisons every tile product that
// reads it, masked or not (0 * NaN = NaN in P V and in dS^T Q). Put NaN in key and value 0 and
// run the forward unchecked: a query tile that starts at i0 >= w reads no key before
// i0 - w + 1 >= 1 if key tiles before the window are skipped, so every row i >= w + BQ - 1 must
// be finite and the same bits as with clean inputs; the unwindowed schedule would read key 0
// in every query tile. Row 0 sees key 0 and must be NaN (the poison works).
template <class T, Index BQ, Index BK, class Forward>
void check_forward_skips(Index n, Index w, Forward&& forward) {
  SCOPED_TRACE(where(n, w, 0) + " tiles " + std::to_string(BQ) + " x " + std::to_string(BK));
  const Matrix<T> q = random_matrix<T>(n, 8, 81), k = random_matrix<T>(n, 8, 82);
  const Matrix<T> v = random_matrix<T>(n, 4, 83);
  Matrix<T> kp = k, vp = v;
  kp.row(0).setConstant(std::numeric_limits<T>::quiet_NaN());
  vp.row(0).setConstant(std::numeric_limits<T>::quiet_NaN());
  const Matrix<T> clean = forward(q, k, v), poisoned = forward(q, kp, vp);
  EXPECT_TRUE(std::isnan(poisoned(0, 0)));
  const Index from = w + BQ - 1;
  ASSERT_LT(from, n);
  EXPECT_TRUE(same_bits(poisoned.bottomRows(n - from), clean.bottomRows(n - from)));
}

// The backward: NaN in the last query and its output gradient. A key tile [j0, j0 + bc) meets
// only the query tiles starting before j0 + bc - 1 + w; the tile holding query N-1 starts after
// N-1-BQ, so keys j <= N - BQ - BK - w + 1 never meet it: their dk and dv must be finite and the
// same bits as with clean inputs. Key N-1 is seen by query N-1 and its gradient must be NaN.
template <class T, Index BQ, Index BK, class Backward>
void check_backward_skips(Index n, Index w, Backward&& backward) {
  SCOPED_TRACE(where(n, w, 0) + " tiles " + std::to_string(BQ) + " x " + std::to_string(BK));
  const Matrix<T> q = random_matrix<T>(n, 8, 91), k = random_matrix<T>(n, 8, 92);
  const Matrix<T> v = random_matrix<T>(n, 4, 93), go = random_matrix<T>(n, 4, 94);
  Matrix<T> qp = q, gop = go;
  qp.row(n - 1).setConstant(std::numeric_limits<T>::quiet_NaN());
  gop.row(n - 1).setConstant(std::numeric_limits<T>::quiet_NaN());
  Matrix<T> dk_clean, dv_clean, dk, dv;
  backward(q, k, v, go, dk_clean, dv_clean);
  backward(qp, k, v, gop, dk, dv);
  EXPECT_TRUE(std::isnan(dk(n - 1, 0)) && std::isnan(dv(n - 1, 0)));
  const Index keys = n - BQ - BK - w + 2;  // j < keys
  ASSERT_GT(keys, 0);
  EXPECT_TRUE(same_bits(dk.topRows(keys), dk_clean.topRows(keys)));
  EXPECT_TRUE(same_bits(dv.topRows(keys), dv_clean.topRows(keys)));
}

template <class T, Index BQ, Index BK>
void check_kernel_skips(Index n, Index w) {
  check_forward_skips<T, BQ, BK>(
      n, w, [&](const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v) {
        Matrix<T> out(n, v.cols());
        Vector<T> lse(n);
        kern::flash_forward_tiles<T, BQ, BK>(q, k, v, T(0.5), true, out, lse, w);
        return out;
      });
  check_backward_skips<T, BQ, BK>(
      n, w,
      [&](const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, const Matrix<T>& go,
          Matrix<T>& dk, Matrix<T>& dv) {
        Matrix<T> out(n, v.cols()), dq(n, q.cols());
        Vector<T> lse(n);
        kern::flash_forward_tiles<T, BQ, BK>(q, k, v, T(0.5), true, out, lse, w);
        dk.resize(n, k.cols());
        dv.resize(n, v.cols());
        kern::flash_backward_tiles<T, BQ, BK>(q, k, v, out, go, lse, T(0.5), true, dq, dk, dv, w);
      });
}

TYPED_TEST(Window, TilesOutsideEveryWindowAreSkipped) {
  using T = TypeParam;
  check_kernel_skips<T, 4, 4>(60, 5);
  check_kernel_skips<T, 8, 3>(60, 7);
  check_kernel_skips<T, 5, 7>(60, 13);
  // The public entry points at their own tile sizes.
  using Tiles = kern::FlashTiles<T>;
  ref::Options opt = windowed(64);
  opt.check_finite = false;
  const Index n = 700;
  check_forward_skips<T, Tiles::forward_queries, Tiles::forward_keys>(
      n, opt.window, [&](const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v) {
        return ref::flash_forward<T>(q, k, v, opt);
      });
  check_backward_skips<T, Tiles::backward_queries, Tiles::backward_keys>(
      n, opt.window,
      [&](const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, const Matrix<T>& go,
          Matrix<T>& dk, Matrix<T>& dv) {
        ref::Saved<T> saved;
        ref::flash_forward<T>(q, k, v, opt, &saved);
        ref::Grad<T> g = ref::flash_backward<T>(q, k, v, go, saved, opt);
        dk = g.k;
        dv = g.v;
      });
}

// Central differences in double of L = sum(W . flash_forward(q, k, v; window)) for every entry
// of q, k and v, through the public entry points and through small tiles. h = 1e-6
// (test_util.hpp): truncation ~h^2 |L'''| ~ 1e-12, rounding ~1e-16 |L| / h ~ 1e-10 for
// |L| <= ~1e2; 1e-6 relative / 1e-7 absolute is above both and far below the O(1e-2) error of a
// key wrongly in or out of a window (as in test_reference.cpp).
TEST(WindowBackward, MatchesCentralDifferences) {
  std::uint64_t seed = 9000;
  for (Index n : {9, 20})
    for (Index w : {1, 3, 7}) {
      ++seed;
      SCOPED_TRACE(where(n, w, seed));
      Matrix<double> q = random_matrix<double>(n, 3, seed),
                     k = random_matrix<double>(n, 3, seed + 1);
      Matrix<double> v = random_matrix<double>(n, 2, seed + 2);
      const Matrix<double> wgt = random_matrix<double>(n, 2, seed + 3);
      const ref::Options opt = windowed(w);
      ref::Saved<double> saved;
      ref::flash_forward<double>(q, k, v, opt, &saved);
      const ref::Grad<double> g = ref::flash_backward(q, k, v, wgt, saved, opt);
      const auto loss = [&] {
        return ref::flash_forward<double>(q, k, v, opt).cwiseProduct(wgt).sum();
      };
      EXPECT_TRUE(all_close(g.q, numeric_gradient(q, loss), 1e-6, 1e-7)) << "dq";
      EXPECT_TRUE(all_close(g.k, numeric_gradient(k, loss), 1e-6, 1e-7)) << "dk";
      EXPECT_TRUE(all_close(g.v, numeric_gradient(v, loss), 1e-6, 1e-7)) << "dv";

      // Tiles of 4 queries x 3 keys: windows cut inside tiles on both edges.
      const auto tiled = [&](Matrix<double>& out, Vector<double>& lse) {
        out.resize(n, 2);
        lse.resize(n);
        kern::flash_forward_tiles<double, 4, 3>(q, k, v, 0.7, true, out, lse, w);
      };
      Matrix<double> out;
      Vector<double> lse;
      tiled(out, lse);
      Matrix<double> dq(n, 3), dk(n, 3), dv(n, 2);
      kern::flash_backward_tiles<double, 4, 3>(q, k, v, out, wgt, lse, 0.7, true, dq, dk, dv, w);
      const auto tiled_loss = [&] {
        Matrix<double> o;
        Vector<double> l;
        tiled(o, l);
        return o.cwiseProduct(wgt).sum();
      };
      EXPECT_TRUE(all_close(dq, numeric_gradient(q, tiled_loss), 1e-6, 1e-7)) << "tiled dq";
      EXPECT_TRUE(all_close(dk, numeric_gradient(k, tiled_loss), 1e-6, 1e-7)) << "tiled dk";
      EXPECT_TRUE(all_close(dv, numeric_gradient(v, tiled_loss), 1e-6, 1e-7)) << "tiled dv";
    }
}

// Decoding with a window, in pieces, gives the rows of the one-call naive form: the cache keeps
// every token, and each new token reads the last w of them. Same sums in another order: the
// double tolerance of Tol.
TEST(WindowDecode, PiecesMatchNaive) {
  const Index n = 40;
  const Matrix<double> q = random_matrix<double>(n, 6, 1), k = random_matrix<double>(n, 6, 2);
  const Matrix<double> v = random_matrix<double>(n, 3, 3);
  for (Index w : {1, 4, 9, 40}) {
    SCOPED_TRACE(where(n, w, 1));
    const ref::Options opt = windowed(w);
    const Matrix<double> expected = ref::naive_forward<double>(q, k, v, opt);
    ref::KvCache<double> cache(6, 3);
    Matrix<double> got(n, 3);
    Index at = 0;
    for (Index piece : {1, 5, 3, 11, 1, 19}) {
      got.middleRows(at, piece) = ref::decode<double>(
          cache, q.middleRows(at, piece), k.middleRows(at, piece), v.middleRows(at, piece), opt);
      at += piece;
    }
    ASSERT_EQ(at, n);
    EXPECT_TRUE(all_close(got, expected, Tol<double>::rtol, Tol<double>::atol));
  }
}

TEST(WindowErrors, RejectedWithMessages) {
  const Matrix<double> q = random_matrix<double>(5, 4, 1), k = random_matrix<double>(5, 4, 2);
  const Matrix<double> v = random_matrix<double>(5, 3, 3), go = random_matrix<double>(5, 3, 4);
  ref::Options negative = windowed(-1);
  ref::Options bidirectional;
  bidirectional.window = 3;
  for (const ref::Options& bad : {negative, bidirectional}) {
    const char* what = bad.window < 0 ? "must be >= 0" : "needs options.causal = true";
    expect_throw<std::invalid_argument>(
        [&] { ref::flash_forward<double>(q, k, v, bad); },
        {"mixattn::reference::flash_forward", "options.window", what});
    expect_throw<std::invalid_argument>(
        [&] { ref::naive_forward<double>(q, k, v, bad); },
        {"mixattn::reference::naive_forward", "options.window", what});
    Matrix<double> out;
    expect_throw<std::invalid_argument>(
        [&] { ref::flash_forward_into<double>(out, q, k, v, bad, nullptr); },
        {"flash_forward_into", "options.window", what});
    ref::KvCache<double> cache(4, 3);
    expect_throw<std::invalid_argument>(
        [&] { ref::decode<double>(cache, q, k, v, bad); },
        {"mixattn::reference::decode", bad.causal ? what : "options.causal must be true"});
    EXPECT_EQ(cache.size(), 0);
  }
  // A record made with another window (or none) is refused by both backwards.
  for (bool flash : {false, true}) {
    ref::Saved<double> saved;
    if (flash)
      ref::flash_forward<double>(q, k, v, windowed(2), &saved);
    else
      ref::naive_forward<double>(q, k, v, windowed(2), &saved);
    ref::Options causal;
    causal.causal = true;
    for (const ref::Options& other : {windowed(3), causal}) {
      expect_throw<std::invalid_argument>(
          [&] {
            flash ? ref::flash_backward<double>(q, k, v, go, saved, other)
                  : ref::naive_backward<double>(q, k, v, go, saved, other);
          },
          {"saved was made with window = 2", "options give window = "});
    }
  }
}

// =============================================================================================
// RoPE

/// The definition entry by entry in long double, theta_i = base^(-2i/r) taken afresh each time.
template <class T>
Matrix<long double> rope_direct(const Matrix<T>& x, Index start, long double base, int sign = 1) {
  Matrix<long double> y(x.rows(), x.cols());
  const Index r = x.cols();
  for (Index n = 0; n < x.rows(); ++n)
    for (Index c = 0; c < r; ++c) {
      const Index i = c / 2;
      const long double a =
          sign * (start + n) * std::pow(base, -2.0L * static_cast<long double>(i) / r);
      const long double x0 = x(n, 2 * i), x1 = x(n, 2 * i + 1);
      y(n, c) =
          c % 2 == 0 ? x0 * std::cos(a) - x1 * std::sin(a) : x0 * std::sin(a) + x1 * std::cos(a);
    }
  return y;
}

/// Largest norm of a column pair (2i, 2i + 1) over the matrix.
template <class T>
double max_pair_norm(const Matrix<T>& x) {
  double m = 0;
  for (Index n = 0; n < x.rows(); ++n)
    for (Index i = 0; i < x.cols() / 2; ++i)
      m = std::max(m, std::hypot(double(x(n, 2 * i)), double(x(n, 2 * i + 1))));
  return m;
}

/// Absolute error bound of the computed rotation against the exact one, per unit of pair norm:
/// each output is rounded once from a double expression (<= 1 ulp of T, with the double terms'
/// own rounding), and the angle p theta_i carries double rounding: the exponent -2i/r rounded
/// (relative eps, i.e. eps ln(base) relative in base^(-2i/r)), pow's and the product's own ulps,
/// so an absolute angle error <= eps |p| (2 + ln base) for theta <= 1, which moves the output by
/// that times the pair norm. A factor 4 of margin on the sum; a wrong angle, sign or pair is
/// O(1) off.
template <class T>
double rope_atol(double pair_norm, double max_abs_position, double base = 10000) {
  return 4 *
         (std::numeric_limits<T>::epsilon() +
          std::numeric_limits<double>::epsilon() * (2 + max_abs_position * (2 + std::log(base)))) *
         pair_norm;
}

// window.hpp is a face over the tiled reference with causal and the window set: the same bits
// (forward, record and gradients, value-returning and _into forms), and its own messages.
TYPED_TEST(Window, PublicFaceIsTheWindowedFlashKernel) {
  using T = TypeParam;
  namespace win = mixattn::window;
  const Index n = 300, r = 16, d_v = 8;
  const Matrix<T> q = random_matrix<T>(n, r, 11), k = random_matrix<T>(n, r, 12);
  const Matrix<T> v = random_matrix<T>(n, d_v, 13), go = random_matrix<T>(n, d_v, 14);
  for (Index w : {1, 37, 256, 1000}) {
    win::Options wo;
    wo.window = w;
    ref::Saved<T> ref_saved;
    win::Saved<T> win_saved;
    const Matrix<T> want = ref::flash_forward<T>(q, k, v, windowed(w), &ref_saved);
    EXPECT_TRUE(same_bits(win::forward<T>(q, k, v, wo, &win_saved), want)) << "w = " << w;
    EXPECT_TRUE(same_bits(win_saved.lse, ref_saved.lse));
    Matrix<T> out;
    win::forward_into<T>(out, q, k, v, wo, nullptr);
    EXPECT_TRUE(same_bits(out, want));
    const ref::Grad<T> g_ref = ref::flash_backward<T>(q, k, v, go, ref_saved, windowed(w));
    const win::Grad<T> g = win::backward<T>(q, k, v, go, win_saved, wo);
    win::Grad<T> g_into;
    win::backward_into<T>(g_into, q, k, v, go, win_saved, wo);
    const win::Grad<T>* grads[2] = {&g, &g_into};
    for (const win::Grad<T>* got : grads) {
      EXPECT_TRUE(same_bits(got->q, g_ref.q));
      EXPECT_TRUE(same_bits(got->k, g_ref.k));
      EXPECT_TRUE(same_bits(got->v, g_ref.v));
    }
  }
  win::Options zero;
  zero.window = 0;
  expect_throw<std::invalid_argument>([&] { win::forward<T>(q, k, v, zero); },
                                      {"mixattn::window::forward", "options.window is 0"});
  const Matrix<T> k_short = random_matrix<T>(n - 1, r, 15),
                  v_short = random_matrix<T>(n - 1, d_v, 16);
  expect_throw<std::invalid_argument>([&] { win::forward<T>(q, k_short, v_short); },
                                      {"mixattn::window::forward", "as many keys as queries"});
  win::Saved<T> saved;
  win::Options w8;
  w8.window = 8;
  win::forward<T>(q, k, v, w8, &saved);
  expect_throw<std::invalid_argument>([&] { win::backward<T>(q, k, v, go, saved); },
                                      {"mixattn::window::backward", "window"});
}

TYPED_TEST(Rope, MatchesDirectFormula) {
  using T = TypeParam;
  std::uint64_t seed = 20;
  for (Index r : {2, 6, 64})
    for (Index start : {0, 5, -3, 100000})
      for (double base : {10000.0, 500.0}) {
        ++seed;
        SCOPED_TRACE("r=" + std::to_string(r) + " start=" + std::to_string(start) +
                     " base=" + std::to_string(base) + " seed=" + std::to_string(seed));
        const Matrix<T> x = random_matrix<T>(37, r, seed);
        rope::Options opt;
        opt.base = base;
        const Matrix<T> y = rope::apply<T>(x, start, opt);
        const Matrix<long double> expected = rope_direct(x, start, base);
        const double atol = rope_atol<T>(max_pair_norm(x), double(std::abs(start) + 37), base);
        EXPECT_TRUE(all_close(y, expected.template cast<double>(), 0, atol));
        // A rotation by the wrong sign is far off (the comparison can fail).
        if (start > 0) {
          EXPECT_FALSE(
              all_close(y, rope_direct(x, start, base, -1).template cast<double>(), 0, atol));
        }
        // The other forms: the same bits.
        Matrix<T> into;
        rope::apply_into<T>(into, x, start, opt);
        EXPECT_TRUE(same_bits(into, y));
        Matrix<T> in_place = x;
        rope::apply_in_place<T>(in_place, start, opt);
        EXPECT_TRUE(same_bits(in_place, y));
        Matrix<T> self = x;  // out may be the input itself
        rope::apply_into<T>(self, self, start, opt);
        EXPECT_TRUE(same_bits(self, y));
      }
  // The default base is 10000.
  const Matrix<T> x = random_matrix<T>(4, 8, 1);
  EXPECT_TRUE(same_bits(rope::apply<T>(x, 3), rope::apply<T>(x, 3, rope::Options{10000, true})));
  EXPECT_FALSE(same_bits(rope::apply<T>(x, 3), rope::apply<T>(x, 3, rope::Options{5000, true})));
}

// The backward is the inverse rotation of the incoming gradient: against central differences of
// L = sum(W . apply(x)). L is linear in x, so the differences carry no truncation error; rounding
// ~1e-16 |L| / h ~ 1e-9 for |L| ~ 10: 1e-6 relative / 1e-7 absolute as for the other FD checks.
TEST(RopeBackward, MatchesCentralDifferences) {
  for (Index start : {0, 3, 1000}) {
    Matrix<double> x = random_matrix<double>(5, 6, 40 + start);
    const Matrix<double> w = random_matrix<double>(5, 6, 50 + start);
    const auto loss = [&] { return rope::apply<double>(x, start).cwiseProduct(w).sum(); };
    const Matrix<double> g = rope::backward<double>(w, start);
    EXPECT_TRUE(all_close(g, numeric_gradient(x, loss), 1e-6, 1e-7)) << "start " << start;
    Matrix<double> into, in_place = w;
    rope::backward_into<double>(into, w, start, {});
    rope::backward_in_place<double>(in_place, start);
    EXPECT_TRUE(same_bits(into, g));
    EXPECT_TRUE(same_bits(in_place, g));
  }
}

// A rotation keeps the norm of every pair, and the backward undoes the forward; both up to the
// rounding of rope_atol.
TYPED_TEST(Rope, KeepsPairNormsAndInverts) {
  using T = TypeParam;
  const Matrix<T> x = random_matrix<T>(50, 16, 60);
  const Matrix<T> y = rope::apply<T>(x, 17);
  const double atol = rope_atol<T>(max_pair_norm(x), 17 + 50);
  for (Index n = 0; n < x.rows(); ++n)
    for (Index i = 0; i < 8; ++i)
      EXPECT_NEAR(std::hypot(double(y(n, 2 * i)), double(y(n, 2 * i + 1))),
                  std::hypot(double(x(n, 2 * i)), double(x(n, 2 * i + 1))), atol)
          << n << ", " << i;
  EXPECT_TRUE(all_close(rope::backward<T>(y, 17), x, 0, 2 * atol));
}

// Row n of a call starting at s is the token at position s + n: the rows s.. of one long call are
// a call on those rows starting at s, and a token-by-token call gives the same rows. The angle
// is the same double either way, so the bits are the same.
TYPED_TEST(Rope, PositionOffset) {
  using T = TypeParam;
  const Matrix<T> x = random_matrix<T>(30, 10, 70);
  const Matrix<T> whole = rope::apply<T>(x, 0);
  for (Index s : {1, 7, 29}) {
    const Matrix<T> tail = x.bottomRows(30 - s);
    EXPECT_TRUE(same_bits(rope::apply<T>(tail, s), whole.bottomRows(30 - s))) << "start " << s;
  }
  for (Index n = 0; n < 30; ++n)
    EXPECT_TRUE(same_bits(rope::apply<T>(x.row(n), n), whole.row(n))) << "row " << n;
}

// RoPE'd q_m . k_n depends on m - n only: shifting both positions by t keeps it. The two sides
// rotate by different angles with different rounding: a few rope_atol of |q| |k| (r/2 pairs).
// Moving one position by 1 changes the dot product well beyond that (the check can fail).
TYPED_TEST(Rope, DotProductDependsOnRelativePosition) {
  using T = TypeParam;
  const Matrix<T> q = random_matrix<T>(1, 32, 80), k = random_matrix<T>(1, 32, 81);
  const auto dot = [&](Index m, Index n) {
    return (rope::apply<T>(q, m).template cast<double>().cwiseProduct(
                rope::apply<T>(k, n).template cast<double>()))
        .sum();
  };
  const double scale = q.template cast<double>().norm() * k.template cast<double>().norm();
  for (Index m : {0, 3, 40})
    for (Index n : {0, 11, 40})
      for (Index t : {1, 17, 500}) {
        const double tol = 32 * rope_atol<T>(1.0, double(std::max(m, n) + t)) * scale;
        EXPECT_NEAR(dot(m + t, n + t), dot(m, n), tol) << m << " " << n << " " << t;
        EXPECT_GT(std::abs(dot(m, n + 1) - dot(m, n)), 10 * tol) << m << " " << n;
      }
}

TYPED_TEST(Rope, ArgumentErrors) {
  using T = TypeParam;
  for (Index r : {3, 1, 0}) {
    const Matrix<T> x = Matrix<T>::Ones(4, r);
    expect_throw<std::invalid_argument>([&] { rope::apply<T>(x, 0); },
                                        {"mixattn::rope::apply", "x is 4 x ", "r must be even"});
    expect_throw<std::invalid_argument>(
        [&] { rope::backward<T>(x, 0); },
        {"mixattn::rope::backward", "grad_out is 4 x ", "r must be even"});
    Matrix<T> y = x;
    expect_throw<std::invalid_argument>([&] { rope::apply_in_place<T>(y, 0); },
                                        {"apply_in_place", "r must be even"});
  }
  const Matrix<T> x = Matrix<T>::Ones(4, 6);
  for (double base : {0.0, -2.0, std::numeric_limits<double>::infinity(),
                      std::numeric_limits<double>::quiet_NaN()}) {
    rope::Options opt;
    opt.base = base;
    expect_throw<std::invalid_argument>([&] { rope::apply<T>(x, 0, opt); },
                                        {"options.base", "finite and > 0"});
  }
  Matrix<T> bad = x;
  bad(2, 3) = std::numeric_limits<T>::infinity();
  expect_throw<std::domain_error>([&] { rope::apply<T>(bad, 0); }, {"x has a non-finite entry"});
  rope::Options unchecked;
  unchecked.check_finite = false;
  EXPECT_FALSE(std::isfinite(rope::apply<T>(bad, 0, unchecked)(2, 3)));  // returned, unchecked
  // A pair whose norm exceeds T's largest value: rotated by 1 radian (pair 0, position 1) both
  // entries would be ~1.38 max, which T cannot hold.
  Matrix<T> huge = Matrix<T>::Zero(2, 2);
  huge.row(1).setConstant(std::numeric_limits<T>::max() / T(1.1));
  expect_throw<std::domain_error>([&] { rope::apply<T>(huge, 0); }, {"the output overflows"});
  // Positions are Index values: a last position start + N - 1 beyond the largest Index is
  // refused (it would overflow), one exactly at it is rotated.
  constexpr Index top = std::numeric_limits<Index>::max();
  expect_throw<std::invalid_argument>([&] { rope::apply<T>(x, top - 2); },
                                      {"mixattn::rope::apply", "start is ", "exceeds the largest"});
  expect_throw<std::invalid_argument>([&] { rope::backward<T>(x, top); }, {"start is "});
  Matrix<T> z = x;
  expect_throw<std::invalid_argument>([&] { rope::apply_in_place<T>(z, top - 1); }, {"start"});
  EXPECT_TRUE(z == x);  // refused before any write
  EXPECT_TRUE(rope::apply<T>(x, top - 3).allFinite());
  EXPECT_TRUE(rope::apply<T>(x, std::numeric_limits<Index>::min()).allFinite());
  // Angles p theta_i that overflow double: theta_max = base^(-(r - 2)/r) of a subnormal base is
  // 4.9e-324^(-0.9375) ~ 1e303 at r = 32, so positions beyond ~1e5 overflow, and at r = 64
  // (~1e313) theta_max itself does. A rotation by an infinite angle does not exist (NaN).
  rope::Options tiny;
  tiny.base = std::numeric_limits<double>::denorm_min();
  const Matrix<T> x32 = Matrix<T>::Ones(3, 32);
  expect_throw<std::invalid_argument>([&] { rope::apply<T>(x32, Index{1} << 20, tiny); },
                                      {"options.base is ", "overflows double"});
  expect_throw<std::invalid_argument>([&] { rope::backward<T>(x32, -(Index{1} << 20), tiny); },
                                      {"options.base is ", "overflows double"});
  EXPECT_TRUE(rope::apply<T>(x32, 100, tiny).allFinite());
  expect_throw<std::invalid_argument>([&] { rope::apply<T>(Matrix<T>::Ones(1, 64), 0, tiny); },
                                      {"theta_i = base^(-2i/r) overflows double for r = 64"});
  // Empty sequences are fine.
  EXPECT_EQ(rope::apply<T>(Matrix<T>(0, 4), 5).rows(), 0);
  EXPECT_EQ(rope::apply<T>(Matrix<T>(0, 4), top).rows(), 0);
}

}  // namespace
