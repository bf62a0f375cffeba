// Shared machinery of the libFuzzer targets: a byte decoder that turns the fuzzer's input into
// shapes, options and matrices (with NaN, Inf, huge, tiny, zero and duplicated rows injected), and
// the oracle every call is held to:
//
//   - valid shapes and options, finite inputs      -> returns, right shape, finite entries
//                                                     (std::domain_error tolerated only when an
//                                                     input is so large that a product overflows)
//   - bad shapes or options                        -> throws std::invalid_argument
//   - non-finite input with check_finite on        -> throws std::domain_error (or
//                                                     std::invalid_argument if shapes are bad too)
//   - non-finite input with check_finite off       -> returns something of the right shape
//   - anything else (other exception types, a valid call that throws, an invalid call that
//     returns, a wrong shape, a non-finite result)  -> __builtin_trap(), so libFuzzer keeps it.
//
// Inputs are compared with copies after every call: nothing may be written through them.
#pragma once

#include <mixattn/core.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace mixattn::fuzz {

/// Prints why the oracle failed, then traps (a crash libFuzzer records with its input).
[[noreturn]] inline void fail(const char* why, const char* detail = "") {
  std::fprintf(stderr, "mixattn fuzz oracle: %s %s\n", why, detail);
  std::fflush(stderr);
  __builtin_trap();
}

