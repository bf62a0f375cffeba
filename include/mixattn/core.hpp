// mixattn/core.hpp — common types, errors, version and configuration macros.
//
// Rows are tokens; matrices are row-major (SPEC.md, preamble). Inputs are taken as
// `const ConstMatrixRef<T>&` so that a caller's row-major buffer (a Matrix, a Map, a row block)
// is read in place. T is never deduced from a ConstMatrixRef: it comes from the argument that
// carries it (a Mixture<T>, a State<T>&, a Saved<T>) or is written explicitly.
#pragma once
#define MIXATTN_CORE_HPP_INCLUDED  // detail/internal_header_check.hpp tests it

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

// The one definition of the version: CMakeLists.txt reads these three lines.
#define MIXATTN_VERSION_MAJOR 0
#define MIXATTN_VERSION_MINOR 1
#define MIXATTN_VERSION_PATCH 0
#define MIXATTN_STRINGIFY_(x) #x
#define MIXATTN_STRINGIFY(x) MIXATTN_STRINGIFY_(x)
#define MIXATTN_VERSION_STRING             \
  MIXATTN_STRINGIFY(MIXATTN_VERSION_MAJOR) \
  "." MIXATTN_STRINGIFY(MIXATTN_VERSION_MINOR) "." MIXATTN_STRINGIFY(MIXATTN_VERSION_PATCH)

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
#define MIXATTN_HAS_EXCEPTIONS 1
#else
#define MIXATTN_HAS_EXCEPTIONS 0
#endif

