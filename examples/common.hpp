// What the training examples share: a tiny sequence model around mixattn::layer, written to be
// read and copied rather than to be a framework.
//
//   x0 = token embedding + position embedding (+ embedding of the previous token)
//   x_{l+1} = x_l + MultiHeadAttention_l(RMSNorm_l(x_l))            l = 0 .. layers-1
//   logits  = RMSNorm_f(x_L) W + b        per token, or of the mean over tokens ("pooled")
//   loss    = softmax cross-entropy
//
// Every piece has its forward and backward by hand; Adam (mixattn/adam.hpp) steps the flat list
// of named parameters. Scalars are float.
#pragma once

#include <mixattn/adam.hpp>
#include <mixattn/layer.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace example {

using mixattn::Index;
using Mat = mixattn::Matrix<float>;
using Block = mixattn::layer::NamedBlock<float>;

inline Mat gaussian(Index rows, Index cols, double stddev, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(0.0, stddev);
  Mat m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<float>(dist(rng));
  return m;
}

/// RMSNorm (Zhang & Sennrich 2019): y = x / rms(x) ∘ gain, rms(x) = sqrt(mean(x²) + eps), per row.
struct RmsNorm {
  static constexpr float eps = 1e-5f;
  /// x: N x d, gain: 1 x d. Writes y (N x d) and the per-row rms (for backward).
  static void forward(const Mat& x, const Mat& gain, Mat& y, Eigen::VectorXf& rms) {
    rms = (x.rowwise().squaredNorm() / static_cast<float>(x.cols())).array() + eps;
    rms = rms.cwiseSqrt();
    y = rms.cwiseInverse().asDiagonal() * x;
    y.array().rowwise() *= gain.row(0).array();
  }
  /// With x̂ = x / rms: d gain += Σ_i dy ∘ x̂,  dx = (dx̂ − x̂ · mean(dx̂ ∘ x̂)) / rms, dx̂ = dy ∘ gain.
  static Mat backward(const Mat& x, const Mat& gain, const Eigen::VectorXf& rms, const Mat& dy,
                      Mat& dgain) {
    const Mat xhat = rms.cwiseInverse().asDiagonal() * x;
    dgain.row(0) += dy.cwiseProduct(xhat).colwise().sum();
    Mat dxhat = dy;
    dxhat.array().rowwise() *= gain.row(0).array();
    const Eigen::VectorXf proj =
        dxhat.cwiseProduct(xhat).rowwise().sum() / static_cast<float>(x.cols());
    Mat dx = dxhat - proj.asDiagonal() * xhat;
    return rms.cwiseInverse().asDiagonal() * dx;
  }
};

/// Mean softmax cross-entropy over the rows whose target is >= 0. logits: N x C. Writes
/// dlogits (∂loss_sum/∂logits, not divided by the count) and returns the summed loss; counts
/// rows and correct argmax predictions.
inline double softmax_cross_entropy(const Mat& logits, const std::vector<int>& targets,
                                    Mat& dlogits, long& counted, long& correct) {
  dlogits.setZero(logits.rows(), logits.cols());
  double loss = 0;
  for (Index i = 0; i < logits.rows(); ++i) {
    const int t = targets[static_cast<std::size_t>(i)];
    if (t < 0) continue;
    Index best = 0;
    const float mx = logits.row(i).maxCoeff(&best);
    const Eigen::RowVectorXf e = (logits.row(i).array() - mx).exp();
    const float z = e.sum();
    loss += std::log(z) - (logits(i, t) - mx);
    dlogits.row(i) = e / z;
    dlogits(i, t) -= 1;
    ++counted;
    correct += (best == t);
  }
  return loss;
}

struct ModelConfig {
  Index vocab = 0;    ///< token ids are 0 .. vocab-1
  Index max_len = 0;  ///< longest sequence (position embeddings)
  Index classes = 0;  ///< readout size
  int layers = 1;
  bool previous_token = false;       ///< add an embedding of token i-1 to token i ("token shift")
  bool pooled = false;               ///< one prediction per sequence from the mean over tokens
  mixattn::layer::Config attention;  ///< model_dim is the model width
};

/// Result of one sequence: summed loss, rows counted, rows predicted correctly.
struct Tally {
  double loss = 0;
  long counted = 0;
  long correct = 0;
  void operator+=(const Tally& o) {
    loss += o.loss;
    counted += o.counted;
    correct += o.correct;
  }
};