#define MIXATTN_FUZZ_CHECK(cond, why) \
  ((cond) ? static_cast<void>(0) : ::mixattn::fuzz::fail(why, #cond))

/// Largest |entry| of a matrix or expression, in double; 0 for an empty one.
template <class D>
double max_abs(const Eigen::DenseBase<D>& m) {
  return m.size() == 0 ? 0.0 : static_cast<double>(m.derived().cwiseAbs().maxCoeff());
}

/// MIXATTN_FUZZ_VERBOSE=1 in the environment prints each decoded case (to replay a crash).
inline bool verbose() {
  static const bool on = std::getenv("MIXATTN_FUZZ_VERBOSE") != nullptr;
  return on;
}

/// Sequential reader over the fuzzer's bytes; reads past the end return 0, so every input decodes.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint16_t u16() { return static_cast<std::uint16_t>(u8() | (u8() << 8)); }
  /// Uniform-ish integer in [lo, hi].
  Index range(Index lo, Index hi) { return lo + static_cast<Index>(u8() % (hi - lo + 1)); }
  bool flag() { return (u8() & 1) != 0; }
  template <class E, std::size_t N>
  E pick(const E (&choices)[N]) {
    return choices[u8() % N];
  }
  bool exhausted() const { return pos_ >= size_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// What the decoder put into the inputs, which decides what the oracle expects.
struct Flags {
  bool non_finite = false;  // a NaN or Inf somewhere the operator checks
  bool extreme = false;     // a finite value so large that products may overflow T
  double max_abs = 0;       // largest finite |x| seen, for operator-specific bounds
  void merge(const Flags& o) {
    non_finite |= o.non_finite;
    extreme |= o.extreme;
    max_abs = std::max(max_abs, o.max_abs);
  }
};

/// |x| above this may overflow a product or a square in T: float 1e12 (squares 1e24, times r and
/// 1/var_floor 1e4 stays below 3.4e38 only up to about 1e16), double 1e100.
template <class T>
constexpr double extreme_threshold() {
  return std::is_same<T, float>::value ? 1e12 : 1e100;
}

template <class T>
void classify(double x, Flags& f) {
  if (!std::isfinite(x)) {
    f.non_finite = true;
    return;
  }
  if (std::abs(x) > extreme_threshold<T>()) f.extreme = true;
  f.max_abs = std::max(f.max_abs, std::abs(x));
}

/// One scalar from a menu of ordinary and hostile values.
template <class T>
T special_value(std::uint8_t kind) {
  constexpr double big = static_cast<double>(std::numeric_limits<T>::max());
  switch (kind % 15) {
    case 14:
      return std::numeric_limits<T>::max();  // the overflow edge
    case 0:
      return std::numeric_limits<T>::quiet_NaN();
    case 1:
      return std::numeric_limits<T>::infinity();
    case 2:
      return -std::numeric_limits<T>::infinity();
    case 3:
      return static_cast<T>(big / 4);  // extreme
    case 4:
      return static_cast<T>(-1e30);  // extreme in float, not in double
    case 5:
      return std::numeric_limits<T>::denorm_min();  // tiny
    case 6:
      return std::numeric_limits<T>::min();  // smallest normal
    case 7:
      return T(-0.0);
    case 8:
      return T(1e6);
    case 9:
      return T(-1e4);
    case 10:
      return T(1e-20);
    case 11:
      return T(0);
    case 12:
      return T(1);
    default:
      return T(-3.5);
  }
}

/// rows x cols: a seeded N(0, scale^2) fill (scale from a menu that includes 0 and 1e-20), then
/// up to 7 edits, each a special value at one entry, a zeroed row, or a row copied from another
/// (identical keys). Keeps fuzz inputs a few bytes long whatever the shape.
template <class T>
Matrix<T> matrix(Bytes& in, Index rows, Index cols, Flags& flags) {
  const std::uint8_t header = in.u8();
  const std::uint16_t seed = in.u16();
  static constexpr double scales[] = {1, 1e-3, 1e2, 1e4, 1e-20, 1e8, 0, 3};
  const double scale = scales[header & 7];
  Matrix<T> m(rows, cols);
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<T>(scale * dist(rng));
  const int edits = (header >> 3) & 7;
  for (int e = 0; e < edits; ++e) {
    const std::uint8_t kind = in.u8();
    const std::uint8_t a = in.u8(), b = in.u8(), c = in.u8();
    if (rows == 0 || cols == 0) continue;
    const Index i = a % rows, j = b % cols;
    if (kind < 200) {
      m(i, j) = special_value<T>(kind);
    } else if (kind < 228) {
      m.row(i).setZero();
    } else {
      m.row(i) = m.row(c % rows).eval();
    }
  }
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) classify<T>(static_cast<double>(m(i, j)), flags);
  return m;
}

template <class T>
Vector<T> vector(Bytes& in, Index size, Flags& flags) {
  Matrix<T> m = matrix<T>(in, size, 1, flags);
  return Vector<T>(Eigen::Map<const Vector<T>>(m.data(), size));
}

/// An input matrix, optionally stored as a block inside a wider buffer so the operator reads it
/// through a non-trivial outer stride, as a caller's row block would be.
template <class T>
struct Strided {
  Matrix<T> buffer;
  Index rows = 0, cols = 0, offset = 0;
  Eigen::Block<const Matrix<T>> view() const { return buffer.block(0, offset, rows, cols); }
};

template <class T>
Strided<T> strided(const Matrix<T>& m, bool padded) {
  Strided<T> s;
  s.rows = m.rows();
  s.cols = m.cols();
  // An empty buffer has no storage to offset into (Eigen would add to a null pointer).
  if (m.rows() == 0) padded = false;
  s.offset = padded ? 1 : 0;
  const Index pad = padded ? 3 : 0;
  s.buffer = Matrix<T>::Constant(m.rows(), m.cols() + pad, std::numeric_limits<T>::quiet_NaN());
  s.buffer.block(0, s.offset, m.rows(), m.cols()) = m;
  return s;
}

/// Bitwise equality (NaN payloads included): "unchanged" means unchanged.
template <class A, class B>
bool same_bits(const Eigen::DenseBase<A>& a, const Eigen::DenseBase<B>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  using S = typename A::Scalar;
  static_assert(std::is_same<S, typename B::Scalar>::value, "same scalar type");
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j) {
      const S x = a.derived().coeff(i, j), y = b.derived().coeff(i, j);
      if (std::memcmp(&x, &y, sizeof(S)) != 0) return false;
    }
  return true;
}

/// Bitwise equality where neither entry is NaN, and NaN where the other is NaN, whatever either
/// NaN's sign and payload: for results that two different pieces of code computed from the same
/// terms (a sum of two NaNs returns one operand's NaN, and which one is the compiler's choice).
template <class A, class B>
bool same_values(const Eigen::DenseBase<A>& a, const Eigen::DenseBase<B>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  using S = typename A::Scalar;
  static_assert(std::is_same<S, typename B::Scalar>::value, "same scalar type");
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j) {
      const S x = a.derived().coeff(i, j), y = b.derived().coeff(i, j);
      if (std::isnan(x) && std::isnan(y)) continue;
      if (std::memcmp(&x, &y, sizeof(S)) != 0) return false;
    }
  return true;
}

/// What a call is expected to do, from the decoder's knowledge of the inputs.
struct Expect {
  bool invalid = false;      // bad shapes or options: std::invalid_argument required
  bool check_finite = true;  // the options' check_finite
  // Tolerated for ovq::backward only: with check_finite off, its consistency check compares beta
  // with saved.beta, and a NaN beta cannot be told from a different NaN, so it is rejected with
  // invalid_argument. (The records' fingerprints hash bit patterns, so NaN inputs match
  // themselves.)
  bool unchecked_nan_may_reject = false;
  Flags flags;
  /// Non-finite input that the operator was asked to check: std::domain_error required.
  bool must_throw_domain() const { return !invalid && check_finite && flags.non_finite; }
  /// Valid call whose result must be finite: any finite input with checks on (huge values may
  /// only be reported as std::domain_error, never returned as NaN or inf); with checks off,
  /// moderate inputs.
  bool must_be_finite() const {
    return !invalid && !flags.non_finite && (check_finite || !flags.extreme);
  }
};

