// mixattn/layer.hpp — a trainable multi-head attention layer over any of the library's mixers.
//
//     X (N x d_model)
//       Q = X W_Q,  K = X W_K   (N x H·r)        V = X W_V   (N x H·d_v)
//       O_h = mixer_h(Q_h, K_h, V_h)             (N x d_v), head h reads column block h
//       Y = [O_1 … O_H] W_O                      (N x d_model)
//
// The mixer of every head is one of
//   - GMA (SPEC §1), bidirectional or causal, with its own routing mixture per head;
//   - OVQ (SPEC §2), always causal, with its own scale factor beta per head; every forward
//     processes X as a whole sequence from an empty State;
//   - softmax attention (SPEC §3, the tiled form), bidirectional or causal;
//   - the papers' baselines, bidirectional or causal: linear attention (SPEC §4), Performer /
//     FAVOR+ (SPEC §5) with its own constant random features per head, and static-codebook VQ
//     attention (SPEC §6) with its own learned codebook per head.
// Causal softmax heads take a sliding window (Config::softmax.window, SPEC §7). With
// Config::rope, every head's Q_h and K_h are rotated by RoPE (SPEC §8.4) before its mixer, row n
// of each sequence at position n: the local sliding-window layers of OVQ's hybrid models.
//
// Causal layers also decode: begin_decoding() makes one sequence's DecodeState (a gma::State,
// ovq::State or softmax KvCache per head) and decode(x, state) takes the next token(s), giving
// the rows forward() would give over the whole sequence.
//
// Parameters are exposed as a flat list of named blocks (parameters()), and backward returns
// one gradient per block in the same order, so any optimiser (adam.hpp) can step them and
// save_parameters / load_parameters can write them to a small binary file.
//
// Thread safety: forward and backward are const and keep all per-call state in the Cache, so
// several threads may run one layer on different sequences at once, each with its own Cache.
// Changing parameters while another thread runs the layer is a data race. Inside one call the
// (sequence, head) pairs run on up to Config::threads threads of the library's pool
// (mixattn/parallel.hpp), the longest sequences first; Eigen stays single-threaded inside each.
//
// Training loops: forward_into / forward_packed_into (a packed batch of sequences, offsets as in
// mixattn/packed.hpp) and backward_into reuse the caller's y, Cache and Gradients: with one
// thread, a step whose shapes repeat performs no heap allocation.
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/gemm.hpp"
#include "mixattn/detail/layer_io.hpp"
#include "mixattn/detail/parallel_gemm.hpp"
#include "mixattn/gma.hpp"
#include "mixattn/linear.hpp"
#include "mixattn/named_block.hpp"
#include "mixattn/ovq.hpp"
#include "mixattn/packed.hpp"
#include "mixattn/parallel.hpp"
#include "mixattn/performer.hpp"
#include "mixattn/reference.hpp"
#include "mixattn/rope.hpp"
#include "mixattn/vq.hpp"

#include <array>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

// ---------------------------------------------------------------------------------------------
// Named parameter blocks and their file format
// ---------------------------------------------------------------------------------------------

/// Magic bytes opening a parameter file.
inline constexpr char file_magic[8] = {'M', 'I', 'X', 'A', 'T', 'T', 'N', 'P'};
/// Format version written by save_parameters and the only one load_parameters reads.
inline constexpr std::uint32_t file_version = 1;

/// Writes `blocks` to `path` in the parameter file format, version 1 (all integers and scalars
/// little-endian, IEEE-754):
///
///     8 bytes   magic "MIXATTNP"
///     u32       version (1)
///     u32       scalar size in bytes (4: float, 8: double)
///     u64       number of blocks
///     per block, in order:
///       u32     name length L, then L bytes of name (no terminator)
///       u64     rows, u64 cols
///       rows·cols scalars, row-major
///
/// The file is replaced whole or not at all (POSIX systems): the bytes go to a temporary file
/// in the same directory ("<path>.tmp.<pid>.<n>"), which is flushed, fsync'ed and renamed over
/// `path`, then the directory is fsync'ed. A process killed or a disk filling up mid-save leaves
/// the previous file byte for byte, and a reader opening `path` at any time sees the old file or
/// the new one. A symbolic link at `path` is followed; only regular files are replaced.
/// Throws std::runtime_error naming the path and the reason (the system's error text) when the
/// file cannot be written; the temporary file is removed and `path` left as it was.
template <class T>
void save_parameters(const std::string& path, const std::vector<ConstNamedBlock<T>>& blocks) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double");
  const std::string fn = "mixattn::layer::save_parameters";
  detail::FileReplacer os(path);
  if (os.open()) {
    os.write(file_magic, sizeof(file_magic));
    detail::put_le(os, file_version);
    detail::put_le(os, static_cast<std::uint32_t>(sizeof(T)));
    detail::put_le(os, static_cast<std::uint64_t>(blocks.size()));
    for (const ConstNamedBlock<T>& b : blocks) {
      detail::put_le(os, static_cast<std::uint32_t>(b.name.size()));
      os.write(b.name.data(), static_cast<std::streamsize>(b.name.size()));
      detail::put_le(os, static_cast<std::uint64_t>(b.rows));
      detail::put_le(os, static_cast<std::uint64_t>(b.cols));
      for (Index i = 0; i < b.rows * b.cols; ++i) detail::put_scalar(os, b.data[i]);
    }
    os.commit();
  }
  if (!os.ok()) {
    os.abandon();  // before raising: without exceptions raise_io aborts
    detail::raise_io(detail::concat_msg(fn, path, os.error()));
  }
}

/// Reads a file written by save_parameters into `blocks`, which must match it exactly: same
/// scalar type, same number of blocks, and per block the same name and shape, in order.
/// Nothing is written into the blocks unless the whole file is valid: it is read into a staged
/// copy first, whose size is the model's, never what the file declares. Any bytes at all give
/// either a correct load or std::runtime_error naming the path and the first mismatch (bad
/// magic, other version, other scalar size, other count, other name or shape, truncated file,
/// trailing bytes).
template <class T>
void load_parameters(const std::string& path, const std::vector<NamedBlock<T>>& blocks) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double");
  const std::string fn = "mixattn::layer::load_parameters";
  std::ifstream is(path, std::ios::binary);
  if (!is) detail::raise_io(detail::concat_msg(fn, path, "cannot open the file for reading"));
  detail::load_header(is, fn, path, file_magic, file_version, sizeof(T), blocks.size());
  std::vector<Matrix<T>> staged(blocks.size());
  for (std::size_t p = 0; p < blocks.size(); ++p)
    detail::load_block(is, fn, path, p, blocks[p].name, blocks[p].rows, blocks[p].cols, staged[p]);
  if (is.peek() != std::char_traits<char>::eof())
    detail::raise_io(detail::concat_msg(fn, path, "trailing bytes after the last parameter"));
  for (std::size_t p = 0; p < blocks.size(); ++p) blocks[p].map() = staged[p];
}

// ---------------------------------------------------------------------------------------------
// The layer
// ---------------------------------------------------------------------------------------------

/// Which sequence mixer every head runs.
enum class MixerKind {
  gma,        ///< Gaussian Mixture Attention (SPEC §1), bidirectional or causal
  ovq,        ///< Online vector-quantized attention (SPEC §2), always causal
  softmax,    ///< exact softmax attention, tiled (SPEC §3), bidirectional or causal
  linear,     ///< linear attention, elu + 1 features (SPEC §4), bidirectional or causal
  performer,  ///< Performer / FAVOR+ random features (SPEC §5), bidirectional or causal
  vq,         ///< static learned-codebook VQ attention (SPEC §6), bidirectional or causal
};

/// The mixer's name as written in MixerKind ("gma", "ovq", "softmax", "linear", "performer",
/// "vq"), for messages.
inline const char* mixer_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::gma:
      return "gma";
    case MixerKind::ovq:
      return "ovq";
    case MixerKind::softmax:
      return "softmax";
    case MixerKind::linear:
      return "linear";
    case MixerKind::performer:
      return "performer";
    case MixerKind::vq:
      return "vq";
  }
  return "unknown";
}

