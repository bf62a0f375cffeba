// Character-level language modelling: the GMA paper's comparison at small scale. Four models that
// differ only in their attention mixer — exact softmax, causal GMA, linear attention (elu + 1) and
// Performer (FAVOR+) — are trained the same way on the King James Bible (Debian's bible-kjv,
// 4.4 MB of English prose) and scored in bits per character on held-out text, each with several
// seeds so that a difference between mixers can be told from the spread between seeds.
//
// Text: `--text FILE`, or by default the whole Bible as `bible -f Gen1:1-Rev22:21` prints it, one
// verse per line with its reference ("Ge1:1 ") removed. The text is cut into 100 pieces; every
// tenth is held out (so the held-out text spans the whole book, not only its end).
//
// Model (examples/common.hpp): token + position + previous-token embeddings, `--layers`
// pre-norm residual causal attention layers, a linear readout of the next character. Attention
// only, no feed-forward blocks: the mixer is the only part that reads context.
//
//   example_char_lm [--ci] [--text FILE] [--steps N] [--batch B] [--len N] [--dim D] [--heads H]
//                   [--layers L] [--components K] [--features M] [--seeds S] [--eval-windows W]
//                   [--lr LR] [--log-every N] [--threads T] [--only softmax|gma|linear|performer]
//                   [--out DIR [--force]] [--list-outputs]
//
// Prints a progress line per --log-every steps and a final table; with --out writes
// DIR/char_lm.csv (one row per mixer and seed), named after the run: _<mixer> for --only,
// _k<K> for --components other than 16, _ci for --ci (char_lm_gma_k64.csv for --only gma
// --components 64). An existing file is replaced only with --force; --list-outputs prints the
// path and exits (examples/common.hpp: prepare_outputs). --ci: a seconds-long configuration that
// fails (exit 1) unless every model learned (held-out bits per character well below the
// alphabet's log2 and below the training text's unigram entropy); it does not check the ordering.
#include "common.hpp"

#include <algorithm>
#include <cstdio>
#include <map>

namespace {

using example::Index;
using example::Model;
using example::Tally;
namespace layer = mixattn::layer;

constexpr long default_components = 16;  // GMA's K

struct Corpus {
  std::vector<int> train, held_out;  // character ids
  std::vector<char> alphabet;        // id -> byte
  double unigram_bits = 0;           // entropy of the training text's character frequencies
};

std::string read_text(const std::string& path) {
  std::string text;
  if (!path.empty()) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) {
      std::fprintf(stderr, "cannot open %s\n", path.c_str());
      std::exit(2);
    }
    char buf[1 << 16];
    std::size_t got;
    while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, got);
    std::fclose(f);
    return text;
  }
  FILE* p = popen("bible -f Gen1:1-Rev22:21 2>/dev/null", "r");
  if (p) {
    char line[1 << 14];
    while (std::fgets(line, sizeof line, p)) {
      const char* body = std::strchr(line, ' ');  // drop the reference, "Ge1:1 "
      if (body) text += body + 1;
    }
    pclose(p);
  }
  if (text.size() < 100000) {
    std::fprintf(stderr,
                 "no text: install Debian's bible-kjv (the test command does) or pass --text\n");
    std::exit(2);
  }
  return text;
}

Corpus make_corpus(const std::string& text) {
  Corpus c;
  std::map<char, int> id;
  for (char ch : text) id.emplace(ch, 0);
  for (auto& [ch, i] : id) {
    i = static_cast<int>(c.alphabet.size());
    c.alphabet.push_back(ch);
  }
  const std::size_t pieces = 100, piece = text.size() / pieces;
  for (std::size_t p = 0; p < pieces; ++p) {
    std::vector<int>& into = p % 10 == 9 ? c.held_out : c.train;
    const std::size_t end = p + 1 == pieces ? text.size() : (p + 1) * piece;
    for (std::size_t i = p * piece; i < end; ++i) into.push_back(id[text[i]]);
  }
  std::vector<double> freq(c.alphabet.size(), 0.0);
  for (int t : c.train) freq[static_cast<std::size_t>(t)] += 1;
  for (double f : freq)
    if (f > 0) {
      const double pr = f / static_cast<double>(c.train.size());
      c.unigram_bits -= pr * std::log2(pr);
    }
  return c;
}

struct Result {
  std::string mixer;
  std::uint64_t seed = 0;
  long parameters = 0;
  double first_bits = 0, train_bits = 0, held_out_bits = 0, tokens_per_s = 0, seconds = 0;
};

