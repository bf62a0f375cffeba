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
//     attention (SPEC §6) with its own learned codebook per head;
//   - the gated delta rule (SPEC §9, Gated DeltaNet), always causal, with its own gate
//     parameters per head (its gates computed from the head's keys, layer/mixers/delta.hpp).
// Causal softmax heads take a sliding window (Config::softmax.window, SPEC §7). With
// Config::rope, every head's Q_h and K_h are rotated by RoPE (SPEC §8.4) before its mixer, row n
// of each sequence at position n: the local sliding-window layers of OVQ's hybrid models.
//
// Causal layers also decode: begin_decoding() makes one sequence's DecodeState (a gma::State,
// ovq::State, softmax KvCache or delta::State per head) and decode(x, state) takes the next
// token(s), giving the rows forward() would give over the whole sequence.
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
#include "mixattn/layer/body.hpp"
#include "mixattn/layer/config.hpp"
#include "mixattn/layer/mixer.hpp"
#include "mixattn/layer/table.hpp"
#include "mixattn/layer/types.hpp"
#include "mixattn/layer_io.hpp"
#include "mixattn/named_block.hpp"
#include "mixattn/packed.hpp"
#include "mixattn/parallel.hpp"
#include "mixattn/rope.hpp"

#include <cmath>
#include <random>
#include <string>
#include <vector>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

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
/// The heads' mixer is one detail::Mixer (mixattn/layer/mixers/), made from its entry in the
/// mixer table: the layer runs it through that interface and names none. What one mixer adds
/// (mixture(h), beta(h), features(h), codebook(h), delta_gates(h), the responsibilities) comes
/// from that mixer's accessors, from which the layer derives (layer/table.hpp).
template <class T>
class MultiHeadAttention : public ::mixattn::detail::MixerAccessors<MultiHeadAttention<T>, T> {
  static_assert(::mixattn::detail::refuse_arguments<T>(), "see the message above");

 public:
  explicit MultiHeadAttention(const Config& config) {
    p_.cfg = config;
    ::mixattn::detail::check_layer_config<T>(p_.cfg);
    const Index h = p_.cfg.heads, r = p_.cfg.key_dim, d_v = p_.cfg.value_dim, d = p_.cfg.model_dim;
    using ::mixattn::detail::gaussian_matrix;
    std::mt19937_64 rng(p_.cfg.seed);
    const double in_sd = 1.0 / std::sqrt(static_cast<double>(d));
    p_.w_q = gaussian_matrix<T>(d, h * r, in_sd, rng);
    p_.w_k = gaussian_matrix<T>(d, h * r, in_sd, rng);
    p_.w_v = gaussian_matrix<T>(d, h * d_v, in_sd, rng);
    p_.w_o = gaussian_matrix<T>(h * d_v, d, 1.0 / std::sqrt(static_cast<double>(h * d_v)), rng);
    p_.mixer = ::mixattn::detail::Cloned<::mixattn::detail::Mixer<T>>(
        ::mixattn::detail::make_mixer<T>(p_.cfg));
  }

  const Config& config() const { return p_.cfg; }
  /// Threads over heads for later calls (0: all cores).
  void set_threads(int threads) {
    ::mixattn::detail::require(threads >= 0, "mixattn::layer::MultiHeadAttention::set_threads",
                               "threads must be >= 0, got ", threads);
    p_.cfg.threads = threads;
  }

  Matrix<T>& w_q() { return p_.w_q; }
  Matrix<T>& w_k() { return p_.w_k; }
  Matrix<T>& w_v() { return p_.w_v; }
  Matrix<T>& w_o() { return p_.w_o; }
  const Matrix<T>& w_q() const { return p_.w_q; }
  const Matrix<T>& w_k() const { return p_.w_k; }
  const Matrix<T>& w_v() const { return p_.w_v; }
  const Matrix<T>& w_o() const { return p_.w_o; }
  /// The heads' mixer, and the mixer as the type M (layer/mixers/) or nullptr for another:
  /// what the mixers' own accessors are built on.
  const ::mixattn::detail::Mixer<T>& mixer() const { return *p_.mixer.operator->(); }
  template <class M>
  M* mixer_as() const {
    return p_.mixer.template as<M>();
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
    return ::mixattn::detail::layer_parameters(p_);
  }

  /// Total number of scalar parameters.
  Index parameter_count() const {
    Index n = 0;
    for (const ConstNamedBlock<T>& b : const_parameters()) n += b.rows * b.cols;
    return n;
  }

