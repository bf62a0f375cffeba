// A backward accepts only the record its own forward filled from the same data: a Saved (or a
// layer Cache) made from other values of the same shapes is rejected with std::invalid_argument,
// even when the other data has the same multiset of values (rows swapped, signs exchanged), which
// an order-insensitive checksum cannot see.
#include "test_util.hpp"

#include <mixattn/gma.hpp>
#include <mixattn/layer.hpp>
#include <mixattn/linear.hpp>
#include <mixattn/ovq.hpp>
#include <mixattn/packed.hpp>
#include <mixattn/reference.hpp>

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <utility>

namespace {

using mixattn::Index;
using mixattn::Matrix;
using mixattn::testing::random_matrix;
using mixattn::testing::reference_backward;
using mixattn::testing::reference_forward;
using mixattn::testing::small_layer;

template <class T>
class Records : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Records, Scalars);

// Runs `call`, expects std::invalid_argument whose message says the record came from other data
// and names `arg`.
template <class F>
void expect_other_data(F&& call, const std::string& arg) {
  try {
    call();
    ADD_FAILURE() << "accepted a record made from other data (" << arg << " changed)";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("came from other data"), std::string::npos) << what;
    EXPECT_NE(what.find(arg), std::string::npos) << what;
  }
}

template <class T>
Matrix<T> swap_rows(Matrix<T> x, Index a, Index b) {
  x.row(a).swap(x.row(b));
  return x;
}

TYPED_TEST(Records, GmaRejectsPermutedAndOtherData) {
  using T = TypeParam;
  const Index n = 9, m = 11, r = 4, dv = 3;
  auto mix = mixattn::gma::Mixture<T>::random(5, r, 7);
  const Matrix<T> q = random_matrix<T>(n, r, 1), k = random_matrix<T>(m, r, 2);
  const Matrix<T> v = random_matrix<T>(m, dv, 3), dout = random_matrix<T>(n, dv, 4);
  for (const bool causal : {false, true}) {
    mixattn::gma::Options opt;
    opt.causal = causal;
    const Matrix<T> kk = causal ? Matrix<T>(k.topRows(n)) : k,
                    vv = causal ? Matrix<T>(v.topRows(n)) : v;
    mixattn::gma::Saved<T> saved;
    mixattn::gma::forward(mix, q, kk, vv, opt, &saved);
    // The same values in another buffer are the same data.
    const Matrix<T> q_copy = q;
    EXPECT_NO_THROW(mixattn::gma::backward(mix, q_copy, kk, vv, dout, saved, opt));
    const auto back = [&](const Matrix<T>& q2, const Matrix<T>& k2, const Matrix<T>& v2,
                          const mixattn::gma::Mixture<T>& mx) {
      return [&, q2, k2, v2, mx] { mixattn::gma::backward(mx, q2, k2, v2, dout, saved, opt); };
    };
    expect_other_data(back(swap_rows(q, 1, 6), kk, vv, mix), "q");  // the same multiset of values
    Matrix<T> q_signs = q;  // exchange x and -x: same sum, same sum of squares
    q_signs(2, 0) = T(0.5);
    q_signs(2, 1) = T(-0.5);
    Matrix<T> q_signs2 = q_signs;
    std::swap(q_signs2(2, 0), q_signs2(2, 1));
    mixattn::gma::forward(mix, q_signs, kk, vv, opt, &saved);
    expect_other_data(back(q_signs2, kk, vv, mix), "q");
    mixattn::gma::forward(mix, q, kk, vv, opt, &saved);
    expect_other_data(back(q, swap_rows(kk, 0, 3), vv, mix), "k");
    expect_other_data(back(q, kk, swap_rows(vv, 2, 5), mix), "v");
    auto mix2 = mix;
    mix2.mean.row(0).swap(mix2.mean.row(1));
    expect_other_data(back(q, kk, vv, mix2), "mixture");
  }
}

