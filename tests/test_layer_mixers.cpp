// MultiHeadAttention (layer.hpp) with the papers' baselines as mixers: linear attention (SPEC 4),
// Performer (SPEC 5), static-codebook VQ attention (SPEC 6) and the gated delta rule (SPEC 9,
// its gates computed from each head's keys: layer/mixers/delta.hpp, also against a
// token-by-token recurrence written here, and decoding). The layer against a composition
// assembled by hand from Eigen products and the operators' own public forwards, gradients
// against central differences for X and every parameter block (VQ's straight-through key
// gradient against a twin with the codes held), packed batches against separate calls, the
// parameter file, the per-head constants and parameters, and the errors. Then Config::rope
// (SPEC 8.4) on sliding-window softmax (SPEC 7) and other mixers: the layer against a hand
// composition with rope::apply per head, central differences, packed batches (positions per
// sequence), decoding (positions continue at tokens_seen) and the configuration's checks.
#include <mixattn/delta.hpp>
#include <mixattn/layer.hpp>
#include <mixattn/rope.hpp>
#include <mixattn/window.hpp>

#include "layer_checks.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace delta = mixattn::delta;
namespace layer = mixattn::layer;
namespace linear = mixattn::linear;
namespace performer = mixattn::performer;
namespace rope = mixattn::rope;
namespace vq = mixattn::vq;
namespace window = mixattn::window;
using mixattn::testing::all_close;
using mixattn::testing::expect_decoding_matches_forward;
using mixattn::testing::expect_packed_equals_separate;
using mixattn::testing::numeric_gradient;
using mixattn::testing::random_matrix;

struct Case {
  const char* name;
  layer::MixerKind mixer;
  bool causal;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}
const Case kCases[] = {
    {"linear_bidirectional", layer::MixerKind::linear, false},
    {"linear_causal", layer::MixerKind::linear, true},
    {"performer_bidirectional", layer::MixerKind::performer, false},
    {"performer_causal", layer::MixerKind::performer, true},
    {"vq_bidirectional", layer::MixerKind::vq, false},
    {"vq_causal", layer::MixerKind::vq, true},
    {"delta", layer::MixerKind::delta, true},  // causal only
};
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.name;
}

// Small shapes: d_model 5, 2 heads of r = 3, d_v = 2; Performer m = 5 features, VQ S = 4 codes;
// chunk 3 so that causal sequences of 7+ tokens cross chunk boundaries of the shared scan. The
// options' own `causal` fields are set to the opposite of Config::causal: the layer must
// override them (the composition below uses the case's flag).
layer::Config small_config(const Case& c, std::uint64_t seed) {
  layer::Config cfg;
  cfg.model_dim = 5;
  cfg.heads = 2;
  cfg.key_dim = 3;
  cfg.value_dim = 2;
  cfg.mixer = c.mixer;
  cfg.causal = c.causal;
  cfg.features = 5;
  cfg.codes = 4;
  cfg.linear.chunk = cfg.performer.chunk = cfg.vq.chunk = 3;
  cfg.delta.chunk = 3;
  cfg.linear.causal = cfg.performer.causal = cfg.vq.causal = !c.causal;
  cfg.seed = seed;
  return cfg;
}

std::string path_in_tmp(const std::string& name) {
  return ::testing::TempDir() + "mixattn_test_layer_mixers_" + name;
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(wrong exception type) ") + e.what();
  }
  return "(no exception)";
}

/// The smallest gap, over every head's keys x W_K, between the squared distances to the nearest
/// and the second-nearest code (in double): how far the quantisation is from a tie.
template <class T>
double smallest_code_gap(const layer::MultiHeadAttention<T>& mha, const Matrix<T>& x) {
  const layer::Config& cfg = mha.config();
  const Matrix<double> k = (x * mha.w_k()).template cast<double>();
  double gap = std::numeric_limits<double>::infinity();
  for (Index h = 0; h < cfg.heads; ++h) {
    const Matrix<double> c = mha.codebook(h).template cast<double>();
    for (Index j = 0; j < k.rows(); ++j) {
      double d0 = std::numeric_limits<double>::infinity(), d1 = d0;
      for (Index s = 0; s < c.rows(); ++s) {
        const double d = (k.row(j).segment(h * cfg.key_dim, cfg.key_dim) - c.row(s)).squaredNorm();
        if (d < d0) {
          d1 = d0;
          d0 = d;
        } else if (d < d1) {
          d1 = d;
        }
      }
      gap = std::min(gap, d1 - d0);
    }
  }
  return gap;
}

/// The gated delta rule layer's gates of head h from its keys kh (n x r), written out from the
/// formulas of layer/mixers/delta.hpp in double: beta_t = 1 / (1 + e^(-(k_t . w_beta +
/// b_beta))), g_t = -e^(A_log) log(1 + e^(k_t . w_a + b_a)).
template <class T>
void delta_gates_of(const layer::DeltaGates<T>& p, const Matrix<T>& kh, mixattn::Vector<T>& g,
                    mixattn::Vector<T>& beta) {
  g.resize(kh.rows());
  beta.resize(kh.rows());
  for (Index t = 0; t < kh.rows(); ++t) {
    double zb = double(p.b_beta), za = double(p.b_a);
    for (Index j = 0; j < kh.cols(); ++j) {
      zb += double(kh(t, j)) * double(p.w_beta(j));
      za += double(kh(t, j)) * double(p.w_a(j));
    }
    beta(t) = static_cast<T>(1 / (1 + std::exp(-zb)));
    g(t) = static_cast<T>(-std::exp(double(p.A_log)) * std::log1p(std::exp(za)));
  }
}

