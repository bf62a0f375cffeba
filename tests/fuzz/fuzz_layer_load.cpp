// libFuzzer target: layer::load_parameters, the one parser of bytes from disk. Decodes a small
// layer (mixer GMA, OVQ, VQ, softmax or the gated delta rule; H <= 2; dimensions <= 4; the scalar
// type from the entry point's flag) and a file: either the rest of the input as it is, or the
// layer's own saved file (save_parameters) with edits — bytes overwritten, a header or shape field
// set to a hostile integer (0, 1, the largest u32 / u64, 2^62, a count one off), the file cut short
// or extended — and loads it into the layer through a file in the temporary directory. The oracle:
//   - the load returns or throws std::runtime_error, nothing else (run.sh also caps any single
//     allocation, -malloc_limit_mb, far above what these models need);
//   - on a throw, every parameter is bitwise as it was before;
//   - on a return, the file was a correct parameter file of this model: saving the layer again
//     gives the file's bytes exactly.
#include <mixattn/layer.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

using mixattn::Index;
namespace layer = mixattn::layer;
namespace fz = mixattn::fuzz;

using Bytes = std::vector<std::uint8_t>;

/// This process's scratch files (the fuzzers run in parallel, one process each).
std::string temp_path(const char* what) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/mixattn_fuzz_layer_load." +
         std::to_string(static_cast<long>(getpid())) + "." + what;
}

void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  os.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!os) fz::fail("cannot write the scratch file", path.c_str());
}

Bytes read_file(const std::string& path) {
  std::ifstream is(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(is)), std::istreambuf_iterator<char>());
}

layer::Config draw_config(fz::Bytes& in) {
  layer::Config cfg;
  static constexpr layer::MixerKind kinds[] = {layer::MixerKind::gma, layer::MixerKind::ovq,
                                               layer::MixerKind::vq, layer::MixerKind::softmax,
                                               layer::MixerKind::delta};
  cfg.mixer = in.pick(kinds);
  cfg.causal =
      cfg.mixer == layer::MixerKind::ovq || cfg.mixer == layer::MixerKind::delta || in.flag();
  cfg.model_dim = in.range(1, 4);
  cfg.heads = in.range(1, 2);
  cfg.key_dim = in.range(1, 4);
  cfg.value_dim = in.range(1, 4);
  cfg.components = in.range(1, 3);
  cfg.codes = in.range(1, 3);
  cfg.features = 2;
  cfg.seed = in.u8();
  return cfg;
}

/// Overwrites the little-endian integer of `width` bytes at `at` (if it fits).
void put_int(Bytes& b, std::size_t at, int width, std::uint64_t value) {
  for (int i = 0; i < width && at + static_cast<std::size_t>(i) < b.size(); ++i)
    b[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(value >> (8 * i));
}

/// Up to 8 edits of a valid file: a byte, an integer field (at a field offset of the header or
/// the first block: version, scalar size, count, name length, rows, cols) set to a hostile value,
/// a cut, or bytes appended.
Bytes mutate(fz::Bytes& in, Bytes file) {
  static constexpr std::uint64_t hostile[] = {0, 1, 2, 0xffffffffull, ~0ull, 1ull << 62,
                                              1ull << 31, 65536, 65537, 3};
  // Field offsets: version 8 (u32), scalar size 12 (u32), count 16 (u64), first name length 24
  // (u32); the first block's rows and cols follow its name ("w_q": 3 bytes) at 31 and 39.
  static constexpr std::size_t field_at[] = {8, 12, 16, 24, 31, 39};
  static constexpr int field_width[] = {4, 4, 8, 4, 8, 8};
  const int edits = 1 + in.u8() % 8;
  for (int e = 0; e < edits && !file.empty(); ++e) {
    const std::uint8_t kind = in.u8();
    const std::size_t at = in.u16() % file.size();
    switch (kind % 5) {
      case 0: file[at] = in.u8(); break;
      case 1: {
        const std::size_t f = in.u8() % 6;
        put_int(file, field_at[f], field_width[f], in.pick(hostile));
        break;
      }
      case 2: file.resize(at); break;
      case 3: {
        const std::size_t count = in.u8() % 16;
        file.insert(file.end(), count, in.u8());
        break;
      }
      default: put_int(file, at, 8, in.pick(hostile)); break;
    }
  }
  return file;
}

/// Every parameter's bytes, in parameters() order.
template <class T>
Bytes snapshot(layer::MultiHeadAttention<T>& model) {
  Bytes out;
  for (const auto& b : model.parameters()) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(b.data);
    out.insert(out.end(), p, p + static_cast<std::size_t>(b.rows * b.cols) * sizeof(T));
  }
  return out;
}

template <class T>
void run_case(fz::Bytes& in) {
  const layer::Config cfg = draw_config(in);
  layer::MultiHeadAttention<T> model(cfg);
  const std::string path = temp_path("bin"), again = temp_path("again");
  model.save(path);
  const Bytes valid = read_file(path);
  Bytes file;
  if (in.flag()) {
    file = mutate(in, valid);
  } else {
    while (!in.exhausted()) file.push_back(in.u8());
  }
  // A different model's parameters, so that a load that returns must have written them all.
  layer::Config other = cfg;
  other.seed = cfg.seed + 1000;
  layer::MultiHeadAttention<T> target(other);
  write_file(path, file);
  const Bytes before = snapshot(target);
  if (fz::verbose()) std::cerr << "file of " << file.size() << " bytes (valid: " << valid.size() << ")\n";
  try {
    target.load(path);
  } catch (const std::runtime_error& e) {
    if (fz::verbose()) std::cerr << "refused: " << e.what() << "\n";
    MIXATTN_FUZZ_CHECK(snapshot(target) == before, "a refused load changed the parameters");
    return;
  } catch (const std::exception& e) {
    fz::fail("load threw other than std::runtime_error:", e.what());
  }
  target.save(again);
  MIXATTN_FUZZ_CHECK(read_file(again) == file, "a load returned but the file was not the model's");
}

}  // namespace

MIXATTN_FUZZ_ENTRY_POINT(run_case)
