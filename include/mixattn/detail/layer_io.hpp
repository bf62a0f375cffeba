// mixattn/detail/layer_io.hpp — byte-level helpers of the parameter file format (layer.hpp) and
// the writer that replaces a file only once its new contents are complete and on disk.
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <istream>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__unix__) || defined(__APPLE__)
#define MIXATTN_POSIX_FILES 1
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#else
#define MIXATTN_POSIX_FILES 0
#include <fstream>
#endif

MIXATTN_BEGIN_NAMESPACE
namespace detail {

// Integers and scalars are written little-endian whatever the host, byte by byte, so a file is
// portable between hosts of either byte order. Out is a std::ostream or a FileReplacer.
template <class U, class Out>
void put_le(Out& os, U value) {
  static_assert(std::is_unsigned<U>::value, "put_le writes unsigned integers");
  unsigned char bytes[sizeof(U)];
  for (std::size_t i = 0; i < sizeof(U); ++i)
    bytes[i] = static_cast<unsigned char>(value >> (8 * i));
  os.write(reinterpret_cast<const char*>(bytes), sizeof(U));
}

template <class U>
bool get_le(std::istream& is, U& value) {
  static_assert(std::is_unsigned<U>::value, "get_le reads unsigned integers");
  unsigned char bytes[sizeof(U)];
  if (!is.read(reinterpret_cast<char*>(bytes), sizeof(U))) return false;
  value = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) value |= static_cast<U>(bytes[i]) << (8 * i);
  return true;
}

/// The unsigned integer type with the bytes of T (float -> uint32, double -> uint64).
template <class T>
using bits_t = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;

template <class T, class Out>
void put_scalar(Out& os, T x) {
  bits_t<T> b;
  std::memcpy(&b, &x, sizeof(T));
  put_le(os, b);
}

template <class T>
bool get_scalar(std::istream& is, T& x) {
  bits_t<T> b;
  if (!get_le(is, b)) return false;
  std::memcpy(&x, &b, sizeof(T));
  return true;
}

/// "<fn>: <path>: <what>" for file errors.
inline std::string concat_msg(const std::string& fn, const std::string& path,
                              const std::string& what) {
  return fn + ": " + path + ": " + what;
}

[[noreturn]] inline void raise_io(const std::string& what) {
#if MIXATTN_HAS_EXCEPTIONS
  throw std::runtime_error(what);
#else
  std::fprintf(stderr, "mixattn: %s\n", what.c_str());
  std::abort();
#endif
}

/// Reads block p's header and data into `staged` (resized to the model's block only once the
/// file's name and shape match it: what the file declares never sizes an allocation).
template <class T>
void load_block(std::istream& is, const std::string& fn, const std::string& path, std::size_t p,
                const std::string& model_name, Index model_rows, Index model_cols,
                Matrix<T>& staged) {
  using ::mixattn::detail::concat;
  constexpr std::uint32_t longest_name_read = 256;  // for the message; longer cannot match
  std::uint32_t len = 0;
  if (!get_le(is, len))
    raise_io(concat_msg(fn, path, concat("parameter ", p, ": truncated name length")));
  if (len > longest_name_read && len != model_name.size())
    raise_io(concat_msg(fn, path,
                        concat("parameter ", p, " has a name of ", len, " bytes in the file but '",
                               model_name, "' in the model")));
  std::string name(len, '\0');
  std::uint64_t rows = 0, cols = 0;
  if (!is.read(&name[0], len) || !get_le(is, rows) || !get_le(is, cols))
    raise_io(concat_msg(fn, path, concat("parameter ", p, ": truncated")));
  if (name != model_name || rows != static_cast<std::uint64_t>(model_rows) ||
      cols != static_cast<std::uint64_t>(model_cols))
    raise_io(concat_msg(
        fn, path,
        concat("parameter ", p, " is '", name, "' ", rows, " x ", cols, " in the file but '",
               model_name, "' ", model_rows, " x ", model_cols, " in the model")));
  staged.resize(model_rows, model_cols);
  // The scalars' bytes straight into the staged block, then each put in host order.
  const std::streamsize bytes =
      static_cast<std::streamsize>(staged.size()) * static_cast<std::streamsize>(sizeof(T));
  if (!is.read(reinterpret_cast<char*>(staged.data()), bytes))
    raise_io(concat_msg(fn, path, concat("parameter ", p, " ('", name, "'): truncated data")));
  for (Index i = 0; i < staged.size(); ++i) {
    unsigned char raw[sizeof(T)];
    std::memcpy(raw, staged.data() + i, sizeof(T));
    bits_t<T> v = 0;
    for (std::size_t k = 0; k < sizeof(T); ++k) v |= static_cast<bits_t<T>>(raw[k]) << (8 * k);
    std::memcpy(staged.data() + i, &v, sizeof(T));
  }
}