/// The layer assembled by hand: projections by Eigen, each head through the operator's public
/// value-returning forward on its column block (options with the case's causal flag; the gated
/// delta rule's gates by delta_gates_of), the output projection by Eigen.
template <class T>
Matrix<T> composition(const layer::MultiHeadAttention<T>& mha, const Case& c, const Matrix<T>& x) {
  const layer::Config& cfg = mha.config();
  const Index r = cfg.key_dim, dv = cfg.value_dim;
  const Matrix<T> q = x * mha.w_q(), k = x * mha.w_k(), v = x * mha.w_v();
  Matrix<T> mixed(x.rows(), cfg.heads * dv);
  for (Index h = 0; h < cfg.heads; ++h) {
    const Matrix<T> qh = q.middleCols(h * r, r), kh = k.middleCols(h * r, r),
                    vh = v.middleCols(h * dv, dv);
    Matrix<T> oh;
    if (c.mixer == layer::MixerKind::linear) {
      linear::Options o = cfg.linear;
      o.causal = c.causal;
      oh = linear::forward<T>(qh, kh, vh, o);
    } else if (c.mixer == layer::MixerKind::performer) {
      performer::Options o = cfg.performer;
      o.causal = c.causal;
      oh = performer::forward<T>(qh, kh, vh, mha.features(h), o);
    } else if (c.mixer == layer::MixerKind::vq) {
      vq::Options o = cfg.vq;
      o.causal = c.causal;
      oh = vq::forward<T>(qh, kh, vh, mha.codebook(h), o);
    } else {
      mixattn::Vector<T> g, beta;
      delta_gates_of(mha.delta_gates(h), kh, g, beta);
      oh = delta::forward<T>(qh, kh, vh, g, beta, cfg.delta);
    }
    mixed.middleCols(h * dv, dv) = oh;
  }
  return mixed * mha.w_o();
}

/// Tolerances of the layer against the hand composition. The two differ only in how the
/// projections are rounded (the layer's GEMM tasks against Eigen's small-product kernel: a few
/// ulps per entry of q, k, v) and, for the gated delta rule, the gates (double here, T in the
/// mixer: a few ulps of T); the heads then run the same operator code. The features are
/// exponentials of O(1) arguments and the outputs ratios of positive sums, which carry those
/// relative errors through with O(1) amplification, and W_O sums d_v H = 4 terms.
template <class T>
struct CompositionTol;
// float: a few ulps (6e-8) times an amplification of at most ~10: ~1e-6; 2e-5 / 2e-6 leaves a
// margin of ~10 and still catches any wrong term (an O(1) error).
template <>
struct CompositionTol<float> {
  static constexpr double rtol = 2e-5, atol = 2e-6;
};
// double: the same argument at 1.1e-16: ~1e-15; 1e-12 as the other mixers' composition test.
template <>
struct CompositionTol<double> {
  static constexpr double rtol = 1e-12, atol = 1e-12;
};

template <class T>
void check_composition(const Case& c) {
  const layer::Config cfg = small_config(c, 3);
  const layer::MultiHeadAttention<T> mha(cfg);
  const Matrix<T> x = random_matrix<T>(9, 5, 42);
  // VQ: keys well away from a tie, so a few ulps in k cannot change a code.
  if (c.mixer == layer::MixerKind::vq) {
    ASSERT_GT(smallest_code_gap(mha, x), 1e-3) << c.name;
  }
  EXPECT_TRUE(all_close(mha.forward(x), composition(mha, c, x), CompositionTol<T>::rtol,
                        CompositionTol<T>::atol))
      << c.name;
}

class MixerCase : public ::testing::TestWithParam<Case> {};
INSTANTIATE_TEST_SUITE_P(Baselines, MixerCase, ::testing::ValuesIn(kCases), case_name);

TEST_P(MixerCase, ForwardIsTheCompositionFloat) {
  check_composition<float>(GetParam());
}
TEST_P(MixerCase, ForwardIsTheCompositionDouble) {
  check_composition<double>(GetParam());
}

/// Straight-through twin of a VQ layer (SPEC 6.3) in double: head h reads the keys
/// k^ = x W_K,h + D_h with the offsets D_h = C_z - x W_K,h of the base point held constant, and
/// attends with w_ij = exp(tau q_i . k^_j - m_i) / sqrt(S), m_i = max_s tau q_i . C_s,
/// O_i = sum_j w_ij v_j / (sum_j w_ij + eps) over j <= i when causal: the O(N^2) formula. At the
/// base point it equals the layer; its derivatives in x and w_k are the layer's
/// straight-through gradients (the codes' own derivative is zero between ties).
Matrix<double> vq_twin(const layer::MultiHeadAttention<double>& mha, const Matrix<double>& x,
                       const std::vector<Matrix<double>>& offsets) {
  const layer::Config& cfg = mha.config();
  const Index n = x.rows(), r = cfg.key_dim, dv = cfg.value_dim, S = cfg.codes;
  const double tau = 1 / std::sqrt(static_cast<double>(r));
  const Matrix<double> q = x * mha.w_q(), k = x * mha.w_k(), v = x * mha.w_v();
  Matrix<double> mixed(n, cfg.heads * dv);
  for (Index h = 0; h < cfg.heads; ++h) {
    const Matrix<double> qh = q.middleCols(h * r, r), vh = v.middleCols(h * dv, dv);
    const Matrix<double> kq = k.middleCols(h * r, r) + offsets[static_cast<std::size_t>(h)];
    const Matrix<double>& cb = mha.codebook(h);
    for (Index i = 0; i < n; ++i) {
      const double m = (tau * (cb * qh.row(i).transpose())).maxCoeff();
      Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(dv);
      double den = cfg.vq.eps;
      for (Index j = 0; j < (cfg.causal ? i + 1 : n); ++j) {
        const double w = std::exp(tau * qh.row(i).dot(kq.row(j)) - m) / std::sqrt(double(S));
        num += w * vh.row(j);
        den += w;
      }
      mixed.block(i, h * dv, 1, dv) = num / den;
    }
  }
  return mixed * mha.w_o();
}