TYPED_TEST(Records, OvqRejectsOtherKeys) {
  using T = TypeParam;
  const Index tn = 40, r = 4, dv = 3;
  mixattn::ovq::Options opt;
  opt.block = 8;
  opt.max_centroids = 6;
  const Matrix<T> q = random_matrix<T>(tn, r, 11), k = random_matrix<T>(tn, r, 12);
  const Matrix<T> v = random_matrix<T>(tn, dv, 13), dout = random_matrix<T>(tn, dv, 14);
  auto state = mixattn::ovq::State<T>::empty(r, dv);
  mixattn::ovq::Saved<T> saved;
  mixattn::ovq::forward(q, k, v, T(1), opt, state, &saved);
  const Matrix<T> k_copy = k;
  EXPECT_NO_THROW(mixattn::ovq::backward(q, k_copy, v, T(1), dout, saved, opt));
  const Matrix<T> k_other = random_matrix<T>(tn, r, 99);
  expect_other_data([&] { mixattn::ovq::backward(q, k_other, v, T(1), dout, saved, opt); }, "k");
  const Matrix<T> q_swapped = swap_rows(q, 0, 39), v_swapped = swap_rows(v, 3, 4);
  expect_other_data([&] { mixattn::ovq::backward(q_swapped, k, v, T(1), dout, saved, opt); }, "q");
  expect_other_data([&] { mixattn::ovq::backward(q, k, v_swapped, T(1), dout, saved, opt); }, "v");
}

TYPED_TEST(Records, ReferenceRejectsPermutedData) {
  using T = TypeParam;
  const Index n = 7, r = 4, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, 21), k = random_matrix<T>(n, r, 22);
  const Matrix<T> v = random_matrix<T>(n, dv, 23), dout = random_matrix<T>(n, dv, 24);
  namespace ref = mixattn::reference;
  for (const bool flash : {false, true}) {
    ref::Saved<T> saved;
    const auto fwd = [flash](const Matrix<T>& q_, const Matrix<T>& k_, const Matrix<T>& v_,
                             ref::Saved<T>* sv) {
      return reference_forward(flash, q_, k_, v_, sv);
    };
    const auto bwd = [flash](const Matrix<T>& q_, const Matrix<T>& k_, const Matrix<T>& v_,
                             const Matrix<T>& d_, const ref::Saved<T>& sv) {
      return reference_backward(flash, q_, k_, v_, d_, sv);
    };
    fwd(q, k, v, &saved);
    const Matrix<T> q_copy = q;
    EXPECT_NO_THROW(bwd(q_copy, k, v, dout, saved));
    const Matrix<T> q2 = swap_rows(q, 0, 4), k2 = swap_rows(k, 1, 2), v2 = swap_rows(v, 5, 6);
    expect_other_data([&] { bwd(q2, k, v, dout, saved); }, "q");
    expect_other_data([&] { bwd(q, k2, v, dout, saved); }, "k");
    expect_other_data([&] { bwd(q, k, v2, dout, saved); }, "v");
  }
}

TYPED_TEST(Records, LayerRejectsCacheOfOtherInputOrParameters) {
  using T = TypeParam;
  for (const auto kind : {mixattn::layer::MixerKind::gma, mixattn::layer::MixerKind::ovq,
                          mixattn::layer::MixerKind::softmax}) {
    mixattn::layer::MultiHeadAttention<T> attn(small_layer<mixattn::layer::Config>(kind));
    const Matrix<T> x = random_matrix<T>(10, 6, 31), dy = random_matrix<T>(10, 6, 32);
    mixattn::layer::Cache<T> cache;
    attn.forward(x, &cache);
    EXPECT_NO_THROW(attn.backward(x, dy, cache));
    const Matrix<T> x_other = random_matrix<T>(10, 6, 33);
    expect_other_data([&] { attn.backward(x_other, dy, cache); }, "x");
    attn.w_o()(0, 0) += T(0.25);  // W_O is read by backward but not by any head's record
    expect_other_data([&] { attn.backward(x, dy, cache); }, "parameter");
  }
}

TYPED_TEST(Records, LinearRejectsPermutedData) {
  using T = TypeParam;
  namespace linear = mixattn::linear;
  const Index n = 9, r = 4, dv = 3;
  const Matrix<T> q = random_matrix<T>(n, r, 51), k = random_matrix<T>(n, r, 52);
  const Matrix<T> v = random_matrix<T>(n, dv, 53), dout = random_matrix<T>(n, dv, 54);
  for (const bool causal : {false, true}) {
    linear::Options opt;
    opt.causal = causal;
    linear::Saved<T> saved;
    linear::forward<T>(q, k, v, opt, &saved);
    const Matrix<T> q_copy = q;
    EXPECT_NO_THROW(linear::backward<T>(q_copy, k, v, dout, saved, opt));
    // Swapped rows keep the multiset of values (and every column sum) of the forward's data.
    const Matrix<T> q2 = swap_rows(q, 0, 7), k2 = swap_rows(k, 2, 3), v2 = swap_rows(v, 1, 8);
    expect_other_data([&] { linear::backward<T>(q2, k, v, dout, saved, opt); }, "q");
    expect_other_data([&] { linear::backward<T>(q, k2, v, dout, saved, opt); }, "k");
    expect_other_data([&] { linear::backward<T>(q, k, v2, dout, saved, opt); }, "v");
  }
}