/// Shape and behaviour of a MultiHeadAttention layer.
struct Config {
  Index model_dim = 0;  ///< d_model: columns of X and Y
  Index heads = 1;      ///< H
  Index key_dim = 0;    ///< r: routing/key dimension per head
  Index value_dim = 0;  ///< d_v: value dimension per head
  MixerKind mixer = MixerKind::gma;
  /// Token i sees only j <= i. Decides for GMA, softmax, linear, Performer and VQ (the `causal`
  /// fields of their options below are overridden by it); OVQ is causal by construction and
  /// requires true.
  bool causal = false;
  Index components = 16;         ///< K, mixture components per head (GMA)
  double gma_mean_scale = 1;     ///< initial component means ~ N(0, 1)·gma_mean_scale (SPEC 1.1)
  gma::Options gma;              ///< eps, chunk, check_finite of every GMA head
  ovq::Options ovq;              ///< block, dictionary size, growth, … of every OVQ head
  reference::Options softmax;    ///< scale (0: 1/sqrt(r)) and check_finite of softmax heads
  linear::Options linear;        ///< eps, chunk, check_finite of linear-attention heads
  performer::Options performer;  ///< eps, chunk, scale (0: r^(-1/4)) of Performer heads
  /// m, random features per Performer head. Head h's directions are
  /// performer::Features::random(features, r, seed + 1 + h, feature_draw), drawn once when the
  /// layer is made and never redrawn by it (features(h).redraw(s) does, between steps); they are
  /// a constant input, not a parameter: no gradient, not in parameters() or the parameter file.
  Index features = 64;
  performer::Draw feature_draw = performer::Draw::orthogonal;  ///< how the directions are drawn
  vq::Options vq;  ///< eps, chunk, scale (0: 1/sqrt(r)) of VQ heads
  /// S, codes per VQ head. Head h's codebook "head<h>.codebook" (S x r) is a learned parameter,
  /// initialised ~ N(0, 1) * codebook_scale from an mt19937_64 seeded with seed + 1 + h (keys
  /// x W_K of unit-variance x are ~ N(0, 1) entrywise at initialisation, so the codes start
  /// where the keys are).
  Index codes = 64;
  double codebook_scale = 1;
  int threads = 1;           ///< threads over heads (0: all cores)
  std::uint64_t seed = 0;    ///< initialisation seed (weights, mixtures, codebooks, features)
  bool check_finite = true;  ///< reject NaN/Inf in X and dY with std::domain_error
  /// Rotate every head's queries and keys by RoPE (SPEC §8, 8.4) before its mixer: row n of a
  /// sequence is at position n (positions restart at each sequence of a packed batch; decode
  /// continues at DecodeState::tokens_seen). Needs an even key_dim. Works with any mixer (it is
  /// how the sliding-window softmax layers of OVQ's hybrids, softmax.window = w, see order); no
  /// parameters and no gradient of its own.
  bool rope = false;
  /// base of the rotation angles (10000); its check_finite is ignored: config.check_finite
  /// decides.
  rope::Options rope_options;
};

/// What forward keeps for backward: the projections, the concatenated head outputs and each
/// head's Saved record. O(N (H·(2r + 2 d_v))) plus what the mixers save (O(N) per head for
/// GMA and flash softmax; OVQ's checkpoints). Reusable across calls: buffers are resized only
/// when N changes.
template <class T>
struct Cache {
  Matrix<T> q, k, v;  ///< N x H·r, N x H·r, N x H·d_v (q and k rotated with Config::rope)
  Matrix<T> mixed;    ///< N x H·d_v, the head outputs side by side
  std::vector<gma::Saved<T>> gma_saved;
  std::vector<ovq::Saved<T>> ovq_saved;
  std::vector<reference::Saved<T>> softmax_saved;
  std::vector<linear::Saved<T>> linear_saved;
  std::vector<performer::Saved<T>> performer_saved;
  std::vector<vq::Saved<T>> vq_saved;
  Index tokens = -1;                      ///< N of the forward that filled it; -1 when empty
  std::uint64_t fingerprint[2] = {0, 0};  ///< of x and of every parameter, checked by backward
  Offsets offsets;  ///< the batch's sequence offsets ({0, N} for one sequence)
  // Working memory reused by forward_into: one output per (sequence, head), OVQ's end states.
  std::vector<Matrix<T>> head_out;
  std::vector<ovq::State<T>> ovq_state;
  std::vector<Index> order;
  ::mixattn::detail::GemmTasks<T> gemm;  // the projections, run as tasks on the pool
};

/// Gradients of a scalar loss: x (N x d_model) and one block per parameter, params[i] matching
/// MultiHeadAttention::parameters()[i] in name and shape.
template <class T>
struct Gradients {
  Matrix<T> x;
  std::vector<std::string> names;
  std::vector<Matrix<T>> params;
  // Working memory reused by backward_into: dM, dQ, dK, dV and one gradient record per head.
  Matrix<T> d_mixed, dq, dk, dv;
  std::vector<gma::Grad<T>> gma_grads;
  std::vector<ovq::Grad<T>> ovq_grads;
  std::vector<reference::Grad<T>> softmax_grads;
  std::vector<linear::Grad<T>> linear_grads;
  std::vector<performer::Grad<T>> performer_grads;
  std::vector<vq::Grad<T>> vq_grads;
  std::vector<Index> order;
  ::mixattn::detail::GemmTasks<T> gemm;
  /// Where each parameter's gradient is in params, found by name when the blocks are set up:
  /// w_q, w_k, w_v, w_o, then per head its blocks (GMA mean, var_raw, prior_logit; OVQ beta;
  /// VQ codebook).
  std::size_t slot_w[4] = {0, 0, 0, 0};
  std::vector<std::array<std::size_t, 3>> slot_head;
  /// The gradient named `name` (a name of parameters()); throws std::invalid_argument when there
  /// is none.
  Matrix<T>& param(const std::string& name) { return params[index_of(name)]; }
  const Matrix<T>& param(const std::string& name) const { return params[index_of(name)]; }
  std::size_t index_of(const std::string& name) const {
    for (std::size_t i = 0; i < names.size() && i < params.size(); ++i)
      if (names[i] == name) return i;
    ::mixattn::detail::raise_invalid_argument(::mixattn::detail::concat(
        "mixattn::layer::Gradients::param: no parameter named '", name, "' among ", names.size()));
    return 0;
  }
  /// Named views of params (valid while this object lives and is not resized).
  std::vector<NamedBlock<T>> blocks() {
    std::vector<NamedBlock<T>> out;
    out.reserve(params.size());
    for (std::size_t i = 0; i < params.size(); ++i)
      out.push_back({names[i], params[i].data(), params[i].rows(), params[i].cols()});
    return out;
  }
};

/// One sequence's incremental state for decoding with a causal layer (begin_decoding()): per
/// head a gma::State (with the head's mixture prepared once), an ovq::State or a softmax
/// reference::KvCache, whichever the layer's mixer needs. GMA and OVQ states have a constant
/// size; the softmax cache grows with the sequence. The mixtures are a snapshot taken by
/// begin_decoding: after changing them, begin again (decode checks each prepared mixture's
/// fingerprint against the layer's and rejects a stale state).
template <class T>
struct DecodeState {
  std::vector<gma::Prepared<T>> gma_prepared;
  std::vector<gma::State<T>> gma;
  std::vector<ovq::State<T>> ovq;
  std::vector<reference::KvCache<T>> softmax;
  Index tokens_seen = 0;
  const void* layer = nullptr;  // the layer that began it (decode rejects another's)
};

