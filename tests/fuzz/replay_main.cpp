// Replays fuzz inputs without libFuzzer (for compilers that lack it): every file named on the
// command line, or found directly inside a directory named there, runs through
// LLVMFuzzerTestOneInput once. The oracle traps on failure, exactly as under libFuzzer.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {
void run_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(f)),
                                        std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
}
}  // namespace

int main(int argc, char** argv) {
  std::size_t runs = 0;
  for (int a = 1; a < argc; ++a) {
    const std::filesystem::path p(argv[a]);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::directory_iterator(p))
        if (e.is_regular_file()) {
          run_file(e.path());
          ++runs;
        }
    } else {
      run_file(p);
      ++runs;
    }
  }
  std::printf("replayed %zu inputs\n", runs);
  return 0;
}
