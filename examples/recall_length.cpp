// In-context recall against sequence length: the OVQ paper's comparison at small scale.
//
// Multi-query associative recall (MQAR) with distractors. A sequence of L tokens opens with P
// key→value pairs; the rest is random filler tokens, among which Q queries repeat one of the P
// keys at random positions; at a query the model must predict the key's value. Queries sit
// anywhere after the pairs, so the distance to recall grows with L.
//
//   k3 v7 k0 v2 … k5 v5 | f2 f9 k0→v2 f1 … f4 k5→v5 f0 … (L tokens)
//
// Five two-layer models, trained the same way at L = --train-len (256), then scored at every
// length of --lengths (up to 4096) on held-out sequences:
//   softmax        softmax, softmax               (exact attention over the whole prefix)
//   ovq+window     window+RoPE, OVQ               (alternating layers, as OVQ's hybrids)
//   linear+window  window+RoPE, linear (elu + 1)
//   gma            causal GMA, causal GMA
//   vq             static-codebook VQ, static-codebook VQ
// "window" is causal softmax attention over the last --window tokens with rotary position
// embeddings on its queries and keys. The models have no absolute position embeddings (so they
// run at any length); every model embeds the previous token as well ("token shift"), which lets
// one attention layer bind a value to its key. Then, for the OVQ model, accuracy against the
// dictionary size N_max changed at test time (--dict-sizes), with the trained weights.
//
//   example_recall_length [--ci] [--steps N] [--batch B] [--train-len L] [--lengths a,b,...]
//                         [--pairs P] [--queries Q] [--keys K] [--values V] [--fillers F]
//                         [--dim D] [--heads H] [--window W] [--block C] [--dict N]
//                         [--dict-sizes a,b,...] [--components K] [--codes S] [--eval N]
//                         [--lr LR] [--log-every N] [--threads T] [--seed S] [--only NAME]
//                         [--out DIR [--force]] [--list-outputs]
//
// With --out writes DIR/recall_length.csv (model, length, accuracy) and, when the OVQ model is
// trained, DIR/recall_dict.csv (dictionary size, length, accuracy), named after the run:
// _<model> for --only, _<P>pairs for --pairs other than the default, _ci for --ci
// (recall_length_32pairs.csv for --pairs 32). An existing file is replaced only with --force;
// --list-outputs prints the paths and exits (examples/common.hpp: prepare_outputs). --ci: a
// seconds-long configuration that fails (exit 1) unless every model learned at the training
// length (held-out accuracy at least 3x chance); it does not check the ordering.
#include "common.hpp"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <sstream>

namespace {

using example::Index;
using example::Model;
using example::Tally;
namespace layer = mixattn::layer;

struct Task {
  int pairs = 8, queries = 16, keys = 64, values = 64, fillers = 16;
  int vocab() const { return keys + values + fillers; }