class Model {
 public:
  explicit Model(const ModelConfig& cfg) : cfg_(cfg) {
    const Index d = cfg.attention.model_dim;
    std::mt19937_64 rng(cfg.attention.seed + 12345);
    tok_ = gaussian(cfg.vocab, d, 1.0, rng);
    pos_ = gaussian(cfg.max_len, d, 0.5, rng);
    prev_ = gaussian(cfg.vocab + 1, d, cfg.previous_token ? 1.0 : 0.0, rng);  // row vocab: none
    for (int l = 0; l < cfg.layers; ++l) {
      mixattn::layer::Config a = cfg.attention;
      a.seed += 1000 * static_cast<std::uint64_t>(l);
      attn_.push_back(std::make_unique<mixattn::layer::MultiHeadAttention<float>>(a));
      norm_.push_back(Mat::Ones(1, d));
    }
    final_norm_ = Mat::Ones(1, d);
    w_ = gaussian(d, cfg.classes, 1.0 / std::sqrt(static_cast<double>(d)), rng);
    b_ = Mat::Zero(1, cfg.classes);

    // One flat list of every parameter, and gradient buffers of the same shapes.
    add("tok_emb", tok_);
    add("pos_emb", pos_);
    if (cfg.previous_token) add("prev_emb", prev_);
    for (int l = 0; l < cfg.layers; ++l) {
      add("norm" + std::to_string(l), norm_[static_cast<std::size_t>(l)]);
      for (const Block& p : attn_[static_cast<std::size_t>(l)]->parameters())
        add_block({"attn" + std::to_string(l) + "." + p.name, p.data, p.rows, p.cols});
    }
    add("final_norm", final_norm_);
    add("readout.w", w_);
    add("readout.b", b_);
    // Every buffer exists now (none will move): the named gradient views, once.
    for (std::size_t k = 0; k < grads_.size(); ++k)
      grad_blocks_.push_back(
          {params_[k].name, grads_[k].data(), grads_[k].rows(), grads_[k].cols()});
  }

  std::vector<Block>& parameters() { return params_; }
  std::vector<Block>& gradients() { return grad_blocks_; }
  void zero_grad() {
    for (Mat& g : grads_) g.setZero();
  }
  Index parameter_count() const {
    Index n = 0;
    for (const Block& p : params_) n += p.rows * p.cols;
    return n;
  }
  mixattn::layer::MultiHeadAttention<float>& attention(int l) {
    return *attn_[static_cast<std::size_t>(l)];
  }

  /// The input of attention layer l (after its RMSNorm) for a sequence: N x d.
  Mat layer_input(const std::vector<int>& tokens, int l) {
    Pass pass;
    run_forward(tokens, pass, /*keep_caches=*/false, l);
    return pass.normed[static_cast<std::size_t>(l)];
  }

  /// Forward only: returns the argmax prediction per row (one row when pooled) and tallies.
  Tally evaluate(const std::vector<int>& tokens, const std::vector<int>& targets) {
    Pass pass;
    run_forward(tokens, pass, false, cfg_.layers);
    Tally t;
    Mat dlogits;
    t.loss = softmax_cross_entropy(pass.logits, targets, dlogits, t.counted, t.correct);
    return t;
  }

  /// Forward and backward of one sequence; gradients are added to gradients() (scaled by
  /// grad_scale, e.g. 1 / rows counted in the batch).
  Tally train_sequence(const std::vector<int>& tokens, const std::vector<int>& targets,
                       float grad_scale) {
    Pass pass;
    run_forward(tokens, pass, true, cfg_.layers);
    Tally t;
    Mat dlogits;
    t.loss = softmax_cross_entropy(pass.logits, targets, dlogits, t.counted, t.correct);
    dlogits *= grad_scale;
    const Index n = static_cast<Index>(tokens.size());

    // Readout: logits = F W + b (F = pooled mean of the final norm, or the final norm itself).
    grad(g_w_).noalias() += pass.readout_in.transpose() * dlogits;
    grad(g_b_) += dlogits.colwise().sum();
    Mat d_readout_in = dlogits * w_.transpose();
    Mat d_final =
        cfg_.pooled ? Mat(d_readout_in.replicate(n, 1) / static_cast<float>(n)) : d_readout_in;
    Mat dx =
        RmsNorm::backward(pass.x.back(), final_norm_, pass.final_rms, d_final, grad(g_final_norm_));
    for (int l = cfg_.layers - 1; l >= 0; --l) {
      const std::size_t li = static_cast<std::size_t>(l);
      // x_{l+1} = x_l + A(N(x_l)): the residual passes dx through, plus the branch.
      mixattn::layer::Gradients<float> ga =
          attn_[li]->backward(pass.normed[li], dx, pass.caches[li]);
      for (std::size_t p = 0; p < ga.params.size(); ++p)
        grads_[attn_grad_offset_[li] + p] += ga.params[p];
      dx += RmsNorm::backward(pass.x[li], norm_[li], pass.rms[li], ga.x, grads_[norm_grad_[li]]);
    }
    // Embeddings: scatter-add rows.
    for (Index i = 0; i < n; ++i) {
      const int tok = tokens[static_cast<std::size_t>(i)];
      grad(g_tok_).row(tok) += dx.row(i);
      grad(g_pos_).row(i) += dx.row(i);
      if (cfg_.previous_token)
        grad(g_prev_).row(i == 0 ? cfg_.vocab : tokens[static_cast<std::size_t>(i - 1)]) +=
            dx.row(i);
    }
    return t;
  }

