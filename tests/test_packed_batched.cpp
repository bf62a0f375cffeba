// Packed variable-length batches (packed.hpp): every (sequence, head) pair of one packed call
// equals the separate single-sequence call bit for bit, on one thread and on several; shared
// parameters' gradients equal the separate gradients summed in sequence order; grouped-query
// heads read their shared key/value head; bad offsets are rejected.
#include "layer_checks.hpp"
#include "test_util.hpp"

#include <mixattn/layer.hpp>
#include <mixattn/packed.hpp>

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::Offsets;
using mixattn::testing::random_matrix;

Offsets offsets_of(const std::vector<Index>& lengths) {
  Offsets o{0};
  for (const Index n : lengths) o.push_back(o.back() + n);
  return o;
}

template <class T>
class PackedTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(PackedTyped, Scalars);

// Mixed lengths 1, 7, 256, 1000, longest not first, so the largest-first order differs from the
// sequence order.
const std::vector<Index> kLengths = {256, 1, 1000, 7};

TYPED_TEST(PackedTyped, GmaEqualsSeparateCalls) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  const Index H = 2, r = 8, K = 8, dv = 4;
  std::vector<gma::Mixture<T>> mix;
  for (Index h = 0; h < H; ++h) mix.push_back(gma::Mixture<T>::random(K, r, 10 + h));
  struct Case {
    bool causal;
    std::vector<Index> key_lengths;
  };
  for (const Case& c : {Case{false, kLengths}, Case{true, kLengths},
                        Case{false, std::vector<Index>{5, 300, 2, 17}}}) {
    const Offsets qo = offsets_of(kLengths), ko = offsets_of(c.key_lengths);
    const Matrix<T> q = random_matrix<T>(qo.back(), H * r, 1), k = random_matrix<T>(ko.back(), H * r, 2);
    const Matrix<T> v = random_matrix<T>(ko.back(), H * dv, 3);
    const Matrix<T> dout = random_matrix<T>(qo.back(), H * dv, 4);
    gma::Options opt;
    opt.causal = c.causal;
    for (const int threads : {1, 2}) {
      Matrix<T> out;
      gma::PackedSaved<T> saved;
      gma::PackedGrad<T> grad;
      gma::forward_packed_into(out, mix, q, k, v, qo, ko, opt, &saved, threads);
      gma::backward_packed_into(grad, mix, q, k, v, dout, qo, ko, saved, opt, threads);
      for (Index h = 0; h < H; ++h) {
        gma::MixtureGrad<T> sum;
        for (std::size_t b = 0; b + 1 < qo.size(); ++b) {
          const Index q0 = qo[b], nq = qo[b + 1] - q0, k0 = ko[b], nk = ko[b + 1] - k0;
          gma::Saved<T> s;
          const Matrix<T> o = gma::forward(mix[h], q.block(q0, h * r, nq, r), k.block(k0, h * r, nk, r),
                                           v.block(k0, h * dv, nk, dv), opt, &s);
          const gma::Grad<T> g = gma::backward(mix[h], q.block(q0, h * r, nq, r),
                                               k.block(k0, h * r, nk, r), v.block(k0, h * dv, nk, dv),
                                               dout.block(q0, h * dv, nq, dv), s, opt);
          EXPECT_EQ(Matrix<T>(out.block(q0, h * dv, nq, dv)), o) << "b " << b << " h " << h;
          EXPECT_EQ(Matrix<T>(grad.q.block(q0, h * r, nq, r)), g.q);
          EXPECT_EQ(Matrix<T>(grad.k.block(k0, h * r, nk, r)), g.k);
          EXPECT_EQ(Matrix<T>(grad.v.block(k0, h * dv, nk, dv)), g.v);
          if (b == 0) {
            sum = g.mixture;
          } else {
            sum.mean += g.mixture.mean;
            sum.var_raw += g.mixture.var_raw;
            sum.prior_logit += g.mixture.prior_logit;
          }
        }
        EXPECT_EQ(grad.mixtures[h].mean, sum.mean) << "threads " << threads;
        EXPECT_EQ(grad.mixtures[h].var_raw, sum.var_raw);
        EXPECT_EQ(grad.mixtures[h].prior_logit, sum.prior_logit);
      }
    }
  }
}