/// The offsets D_h = C_z - x W_K,h of vq_twin at x.
std::vector<Matrix<double>> vq_offsets(const layer::MultiHeadAttention<double>& mha,
                                       const Matrix<double>& x) {
  const Index r = mha.config().key_dim;
  const Matrix<double> k = x * mha.w_k();
  std::vector<Matrix<double>> out;
  for (Index h = 0; h < mha.config().heads; ++h) {
    const Matrix<double> kh = k.middleCols(h * r, r);
    const auto z = vq::assign<double>(kh, mha.codebook(h));
    Matrix<double> d(kh.rows(), r);
    for (Index j = 0; j < kh.rows(); ++j) d.row(j) = mha.codebook(h).row(z[j]) - kh.row(j);
    out.push_back(d);
  }
  return out;
}

// Loss = sum Y o R for a fixed random R, so dL/dY = R. Central differences with h = 1e-6 in
// double are accurate to ~1e-9 relative on these O(1) quantities (truncation h^2 f''' ~ 1e-12,
// rounding 1e-16 / h ~ 1e-10); rtol 1e-5 / atol 1e-7 leaves room for that and catches any real
// error (a wrong or missing term is off by O(1)), as in test_layer.cpp.
// Linear and Performer: every block against the layer's own loss (Performer's stabilisers are
// maxima whose argmax does not move within h here: no ties in the draws). VQ: w_q, w_v, w_o
// and the codebooks against the layer's loss (every key >= 1e-3 in squared distance from a
// tie, so no code changes within h and the forward is smooth there); the forward is constant
// in w_k between ties (its central difference is exactly 0), and the straight-through
// gradients of x and w_k are checked against the twin with the codes held (vq_twin).
TEST_P(MixerCase, GradientsMatchCentralDifferences) {
  const Case c = GetParam();
  const std::uint64_t seed = 11;
  layer::MultiHeadAttention<double> mha(small_config(c, seed));
  Matrix<double> x = random_matrix<double>(7, 5, seed + 100);
  const Matrix<double> r = random_matrix<double>(7, 5, seed + 200);
  const bool is_vq = c.mixer == layer::MixerKind::vq;
  if (is_vq) {
    ASSERT_GT(smallest_code_gap(mha, x), 1e-3) << c.name << ", seed " << seed;
  }
  const auto loss = [&]() { return mha.forward(x).cwiseProduct(r).sum(); };

  layer::Cache<double> cache;
  mha.forward(x, &cache);
  const layer::Gradients<double> g = mha.backward(x, r, cache);

  std::vector<layer::NamedBlock<double>> params = mha.parameters();
  ASSERT_EQ(params.size(), g.params.size());
  // VQ: a codebook per head; the gated delta rule: five gate blocks per head.
  const std::size_t per_head = is_vq ? 1 : c.mixer == layer::MixerKind::delta ? 5 : 0;
  ASSERT_EQ(params.size(), 4 + 2 * per_head);
  if (!is_vq) {
    EXPECT_TRUE(all_close(g.x, numeric_gradient(x, loss), 1e-5, 1e-7))
        << c.name << " x, seed " << seed;
    for (std::size_t i = 0; i < params.size(); ++i) {
      Eigen::Map<Matrix<double>> p = params[i].map();
      EXPECT_TRUE(all_close(g.param(params[i].name), numeric_gradient(p, loss), 1e-5, 1e-7))
          << c.name << " " << params[i].name << ", seed " << seed;
    }
    return;
  }
  const std::vector<Matrix<double>> offsets = vq_offsets(mha, x);
  const auto twin_loss = [&]() { return vq_twin(mha, x, offsets).cwiseProduct(r).sum(); };
  // The twin is the layer at the base point (1e-12: the same sums in another order).
  EXPECT_TRUE(all_close(vq_twin(mha, x, offsets), mha.forward(x), 1e-12, 1e-12)) << c.name;
  EXPECT_TRUE(all_close(g.x, numeric_gradient(x, twin_loss), 1e-5, 1e-7))
      << c.name << " x (straight-through), seed " << seed;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].name;
    Eigen::Map<Matrix<double>> p = params[i].map();
    if (name == "w_k") {
      EXPECT_TRUE(numeric_gradient(p, loss).isZero(0.0))
          << c.name << ": forward not constant in w_k";
      EXPECT_TRUE(all_close(g.param(name), numeric_gradient(p, twin_loss), 1e-5, 1e-7))
          << c.name << " w_k (straight-through), seed " << seed;
      EXPECT_FALSE(g.param(name).isZero(0.0)) << c.name;  // the straight-through path is used
    } else {
      EXPECT_TRUE(all_close(g.param(name), numeric_gradient(p, loss), 1e-5, 1e-7))
          << c.name << " " << name << ", seed " << seed;
    }
  }
}

// A packed batch (sequences of 1, 7 and 40 tokens) equals the layer on each sequence alone:
// outputs and input gradients row for row, parameter gradients as the per-sequence sum.
// Double; 1e-12 relative: only the projections' GEMM blocking and the order of the sums over
// sequences differ (as the other mixers' test in test_packed_batched.cpp).
TEST_P(MixerCase, PackedBatchEqualsSeparateCalls) {
  const Case c = GetParam();
  const layer::MultiHeadAttention<double> mha(small_config(c, 17));
  const mixattn::Offsets off = {0, 1, 8, 48};
  const Matrix<double> x = random_matrix<double>(off.back(), 5, 41);
  const Matrix<double> dy = random_matrix<double>(off.back(), 5, 42);
  Matrix<double> y;
  layer::Cache<double> cache;
  layer::Gradients<double> g;
  expect_packed_equals_separate(mha, x, dy, off, c.name, y, cache, g, [](auto&&...) {});
  // The reused cache and gradients give the same again for a single sequence afterwards.
  mha.forward_into(y, x.middleRows(1, 7), cache);
  EXPECT_TRUE(y == mha.forward(x.middleRows(1, 7))) << c.name;
}