 private:
  struct Pass {
    std::vector<Mat> x;       // residual stream x_0 .. x_L
    std::vector<Mat> normed;  // RMSNorm_l(x_l)
    std::vector<Eigen::VectorXf> rms;
    std::vector<mixattn::layer::Cache<float>> caches;
    Eigen::VectorXf final_rms;
    Mat readout_in, logits;
  };

  void run_forward(const std::vector<int>& tokens, Pass& pass, bool keep_caches, int stop_at) {
    const Index n = static_cast<Index>(tokens.size()), d = cfg_.attention.model_dim;
    if (n < 1 || n > cfg_.max_len) {
      std::fprintf(stderr, "sequence of %ld tokens, model allows 1..%ld\n", static_cast<long>(n),
                   static_cast<long>(cfg_.max_len));
      std::exit(2);
    }
    Mat x0(n, d);
    for (Index i = 0; i < n; ++i) {
      const int tok = tokens[static_cast<std::size_t>(i)];
      x0.row(i) = tok_.row(tok) + pos_.row(i);
      if (cfg_.previous_token)
        x0.row(i) += prev_.row(i == 0 ? cfg_.vocab : tokens[static_cast<std::size_t>(i - 1)]);
    }
    pass.x.push_back(std::move(x0));
    pass.caches.resize(static_cast<std::size_t>(cfg_.layers));
    for (int l = 0; l < cfg_.layers; ++l) {
      const std::size_t li = static_cast<std::size_t>(l);
      Mat normed;
      Eigen::VectorXf rms;
      RmsNorm::forward(pass.x[li], norm_[li], normed, rms);
      pass.normed.push_back(std::move(normed));
      pass.rms.push_back(std::move(rms));
      if (l == stop_at) return;
      Mat a = attn_[li]->forward(pass.normed[li], keep_caches ? &pass.caches[li] : nullptr);
      pass.x.push_back(pass.x[li] + a);
    }
    Mat final_normed;
    RmsNorm::forward(pass.x.back(), final_norm_, final_normed, pass.final_rms);
    pass.readout_in = cfg_.pooled ? Mat(final_normed.colwise().mean()) : final_normed;
    pass.logits = pass.readout_in * w_;
    pass.logits.rowwise() += b_.row(0);
  }

  // Registers a parameter and a gradient buffer of its shape; returns the buffer's index.
  std::size_t add_block(const Block& b) {
    params_.push_back(b);
    grads_.push_back(Mat::Zero(b.rows, b.cols));
    return grads_.size() - 1;
  }
  std::size_t add(const std::string& name, Mat& m) {
    const std::size_t i = add_block({name, m.data(), m.rows(), m.cols()});
    if (name == "tok_emb") g_tok_ = i;
    if (name == "pos_emb") g_pos_ = i;
    if (name == "prev_emb") g_prev_ = i;
    if (name == "final_norm") {
      g_final_norm_ = i;
    } else if (name.rfind("norm", 0) == 0) {
      norm_grad_.push_back(i);
      attn_grad_offset_.push_back(i + 1);  // the layer's parameters follow its norm
    }
    if (name == "readout.w") g_w_ = i;
    if (name == "readout.b") g_b_ = i;
    return i;
  }
  Mat& grad(std::size_t i) { return grads_[i]; }

  ModelConfig cfg_;
  Mat tok_, pos_, prev_, final_norm_, w_, b_;
  std::vector<Mat> norm_;
  std::vector<std::unique_ptr<mixattn::layer::MultiHeadAttention<float>>> attn_;
  std::vector<Block> params_, grad_blocks_;
  std::vector<Mat> grads_;
  std::size_t g_tok_ = 0, g_pos_ = 0, g_prev_ = 0, g_final_norm_ = 0, g_w_ = 0, g_b_ = 0;
  std::vector<std::size_t> norm_grad_, attn_grad_offset_;
};

// ---- command line ----

/// `--name value` lookup with a default; `--flag` presence via has_flag.
inline bool has_flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return true;
  return false;
}
inline long int_arg(int argc, char** argv, const char* name, long fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::strtol(argv[i + 1], nullptr, 10);
  return fallback;
}
inline double float_arg(int argc, char** argv, const char* name, double fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::strtod(argv[i + 1], nullptr);
  return fallback;
}
inline std::string string_arg(int argc, char** argv, const char* name,
                              const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace example