/// Multi-head attention layer (see the top of this file). Parameters, in parameters() order:
///   w_q (d_model x H·r), w_k (d_model x H·r), w_v (d_model x H·d_v), w_o (H·d_v x d_model),
///   then per head h: GMA "head<h>.mean" (K x r), "head<h>.var_raw" (K x r),
///   "head<h>.prior_logit" (K x 1); OVQ "head<h>.beta" (1 x 1); VQ "head<h>.codebook" (S x r);
///   softmax, linear and Performer nothing.
/// Initialisation: projection weights ~ N(0, 1/fan_in), seeded by Config::seed; mixtures by
/// gma::Mixture::random(K, r, seed + 1 + h, gma_mean_scale); beta = 1; codebooks and Performer
/// directions from seed + 1 + h as Config::codes and Config::features say.
/// RoPE (Config::rope, SPEC 8.4) adds no parameter: forward rotates each (sequence, head)
/// item's Q_h, K_h in the Cache in place (rows at positions 0, 1, … of their own sequence), so
/// the Cache holds the rotated q and k the mixers saw; backward rotates the mixer's dQ_h, dK_h
/// back (R^T) before the weight products; decode rotates the new rows at positions
/// tokens_seen, tokens_seen + 1, …
template <class T>
class MultiHeadAttention {
  static_assert(::mixattn::detail::refuse_arguments<T>(), "see the message above");

 public:
  explicit MultiHeadAttention(const Config& config) : cfg_(config) {
    validate_config();
    const Index h = cfg_.heads, r = cfg_.key_dim, d_v = cfg_.value_dim, d = cfg_.model_dim;
    std::mt19937_64 rng(cfg_.seed);
    w_q_ = gaussian(d, h * r, 1.0 / std::sqrt(static_cast<double>(d)), rng);
    w_k_ = gaussian(d, h * r, 1.0 / std::sqrt(static_cast<double>(d)), rng);
    w_v_ = gaussian(d, h * d_v, 1.0 / std::sqrt(static_cast<double>(d)), rng);
    w_o_ = gaussian(h * d_v, d, 1.0 / std::sqrt(static_cast<double>(h * d_v)), rng);
    if (cfg_.mixer == MixerKind::gma)
      for (Index i = 0; i < h; ++i)
        mixtures_.push_back(gma::Mixture<T>::random(cfg_.components, r,
                                                    cfg_.seed + 1 + static_cast<std::uint64_t>(i),
                                                    static_cast<T>(cfg_.gma_mean_scale)));
    if (cfg_.mixer == MixerKind::ovq) beta_ = Vector<T>::Ones(h);
    for (Index i = 0; i < h && cfg_.mixer == MixerKind::performer; ++i)
      features_.push_back(performer::Features<T>::random(
          cfg_.features, r, cfg_.seed + 1 + static_cast<std::uint64_t>(i), cfg_.feature_draw));
    for (Index i = 0; i < h && cfg_.mixer == MixerKind::vq; ++i) {
      std::mt19937_64 code_rng(cfg_.seed + 1 + static_cast<std::uint64_t>(i));
      codebooks_.push_back(gaussian(cfg_.codes, r, cfg_.codebook_scale, code_rng));
    }
  }

  const Config& config() const { return cfg_; }
  /// Threads over heads for later calls (0: all cores).
  void set_threads(int threads) {
    ::mixattn::detail::require(threads >= 0, "mixattn::layer::MultiHeadAttention::set_threads",
                               "threads must be >= 0, got ", threads);
    cfg_.threads = threads;
  }

  Matrix<T>& w_q() { return w_q_; }
  Matrix<T>& w_k() { return w_k_; }
  Matrix<T>& w_v() { return w_v_; }
  Matrix<T>& w_o() { return w_o_; }
  const Matrix<T>& w_q() const { return w_q_; }
  const Matrix<T>& w_k() const { return w_k_; }
  const Matrix<T>& w_v() const { return w_v_; }
  const Matrix<T>& w_o() const { return w_o_; }
  /// Head h's routing mixture (GMA layers only).
  gma::Mixture<T>& mixture(Index h) { return mixtures_.at(static_cast<std::size_t>(h)); }
  const gma::Mixture<T>& mixture(Index h) const {
    return mixtures_.at(static_cast<std::size_t>(h));
  }
  /// Head h's scale factor beta (OVQ layers only).
  T& beta(Index h) { return beta_[checked_head(h, "beta")]; }
  T beta(Index h) const { return beta_[checked_head(h, "beta")]; }
  /// Head h's random feature directions (Performer layers only; m x r, a constant input).
  performer::Features<T>& features(Index h) {
    return features_[kind_head(MixerKind::performer, h,
                               "mixattn::layer::MultiHeadAttention::features")];
  }
  const performer::Features<T>& features(Index h) const {
    return features_[kind_head(MixerKind::performer, h,
                               "mixattn::layer::MultiHeadAttention::features")];
  }
  /// Head h's codebook (VQ layers only; S x r, the parameter "head<h>.codebook").
  Matrix<T>& codebook(Index h) {
    return codebooks_[kind_head(MixerKind::vq, h, "mixattn::layer::MultiHeadAttention::codebook")];
  }
  const Matrix<T>& codebook(Index h) const {
    return codebooks_[kind_head(MixerKind::vq, h, "mixattn::layer::MultiHeadAttention::codebook")];
  }

  /// Named writable views of every parameter (order and shapes documented on the class).
  std::vector<NamedBlock<T>> parameters() {
    std::vector<NamedBlock<T>> out;
    for (const ConstNamedBlock<T>& b : const_parameters())
      out.push_back({b.name, const_cast<T*>(b.data), b.rows, b.cols});  // we own the storage
    return out;
  }

  /// Named read-only views of every parameter.
  std::vector<ConstNamedBlock<T>> const_parameters() const {
    std::vector<ConstNamedBlock<T>> out;
    out.emplace_back("w_q", w_q_.data(), w_q_.rows(), w_q_.cols());
    out.emplace_back("w_k", w_k_.data(), w_k_.rows(), w_k_.cols());
    out.emplace_back("w_v", w_v_.data(), w_v_.rows(), w_v_.cols());
    out.emplace_back("w_o", w_o_.data(), w_o_.rows(), w_o_.cols());
    for (Index h = 0; h < cfg_.heads; ++h) {
      const std::string prefix = ::mixattn::detail::concat("head", h, ".");
      if (cfg_.mixer == MixerKind::gma) {
        const gma::Mixture<T>& m = mixtures_[static_cast<std::size_t>(h)];
        out.emplace_back(prefix + "mean", m.mean.data(), m.mean.rows(), m.mean.cols());
        out.emplace_back(prefix + "var_raw", m.var_raw.data(), m.var_raw.rows(), m.var_raw.cols());
        out.emplace_back(prefix + "prior_logit", m.prior_logit.data(), m.prior_logit.size(), 1);
      } else if (cfg_.mixer == MixerKind::ovq) {
        out.emplace_back(prefix + "beta", beta_.data() + h, 1, 1);
      } else if (cfg_.mixer == MixerKind::vq) {
        const Matrix<T>& c = codebooks_[static_cast<std::size_t>(h)];
        out.emplace_back(prefix + "codebook", c.data(), c.rows(), c.cols());
      }
    }
    return out;
  }

  /// Total number of scalar parameters.
  Index parameter_count() const {
    Index n = 0;
    for (const ConstNamedBlock<T>& b : const_parameters()) n += b.rows * b.cols;
    return n;
  }

  /// Y = concat_h(mixer_h(X W_Q, X W_K, X W_V)) W_O.  x: N x d_model (N >= 1); returns
  /// N x d_model. With a cache, fills it for backward; without, keeps nothing.
  Matrix<T> forward(const ConstMatrixRef<T>& x, Cache<T>* cache = nullptr) const {
    Matrix<T> y;
    Cache<T> local;
    Cache<T>& c = cache ? *cache : local;
    c.offsets.assign({0, x.rows()});
    run_forward("mixattn::layer::MultiHeadAttention::forward", y, x, c, cache != nullptr);
    return y;
  }