// Heads are independent, so several threads change nothing, bit for bit; every gradient is
// found by its parameter's name.
TEST_P(MixerCase, ThreadsGiveIdenticalResults) {
  const Case c = GetParam();
  layer::Config cfg = small_config(c, 9);
  cfg.heads = 5;
  const layer::MultiHeadAttention<double> one(cfg);
  cfg.threads = 3;
  const layer::MultiHeadAttention<double> three(cfg);
  const Index n = 2 * mixattn::detail::gemm_task_rows + 13;
  const Matrix<double> x = random_matrix<double>(n, 5, 8), dy = random_matrix<double>(n, 5, 9);
  layer::Cache<double> c1, c3;
  EXPECT_TRUE(one.forward(x, &c1) == three.forward(x, &c3)) << c.name;
  const layer::Gradients<double> g1 = one.backward(x, dy, c1), g3 = three.backward(x, dy, c3);
  EXPECT_TRUE(g1.x == g3.x) << c.name;
  ASSERT_EQ(g1.params.size(), g3.params.size());
  for (std::size_t i = 0; i < g1.params.size(); ++i)
    EXPECT_TRUE(g1.params[i] == g3.params[i]) << c.name << " " << g1.names[i];
  const std::vector<layer::ConstNamedBlock<double>> params = one.const_parameters();
  for (std::size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(&g1.param(params[i].name), &g1.params[i]) << params[i].name;
}

// Causal linear, VQ and gated delta rule layers: output row i depends on X rows <= i only, bit
// for bit (the delta rule's chunks multiply the later rows of a chunk by exact zeros). (Causal
// Performer is left out on purpose: its key stabiliser is one maximum over the whole call, so
// later keys reach earlier rows through the guard eps and the features' rounding, SPEC 5.2.)
TEST(LayerMixers, CausalOutputsIgnoreTheFuture) {
  for (const Case& c : {kCases[1], kCases[5], kCases[6]}) {
    const layer::MultiHeadAttention<double> mha(small_config(c, 21));
    Matrix<double> x = random_matrix<double>(8, 5, 22);
    const Matrix<double> before = mha.forward(x);
    x.row(5) += random_matrix<double>(1, 5, 23);
    const Matrix<double> after = mha.forward(x);
    EXPECT_TRUE(before.topRows(5) == after.topRows(5)) << c.name;
    EXPECT_FALSE(before.row(5) == after.row(5)) << c.name;
  }
}

// Save and load: a layer of the same configuration whose parameters were overwritten gets the
// saved ones back and gives the same output. Performer's directions are not in the file (not
// parameters): they come from Config::seed, so a layer of another seed loads the same
// parameters but keeps its own directions.
TEST_P(MixerCase, SaveLoadRoundTrip) {
  const Case c = GetParam();
  const std::string path = path_in_tmp(std::string("roundtrip_") + c.name);
  const layer::MultiHeadAttention<double> a(small_config(c, 1));
  a.save(path);
  layer::MultiHeadAttention<double> b(small_config(c, 1));
  std::vector<layer::NamedBlock<double>> pb = b.parameters();
  for (std::size_t i = 0; i < pb.size(); ++i)
    pb[i].map() = random_matrix<double>(pb[i].rows, pb[i].cols, 50 + i);
  const Matrix<double> x = random_matrix<double>(6, 5, 3);
  ASSERT_FALSE(a.forward(x) == b.forward(x));
  b.load(path);
  const std::vector<layer::ConstNamedBlock<double>> pa = a.const_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].name, pb[i].name);
    EXPECT_TRUE(pa[i].map() == pb[i].map()) << pa[i].name;
  }
  EXPECT_TRUE(a.forward(x) == b.forward(x)) << c.name;
  layer::MultiHeadAttention<double> other(small_config(c, 2));
  other.load(path);
  if (c.mixer == layer::MixerKind::performer) {
    EXPECT_FALSE(other.features(0).w == a.features(0).w);
    EXPECT_FALSE(other.forward(x) == a.forward(x)) << c.name;
  } else {
    EXPECT_TRUE(other.forward(x) == a.forward(x)) << c.name;
  }
  std::remove(path.c_str());
}

// ---- Not per case ----

// parameters(): VQ adds one codebook per head (S x r), named like the GMA blocks and aliasing
// codebook(h); linear and Performer add nothing. The constants and the initial codebooks come
// from the seed as Config documents.
TEST(LayerMixers, ParametersFeaturesAndCodebooks) {
  const layer::Config vcfg = small_config(kCases[4], 4);
  layer::MultiHeadAttention<float> vql(vcfg);
  const std::vector<layer::NamedBlock<float>> p = vql.parameters();
  const std::vector<std::string> names{"w_q",           "w_k", "w_v", "w_o", "head0.codebook",
                                       "head1.codebook"};
  ASSERT_EQ(p.size(), names.size());
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_EQ(p[i].name, names[i]);
  EXPECT_EQ(p[5].rows, 4);
  EXPECT_EQ(p[5].cols, 3);
  EXPECT_EQ(vql.parameter_count(), 30 + 30 + 20 + 20 + 2 * 12);
  p[5].map()(3, 2) = 4.5f;
  EXPECT_EQ(vql.codebook(1)(3, 2), 4.5f);
  // Codebook h ~ N(0, 1) * codebook_scale from mt19937_64(seed + 1 + h): reproducible, distinct
  // per head and per seed, and scaled.
  layer::MultiHeadAttention<float> again(vcfg), other(small_config(kCases[4], 5));
  EXPECT_TRUE(again.codebook(0) == layer::MultiHeadAttention<float>(vcfg).codebook(0));
  EXPECT_FALSE(again.codebook(0) == again.codebook(1));
  EXPECT_FALSE(again.codebook(0) == other.codebook(0));
  layer::Config scaled = vcfg;
  scaled.codebook_scale = 0.25;
  // (scaling a draw by a power of two is exact, before and after rounding to float)
  EXPECT_TRUE(layer::MultiHeadAttention<float>(scaled).codebook(1) == 0.25f * again.codebook(1));

  const layer::Config pcfg = small_config(kCases[2], 4);
  layer::MultiHeadAttention<double> perf(pcfg);
  EXPECT_EQ(perf.parameters().size(), 4u);
  for (Index h = 0; h < pcfg.heads; ++h)
    EXPECT_TRUE(perf.features(h).w ==
                performer::Features<double>::random(5, 3, 4 + 1 + h, pcfg.feature_draw).w)
        << h;
  // The directions are a constant input: a redraw changes the output, a backward given the
  // forward's record after a redraw is refused.
  const Matrix<double> x = random_matrix<double>(6, 5, 1);
  layer::Cache<double> cache;
  const Matrix<double> y = perf.forward(x, &cache);
  perf.features(1).redraw(99);
  EXPECT_FALSE(perf.forward(x) == y);
  EXPECT_NE(error_of([&] { perf.backward(x, x, cache); }).find("features.w"), std::string::npos);
  EXPECT_EQ(layer::MultiHeadAttention<double>(small_config(kCases[0], 4)).parameters().size(), 4u);
}