// Large packed results reach their blocks through stores that bypass the caches
// (detail::copy_block_into, stream = true, used above detail::packed_stream_bytes, which these
// small shapes stay under): the same bits as the block assignment, whatever the alignment of the
// block's rows and the width of the tail, and nothing outside the block touched.
TYPED_TEST(PackedTyped, StreamedBlockCopyEqualsAssignment) {
  using T = TypeParam;
  for (const Index cols : {Index(1), Index(3), Index(8), Index(17), Index(64), Index(67)}) {
    for (const Index col0 : {Index(0), Index(1), Index(5), Index(16)}) {
      const Matrix<T> src = random_matrix<T>(13, cols, 50 + cols);
      const Matrix<T> start = random_matrix<T>(20, col0 + cols + 3, 60 + col0);
      Matrix<T> streamed = start, assigned = start;
      mixattn::detail::copy_block_into<mixattn::detail::simd_arch>(streamed, 4, col0, src, true);
      assigned.block(4, col0, src.rows(), cols) = src;
      EXPECT_EQ(streamed, assigned) << "cols " << cols << " col0 " << col0;
      Matrix<T> plain = start;
      mixattn::detail::copy_block_into<mixattn::detail::simd_arch>(plain, 4, col0, src, false);
      EXPECT_EQ(plain, assigned) << "cols " << cols << " col0 " << col0;
    }
  }
}

// The packed backward leaves q, k, v to the forward's finite checks (the records' fingerprints
// tie them to it) but still checks grad_out and, with checks off, checks nothing.
TEST(Packed, GmaBackwardChecksGradOut) {
  namespace gma = mixattn::gma;
  const std::vector<gma::Mixture<double>> mix = {gma::Mixture<double>::random(4, 3, 1),
                                                 gma::Mixture<double>::random(4, 3, 2)};
  const Offsets off = offsets_of({6, 1, 9});
  const Matrix<double> x = random_matrix<double>(off.back(), 6, 3);
  Matrix<double> dout = random_matrix<double>(off.back(), 6, 4);
  dout(8, 4) = std::numeric_limits<double>::quiet_NaN();  // sequence 2, head 1
  for (const bool check : {true, false}) {
    gma::Options opt;
    opt.check_finite = check;
    Matrix<double> out;
    gma::PackedSaved<double> saved;
    gma::PackedGrad<double> grad;
    gma::forward_packed_into(out, mix, x, x, x, off, off, opt, &saved);
    if (check) {
      try {
        gma::backward_packed_into(grad, mix, x, x, x, dout, off, off, saved, opt);
        ADD_FAILURE() << "a NaN in grad_out must throw";
      } catch (const std::domain_error& e) {
        EXPECT_NE(std::string(e.what()).find("grad_out"), std::string::npos) << e.what();
      }
    } else {
      EXPECT_NO_THROW(gma::backward_packed_into(grad, mix, x, x, x, dout, off, off, saved, opt));
    }
  }
}