  /// A fresh decoding state for one sequence (causal layers only: config.causal). Prepares
  /// every GMA head's mixture constants once. reserve_tokens: softmax layers reserve their
  /// key/value caches for that many tokens (no reallocation while decoding up to it).
  DecodeState<T> begin_decoding(Index reserve_tokens = 0) const {
    constexpr const char* fn = "mixattn::layer::MultiHeadAttention::begin_decoding";
    ::mixattn::detail::require(cfg_.causal, fn,
                               "decoding needs a causal layer: set config.causal = true");
    ::mixattn::detail::require(reserve_tokens >= 0, fn, "reserve_tokens is ", reserve_tokens,
                               ", must be >= 0");
    ::mixattn::detail::require(decodes(), fn, "config.mixer is ", mixer_name(cfg_.mixer),
                               ", which keeps no streaming state (SPEC 4.4, 5.2, 6.4); decoding "
                               "is provided for gma, ovq and softmax");
    const Index heads = cfg_.heads, r = cfg_.key_dim, d_v = cfg_.value_dim;
    DecodeState<T> st;
    st.layer = this;
    for (Index h = 0; h < heads; ++h) {
      switch (cfg_.mixer) {
        case MixerKind::gma:
          st.gma_prepared.emplace_back(mixtures_[static_cast<std::size_t>(h)]);
          st.gma.push_back(gma::State<T>::empty(cfg_.components, d_v));
          break;
        case MixerKind::ovq:
          st.ovq.push_back(ovq::State<T>::empty(r, d_v));
          break;
        case MixerKind::softmax:
          st.softmax.emplace_back(r, d_v, reserve_tokens);
          break;
        case MixerKind::linear:  // refused above
        case MixerKind::performer:
        case MixerKind::vq:
          break;
      }
    }
    return st;
  }

  /// The next n tokens of the sequence `state` has seen so far: x is n x d_model (n >= 1, one
  /// token when generating); returns n x d_model, the rows forward() would give for them over
  /// the whole sequence (up to rounding), and advances `state`. Per token and head the cost is
  /// O(K (r + d_v)) for GMA, O((N_max + C)(r + d_v)) for OVQ, O(t (r + d_v)) for softmax at
  /// position t. With config.rope the new rows are at positions state.tokens_seen onwards.
  /// A throw for x (shape, non-finite values, or projections that overflow T) leaves
  /// `state` unchanged; after any other (a mismatched state, a non-finite parameter, an output
  /// that overflowed T), begin_decoding() again.
  Matrix<T> decode(const ConstMatrixRef<T>& x, DecodeState<T>& state) const {
    constexpr const char* fn = "mixattn::layer::MultiHeadAttention::decode";
    check_input(fn, x);
    const std::size_t hs = static_cast<std::size_t>(cfg_.heads);
    const std::size_t have = cfg_.mixer == MixerKind::gma   ? state.gma.size()
                             : cfg_.mixer == MixerKind::ovq ? state.ovq.size()
                                                            : state.softmax.size();
    ::mixattn::detail::require(decodes() && state.layer == this && have == hs, fn,
                               "state was not made by this layer's begin_decoding()");
    if (cfg_.mixer == MixerKind::gma) check_prepared(fn, state);
    const Index n = x.rows(), r = cfg_.key_dim, d_v = cfg_.value_dim;
    Matrix<T> q = x * w_q_, k = x * w_k_;
    const Matrix<T> v = x * w_v_;
    check_projections(fn, q, k, v);  // before any head's state moves
    // RoPE: the new rows continue the sequence at position tokens_seen.
    if (cfg_.rope) {
      const rope::Options ro = rope_options();
      for (Index h = 0; h < cfg_.heads; ++h) {
        rope::apply_in_place<T>(q.middleCols(h * r, r), state.tokens_seen, ro);
        rope::apply_in_place<T>(k.middleCols(h * r, r), state.tokens_seen, ro);
      }
    }
    Matrix<T> mixed(n, cfg_.heads * d_v);
    const gma::Options gopt = gma_options();
    const reference::Options sopt = softmax_options();
    parallel_for(cfg_.heads, cfg_.threads, [&](Index h) {
      const std::size_t i = static_cast<std::size_t>(h);
      const ConstMatrixRef<T> qh = q.middleCols(h * r, r), kh = k.middleCols(h * r, r);
      const ConstMatrixRef<T> vh = v.middleCols(h * d_v, d_v);
      auto out = mixed.middleCols(h * d_v, d_v);
      switch (cfg_.mixer) {
        case MixerKind::gma:
          out = gma::forward(state.gma_prepared[i], qh, kh, vh, gopt, state.gma[i]);
          break;
        case MixerKind::ovq:
          out = ovq::forward(qh, kh, vh, beta_[h], cfg_.ovq, state.ovq[i]);
          break;
        case MixerKind::softmax:
          out = reference::decode<T>(state.softmax[i], qh, kh, vh, sopt);
          break;
        case MixerKind::linear:  // begin_decoding refuses these layers
        case MixerKind::performer:
        case MixerKind::vq:
          break;
      }
    });
    state.tokens_seen += n;
    Matrix<T> y(n, cfg_.model_dim);
    y.noalias() = mixed * w_o_;
    if (cfg_.check_finite)  // as forward: an overflowed projection is reported, never returned
      ::mixattn::detail::require_finite_result(y, fn, "the output", "x or a weight is");
    return y;
  }

  /// forward into a caller-owned y (resized to N x d_model) and cache (filled for backward);
  /// both keep their capacity, so with threads = 1 a training step whose shapes repeat
  /// performs no heap allocation.
  void forward_into(Matrix<T>& y, const ConstMatrixRef<T>& x, Cache<T>& cache) const {
    cache.offsets.assign({0, x.rows()});
    run_forward("mixattn::layer::MultiHeadAttention::forward_into", y, x, cache, true);
  }

  /// A packed batch of B sequences (packed.hpp): x: total x d_model, sequence b = rows
  /// [offsets[b], offsets[b+1]); y: resized to total x d_model. The projections run once over
  /// all rows; the mixers run per (sequence, head) pair, largest first on Config::threads
  /// threads, each pair equal to the layer's forward on that sequence alone bit for bit.
  /// backward_into takes the same cache (it holds the offsets).
  void forward_packed_into(Matrix<T>& y, const ConstMatrixRef<T>& x, const Offsets& offsets,
                           Cache<T>& cache) const {
    constexpr const char* fn = "mixattn::layer::MultiHeadAttention::forward_packed_into";
    ::mixattn::detail::check_offsets(fn, "offsets", offsets, x.rows());
    for (std::size_t b = 0; b + 1 < offsets.size(); ++b)
      ::mixattn::detail::require(offsets[b + 1] > offsets[b], fn, "sequence ", b,
                                 " is empty; every sequence needs N >= 1");
    cache.offsets = offsets;
    run_forward(fn, y, x, cache, true);
  }

  /// Gradients of a scalar loss L given dY = ∂L/∂Y. x: N x d_model, the forward's input;
  /// grad_y: N x d_model; cache: filled by forward(x, &cache) with the current parameters.
  Gradients<T> backward(const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& grad_y,
                        const Cache<T>& cache) const {
    Gradients<T> g;
    run_backward("mixattn::layer::MultiHeadAttention::backward", g, x, grad_y, cache);
    return g;
  }

  /// backward into caller-owned gradients: names and blocks are filled once, matrices resized
  /// (no-op when shapes repeat) and the per-head records reused.
  void backward_into(Gradients<T>& g, const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& grad_y,
                     const Cache<T>& cache) const {
    run_backward("mixattn::layer::MultiHeadAttention::backward_into", g, x, grad_y, cache);
  }

  /// Head h's query responsibilities Γ_Q = γ(X W_Q,h) (N x K) — for diagnostics (GMA only).
  Matrix<T> query_responsibilities(const ConstMatrixRef<T>& x, Index h) const {
    return head_responsibilities("query_responsibilities", x, h, w_q_);
  }
  /// Head h's key responsibilities Γ_K = γ(X W_K,h) (N x K) — for diagnostics (GMA only).
  Matrix<T> key_responsibilities(const ConstMatrixRef<T>& x, Index h) const {
    return head_responsibilities("key_responsibilities", x, h, w_k_);
  }