TEST(LayerMixers, InvalidCombinationsAreRejected) {
  const auto bad_config = [](const Case& c, auto edit) {
    layer::Config cfg = small_config(c, 1);
    edit(cfg);
    return error_of([&] { layer::MultiHeadAttention<double> l(cfg); });
  };
  const auto has = [](const std::string& msg, const char* fragment) {
    return msg.find(fragment) != std::string::npos && msg.find("mixattn::layer") == 0;
  };
  const Case lin = kCases[1], perf = kCases[3], vqc = kCases[5];
  EXPECT_PRED2(has, bad_config(perf, [](layer::Config& c) { c.features = 0; }),
               "config.features must be >= 1 for Performer, got 0");
  EXPECT_PRED2(has, bad_config(vqc, [](layer::Config& c) { c.codes = 0; }),
               "config.codes must be >= 1 for VQ, got 0");
  EXPECT_PRED2(has, bad_config(vqc, [](layer::Config& c) { c.codebook_scale = 0; }),
               "config.codebook_scale must be > 0");
  EXPECT_PRED2(has, bad_config(perf, [](layer::Config& c) { c.performer.scale = -1; }),
               "config.performer.scale must be >= 0");
  EXPECT_PRED2(
      has,
      bad_config(vqc,
                 [](layer::Config& c) { c.vq.scale = std::numeric_limits<double>::quiet_NaN(); }),
      "config.vq.scale");
  EXPECT_PRED2(has, bad_config(lin, [](layer::Config& c) { c.linear.eps = 0; }),
               "config.linear.eps must be > 0");
  EXPECT_PRED2(has, bad_config(vqc, [](layer::Config& c) { c.vq.chunk = -1; }),
               "config.vq.chunk must be >= 0");
  // A field of another mixer is not checked (the GMA layer's defaults stay valid).
  EXPECT_EQ(bad_config(lin, [](layer::Config& c) { c.codes = 0; }), "(no exception)");

  // No streaming state: decoding is refused, naming the mixer.
  for (const Case& c : {lin, perf, vqc}) {
    const layer::MultiHeadAttention<double> mha(small_config(c, 2));
    EXPECT_PRED2(has, error_of([&] { mha.begin_decoding(); }), "config.mixer is ") << c.name;
    EXPECT_NE(error_of([&] { mha.begin_decoding(); }).find(layer::mixer_name(c.mixer)),
              std::string::npos);
    layer::DecodeState<double> st;
    EXPECT_THROW(mha.decode(random_matrix<double>(1, 5, 1), st), std::invalid_argument) << c.name;
    EXPECT_THROW(mha.query_responsibilities(random_matrix<double>(3, 5, 1), 0),
                 std::invalid_argument);
    EXPECT_THROW(mha.beta(0), std::invalid_argument);
  }

  // Accessors of another mixer's per-head state, or of a head out of range.
  layer::MultiHeadAttention<double> v(small_config(vqc, 3)), p(small_config(perf, 3));
  EXPECT_PRED2(has, error_of([&] { v.features(0); }), "exists for heads 0..H-1 of a performer");
  EXPECT_PRED2(has, error_of([&] { p.codebook(0); }), "of a vq layer; asked for head 0");
  EXPECT_PRED2(has, error_of([&] { v.codebook(2); }), "asked for head 2 of a vq layer of 2");
  EXPECT_NO_THROW(v.codebook(1));

  // A cache filled by a layer of another mixer, or before the codebook changed.
  const Matrix<double> x = random_matrix<double>(6, 5, 4);
  layer::Cache<double> cache;
  p.forward(x, &cache);
  EXPECT_PRED2(has, error_of([&] { v.backward(x, x, cache); }), "head records");
  v.forward(x, &cache);
  v.codebook(0)(0, 0) += 1;
  EXPECT_PRED2(has, error_of([&] { v.backward(x, x, cache); }), "a parameter of the layer");
}

// ---- The gated delta rule (MixerKind::delta) ----

/// The gated delta rule layer in double from SPEC 9.1, token by token rather than through the
/// library's chunked form: per head the gates of delta_gates_of (from the raw keys), q and k
/// normalised (x / sqrt(|x|^2 + norm_eps)), S_t = e^(g_t) (I - beta_t k_t k_t^T) S_(t-1) +
/// beta_t k_t v_t^T from S_0 = 0, o_t = S_t^T q_t / sqrt(r); then W_O.
Matrix<double> delta_recurrence(const layer::MultiHeadAttention<double>& mha,
                                const Matrix<double>& x) {
  const layer::Config& cfg = mha.config();
  const Index r = cfg.key_dim, dv = cfg.value_dim;
  const Matrix<double> q = x * mha.w_q(), k = x * mha.w_k(), v = x * mha.w_v();
  const auto normalised = [&](const Matrix<double>& m) {
    Matrix<double> out = m;
    for (Index t = 0; t < m.rows(); ++t)
      out.row(t) /= std::sqrt(m.row(t).squaredNorm() + cfg.delta.norm_eps);
    return out;
  };
  Matrix<double> mixed(x.rows(), cfg.heads * dv);
  for (Index h = 0; h < cfg.heads; ++h) {
    const Matrix<double> kh = k.middleCols(h * r, r);
    mixattn::Vector<double> g, beta;
    delta_gates_of(mha.delta_gates(h), kh, g, beta);
    const Matrix<double> qn = normalised(q.middleCols(h * r, r)), kn = normalised(kh);
    Matrix<double> S = Matrix<double>::Zero(r, dv);
    for (Index t = 0; t < x.rows(); ++t) {
      S *= std::exp(g(t));
      const Matrix<double> err = v.block(t, h * dv, 1, dv) - kn.row(t) * S;
      S += beta(t) * kn.row(t).transpose() * err;
      mixed.block(t, h * dv, 1, dv) = qn.row(t) * S / std::sqrt(double(r));
    }
  }
  return mixed * mha.w_o();
}