  // Tokens and per-position targets (-1: nothing asked) of one sequence of `len` tokens.
  void sample(std::mt19937_64& rng, int len, std::vector<int>& tokens,
              std::vector<int>& targets) const {
    std::vector<int> key_ids(static_cast<std::size_t>(keys));
    std::iota(key_ids.begin(), key_ids.end(), 0);
    std::shuffle(key_ids.begin(), key_ids.end(), rng);
    std::uniform_int_distribution<int> value(0, values - 1), which(0, pairs - 1),
        filler(0, fillers - 1);
    std::vector<int> bound(static_cast<std::size_t>(pairs));
    tokens.assign(static_cast<std::size_t>(len), 0);
    targets.assign(static_cast<std::size_t>(len), -1);
    for (int p = 0; p < pairs; ++p) {
      bound[static_cast<std::size_t>(p)] = keys + value(rng);
      tokens[static_cast<std::size_t>(2 * p)] = key_ids[static_cast<std::size_t>(p)];
      tokens[static_cast<std::size_t>(2 * p + 1)] = bound[static_cast<std::size_t>(p)];
    }
    std::vector<int> slots(static_cast<std::size_t>(len - 2 * pairs));
    std::iota(slots.begin(), slots.end(), 2 * pairs);
    std::shuffle(slots.begin(), slots.end(), rng);  // the first `queries` slots ask
    for (std::size_t s = 0; s < slots.size(); ++s) {
      const std::size_t at = static_cast<std::size_t>(slots[s]);
      if (s < static_cast<std::size_t>(queries)) {
        const std::size_t p = static_cast<std::size_t>(which(rng));
        tokens[at] = key_ids[p];
        targets[at] = bound[p];
      } else {
        tokens[at] = keys + values + filler(rng);
      }
    }
  }
};

std::vector<long> list_arg(int argc, char** argv, const char* name, const std::string& fallback) {
  std::stringstream in(example::string_arg(argc, argv, name, fallback));
  std::vector<long> out;
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(std::strtol(item.c_str(), nullptr, 10));
  return out;
}

struct Arch {
  const char* name;
  layer::MixerKind first, second;
  bool window_first;  // the first layer is a sliding-window + RoPE softmax layer
};

struct Settings {
  long steps, batch, train_len, eval, log_every, window, block, dict;
  std::uint64_t seed;
  bool ci;
};

example::ModelConfig model_config(const Arch& arch, const Task& task, const Settings& s, int argc,
                                  char** argv) {
  example::ModelConfig mc;
  mc.vocab = task.vocab();
  mc.classes = task.vocab();
  mc.max_len = s.train_len;
  mc.positions = false;  // runs at any length
  mc.previous_token = true;
  mc.layers = 2;
  layer::Config base;
  base.model_dim = example::int_arg(argc, argv, "--dim", s.ci ? 32 : 64);
  base.heads = example::int_arg(argc, argv, "--heads", 4);
  base.key_dim = base.model_dim / base.heads;
  base.value_dim = base.model_dim / base.heads;
  base.causal = true;
  base.components = example::int_arg(argc, argv, "--components", 32);
  base.codes = example::int_arg(argc, argv, "--codes", 64);
  base.ovq.block = s.block;
  base.ovq.max_centroids = s.dict;
  base.threads = static_cast<int>(example::int_arg(argc, argv, "--threads", 1));
  base.seed = s.seed;
  mc.attention = base;
  layer::Config first = base, second = base;
  first.mixer = arch.first;
  second.mixer = arch.second;
  if (arch.window_first) {
    first.mixer = layer::MixerKind::softmax;
    first.softmax.window = s.window;
    first.rope = true;
  }
  mc.per_layer = {first, second};
  return mc;
}

/// Held-out accuracy at `len` on `count` sequences from a generator of its own (the same
/// sequences for every model).
double accuracy(Model& model, const Task& task, int len, long count, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 104729 + static_cast<std::uint64_t>(len));
  std::vector<int> tokens, targets;
  Tally t;
  for (long i = 0; i < count; ++i) {
    task.sample(rng, len, tokens, targets);
    t += model.evaluate(tokens, targets);
  }
  return static_cast<double>(t.correct) / static_cast<double>(t.counted);
}

struct Trained {
  std::unique_ptr<Model> model;
  double first_loss = 0, last_loss = 0, seconds = 0;
};

