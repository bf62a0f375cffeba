// The parameter file (layer.hpp save_parameters / load_parameters): a save replaces the file
// whole or not at all, whatever fails midway (an injected failure at every stage, a real full
// tmpfs when the test may mount one); a reader never sees a half-written file; and load turns
// any bytes (truncations at every length, every single-byte mutation, huge declared lengths)
// into a correct load or std::runtime_error, never a partial write into the model and never an
// allocation sized by the file.
//
// The expected file bytes come from this file's own encoder of the documented format, not from
// save_parameters.

#include "counting_heap.hpp"

#include <mixattn/layer.hpp>

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using mixattn::Index;
using mixattn::Matrix;
namespace layer = mixattn::layer;
using Layer = layer::MultiHeadAttention<double>;

// d_model 5, 2 GMA heads of r = 3, d_v = 2, K = 3: 142 scalars, a 1.4 KB file. value_dim
// widens it (the big layer below is over 16 KiB, the writer's buffer, and over 64 KiB).
layer::Config config(std::uint64_t seed, Index model_dim = 5, Index value_dim = 2) {
  layer::Config cfg;
  cfg.model_dim = model_dim;
  cfg.heads = 2;
  cfg.key_dim = 3;
  cfg.value_dim = value_dim;
  cfg.components = 3;
  cfg.seed = seed;
  return cfg;
}
layer::Config big_config(std::uint64_t seed) {
  return config(seed, 64, 48);  // 4 weights of 64 x 96 or 64 x 6: ~13 800 scalars, ~108 KiB
}

/// The file the format documented above save_parameters describes, encoded here.
struct Encoded {
  std::string bytes;
  std::vector<std::pair<std::size_t, std::size_t>> data;  // [begin, end) of each block's scalars
};
template <class U>
void put(std::string& s, U v) {
  for (std::size_t i = 0; i < sizeof(U); ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
Encoded encode(const Layer& l) {
  Encoded e;
  e.bytes = "MIXATTNP";
  put<std::uint32_t>(e.bytes, 1);
  put<std::uint32_t>(e.bytes, 8);
  const std::vector<layer::ConstNamedBlock<double>> blocks = l.const_parameters();
  put<std::uint64_t>(e.bytes, blocks.size());
  for (const layer::ConstNamedBlock<double>& b : blocks) {
    put<std::uint32_t>(e.bytes, static_cast<std::uint32_t>(b.name.size()));
    e.bytes += b.name;
    put<std::uint64_t>(e.bytes, static_cast<std::uint64_t>(b.rows));
    put<std::uint64_t>(e.bytes, static_cast<std::uint64_t>(b.cols));
    const std::size_t begin = e.bytes.size();
    for (Index i = 0; i < b.rows * b.cols; ++i) {
      std::uint64_t bits;
      std::memcpy(&bits, b.data + i, 8);
      put<std::uint64_t>(e.bytes, bits);
    }
    e.data.emplace_back(begin, e.bytes.size());
  }
  return e;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

/// Every parameter of the layer, concatenated (to compare a layer before and after).
std::vector<double> values(const Layer& l) {
  std::vector<double> out;
  for (const layer::ConstNamedBlock<double>& b : l.const_parameters())
    out.insert(out.end(), b.data, b.data + b.rows * b.cols);
  return out;
}

template <class Fn>
std::string runtime_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no std::runtime_error)";
}

/// A fresh directory per test, removed with what is left in it; names() lists its entries.
class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "mixattn_checkpoint_XXXXXX";
    ASSERT_NE(::mkdtemp(&tmpl[0]), nullptr) << std::strerror(errno);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const std::string& n : names()) std::remove((dir_ + "/" + n).c_str());
    ::rmdir(dir_.c_str());
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    if (DIR* d = ::opendir(dir_.c_str())) {
      while (const dirent* e = ::readdir(d))
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
          out.push_back(e->d_name);
      ::closedir(d);
    }
    return out;
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

/// Resets the injected failure however the test ends.
struct Fault {
  Fault(long long after_bytes, const char* step) {
    mixattn::detail::replace_fault() = {after_bytes, step};
  }
  ~Fault() { mixattn::detail::replace_fault() = {}; }
};

TEST_F(Checkpoint, SaveWritesTheDocumentedBytesAndReplacesALongerFile) {
  const std::string file = path("model.bin");
  const Layer big(big_config(1)), small(config(2));
  big.save(file);
  EXPECT_EQ(read_all(file), encode(big).bytes);
  small.save(file);  // over a longer file: nothing of it may remain
  EXPECT_EQ(read_all(file), encode(small).bytes);
  EXPECT_EQ(names(), std::vector<std::string>{"model.bin"}) << "a temporary file was left";
  Layer back(config(3));
  ASSERT_NE(values(back), values(small));
  back.load(file);
  EXPECT_EQ(values(back), values(small));
}

