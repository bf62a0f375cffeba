// mixattn/layer_io.hpp — the parameter file: save_parameters / load_parameters over a list of
// named blocks (a layer's parameters(), or any other).
#pragma once

#include "mixattn/core.hpp"
#include "mixattn/detail/layer_io.hpp"
#include "mixattn/named_block.hpp"

#include <cstdint>
#include <fstream>
#include <string>
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

}  // namespace layer
MIXATTN_END_NAMESPACE
