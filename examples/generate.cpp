// Generation with a causal attention layer, one token at a time.
//
// For each mixer (causal GMA, OVQ, exact softmax with a key/value cache) this builds one
// layer::MultiHeadAttention, feeds a prompt in one piece, then generates tokens autoregressively:
// each new input is the previous output, normalised. It prints the per-token latency (mean, p99
// and max, and the mean around a few positions): constant for GMA and OVQ, whose per-sequence
// state has a fixed size, growing with the position for softmax, whose cache does not.
// Finally it checks that the generated outputs equal one forward() over the whole sequence.
//
//   example_generate [tokens]   (default 4096 generated tokens after a 64-token prompt)
#include <mixattn/layer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace layer = mixattn::layer;

struct Run {
  double max_error = 0;
  bool ok = false;
};

Run generate(const char* name, layer::MixerKind mixer, Index prompt_len, Index tokens) {
  layer::Config cfg;
  cfg.model_dim = 128;
  cfg.heads = 2;
  cfg.key_dim = 64;
  cfg.value_dim = 64;
  cfg.mixer = mixer;
  cfg.causal = true;
  cfg.components = 64;
  cfg.seed = 5;
  const layer::MultiHeadAttention<float> mha(cfg);

  const Index total = prompt_len + tokens;
  Matrix<float> x(total, cfg.model_dim);  // the inputs, filled as they are generated
  x.topRows(prompt_len) = Matrix<float>::Random(prompt_len, cfg.model_dim);
  Matrix<float> y(total, cfg.model_dim);

  layer::DecodeState<float> st = mha.begin_decoding(total);
  y.topRows(prompt_len) = mha.decode(x.topRows(prompt_len), st);  // the prompt in one piece
  std::vector<double> us(static_cast<std::size_t>(tokens));
  for (Index t = prompt_len; t < total; ++t) {
    x.row(t) = y.row(t - 1) / (y.row(t - 1).norm() + 1e-6f) *
               std::sqrt(static_cast<float>(cfg.model_dim));  // feed the output back
    const auto a = std::chrono::steady_clock::now();
    y.row(t) = mha.decode(x.row(t), st);
    const auto b = std::chrono::steady_clock::now();
    us[static_cast<std::size_t>(t - prompt_len)] =
        std::chrono::duration<double, std::micro>(b - a).count();
  }

  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  double mean = 0;
  for (const double u : us) mean += u;
  mean /= static_cast<double>(us.size());
  std::printf("%-12s mean %8.1f us  p99 %8.1f us  max %8.1f us  per token (2 heads);", name, mean,
              sorted[sorted.size() * 99 / 100], sorted.back());
  for (Index p = 1024; p <= tokens; p *= 4) {  // mean of the 64 tokens before position p
    double m = 0;
    for (Index i = p - 64; i < p; ++i) m += us[static_cast<std::size_t>(i)];
    std::printf("  @%ld: %.1f", static_cast<long>(p), m / 64);
  }
  std::printf("\n");

  // The same sequence in one call: generation changed nothing but the schedule.
  const Matrix<float> whole = mha.forward(x);
  Run r;
  r.max_error = (whole - y).cwiseAbs().maxCoeff() / std::max(1.0f, whole.cwiseAbs().maxCoeff());
  r.ok = r.max_error < 1e-3;  // float, sums reordered over up to ~4k terms
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Index tokens = argc > 1 ? std::atol(argv[1]) : 4096;
  if (tokens < 1024) {
    std::fprintf(stderr, "example_generate: need at least 1024 tokens\n");
    return 2;
  }
  std::printf("generating %ld tokens after a 64-token prompt, d_model 128, 2 heads of 64\n",
              static_cast<long>(tokens));
  bool ok = true;
  const struct {
    const char* name;
    layer::MixerKind mixer;
  } mixers[] = {{"causal GMA", layer::MixerKind::gma},
                {"OVQ", layer::MixerKind::ovq},
                {"softmax+KV", layer::MixerKind::softmax}};
  for (const auto& m : mixers) {
    const Run r = generate(m.name, m.mixer, 64, tokens);
    std::printf("%-12s generated = one forward: max relative difference %.2e %s\n", m.name,
                r.max_error, r.ok ? "(ok)" : "(MISMATCH)");
    ok = ok && r.ok;
  }
  return ok ? 0 : 1;
}
