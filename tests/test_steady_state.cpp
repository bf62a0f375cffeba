// Training-loop steady state: after one warm-up step, a forward + backward step of every operator
// through the `_into` forms, with the same shapes, performs zero heap allocations. The process's
// heap entry points are replaced by the benchmarks' counting allocator (both malloc and operator
// new, since Eigen allocates through malloc). Shapes are large enough that Eigen's GEMM would
// heap-allocate its packing buffers (> 128 KiB) if they were not reused.
//
// Under the sanitizers the allocator cannot be replaced (their runtimes own malloc): the counting
// checks are skipped there, the `_into` results are still compared with the value-returning forms.

#include "counting_heap.hpp"

#include "test_util.hpp"

#include <mixattn/gma.hpp>
#include <mixattn/layer.hpp>
#include <mixattn/linear.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/packed.hpp>
#include <mixattn/performer.hpp>
#include <mixattn/reference.hpp>
#include <mixattn/vq.hpp>

#include <gtest/gtest.h>

#include <dirent.h>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::testing::random_matrix;

/// The _into step's input gradients against the value-returning forms', bit for bit.
template <class G>
void expect_same_qkv(const G& got, const G& want) {
  EXPECT_EQ(got.q, want.q);
  EXPECT_EQ(got.k, want.k);
  EXPECT_EQ(got.v, want.v);
}

/// Heap allocations made by fn() (0 and a skip note under the sanitizers).
template <class Fn>
std::int64_t allocations_of(Fn&& fn) {
#ifndef MIXATTN_TEST_SANITIZED
  const std::int64_t before = mixattn::bench::heap_counters().allocs.load();
  fn();
  return mixattn::bench::heap_counters().allocs.load() - before;
#else
  fn();
  return 0;
#endif
}

/// The counting allocator really counts: a fresh matrix is one allocation.
TEST(SteadyState, CounterSeesAllocations) {
#ifdef MIXATTN_TEST_SANITIZED
  GTEST_SKIP() << "allocator not replaceable under sanitizers";
#else
  Matrix<float> m;
  EXPECT_EQ(allocations_of([&] { m.resize(100, 100); }), 1);
  EXPECT_EQ(allocations_of([&] { m.resize(100, 100); }), 0);
#endif
}

template <class T>
class SteadyStateTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SteadyStateTyped, Scalars);

/// Same bits from the value-returning and the `_into` forms, and a second `_into` step with the
/// same shapes allocates nothing. N = 2048, K = r = d_v = 64: the N x K by K x d_v product packs
/// more than 128 KiB.
TYPED_TEST(SteadyStateTyped, GmaStepAllocatesNothing) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  const Index N = 2048, K = 64, r = 64, dv = 64;
  const gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 5);
  const Matrix<T> q = random_matrix<T>(N, r, 1), k = random_matrix<T>(N, r, 2);
  const Matrix<T> v = random_matrix<T>(N, dv, 3), dout = random_matrix<T>(N, dv, 4);
  for (const bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    Matrix<T> out;
    gma::Saved<T> saved;
    gma::Grad<T> grad;
    const auto step = [&] {
      gma::forward_into(out, mix, q, k, v, opt, &saved);
      gma::backward_into(grad, mix, q, k, v, dout, saved, opt);
    };
    step();  // warm-up: sizes every buffer
    EXPECT_EQ(allocations_of(step), 0) << "causal = " << causal;
    gma::Saved<T> ref_saved;
    const Matrix<T> ref = gma::forward(mix, q, k, v, opt, &ref_saved);
    const gma::Grad<T> ref_grad = gma::backward(mix, q, k, v, dout, ref_saved, opt);
    EXPECT_EQ(out, ref);
    expect_same_qkv(grad, ref_grad);
    EXPECT_EQ(grad.mixture.mean, ref_grad.mixture.mean);
    EXPECT_EQ(grad.mixture.var_raw, ref_grad.mixture.var_raw);
    EXPECT_EQ(grad.mixture.prior_logit, ref_grad.mixture.prior_logit);
  }
}