// The _into forms fill the same fingerprints: a record reused for a forward over other data
// holds that data's fingerprints, so a backward given the earlier data rejects it, and a backward
// given the data of the last forward accepts it.
TYPED_TEST(Records, IntoFormsRefingerprintAReusedRecord) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  const Index n = 8, r = 4, dv = 3, K = 5;
  const auto mix = gma::Mixture<T>::random(K, r, 61);
  const Matrix<T> q = random_matrix<T>(n, r, 62), k = random_matrix<T>(n, r, 63);
  const Matrix<T> v = random_matrix<T>(n, dv, 64), dout = random_matrix<T>(n, dv, 65);
  const Matrix<T> q_other = swap_rows(q, 0, 5), k_other = swap_rows(k, 1, 2);
  Matrix<T> out;
  for (const bool causal : {false, true}) {
    gma::Options opt;
    opt.causal = causal;
    gma::Saved<T> saved;
    gma::Grad<T> grad;
    gma::forward_into(out, mix, q, k, v, opt, &saved);
    gma::forward_into(out, mix, q_other, k, v, opt, &saved);
    EXPECT_NO_THROW(gma::backward_into(grad, mix, q_other, k, v, dout, saved, opt));
    expect_other_data([&] { gma::backward_into(grad, mix, q, k, v, dout, saved, opt); }, "q");
  }
  {  // continued pieces through a Prepared mixture
    gma::Options opt;
    opt.causal = true;
    const gma::Prepared<T> prep(mix);
    gma::Saved<T> saved;
    gma::Grad<T> grad;
    auto st = gma::State<T>::empty(K, dv);
    gma::forward_into(out, prep, q, k, v, opt, st, &saved);
    auto st2 = gma::State<T>::empty(K, dv);
    gma::forward_into(out, prep, q, k_other, v, opt, st2, &saved);
    EXPECT_NO_THROW(gma::backward_into(grad, mix, q, k_other, v, dout, saved, opt));
    expect_other_data([&] { gma::backward_into(grad, mix, q, k, v, dout, saved, opt); }, "k");
  }
  {  // a packed batch of two sequences and one head
    const mixattn::Offsets off{0, 3, n};
    const std::vector<gma::Mixture<T>> mixtures{mix};
    gma::Options opt;
    gma::PackedSaved<T> saved;
    gma::PackedGrad<T> grad;
    gma::forward_packed_into(out, mixtures, q, k, v, off, off, opt, &saved);
    gma::forward_packed_into(out, mixtures, q, k_other, v, off, off, opt, &saved);
    EXPECT_NO_THROW(
        gma::backward_packed_into(grad, mixtures, q, k_other, v, dout, off, off, saved, opt));
    expect_other_data(
        [&] { gma::backward_packed_into(grad, mixtures, q, k, v, dout, off, off, saved, opt); },
        "k");
  }
  {  // OVQ: in place and from a constant start state into another
    namespace ovq = mixattn::ovq;
    ovq::Options opt;
    opt.block = 4;
    ovq::Saved<T> saved;
    ovq::Grad<T> grad;
    const auto start = ovq::State<T>::empty(r, dv);
    auto st = start, next = start;
    ovq::forward_into(out, q, k, v, T(1), opt, st, &saved);
    ovq::forward_into(out, q_other, k, v, T(1), opt, start, next, &saved);
    EXPECT_NO_THROW(ovq::backward_into(grad, q_other, k, v, T(1), dout, saved, opt));
    expect_other_data([&] { ovq::backward_into(grad, q, k, v, T(1), dout, saved, opt); }, "q");
    st = start;
    ovq::forward_into(out, q, k, v, T(1), opt, st, &saved);
    EXPECT_NO_THROW(ovq::backward_into(grad, q, k, v, T(1), dout, saved, opt));
    expect_other_data([&] { ovq::backward_into(grad, q_other, k, v, T(1), dout, saved, opt); },
                      "q");
  }
  {  // softmax references
    namespace ref = mixattn::reference;
    ref::Saved<T> saved;
    ref::Grad<T> grad;
    ref::naive_forward_into<T>(out, q, k, v, {}, &saved);
    ref::naive_forward_into<T>(out, q, k_other, v, {}, &saved);
    EXPECT_NO_THROW(ref::naive_backward_into<T>(grad, q, k_other, v, dout, saved, {}));
    expect_other_data([&] { ref::naive_backward_into<T>(grad, q, k, v, dout, saved, {}); }, "k");
    ref::flash_forward_into<T>(out, q, k, v, {}, &saved);
    ref::flash_forward_into<T>(out, q_other, k, v, {}, &saved);
    EXPECT_NO_THROW(ref::flash_backward_into<T>(grad, q_other, k, v, dout, saved, {}));
    expect_other_data([&] { ref::flash_backward_into<T>(grad, q, k, v, dout, saved, {}); }, "q");
  }
}