  // Compile-time refusal (core.hpp, refuse_arguments): a column-major or strided x or grad_y
  // would be copied on every call; these overloads exist only for the static_assert's message.
  template <class X, ::mixattn::detail::enable_if_refused<T, X> = 0>
  Matrix<T> forward(const X&, Cache<T>* = nullptr) const {
    ::mixattn::detail::refuse_arguments<T, X>();
    return {};
  }
  template <class X, class G, ::mixattn::detail::enable_if_refused<T, X, G> = 0>
  Gradients<T> backward(const X&, const G&, const Cache<T>&) const {
    ::mixattn::detail::refuse_arguments<T, X, G>();
    return {};
  }
  template <class X, ::mixattn::detail::enable_if_refused<T, X> = 0>
  void forward_into(Matrix<T>&, const X&, Cache<T>&) const {
    ::mixattn::detail::refuse_arguments<T, X>();
  }
  template <class X, ::mixattn::detail::enable_if_refused<T, X> = 0>
  void forward_packed_into(Matrix<T>&, const X&, const Offsets&, Cache<T>&) const {
    ::mixattn::detail::refuse_arguments<T, X>();
  }
  template <class X, class G, ::mixattn::detail::enable_if_refused<T, X, G> = 0>
  void backward_into(Gradients<T>&, const X&, const G&, const Cache<T>&) const {
    ::mixattn::detail::refuse_arguments<T, X, G>();
  }
  template <class X, ::mixattn::detail::enable_if_refused<T, X> = 0>
  Matrix<T> decode(const X&, DecodeState<T>&) const {
    ::mixattn::detail::refuse_arguments<T, X>();
    return {};
  }
  template <class X, ::mixattn::detail::enable_if_refused<T, X> = 0>
  Matrix<T> query_responsibilities(const X&, Index) const {
    ::mixattn::detail::refuse_arguments<T, X>();
    return {};
  }
  template <class X, ::mixattn::detail::enable_if_refused<T, X> = 0>
  Matrix<T> key_responsibilities(const X&, Index) const {
    ::mixattn::detail::refuse_arguments<T, X>();
    return {};
  }

  /// Writes every parameter to `path` (format: save_parameters).
  void save(const std::string& path) const { save_parameters<T>(path, const_parameters()); }
  /// Reads parameters saved by a layer of the same configuration (load_parameters); the layer
  /// is unchanged if the file does not match.
  void load(const std::string& path) { load_parameters<T>(path, parameters()); }

 private:
  /// The mixtures a decoding state prepared must still be the layer's (O(H K r), small next to
  /// the projections of one token).
  void check_prepared(const char* fn, const DecodeState<T>& state) const {
    for (std::size_t i = 0; i < mixtures_.size(); ++i)
      if (i >= state.gma_prepared.size() || ::mixattn::detail::mixture_fingerprint(mixtures_[i]) !=
                                                state.gma_prepared[i].mixture_fingerprint())
        ::mixattn::detail::raise_invalid_argument(::mixattn::detail::concat(
            fn, ": state came from other data: head ", i,
            "'s mixture changed since begin_decoding() prepared it; call begin_decoding() again"));
  }

  void run_forward(const char* fn, Matrix<T>& y, const ConstMatrixRef<T>& x, Cache<T>& c,
                   bool keep) const {
    check_input(fn, x);
    using ::mixattn::detail::plain;
    constexpr Index block = ::mixattn::detail::gemm_task_rows;
    const Index n = x.rows(), heads = cfg_.heads, r = cfg_.key_dim, d_v = cfg_.value_dim;
    c.tokens = -1;  // stays invalid if a head throws
    c.q.resize(n, heads * r);
    c.k.resize(n, heads * r);
    c.v.resize(n, heads * d_v);
    c.gemm.clear();  // the projections in row blocks, on the pool
    c.gemm.add(c.q, {plain<T>(x)}, {plain<T>(w_q_)}, T(1), false, block);
    c.gemm.add(c.k, {plain<T>(x)}, {plain<T>(w_k_)}, T(1), false, block);
    c.gemm.add(c.v, {plain<T>(x)}, {plain<T>(w_v_)}, T(1), false, block);
    c.gemm.run(cfg_.threads);
    check_projections(fn, c.q, c.k, c.v);
    c.mixed.resize(n, heads * d_v);
    const Index items = (static_cast<Index>(c.offsets.size()) - 1) * heads;
    const std::size_t is = static_cast<std::size_t>(items);
    c.gma_saved.resize(keep && cfg_.mixer == MixerKind::gma ? is : 0);
    c.ovq_saved.resize(keep && cfg_.mixer == MixerKind::ovq ? is : 0);
    c.softmax_saved.resize(keep && cfg_.mixer == MixerKind::softmax ? is : 0);
    c.linear_saved.resize(keep && cfg_.mixer == MixerKind::linear ? is : 0);
    c.performer_saved.resize(keep && cfg_.mixer == MixerKind::performer ? is : 0);
    c.vq_saved.resize(keep && cfg_.mixer == MixerKind::vq ? is : 0);
    c.head_out.resize(is);
    c.ovq_state.resize(cfg_.mixer == MixerKind::ovq ? is : 0);
    ::mixattn::detail::parallel_largest_first(
        items, cfg_.threads, [&](Index i) { return sequence_length(c.offsets, i); },
        [&](Index i) { head_forward(c, i, keep); }, c.order);
    y.resize(n, cfg_.model_dim);
    c.gemm.clear();
    c.gemm.add(y, {plain<T>(c.mixed)}, {plain<T>(w_o_)}, T(1), false, block);
    c.gemm.run(cfg_.threads);
    if (cfg_.check_finite)
      ::mixattn::detail::require_finite_result(y, fn, "the output", "x or a weight is");
    if (keep) {  // recomputed by every forward that fills the cache
      c.fingerprint[0] = ::mixattn::detail::fingerprint(x);
      c.fingerprint[1] = parameter_fingerprint();
      c.tokens = n;
    }
  }

  Index sequence_length(const Offsets& offsets, Index item) const {
    const std::size_t b = static_cast<std::size_t>(item / cfg_.heads);
    return offsets[b + 1] - offsets[b];
  }

  /// The mixer of item i = b H + h: head h on sequence b.
  void head_forward(Cache<T>& c, Index item, bool keep) const {
    const Index r = cfg_.key_dim, d_v = cfg_.value_dim, h = item % cfg_.heads;
    const std::size_t i = static_cast<std::size_t>(item), hi = static_cast<std::size_t>(h);
    const Index t0 = c.offsets[static_cast<std::size_t>(item / cfg_.heads)];
    const Index n = sequence_length(c.offsets, item);
    if (cfg_.rope) {  // the item's own blocks, positions from 0: the cache keeps the rotated q, k
      const rope::Options ro = rope_options();
      rope::apply_in_place<T>(c.q.block(t0, h * r, n, r), 0, ro);
      rope::apply_in_place<T>(c.k.block(t0, h * r, n, r), 0, ro);
    }
    const ConstMatrixRef<T> qh = c.q.block(t0, h * r, n, r);
    const ConstMatrixRef<T> kh = c.k.block(t0, h * r, n, r);
    const ConstMatrixRef<T> vh = c.v.block(t0, h * d_v, n, d_v);
    Matrix<T>& out = c.head_out[i];
    switch (cfg_.mixer) {
      case MixerKind::gma:
        gma::forward_into(out, mixtures_[hi], qh, kh, vh, gma_options(),
                          keep ? &c.gma_saved[i] : nullptr);
        break;
      case MixerKind::ovq: {                                       // each sequence starts afresh
        const ovq::State<T> empty = ovq::State<T>::empty(r, d_v);  // 0-row: nothing allocated
        ovq::forward_into(out, qh, kh, vh, beta_[h], cfg_.ovq, empty, c.ovq_state[i],
                          keep ? &c.ovq_saved[i] : nullptr);
        break;
      }
      case MixerKind::softmax:
        reference::flash_forward_into<T>(out, qh, kh, vh, softmax_options(),
                                         keep ? &c.softmax_saved[i] : nullptr);
        break;
      case MixerKind::linear:
        linear::forward_into<T>(out, qh, kh, vh, linear_options(),
                                keep ? &c.linear_saved[i] : nullptr);
        break;
      case MixerKind::performer:
        performer::forward_into<T>(out, qh, kh, vh, features_[hi], performer_options(),
                                   keep ? &c.performer_saved[i] : nullptr);
        break;
      case MixerKind::vq:
        vq::forward_into<T>(out, qh, kh, vh, codebooks_[hi], vq_options(),
                            keep ? &c.vq_saved[i] : nullptr);
        break;
    }
    c.mixed.block(t0, h * d_v, n, d_v) = out;
  }