/// Magic, version, scalar size and block count of a parameter file, checked against the model.
inline void load_header(std::istream& is, const std::string& fn, const std::string& path,
                        const char (&file_magic)[8], std::uint32_t file_version,
                        std::size_t scalar_bytes, std::size_t blocks) {
  using ::mixattn::detail::concat;
  char magic[sizeof(file_magic)];
  if (!is.read(magic, sizeof(magic)) || std::memcmp(magic, file_magic, sizeof(magic)) != 0)
    raise_io(concat_msg(fn, path, "not a mixattn parameter file (bad magic)"));
  std::uint32_t version = 0, scalar_size = 0;
  std::uint64_t count = 0;
  if (!get_le(is, version) || !get_le(is, scalar_size) || !get_le(is, count))
    raise_io(concat_msg(fn, path, "truncated header"));
  if (version != file_version)
    raise_io(concat_msg(
        fn, path, concat("format version ", version, " but this library reads ", file_version)));
  if (scalar_size != scalar_bytes)
    raise_io(concat_msg(fn, path,
                        concat("scalars of ", scalar_size, " bytes but the model uses ",
                               scalar_bytes, "-byte scalars")));
  if (count != blocks)
    raise_io(concat_msg(fn, path,
                        concat(count, " parameters in the file but ", blocks, " in the model")));
}

/// Test hook (tests/test_checkpoint.cpp): a failure injected into every FileReplacer until
/// reset, as a full or failing disk would give it. Programs never set it; not thread-safe.
struct ReplaceFault {
  long long fail_after_bytes = -1;  ///< >= 0: writing fails with ENOSPC past this many bytes
  const char* fail_step = nullptr;  ///< "fsync", "close" or "rename": that step fails with EIO
};
inline ReplaceFault& replace_fault() {
  static ReplaceFault fault;
  return fault;
}

#if MIXATTN_POSIX_FILES

/// Writes a file that replaces `path` whole or not at all: the bytes go to a temporary file in
/// the destination's directory (so rename() stays within one file system), which is flushed,
/// fsync'ed, closed and renamed over the destination, then the directory is fsync'ed. A crash
/// or a full disk at any point leaves the destination's old contents (or no file, if there was
/// none); readers see the old file or the new one, never a mixture. The first failure is kept
/// (error(): "<step>: <errno text>"); abandon() (also the destructor's) removes the temporary.
/// A symbolic link at `path` is followed: its target is replaced, as writing through it would.
class FileReplacer {
 public:
  explicit FileReplacer(const std::string& path) : path_(path) {}
  FileReplacer(const FileReplacer&) = delete;
  FileReplacer& operator=(const FileReplacer&) = delete;
  ~FileReplacer() { abandon(); }

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

