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
#include <filesystem>
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
  /// Learned absolute position embeddings (rows 0 .. max_len-1). Without them the model has no
  /// position input of its own (order comes from the previous-token embedding and from RoPE
  /// layers) and runs on sequences of any length: max_len then only bounds training.
  bool positions = true;
  mixattn::layer::Config attention;  ///< model_dim is the model width
  /// Per-layer attention configurations (hybrids: e.g. sliding-window and OVQ layers
  /// alternating). Empty: every layer uses `attention`. Otherwise one per layer, each with
  /// attention.model_dim as its model_dim.
  std::vector<mixattn::layer::Config> per_layer;
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
    if (!cfg.per_layer.empty() && cfg.per_layer.size() != static_cast<std::size_t>(cfg.layers)) {
      std::fprintf(stderr, "per_layer has %zu configurations for %d layers\n", cfg.per_layer.size(),
                   cfg.layers);
      std::exit(2);
    }
    for (int l = 0; l < cfg.layers; ++l) {
      mixattn::layer::Config a =
          cfg.per_layer.empty() ? cfg.attention : cfg.per_layer[static_cast<std::size_t>(l)];
      a.model_dim = d;
      a.seed += 1000 * static_cast<std::uint64_t>(l);
      attn_.push_back(std::make_unique<mixattn::layer::MultiHeadAttention<float>>(a));
      norm_.push_back(Mat::Ones(1, d));
    }
    final_norm_ = Mat::Ones(1, d);
    w_ = gaussian(d, cfg.classes, 1.0 / std::sqrt(static_cast<double>(d)), rng);
    b_ = Mat::Zero(1, cfg.classes);

    // One flat list of every parameter, and gradient buffers of the same shapes.
    add("tok_emb", tok_);
    if (cfg.positions) add("pos_emb", pos_);
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
    run_forward({tokens}, eval_, l);
    return eval_.normed[static_cast<std::size_t>(l)];
  }

  /// Forward only: returns the argmax prediction per row (one row when pooled) and tallies.
  Tally evaluate(const std::vector<int>& tokens, const std::vector<int>& targets) {
    run_forward({tokens}, eval_, cfg_.layers);
    Tally t;
    Mat dlogits;
    t.loss = softmax_cross_entropy(eval_.logits, targets, dlogits, t.counted, t.correct);
    return t;
  }

  /// Forward and backward of one sequence; gradients are added to gradients() (scaled by
  /// grad_scale, e.g. 1 / rows counted in the batch).
  Tally train_sequence(const std::vector<int>& tokens, const std::vector<int>& targets,
                       float grad_scale) {
    return train_batch({tokens}, targets, grad_scale);
  }

  /// Forward and backward of B sequences at once: they are packed along the rows (offsets in
  /// the cu_seqlens convention, mixattn/packed.hpp) and every attention layer runs once over the
  /// batch through forward_packed_into / backward_into, whose caches and gradient records are
  /// kept from step to step. targets: per token, the sequences' concatenated; when pooled, one
  /// per sequence. Gradients are added to gradients() scaled by grad_scale.
  Tally train_batch(const std::vector<std::vector<int>>& batch, const std::vector<int>& targets,
                    float grad_scale) {
    Pass& pass = train_;
    run_forward(batch, pass, cfg_.layers);
    Tally t;
    Mat dlogits;
    t.loss = softmax_cross_entropy(pass.logits, targets, dlogits, t.counted, t.correct);
    dlogits *= grad_scale;

    // Readout: logits = F W + b (F = per-sequence mean of the final norm, or the final norm).
    grad(g_w_).noalias() += pass.readout_in.transpose() * dlogits;
    grad(g_b_) += dlogits.colwise().sum();
    const Mat d_readout_in = dlogits * w_.transpose();
    Mat d_final = d_readout_in;
    if (cfg_.pooled) {
      d_final.resize(pass.offsets.back(), d_readout_in.cols());
      for (std::size_t b = 0; b + 1 < pass.offsets.size(); ++b) {
        const Index t0 = pass.offsets[b], n = pass.offsets[b + 1] - t0;
        d_final.middleRows(t0, n).rowwise() =
            d_readout_in.row(static_cast<Index>(b)) / static_cast<float>(n);
      }
    }
    Mat dx =
        RmsNorm::backward(pass.x.back(), final_norm_, pass.final_rms, d_final, grad(g_final_norm_));
    for (int l = cfg_.layers - 1; l >= 0; --l) {
      const std::size_t li = static_cast<std::size_t>(l);
      // x_{l+1} = x_l + A(N(x_l)): the residual passes dx through, plus the branch.
      mixattn::layer::Gradients<float>& ga = pass.grads[li];
      attn_[li]->backward_into(ga, pass.normed[li], dx, pass.caches[li]);
      for (std::size_t p = 0; p < ga.params.size(); ++p)
        grads_[attn_grad_offset_[li] + p] += ga.params[p];
      dx += RmsNorm::backward(pass.x[li], norm_[li], pass.rms[li], ga.x, grads_[norm_grad_[li]]);
    }
    // Embeddings: scatter-add rows (positions and previous tokens within each sequence).
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::vector<int>& tokens = batch[b];
      const Index t0 = pass.offsets[b];
      for (Index i = 0; i < static_cast<Index>(tokens.size()); ++i) {
        const int tok = tokens[static_cast<std::size_t>(i)];
        grad(g_tok_).row(tok) += dx.row(t0 + i);
        if (cfg_.positions) grad(g_pos_).row(i) += dx.row(t0 + i);
        if (cfg_.previous_token)
          grad(g_prev_).row(i == 0 ? cfg_.vocab : tokens[static_cast<std::size_t>(i - 1)]) +=
              dx.row(t0 + i);
      }
    }
    return t;
  }

 private:
  struct Pass {
    mixattn::Offsets offsets;  // B + 1 row offsets of the packed batch
    std::vector<Mat> x;        // residual stream x_0 .. x_L
    std::vector<Mat> normed;   // RMSNorm_l(x_l)
    std::vector<Eigen::VectorXf> rms;
    std::vector<mixattn::layer::Cache<float>> caches;     // kept from step to step
    std::vector<mixattn::layer::Gradients<float>> grads;  // kept from step to step
    Mat attn_out;
    Eigen::VectorXf final_rms;
    Mat readout_in, logits;
  };

  void run_forward(const std::vector<std::vector<int>>& batch, Pass& pass, int stop_at) {
    const Index d = cfg_.attention.model_dim;
    pass.offsets.assign(1, 0);
    for (const std::vector<int>& tokens : batch) {
      const Index n = static_cast<Index>(tokens.size());
      if (n < 1 || (cfg_.positions && n > cfg_.max_len)) {
        std::fprintf(stderr, "sequence of %ld tokens, model allows 1..%ld\n", static_cast<long>(n),
                     static_cast<long>(cfg_.max_len));
        std::exit(2);
      }
      pass.offsets.push_back(pass.offsets.back() + n);
    }
    Mat x0(pass.offsets.back(), d);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::vector<int>& tokens = batch[b];
      for (Index i = 0; i < static_cast<Index>(tokens.size()); ++i) {
        const int tok = tokens[static_cast<std::size_t>(i)];
        const Index r = pass.offsets[b] + i;
        x0.row(r) = tok_.row(tok);
        if (cfg_.positions) x0.row(r) += pos_.row(i);
        if (cfg_.previous_token)
          x0.row(r) += prev_.row(i == 0 ? cfg_.vocab : tokens[static_cast<std::size_t>(i - 1)]);
      }
    }
    pass.x.clear();
    pass.normed.clear();
    pass.rms.clear();
    pass.x.push_back(std::move(x0));
    pass.caches.resize(static_cast<std::size_t>(cfg_.layers));
    pass.grads.resize(static_cast<std::size_t>(cfg_.layers));
    for (int l = 0; l < cfg_.layers; ++l) {
      const std::size_t li = static_cast<std::size_t>(l);
      Mat normed;
      Eigen::VectorXf rms;
      RmsNorm::forward(pass.x[li], norm_[li], normed, rms);
      pass.normed.push_back(std::move(normed));
      pass.rms.push_back(std::move(rms));
      if (l == stop_at) return;
      attn_[li]->forward_packed_into(pass.attn_out, pass.normed[li], pass.offsets, pass.caches[li]);
      pass.x.push_back(pass.x[li] + pass.attn_out);
    }
    Mat final_normed;
    RmsNorm::forward(pass.x.back(), final_norm_, final_normed, pass.final_rms);
    if (cfg_.pooled) {
      pass.readout_in.resize(static_cast<Index>(batch.size()), d);
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const Index t0 = pass.offsets[b], n = pass.offsets[b + 1] - t0;
        pass.readout_in.row(static_cast<Index>(b)) =
            final_normed.middleRows(t0, n).colwise().mean();
      }
    } else {
      pass.readout_in = final_normed;
    }
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
  Pass train_, eval_;  // working memory of training and evaluation, reused
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