/// A causal sequence in pieces carried by a gma::State (the chunked scan for the long pieces, the
/// token recurrence for the 20-token one), backward in reverse with each piece fed its
/// successor's grad.state: after a warm-up the whole step allocates nothing, and every output
/// and gradient equals the value-returning forms' bit for bit. Decoding one token at a time
/// through a Prepared mixture allocates nothing either.
TYPED_TEST(SteadyStateTyped, GmaStatePiecesAllocateNothing) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  const Index K = 64, r = 64, dv = 64;
  const Index lengths[] = {1024, 20, 1000};
  const gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 7);
  gma::Options opt;
  opt.causal = true;
  std::vector<Matrix<T>> q, k, v, dout;
  for (int p = 0; p < 3; ++p) {
    q.push_back(random_matrix<T>(lengths[p], r, 31 + 4 * p));
    k.push_back(random_matrix<T>(lengths[p], r, 32 + 4 * p));
    v.push_back(random_matrix<T>(lengths[p], dv, 33 + 4 * p));
    dout.push_back(random_matrix<T>(lengths[p], dv, 34 + 4 * p));
  }
  gma::State<T> state = gma::State<T>::empty(K, dv);
  std::vector<Matrix<T>> out(3);
  std::vector<gma::Saved<T>> saved(3);
  std::vector<gma::Grad<T>> grad(3);
  const auto step = [&] {
    state.S.setZero();
    state.z.setZero();
    state.tokens_seen = 0;
    for (int p = 0; p < 3; ++p)
      gma::forward_into(out[p], mix, q[p], k[p], v[p], opt, state, &saved[p]);
    for (int p = 2; p >= 0; --p)
      gma::backward_into(grad[p], mix, q[p], k[p], v[p], dout[p], saved[p], opt,
                         p < 2 ? &grad[p + 1].state : nullptr);
  };
  step();
  EXPECT_EQ(allocations_of(step), 0);
  gma::State<T> ref_state = gma::State<T>::empty(K, dv);
  std::vector<gma::Saved<T>> ref_saved(3);
  std::vector<gma::Grad<T>> ref_grad(3);
  for (int p = 0; p < 3; ++p)
    EXPECT_EQ(out[p], gma::forward(mix, q[p], k[p], v[p], opt, ref_state, &ref_saved[p])) << p;
  EXPECT_EQ(state.S, ref_state.S);
  for (int p = 2; p >= 0; --p) {
    ref_grad[p] = gma::backward(mix, q[p], k[p], v[p], dout[p], ref_saved[p], opt,
                                p < 2 ? &ref_grad[p + 1].state : nullptr);
    EXPECT_EQ(grad[p].q, ref_grad[p].q) << p;
    EXPECT_EQ(grad[p].k, ref_grad[p].k) << p;
    EXPECT_EQ(grad[p].v, ref_grad[p].v) << p;
    EXPECT_EQ(grad[p].mixture.mean, ref_grad[p].mixture.mean) << p;
    EXPECT_EQ(grad[p].state.S, ref_grad[p].state.S) << p;
    EXPECT_EQ(grad[p].state.z, ref_grad[p].state.z) << p;
  }

  // Decoding: one token per call through a Prepared mixture, no Saved.
  const gma::Prepared<T> prep(mix);
  gma::State<T> dec = gma::State<T>::empty(K, dv);
  Matrix<T> one;
  Index t = 0;
  const auto token = [&] {
    gma::forward_into(one, prep, q[0].row(t), k[0].row(t), v[0].row(t), opt, dec, nullptr);
    ++t;
  };
  token();
  EXPECT_EQ(allocations_of([&] {
              for (int i = 0; i < 16; ++i) token();
            }),
            0);
  EXPECT_EQ(dec.tokens_seen, 17);
}

TYPED_TEST(SteadyStateTyped, SoftmaxStepAllocatesNothing) {
  using T = TypeParam;
  namespace ref = mixattn::reference;
  const Index N = 600, r = 64, dv = 64;  // naive: N x N probabilities, 1.4 MiB in float
  const Matrix<T> q = random_matrix<T>(N, r, 11), k = random_matrix<T>(N, r, 12);
  const Matrix<T> v = random_matrix<T>(N, dv, 13), dout = random_matrix<T>(N, dv, 14);
  for (const bool causal : {false, true}) {
    ref::Options opt;
    opt.causal = causal;
    Matrix<T> out_f, out_n;
    ref::Saved<T> saved_f, saved_n;
    ref::Grad<T> grad_f, grad_n;
    const auto flash_step = [&] {
      ref::flash_forward_into<T>(out_f, q, k, v, opt, &saved_f);
      ref::flash_backward_into<T>(grad_f, q, k, v, dout, saved_f, opt);
    };
    const auto naive_step = [&] {
      ref::naive_forward_into<T>(out_n, q, k, v, opt, &saved_n);
      ref::naive_backward_into<T>(grad_n, q, k, v, dout, saved_n, opt);
    };
    flash_step();
    naive_step();
    EXPECT_EQ(allocations_of(flash_step), 0) << "flash, causal = " << causal;
    EXPECT_EQ(allocations_of(naive_step), 0) << "naive, causal = " << causal;
    ref::Saved<T> s1, s2;
    EXPECT_EQ(out_f, ref::flash_forward<T>(q, k, v, opt, &s1));
    EXPECT_EQ(out_n, ref::naive_forward<T>(q, k, v, opt, &s2));
    EXPECT_EQ(grad_f.q, ref::flash_backward<T>(q, k, v, dout, s1, opt).q);
    EXPECT_EQ(grad_n.k, ref::naive_backward<T>(q, k, v, dout, s2, opt).k);
  }
}