// A failure at each stage of the save: the old file stays byte for byte, no temporary is
// left, the error names the path and the system's reason, and the old file still loads.
TEST_F(Checkpoint, FailureMidwayLeavesTheOldFileAndNoTemporary) {
  const std::string file = path("model.bin");
  const Layer old_layer(config(1)), new_layer(big_config(2));
  old_layer.save(file);
  const std::string old_bytes = read_all(file);
  const long long size = static_cast<long long>(encode(new_layer).bytes.size());
  ASSERT_GT(size, 3 * 16384);  // crosses the writer's buffer several times
  struct Stage {
    long long after_bytes;
    const char* step;
    int reason;  // the errno whose text the message carries
  };
  const Stage stages[] = {{0, nullptr, ENOSPC},        {1, nullptr, ENOSPC},
                          {20, nullptr, ENOSPC},       {16383, nullptr, ENOSPC},
                          {16384, nullptr, ENOSPC},    {40000, nullptr, ENOSPC},
                          {size - 1, nullptr, ENOSPC}, {-1, "fsync", EIO},
                          {-1, "close", EIO},          {-1, "rename", EIO}};
  for (const Stage& s : stages) {
    SCOPED_TRACE(::testing::Message()
                 << "after " << s.after_bytes << " bytes, step " << (s.step ? s.step : "write"));
    std::string msg;
    {
      const Fault fault(s.after_bytes, s.step);
      msg = runtime_error_of([&] { new_layer.save(file); });
    }
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::strerror(s.reason)), std::string::npos) << msg;
    EXPECT_EQ(read_all(file), old_bytes);
    EXPECT_EQ(names(), std::vector<std::string>{"model.bin"}) << "a temporary file was left";
  }
  Layer back(config(3));
  back.load(file);
  EXPECT_EQ(values(back), values(old_layer));
  {
    const Fault fault(size, nullptr);  // exactly enough room: the save succeeds
    new_layer.save(file);
  }
  EXPECT_EQ(read_all(file), encode(new_layer).bytes);
}

TEST_F(Checkpoint, FailureWithoutAnOldFileLeavesNoFile) {
  const std::string file = path("model.bin");
  {
    const Fault fault(100, nullptr);
    EXPECT_NE(runtime_error_of([&] { Layer(config(1)).save(file); }).find(std::strerror(ENOSPC)),
              std::string::npos);
  }
  EXPECT_TRUE(names().empty());
  const std::string missing = path("no_such_dir/model.bin");
  const std::string msg = runtime_error_of([&] { Layer(config(1)).save(missing); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(ENOENT)), std::string::npos) << msg;
  EXPECT_TRUE(names().empty());
}

TEST_F(Checkpoint, UnwritableDirectoryIsReported) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes into a read-only directory";
  const std::string file = path("model.bin");
  Layer(config(1)).save(file);
  const std::string old_bytes = read_all(file);
  ASSERT_EQ(::chmod(dir_.c_str(), 0555), 0);
  const std::string msg = runtime_error_of([&] { Layer(config(2)).save(file); });
  ::chmod(dir_.c_str(), 0755);
  EXPECT_NE(msg.find(std::strerror(EACCES)), std::string::npos) << msg;
  EXPECT_EQ(read_all(file), old_bytes);
  EXPECT_EQ(names(), std::vector<std::string>{"model.bin"});
}

// A real full disk: a 64 KiB tmpfs holding a 1.4 KB checkpoint, then a 108 KiB save. Needs
// the right to mount (root outside a restricted container); skipped otherwise.
TEST_F(Checkpoint, FullTmpfsLeavesTheOldFile) {
  const std::string mnt = path("tmpfs");
  ASSERT_EQ(::mkdir(mnt.c_str(), 0755), 0);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k") != 0) {
    const int err = errno;
    ::rmdir(mnt.c_str());
    GTEST_SKIP() << "cannot mount a tmpfs: " << std::strerror(err);
  }
  const std::string file = mnt + "/model.bin";
  const Layer old_layer(config(1));
  old_layer.save(file);
  const std::string old_bytes = read_all(file);
  const std::string msg = runtime_error_of([&] { Layer(big_config(2)).save(file); });
  EXPECT_NE(msg.find(std::strerror(ENOSPC)), std::string::npos) << msg;
  EXPECT_EQ(read_all(file), old_bytes);
  std::vector<std::string> left;
  if (DIR* d = ::opendir(mnt.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') left.push_back(e->d_name);
    ::closedir(d);
  }
  EXPECT_EQ(left, std::vector<std::string>{"model.bin"});
  Layer back(config(3));
  back.load(file);
  EXPECT_EQ(values(back), values(old_layer));
  std::remove(file.c_str());
  ::umount2(mnt.c_str(), MNT_DETACH);
  ::rmdir(mnt.c_str());
}

