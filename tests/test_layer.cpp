// MultiHeadAttention (layer.hpp): composition against per-head calls and the naive oracle,
// gradients against central differences for X and every parameter, threads, save/load, errors.
#include <mixattn/adam.hpp>
#include <mixattn/layer.hpp>

#include "layer_checks.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace layer = mixattn::layer;
using mixattn::testing::all_close;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;

// One configuration per mixer the layer offers.
struct Case {
  const char* name;
  layer::MixerKind mixer;
  bool causal;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}
const Case kCases[] = {
    {"gma_bidirectional", layer::MixerKind::gma, false},
    {"gma_causal", layer::MixerKind::gma, true},
    {"ovq", layer::MixerKind::ovq, true},
    {"softmax_bidirectional", layer::MixerKind::softmax, false},
    {"softmax_causal", layer::MixerKind::softmax, true},
};

// Small shapes: d_model 5, 2 heads of r = 3, d_v = 2, K = 3. For OVQ, blocks of 3 tokens and at
// most 2 centroids, so a 7-token sequence exercises seeding, assignment and merging, not just
// the T <= N_max regime where OVQ is plain softmax attention.
layer::Config small_config(const Case& c, std::uint64_t seed) {
  layer::Config cfg;
  cfg.model_dim = 5;
  cfg.heads = 2;
  cfg.key_dim = 3;
  cfg.value_dim = 2;
  cfg.mixer = c.mixer;
  cfg.causal = c.causal;
  cfg.components = 3;
  cfg.ovq.block = 3;
  cfg.ovq.max_centroids = 2;
  cfg.seed = seed;
  return cfg;
}

std::string path_in_tmp(const std::string& name) {
  return ::testing::TempDir() + "mixattn_test_layer_" + name;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.name;
}

class LayerCase : public ::testing::TestWithParam<Case> {};
INSTANTIATE_TEST_SUITE_P(Mixers, LayerCase, ::testing::ValuesIn(kCases), case_name);

// Loss = Σ Y ∘ R for a fixed random R, so dL/dY = R. Every parameter and X are checked.
// Central differences with h = 1e-6 in double are accurate to ~1e-9 relative on these O(1)
// quantities; rtol 1e-5 / atol 1e-7 leaves room for that and catches any real error (a wrong
// term is off by O(1)).
TEST_P(LayerCase, GradientsMatchCentralDifferences) {
  const Case c = GetParam();
  const std::uint64_t seed = 11;
  layer::MultiHeadAttention<double> mha(small_config(c, seed));
  Matrix<double> x = random_matrix<double>(7, 5, seed + 100);
  const Matrix<double> r = random_matrix<double>(7, 5, seed + 200);
  auto loss = [&]() { return mha.forward(x).cwiseProduct(r).sum(); };

  layer::Cache<double> cache;
  mha.forward(x, &cache);
  layer::Gradients<double> g = mha.backward(x, r, cache);

  EXPECT_TRUE(all_close(g.x, numeric_gradient(x, loss), 1e-5, 1e-7))
      << c.name << " x, seed " << seed;
  std::vector<layer::NamedBlock<double>> params = mha.parameters();
  ASSERT_EQ(params.size(), g.params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(g.names[i], params[i].name);
    Eigen::Map<Matrix<double>> p = params[i].map();
    EXPECT_TRUE(all_close(g.params[i], numeric_gradient(p, loss), 1e-5, 1e-7))
        << c.name << " " << params[i].name << ", seed " << seed;
  }
}

// The layer is the composition of the projections, one operator call per head on its column
// block, and the output projection. Built here by hand, head by head, from the public
// operators (and for softmax from the naive oracle rather than the tiled form the layer uses).
TEST_P(LayerCase, ForwardIsTheComposition) {
  const Case c = GetParam();
  const layer::Config cfg = small_config(c, 3);
  layer::MultiHeadAttention<double> mha(cfg);
  const Matrix<double> x = random_matrix<double>(9, 5, 42);
  const Index r = cfg.key_dim, dv = cfg.value_dim;
  const Matrix<double> q = x * mha.w_q(), k = x * mha.w_k(), v = x * mha.w_v();
  Matrix<double> mixed(9, cfg.heads * dv);
  for (Index h = 0; h < cfg.heads; ++h) {
    const Matrix<double> qh = q.middleCols(h * r, r), kh = k.middleCols(h * r, r),
                         vh = v.middleCols(h * dv, dv);
    Matrix<double> oh;
    if (c.mixer == layer::MixerKind::gma) {
      mixattn::gma::Options o;
      o.causal = c.causal;
      oh = mixattn::gma::forward(mha.mixture(h), qh, kh, vh, o);
    } else if (c.mixer == layer::MixerKind::ovq) {
      auto state = mixattn::ovq::State<double>::empty(r, dv);
      oh = mixattn::ovq::forward(qh, kh, vh, mha.beta(h), cfg.ovq, state);
    } else {
      mixattn::reference::Options o;
      o.causal = c.causal;
      oh = mixattn::reference::naive_forward<double>(qh, kh, vh, o);
    }
    mixed.middleCols(h * dv, dv) = oh;
  }
  const Matrix<double> expected = mixed * mha.w_o();
  // Same operations in a different association order (and naive vs tiled softmax): a few ulps
  // of double on O(1) values.
  EXPECT_TRUE(all_close(mha.forward(x), expected, 1e-12, 1e-12)) << c.name;
}