/// The baselines' `_into` forms (linear attention, Performer, VQ attention), bidirectional and
/// causal: a second step with the same shapes allocates nothing, and the results equal the
/// value-returning forms' bit for bit. N = 2048, r = d_v = 64, m = S = 64 features or codes.
TYPED_TEST(SteadyStateTyped, BaselineStepsAllocateNothing) {
  using T = TypeParam;
  namespace linear = mixattn::linear;
  namespace performer = mixattn::performer;
  namespace vq = mixattn::vq;
  const Index N = 2048, r = 64, dv = 64, m = 64;
  const Matrix<T> q = random_matrix<T>(N, r, 51), k = random_matrix<T>(N, r, 52);
  const Matrix<T> v = random_matrix<T>(N, dv, 53), dout = random_matrix<T>(N, dv, 54);
  const performer::Features<T> features = performer::Features<T>::random(m, r, 55);
  const Matrix<T> codebook = random_matrix<T>(m, r, 56);
  for (const bool causal : {false, true}) {
    Matrix<T> out_l, out_p, out_v;
    linear::Options lo;
    lo.causal = causal;
    linear::Saved<T> saved_l;
    linear::Grad<T> grad_l;
    performer::Options po;
    po.causal = causal;
    performer::Saved<T> saved_p;
    performer::Grad<T> grad_p;
    vq::Options vo;
    vo.causal = causal;
    vq::Saved<T> saved_v;
    vq::Grad<T> grad_v;
    const auto linear_step = [&] {
      linear::forward_into<T>(out_l, q, k, v, lo, &saved_l);
      linear::backward_into<T>(grad_l, q, k, v, dout, saved_l, lo);
    };
    const auto performer_step = [&] {
      performer::forward_into<T>(out_p, q, k, v, features, po, &saved_p);
      performer::backward_into<T>(grad_p, q, k, v, features, dout, saved_p, po);
    };
    const auto vq_step = [&] {
      vq::forward_into<T>(out_v, q, k, v, codebook, vo, &saved_v);
      vq::backward_into<T>(grad_v, q, k, v, codebook, dout, saved_v, vo);
    };
    linear_step();
    performer_step();
    vq_step();
    EXPECT_EQ(allocations_of(linear_step), 0) << "linear, causal = " << causal;
    EXPECT_EQ(allocations_of(performer_step), 0) << "performer, causal = " << causal;
    EXPECT_EQ(allocations_of(vq_step), 0) << "vq, causal = " << causal;
    // A forward without a record (this thread's scratch) allocates nothing either.
    Matrix<T> out_none;
    linear::forward_into<T>(out_none, q, k, v, lo, nullptr);
    EXPECT_EQ(allocations_of([&] { linear::forward_into<T>(out_none, q, k, v, lo, nullptr); }), 0);
    EXPECT_EQ(out_none, out_l);

    linear::Saved<T> rl;
    EXPECT_EQ(out_l, linear::forward<T>(q, k, v, lo, &rl));
    const linear::Grad<T> gl = linear::backward<T>(q, k, v, dout, rl, lo);
    expect_same_qkv(grad_l, gl);
    performer::Saved<T> rp;
    EXPECT_EQ(out_p, performer::forward<T>(q, k, v, features, po, &rp));
    const performer::Grad<T> gp = performer::backward<T>(q, k, v, features, dout, rp, po);
    expect_same_qkv(grad_p, gp);
    vq::Saved<T> rv;
    EXPECT_EQ(out_v, vq::forward<T>(q, k, v, codebook, vo, &rv));
    const vq::Grad<T> gv = vq::backward<T>(q, k, v, codebook, dout, rv, vo);
    expect_same_qkv(grad_v, gv);
    EXPECT_EQ(grad_v.codebook, gv.codebook);
  }
}

/// OVQ from a constant start state: 1000 tokens in blocks of 64 with up to 256 centroids (the
/// assignment and attention GEMMs pack more than 128 KiB in double).
TYPED_TEST(SteadyStateTyped, OvqStepAllocatesNothing) {
  using T = TypeParam;
  namespace ovq = mixattn::ovq;
  const Index N = 1000, r = 64, dv = 64;
  const Matrix<T> q = random_matrix<T>(N, r, 21), k = random_matrix<T>(N, r, 22);
  const Matrix<T> v = random_matrix<T>(N, dv, 23), dout = random_matrix<T>(N, dv, 24);
  ovq::Options opt;
  opt.block = 64;
  opt.max_centroids = 256;
  const ovq::State<T> start = ovq::State<T>::empty(r, dv);
  const T beta = T(0.7);
  Matrix<T> out;
  ovq::State<T> next;
  ovq::Saved<T> saved;
  ovq::Grad<T> grad;
  const auto step = [&] {
    ovq::forward_into(out, q, k, v, beta, opt, start, next, &saved);
    ovq::backward_into(grad, q, k, v, beta, dout, saved, opt);
  };
  step();
  EXPECT_EQ(allocations_of(step), 0);
  ovq::State<T> state = start;
  ovq::Saved<T> ref_saved;
  EXPECT_EQ(out, ovq::forward(q, k, v, beta, opt, state, &ref_saved));
  EXPECT_EQ(next.keys, state.keys);
  EXPECT_EQ(next.pending_values, state.pending_values);
  EXPECT_EQ(next.tokens_seen, state.tokens_seen);
  const ovq::Grad<T> ref_grad = ovq::backward(q, k, v, beta, dout, ref_saved, opt);
  expect_same_qkv(grad, ref_grad);
  EXPECT_EQ(grad.beta, ref_grad.beta);
}