  /// Y = concat_h(mixer_h(X W_Q, X W_K, X W_V)) W_O.  x: N x d_model (N >= 1); returns
  /// N x d_model. With a cache, fills it for backward; without, keeps nothing.
  Matrix<T> forward(const ConstMatrixArg<T>& x, Cache<T>* cache = nullptr) const {
    Matrix<T> y;
    Cache<T> local;
    Cache<T>& c = cache ? *cache : local;
    c.offsets.assign({0, x.rows()});
    ::mixattn::detail::layer_run_forward(p_, "mixattn::layer::MultiHeadAttention::forward", y, x, c,
                                         cache != nullptr);
    return y;
  }

  /// A fresh decoding state for one sequence (causal layers only: config.causal). Prepares
  /// every GMA head's mixture constants once. reserve_tokens: softmax layers reserve their
  /// key/value caches for that many tokens (no reallocation while decoding up to it).
  DecodeState<T> begin_decoding(Index reserve_tokens = 0) const {
    constexpr const char* fn = "mixattn::layer::MultiHeadAttention::begin_decoding";
    ::mixattn::detail::require(p_.cfg.causal, fn,
                               "decoding needs a causal layer: set config.causal = true");
    ::mixattn::detail::require(reserve_tokens >= 0, fn, "reserve_tokens is ", reserve_tokens,
                               ", must be >= 0");
    if (!p_.mixer->decodes())
      ::mixattn::detail::raise_invalid_argument(
          ::mixattn::detail::concat(fn, ": config.mixer is ", mixer_name(p_.cfg.mixer),
                                    ", which keeps no streaming state; decoding is provided for ",
                                    ::mixattn::detail::decoding_mixers()));
    DecodeState<T> st;
    st.layer = this;
    p_.mixer->begin_decoding(st.heads, p_.cfg.heads, reserve_tokens);
    return st;
  }

  /// The next n tokens of the sequence `state` has seen so far: x is n x d_model (n >= 1, one
  /// token when generating); returns n x d_model, the rows forward() would give for them over
  /// the whole sequence (up to rounding), and advances `state`. Per token and head the cost is
  /// O(K (r + d_v)) for GMA, O((N_max + C)(r + d_v)) for OVQ, O(t (r + d_v)) for softmax at
  /// position t, O(r d_v) for the gated delta rule. With config.rope the new rows are at positions
  /// state.tokens_seen onwards. A throw for x (shape, non-finite values, or projections that
  /// overflow T) leaves `state` unchanged; after any other (a mismatched state, a non-finite
  /// parameter, an output that overflowed T), begin_decoding() again.
  Matrix<T> decode(const ConstMatrixArg<T>& x, DecodeState<T>& state) const {
    constexpr const char* fn = "mixattn::layer::MultiHeadAttention::decode";
    ::mixattn::detail::check_layer_input<T>(p_.cfg, fn, x);
    ::mixattn::detail::require(
        p_.mixer->decodes() && state.layer == this &&
            p_.mixer->decoding_heads(state.heads) == static_cast<std::size_t>(p_.cfg.heads),
        fn, "state was not made by this layer's begin_decoding()");
    p_.mixer->check_decoding(fn, state.heads);
    const Index n = x.rows(), r = p_.cfg.key_dim, d_v = p_.cfg.value_dim;
    Matrix<T> q = x * p_.w_q, k = x * p_.w_k;
    const Matrix<T> v = x * p_.w_v;
    ::mixattn::detail::check_projections<T>(p_.cfg, fn, q, k, v);  // before any head's state moves
    if (p_.cfg.rope) {  // the new rows continue the sequence at position tokens_seen
      const rope::Options ro = ::mixattn::detail::layer_rope_options(p_.cfg);
      for (Index h = 0; h < p_.cfg.heads; ++h) {
        rope::apply_in_place<T>(q.middleCols(h * r, r), state.tokens_seen, ro);
        rope::apply_in_place<T>(k.middleCols(h * r, r), state.tokens_seen, ro);
      }
    }
    Matrix<T> mixed(n, p_.cfg.heads * d_v);
    const Offsets rows{0, n};
    parallel_for(p_.cfg.heads, p_.cfg.threads, [&](Index h) {
      auto out = mixed.middleCols(h * d_v, d_v);
      p_.mixer->decode(out, ::mixattn::detail::layer_item<T>(q, k, v, rows, p_.cfg.heads, h),
                       state.heads);
    });
    state.tokens_seen += n;
    Matrix<T> y(n, p_.cfg.model_dim);
    y.noalias() = mixed * p_.w_o;
    if (p_.cfg.check_finite)  // as forward: an overflowed projection is reported, never returned
      ::mixattn::detail::require_finite_result(y, fn, "the output", "x or a weight is");
    return y;
  }