Trained train(const Arch& arch, const Task& task, const Settings& s, int argc, char** argv) {
  Trained out;
  out.model = std::make_unique<Model>(model_config(arch, task, s, argc, argv));
  Model& model = *out.model;
  mixattn::optim::Adam<float> adam = example::adam_from_args(model.parameters(), argc, argv);
  std::printf("\n== %s: %ld parameters, %ld steps of %ld sequences of %ld tokens\n", arch.name,
              static_cast<long>(model.parameter_count()), s.steps, s.batch, s.train_len);
  std::mt19937_64 rng(s.seed * 7919 + 1);
  std::vector<std::vector<int>> batch(static_cast<std::size_t>(s.batch));
  std::vector<int> targets, batch_targets;
  Tally recent;
  const auto t0 = std::chrono::steady_clock::now();
  for (long step = 1; step <= s.steps; ++step) {
    model.zero_grad();
    batch_targets.clear();
    for (std::vector<int>& tokens : batch) {
      task.sample(rng, static_cast<int>(s.train_len), tokens, targets);
      batch_targets.insert(batch_targets.end(), targets.begin(), targets.end());
    }
    const Tally t = model.train_batch(batch, batch_targets,
                                      1.0f / static_cast<float>(s.batch * task.queries));
    adam.step(model.gradients());
    recent += t;
    if (step == 1) out.first_loss = t.loss / static_cast<double>(t.counted);
    if (step % s.log_every == 0 || step == s.steps) {
      out.last_loss = recent.loss / static_cast<double>(recent.counted);
      std::printf("  step %5ld  loss %.4f  acc %5.1f%%  %6.1f s\n", step, out.last_loss,
                  100.0 * static_cast<double>(recent.correct) / static_cast<double>(recent.counted),
                  example::seconds_since(t0));
      std::fflush(stdout);
      recent = Tally{};
    }
  }
  out.seconds = example::seconds_since(t0);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  s.ci = example::has_flag(argc, argv, "--ci");
  s.steps = example::int_arg(argc, argv, "--steps", s.ci ? 400 : 1500);
  s.batch = example::int_arg(argc, argv, "--batch", s.ci ? 8 : 16);
  s.train_len = example::int_arg(argc, argv, "--train-len", s.ci ? 32 : 256);
  s.eval = example::int_arg(argc, argv, "--eval", s.ci ? 50 : 100);
  s.log_every = example::int_arg(argc, argv, "--log-every", s.ci ? 50 : 250);
  s.window = example::int_arg(argc, argv, "--window", s.ci ? 8 : 32);
  s.block = example::int_arg(argc, argv, "--block", s.ci ? 8 : 32);
  s.dict = example::int_arg(argc, argv, "--dict", s.ci ? 16 : 64);
  s.seed = static_cast<std::uint64_t>(example::int_arg(argc, argv, "--seed", 1));
  Task task;
  const long default_pairs = s.ci ? 4 : 8;
  task.pairs = static_cast<int>(example::int_arg(argc, argv, "--pairs", default_pairs));
  task.queries = static_cast<int>(example::int_arg(argc, argv, "--queries", s.ci ? 8 : 16));
  task.keys = static_cast<int>(example::int_arg(argc, argv, "--keys", s.ci ? 8 : 64));
  task.values = static_cast<int>(example::int_arg(argc, argv, "--values", s.ci ? 8 : 64));
  task.fillers = static_cast<int>(example::int_arg(argc, argv, "--fillers", s.ci ? 4 : 16));
  const std::vector<long> lengths =
      list_arg(argc, argv, "--lengths", s.ci ? "32,64" : "256,512,1024,2048,4096");
  const std::vector<long> dict_sizes =
      list_arg(argc, argv, "--dict-sizes", s.ci ? "4,8" : "8,16,32,64,128,256");
  const std::string only = example::string_arg(argc, argv, "--only", "");
  const std::string out = example::string_arg(argc, argv, "--out", "");
  // The files are named after the run, so runs of other configurations never share their names;
  // the dictionary sweep is the OVQ model's.
  const std::string suffix =
      (only.empty() ? "" : "_" + only) +
      (task.pairs != default_pairs ? "_" + std::to_string(task.pairs) + "pairs" : "") +
      (s.ci ? "_ci" : "") + ".csv";
  const bool sweep = only.empty() || only == "ovq+window";
  std::vector<std::string> outputs = {"recall_length" + suffix};
  if (sweep) outputs.push_back("recall_dict" + suffix);
  example::prepare_outputs(argc, argv, out, outputs);
  for (long len : lengths)
    if (task.pairs < 1 || task.pairs > task.keys || task.queries < 1 || task.values < 2 ||
        task.fillers < 1 || len < 2 * task.pairs + task.queries ||
        s.train_len < 2 * task.pairs + task.queries) {
      std::fprintf(stderr, "need 1 <= pairs <= keys, queries >= 1, values >= 2, fillers >= 1 and "
                           "every length >= 2 pairs + queries\n");
      return 2;
    }
  std::printf("MQAR: %d pairs, %d queries, %d keys, %d values, %d filler tokens; trained at %ld "
              "tokens%s\n",
              task.pairs, task.queries, task.keys, task.values, task.fillers, s.train_len,
              s.ci ? " (CI configuration)" : "");

  const Arch archs[] = {
      {"softmax", layer::MixerKind::softmax, layer::MixerKind::softmax, false},
      {"ovq+window", layer::MixerKind::softmax, layer::MixerKind::ovq, true},
      {"linear+window", layer::MixerKind::softmax, layer::MixerKind::linear, true},
      {"gma", layer::MixerKind::gma, layer::MixerKind::gma, false},
      {"vq", layer::MixerKind::vq, layer::MixerKind::vq, false}};
  FILE* by_length =
      example::open_csv(out, outputs[0].c_str(), "model,length,accuracy,train_seconds");
  FILE* by_dict =
      sweep ? example::open_csv(out, outputs[1].c_str(), "dict_size,length,accuracy") : nullptr;
  const double chance = 1.0 / task.values;
  bool ok = true;
  int trained = 0;
  std::vector<std::pair<std::string, std::vector<double>>> table;
  for (const Arch& arch : archs) {
    if (!only.empty() && only != arch.name) continue;
    ++trained;
    Trained t = train(arch, task, s, argc, argv);
    std::vector<double> acc;
    for (long len : lengths) {
      acc.push_back(accuracy(*t.model, task, static_cast<int>(len), s.eval, s.seed));
      std::printf("  %-14s length %5ld: accuracy %5.1f%%\n", arch.name, len, 100 * acc.back());
      std::fflush(stdout);
      if (by_length)
        std::fprintf(by_length, "%s,%ld,%.4f,%.1f\n", arch.name, len, acc.back(), t.seconds);
    }
    const double at_train =
        accuracy(*t.model, task, static_cast<int>(s.train_len), s.eval, s.seed + 1);
    const bool learned = at_train >= 3 * chance;
    std::printf("  %s: loss %.3f -> %.3f, accuracy at the training length %.1f%% (chance %.1f%%) "
                "%s\n",
                arch.name, t.first_loss, t.last_loss, 100 * at_train, 100 * chance,
                learned ? "learned" : "DID NOT LEARN");
    ok = ok && learned;
    table.emplace_back(arch.name, acc);

    if (arch.second == layer::MixerKind::ovq) {  // the test-time dictionary-size sweep
      std::printf("\n  OVQ: accuracy with N_max changed at test time (trained with %ld)\n  %8s",
                  s.dict, "N_max");
      for (long len : lengths) std::printf(" %8ld", len);
      std::printf("\n");
      for (long n : dict_sizes) {
        example::ModelConfig mc = model_config(arch, task, s, argc, argv);
        for (layer::Config& c : mc.per_layer) c.ovq.max_centroids = n;
        Model sized(mc);
        std::vector<example::Block>& to = sized.parameters();
        const std::vector<example::Block>& from = t.model->parameters();
        for (std::size_t p = 0; p < to.size(); ++p) to[p].map() = from[p].map();
        std::printf("  %8ld", n);
        for (long len : lengths) {
          const double a = accuracy(sized, task, static_cast<int>(len), s.eval, s.seed);
          std::printf(" %7.1f%%", 100 * a);
          std::fflush(stdout);
          if (by_dict) std::fprintf(by_dict, "%ld,%ld,%.4f\n", n, len, a);
        }
        std::printf("\n");
      }
    }
  }

  std::printf("\nheld-out accuracy by length (chance %.1f%%)\n%-14s", 100 * chance, "model");
  for (long len : lengths) std::printf(" %8ld", len);
  std::printf("\n");
  for (const auto& [name, acc] : table) {
    std::printf("%-14s", name.c_str());
    for (double a : acc) std::printf(" %7.1f%%", 100 * a);
    std::printf("\n");
  }
  if (by_length) std::fclose(by_length);
  if (by_dict) std::fclose(by_dict);
  return ok && trained > 0 ? 0 : 1;
}