// A reader loading while another thread saves two models in turn: every load succeeds and
// gives one of the two (writing in place, a reader would see a truncated or mixed file).
TEST_F(Checkpoint, ReaderNeverSeesAHalfWrittenFile) {
  const std::string file = path("model.bin");
  const Layer a(big_config(1)), b(big_config(2));
  a.save(file);
  const std::vector<double> va = values(a), vb = values(b);
  std::atomic<bool> done{false};
  std::atomic<int> loads{0}, bad{0};
  std::string first_error;
  std::thread reader([&] {
    Layer r(big_config(3));
    while (!done.load()) {
      try {
        r.load(file);
        const std::vector<double> v = values(r);
        if (v != va && v != vb) ++bad;
      } catch (const std::exception& e) {
        if (bad++ == 0) first_error = e.what();
      }
      ++loads;
    }
  });
  for (int i = 0; i < 60; ++i) (i % 2 ? a : b).save(file);
  while (loads.load() < 20) std::this_thread::yield();  // a slow reader still reads enough
  done = true;
  reader.join();
  EXPECT_EQ(bad.load(), 0) << "of " << loads.load() << " loads; first error: " << first_error;
  EXPECT_EQ(names(), std::vector<std::string>{"model.bin"});
}

TEST_F(Checkpoint, SymbolicLinkIsFollowedAndOtherFilesRefused) {
  const std::string target = path("target.bin"), link = path("link.bin");
  Layer(config(1)).save(target);
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  const Layer l(config(2));
  l.save(link);
  struct stat st;
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode)) << "the link was replaced by a file";
  EXPECT_EQ(read_all(target), encode(l).bytes);
  ASSERT_EQ(::chmod(target.c_str(), 0640), 0);  // an existing file keeps its permissions
  l.save(target);
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  EXPECT_NE(runtime_error_of([&] { l.save(fifo); }).find("not a regular file"), std::string::npos);
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_EQ(names().size(), 3u) << "a temporary file was left";
}

// ---- load_parameters on bad bytes ----

/// Loads `bytes` into `dst`: either the load succeeds or it throws std::runtime_error naming
/// the file and leaves every parameter as it was. Returns the error ("" on success).
std::string load_bytes(const std::string& file, const std::string& bytes, Layer& dst) {
  write_all(file, bytes);
  const std::vector<double> before = values(dst);
  std::string msg;
  try {
    dst.load(file);
  } catch (const std::runtime_error& e) {
    msg = e.what();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_EQ(values(dst), before) << "a failed load changed the layer: " << msg;
    if (msg.empty()) msg = "(empty message)";
  }
  return msg;
}

TEST_F(Checkpoint, LoadRefusesEveryTruncation) {
  const Encoded e = encode(Layer(config(1)));
  Layer dst(config(2));
  for (std::size_t n = 0; n < e.bytes.size(); ++n)
    ASSERT_NE(load_bytes(path("cut.bin"), e.bytes.substr(0, n), dst), "") << "prefix of " << n;
  EXPECT_EQ(load_bytes(path("cut.bin"), e.bytes, dst), "");
}

// Every byte changed in turn: a change inside a block's scalars loads (that scalar differs);
// a change anywhere else (magic, version, sizes, count, a name or a shape) is refused.
TEST_F(Checkpoint, LoadOfEverySingleByteMutation) {
  const Layer src(config(1));
  const Encoded e = encode(src);
  const std::vector<double> original = values(src);
  Layer dst(config(2));
  for (std::size_t at = 0; at < e.bytes.size(); ++at) {
    bool in_data = false;
    for (const auto& range : e.data) in_data |= at >= range.first && at < range.second;
    std::string bytes = e.bytes;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x5a);
    const std::string msg = load_bytes(path("mutated.bin"), bytes, dst);
    if (!in_data) {
      EXPECT_NE(msg, "") << "byte " << at << " changed outside the data, yet the file loaded";
      continue;
    }
    ASSERT_EQ(msg, "") << "byte " << at;
    const std::vector<double> got = values(dst);
    std::size_t differing = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
      differing += std::memcmp(&got[i], &original[i], sizeof(double)) != 0;
    EXPECT_EQ(differing, 1u) << "byte " << at;
  }
}