TYPED_TEST(Records, LayerIntoFormsRefingerprintTheCache) {
  using T = TypeParam;
  for (const auto kind : {mixattn::layer::MixerKind::gma, mixattn::layer::MixerKind::ovq,
                          mixattn::layer::MixerKind::softmax}) {
    mixattn::layer::MultiHeadAttention<T> attn(small_layer<mixattn::layer::Config>(kind));
    const Matrix<T> x = random_matrix<T>(10, 6, 71), dy = random_matrix<T>(10, 6, 72);
    const Matrix<T> x_other = swap_rows(x, 0, 9);
    Matrix<T> y;
    mixattn::layer::Cache<T> cache;
    mixattn::layer::Gradients<T> g;
    attn.forward_into(y, x, cache);
    attn.forward_into(y, x_other, cache);
    EXPECT_NO_THROW(attn.backward_into(g, x_other, dy, cache));
    expect_other_data([&] { attn.backward_into(g, x, dy, cache); }, "x");
    attn.forward_packed_into(y, x, mixattn::Offsets{0, 4, 10}, cache);
    EXPECT_NO_THROW(attn.backward_into(g, x, dy, cache));
    expect_other_data([&] { attn.backward_into(g, x_other, dy, cache); }, "x");
  }
}

// Records of the decoding path: a forward that continues a State (from a Mixture or a Prepared
// mixture) fills the same fingerprints, the start state it keeps included, and the backward of
// a piece accepts the end-state gradient only from the backward of the piece that followed it.
TYPED_TEST(Records, GmaContinuedForwardRecords) {
  using T = TypeParam;
  namespace gma = mixattn::gma;
  const Index n = 6, r = 4, dv = 3, K = 5;
  const auto mix = gma::Mixture<T>::random(K, r, 17);
  const Matrix<T> q = random_matrix<T>(2 * n, r, 1), k = random_matrix<T>(2 * n, r, 2);
  const Matrix<T> v = random_matrix<T>(2 * n, dv, 3), dout = random_matrix<T>(2 * n, dv, 4);
  gma::Options opt;
  opt.causal = true;
  const gma::Prepared<T> prep(mix);
  auto st = gma::State<T>::empty(K, dv);
  gma::Saved<T> first, second;
  gma::forward(mix, q.topRows(n), k.topRows(n), v.topRows(n), opt, st, &first);
  gma::forward(prep, q.bottomRows(n), k.bottomRows(n), v.bottomRows(n), opt, st, &second);
  const Matrix<T> q2 = q.bottomRows(n), k2 = k.bottomRows(n), v2 = v.bottomRows(n);
  const Matrix<T> d2 = dout.bottomRows(n);
  gma::Grad<T> g2;
  ASSERT_NO_THROW(g2 = gma::backward(mix, q2, k2, v2, d2, second, opt));
  EXPECT_NO_THROW(gma::backward(mix, q.topRows(n), k.topRows(n), v.topRows(n), dout.topRows(n),
                                first, opt, &g2.state));
  // Rows swapped, another mixture, an edited start state.
  expect_other_data([&] { gma::backward(mix, swap_rows<T>(q2, 0, 3), k2, v2, d2, second, opt); },
                    "q");
  auto other_mix = mix;
  other_mix.mean(0, 0) += T(0.5);
  expect_other_data([&] { gma::backward(other_mix, q2, k2, v2, d2, second, opt); }, "the mixture");
  gma::Saved<T> edited = second;
  edited.start_S(0, 0) += 1;
  expect_other_data([&] { gma::backward(mix, q2, k2, v2, d2, edited, opt); }, "start state");
  // The end-state gradient of another continuation (the second piece run from the empty state)
  // does not belong to the first piece.
  auto fresh = gma::State<T>::empty(K, dv);
  gma::Saved<T> alone;
  gma::forward(prep, q2, k2, v2, opt, fresh, &alone);
  const gma::Grad<T> g_alone = gma::backward(mix, q2, k2, v2, d2, alone, opt);
  try {
    gma::backward(mix, q.topRows(n), k.topRows(n), v.topRows(n), dout.topRows(n), first, opt,
                  &g_alone.state);
    ADD_FAILURE() << "accepted the gradient of another state";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("grad_state_out came from other data"), std::string::npos)
        << e.what();
  }
}