  void check_backward(const char* fn, const ConstMatrixRef<T>& x, const ConstMatrixRef<T>& grad_y,
                      const Cache<T>& cache) const {
    check_input(fn, x);
    ::mixattn::detail::require(grad_y.rows() == x.rows() && grad_y.cols() == x.cols(), fn,
                               "grad_y is ", ::mixattn::detail::shape_str(grad_y), " but x is ",
                               ::mixattn::detail::shape_str(x));
    if (cfg_.check_finite) ::mixattn::detail::require_finite(grad_y, fn, "grad_y");
    if (cache.tokens != x.rows())  // the message is built only on failure
      ::mixattn::detail::require(
          false, fn, "cache ",
          cache.tokens < 0
              ? std::string("is empty")
              : ::mixattn::detail::concat("holds a forward of ", cache.tokens, " tokens"),
          " but x has ", x.rows(), " rows (call forward(x, &cache) first)");
    const std::size_t expected_saved =
        static_cast<std::size_t>(cfg_.heads) * (cache.offsets.size() - 1);
    const std::size_t saved = saved_records(cache);
    ::mixattn::detail::require(saved == expected_saved, fn, "cache holds ", saved,
                               " head records of this mixer but the layer has ", cfg_.heads,
                               " heads (was it filled by another layer?)");
    if (::mixattn::detail::fingerprint(x) != cache.fingerprint[0])
      ::mixattn::detail::raise_other_data(fn, "cache", "x");
    if (parameter_fingerprint() != cache.fingerprint[1])
      ::mixattn::detail::raise_other_data(fn, "cache", "a parameter of the layer");
  }

  /// Names and shapes of g's blocks and where each parameter's block is, set once by name: a
  /// reused Gradients of this layer's shapes keeps them.
  void prepare_gradients(Gradients<T>& g) const {
    if (gradients_fit(g)) return;
    const std::vector<ConstNamedBlock<T>> params = const_parameters();
    g.names.clear();
    g.params.resize(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      g.names.push_back(params[i].name);
      g.params[i].resize(params[i].rows, params[i].cols);
    }
    const char* weights[4] = {"w_q", "w_k", "w_v", "w_o"};
    for (std::size_t i = 0; i < 4; ++i) g.slot_w[i] = g.index_of(weights[i]);
    g.slot_head.assign(static_cast<std::size_t>(cfg_.heads), {0, 0, 0});
    for (Index h = 0; h < cfg_.heads; ++h) {
      const std::string prefix = ::mixattn::detail::concat("head", h, ".");
      std::array<std::size_t, 3>& slot = g.slot_head[static_cast<std::size_t>(h)];
      if (cfg_.mixer == MixerKind::gma) {
        slot = {g.index_of(prefix + "mean"), g.index_of(prefix + "var_raw"),
                g.index_of(prefix + "prior_logit")};
      } else if (cfg_.mixer == MixerKind::ovq) {
        slot[0] = g.index_of(prefix + "beta");
      } else if (cfg_.mixer == MixerKind::vq) {
        slot[0] = g.index_of(prefix + "codebook");
      }
    }
  }

  /// Whether g's blocks were set up for this layer's parameters (count and every slot's shape).
  bool gradients_fit(const Gradients<T>& g) const {
    const std::size_t per_head = cfg_.mixer == MixerKind::gma   ? 3
                                 : cfg_.mixer == MixerKind::ovq ? 1
                                 : cfg_.mixer == MixerKind::vq  ? 1
                                                                : 0;
    const std::size_t hs = static_cast<std::size_t>(cfg_.heads);
    if (g.params.size() != 4 + per_head * hs || g.names.size() != g.params.size() ||
        g.slot_head.size() != hs)
      return false;
    const auto fits = [&](std::size_t slot, Index rows, Index cols) {
      return slot < g.params.size() && g.params[slot].rows() == rows &&
             g.params[slot].cols() == cols;
    };
    const Matrix<T>* w[4] = {&w_q_, &w_k_, &w_v_, &w_o_};
    for (std::size_t i = 0; i < 4; ++i)
      if (!fits(g.slot_w[i], w[i]->rows(), w[i]->cols())) return false;
    for (std::size_t h = 0; h < hs && cfg_.mixer == MixerKind::gma; ++h)
      if (!fits(g.slot_head[h][0], mixtures_[h].mean.rows(), mixtures_[h].mean.cols()) ||
          !fits(g.slot_head[h][1], mixtures_[h].var_raw.rows(), mixtures_[h].var_raw.cols()) ||
          !fits(g.slot_head[h][2], mixtures_[h].prior_logit.size(), 1))
        return false;
    for (std::size_t h = 0; h < hs && cfg_.mixer == MixerKind::ovq; ++h)
      if (!fits(g.slot_head[h][0], 1, 1)) return false;
    for (std::size_t h = 0; h < hs && cfg_.mixer == MixerKind::vq; ++h)
      if (!fits(g.slot_head[h][0], codebooks_[h].rows(), codebooks_[h].cols())) return false;
    return true;
  }

  void run_backward(const char* fn, Gradients<T>& g, const ConstMatrixRef<T>& x,
                    const ConstMatrixRef<T>& grad_y, const Cache<T>& cache) const {
    check_backward(fn, x, grad_y, cache);
    using ::mixattn::detail::plain;
    using ::mixattn::detail::transposed;
    const Index n = x.rows(), heads = cfg_.heads, r = cfg_.key_dim, d_v = cfg_.value_dim;
    prepare_gradients(g);
    // Y = M W_O: dW_O = Mᵀ dY (one task: its depth is N), dM = dY W_Oᵀ (row blocks).
    constexpr Index block = ::mixattn::detail::gemm_task_rows;
    g.d_mixed.resize(n, heads * d_v);
    g.gemm.clear();
    g.gemm.add(g.params[g.slot_w[3]], {transposed<T>(cache.mixed)}, {plain<T>(grad_y)}, T(1), false,
               0);
    g.gemm.add(g.d_mixed, {plain<T>(grad_y)}, {transposed<T>(w_o_)}, T(1), false, block);
    g.gemm.run(cfg_.threads);
    if (cfg_.check_finite)
      ::mixattn::detail::require_finite_result(g.d_mixed, fn, "the heads' output gradient dY W_O^T",
                                               "grad_y or w_o is");
    g.dq.resize(n, heads * r);
    g.dk.resize(n, heads * r);
    g.dv.resize(n, heads * d_v);
    const Index items = (static_cast<Index>(cache.offsets.size()) - 1) * heads;
    const std::size_t is = static_cast<std::size_t>(items);
    g.gma_grads.resize(cfg_.mixer == MixerKind::gma ? is : 0);
    g.ovq_grads.resize(cfg_.mixer == MixerKind::ovq ? is : 0);
    g.softmax_grads.resize(cfg_.mixer == MixerKind::softmax ? is : 0);
    g.linear_grads.resize(cfg_.mixer == MixerKind::linear ? is : 0);
    g.performer_grads.resize(cfg_.mixer == MixerKind::performer ? is : 0);
    g.vq_grads.resize(cfg_.mixer == MixerKind::vq ? is : 0);
    ::mixattn::detail::parallel_largest_first(
        items, cfg_.threads, [&](Index i) { return sequence_length(cache.offsets, i); },
        [&](Index i) { head_backward(g, cache, i); }, g.order);
    sum_parameter_gradients(g, items);
    // Q = X W_Q etc.: dW = Xᵀ dQ (one task each), dX = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ (row
    // blocks, the three terms in this order).
    g.x.resize(n, cfg_.model_dim);
    g.gemm.clear();
    g.gemm.add(g.params[g.slot_w[0]], {transposed<T>(x)}, {plain<T>(g.dq)}, T(1), false, 0);
    g.gemm.add(g.params[g.slot_w[1]], {transposed<T>(x)}, {plain<T>(g.dk)}, T(1), false, 0);
    g.gemm.add(g.params[g.slot_w[2]], {transposed<T>(x)}, {plain<T>(g.dv)}, T(1), false, 0);
    g.gemm.add(g.x, {plain<T>(g.dq), plain<T>(g.dk), plain<T>(g.dv)},
               {transposed<T>(w_q_), transposed<T>(w_k_), transposed<T>(w_v_)}, T(1), false, block);
    g.gemm.run(cfg_.threads);
    if (cfg_.check_finite) {
      const char* culprit = "x, grad_y or a parameter is";
      ::mixattn::detail::require_finite_result(g.x, fn, "the gradient of x", culprit);
      for (std::size_t i = 0; i < g.params.size(); ++i)
        ::mixattn::detail::require_finite_result(g.params[i], fn, "a parameter's gradient",
                                                 culprit);
    }
  }

