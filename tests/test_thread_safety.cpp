// Thread safety: concurrent calls from several std::threads on shared const parameters (the same
// Mixture, the same q, k, v, the same Saved, the same start State copied per thread) give bitwise
// the results of serial calls, for every operator; and the multi-head entry points give bitwise
// the same results whatever their thread count. tests/sanitize.sh also runs this file under
// ThreadSanitizer.
#include <mixattn/batched.hpp>
#include <mixattn/gma.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/reference.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Vector;
namespace gma = mixattn::gma;
namespace ovq = mixattn::ovq;
namespace ref = mixattn::reference;
using mixattn::testing::random_matrix;

template <class S>
bool same_bits(const Matrix<S>& a, const Matrix<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), sizeof(S) * a.size()) == 0);
}

/// Runs `job` (which returns its results flattened into matrices) once serially, then
/// `threads` x `rounds` times concurrently, all threads released together; every concurrent
/// result must equal the serial one bit for bit.
template <class S>
void expect_same_concurrently(const std::function<std::vector<Matrix<S>>()>& job,
                              const std::string& what, int threads = 4, int rounds = 3) {
  SCOPED_TRACE(what);
  const std::vector<Matrix<S>> serial = job();
  std::vector<std::vector<std::vector<Matrix<S>>>> got(static_cast<std::size_t>(threads));
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      ++ready;
      while (ready.load() < threads) std::this_thread::yield();  // start together
      for (int i = 0; i < rounds; ++i) got[static_cast<std::size_t>(t)].push_back(job());
    });
  for (std::thread& th : pool) th.join();
  for (int t = 0; t < threads; ++t)
    for (int i = 0; i < rounds; ++i) {
      const auto& res = got[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)];
      ASSERT_EQ(res.size(), serial.size());
      for (std::size_t j = 0; j < serial.size(); ++j)
        EXPECT_TRUE(same_bits(res[j], serial[j])) << "thread " << t << " round " << i << " result " << j;
    }
}

template <class T>
class ThreadSafety : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ThreadSafety, Scalars);

TYPED_TEST(ThreadSafety, Reference) {
  using T = TypeParam;
  const Index n = 150, r = 8, dv = 5;  // more than one tile in each direction
  const Matrix<T> q = random_matrix<T>(n, r, 1), k = random_matrix<T>(n, r, 2);
  const Matrix<T> v = random_matrix<T>(n, dv, 3), w = random_matrix<T>(n, dv, 4);
  for (bool causal : {false, true}) {
    ref::Options opt;
    opt.causal = causal;
    ref::Saved<T> sn, sf;  // shared, read-only in the backward jobs
    ref::naive_forward<T>(q, k, v, opt, &sn);
    ref::flash_forward<T>(q, k, v, opt, &sf);
    expect_same_concurrently<T>(
        [&] {
          ref::Saved<T> s;
          const Matrix<T> o = ref::naive_forward<T>(q, k, v, opt, &s);
          const ref::Grad<T> g = ref::naive_backward<T>(q, k, v, w, sn, opt);
          return std::vector<Matrix<T>>{o, s.probs, g.q, g.k, g.v};
        },
        causal ? "naive causal" : "naive");
    expect_same_concurrently<T>(
        [&] {
          ref::Saved<T> s;
          const Matrix<T> o = ref::flash_forward<T>(q, k, v, opt, &s);
          const ref::Grad<T> g = ref::flash_backward<T>(q, k, v, w, sf, opt);
          return std::vector<Matrix<T>>{o, s.out, Matrix<T>(s.lse), g.q, g.k, g.v};
        },
        causal ? "flash causal" : "flash");
  }
}

