// mixattn/detail/layer_io.hpp — byte-level helpers of the parameter file format (layer.hpp).
#pragma once
#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

// Integers and scalars are written little-endian whatever the host, byte by byte, so a file is
// portable between hosts of either byte order.
template <class U>
void put_le(std::ostream& os, U value) {
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

template <class T>
void put_scalar(std::ostream& os, T x) {
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

}  // namespace detail
MIXATTN_END_NAMESPACE