// A layer's decoding state holds its mixtures prepared: after a mixture changes, decode rejects
// the state instead of decoding with the old mixture.
TYPED_TEST(Records, LayerDecodeRejectsStaleState) {
  using T = TypeParam;
  mixattn::layer::MultiHeadAttention<T> attn(
      small_layer<mixattn::layer::Config>(mixattn::layer::MixerKind::gma));
  const Matrix<T> x = random_matrix<T>(3, 6, 41);
  auto st = attn.begin_decoding();
  EXPECT_NO_THROW(attn.decode(x.topRows(1), st));
  attn.mixture(1).prior_logit(0) += T(1);
  try {
    attn.decode(x.middleRows(1, 1), st);
    ADD_FAILURE() << "decoded with a stale prepared mixture";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("head 1's mixture changed"), std::string::npos)
        << e.what();
  }
  auto again = attn.begin_decoding();
  EXPECT_NO_THROW(attn.decode(x.topRows(1), again));
}

}  // namespace

namespace {

// Fingerprint::add_checked takes a record's fingerprint and its input's finiteness probe in one
// pass: the same fingerprint as add(), and "finite" exactly when no entry is inf or NaN, wherever
// the entry sits (a full run of lanes or the partial run at the end, a row of a strided view).
TYPED_TEST(Records, CheckedFingerprintMatchesPlainAndFindsNonFinite) {
  using T = TypeParam;
  using mixattn::detail::Fingerprint;
  const Matrix<T> base = random_matrix<T>(37, 45, 3);
  const auto checked = [](const auto& x, bool& finite) {
    return Fingerprint().add_checked(x, finite).value();
  };
  // a strided view (outer stride 45, 29 columns) and the contiguous whole
  const auto view = [](const Matrix<T>& m) { return m.leftCols(29); };
  bool finite = false;
  EXPECT_EQ(checked(base, finite), Fingerprint().add(base).value());
  EXPECT_TRUE(finite);
  finite = false;
  EXPECT_EQ(checked(view(base), finite), Fingerprint().add(view(base)).value());
  EXPECT_TRUE(finite);
  const T specials[] = {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                        -std::numeric_limits<T>::infinity()};
  // every position of a few rows, the first, a middle and the last one: lanes of both parities
  for (Index i : {Index(0), Index(17), Index(36)})
    for (Index j = 0; j < base.cols(); ++j)
      for (T bad : specials) {
        Matrix<T> m = base;
        m(i, j) = bad;
        finite = true;
        EXPECT_EQ(checked(m, finite), Fingerprint().add(m).value());
        EXPECT_FALSE(finite) << "(" << i << ", " << j << ") = " << bad;
        finite = true;
        checked(view(m), finite);
        EXPECT_EQ(finite, j >= 29) << "view, (" << i << ", " << j << ") = " << bad;
      }
  // the largest finite values, subnormals and zeros of both signs are finite
  Matrix<T> edge = base;
  edge(0, 0) = std::numeric_limits<T>::max();
  edge(1, 1) = -std::numeric_limits<T>::max();
  edge(2, 2) = std::numeric_limits<T>::denorm_min();
  edge(3, 3) = -T(0);
  finite = false;
  checked(edge, finite);
  EXPECT_TRUE(finite);
}

}  // namespace