/// OVQ decoding, one token per forward_into call on a full dictionary (N_max = 1024, C = 256,
/// r = d_v = 64, float: the block's C x N scoring would pack 256 KiB of keys in one GEMM). After
/// one block completion as warm-up, the only heap traffic left is the public State's unfinished
/// block growing by one row of keys and one of values per token: at most two allocations per
/// call, none in the block-completing call, and the outputs equal one long call's.
TEST(SteadyState, OvqDecodeAllocatesOnlyTheUnfinishedBlock) {
#ifdef MIXATTN_TEST_SANITIZED
  GTEST_SKIP() << "allocator not replaceable under sanitizers";
#else
  namespace ovq = mixattn::ovq;
  const Index r = 64, dv = 64, c = 256, prefill = 4 * c + c - 10, decode = c + 20;
  const Index n = prefill + decode;
  const Matrix<float> q = random_matrix<float>(n, r, 41), k = random_matrix<float>(n, r, 42);
  const Matrix<float> v = random_matrix<float>(n, dv, 43);
  ovq::Options opt;
  opt.block = c;
  opt.max_centroids = 1024;
  opt.growth = ovq::Growth::linear;
  ovq::State<float> st = ovq::State<float>::empty(r, dv);
  Matrix<float> out, all(n, dv), row;
  ovq::forward_into(out, q.topRows(prefill), k.topRows(prefill), v.topRows(prefill), 1.0f, opt, st,
                    nullptr);
  all.topRows(prefill) = out;
  for (Index t = prefill; t < n; ++t) {
    const bool warm = t < prefill + 12;  // through the completion of the 5th block (t = 1279)
    const std::int64_t allocs = allocations_of(
        [&] { ovq::forward_into(row, q.row(t), k.row(t), v.row(t), 1.0f, opt, st, nullptr); });
    all.row(t) = row;
    if (warm) continue;
    if ((t + 1) % c == 0)
      EXPECT_EQ(allocs, 0) << "block-completing token " << t;
    else
      EXPECT_LE(allocs, 2) << "token " << t;
  }
  ovq::State<float> one = ovq::State<float>::empty(r, dv);
  const Matrix<float> expect = ovq::forward<float>(q, k, v, 1.0f, opt, one);
  // One call and token-by-token calls differ only in the rounding of the attention GEMMs' shapes
  // (the dictionary updates are bit-identical, compared below): float softmax over N + C = 1280
  // terms, a few hundred ulps.
  EXPECT_TRUE(mixattn::testing::all_close(all, expect, 1e-4, 1e-5));
  EXPECT_EQ(st.keys, one.keys);
  EXPECT_EQ(st.pending_keys, one.pending_keys);
#endif
}

/// The layer's training step (forward_into + backward_into, one thread) for every mixer, with
/// projections of 1024 x 128 by 128 x 128 (packing more than 128 KiB); and the local layer of
/// OVQ's hybrids, causal softmax with a sliding window of 64 and RoPE (rope.hpp keeps its angle
/// table per thread: filled by the warm-up step, reused after).
TEST(SteadyState, LayerStepAllocatesNothing) {
  namespace layer = mixattn::layer;
  struct Case {
    layer::MixerKind mixer;
    bool causal;
    bool window_rope = false;
  };
  for (const Case c :
       {Case{layer::MixerKind::gma, false}, Case{layer::MixerKind::gma, true},
        Case{layer::MixerKind::ovq, true}, Case{layer::MixerKind::softmax, true},
        Case{layer::MixerKind::linear, false}, Case{layer::MixerKind::linear, true},
        Case{layer::MixerKind::performer, false}, Case{layer::MixerKind::performer, true},
        Case{layer::MixerKind::vq, false}, Case{layer::MixerKind::vq, true},
        Case{layer::MixerKind::delta, true}, Case{layer::MixerKind::softmax, true, true}}) {
    layer::Config cfg;
    cfg.model_dim = 128;
    cfg.heads = 4;
    cfg.key_dim = 32;
    cfg.value_dim = 32;
    cfg.mixer = c.mixer;
    cfg.causal = c.causal;
    cfg.ovq.block = 64;
    cfg.ovq.max_centroids = 128;
    if (c.window_rope) {
      cfg.softmax.window = 64;
      cfg.rope = true;
    }
    const layer::MultiHeadAttention<float> mha(cfg);
    const Matrix<float> x = random_matrix<float>(1024, 128, 31),
                        dy = random_matrix<float>(1024, 128, 32);
    Matrix<float> y;
    layer::Cache<float> cache;
    layer::Gradients<float> g;
    const auto step = [&] {
      mha.forward_into(y, x, cache);
      mha.backward_into(g, x, dy, cache);
    };
    step();
    EXPECT_EQ(allocations_of(step), 0)
        << "mixer " << layer::mixer_name(c.mixer) << ", causal = " << c.causal
        << ", window + rope = " << c.window_rope;
    layer::Cache<float> ref_cache;
    EXPECT_EQ(y, mha.forward(x, &ref_cache));
    const layer::Gradients<float> ref = mha.backward(x, dy, ref_cache);
    EXPECT_EQ(g.x, ref.x);
    ASSERT_EQ(g.params.size(), ref.params.size());
    for (std::size_t i = 0; i < ref.params.size(); ++i) EXPECT_EQ(g.params[i], ref.params[i]) << i;
    EXPECT_EQ(g.names, ref.names);
  }
}

// ---- Every `_into` operator at its default options and at training lengths (T = 2048, 8192) ----
// One warm-up step sizes every record, then one counted step. Widths are the smallest that still
// reach Eigen's heap-allocating GEMM blocking where the operator has GEMMs that depend on them
// (OVQ: r = d_v = 64 in float, 32 in double, the same bytes); elsewhere r = d_v = 16. Under the
// sanitizers (no counting) only T = 2048 runs, to keep their pass short.