  /// Creates the temporary file; false (with error()) when it cannot.
  bool open() {
    if (!resolve_target()) return false;
    static std::atomic<unsigned long> counter{0};
    for (int attempt = 0; attempt < 100; ++attempt) {
      temp_ = target_ + ".tmp." + std::to_string(static_cast<long>(::getpid())) + "." +
              std::to_string(counter.fetch_add(1));
      fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0 || errno != EEXIST) break;
    }
    if (fd_ < 0) {
      temp_.clear();
      return fail("cannot create a temporary file beside it");
    }
    // Keep an existing destination's permission bits (best effort: the data matter more).
    if (had_target_) (void)::fchmod(fd_, target_mode_ & 07777);
    return true;
  }

  /// Appends n bytes (buffered); after a failure does nothing.
  void write(const char* data, std::streamsize n) {
    while (ok() && n > 0) {
      const std::size_t take = std::min(static_cast<std::size_t>(n), sizeof(buffer_) - used_);
      std::memcpy(buffer_ + used_, data, take);
      used_ += take;
      data += take;
      n -= static_cast<std::streamsize>(take);
      if (used_ == sizeof(buffer_)) flush_buffer();
    }
  }

  /// Flushes, syncs and closes the temporary and renames it over the destination; false (with
  /// error(), the temporary still there for abandon()) on the first failure.
  bool commit() {
    if (!ok() || fd_ < 0) return false;
    flush_buffer();
    if (!ok()) return false;
    if (::fsync(fd_) != 0 || injected("fsync")) return fail("fsync of the temporary file failed");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 || injected("close")) return fail("close of the temporary file failed");
    if (injected("rename") || ::rename(temp_.c_str(), target_.c_str()) != 0)
      return fail("cannot rename the temporary file over it");
    temp_.clear();
    sync_directory();
    return ok();
  }

  /// Closes and removes the temporary file, if any; the destination is untouched.
  void abandon() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (!temp_.empty()) ::unlink(temp_.c_str());
    temp_.clear();
  }

 private:
  bool fail(const char* what) {
    if (error_.empty()) error_ = std::string(what) + ": " + std::strerror(errno);
    return false;
  }
  static bool injected(const char* step) {
    const char* want = replace_fault().fail_step;
    if (want == nullptr || std::strcmp(want, step) != 0) return false;
    errno = EIO;
    return true;
  }

  /// The file to replace: `path` itself or the target of the link it is. Only regular files
  /// are replaced (a device or a pipe would be swapped for a regular file).
  bool resolve_target() {
    target_ = path_;
    struct stat st;
    if (::lstat(path_.c_str(), &st) != 0) {
      if (errno == ENOENT) return true;  // a new file
      return fail("cannot inspect the destination");
    }
    if (S_ISLNK(st.st_mode)) {
      char* real = ::realpath(path_.c_str(), nullptr);
      if (real == nullptr) return fail("cannot resolve the symbolic link");
      target_ = real;
      std::free(real);
      if (::stat(target_.c_str(), &st) != 0) return fail("cannot inspect the link's target");
    }
    if (!S_ISREG(st.st_mode)) {
      errno = EINVAL;
      return fail("not a regular file; only regular files are replaced");
    }
    had_target_ = true;
    target_mode_ = st.st_mode;
    return true;
  }

  void flush_buffer() {
    std::size_t done = 0;
    while (ok() && done < used_) {
      std::size_t n = used_ - done;
      const long long limit = replace_fault().fail_after_bytes;
      if (limit >= 0 && written_ + static_cast<long long>(n) > limit)
        n = static_cast<std::size_t>(std::max(0LL, limit - written_));
      const ::ssize_t w = n > 0 ? ::write(fd_, buffer_ + done, n) : (errno = ENOSPC, -1);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        fail("write failed");
        break;
      }
      done += static_cast<std::size_t>(w);
      written_ += w;
    }
    used_ = 0;
  }

  /// Makes the rename itself durable. File systems that cannot sync a directory (EINVAL) are
  /// left alone: the rename has happened and the data are on disk.
  void sync_directory() {
    const std::size_t slash = target_.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : target_.substr(0, slash + 1);
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
      fail("the file was replaced but its directory could not be opened to sync it");
      return;
    }
    if (::fsync(fd) != 0 && errno != EINVAL)
      fail("the file was replaced but its directory could not be synced");
    ::close(fd);
  }

  std::string path_, target_, temp_, error_;
  bool had_target_ = false;
  mode_t target_mode_ = 0;
  int fd_ = -1;
  long long written_ = 0;
  std::size_t used_ = 0;
  char buffer_[1 << 14];  // 16 KiB: few system calls, a small object on the stack
};

#else  // not POSIX: the file is written in place, as std::ofstream does (no crash safety)

class FileReplacer {
 public:
  explicit FileReplacer(const std::string& path) : path_(path) {}
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  bool open() {
    os_.open(path_, std::ios::binary | std::ios::trunc);
    if (!os_) error_ = "cannot open the file for writing";
    return ok();
  }
  void write(const char* data, std::streamsize n) {
    if (ok() && !os_.write(data, n)) error_ = "write failed";
  }
  bool commit() {
    if (ok() && !os_.flush()) error_ = "write failed";
    os_.close();
    return ok();
  }
  void abandon() { os_.close(); }

 private:
  std::string path_, error_;
  std::ofstream os_;
};

#endif

}  // namespace detail
MIXATTN_END_NAMESPACE