enum class Outcome { returned, invalid_argument, domain_error };

/// Runs `call` and enforces the oracle's exception half; the caller checks results when
/// Outcome::returned. Any exception other than the two documented ones traps.
template <class F>
Outcome run(const Expect& ex, F&& call) {
  Outcome got;
  std::string what = "(returned)";
  try {
    call();
    got = Outcome::returned;
  } catch (const std::invalid_argument& e) {
    got = Outcome::invalid_argument;
    what = e.what();
  } catch (const std::domain_error& e) {
    got = Outcome::domain_error;
    what = e.what();
  } catch (const std::exception& e) {
    fail("undocumented exception type:", e.what());
  } catch (...) {
    fail("non-std exception");
  }
  if (verbose()) std::cerr << "outcome: " << what << "\n";
  if (ex.invalid && ex.check_finite && ex.flags.non_finite) {
    // Both a bad argument and a non-finite one: which is reported first is the operator's choice.
    MIXATTN_FUZZ_CHECK(got != Outcome::returned, "bad arguments must throw");
  } else if (ex.invalid) {
    MIXATTN_FUZZ_CHECK(got == Outcome::invalid_argument,
                       "bad shapes/options must throw invalid_argument");
  } else if (ex.must_throw_domain()) {
    MIXATTN_FUZZ_CHECK(got == Outcome::domain_error, "non-finite input must throw domain_error");
  } else if (ex.flags.non_finite) {
    // check_finite off: the caller took responsibility; any result, but no crash and no throw
    // of invalid_argument for valid shapes.
    MIXATTN_FUZZ_CHECK(got != Outcome::invalid_argument || ex.unchecked_nan_may_reject,
                       "valid call threw invalid_argument");
  } else if (ex.flags.extreme) {
    // Finite but huge: overflow may be reported as domain_error.
    MIXATTN_FUZZ_CHECK(got != Outcome::invalid_argument, "valid call threw invalid_argument");
  } else {
    MIXATTN_FUZZ_CHECK(got == Outcome::returned, "valid finite call threw");
  }
  return got;
}

/// Product of non-negative magnitudes in which a zero factor wins: 0 when any factor is 0 (an
/// empty matrix's max_abs), so that 0 x inf never makes a bound NaN.
inline double magnitude_product(std::initializer_list<double> factors) {
  double p = 1;
  for (const double f : factors) {
    if (f == 0) return 0;
    p *= f;
  }
  return p;
}

/// Result checks for a returned call.
template <class D>
void check_result(const Eigen::DenseBase<D>& out, Index rows, Index cols, bool must_be_finite,
                  const char* what) {
  if (out.rows() != rows || out.cols() != cols) fail("wrong result shape:", what);
  if (must_be_finite && !out.derived().allFinite()) fail("non-finite result:", what);
}

/// Cuts [0, n) into up to `max_pieces` consecutive pieces (empty ones included) from the bytes:
/// the returned lengths sum to n.
inline std::vector<Index> pieces(Bytes& in, Index n, int max_pieces) {
  const int count = 1 + static_cast<int>(in.u8() % max_pieces);
  std::vector<Index> out;
  Index left = n;
  for (int p = 0; p + 1 < count; ++p) {
    const Index len = left == 0 ? 0 : static_cast<Index>(in.u8()) % (left + 1);
    out.push_back(len);
    left -= len;
  }
  out.push_back(left);
  return out;
}

/// Whether `text` contains `name` as a whole identifier: "q_offsets" does not name `offsets`.
inline bool names(const std::string& text, const std::string& name) {
  const auto ident = [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_';
  };
  for (std::size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    const std::size_t end = at + name.size();
    if ((at == 0 || !ident(text[at - 1])) && (end == text.size() || !ident(text[end])))
      return true;
  }
  return false;
}

/// Runs `call` expecting std::invalid_argument whose message names `name` (as a whole
/// identifier); anything else (a return, another exception, a message that does not name the
/// argument) fails.
template <class F>
void expect_invalid_naming(const char* name, F&& call, const char* what) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    if (verbose()) std::cerr << "refused: " << e.what() << "\n";
    if (!names(e.what(), name)) fail(what, e.what());
    return;
  } catch (const std::exception& e) {
    fail("wrong exception type:", e.what());
  }
  fail("an invalid call returned:", what);
}

}  // namespace mixattn::fuzz

/// The libFuzzer entry point of a target whose cases are `run_case<float>(Bytes&)` and
/// `run_case<double>(Bytes&)`: the first decoded flag picks the scalar type.
#define MIXATTN_FUZZ_ENTRY_POINT(run_case)                                            \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    ::mixattn::fuzz::Bytes in(data, size);                                            \
    if (in.flag())                                                                    \
      run_case<double>(in);                                                           \
    else                                                                              \
      run_case<float>(in);                                                            \
    return 0;                                                                         \
  }