// The chunked form (chunks of 3 over 11 tokens) against the recurrence: the same float64
// quantities in another order, ~1e-15 relative on these contracting updates (normalised keys,
// beta in (0, 1)); 1e-12 catches any wrong term (a gate's or a key's is O(1e-2) or more).
TEST(LayerDelta, ForwardIsTheRecurrence) {
  layer::MultiHeadAttention<double> mha(small_config(kCases[6], 5));
  const Matrix<double> x = random_matrix<double>(11, 5, 6);
  const Matrix<double> y = mha.forward(x);
  EXPECT_TRUE(all_close(y, delta_recurrence(mha, x), 1e-12, 1e-12));
  // Every gate parameter reaches the output.
  for (const auto edit : {+[](layer::DeltaGates<double>& p) { p.w_beta(1) += 0.5; },
                          +[](layer::DeltaGates<double>& p) { p.b_beta += 0.5; },
                          +[](layer::DeltaGates<double>& p) { p.w_a(2) += 0.5; },
                          +[](layer::DeltaGates<double>& p) { p.b_a += 0.5; },
                          +[](layer::DeltaGates<double>& p) { p.A_log += 0.5; }}) {
    layer::MultiHeadAttention<double> changed = mha;
    edit(changed.delta_gates(1));
    const Matrix<double> yc = changed.forward(x);
    EXPECT_FALSE(all_close(yc, y, 1e-6, 1e-6));
    EXPECT_TRUE(all_close(yc, delta_recurrence(changed, x), 1e-12, 1e-12));
  }
}

TEST(LayerDelta, DecodingMatchesOneForward) {
  const layer::MultiHeadAttention<double> mha(small_config(kCases[6], 33));
  expect_decoding_matches_forward(mha, random_matrix<double>(20, 5, 34), "delta");
}

// parameters(): the four projections, then per head its five gate blocks, aliasing
// delta_gates(h); the initial values as layer::DeltaGates documents, from seed + 1 + h.
TEST(LayerDelta, ParametersAndInitialGates) {
  const layer::Config cfg = small_config(kCases[6], 4);
  layer::MultiHeadAttention<double> mha(cfg);
  const std::vector<layer::NamedBlock<double>> p = mha.parameters();
  const std::vector<std::string> names{"w_q",          "w_k",          "w_v",          "w_o",
                                       "head0.w_beta", "head0.b_beta", "head0.w_a",    "head0.b_a",
                                       "head0.A_log",  "head1.w_beta", "head1.b_beta", "head1.w_a",
                                       "head1.b_a",    "head1.A_log"};
  ASSERT_EQ(p.size(), names.size());
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_EQ(p[i].name, names[i]);
  EXPECT_EQ(p[4].rows, 3);
  EXPECT_EQ(p[4].cols, 1);
  EXPECT_EQ(p[8].rows * p[8].cols, 1);
  EXPECT_EQ(mha.parameter_count(), 30 + 30 + 20 + 20 + 2 * (3 + 1 + 3 + 1 + 1));
  p[13].map()(0, 0) = 0.25;
  p[11].map()(2, 0) = -1.5;
  EXPECT_EQ(mha.delta_gates(1).A_log, 0.25);
  EXPECT_EQ(mha.delta_gates(1).w_a(2), -1.5);
  const layer::MultiHeadAttention<double> again(cfg), other(small_config(kCases[6], 5));
  for (Index h = 0; h < cfg.heads; ++h) {
    const layer::DeltaGates<double>& g = again.delta_gates(h);
    EXPECT_EQ(g.b_beta, 0.0);
    EXPECT_GE(g.A_log, 0.0);  // A in [1, 16]
    EXPECT_LE(g.A_log, std::log(16.0));
    const double dt = std::log1p(std::exp(g.b_a));  // softplus(b_a) = dt in [1e-3, 0.1]
    EXPECT_GE(dt, 1e-3 * (1 - 1e-12));
    EXPECT_LE(dt, 0.1 * (1 + 1e-12));
    EXPECT_FALSE(g.w_beta == g.w_a);
    EXPECT_FALSE(g.w_beta == other.delta_gates(h).w_beta);
  }
  EXPECT_FALSE(again.delta_gates(0).w_beta == again.delta_gates(1).w_beta);
  EXPECT_TRUE(layer::MultiHeadAttention<double>(cfg).delta_gates(1).w_a ==
              again.delta_gates(1).w_a);
}

TEST(LayerDelta, InvalidConfigurationsAreRejected) {
  const auto bad_config = [](auto edit) {
    layer::Config cfg = small_config(kCases[6], 1);
    edit(cfg);
    return error_of([&] { layer::MultiHeadAttention<double> l(cfg); });
  };
  const auto has = [](const std::string& msg, const char* fragment) {
    return msg.find(fragment) != std::string::npos && msg.find("mixattn::layer") == 0;
  };
  EXPECT_PRED2(has, bad_config([](layer::Config& c) { c.causal = false; }),
               "the gated delta rule is causal: set config.causal = true");
  EXPECT_PRED2(has, bad_config([](layer::Config& c) { c.delta.chunk = 0; }),
               "config.delta.chunk must be >= 1, got 0");
  EXPECT_PRED2(has, bad_config([](layer::Config& c) { c.delta.scale = -1; }),
               "config.delta.scale must be >= 0");
  EXPECT_PRED2(has, bad_config([](layer::Config& c) { c.delta.norm_eps = 0; }),
               "config.delta.norm_eps must be > 0 and finite");
  layer::MultiHeadAttention<double> d(small_config(kCases[6], 2)), v(small_config(kCases[5], 2));
  EXPECT_PRED2(has, error_of([&] { v.delta_gates(0); }), "exists for heads 0..H-1 of a delta");
  EXPECT_PRED2(has, error_of([&] { d.delta_gates(2); }), "asked for head 2 of a delta layer of 2");
  EXPECT_PRED2(has, error_of([&] { d.codebook(0); }), "of a vq layer; asked for head 0");
  // A cache made before a gate changed is refused by the layer's fingerprint of its parameters.
  const Matrix<double> x = random_matrix<double>(6, 5, 4);
  layer::Cache<double> cache;
  d.forward(x, &cache);
  d.delta_gates(1).b_a += 1;
  EXPECT_PRED2(has, error_of([&] { d.backward(x, x, cache); }), "a parameter of the layer");
}