TYPED_TEST(ThreadSafety, Gma) {
  using T = TypeParam;
  const Index n = 300, r = 8, dv = 6, K = 11;  // K not a multiple of the SIMD width
  const gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 5);
  const Matrix<T> q = random_matrix<T>(n, r, 6), k = random_matrix<T>(n, r, 7);
  const Matrix<T> v = random_matrix<T>(n, dv, 8), w = random_matrix<T>(n, dv, 9);
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    gma::Saved<T> shared;
    gma::forward(mix, q, k, v, opt, &shared);
    expect_same_concurrently<T>(
        [&] {
          gma::Saved<T> s;
          const Matrix<T> o = gma::forward(mix, q, k, v, opt, &s);
          const gma::Grad<T> g = gma::backward(mix, q, k, v, w, shared, opt);
          return std::vector<Matrix<T>>{o,
                                        gma::responsibilities(mix, q),
                                        g.q,
                                        g.k,
                                        g.v,
                                        g.mixture.mean,
                                        g.mixture.var_raw,
                                        Matrix<T>(g.mixture.prior_logit)};
        },
        causal ? "gma causal" : "gma");
  }
}

TYPED_TEST(ThreadSafety, Ovq) {
  using T = TypeParam;
  const Index r = 6, dv = 4, t = 700;
  ovq::Options opt;
  opt.block = 32;
  opt.max_centroids = 24;
  ovq::State<T> start = ovq::State<T>::empty(r, dv);
  ovq::forward<T>(random_matrix<T>(50, r, 10), random_matrix<T>(50, r, 11),
                  random_matrix<T>(50, dv, 12), T(1), opt, start);
  const Matrix<T> q = random_matrix<T>(t, r, 13), k = random_matrix<T>(t, r, 14);
  const Matrix<T> v = random_matrix<T>(t, dv, 15), w = random_matrix<T>(t, dv, 16);
  ovq::Saved<T> shared;
  {
    ovq::State<T> scratch = start;
    ovq::forward<T>(q, k, v, T(1.25), opt, scratch, &shared);
  }
  expect_same_concurrently<T>(
      [&] {
        ovq::State<T> st = start;  // each thread streams its own copy of the shared start
        ovq::Saved<T> s;
        const Matrix<T> o = ovq::forward<T>(q, k, v, T(1.25), opt, st, &s);
        const ovq::Grad<T> g = ovq::backward<T>(q, k, v, T(1.25), w, shared, opt);
        Matrix<T> beta(1, 1);
        beta(0, 0) = g.beta;
        return std::vector<Matrix<T>>{o, st.keys, st.values, Matrix<T>(st.counts), g.q, g.k, g.v,
                                      beta};
      },
      "ovq");
}

// The multi-head entry points run heads on their own threads: any thread count must give the
// single-threaded bits.
TYPED_TEST(ThreadSafety, BatchedHeadsIndependentOfThreadCount) {
  using T = TypeParam;
  const Index heads = 5, n = 120, r = 4, dv = 3;
  std::vector<gma::Mixture<T>> mixes;
  for (Index h = 0; h < heads; ++h) mixes.push_back(gma::Mixture<T>::random(7, r, 20 + h));
  const Matrix<T> q = random_matrix<T>(n, heads * r, 21), k = random_matrix<T>(n, heads * r, 22);
  const Matrix<T> v = random_matrix<T>(n, heads * dv, 23), w = random_matrix<T>(n, heads * dv, 24);
  for (bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    gma::HeadsSaved<T> s1;
    const Matrix<T> o1 = gma::forward_heads(mixes, q, k, v, opt, 1, &s1);
    const gma::HeadsGrad<T> g1 = gma::backward_heads(mixes, q, k, v, w, s1, opt, 1);
    for (int threads : {2, 3, 0}) {
      gma::HeadsSaved<T> s;
      const Matrix<T> o = gma::forward_heads(mixes, q, k, v, opt, threads, &s);
      EXPECT_TRUE(same_bits(o, o1)) << threads << " threads";
      const gma::HeadsGrad<T> g = gma::backward_heads(mixes, q, k, v, w, s, opt, threads);
      EXPECT_TRUE(same_bits(g.q, g1.q) && same_bits(g.k, g1.k) && same_bits(g.v, g1.v))
          << threads << " threads";
      for (Index h = 0; h < heads; ++h)
        EXPECT_TRUE(same_bits(g.mixtures[h].mean, g1.mixtures[h].mean)) << "head " << h;
    }
  }
}

}  // namespace