// Float agrees with double: the same parameters cast down give the same output to float
// precision (inputs O(1), a handful of reductions of length <= 9: 1e-4 relative is ample).
TEST_P(LayerCase, FloatAgreesWithDouble) {
  const Case c = GetParam();
  layer::MultiHeadAttention<double> d(small_config(c, 5));
  layer::MultiHeadAttention<float> f(small_config(c, 5));
  std::vector<layer::NamedBlock<double>> pd = d.parameters();
  std::vector<layer::NamedBlock<float>> pf = f.parameters();
  ASSERT_EQ(pd.size(), pf.size());
  for (std::size_t i = 0; i < pd.size(); ++i) pf[i].map() = pd[i].map().cast<float>();
  const Matrix<double> x = random_matrix<double>(8, 5, 77);
  const Matrix<float> xf = x.cast<float>();
  EXPECT_TRUE(all_close(Matrix<double>(f.forward(xf).cast<double>()), d.forward(x), 1e-4, 1e-5))
      << c.name;
}

// Heads are independent and the projections are split into row blocks that do not depend on
// the thread count, so running on several threads changes nothing, bit for bit. N spans three
// row blocks of the projections (detail::gemm_task_rows), the last one partial.
TEST_P(LayerCase, ThreadsGiveIdenticalResults) {
  const Case c = GetParam();
  layer::Config cfg = small_config(c, 9);
  cfg.heads = 5;
  layer::MultiHeadAttention<double> one(cfg);
  cfg.threads = 3;
  layer::MultiHeadAttention<double> three(cfg);
  const Index n = 2 * mixattn::detail::gemm_task_rows + 13;
  const Matrix<double> x = random_matrix<double>(n, 5, 8);
  const Matrix<double> dy = random_matrix<double>(n, 5, 9);
  layer::Cache<double> c1, c3;
  const Matrix<double> y1 = one.forward(x, &c1), y3 = three.forward(x, &c3);
  EXPECT_TRUE(y1 == y3) << c.name;
  const layer::Gradients<double> g1 = one.backward(x, dy, c1), g3 = three.backward(x, dy, c3);
  EXPECT_TRUE(g1.x == g3.x);
  ASSERT_EQ(g1.params.size(), g3.params.size());
  for (std::size_t i = 0; i < g1.params.size(); ++i)
    EXPECT_TRUE(g1.params[i] == g3.params[i]) << g1.names[i];
  // Every gradient is found by its parameter's name.
  const std::vector<layer::ConstNamedBlock<double>> params = one.const_parameters();
  ASSERT_EQ(params.size(), g1.params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(&g1.param(params[i].name), &g1.params[i]) << params[i].name;
  EXPECT_THROW(g1.param("head9.mean"), std::invalid_argument);
}

// Causal mixers: output row i depends on X rows <= i only.
std::vector<Case> causal_cases() {
  std::vector<Case> out;
  for (const Case& c : kCases)
    if (c.causal) out.push_back(c);
  return out;
}
class CausalLayerCase : public ::testing::TestWithParam<Case> {};
INSTANTIATE_TEST_SUITE_P(Mixers, CausalLayerCase, ::testing::ValuesIn(causal_cases()), case_name);

TEST_P(CausalLayerCase, OutputsIgnoreTheFuture) {
  const Case c = GetParam();
  layer::MultiHeadAttention<double> mha(small_config(c, 21));
  Matrix<double> x = random_matrix<double>(8, 5, 22);
  const Matrix<double> before = mha.forward(x);
  x.row(5) += random_matrix<double>(1, 5, 23);
  const Matrix<double> after = mha.forward(x);
  EXPECT_TRUE(before.topRows(5) == after.topRows(5)) << c.name;
  EXPECT_FALSE(before.row(5) == after.row(5)) << c.name;
}

/// Decoding token by token, or in uneven pieces, gives the rows of one forward over the whole
/// sequence: 20 tokens cross several OVQ blocks of 3 (seeding, merging at 2 centroids) and GMA
/// chunks of 4 (the chunked scan and the one-token path both continue the state).
TEST_P(CausalLayerCase, DecodingMatchesOneForward) {
  const Case c = GetParam();
  layer::Config cfg = small_config(c, 31);
  cfg.gma.chunk = 4;
  const layer::MultiHeadAttention<double> mha(cfg);
  mixattn::testing::expect_decoding_matches_forward(mha, random_matrix<double>(20, 5, 32), c.name);
}

TEST(Layer, DecodingRejectsNonCausalLayersAndForeignStates) {
  layer::MultiHeadAttention<double> bidir(small_config(kCases[0], 41));
  EXPECT_THROW(bidir.begin_decoding(), std::invalid_argument);
  layer::MultiHeadAttention<double> a(small_config(kCases[1], 42)), b(small_config(kCases[1], 43));
  layer::DecodeState<double> st = a.begin_decoding();
  const Matrix<double> x = random_matrix<double>(2, 5, 44);
  EXPECT_THROW(b.decode(x, st), std::invalid_argument);
  EXPECT_THROW(a.decode(random_matrix<double>(2, 4, 45), st), std::invalid_argument);
  EXPECT_EQ(st.tokens_seen, 0);
  EXPECT_NO_THROW(a.decode(x, st));
  EXPECT_EQ(st.tokens_seen, 2);
}

TEST_P(LayerCase, SaveLoadRoundTrip) {
  const Case c = GetParam();
  const std::string path = path_in_tmp(std::string("roundtrip_") + c.name);
  layer::MultiHeadAttention<double> a(small_config(c, 1));
  a.save(path);
  layer::MultiHeadAttention<double> b(small_config(c, 2));  // different initial values
  const Matrix<double> x = random_matrix<double>(6, 5, 3);
  ASSERT_FALSE(a.forward(x) == b.forward(x));
  b.load(path);
  std::vector<layer::NamedBlock<double>> pa = a.parameters(), pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(pa[i].map() == pb[i].map()) << pa[i].name;
  EXPECT_TRUE(a.forward(x) == b.forward(x));
  std::remove(path.c_str());
}

// ---- Not per mixer ----

TEST(Layer, ParameterListNamesAndShapes) {
  layer::Config cfg = small_config(kCases[0], 4);
  layer::MultiHeadAttention<float> gma(cfg);
  const std::vector<layer::NamedBlock<float>> p = gma.parameters();
  const std::vector<std::string> names{"w_q",
                                       "w_k",
                                       "w_v",
                                       "w_o",
                                       "head0.mean",
                                       "head0.var_raw",
                                       "head0.prior_logit",
                                       "head1.mean",
                                       "head1.var_raw",
                                       "head1.prior_logit"};
  ASSERT_EQ(p.size(), names.size());
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_EQ(p[i].name, names[i]);
  EXPECT_EQ(p[0].rows, 5);
  EXPECT_EQ(p[0].cols, 6);
  EXPECT_EQ(p[2].cols, 4);
  EXPECT_EQ(p[3].rows, 4);
  EXPECT_EQ(p[3].cols, 5);
  EXPECT_EQ(p[4].rows, 3);
  EXPECT_EQ(p[6].rows, 3);
  EXPECT_EQ(p[6].cols, 1);
  EXPECT_EQ(gma.parameter_count(), 30 + 30 + 20 + 20 + 2 * (9 + 9 + 3));
  // The views alias the layer's storage.
  p[7].map()(1, 2) = 4.5f;
  EXPECT_EQ(gma.mixture(1).mean(1, 2), 4.5f);
  p[1].map()(0, 0) = -2.f;
  EXPECT_EQ(gma.w_k()(0, 0), -2.f);

  layer::MultiHeadAttention<float> ovq(small_config(kCases[2], 4));
  const std::vector<layer::NamedBlock<float>> po = ovq.parameters();
  ASSERT_EQ(po.size(), 6u);
  EXPECT_EQ(po[5].name, "head1.beta");
  po[5].map()(0, 0) = 0.25f;
  EXPECT_EQ(ovq.beta(1), 0.25f);
  layer::MultiHeadAttention<float> softmax(small_config(kCases[3], 4));
  EXPECT_EQ(softmax.parameters().size(), 4u);
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

TEST(Layer, LoadRejectsBadFiles) {
  const layer::Config cfg = small_config(kCases[0], 1);
  layer::MultiHeadAttention<double> src(cfg);
  const std::string good = path_in_tmp("good");
  src.save(good);
  std::ifstream in(good, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  auto write = [](const std::string& path, const std::string& content) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
  };

  layer::MultiHeadAttention<double> dst(small_config(kCases[0], 2));
  const Matrix<double> before = dst.w_q();
  auto expect_error = [&](const std::string& path, const std::string& fragment) {
    const std::string msg = error_of([&] { dst.load(path); });
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_TRUE(dst.w_q() == before) << "a failed load changed the layer: " << msg;
  };

  expect_error(path_in_tmp("does_not_exist"), "cannot open");
  const std::string bad = path_in_tmp("bad");
  write(bad, "NOTAFILE" + bytes.substr(8));
  expect_error(bad, "bad magic");
  std::string v2 = bytes;
  v2[8] = 2;
  write(bad, v2);
  expect_error(bad, "format version 2");
  write(bad, bytes.substr(0, bytes.size() - 3));
  expect_error(bad, "truncated");
  write(bad, bytes + "x");
  expect_error(bad, "trailing bytes");

  // A float file into a double layer, and a layer of another shape.
  layer::MultiHeadAttention<float> as_float(cfg);
  as_float.save(bad);
  expect_error(bad, "scalars of 4 bytes");
  layer::Config wider = cfg;
  wider.value_dim = 3;
  layer::MultiHeadAttention<double>(wider).save(bad);
  expect_error(bad, "'w_v' 5 x 6 in the file but 'w_v' 5 x 4 in the model");
  layer::Config other_mixer = cfg;
  other_mixer.mixer = layer::MixerKind::softmax;
  layer::MultiHeadAttention<double>(other_mixer).save(bad);
  expect_error(bad, "4 parameters in the file but 10 in the model");

  dst.load(good);  // and the good file still loads
  EXPECT_TRUE(dst.w_q() == src.w_q());
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST(Layer, BadArgumentsAreRejected) {
  layer::Config cfg = small_config(kCases[1], 1);
  layer::MultiHeadAttention<double> mha(cfg);
  const Matrix<double> x = random_matrix<double>(6, 5, 1);
  EXPECT_NE(error_of([&] { mha.forward(random_matrix<double>(6, 4, 1)); })
                .find("mixattn::layer::MultiHeadAttention::forward: x is 6 x 4 but the layer "
                      "needs N x 5"),
            std::string::npos);
  EXPECT_THROW(mha.forward(Matrix<double>(0, 5)), std::invalid_argument);
  Matrix<double> nan = x;
  nan(2, 3) = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(mha.forward(nan), std::domain_error);

  layer::Cache<double> cache;
  EXPECT_NE(error_of([&] { mha.backward(x, x, cache); }).find("cache is empty"), std::string::npos);
  mha.forward(x, &cache);
  EXPECT_THROW(mha.backward(x, random_matrix<double>(6, 3, 2), cache), std::invalid_argument);
  EXPECT_THROW(mha.backward(x.topRows(5), x.topRows(5), cache), std::invalid_argument);
  layer::MultiHeadAttention<double> softmax(small_config(kCases[4], 1));
  EXPECT_NE(error_of([&] { softmax.backward(x, x, cache); }).find("head records"),
            std::string::npos);

  auto bad_config = [&](auto edit) {
    layer::Config c = cfg;
    edit(c);
    return error_of([&] { layer::MultiHeadAttention<double> l(c); });
  };
  EXPECT_NE(bad_config([](layer::Config& c) { c.heads = 0; }).find("config.heads must be >= 1"),
            std::string::npos);
  EXPECT_NE(bad_config([](layer::Config& c) { c.model_dim = 0; }).find("config.model_dim"),
            std::string::npos);
  EXPECT_NE(bad_config([](layer::Config& c) { c.components = 0; }).find("config.components"),
            std::string::npos);
  EXPECT_NE(bad_config([](layer::Config& c) {
              c.mixer = layer::MixerKind::ovq;
              c.causal = false;
            }).find("OVQ attention is causal"),
            std::string::npos);
  EXPECT_THROW(mha.set_threads(-1), std::invalid_argument);
  EXPECT_THROW(mha.beta(0), std::invalid_argument);  // not an OVQ layer
}

TEST(Layer, ResponsibilitiesMatchTheMixtureOnTheProjection) {
  layer::MultiHeadAttention<double> mha(small_config(kCases[0], 6));
  const Matrix<double> x = random_matrix<double>(6, 5, 7);
  const Matrix<double> q1 = (x * mha.w_q()).middleCols(3, 3);
  const Matrix<double> k0 = (x * mha.w_k()).middleCols(0, 3);
  EXPECT_TRUE(all_close(mha.query_responsibilities(x, 1),
                        mixattn::gma::responsibilities(mha.mixture(1), q1), 1e-12, 1e-14));
  EXPECT_TRUE(all_close(mha.key_responsibilities(x, 0),
                        mixattn::gma::responsibilities(mha.mixture(0), k0), 1e-12, 1e-14));
  EXPECT_THROW(mha.query_responsibilities(x, 2), std::invalid_argument);
  layer::MultiHeadAttention<double> softmax(small_config(kCases[3], 6));
  EXPECT_THROW(softmax.query_responsibilities(x, 0), std::invalid_argument);
}

// Adam's first step is p -= lr · g / (|g| + eps) (both bias corrections are exact at t = 1), so
// every entry moves by lr · sign(g) up to eps/|g|; the second step with the same gradient does
// the same again (m̂ = g, v̂ = g²). Values here are exact in double up to ~1e-16 relative.
TEST(Adam, KnownSteps) {
  Matrix<double> a(1, 3), b(2, 1);
  a << 1, 2, 3;
  b << -1, 0.5;
  Matrix<double> ga(1, 3), gb(2, 1);
  ga << 0.5, -2, 1e-3;
  gb << 4, -0.25;
  std::vector<layer::NamedBlock<double>> params{{"a", a.data(), 1, 3}, {"b", b.data(), 2, 1}};
  std::vector<layer::NamedBlock<double>> grads{{"a", ga.data(), 1, 3}, {"b", gb.data(), 2, 1}};
  mixattn::optim::AdamOptions opt;
  opt.lr = 0.1;
  opt.eps = 1e-30;  // negligible next to every |g| here (>= 1e-3)
  mixattn::optim::Adam<double> adam(params, opt);
  const double norm = adam.step(grads);
  EXPECT_NEAR(norm, std::sqrt(0.25 + 4 + 1e-6 + 16 + 0.0625), 1e-12);
  Matrix<double> ea(1, 3), eb(2, 1);
  ea << 0.9, 2.1, 2.9;
  eb << -1.1, 0.6;
  EXPECT_TRUE(all_close(a, ea, 1e-14, 1e-14));
  EXPECT_TRUE(all_close(b, eb, 1e-14, 1e-14));
  adam.step(grads);
  ea << 0.8, 2.2, 2.8;
  eb << -1.2, 0.7;
  EXPECT_TRUE(all_close(a, ea, 1e-14, 1e-14));
  EXPECT_EQ(adam.steps(), 2);

  // Decoupled weight decay adds lr · λ · p; clipping rescales g but not its sign (no change at
  // t = 1 since the update is sign-like), so check it through the returned norm only.
  Matrix<double> c(1, 1), gc(1, 1);
  c << 2;
  gc << 1;
  opt.weight_decay = 0.5;
  mixattn::optim::Adam<double> decay({{"c", c.data(), 1, 1}}, opt);
  decay.step({{"c", gc.data(), 1, 1}});
  EXPECT_NEAR(c(0, 0), 2 - 0.1 * (1 + 0.5 * 2), 1e-14);

  std::vector<layer::NamedBlock<double>> wrong{{"b", gb.data(), 2, 1}, {"a", ga.data(), 1, 3}};
  EXPECT_THROW(adam.step(wrong), std::invalid_argument);
  EXPECT_THROW(adam.step({grads[0]}), std::invalid_argument);
}

// Training a layer with Adam on a fixed regression target lowers the loss: the pieces fit.
TEST(Adam, TrainsTheLayer) {
  layer::MultiHeadAttention<double> mha(small_config(kCases[0], 31));
  const Matrix<double> x = random_matrix<double>(12, 5, 32);
  const Matrix<double> target = random_matrix<double>(12, 5, 33, 0.5);
  mixattn::optim::AdamOptions opt;
  opt.lr = 1e-2;
  mixattn::optim::Adam<double> adam(mha.parameters(), opt);
  layer::Cache<double> cache;
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    const Matrix<double> diff = mha.forward(x, &cache) - target;
    last = 0.5 * diff.squaredNorm();
    if (step == 0) first = last;
    layer::Gradients<double> g = mha.backward(x, diff, cache);
    adam.step(g.blocks());
  }
  // 200 steps of Adam on 100 parameters against 60 targets: a working gradient roughly halves
  // the loss or better; a wrong one does not move it reliably.
  EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
}

}  // namespace