  /// The backward of item i = b H + h into its own record and its rows of dQ, dK, dV.
  void head_backward(Gradients<T>& g, const Cache<T>& cache, Index item) const {
    const Index r = cfg_.key_dim, d_v = cfg_.value_dim, h = item % cfg_.heads;
    const std::size_t i = static_cast<std::size_t>(item), hi = static_cast<std::size_t>(h);
    const Index t0 = cache.offsets[static_cast<std::size_t>(item / cfg_.heads)];
    const Index n = sequence_length(cache.offsets, item);
    const ConstMatrixRef<T> qh = cache.q.block(t0, h * r, n, r);
    const ConstMatrixRef<T> kh = cache.k.block(t0, h * r, n, r);
    const ConstMatrixRef<T> vh = cache.v.block(t0, h * d_v, n, d_v);
    const ConstMatrixRef<T> doh = g.d_mixed.block(t0, h * d_v, n, d_v);
    const Matrix<T>*gq = nullptr, *gk = nullptr, *gv = nullptr;
    switch (cfg_.mixer) {
      case MixerKind::gma: {
        gma::Grad<T>& gh = g.gma_grads[i];
        gma::backward_into(gh, mixtures_[hi], qh, kh, vh, doh, cache.gma_saved[i], gma_options());
        gq = &gh.q, gk = &gh.k, gv = &gh.v;
        break;
      }
      case MixerKind::ovq: {
        ovq::Grad<T>& gh = g.ovq_grads[i];
        ovq::backward_into(gh, qh, kh, vh, beta_[h], doh, cache.ovq_saved[i], cfg_.ovq);
        gq = &gh.q, gk = &gh.k, gv = &gh.v;
        break;
      }
      case MixerKind::softmax: {
        reference::Grad<T>& gh = g.softmax_grads[i];
        reference::flash_backward_into<T>(gh, qh, kh, vh, doh, cache.softmax_saved[i],
                                          softmax_options());
        gq = &gh.q, gk = &gh.k, gv = &gh.v;
        break;
      }
      case MixerKind::linear: {
        linear::Grad<T>& gh = g.linear_grads[i];
        linear::backward_into<T>(gh, qh, kh, vh, doh, cache.linear_saved[i], linear_options());
        gq = &gh.q, gk = &gh.k, gv = &gh.v;
        break;
      }
      case MixerKind::performer: {
        performer::Grad<T>& gh = g.performer_grads[i];
        performer::backward_into<T>(gh, qh, kh, vh, doh, features_[hi], cache.performer_saved[i],
                                    performer_options());
        gq = &gh.q, gk = &gh.k, gv = &gh.v;
        break;
      }
      case MixerKind::vq: {  // dk is the straight-through gradient (SPEC 6.3)
        vq::Grad<T>& gh = g.vq_grads[i];
        vq::backward_into<T>(gh, qh, kh, vh, codebooks_[hi], doh, cache.vq_saved[i], vq_options());
        gq = &gh.q, gk = &gh.k, gv = &gh.v;
        break;
      }
    }
    g.dq.block(t0, h * r, n, r) = *gq;
    g.dk.block(t0, h * r, n, r) = *gk;
    g.dv.block(t0, h * d_v, n, d_v) = *gv;
    if (cfg_.rope) {  // the mixer saw R q and R k: dq = R^T d(Rq), dk = R^T d(Rk) (SPEC 8.2)
      const rope::Options ro = rope_options();
      rope::backward_in_place<T>(g.dq.block(t0, h * r, n, r), 0, ro);
      rope::backward_in_place<T>(g.dk.block(t0, h * r, n, r), 0, ro);
    }
  }

  /// Per-head parameters' gradients: the items' summed in sequence order.
  void sum_parameter_gradients(Gradients<T>& g, Index items) const {
    const Index heads = cfg_.heads;
    for (Index h = 0; h < heads; ++h)
      for (Index item = h; item < items; item += heads) {
        const std::size_t i = static_cast<std::size_t>(item), hi = static_cast<std::size_t>(h);
        const bool first = item == h;
        const std::array<std::size_t, 3>& slot = g.slot_head[hi];
        if (cfg_.mixer == MixerKind::gma) {
          const gma::MixtureGrad<T>& m = g.gma_grads[i].mixture;
          if (first) {
            g.params[slot[0]] = m.mean;
            g.params[slot[1]] = m.var_raw;
            g.params[slot[2]] = m.prior_logit;
          } else {
            g.params[slot[0]] += m.mean;
            g.params[slot[1]] += m.var_raw;
            g.params[slot[2]] += m.prior_logit;
          }
        } else if (cfg_.mixer == MixerKind::ovq) {
          T& dbeta = g.params[slot[0]](0, 0);
          dbeta = first ? g.ovq_grads[i].beta : dbeta + g.ovq_grads[i].beta;
        } else if (cfg_.mixer == MixerKind::vq) {
          if (first)
            g.params[slot[0]] = g.vq_grads[i].codebook;
          else
            g.params[slot[0]] += g.vq_grads[i].codebook;
        }
      }
  }

  void validate_config() const {
    constexpr const char* fn = "mixattn::layer::MultiHeadAttention";
    using ::mixattn::detail::require;
    require(cfg_.model_dim >= 1, fn, "config.model_dim must be >= 1, got ", cfg_.model_dim);
    require(cfg_.heads >= 1, fn, "config.heads must be >= 1, got ", cfg_.heads);
    require(cfg_.key_dim >= 1, fn, "config.key_dim must be >= 1, got ", cfg_.key_dim);
    require(cfg_.value_dim >= 1, fn, "config.value_dim must be >= 1, got ", cfg_.value_dim);
    require(cfg_.threads >= 0, fn, "config.threads must be >= 0, got ", cfg_.threads);
    require(cfg_.mixer != MixerKind::gma || cfg_.components >= 1, fn,
            "config.components must be >= 1 for GMA, got ", cfg_.components);
    require(cfg_.mixer != MixerKind::ovq || cfg_.causal, fn,
            "OVQ attention is causal: set config.causal = true");
    require(std::isfinite(cfg_.gma_mean_scale), fn, "config.gma_mean_scale must be finite, got ",
            cfg_.gma_mean_scale);
    if (cfg_.rope) {  // SPEC 8.3, before any call
      require(cfg_.key_dim % 2 == 0, fn, "config.key_dim is ", cfg_.key_dim,
              ": config.rope rotates column pairs (2i, 2i + 1) and needs an even key_dim");
      ::mixattn::detail::rope_check_base(fn, "config.rope_options.base", cfg_.rope_options.base);
      // theta_i itself finite (a position's angle p theta_i is checked per call, p unknown here)
      ::mixattn::detail::rope_check_angles(fn, "config.rope_options.base", cfg_.rope_options.base,
                                           cfg_.key_dim, 0);
    }
    // The baselines' own options are checked here too, naming the field, before any call.
    const auto check_eps = [&](const char* field, double eps) {
      require(eps > 0 && std::isfinite(eps) && std::isfinite(static_cast<T>(eps)) &&
                  static_cast<T>(eps) > 0,
              fn, "config.", field, ".eps must be > 0 and finite in the scalar type, got ", eps);
    };
    const auto check_scale = [&](const char* field, double scale) {
      require(scale >= 0 && std::isfinite(scale) && std::isfinite(static_cast<T>(scale)), fn,
              "config.", field, ".scale must be >= 0 and finite (0: the default), got ", scale);
    };
    const auto check_chunk = [&](const char* field, Index chunk) {
      require(chunk >= 0, fn, "config.", field, ".chunk must be >= 0 (0: the default), got ",
              chunk);
    };
    if (cfg_.mixer == MixerKind::linear) {
      check_eps("linear", cfg_.linear.eps);
      check_chunk("linear", cfg_.linear.chunk);
    } else if (cfg_.mixer == MixerKind::performer) {
      check_eps("performer", cfg_.performer.eps);
      check_chunk("performer", cfg_.performer.chunk);
      check_scale("performer", cfg_.performer.scale);
      require(cfg_.features >= 1, fn, "config.features must be >= 1 for Performer, got ",
              cfg_.features);
    } else if (cfg_.mixer == MixerKind::vq) {
      check_eps("vq", cfg_.vq.eps);
      check_chunk("vq", cfg_.vq.chunk);
      check_scale("vq", cfg_.vq.scale);
      require(cfg_.codes >= 1, fn, "config.codes must be >= 1 for VQ, got ", cfg_.codes);
      require(cfg_.codebook_scale > 0 && std::isfinite(cfg_.codebook_scale), fn,
              "config.codebook_scale must be > 0 and finite, got ", cfg_.codebook_scale);
    }
  }