TYPED_TEST(PackedTyped, FlashGroupedQueryEqualsSeparateCalls) {
  using T = TypeParam;
  namespace ref = mixattn::reference;
  const Index Hq = 4, Hkv = 2, r = 8, dv = 4, group = Hq / Hkv;
  const Offsets off = offsets_of(kLengths);
  const Matrix<T> q = random_matrix<T>(off.back(), Hq * r, 5), k = random_matrix<T>(off.back(), Hkv * r, 6);
  const Matrix<T> v = random_matrix<T>(off.back(), Hkv * dv, 7);
  const Matrix<T> dout = random_matrix<T>(off.back(), Hq * dv, 8);
  for (const bool causal : {false, true}) {
    ref::Options opt;
    opt.causal = causal;
    for (const int threads : {1, 2}) {
      Matrix<T> out;
      ref::PackedSaved<T> saved;
      ref::PackedGrad<T> grad;
      ref::flash_forward_packed_into<T>(out, Hq, Hkv, q, k, v, off, off, opt, &saved, threads);
      ref::flash_backward_packed_into<T>(grad, Hq, Hkv, q, k, v, dout, off, off, saved, opt, threads);
      for (std::size_t b = 0; b + 1 < off.size(); ++b) {
        const Index t0 = off[b], n = off[b + 1] - t0;
        for (Index g = 0; g < Hkv; ++g) {
          Matrix<T> dk_sum, dv_sum;
          for (Index j = 0; j < group; ++j) {
            const Index h = g * group + j;
            ref::Saved<T> s;
            const Matrix<T> o = ref::flash_forward<T>(q.block(t0, h * r, n, r), k.block(t0, g * r, n, r),
                                                      v.block(t0, g * dv, n, dv), opt, &s);
            const ref::Grad<T> gr = ref::flash_backward<T>(
                q.block(t0, h * r, n, r), k.block(t0, g * r, n, r), v.block(t0, g * dv, n, dv),
                dout.block(t0, h * dv, n, dv), s, opt);
            EXPECT_EQ(Matrix<T>(out.block(t0, h * dv, n, dv)), o);
            EXPECT_EQ(Matrix<T>(grad.q.block(t0, h * r, n, r)), gr.q);
            if (j == 0) {
              dk_sum = gr.k;
              dv_sum = gr.v;
            } else {
              dk_sum += gr.k;
              dv_sum += gr.v;
            }
          }
          EXPECT_EQ(Matrix<T>(grad.k.block(t0, g * r, n, r)), dk_sum);
          EXPECT_EQ(Matrix<T>(grad.v.block(t0, g * dv, n, dv)), dv_sum);
        }
      }
    }
  }
}

TYPED_TEST(PackedTyped, OvqGroupedQueryEqualsSeparateCalls) {
  using T = TypeParam;
  namespace ovq = mixattn::ovq;
  const Index Hq = 2, Hkv = 1, r = 8, dv = 4;
  const Offsets off = offsets_of(kLengths);
  const Matrix<T> q = random_matrix<T>(off.back(), Hq * r, 9), k = random_matrix<T>(off.back(), Hkv * r, 10);
  const Matrix<T> v = random_matrix<T>(off.back(), Hkv * dv, 11);
  const Matrix<T> dout = random_matrix<T>(off.back(), Hq * dv, 12);
  ovq::Options opt;
  opt.block = 32;
  opt.max_centroids = 64;
  const std::vector<T> beta = {T(0.8), T(1.3)};
  const Index B = static_cast<Index>(kLengths.size());
  for (const int threads : {1, 2}) {
    std::vector<ovq::State<T>> states(B * Hq, ovq::State<T>::empty(r, dv));
    Matrix<T> out;
    ovq::PackedSaved<T> saved;
    ovq::PackedGrad<T> grad;
    ovq::forward_packed_into(out, Hkv, q, k, v, beta, off, opt, states, &saved, threads);
    ovq::backward_packed_into(grad, Hkv, q, k, v, beta, dout, off, saved, opt, threads);
    for (Index h = 0; h < Hq; ++h) {
      T dbeta = 0;
      for (Index b = 0; b < B; ++b) {
        const Index t0 = off[b], n = off[b + 1] - t0;
        ovq::State<T> st = ovq::State<T>::empty(r, dv);
        ovq::Saved<T> s;
        const Matrix<T> o = ovq::forward(q.block(t0, h * r, n, r), k.block(t0, 0, n, r),
                                         v.block(t0, 0, n, dv), beta[h], opt, st, &s);
        const ovq::Grad<T> g = ovq::backward(q.block(t0, h * r, n, r), k.block(t0, 0, n, r),
                                             v.block(t0, 0, n, dv), beta[h],
                                             dout.block(t0, h * dv, n, dv), s, opt);
        EXPECT_EQ(Matrix<T>(out.block(t0, h * dv, n, dv)), o);
        EXPECT_EQ(states[b * Hq + h].keys, st.keys);
        EXPECT_EQ(states[b * Hq + h].tokens_seen, st.tokens_seen);
        EXPECT_EQ(Matrix<T>(grad.q.block(t0, h * r, n, r)), g.q);
        EXPECT_EQ(grad.items[b * Hq + h].k, g.k);
        dbeta += g.beta;
      }
      EXPECT_EQ(grad.beta[h], dbeta);
    }
    // the shared key head's gradient is the sum of its two query heads'
    const Matrix<T> dk_sum = grad.items[0].k + grad.items[1].k;
    EXPECT_EQ(Matrix<T>(grad.k.topRows(off[1])), dk_sum);
  }
}

