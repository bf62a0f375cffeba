// mixattn/detail/common/fingerprint.hpp — the position-sensitive fingerprint that ties a backward's
// record to the data its forward was given, and the error raised when they differ.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Position-sensitive fingerprint of values, for checking that a backward is given the data its
/// forward saw (Saved / Cache records). The bit patterns of the scalars are fed row by row into
/// 64 independent 32-bit lanes (word j of a row goes to lane j mod 64), each stepped by
/// h = (h ^ word) * odd; h ^= h >> 15 -- a bijection of h, so a change in one word always changes
/// its lane, and a move of values changes the lanes they land in or their order along a lane.
/// The lanes vectorise (fixed count, independent chains): O(size) at a fraction of a nanosecond
/// per scalar, small next to any operator. Not cryptographic: it catches other data, not an
/// adversary. NaN payloads hash like any bits, so unchecked non-finite inputs still match.
class Fingerprint {
 public:
  static constexpr int lanes = 64;

  Fingerprint() {
    for (int l = 0; l < lanes; ++l) h_[l] = 0x9E3779B9u * static_cast<std::uint32_t>(l + 1);
  }

  /// Adds rows x cols scalars (float or double) at `data`, rows `stride` scalars apart.
  template <class S>
  Fingerprint& add(const S* data, Index rows, Index cols, Index stride) {
    std::uint32_t bad = 0;
    return add_impl<S, false>(data, rows, cols, stride, bad);
  }

  /// The same, and whether every scalar is finite, read off the bit patterns in the same pass
  /// (a float whose exponent bits are all set, or a double's in its high word, is inf or NaN):
  /// a backward's record check and its inputs' finiteness check in one read of the inputs.
  template <class S>
  Fingerprint& add_checked(const S* data, Index rows, Index cols, Index stride, bool& finite) {
    static_assert(std::is_same<S, float>::value || std::is_same<S, double>::value,
                  "IEEE float or double");
    MIXATTN_ASSERT(sizeof(S) == 4 || lane_ % 2 == 0);  // a double's high word on an odd lane
    std::uint32_t bad = 0;
    add_impl<S, true>(data, rows, cols, stride, bad);
    finite = bad == 0;
    return *this;
  }

  /// add_checked for a row-major matrix or view (rows contiguous).
  template <class Derived>
  Fingerprint& add_checked(const Eigen::DenseBase<Derived>& x, bool& finite) {
    const Derived& d = x.derived();
    static_assert(Derived::Flags & Eigen::RowMajorBit, "fingerprints read row-major storage");
    return add_checked(d.data(), d.rows(), d.cols(), d.outerStride(), finite);
  }

  /// Adds a row-major matrix or view (rows contiguous), or a vector.
  template <class Derived>
  Fingerprint& add(const Eigen::DenseBase<Derived>& x) {
    const Derived& d = x.derived();
    if (Derived::IsVectorAtCompileTime && d.innerStride() == 1)
      return add(d.data(), 1, d.size(), 0);
    static_assert(Derived::IsVectorAtCompileTime || (Derived::Flags & Eigen::RowMajorBit),
                  "fingerprints read row-major storage");
    return add(d.data(), d.rows(), d.cols(), d.outerStride());
  }

  template <class S, std::enable_if_t<std::is_arithmetic<S>::value, int> = 0>
  Fingerprint& add(S value) {
    return add(&value, 1, 1, 0);
  }

  std::uint64_t value() const {
    std::uint64_t f = words_;
    for (int l = 0; l < lanes; ++l) f = mix64(f ^ h_[l]);
    return f;
  }