// ---- RoPE in the layer (Config::rope, SPEC 8.4) ----

const Case kRopeCases[] = {
    {"softmax_window_rope", layer::MixerKind::softmax, true},
    {"linear_causal_rope", layer::MixerKind::linear, true},
};

// small_config with an even key width (r = 4: two rotated pairs per head), RoPE on with a base
// of 50 rather than the default (so a layer ignoring rope_options.base is caught: theta_1 =
// 50^(-1/2) = 0.14, not 0.01), softmax heads with a window of 3 (shorter than every sequence
// below but one), GMA with K = 3 and OVQ with blocks of 3 and at most 2 centroids as in
// test_layer.cpp.
layer::Config rope_config(const Case& c, std::uint64_t seed) {
  layer::Config cfg = small_config(c, seed);
  cfg.key_dim = 4;
  cfg.rope = true;
  cfg.rope_options.base = 50;
  cfg.softmax.window = 3;
  cfg.components = 3;
  cfg.ovq.block = 3;
  cfg.ovq.max_centroids = 2;
  return cfg;
}

/// The RoPE layer assembled by hand: projections by Eigen, rope::apply (positions 0..N-1) on
/// each head's column block of Q and K, the mixer's own public forward (window::forward for
/// softmax heads, linear::forward with the case's causal flag), concatenation, W_O by Eigen.
template <class T>
Matrix<T> rope_composition(const layer::MultiHeadAttention<T>& mha, const Case& c,
                           const Matrix<T>& x) {
  const layer::Config& cfg = mha.config();
  const Index r = cfg.key_dim, dv = cfg.value_dim;
  const Matrix<T> q = x * mha.w_q(), k = x * mha.w_k(), v = x * mha.w_v();
  rope::Options ro;
  ro.base = cfg.rope_options.base;
  Matrix<T> mixed(x.rows(), cfg.heads * dv);
  for (Index h = 0; h < cfg.heads; ++h) {
    const Matrix<T> qh = rope::apply<T>(q.middleCols(h * r, r), 0, ro);
    const Matrix<T> kh = rope::apply<T>(k.middleCols(h * r, r), 0, ro);
    const Matrix<T> vh = v.middleCols(h * dv, dv);
    if (c.mixer == layer::MixerKind::softmax) {
      window::Options wo;
      wo.window = cfg.softmax.window;
      mixed.middleCols(h * dv, dv) = window::forward<T>(qh, kh, vh, wo);
    } else {
      linear::Options lo = cfg.linear;
      lo.causal = c.causal;
      mixed.middleCols(h * dv, dv) = linear::forward<T>(qh, kh, vh, lo);
    }
  }
  return mixed * mha.w_o();
}

class RopeCase : public ::testing::TestWithParam<Case> {};
INSTANTIATE_TEST_SUITE_P(Rope, RopeCase, ::testing::ValuesIn(kRopeCases), case_name);

// Tolerances as CompositionTol's argument: the rotation is the same code on both sides (angles
// and products in double, one rounding to T), so the inputs' few-ulp differences from the
// projections pass through it unamplified (it is orthogonal), and the heads' softmax or
// elu + 1 ratios carry them with O(1) amplification. 12 tokens: the window of 3 masks most keys
// and the angles p theta_0 reach 11 rad, several turns.
template <class T>
void check_rope_composition(const Case& c) {
  const layer::MultiHeadAttention<T> mha(rope_config(c, 3));
  const Matrix<T> x = random_matrix<T>(12, 5, 42);
  const Matrix<T> y = mha.forward(x);
  EXPECT_TRUE(
      all_close(y, rope_composition(mha, c, x), CompositionTol<T>::rtol, CompositionTol<T>::atol))
      << c.name;
  // The rotation matters here: the same weights without it give another output.
  layer::Config plain = rope_config(c, 3);
  plain.rope = false;
  EXPECT_FALSE(all_close(layer::MultiHeadAttention<T>(plain).forward(x), y, 1e-3, 1e-3)) << c.name;
}

TEST_P(RopeCase, ForwardIsTheCompositionFloat) {
  check_rope_composition<float>(GetParam());
}
TEST_P(RopeCase, ForwardIsTheCompositionDouble) {
  check_rope_composition<double>(GetParam());
}

// Central differences for x and every parameter block, as GradientsMatchCentralDifferences
// (same h, same tolerances and the same argument for them; the rotation is linear in q and k,
// so it adds no curvature). 7 tokens: windows of 3 cut the causal rows, and positions 0..6.
TEST_P(RopeCase, GradientsMatchCentralDifferences) {
  const Case c = GetParam();
  const std::uint64_t seed = 13;
  layer::MultiHeadAttention<double> mha(rope_config(c, seed));
  Matrix<double> x = random_matrix<double>(7, 5, seed + 100);
  const Matrix<double> r = random_matrix<double>(7, 5, seed + 200);
  const auto loss = [&]() { return mha.forward(x).cwiseProduct(r).sum(); };
  layer::Cache<double> cache;
  mha.forward(x, &cache);
  const layer::Gradients<double> g = mha.backward(x, r, cache);
  std::vector<layer::NamedBlock<double>> params = mha.parameters();
  ASSERT_EQ(params.size(), 4u);  // RoPE adds no parameter
  ASSERT_EQ(g.params.size(), 4u);
  EXPECT_TRUE(all_close(g.x, numeric_gradient(x, loss), 1e-5, 1e-7))
      << c.name << " x, seed " << seed;
  for (std::size_t i = 0; i < params.size(); ++i) {
    Eigen::Map<Matrix<double>> p = params[i].map();
    EXPECT_TRUE(all_close(g.param(params[i].name), numeric_gradient(p, loss), 1e-5, 1e-7))
        << c.name << " " << params[i].name << ", seed " << seed;
  }
}

