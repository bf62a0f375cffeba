// A soak run: many training steps of one small layer through the caller-owned forms
// (forward_into / backward_into) and Adam, with the process's resident memory sampled from
// /proc/self/statm. Every record is reused, so after the first steps the resident set must stay
// flat: growth there is a leak or a record that reallocates. Not a unit test (a long run), not
// a timing: the numbers are pages, whatever the machine's load.
//
//   example_soak [--steps N] [--every M] [--warmup W] [--mixer gma|ovq|softmax|linear|performer|vq]
//
// Defaults: 100 000 steps of a causal GMA layer (T = 64, d_model = 32, 4 heads of r = d_v = 8,
// K = 16), a sample every 1 000 steps, the first 10 000 steps warm-up. Prints every sample,
// then the minimum and maximum after warm-up; exits 1 unless they are within `flat_bytes` and
// the loss stayed finite.
#include <mixattn/adam.hpp>
#include <mixattn/layer.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using mixattn::Index;
using Mat = mixattn::Matrix<float>;
namespace layer = mixattn::layer;

// Allocator noise (a page or two of malloc's arenas, the pool's first use) is not growth; a
// leak of even one small record per step is 100 000 records, megabytes.
constexpr long flat_bytes = 256 * 1024;

long resident_bytes() {
  long size = 0, resident = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &size, &resident) != 2) resident = -1;
    std::fclose(f);
  }
  return resident * ::sysconf(_SC_PAGESIZE);
}

struct Args {
  long steps = 100000, every = 1000, warmup = 10000;
  layer::MixerKind mixer = layer::MixerKind::gma;
};

bool parse(int argc, char** argv, Args& a) {
  const char* names[] = {"gma", "ovq", "softmax", "linear", "performer", "vq"};
  const layer::MixerKind kinds[] = {layer::MixerKind::gma,       layer::MixerKind::ovq,
                                    layer::MixerKind::softmax,   layer::MixerKind::linear,
                                    layer::MixerKind::performer, layer::MixerKind::vq};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--steps")
      a.steps = std::atol(value.c_str());
    else if (flag == "--every")
      a.every = std::atol(value.c_str());
    else if (flag == "--warmup")
      a.warmup = std::atol(value.c_str());
    else if (flag == "--mixer") {
      const auto* it = std::find(std::begin(names), std::end(names), value);
      if (it == std::end(names)) return false;
      a.mixer = kinds[it - std::begin(names)];
    } else {
      return false;
    }
  }
  return argc % 2 == 1 && a.steps >= 1 && a.every >= 1 && a.warmup >= 0;
}

layer::Config soak_config(layer::MixerKind mixer) {
  layer::Config cfg;
  cfg.model_dim = 32;
  cfg.heads = 4;
  cfg.key_dim = 8;
  cfg.value_dim = 8;
  cfg.mixer = mixer;
  cfg.causal = true;
  cfg.components = 16;
  cfg.codes = 16;
  cfg.features = 16;
  cfg.threads = 1;
  cfg.seed = 7;
  return cfg;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!parse(argc, argv, args)) {
    std::fprintf(stderr,
                 "usage: example_soak [--steps N] [--every M] [--warmup W] "
                 "[--mixer gma|ovq|softmax|linear|performer|vq]\n");
    return 2;
  }
  const Index tokens = 64;
  layer::MultiHeadAttention<float> attn(soak_config(args.mixer));
  mixattn::optim::AdamOptions opt;
  opt.lr = 1e-3;
  opt.clip_norm = 1;
  mixattn::optim::Adam<float> adam(attn.parameters(), opt);
  // Eight inputs and targets, cycled: a regression of Y onto a fixed random map of X.
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<Mat> xs(8, Mat(tokens, 32)), targets(8);
  const Mat map = Mat::NullaryExpr(32, 32, [&] { return normal(rng) / std::sqrt(32.f); });
  for (std::size_t i = 0; i < xs.size(); ++i) {
    xs[i] = Mat::NullaryExpr(tokens, 32, [&] { return normal(rng); });
    targets[i] = xs[i] * map;
  }
  Mat y, dy;
  layer::Cache<float> cache;
  layer::Gradients<float> grads;
  std::vector<layer::NamedBlock<float>> grad_blocks;
  long rss_min = -1, rss_max = -1, rss_first = -1, rss_last = -1;
  double first_loss = 0, loss = 0;
  for (long step = 1; step <= args.steps; ++step) {
    const std::size_t i = static_cast<std::size_t>(step) % xs.size();
    attn.forward_into(y, xs[i], cache);
    dy = (y - targets[i]) / static_cast<float>(tokens);
    loss = 0.5 * static_cast<double>((y - targets[i]).squaredNorm()) / tokens;
    attn.backward_into(grads, xs[i], dy, cache);
    if (grad_blocks.empty()) grad_blocks = grads.blocks();  // views stay valid: shapes repeat
    adam.step(grad_blocks);
    if (step == 1) first_loss = loss;
    if (step % args.every != 0) continue;
    const long rss = resident_bytes();
    std::printf("step %7ld  loss %.5f  resident %8.1f KiB\n", step, loss, rss / 1024.0);
    if (step <= args.warmup) continue;
    rss_min = rss_min < 0 ? rss : std::min(rss_min, rss);
    rss_max = std::max(rss_max, rss);
    if (rss_first < 0) rss_first = rss;
    rss_last = rss;
  }
  const bool finite = std::isfinite(loss);
  const bool flat = rss_min >= 0 && rss_max - rss_min <= flat_bytes;
  std::printf("mixer %s, %ld steps, loss %.5f -> %.5f\n", layer::mixer_name(args.mixer), args.steps,
              first_loss, loss);
  if (rss_min < 0) {
    std::printf("no sample after the %ld warm-up steps\n", args.warmup);
    return 1;
  }
  std::printf(
      "resident after warm-up (step > %ld): min %.1f KiB, max %.1f KiB, first %.1f KiB, "
      "last %.1f KiB: %s (max - min = %ld bytes, allowed %ld)\n",
      args.warmup, rss_min / 1024.0, rss_max / 1024.0, rss_first / 1024.0, rss_last / 1024.0,
      flat ? "flat" : "NOT FLAT", rss_max - rss_min, flat_bytes);
  return flat && finite ? 0 : 1;
}