/// The training lengths this build runs.
std::vector<Index> training_lengths() {
#ifdef MIXATTN_TEST_SANITIZED
  return {2048};
#else
  return {2048, 8192};
#endif
}

/// Runs step once as a warm-up, then expects a second step to allocate nothing.
template <class Step>
void expect_steady(Step&& step, const std::string& what) {
  step();
  EXPECT_EQ(allocations_of(step), 0) << what;
}

/// OVQ at ovq::Options{} (block 256, N_max 1024), both gradient modes, from a constant start;
/// at T = 2048 the results equal the value-returning forms' bit for bit.
TYPED_TEST(SteadyStateTyped, OvqDefaultsAllocateNothing) {
  using T = TypeParam;
  namespace ovq = mixattn::ovq;
  const Index r = static_cast<Index>(256 / sizeof(T)), dv = r;
  for (const Index n : training_lengths()) {
    const Matrix<T> q = random_matrix<T>(n, r, 61), k = random_matrix<T>(n, r, 62);
    const Matrix<T> v = random_matrix<T>(n, dv, 63), dout = random_matrix<T>(n, dv, 64);
    for (const bool through : {true, false}) {
      ovq::Options opt;
      opt.grad_through_dictionary = through;
      const ovq::State<T> start = ovq::State<T>::empty(r, dv);
      const T beta = T(0.7);
      Matrix<T> out;
      ovq::State<T> next;
      ovq::Saved<T> saved;
      ovq::Grad<T> grad;
      expect_steady(
          [&] {
            ovq::forward_into(out, q, k, v, beta, opt, start, next, &saved);
            ovq::backward_into(grad, q, k, v, beta, dout, saved, opt);
          },
          "T = " + std::to_string(n) + ", through = " + std::to_string(through));
      if (n != 2048) continue;
      ovq::State<T> state = start;
      ovq::Saved<T> ref_saved;
      EXPECT_EQ(out, ovq::forward(q, k, v, beta, opt, state, &ref_saved));
      const ovq::Grad<T> ref = ovq::backward(q, k, v, beta, dout, ref_saved, opt);
      expect_same_qkv(grad, ref);
      EXPECT_EQ(grad.beta, ref.beta);
    }
  }
}

/// GMA at gma::Options{} (K = 64), bidirectional and causal, and a causal sequence continued
/// through a State in two pieces (backward in reverse, the second piece's grad.state fed to the
/// first).
TYPED_TEST(SteadyStateTyped, GmaDefaultsAllocateNothing) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  const Index K = 64, r = 16, dv = 16;
  const gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 65);
  for (const Index n : training_lengths()) {
    const Matrix<T> q = random_matrix<T>(n, r, 66), k = random_matrix<T>(n, r, 67);
    const Matrix<T> v = random_matrix<T>(n, dv, 68), dout = random_matrix<T>(n, dv, 69);
    const std::string at = "T = " + std::to_string(n);
    for (const bool causal : {false, true}) {
      gma::Options opt;
      opt.causal = causal;
      Matrix<T> out;
      gma::Saved<T> saved;
      gma::Grad<T> grad;
      expect_steady(
          [&] {
            gma::forward_into(out, mix, q, k, v, opt, &saved);
            gma::backward_into(grad, mix, q, k, v, dout, saved, opt);
          },
          at + ", causal = " + std::to_string(causal));
    }
    gma::Options opt;
    opt.causal = true;
    const Index h = n / 2 + 7;  // two pieces, neither a whole number of chunks
    const Index rows[2][2] = {{0, h}, {h, n - h}};
    gma::State<T> state = gma::State<T>::empty(K, dv);
    Matrix<T> out[2];
    gma::Saved<T> saved[2];
    gma::Grad<T> grad[2];
    expect_steady(
        [&] {
          state.S.setZero();
          state.z.setZero();
          state.tokens_seen = 0;
          for (int p = 0; p < 2; ++p)
            gma::forward_into(out[p], mix, q.middleRows(rows[p][0], rows[p][1]),
                              k.middleRows(rows[p][0], rows[p][1]),
                              v.middleRows(rows[p][0], rows[p][1]), opt, state, &saved[p]);
          for (int p = 1; p >= 0; --p)
            gma::backward_into(grad[p], mix, q.middleRows(rows[p][0], rows[p][1]),
                               k.middleRows(rows[p][0], rows[p][1]),
                               v.middleRows(rows[p][0], rows[p][1]),
                               dout.middleRows(rows[p][0], rows[p][1]), saved[p], opt,
                               p == 0 ? &grad[1].state : nullptr);
        },
        at + ", continued state");
  }
}