// Internal invariants (never user input: that is validated and thrown). Overridable; on by
// default unless NDEBUG, force with MIXATTN_ENABLE_ASSERTS.
#ifndef MIXATTN_ASSERT
#if !defined(NDEBUG) || defined(MIXATTN_ENABLE_ASSERTS)
#define MIXATTN_ASSERT(cond) \
  ((cond) ? static_cast<void>(0) : ::mixattn::detail::assert_fail(#cond, __FILE__, __LINE__))
#else
#define MIXATTN_ASSERT(cond) static_cast<void>(0)
#endif
#endif

// Register-tile helpers whose arrays of vectors must stay in registers across the call: a kernel
// split into an accumulation and several epilogues is inlined whole.
#if defined(__GNUC__) || defined(__clang__)
#define MIXATTN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define MIXATTN_ALWAYS_INLINE inline
#endif

// A pointer parameter whose data no other pointer of the function reaches, so that loops storing
// through one and reading through another (a char pointer, which may alias anything) vectorise.
#if defined(__GNUC__) || defined(__clang__) || defined(_MSC_VER)
#define MIXATTN_RESTRICT __restrict
#else
#define MIXATTN_RESTRICT
#endif

// Every mixattn symbol carries the instruction set its translation unit is compiled for: all of
// the library lives in an inline namespace named after it (mixattn::arch_avx512bw::gma::forward
// is spelled mixattn::gma::forward), so TUs built with different -march flags get different
// symbols and each runs its own code. The name follows the compiler's ISA macros, at the
// granularity xsimd dispatches on; flags below that (e.g. -mavx512vbmi) do not change it.
// Eigen's own code (its products, allocator, ...) cannot be tagged: see detail/simd.hpp.
#ifndef MIXATTN_ARCH_NAMESPACE
#if defined(__AVX512BW__)
#define MIXATTN_ARCH_NAMESPACE arch_avx512bw
#elif defined(__AVX512DQ__)
#define MIXATTN_ARCH_NAMESPACE arch_avx512dq
#elif defined(__AVX512CD__)
#define MIXATTN_ARCH_NAMESPACE arch_avx512cd
#elif defined(__AVX512F__)
#define MIXATTN_ARCH_NAMESPACE arch_avx512f
#elif defined(__AVX2__) && defined(__FMA__)
#define MIXATTN_ARCH_NAMESPACE arch_fma3_avx2
#elif defined(__AVX2__)
#define MIXATTN_ARCH_NAMESPACE arch_avx2
#elif defined(__AVX__) && defined(__FMA__)
#define MIXATTN_ARCH_NAMESPACE arch_fma3_avx
#elif defined(__AVX__)
#define MIXATTN_ARCH_NAMESPACE arch_avx
#elif defined(__SSE4_2__)
#define MIXATTN_ARCH_NAMESPACE arch_sse4_2
#elif defined(__SSE4_1__)
#define MIXATTN_ARCH_NAMESPACE arch_sse4_1
#elif defined(__SSSE3__)
#define MIXATTN_ARCH_NAMESPACE arch_ssse3
#elif defined(__SSE3__)
#define MIXATTN_ARCH_NAMESPACE arch_sse3
#elif defined(__SSE2__) || defined(_M_X64)
#define MIXATTN_ARCH_NAMESPACE arch_sse2
#elif defined(__aarch64__) || defined(_M_ARM64)
#define MIXATTN_ARCH_NAMESPACE arch_neon64
#elif defined(__ARM_NEON)
#define MIXATTN_ARCH_NAMESPACE arch_neon
#else
#define MIXATTN_ARCH_NAMESPACE arch_scalar
#endif
#endif
#define MIXATTN_BEGIN_NAMESPACE \
  namespace mixattn {           \
  inline namespace MIXATTN_ARCH_NAMESPACE {
#define MIXATTN_END_NAMESPACE \
  }                           \
  }

// Compiling the operators once. Every operator is a template, compiled again in each translation
// unit (TU) that calls it. A program with many such TUs can compile the heavy part of each
// operator (its float and double workers, for the TU's instruction set) once: define
// MIXATTN_EXTERN_TEMPLATES in every TU that includes mixattn (the workers are then declared
// `extern template`), and build one more TU, with the same compiler flags, that defines
// MIXATTN_INSTANTIATE_TEMPLATES and includes <mixattn/mixattn.hpp>: it holds their definitions.
// Results are the same bits either way; only where the code is compiled changes.
#if defined(MIXATTN_INSTANTIATE_TEMPLATES)
#define MIXATTN_TEMPLATE_INSTANCE template
#elif defined(MIXATTN_EXTERN_TEMPLATES)
#define MIXATTN_TEMPLATE_INSTANCE extern template
#endif

MIXATTN_BEGIN_NAMESPACE

namespace detail {
template <class T>
struct identity {
  using type = T;
};
}  // namespace detail

using Index = Eigen::Index;

/// Row-major dense matrix; rows are tokens.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// Column vector.
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
/// Read-only view of a row-major matrix (inner stride 1, any outer stride): binds a Matrix, a
/// Map over a caller's buffer, or a row block without a copy. T is non-deduced on purpose.
template <class T>
using ConstMatrixRef = Eigen::Ref<const Matrix<typename detail::identity<T>::type>>;
/// Writable view of a row-major matrix, for outputs written in place.
template <class T>
using MatrixRef = Eigen::Ref<Matrix<typename detail::identity<T>::type>>;

namespace detail {

/// The scalar types the library computes in.
template <class S>
constexpr bool supported_scalar = std::is_same<S, float>::value || std::is_same<S, double>::value;

template <class A>
constexpr bool is_eigen = std::is_base_of<Eigen::EigenBase<A>, A>::value;

/// True when an argument of type A would bind to ConstMatrixRef<T> only through a hidden copy:
/// stored data of scalar T (a matrix, Map or block) that a row-major view cannot read in place,
/// i.e. column-major storage (Eigen's default MatrixXf) or a non-unit inner stride. Expressions
/// (a + b, 2 * x) are evaluated, as any Eigen function would; only a silent layout copy is refused.
template <class T, class A, class = void>
struct copied_layout : std::false_type {};
template <class T, class A>
struct copied_layout<T, A, std::enable_if_t<is_eigen<A> && !std::is_void<T>::value>>
    : std::integral_constant<bool, std::is_same<typename A::Scalar, T>::value&& bool(
                                       int(A::Flags) & Eigen::DirectAccessBit) &&
                                       !bool(Eigen::internal::traits<Eigen::Ref<const Matrix<T>>>::
                                                 template match<A>::MatchAtCompileTime)> {};

template <class T, class... A>
constexpr bool any_copied_layout = (copied_layout<T, A>::value || ...);

/// The compile-time refusals of every entry point, in one place: the catch-all overloads that
/// the conditions below select call this, and its static_asserts are the whole diagnostic.
template <class T, class... A>
constexpr bool refuse_arguments() {
  static_assert(supported_scalar<T>,
                "mixattn supports the scalar types float and double only (Eigen::half, "
                "Eigen::bfloat16 and other types are not supported: convert to float)");
  static_assert(!any_copied_layout<T, A...>,
                "mixattn reads row-major matrices (rows are tokens) in place; this argument is "
                "column-major (Eigen's default MatrixXf/MatrixXd, or a Map or column block of one) "
                "or strided, and would be copied on every call. Pass a mixattn::Matrix<T> "
                "(row-major) or a row-major Map or row block; for data kept column-major as d x N "
                "(tokens in columns) pass its .transpose(), which binds without a copy");
  return true;
}

/// Selects an entry point's catch-all overload: T is not supported or an argument would be
/// copied. Main overloads require supported_scalar<T> (enable_if_supported) so that an
/// unsupported T reports the static_assert alone.
template <class T, class... A>
using enable_if_refused =
    std::enable_if_t<(is_eigen<A> && ...) && (!supported_scalar<T> || any_copied_layout<T, A...>),
                     int>;
template <class T>
using enable_if_supported = std::enable_if_t<supported_scalar<T>, int>;

/// For entry points whose T is written explicitly or deduced from the arguments (reference::,
/// diagnostics::): T = void means "deduce from the first argument".
template <class T, class A>
using scalar_of = std::conditional_t<std::is_void<T>::value, typename A::Scalar, T>;
template <class T, class... A>
using enable_if_deduced_or_refused =
    std::enable_if_t<(is_eigen<A> && ...) && (std::is_void<T>::value || !supported_scalar<T> ||
                                              any_copied_layout<T, A...>),
                     int>;
/// Whether a deduced call may go on to the main overload (otherwise the static_asserts fired).
template <class S, class... A>
constexpr bool accepted = supported_scalar<S> && !any_copied_layout<S, A...>;

}  // namespace detail

/// Library version as "major.minor.patch".
inline const char* version() noexcept {
  return MIXATTN_VERSION_STRING;
}

namespace detail {

/// Type used to accumulate long sums (prefix states, counts, norms): double for float input.
template <class T>
using wide_t = std::conditional_t<std::is_same<T, float>::value, double, T>;

template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

[[noreturn]] inline void assert_fail(const char* cond, const char* file, int line) {
  std::fprintf(stderr, "mixattn: internal assertion failed: %s (%s:%d)\n", cond, file, line);
  std::abort();
}

/// Raise std::invalid_argument (or print and abort when exceptions are off).
[[noreturn]] inline void raise_invalid_argument(const std::string& what) {
#if MIXATTN_HAS_EXCEPTIONS
  throw std::invalid_argument(what);
#else
  std::fprintf(stderr, "mixattn: invalid argument: %s\n", what.c_str());
  std::abort();
#endif
}

/// Raise std::domain_error (or print and abort when exceptions are off).
[[noreturn]] inline void raise_domain_error(const std::string& what) {
#if MIXATTN_HAS_EXCEPTIONS
  throw std::domain_error(what);
#else
  std::fprintf(stderr, "mixattn: domain error: %s\n", what.c_str());
  std::abort();
#endif
}

/// A shape that prints as "rows x cols" in messages. Not a string: validation passes it to
/// require() on every call, and the message is built only on failure.
struct Shape {
  Index rows, cols;
};
inline std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << s.rows << " x " << s.cols;
}

/// "rows x cols" for messages (streamed; see Shape).
template <class Derived>
Shape shape_str(const Eigen::EigenBase<Derived>& m) {
  return Shape{m.rows(), m.cols()};
}

/// Throws std::invalid_argument "<fn>: <arg> ..." when `ok` is false. The message is built
/// only on failure.
template <class... Args>
inline void require(bool ok, const char* fn, Args&&... message) {
  if (!ok) raise_invalid_argument(concat(fn, ": ", std::forward<Args>(message)...));
}

/// The shapes every q, k, v operator without its own dimension needs (reference::, linear::):
/// r = q.cols() >= 1, k with r columns, v with k's rows, and at least one key for any query.
template <class T>
void check_qkv_shapes(const char* fn, const ConstMatrixRef<T>& q, const ConstMatrixRef<T>& k,
                      const ConstMatrixRef<T>& v) {
  require(q.cols() > 0, fn,
          "q has 0 columns: the key dimension r must be at least 1 (q: ", shape_str(q), ")");
  require(k.cols() == q.cols(), fn, "k has ", k.cols(), " columns but q has ", q.cols(),
          " (q: ", shape_str(q), ", k: ", shape_str(k), ")");
  require(v.rows() == k.rows(), fn, "v has ", v.rows(), " rows but k has ", k.rows(),
          " (k: ", shape_str(k), ", v: ", shape_str(v), ")");
  require(!(q.rows() > 0 && k.rows() == 0), fn, "k has 0 rows but q has ", q.rows(),
          ": every query needs at least one key (q: ", shape_str(q), ", k: ", shape_str(k), ")");
}

/// The sum of x * 0 over n contiguous scalars: 0 when every one is finite, NaN otherwise (inf * 0
/// and NaN are NaN), in 32 independent sums (x * 0 + acc, exact, each one FMA where the compiler
/// fuses them), where Eigen's sum has two: over a decoding step's K x d_v state (AVX2, K = d_v =
/// 64) its latency chain took 30% of the step.
template <class S>
inline S finite_probe(const S* x, Index n) {
  constexpr int L = 32;
  S acc[L] = {};
  Index i = 0;
  for (; i + L <= n; i += L)
    for (int j = 0; j < L; ++j) acc[j] += x[i + j] * S(0);
  for (; i < n; ++i) acc[0] += x[i] * S(0);
  S probe = S(0);
  for (int j = 0; j < L; ++j) probe += acc[j];
  return probe;
}

/// finite_probe over every entry of x: in one finite_probe(const S*, Index) when its entries are
/// contiguous (a plain matrix, a block of whole rows of a row-major one, a contiguous map), else
/// row by row with Eigen's sums so that any outer stride works. Probes of blocks add up to the
/// probe of their union.
template <class Derived>
inline typename Derived::Scalar finite_probe(const Eigen::DenseBase<Derived>& x) {
  using S = typename Derived::Scalar;
  const Derived& d = x.derived();
  if constexpr (bool(Derived::Flags & Eigen::DirectAccessBit)) {
    if (d.innerStride() == 1 && (d.outerStride() == d.innerSize() || d.outerSize() <= 1))
      return finite_probe(d.data(), d.size());
  }
  S probe = S(0);
  for (Index i = 0; i < d.rows(); ++i) probe += (d.row(i).array() * S(0)).sum();
  return probe;
}

/// Throws std::domain_error naming `arg` when any entry of `x` is NaN or infinite.
template <class Derived>
inline void require_finite(const Eigen::DenseBase<Derived>& x, const char* fn, const char* arg) {
  // Fast path: finite_probe (x * 0 is 0 for finite x and NaN otherwise). The locating scan below
  // runs only when something is wrong.
  using S = typename Derived::Scalar;
  if (finite_probe(x) == S(0)) return;
  const Index rows = x.rows(), cols = x.cols();
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j)
      if (!std::isfinite(static_cast<double>(x(i, j))))
        raise_domain_error(concat(fn, ": ", arg, " has a non-finite entry at (", i, ", ", j,
                                  ") of ", rows, " x ", cols));
}

/// "float" or "double", for messages.
template <class S>
const char* scalar_name() {
  return std::is_same<S, float>::value ? "float" : "double";
}

/// Whether every entry of x is finite.
template <class Derived>
inline bool all_finite(const Eigen::DenseBase<Derived>& x) {
  return finite_probe(x) == typename Derived::Scalar(0);
}

/// With checks on, a result that is not finite although every input was finite overflowed the
/// scalar type: throw std::domain_error naming the result and the way out, never return it.
template <class Derived>
inline void require_finite_result(const Eigen::DenseBase<Derived>& x, const char* fn,
                                  const char* what, const char* culprit) {
  using S = typename Derived::Scalar;
  if (all_finite(x)) return;
  raise_domain_error(concat(fn, ": ", what, " overflows ", scalar_name<S>(),
                            " although every input is finite: ", culprit,
                            " too large for the scalar type (scale it down or use double)"));
}

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

/// The error every backward raises for a record filled from other data.
[[noreturn]] inline void raise_other_data(const char* fn, const char* record, const char* which) {
  raise_invalid_argument(concat(fn, ": ", record, " came from other data: ", which,
                                " is different from what its forward was given (the record's "
                                "fingerprint does not match); run forward on these inputs again"));
}

/// The working memory of the value-returning forms (forward, backward): one per thread and
/// scratch type, kept for the thread's lifetime and holding the buffers of the last call that
/// used it (docs/operators.md, "Memory between calls"). The `_into` forms use their records'.
template <class Scratch>
Scratch& value_form_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

/// Lends this thread's value_form_scratch to a record's scratch (none when null) for one call
/// and takes it back when it goes out of scope (on a throw too), leaving the record's own
/// scratch as it was: a repeated value-returning call reuses warm working memory instead of
/// page-faulting fresh multi-megabyte buffers (glibc maps them from the OS and unmaps them on
/// free). Lends nest (each takes back what it lent, in reverse order).
template <class Scratch>
class LentScratch {
 public:
  explicit LentScratch(Scratch* slot) : slot_(slot) { exchange(); }
  ~LentScratch() { exchange(); }
  LentScratch(const LentScratch&) = delete;
  LentScratch& operator=(const LentScratch&) = delete;

 private:
  void exchange() {
    using std::swap;
    if (slot_ != nullptr) swap(*slot_, value_form_scratch<Scratch>());
  }
  Scratch* slot_;
};

}  // namespace detail
MIXATTN_END_NAMESPACE