/// The examples' optimiser: Adam over `params` with --lr (default 3e-3) and the global gradient
/// norm clipped to 1.
inline mixattn::optim::Adam<float> adam_from_args(
    std::vector<mixattn::layer::NamedBlock<float>> params, int argc, char** argv) {
  mixattn::optim::AdamOptions ao;
  ao.lr = float_arg(argc, argv, "--lr", 3e-3);
  ao.clip_norm = 1.0;
  return mixattn::optim::Adam<float>(std::move(params), ao);
}

/// The --out rules, applied before any work to the files `names` a run writes into DIR (none
/// without --out): --list-outputs prints their paths, one a line, and exits 0 (tests/docs/docs.py
/// compares the files docs/claims.md names with them); a file that exists is not replaced
/// without --force (examples/results holds the recorded outputs the docs cite), exit 2; DIR is
/// created.
inline void prepare_outputs(int argc, char** argv, const std::string& dir,
                            const std::vector<std::string>& names) {
  std::vector<std::string> paths;
  if (!dir.empty())
    for (const std::string& name : names) paths.push_back(dir + "/" + name);
  if (has_flag(argc, argv, "--list-outputs")) {
    for (const std::string& p : paths) std::printf("%s\n", p.c_str());
    std::exit(0);
  }
  if (paths.empty()) return;
  if (!has_flag(argc, argv, "--force"))
    for (const std::string& p : paths)
      if (std::filesystem::exists(p)) {
        std::fprintf(stderr,
                     "%s exists and is not replaced: --force replaces it, or choose "
                     "another --out\n",
                     p.c_str());
        std::exit(2);
      }
  std::error_code ignored;  // a directory that cannot be made fails in open_csv, naming the file
  std::filesystem::create_directories(dir, ignored);
}

/// DIR/name opened for writing with its header line written, or nullptr when dir is empty (no
/// --out given); exits with status 2 when the file cannot be created.
inline FILE* open_csv(const std::string& dir, const char* name, const char* header) {
  if (dir.empty()) return nullptr;
  const std::string path = dir + "/" + name;
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(2);
  }
  std::fprintf(f, "%s\n", header);
  return f;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace example