/// Tiled softmax (flash) at reference::Options{}, bidirectional and causal, and the baselines'
/// `_into` forms (linear attention, Performer, VQ attention) at their default options.
TYPED_TEST(SteadyStateTyped, FlashAndBaselinesAtTrainingLengthsAllocateNothing) {
  using T = TypeParam;
  namespace ref = mixattn::reference;
  namespace linear = mixattn::linear;
  namespace performer = mixattn::performer;
  namespace vq = mixattn::vq;
  const Index r = 16, dv = 16, m = 64;
  const performer::Features<T> features = performer::Features<T>::random(m, r, 70);
  const Matrix<T> codebook = random_matrix<T>(m, r, 71);
  for (const Index n : training_lengths()) {
    const Matrix<T> q = random_matrix<T>(n, r, 72), k = random_matrix<T>(n, r, 73);
    const Matrix<T> v = random_matrix<T>(n, dv, 74), dout = random_matrix<T>(n, dv, 75);
    for (const bool causal : {false, true}) {
      const std::string at = "T = " + std::to_string(n) + ", causal = " + std::to_string(causal);
      ref::Options fo;
      fo.causal = causal;
      Matrix<T> out_f, out_l, out_p, out_v;
      ref::Saved<T> saved_f;
      ref::Grad<T> grad_f;
      expect_steady(
          [&] {
            ref::flash_forward_into<T>(out_f, q, k, v, fo, &saved_f);
            ref::flash_backward_into<T>(grad_f, q, k, v, dout, saved_f, fo);
          },
          "flash, " + at);
      linear::Options lo;
      lo.causal = causal;
      linear::Saved<T> saved_l;
      linear::Grad<T> grad_l;
      expect_steady(
          [&] {
            linear::forward_into<T>(out_l, q, k, v, lo, &saved_l);
            linear::backward_into<T>(grad_l, q, k, v, dout, saved_l, lo);
          },
          "linear, " + at);
      performer::Options po;
      po.causal = causal;
      performer::Saved<T> saved_p;
      performer::Grad<T> grad_p;
      expect_steady(
          [&] {
            performer::forward_into<T>(out_p, q, k, v, features, po, &saved_p);
            performer::backward_into<T>(grad_p, q, k, v, features, dout, saved_p, po);
          },
          "performer, " + at);
      vq::Options vo;
      vo.causal = causal;
      vq::Saved<T> saved_v;
      vq::Grad<T> grad_v;
      expect_steady(
          [&] {
            vq::forward_into<T>(out_v, q, k, v, codebook, vo, &saved_v);
            vq::backward_into<T>(grad_v, q, k, v, codebook, dout, saved_v, vo);
          },
          "vq, " + at);
    }
  }
}

/// Packed batches (packed.hpp) of four sequences of T/2, T/4, T/8, T/8 tokens, two heads, on one
/// thread: GMA (bidirectional and causal), flash with grouped-query heads (four sequences of T/4
/// tokens: its per-thread forward buffers follow each item's length), and OVQ. OVQ
/// continues each item's State, which grows its dictionary in place (a State has no spare
/// rows), so its steps start from full dictionaries (Growth::linear after N_max tokens) and run
/// whole blocks, which leave the states' shapes as they found them.
TYPED_TEST(SteadyStateTyped, PackedAtTrainingLengthsAllocateNothing) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  namespace ref = mixattn::reference;
  namespace ovq = mixattn::ovq;
  const Index H = 2, r = 16, dv = 16;
  const std::vector<gma::Mixture<T>> mix = {gma::Mixture<T>::random(64, r, 76),
                                            gma::Mixture<T>::random(64, r, 77)};
  for (const Index n : training_lengths()) {
    const mixattn::Offsets off = {0, n / 2, n / 2 + n / 4, n - n / 8, n};
    const Matrix<T> q = random_matrix<T>(n, H * r, 78), k = random_matrix<T>(n, H * r, 79);
    const Matrix<T> v = random_matrix<T>(n, H * dv, 80), dout = random_matrix<T>(n, H * dv, 81);
    for (const bool causal : {false, true}) {
      gma::Options opt;
      opt.causal = causal;
      Matrix<T> out;
      gma::PackedSaved<T> saved;
      gma::PackedGrad<T> grad;
      expect_steady(
          [&] {
            gma::forward_packed_into(out, mix, q, k, v, off, off, opt, &saved);
            gma::backward_packed_into(grad, mix, q, k, v, dout, off, off, saved, opt);
          },
          "packed gma, T = " + std::to_string(n) + ", causal = " + std::to_string(causal));
    }
    const Matrix<T> k1 = k.leftCols(r), v1 = v.leftCols(dv);  // one key/value head
    const mixattn::Offsets even = {0, n / 4, n / 2, n - n / 4, n};
    for (const bool causal : {false, true}) {
      ref::Options opt;
      opt.causal = causal;
      Matrix<T> out;
      ref::PackedSaved<T> saved;
      ref::PackedGrad<T> grad;
      expect_steady(
          [&] {
            ref::flash_forward_packed_into<T>(out, H, 1, q, k1, v1, even, even, opt, &saved);
            ref::flash_backward_packed_into<T>(grad, H, 1, q, k1, v1, dout, even, even, saved,
                                               opt);
          },
          "packed flash, T = " + std::to_string(n) + ", causal = " + std::to_string(causal));
    }
    ovq::Options opt;
    opt.growth = ovq::Growth::linear;
    const std::vector<T> beta = {T(0.8), T(1.3)};
    const Matrix<T> fk = random_matrix<T>(opt.max_centroids, r, 82),
                    fv = random_matrix<T>(opt.max_centroids, dv, 85);
    ovq::State<T> full = ovq::State<T>::empty(r, dv);
    ovq::forward<T>(fk, fk, fv, T(1), opt, full);
    ASSERT_EQ(full.keys.rows(), opt.max_centroids);
    const std::vector<ovq::State<T>> start(static_cast<std::size_t>(4 * H), full);
    std::vector<ovq::State<T>> states = start;
    Matrix<T> out;
    ovq::PackedSaved<T> saved;
    ovq::PackedGrad<T> grad;
    expect_steady(
        [&] {
          for (std::size_t i = 0; i < states.size(); ++i) states[i] = start[i];
          ovq::forward_packed_into(out, 1, q, k1, v1, beta, off, opt, states, &saved);
          ovq::backward_packed_into(grad, 1, q, k1, v1, beta, dout, off, saved, opt);
        },
        "packed ovq, T = " + std::to_string(n));
  }
}