 private:
  static std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finaliser
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }
  static std::uint32_t step(std::uint32_t h, std::uint32_t w) {
    h = (h ^ w) * 0x85EBCA6Bu;
    return h ^ (h >> 15);
  }
  template <class S, bool Check>
  Fingerprint& add_impl(const S* data, Index rows, Index cols, Index stride, std::uint32_t& bad) {
    static_assert(sizeof(S) % 4 == 0, "scalars of a multiple of 4 bytes");
    constexpr Index per = static_cast<Index>(sizeof(S) / 4);
    mix_size(rows, cols);
    std::uint32_t h[lanes], buf[lanes] = {}, flags[lanes] = {};
    std::memcpy(h, h_, sizeof(h));
    const auto* bytes = reinterpret_cast<const unsigned char*>(data);
    if (stride == cols || rows == 1) {
      add_words<S, Check>(h, buf, flags, bytes, rows * cols * per);  // contiguous: one stream
    } else {
      for (Index i = 0; i < rows; ++i)
        add_words<S, Check>(h, buf, flags, bytes + i * stride * Index(sizeof(S)), cols * per);
    }
    std::memcpy(h_, h, sizeof(h));
    words_ += static_cast<std::uint64_t>(rows * cols * per);
    for (int l = 0; l < lanes; ++l) bad |= flags[l];
    return *this;
  }
  /// The exponent bits of the word on lane l: a float's, a double's high word (odd lanes), or
  /// none (a double's low word).
  template <class S>
  static constexpr std::uint32_t exponent_mask(int l) {
    return sizeof(S) == 4 ? 0x7F800000u : (l % 2 == 1 ? 0x7FF00000u : 0u);
  }
  void mix_size(Index rows, Index cols) {
    h_[0] = step(h_[0], static_cast<std::uint32_t>(rows));
    h_[1] = step(h_[1], static_cast<std::uint32_t>(cols));
  }
  // Steps the lanes h (a local copy of h_: stores to it cannot alias the data, so the loops
  // vectorise) with n more words of the stream: word w of the stream goes to lane w mod `lanes`,
  // whatever the storage, so equal values give equal fingerprints in any layout.
  // With Check, flags[l] collects the exponent bits of the words on lane l that have all of
  // them set (an inf or NaN), as m & -((w & m) == m) with the lane's mask m: branch-free
  // arithmetic in the step's loop, so that both vectorise together.
  template <class S, bool Check>
  void add_words(std::uint32_t* MIXATTN_RESTRICT h, std::uint32_t* MIXATTN_RESTRICT buf,
                 std::uint32_t* MIXATTN_RESTRICT flags, const unsigned char* MIXATTN_RESTRICT p,
                 Index n) {
    std::uint32_t mask[lanes];
    for (int l = 0; l < lanes; ++l) mask[l] = Check ? exponent_mask<S>(l) : 0u;
    Index j = 0;
    while (j < n) {
      if (lane_ == 0)
        for (; j + lanes <= n; j += lanes)
          for (int l = 0; l < lanes; ++l) {
            const std::uint32_t w = word(p + 4 * (j + l));
            h[l] = step(h[l], w);
            if constexpr (Check)
              flags[l] |= mask[l] & (0u - static_cast<std::uint32_t>((w & mask[l]) == mask[l]));
          }
      // A partial run of lanes [o, o + take): staged in buf so that the loop keeps its fixed
      // length (and vectorises at -O2 too); the other lanes keep their values.
      const int o = lane_;
      const int take = static_cast<int>(std::min<Index>(lanes - o, n - j));
      std::memcpy(buf + o, p + 4 * j, static_cast<std::size_t>(4 * take));
      for (int l = 0; l < lanes; ++l) {
        const bool in = l >= o && l < o + take;
        const std::uint32_t stepped = step(h[l], buf[l]);
        h[l] = in ? stepped : h[l];
        if constexpr (Check)
          flags[l] |= in && (buf[l] & mask[l]) == mask[l] ? mask[l] : 0u;  // once per call
      }
      j += take;
      lane_ = (o + take) % lanes;
    }
  }
  static std::uint32_t word(const unsigned char* p) {
    std::uint32_t w;
    std::memcpy(&w, p, 4);
    return w;
  }

  std::uint32_t h_[lanes];
  int lane_ = 0;
  std::uint64_t words_ = 0;
};

/// Fingerprint of one matrix, vector or scalar.
template <class X>
std::uint64_t fingerprint(const X& x) {
  return Fingerprint().add(x).value();
}

/// The fingerprints of q, k and v, in out[0..2].
template <class T>
void qkv_fingerprints(const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v, std::uint64_t* out) {
  out[0] = fingerprint(q);
  out[1] = fingerprint(k);
  out[2] = fingerprint(v);
}

/// The error every backward raises for a record filled from other data.
[[noreturn]] inline void raise_other_data(const char* fn, const char* record, const char* which) {
  raise_invalid_argument(concat(fn, ": ", record, " came from other data: ", which,
                                " is different from what its forward was given (the record's "
                                "fingerprint does not match); run forward on these inputs again"));
}

/// One fingerprint of a record's check: what the record kept, what the call gives now, and what
/// it is the fingerprint of (for the message).
struct FingerprintCheck {
  std::uint64_t kept, now;
  const char* what;
};

/// The one check every backward makes of its record (a Saved, a layer's Cache): the first
/// fingerprint that differs raises raise_other_data naming it.
inline void check_record(const char* fn, const char* record,
                         std::initializer_list<FingerprintCheck> checks) {
  for (const FingerprintCheck& c : checks)
    if (c.kept != c.now) raise_other_data(fn, record, c.what);
}

}  // namespace detail
MIXATTN_END_NAMESPACE