// A window of len + 1 characters starting at `at`: inputs are the first len, targets the last.
void window(const std::vector<int>& text, std::size_t at, long len, std::vector<int>& tokens,
            std::vector<int>& targets) {
  tokens.assign(text.begin() + static_cast<std::ptrdiff_t>(at),
                text.begin() + static_cast<std::ptrdiff_t>(at) + len);
  targets.assign(text.begin() + static_cast<std::ptrdiff_t>(at) + 1,
                 text.begin() + static_cast<std::ptrdiff_t>(at) + len + 1);
}

Result train(const std::string& name, layer::MixerKind mixer, std::uint64_t seed,
             const Corpus& corpus, int argc, char** argv, bool ci) {
  const long steps = example::int_arg(argc, argv, "--steps", ci ? 80 : 1500);
  const long batch = example::int_arg(argc, argv, "--batch", ci ? 8 : 16);
  const long len = example::int_arg(argc, argv, "--len", ci ? 64 : 256);
  const long log_every = example::int_arg(argc, argv, "--log-every", ci ? 40 : 250);
  const long eval_windows = example::int_arg(argc, argv, "--eval-windows", ci ? 16 : 256);

  example::ModelConfig mc;
  mc.vocab = static_cast<Index>(corpus.alphabet.size());
  mc.classes = mc.vocab;
  mc.max_len = len;
  mc.previous_token = true;
  mc.layers = static_cast<int>(example::int_arg(argc, argv, "--layers", 2));
  mc.attention.model_dim = example::int_arg(argc, argv, "--dim", ci ? 32 : 64);
  mc.attention.heads = example::int_arg(argc, argv, "--heads", 4);
  mc.attention.key_dim = mc.attention.model_dim / mc.attention.heads;
  mc.attention.value_dim = mc.attention.model_dim / mc.attention.heads;
  mc.attention.mixer = mixer;
  mc.attention.causal = true;
  mc.attention.components = example::int_arg(argc, argv, "--components", default_components);
  mc.attention.features = example::int_arg(argc, argv, "--features", 64);
  mc.attention.threads = static_cast<int>(example::int_arg(argc, argv, "--threads", 1));
  mc.attention.seed = seed;
  Model model(mc);
  mixattn::optim::Adam<float> adam = example::adam_from_args(model.parameters(), argc, argv);

  Result res;
  res.mixer = name;
  res.seed = seed;
  res.parameters = static_cast<long>(model.parameter_count());
  std::printf("\n== %s, seed %llu: %ld parameters, %ld steps of %ld windows of %ld characters\n",
              name.c_str(), static_cast<unsigned long long>(seed), res.parameters, steps, batch,
              len);
  std::mt19937_64 rng(seed * 7919 + 11);
  std::uniform_int_distribution<std::size_t> start(0, corpus.train.size() - static_cast<std::size_t>(len) - 2);
  std::vector<std::vector<int>> batch_tokens(static_cast<std::size_t>(batch));
  std::vector<int> targets, batch_targets;
  Tally recent;
  long tokens_done = 0;
  constexpr double bits = 1.0 / 0.69314718055994530942;  // nats -> bits
  const auto t0 = std::chrono::steady_clock::now();
  for (long step = 1; step <= steps; ++step) {
    model.zero_grad();
    batch_targets.clear();
    for (std::vector<int>& tokens : batch_tokens) {
      window(corpus.train, start(rng), len, tokens, targets);
      batch_targets.insert(batch_targets.end(), targets.begin(), targets.end());
    }
    const Tally t =
        model.train_batch(batch_tokens, batch_targets, 1.0f / static_cast<float>(batch * len));
    adam.step(model.gradients());
    tokens_done += batch * len;
    recent += t;
    if (step == 1) res.first_bits = bits * t.loss / static_cast<double>(t.counted);
    if (step % log_every == 0 || step == steps) {
      res.train_bits = bits * recent.loss / static_cast<double>(recent.counted);
      std::printf("  step %5ld  train %.3f bits/char  %8.0f characters/s\n", step, res.train_bits,
                  static_cast<double>(tokens_done) / example::seconds_since(t0));
      std::fflush(stdout);
      recent = Tally{};
    }
  }
  res.seconds = example::seconds_since(t0);
  res.tokens_per_s = static_cast<double>(tokens_done) / res.seconds;

  // Held-out: the same evenly spaced windows for every model and seed.
  Tally test;
  std::vector<int> tokens;
  const std::size_t span = corpus.held_out.size() - static_cast<std::size_t>(len) - 1;
  for (long w = 0; w < eval_windows; ++w) {
    window(corpus.held_out, span * static_cast<std::size_t>(w) / static_cast<std::size_t>(eval_windows), len,
           tokens, targets);
    test += model.evaluate(tokens, targets);
  }
  res.held_out_bits = bits * test.loss / static_cast<double>(test.counted);
  std::printf("  %s seed %llu: held-out %.3f bits/char (%ld characters), %.0f s\n", name.c_str(),
              static_cast<unsigned long long>(seed), res.held_out_bits, test.counted, res.seconds);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  const bool ci = example::has_flag(argc, argv, "--ci");
  const std::string only = example::string_arg(argc, argv, "--only", "");
  const std::string out = example::string_arg(argc, argv, "--out", "");
  // The file is named after the run, so runs of other configurations never share its name.
  const long components = example::int_arg(argc, argv, "--components", default_components);
  const std::string csv_name =
      "char_lm" + (only.empty() ? "" : "_" + only) +
      (components != default_components ? "_k" + std::to_string(components) : "") +
      (ci ? "_ci" : "") + ".csv";
  example::prepare_outputs(argc, argv, out, {csv_name});
  const Corpus corpus = make_corpus(read_text(example::string_arg(argc, argv, "--text", "")));
  const long seeds = example::int_arg(argc, argv, "--seeds", ci ? 1 : 2);
  FILE* csv = example::open_csv(  // before training: a bad --out fails at once
      out, csv_name.c_str(),
      "mixer,seed,parameters,first_bits,train_bits,held_out_bits,chars_per_s,seconds");
  std::printf("character LM: %zu training and %zu held-out characters, alphabet of %zu, training "
              "unigram entropy %.3f bits/char%s\n",
              corpus.train.size(), corpus.held_out.size(), corpus.alphabet.size(),
              corpus.unigram_bits, ci ? " (CI configuration)" : "");

  const std::pair<const char*, layer::MixerKind> mixers[] = {
      {"softmax", layer::MixerKind::softmax},
      {"gma", layer::MixerKind::gma},
      {"linear", layer::MixerKind::linear},
      {"performer", layer::MixerKind::performer}};
  std::vector<Result> results;
  for (const auto& [name, kind] : mixers)
    if (only.empty() || only == name)
      for (long s = 1; s <= seeds; ++s)
        results.push_back(train(name, kind, static_cast<std::uint64_t>(s), corpus, argc, argv, ci));

  // Passing: every model's held-out bits per character are below the training text's unigram
  // entropy (a model that ignores context cannot beat it on average) and below 0.75 log2 of the
  // alphabet (the loss at initialisation is about log2 of the alphabet).
  const double bar = std::min(corpus.unigram_bits, 0.75 * std::log2(static_cast<double>(corpus.alphabet.size())));
  std::printf("\n%-10s %5s %10s %10s %10s %10s %12s\n", "mixer", "seed", "params", "bits@1",
              "train", "held-out", "chars/s");
  bool ok = !results.empty();
  for (const Result& r : results) {
    const bool learned = r.held_out_bits < bar;
    std::printf("%-10s %5llu %10ld %10.3f %10.3f %10.3f %12.0f  %s\n", r.mixer.c_str(),
                static_cast<unsigned long long>(r.seed), r.parameters, r.first_bits, r.train_bits,
                r.held_out_bits, r.tokens_per_s, learned ? "learned" : "DID NOT LEARN");
    ok = ok && learned;
  }
  // Mean and spread (max - min over seeds) per mixer.
  std::printf("\n%-10s %10s %10s\n", "mixer", "mean", "spread");
  for (const auto& [name, kind] : mixers) {
    double lo = 1e300, hi = -1e300, sum = 0;
    int n = 0;
    for (const Result& r : results)
      if (r.mixer == name) {
        lo = std::min(lo, r.held_out_bits), hi = std::max(hi, r.held_out_bits);
        sum += r.held_out_bits, ++n;
      }
    if (n) std::printf("%-10s %10.3f %10.3f\n", name, sum / n, hi - lo);
  }
  if (csv) {
    for (const Result& r : results)
      std::fprintf(csv, "%s,%llu,%ld,%.4f,%.4f,%.4f,%.0f,%.1f\n", r.mixer.c_str(),
                   static_cast<unsigned long long>(r.seed), r.parameters, r.first_bits,
                   r.train_bits, r.held_out_bits, r.tokens_per_s, r.seconds);
    std::fclose(csv);
    std::printf("wrote %s/%s\n", out.c_str(), csv_name.c_str());
  }
  return ok ? 0 : 1;
}