  /// forward into a caller-owned y (resized to N x d_model) and cache (filled for backward);
  /// both keep their capacity, so with threads = 1 a training step whose shapes repeat
  /// performs no heap allocation.
  void forward_into(Matrix<T>& y, const ConstMatrixArg<T>& x, Cache<T>& cache) const {
    cache.offsets.assign({0, x.rows()});
    ::mixattn::detail::layer_run_forward(p_, "mixattn::layer::MultiHeadAttention::forward_into", y,
                                         x, cache, true);
  }

  /// A packed batch of B sequences (packed.hpp): x: total x d_model, sequence b = rows
  /// [offsets[b], offsets[b+1]); y: resized to total x d_model. The projections run once over
  /// all rows; the mixers run per (sequence, head) pair, largest first on Config::threads
  /// threads, each pair equal to the layer's forward on that sequence alone bit for bit.
  /// backward_into takes the same cache (it holds the offsets).
  void forward_packed_into(Matrix<T>& y, const ConstMatrixArg<T>& x, const Offsets& offsets,
                           Cache<T>& cache) const {
    constexpr const char* fn = "mixattn::layer::MultiHeadAttention::forward_packed_into";
    ::mixattn::detail::check_offsets(fn, "offsets", offsets, x.rows());
    for (std::size_t b = 0; b + 1 < offsets.size(); ++b)
      ::mixattn::detail::require(offsets[b + 1] > offsets[b], fn, "sequence ", b,
                                 " is empty; every sequence needs N >= 1");
    cache.offsets = offsets;
    ::mixattn::detail::layer_run_forward(p_, fn, y, x, cache, true);
  }

  /// Gradients of a scalar loss L given dY = ∂L/∂Y. x: N x d_model, the forward's input;
  /// grad_y: N x d_model; cache: filled by forward(x, &cache) with the current parameters.
  Gradients<T> backward(const ConstMatrixArg<T>& x, const ConstMatrixArg<T>& grad_y,
                        const Cache<T>& cache) const {
    Gradients<T> g;
    ::mixattn::detail::layer_run_backward(p_, "mixattn::layer::MultiHeadAttention::backward", g, x,
                                          grad_y, cache);
    return g;
  }

  /// backward into caller-owned gradients: names and blocks are filled once, matrices resized
  /// (no-op when shapes repeat) and the per-head records reused.
  void backward_into(Gradients<T>& g, const ConstMatrixArg<T>& x, const ConstMatrixArg<T>& grad_y,
                     const Cache<T>& cache) const {
    ::mixattn::detail::layer_run_backward(p_, "mixattn::layer::MultiHeadAttention::backward_into",
                                          g, x, grad_y, cache);
  }

  /// Writes every parameter to `path` (format: save_parameters).
  void save(const std::string& path) const { save_parameters<T>(path, const_parameters()); }
  /// Reads parameters saved by a layer of the same configuration (load_parameters); the layer
  /// is unchanged if the file does not match.
  void load(const std::string& path) { load_parameters<T>(path, parameters()); }

 private:
  ::mixattn::detail::LayerParts<T> p_;
};

#ifdef MIXATTN_TEMPLATE_INSTANCE
// Every member of the layer, at the default instruction set (core.hpp: compiling the operators
// once). The members are defined in the class, so without this each file that uses the layer
// compiles all of them again, most of such a file's compile time with g++ -O2.
#define MIXATTN_LAYER_INSTANCES(T) MIXATTN_TEMPLATE_INSTANCE class MultiHeadAttention<T>;
MIXATTN_FOR_EACH_SCALAR(MIXATTN_LAYER_INSTANCES)
#endif

}  // namespace layer

#ifdef MIXATTN_TEMPLATE_INSTANCE
// The members are defined in the class, hence inline, and an inline member is compiled where it
// is used even when its class is extern: what they call that makes every mixer (the mixer table)
// is listed here on its own.
#define MIXATTN_LAYER_MIXER_INSTANCES(T)                                                    \
  MIXATTN_TEMPLATE_INSTANCE void detail::check_layer_config<T>(const layer::Config&);      \
  MIXATTN_TEMPLATE_INSTANCE std::unique_ptr<detail::Mixer<T>> detail::make_mixer<T>(       \
      const layer::Config&);
MIXATTN_FOR_EACH_SCALAR(MIXATTN_LAYER_MIXER_INSTANCES)
#endif
MIXATTN_END_NAMESPACE