/// The byte offset of block p's name length, walking the encoded file.
std::size_t block_offset(const Encoded& e, std::size_t p) {
  std::size_t at = 24;
  for (std::size_t i = 0; i < p; ++i) at = e.data[i].second;
  return at;
}
template <class U>
std::string with(std::string bytes, std::size_t at, U v) {
  std::string enc;
  put<U>(enc, v);
  bytes.replace(at, sizeof(U), enc);
  return bytes;
}

// Declared sizes far past the model and the file: refused by comparison with the model, before
// anything is allocated from them (the next test measures the allocations).
TEST_F(Checkpoint, LoadRefusesHugeOrWrongDeclaredSizes) {
  const Encoded e = encode(Layer(config(1)));
  Layer dst(config(2));
  const std::string f = path("bad.bin");
  const std::size_t b1 = block_offset(e, 1);  // "w_k": name length at b1, rows at b1 + 7
  const std::uint64_t max64 = ~std::uint64_t{0};
  struct Bad {
    std::string bytes;
    const char* fragment;
  };
  const Bad cases[] = {
      {"MIXATTNQ" + e.bytes.substr(8), "bad magic"},
      {with<std::uint32_t>(e.bytes, 8, 0xffffffffu), "format version 4294967295"},
      {with<std::uint32_t>(e.bytes, 12, 4), "scalars of 4 bytes"},
      {with<std::uint32_t>(e.bytes, 12, 0xffffffffu), "scalars of 4294967295 bytes"},
      {with<std::uint64_t>(e.bytes, 16, max64), "18446744073709551615 parameters in the file"},
      {with<std::uint64_t>(e.bytes, 16, 0), "0 parameters in the file but 10"},
      {with<std::uint32_t>(e.bytes, b1, 0xffffffffu), "name of 4294967295 bytes"},
      {with<std::uint32_t>(e.bytes, b1, 60000), "name of 60000 bytes"},
      {with<std::uint32_t>(e.bytes, b1, 200), "parameter 1 is 'w_k"},
      {with<std::uint32_t>(e.bytes, b1, 2), "parameter 1 is 'w_' "},
      {with<std::uint64_t>(e.bytes, b1 + 7, max64), "18446744073709551615 x 6 in the file"},
      {with<std::uint64_t>(e.bytes, b1 + 7, std::uint64_t{1} << 63), "in the file but 'w_k' 5 x 6"},
      {with<std::uint64_t>(e.bytes, b1 + 15, (std::uint64_t{6} << 32) + 6), "5 x 25769803782 in"},
      {e.bytes + std::string(1, '\0'), "trailing bytes"},
      {std::string(), "bad magic"},
  };
  for (const Bad& c : cases) {
    const std::string msg = load_bytes(f, c.bytes, dst);
    EXPECT_NE(msg.find(c.fragment), std::string::npos)
        << "expected '" << c.fragment << "': " << msg;
  }
  const std::string dir_msg = runtime_error_of([&] { dst.load(dir_); });  // a directory
  EXPECT_NE(dir_msg.find(dir_), std::string::npos) << dir_msg;
}

#ifndef MIXATTN_TEST_SANITIZED
// The heap in use while loading never exceeds what the model's staged copy (1 136 bytes) needs
// plus the stream's buffer (8 KiB) and a few short strings, whatever length the file declares:
// 16 KiB of slack, below a 60 000-byte name and far below the lengths refused above.
TEST_F(Checkpoint, LoadAllocatesNoMoreThanTheModel) {
  const Layer src(config(1));
  const Encoded e = encode(src);
  Layer dst(config(2));
  const std::int64_t model_bytes = static_cast<std::int64_t>(values(src).size() * sizeof(double));
  const std::size_t b1 = block_offset(e, 1);
  const std::string files[] = {e.bytes, with<std::uint32_t>(e.bytes, b1, 60000),
                               with<std::uint32_t>(e.bytes, b1, 0xffffffffu),
                               with<std::uint64_t>(e.bytes, 16, ~std::uint64_t{0})};
  for (const std::string& bytes : files) {
    write_all(path("m.bin"), bytes);
    mixattn::bench::HeapCounters& c = mixattn::bench::heap_counters();
    const std::int64_t start = c.current.load();
    c.peak.store(start);
    try {
      dst.load(path("m.bin"));
    } catch (const std::runtime_error&) {
    }
    EXPECT_LE(c.peak.load() - start, model_bytes + 16384) << "model " << model_bytes << " bytes";
  }
}
#endif

}  // namespace