/// The layer's training step at each mixer's default options (OVQ: block 256, N_max 1024; GMA:
/// its K = 16), r = d_v = 64 per head, at T = 2048 and 8192; full softmax attention, O(T^2),
/// at T = 2048 only, its sliding-window + RoPE form at both.
TEST(SteadyState, LayerDefaultsAtTrainingLengthsAllocateNothing) {
  namespace layer = mixattn::layer;
  using layer::MixerKind;
  struct Case {
    MixerKind mixer;
    bool causal;
    bool window_rope = false;
  };
  for (const Index n : training_lengths())
    for (const Case c : {Case{MixerKind::gma, false}, Case{MixerKind::gma, true},
                         Case{MixerKind::ovq, true}, Case{MixerKind::softmax, true},
                         Case{MixerKind::linear, false}, Case{MixerKind::linear, true},
                         Case{MixerKind::performer, false}, Case{MixerKind::performer, true},
                         Case{MixerKind::vq, false}, Case{MixerKind::vq, true},
                         Case{MixerKind::delta, true}, Case{MixerKind::softmax, true, true}}) {
      if (c.mixer == MixerKind::softmax && !c.window_rope && n > 2048) continue;
      layer::Config cfg;
      cfg.model_dim = 128;
      cfg.heads = 2;
      cfg.key_dim = 64;
      cfg.value_dim = 64;
      cfg.mixer = c.mixer;
      cfg.causal = c.causal;
      if (c.window_rope) {
        cfg.softmax.window = 64;
        cfg.rope = true;
      }
      const layer::MultiHeadAttention<float> mha(cfg);
      const Matrix<float> x = random_matrix<float>(n, 128, 83),
                          dy = random_matrix<float>(n, 128, 84);
      Matrix<float> y;
      layer::Cache<float> cache;
      layer::Gradients<float> g;
      expect_steady(
          [&] {
            mha.forward_into(y, x, cache);
            mha.backward_into(g, x, dy, cache);
          },
          "T = " + std::to_string(n) + ", mixer " + layer::mixer_name(c.mixer) +
              ", causal = " + std::to_string(c.causal) +
              ", window + rope = " + std::to_string(c.window_rope));
    }
}

/// Bytes held by the matrices and vectors given (what a value-returning call hands back).
template <class... M>
std::int64_t held_bytes(const M&... m) {
  return (std::int64_t(0) + ... +
          static_cast<std::int64_t>(m.size() * sizeof(typename M::Scalar)));
}

/// Heap bytes a warm value-returning call allocates beyond `returned()` (what it hands back),
/// allowing each allocation glibc's rounding of a mapped chunk to whole pages.
template <class Call, class Returned>
std::int64_t bytes_beyond_results(Call&& call, Returned&& returned) {
#ifndef MIXATTN_TEST_SANITIZED
  call();  // warm-up: fills this thread's working memory
  const auto& c = mixattn::bench::heap_counters();
  const std::int64_t bytes = c.total.load(), allocs = c.allocs.load();
  call();
  const std::int64_t allocated = c.total.load() - bytes, n = c.allocs.load() - allocs;
  return allocated - returned() - n * 4160;
#else
  call();
  (void)returned;
  return 0;
#endif
}