/// The layer on a packed batch equals the layer on each sequence alone: outputs and input
/// gradients row for row, parameter gradients as the per-sequence sum. Double; 1e-12 relative:
/// only the projections' GEMM blocking and the order of the sums over sequences differ.
TEST(Packed, LayerEqualsPerSequenceCalls) {
  namespace layer = mixattn::layer;
  for (const layer::MixerKind mixer :
       {layer::MixerKind::gma, layer::MixerKind::ovq, layer::MixerKind::softmax}) {
    layer::Config cfg;
    cfg.model_dim = 12;
    cfg.heads = 2;
    cfg.key_dim = 4;
    cfg.value_dim = 3;
    cfg.mixer = mixer;
    cfg.causal = mixer != layer::MixerKind::gma;
    cfg.components = 4;
    cfg.ovq.block = 8;
    cfg.ovq.max_centroids = 16;
    cfg.threads = 2;
    const layer::MultiHeadAttention<double> mha(cfg);
    const Offsets off = offsets_of({30, 1, 70, 7});
    const Matrix<double> x = random_matrix<double>(off.back(), 12, 41);
    const Matrix<double> dy = random_matrix<double>(off.back(), 12, 42);
    Matrix<double> y;
    layer::Cache<double> cache;
    layer::Gradients<double> g;
    mixattn::testing::expect_packed_equals_separate(mha, x, dy, off, layer::mixer_name(mixer), y,
                                                    cache, g, [](auto&&...) {});
  }
  const layer::MultiHeadAttention<double> mha([] {
    layer::Config c;
    c.model_dim = 4;
    c.key_dim = 2;
    c.value_dim = 2;
    return c;
  }());
  Matrix<double> y;
  layer::Cache<double> cache;
  EXPECT_THROW(mha.forward_packed_into(y, random_matrix<double>(5, 4, 1), {0, 3, 3, 5}, cache),
               std::invalid_argument);  // an empty sequence
  EXPECT_THROW(mha.forward_packed_into(y, random_matrix<double>(5, 4, 1), {0, 3, 6}, cache),
               std::invalid_argument);  // offsets end beyond x
}