  /// Whether the mixer keeps a streaming state (begin_decoding / decode).
  bool decodes() const {
    return cfg_.mixer == MixerKind::gma || cfg_.mixer == MixerKind::ovq ||
           cfg_.mixer == MixerKind::softmax;
  }

  /// How many per-(sequence, head) records of this layer's mixer the cache holds.
  std::size_t saved_records(const Cache<T>& cache) const {
    switch (cfg_.mixer) {
      case MixerKind::gma:
        return cache.gma_saved.size();
      case MixerKind::ovq:
        return cache.ovq_saved.size();
      case MixerKind::softmax:
        return cache.softmax_saved.size();
      case MixerKind::linear:
        return cache.linear_saved.size();
      case MixerKind::performer:
        return cache.performer_saved.size();
      case MixerKind::vq:
        return cache.vq_saved.size();
    }
    return 0;
  }

  /// Index of head h of a layer of mixer `kind` (features, codebook accessors).
  std::size_t kind_head(MixerKind kind, Index h, const char* fn) const {
    ::mixattn::detail::require(cfg_.mixer == kind && h >= 0 && h < cfg_.heads, fn,
                               "exists for heads 0..H-1 of a ", mixer_name(kind),
                               " layer; asked for head ", h, " of a ", mixer_name(cfg_.mixer),
                               " layer of ", cfg_.heads, " heads");
    return static_cast<std::size_t>(h);
  }

  /// With checks on, projections of finite x that overflowed T are reported (naming them), not
  /// handed to the heads, which would blame q, k or v.
  void check_projections(const char* fn, const Matrix<T>& q, const Matrix<T>& k,
                         const Matrix<T>& v) const {
    if (!cfg_.check_finite) return;
    const char* culprit = "x or a projection weight is";
    ::mixattn::detail::require_finite_result(q, fn, "the queries x W_Q", culprit);
    ::mixattn::detail::require_finite_result(k, fn, "the keys x W_K", culprit);
    ::mixattn::detail::require_finite_result(v, fn, "the values x W_V", culprit);
  }

  void check_input(const char* fn, const ConstMatrixRef<T>& x) const {
    ::mixattn::detail::require(x.rows() >= 1 && x.cols() == cfg_.model_dim, fn, "x is ",
                               ::mixattn::detail::shape_str(x), " but the layer needs N x ",
                               cfg_.model_dim, " with N >= 1");
    if (cfg_.check_finite) ::mixattn::detail::require_finite(x, fn, "x");
  }

  std::size_t checked_head(Index h, const char* what) const {
    ::mixattn::detail::require(cfg_.mixer == MixerKind::ovq && h >= 0 && h < cfg_.heads,
                               "mixattn::layer::MultiHeadAttention::beta", what,
                               " exists for heads 0..H-1 of an OVQ layer; asked for head ", h);
    return static_cast<std::size_t>(h);
  }

  /// Fingerprint of every parameter, in const_parameters() order (without building the list:
  /// forward and backward take it on every call).
  std::uint64_t parameter_fingerprint() const {
    ::mixattn::detail::Fingerprint f;
    f.add(w_q_.data(), w_q_.rows(), w_q_.cols(), w_q_.cols());
    f.add(w_k_.data(), w_k_.rows(), w_k_.cols(), w_k_.cols());
    f.add(w_v_.data(), w_v_.rows(), w_v_.cols(), w_v_.cols());
    f.add(w_o_.data(), w_o_.rows(), w_o_.cols(), w_o_.cols());
    for (Index h = 0; h < cfg_.heads; ++h) {
      if (cfg_.mixer == MixerKind::gma) {
        const gma::Mixture<T>& m = mixtures_[static_cast<std::size_t>(h)];
        f.add(m.mean.data(), m.mean.rows(), m.mean.cols(), m.mean.cols());
        f.add(m.var_raw.data(), m.var_raw.rows(), m.var_raw.cols(), m.var_raw.cols());
        f.add(m.prior_logit.data(), m.prior_logit.size(), 1, 1);
      } else if (cfg_.mixer == MixerKind::ovq) {
        f.add(beta_.data() + h, 1, 1, 1);
      } else if (cfg_.mixer == MixerKind::vq) {
        const Matrix<T>& c = codebooks_[static_cast<std::size_t>(h)];
        f.add(c.data(), c.rows(), c.cols(), c.cols());
      }
    }
    return f.value();
  }

  /// A mixer's options with the layer's causality (Config::causal decides for every mixer).
  template <class O>
  O with_layer_causality(O o) const {
    o.causal = cfg_.causal;
    return o;
  }
  gma::Options gma_options() const { return with_layer_causality(cfg_.gma); }
  reference::Options softmax_options() const { return with_layer_causality(cfg_.softmax); }
  linear::Options linear_options() const { return with_layer_causality(cfg_.linear); }
  performer::Options performer_options() const { return with_layer_causality(cfg_.performer); }
  vq::Options vq_options() const { return with_layer_causality(cfg_.vq); }
  rope::Options rope_options() const {  // check_finite follows the layer's
    rope::Options o = cfg_.rope_options;
    o.check_finite = cfg_.check_finite;
    return o;
  }

  Matrix<T> head_responsibilities(const char* name, const ConstMatrixRef<T>& x, Index h,
                                  const Matrix<T>& w) const {
    const std::string fn = ::mixattn::detail::concat("mixattn::layer::MultiHeadAttention::", name);
    ::mixattn::detail::require(cfg_.mixer == MixerKind::gma, fn.c_str(),
                               "responsibilities exist only for GMA layers");
    ::mixattn::detail::require(h >= 0 && h < cfg_.heads, fn.c_str(), "head ", h,
                               " is out of range [0, ", cfg_.heads, ")");
    check_input(fn.c_str(), x);
    Matrix<T> proj(x.rows(), cfg_.key_dim);
    proj.noalias() = x * w.middleCols(h * cfg_.key_dim, cfg_.key_dim);
    return gma::responsibilities(mixtures_[static_cast<std::size_t>(h)], proj);
  }

  static Matrix<T> gaussian(Index rows, Index cols, double stddev, std::mt19937_64& rng) {
    std::normal_distribution<double> dist(0.0, stddev);
    Matrix<T> m(rows, cols);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(dist(rng));
    return m;
  }

  Config cfg_;
  Matrix<T> w_q_, w_k_, w_v_, w_o_;
  std::vector<gma::Mixture<T>> mixtures_;         // GMA: one per head
  Vector<T> beta_;                                // OVQ: one per head
  std::vector<performer::Features<T>> features_;  // Performer: one per head (constant)
  std::vector<Matrix<T>> codebooks_;              // VQ: one per head
};

#ifdef MIXATTN_TEMPLATE_INSTANCE
// Every member of the layer, at the default instruction set (core.hpp: compiling the operators
// once). The members are defined in the class, so without this each file that uses the layer
// compiles all of them again, most of such a file's compile time with g++ -O2.
MIXATTN_TEMPLATE_INSTANCE class MultiHeadAttention<float>;
MIXATTN_TEMPLATE_INSTANCE class MultiHeadAttention<double>;
#endif

}  // namespace layer
MIXATTN_END_NAMESPACE