/// The value-returning forms borrow their working memory from this thread's cache
/// (detail::LentScratch): once warm, a forward + backward allocates only its results, its
/// Saved's contents and the gradients it returns, at N = 4096 where a fresh scratch would be
/// mapped from the OS and page-faulted on every call.
TYPED_TEST(SteadyStateTyped, ValueFormsAllocateOnlyTheirResults) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  namespace ovq = mixattn::ovq;
  namespace ref = mixattn::reference;
  const Index n = 4096, K = 64, r = 16, dv = 16;
  const gma::Mixture<T> mix = gma::Mixture<T>::random(K, r, 86);
  const Matrix<T> q = random_matrix<T>(n, r, 87), k = random_matrix<T>(n, r, 88);
  const Matrix<T> v = random_matrix<T>(n, dv, 89), dout = random_matrix<T>(n, dv, 90);
  for (const bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    std::int64_t kept = 0;
    const auto call = [&] {
      gma::Saved<T> s;
      const Matrix<T> out = gma::forward(mix, q, k, v, opt, &s);
      const gma::Grad<T> g = gma::backward(mix, q, k, v, dout, s, opt);
      kept = held_bytes(out, s.gamma_q, s.gamma_k, s.den, s.out, s.vt, s.z, s.start_S, s.start_z,
                        g.q, g.k, g.v, g.mixture.mean, g.mixture.var_raw, g.mixture.prior_logit,
                        g.state.S, g.state.z);
    };
    EXPECT_LE(bytes_beyond_results(call, [&] { return kept; }), 0) << "gma, causal = " << causal;
  }
  for (const bool through : {true, false}) {
    ovq::Options opt;
    opt.grad_through_dictionary = through;
    std::int64_t kept = 0;
    const auto call = [&] {
      ovq::State<T> state = ovq::State<T>::empty(r, dv);
      ovq::Saved<T> s;
      const Matrix<T> out = ovq::forward(q, k, v, T(0.7), opt, state, &s);
      const ovq::Grad<T> g = ovq::backward(q, k, v, T(0.7), dout, s, opt);
      // + the in-place state's transient growth: the dictionary is grown to the call's
      // capacity (N_max rows here) before it is trimmed to its live rows
      kept = held_bytes(out, state.keys, state.values, state.counts, state.pending_keys,
                        state.pending_values, g.q, g.k, g.v, g.state.keys, g.state.values,
                        g.state.pending_keys, g.state.pending_values) +
             static_cast<std::int64_t>(s.bytes()) +
             static_cast<std::int64_t>(opt.max_centroids * (r + dv + 1) * sizeof(T));
    };
    EXPECT_LE(bytes_beyond_results(call, [&] { return kept; }), 0) << "ovq, through = " << through;
  }
  for (const bool causal : {false, true}) {
    ref::Options opt;
    opt.causal = causal;
    std::int64_t kept = 0;
    const auto call = [&] {
      ref::Saved<T> s;
      const Matrix<T> out = ref::flash_forward<T>(q, k, v, opt, &s);
      const ref::Grad<T> g = ref::flash_backward<T>(q, k, v, dout, s, opt);
      kept = held_bytes(out, s.out, s.lse, s.probs, g.q, g.k, g.v);
    };
    EXPECT_LE(bytes_beyond_results(call, [&] { return kept; }), 0) << "flash, causal = " << causal;
  }
}

/// Threads of this process, from /proc/self/task.
int thread_count() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(dir))
    if (e->d_name[0] != '.') ++n;
  closedir(dir);
  return n;
}

/// parallel_for runs on one persistent pool: many calls start no thread, every item runs once.
TEST(SteadyState, ParallelForStartsNoThreadPerCall) {
  std::atomic<int> sum{0};
  mixattn::parallel_for(4, 2, [&](Index i) { sum += static_cast<int>(i); });  // creates the pool
  const int before = thread_count();
  ASSERT_GT(before, 1);
  for (int call = 0; call < 300; ++call)
    mixattn::parallel_for(8, 2, [&](Index i) { sum += static_cast<int>(i); });
  EXPECT_EQ(thread_count(), before);
  EXPECT_EQ(sum.load(), 6 + 300 * 28);
}

/// A caller's own pool is used instead of the default one; the lowest failing index's
/// exception is the one rethrown, after every item ran.
TEST(SteadyState, ParallelForOnCallerPool) {
  mixattn::ThreadPool pool(3);
  std::atomic<int> ran{0};
  try {
    mixattn::parallel_for(
        10, 4,
        [&](Index i) {
          ++ran;
          if (i == 7 || i == 3 || i == 8) throw std::runtime_error(std::to_string(i));
        },
        pool);
    FAIL() << "no throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "3");
  }
  EXPECT_EQ(ran.load(), 10);
  std::atomic<int> inside{0};
  mixattn::parallel_for(
      3, 3, [&](Index) { inside += pool.CurrentThreadId() >= 0 ? 1 : 0; }, pool);
  EXPECT_EQ(inside.load(), 2);  // the caller took one range, two workers of `pool` the rest
}

/// A record reused for a different shape is resized correctly (no stale rows).
TEST(SteadyState, RecordsFollowShapeChanges) {
  namespace gma = mixattn::gma;
  const gma::Mixture<double> mix = gma::Mixture<double>::random(8, 4, 7);
  Matrix<double> out;
  gma::Saved<double> saved;
  gma::Grad<double> grad;
  for (const Index n : {50, 7, 300}) {
    const Matrix<double> q = random_matrix<double>(n, 4, 20 + n),
                         v = random_matrix<double>(n, 3, 30);
    const Matrix<double> dout = random_matrix<double>(n, 3, 40);
    gma::forward_into(out, mix, q, q, v, gma::Options{}, &saved);
    gma::backward_into(grad, mix, q, q, v, dout, saved, gma::Options{});
    gma::Saved<double> fresh;
    EXPECT_EQ(out, gma::forward(mix, q, q, v, gma::Options{}, &fresh));
    EXPECT_EQ(grad.q, gma::backward(mix, q, q, v, dout, fresh, gma::Options{}).q);
  }
}

/// The `_into` forms validate like the value-returning ones and name themselves.
TEST(SteadyState, IntoFormsRejectBadShapes) {
  namespace gma = mixattn::gma;
  const gma::Mixture<double> mix = gma::Mixture<double>::random(4, 3, 1);
  Matrix<double> out;
  const Matrix<double> q = random_matrix<double>(5, 3, 1), bad = random_matrix<double>(5, 2, 2);
  try {
    gma::forward_into(out, mix, q, bad, q, gma::Options{}, nullptr);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mixattn::gma::forward_into"), std::string::npos);
  }
  mixattn::reference::Grad<double> g;
  mixattn::reference::Saved<double> empty;
  EXPECT_THROW(mixattn::reference::flash_backward_into<double>(g, q, q, q, q, empty, {}),
               std::invalid_argument);
}

}  // namespace