// A packed batch of sequences of 1, 7 and 40 tokens equals the layer on each sequence alone:
// every sequence's rows start again at position 0 (a layer that rotated by the packed row index
// would rotate sequences 1 and 2 by other angles, an O(1) difference). Bit for bit where the
// two compute the same thing in the same order: the cache's rotated queries and keys, the heads'
// outputs (the projections give these rows the same bits whatever the row count, and each
// (sequence, head) item runs the same code on them), and the mixers' gradients dQ, dK (rotated
// back) and dV. Y = M W_O and dX go through GEMMs whose blocking depends on the row count (a few
// ulps): 1e-12 relative, and the parameter gradients are per-sequence sums taken in another order
// (1e-11), as PackedBatchEqualsSeparateCalls.
TEST_P(RopeCase, PackedBatchEqualsSeparateCalls) {
  const Case c = GetParam();
  const layer::MultiHeadAttention<double> mha(rope_config(c, 17));
  const mixattn::Offsets off = {0, 1, 8, 48};
  const Matrix<double> x = random_matrix<double>(off.back(), 5, 41);
  const Matrix<double> dy = random_matrix<double>(off.back(), 5, 42);
  Matrix<double> y;
  layer::Cache<double> cache;
  layer::Gradients<double> g;
  expect_packed_equals_separate(
      mha, x, dy, off, c.name, y, cache, g,
      [&](std::size_t b, Index t0, Index n, const layer::Cache<double>& cb,
          const layer::Gradients<double>& gb) {
        EXPECT_TRUE(Matrix<double>(cache.q.middleRows(t0, n)) == cb.q) << c.name << " sequence " << b;
        EXPECT_TRUE(Matrix<double>(cache.k.middleRows(t0, n)) == cb.k) << c.name << " sequence " << b;
        EXPECT_TRUE(Matrix<double>(cache.mixed.middleRows(t0, n)) == cb.mixed)
            << c.name << " sequence " << b;
        EXPECT_TRUE(Matrix<double>(g.dq.middleRows(t0, n)) == gb.dq) << c.name << " sequence " << b;
        EXPECT_TRUE(Matrix<double>(g.dk.middleRows(t0, n)) == gb.dk) << c.name << " sequence " << b;
        EXPECT_TRUE(Matrix<double>(g.dv.middleRows(t0, n)) == gb.dv) << c.name << " sequence " << b;
      });
}

// Decoding token by token, or in uneven pieces, gives the rows of one forward over the whole
// sequence with RoPE on: each piece's rows are rotated at positions tokens_seen onwards (a
// decode that restarted at 0 per piece would rotate queries and keys by other angles, and the
// scores depend on the difference of positions). Softmax with a window of 3 (the KV cache keeps
// every rotated key, each new token reads the last 3), GMA and OVQ (blocks of 3, at most 2
// centroids: seeding and merging) and the gated delta rule (its gates read the rotated keys).
// Double; as DecodingMatchesOneForward in test_layer.cpp, the pieces reorder sums of <= 20 O(1)
// terms and the projections are Eigen's products rather than the layer's GEMM tasks (a few
// ulps): 1e-12 leaves a margin of ~100.
TEST(LayerRope, DecodingMatchesOneForward) {
  const Case cases[] = {{"softmax_window_rope", layer::MixerKind::softmax, true},
                        {"gma_causal_rope", layer::MixerKind::gma, true},
                        {"ovq_rope", layer::MixerKind::ovq, true},
                        {"delta_rope", layer::MixerKind::delta, true}};
  for (const Case& c : cases) {
    layer::Config cfg = rope_config(c, 31);
    cfg.gma.chunk = 4;
    const layer::MultiHeadAttention<double> mha(cfg);
    expect_decoding_matches_forward(mha, random_matrix<double>(20, 5, 32), c.name);
  }
}

// With RoPE, key_dim must be even and the base finite and > 0; the messages name the fields.
// Without RoPE neither is checked (the baselines' cases above run r = 3).
TEST(LayerRope, InvalidConfigurationsAreRejected) {
  const auto error_for = [](auto edit) {
    layer::Config cfg = rope_config(kRopeCases[0], 1);
    edit(cfg);
    return error_of([&] { layer::MultiHeadAttention<double> l(cfg); });
  };
  const auto has = [](const std::string& msg, const char* fragment) {
    return msg.find(fragment) != std::string::npos && msg.find("mixattn::layer") == 0;
  };
  EXPECT_PRED2(has, error_for([](layer::Config& c) { c.key_dim = 3; }), "config.key_dim is 3");
  EXPECT_PRED2(has, error_for([](layer::Config& c) { c.key_dim = 1; }), "config.key_dim is 1");
  for (const double base : {0.0, -2.0, std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::quiet_NaN()})
    EXPECT_PRED2(has, error_for([&](layer::Config& c) { c.rope_options.base = base; }),
                 "config.rope_options.base is ")
        << base;
  EXPECT_EQ(error_for([](layer::Config& c) { c.rope_options.base = 1e-3; }), "(no exception)");
  // A subnormal base: theta_i = base^(-2i/r) overflows double for r = 64 (SPEC 8.3).
  EXPECT_PRED2(has, error_for([](layer::Config& c) {
                 c.key_dim = 64;
                 c.rope_options.base = std::numeric_limits<double>::denorm_min();
               }),
               "config.rope_options.base is ");
  EXPECT_EQ(error_for([](layer::Config& c) {
              c.key_dim = 3;
              c.rope_options.base = -1;
              c.rope = false;
            }),
            "(no exception)");
}

}  // namespace