TEST(Packed, RejectsBadOffsetsAndHeads) {
  namespace gma = mixattn::gma;
  const std::vector<gma::Mixture<double>> mix = {gma::Mixture<double>::random(4, 3, 1)};
  const Matrix<double> x = random_matrix<double>(10, 3, 1);
  Matrix<double> out;
  const auto fails = [&](const Offsets& qo, const Offsets& ko) {
    try {
      gma::forward_packed_into(out, mix, x, x, x, qo, ko, gma::Options{}, nullptr);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(fails({0, 4, 10}, {0, 4, 10}), "") << "valid offsets must not throw";
  EXPECT_NE(fails({1, 4, 10}, {1, 4, 10}).find("q_offsets[0] is 1"), std::string::npos);
  EXPECT_NE(fails({0, 6, 4, 10}, {0, 6, 4, 10}).find("decreases"), std::string::npos);
  EXPECT_NE(fails({0, 4, 9}, {0, 4, 9}).find("ends at 9"), std::string::npos);
  EXPECT_NE(fails({0, 4, 10}, {0, 10}).find("k_offsets has 2"), std::string::npos);
  EXPECT_NE(fails({0}, {0}).find("B + 1 >= 2"), std::string::npos);
  namespace ref = mixattn::reference;
  const Matrix<double> q3 = random_matrix<double>(10, 9, 2);
  EXPECT_THROW(ref::flash_forward_packed_into<double>(out, 3, 2, q3, q3, q3, {0, 10}, {0, 10}, {},
                                                      nullptr),
               std::invalid_argument);  // 3 query heads cannot share 2 key/value heads
}

// A batch whose sequences are all empty (the fuzz input that found it: OVQ, float, two query
// heads sharing one key/value head, r = 3, d_v = 2, offsets {0, 0}): every operator returns
// empty outputs and gradients of the right widths, zero gradients for the shared parameters (no
// token contributes) and untouched states. The items' blocks of the empty inputs used to add a
// head's column offset to their null data pointer (UBSan: the sanitizer build fails here).
TYPED_TEST(PackedTyped, AllSequencesEmpty) {
  using T = TypeParam;
  const Index Hq = 2, Hkv = 1, r = 3, dv = 2;
  for (const Offsets& off : {Offsets{0, 0}, Offsets{0, 0, 0, 0}}) {
    const Index B = static_cast<Index>(off.size()) - 1;
    const Matrix<T> q(0, Hq * r), kg(0, Hkv * r), vg(0, Hkv * dv), dout(0, Hq * dv);
    {
      namespace ovq = mixattn::ovq;
      ovq::Options opt;
      opt.block = 2;
      const std::vector<T> beta = {T(1), T(0.5)};
      std::vector<ovq::State<T>> states(B * Hq, ovq::State<T>::empty(r, dv));
      Matrix<T> out;
      ovq::PackedSaved<T> saved;
      ovq::PackedGrad<T> grad;
      ovq::forward_packed_into(out, Hkv, q, kg, vg, beta, off, opt, states, &saved);
      ovq::backward_packed_into(grad, Hkv, q, kg, vg, beta, dout, off, saved, opt);
      EXPECT_EQ(out.rows(), 0);
      EXPECT_EQ(out.cols(), Hq * dv);
      for (const ovq::State<T>& s : states) {
        EXPECT_EQ(s.tokens_seen, 0);
        EXPECT_EQ(s.keys.rows(), 0);
        EXPECT_EQ(s.pending_keys.rows(), 0);
      }
      EXPECT_EQ(grad.q.rows(), 0);
      EXPECT_EQ(grad.q.cols(), Hq * r);
      EXPECT_EQ(grad.k.cols(), Hkv * r);
      EXPECT_EQ(grad.v.cols(), Hkv * dv);
      EXPECT_EQ(grad.beta, std::vector<T>(Hq, T(0)));
    }
    {
      namespace ref = mixattn::reference;
      for (const bool causal : {false, true}) {
        ref::Options opt;
        opt.causal = causal;
        Matrix<T> out;
        ref::PackedSaved<T> saved;
        ref::PackedGrad<T> grad;
        ref::flash_forward_packed_into<T>(out, Hq, Hkv, q, kg, vg, off, off, opt, &saved);
        ref::flash_backward_packed_into<T>(grad, Hq, Hkv, q, kg, vg, dout, off, off, saved, opt);
        EXPECT_EQ(out.rows(), 0);
        EXPECT_EQ(out.cols(), Hq * dv);
        EXPECT_EQ(grad.q.cols(), Hq * r);
        EXPECT_EQ(grad.k.cols(), Hkv * r);
        EXPECT_EQ(grad.v.cols(), Hkv * dv);
        EXPECT_EQ(grad.q.rows() + grad.k.rows() + grad.v.rows(), 0);
      }
    }
    {
      namespace gma = mixattn::gma;
      const Index K = 4;
      const std::vector<gma::Mixture<T>> mix = {gma::Mixture<T>::random(K, r, 1),
                                                gma::Mixture<T>::random(K, r, 2)};
      const Matrix<T> k(0, Hq * r), v(0, Hq * dv);
      for (const bool causal : {false, true}) {
        gma::Options opt;
        opt.causal = causal;
        Matrix<T> out;
        gma::PackedSaved<T> saved;
        gma::PackedGrad<T> grad;
        gma::forward_packed_into(out, mix, q, k, v, off, off, opt, &saved);
        gma::backward_packed_into(grad, mix, q, k, v, dout, off, off, saved, opt);
        EXPECT_EQ(out.rows(), 0);
        EXPECT_EQ(out.cols(), Hq * dv);
        EXPECT_EQ(grad.q.cols(), Hq * r);
        EXPECT_EQ(grad.v.cols(), Hq * dv);
        EXPECT_EQ(grad.q.rows() + grad.k.rows() + grad.v.rows(), 0);
        ASSERT_EQ(grad.mixtures.size(), mix.size());
        for (const gma::MixtureGrad<T>& m : grad.mixtures) {
          EXPECT_EQ(m.mean, Matrix<T>::Zero(K, r));
          EXPECT_EQ(m.var_raw, Matrix<T>::Zero(K, r));
          EXPECT_EQ(m.prior_logit, mixattn::Vector<T>::Zero(K));
        }
      }
    }
  }
}

// OVQ takes one offsets vector, `offsets`: its refusals name it, not q_offsets or k_offsets
// (which it has no parameters of), and a k of other rows than q is named as such.
TEST(Packed, OvqRefusalsNameOffsets) {
  namespace ovq = mixattn::ovq;
  const Index r = 3, dv = 2;
  const Matrix<double> x = random_matrix<double>(10, r, 1), v = random_matrix<double>(10, dv, 2);
  const Matrix<double> dout = random_matrix<double>(10, dv, 3);
  const std::vector<double> beta = {1.0};
  ovq::Options opt;
  opt.block = 4;
  const auto refusal = [&](const Offsets& off, const Matrix<double>& k, const Matrix<double>& vk,
                           bool backward) {
    // as many states as the forward's offsets have sequences: only the offsets are wrong
    const Offsets fwd = backward ? Offsets{0, 4, 10} : off;
    std::vector<ovq::State<double>> states(fwd.size() < 2 ? 1 : fwd.size() - 1,
                                           ovq::State<double>::empty(r, dv));
    Matrix<double> out;
    ovq::PackedSaved<double> saved;
    ovq::PackedGrad<double> grad;
    try {
      if (backward) {
        ovq::forward_packed_into(out, 1, x, x, v, beta, fwd, opt, states, &saved);
        ovq::backward_packed_into(grad, 1, x, k, vk, beta, dout, off, saved, opt);
      } else {
        ovq::forward_packed_into(out, 1, x, k, vk, beta, off, opt, states, &saved);
      }
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(returned)");
  };
  for (const bool backward : {false, true}) {
    const std::string fn = backward ? "ovq::backward_packed_into" : "ovq::forward_packed_into";
    for (const Offsets& bad : {Offsets{1, 4, 10}, Offsets{0, 6, 4, 10}, Offsets{0, 4, 9},
                               Offsets{0}}) {
      const std::string what = refusal(bad, x, v, backward);
      EXPECT_NE(what.find(fn), std::string::npos) << what;
      EXPECT_NE(what.find("offsets"), std::string::npos) << what;
      EXPECT_EQ(what.find("q_offsets"), std::string::npos) << what;
      EXPECT_EQ(what.find("k_offsets"), std::string::npos) << what;
    }
    EXPECT_NE(refusal({1, 4, 10}, x, v, backward).find("offsets[0] is 1"), std::string::npos);
    const Matrix<double> k9 = random_matrix<double>(9, r, 4), v9 = random_matrix<double>(9, dv, 5);
    const std::string rows = refusal({0, 4, 10}, k9, v9, backward);
    EXPECT_NE(rows.find("k has 9 rows but q has 10"), std::string::npos) << rows;
  }
}

}  // namespace
