// mixattn/core.hpp — common types (ConstMatrixArg, the parameter type of every matrix input,
// among them), errors, version and configuration macros.
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
// Eigen's own code (its products, allocator, ...) cannot be tagged: see detail/common/simd.hpp.
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
// A unit that also defines MIXATTN_INSTANTIATE_SCALAR as float or double holds the workers of
// that type only, so that two units compiled side by side share the work.
#if defined(MIXATTN_INSTANTIATE_TEMPLATES)
#define MIXATTN_TEMPLATE_INSTANCE template
#elif defined(MIXATTN_EXTERN_TEMPLATES)
#define MIXATTN_TEMPLATE_INSTANCE extern template
#endif
#if defined(MIXATTN_INSTANTIATE_TEMPLATES) && defined(MIXATTN_INSTANTIATE_SCALAR)
#define MIXATTN_FOR_EACH_SCALAR(M) M(MIXATTN_INSTANTIATE_SCALAR)
#else
#define MIXATTN_FOR_EACH_SCALAR(M) M(float) M(double)
#endif

MIXATTN_BEGIN_NAMESPACE

namespace detail {
template <class T>
struct identity {
  using type = T;
};
/// T in a parameter that must not take part in deducing T (a record pointer that may be nullptr).
template <class T>
using identity_t = typename identity<T>::type;
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
/// Read-only view of a column vector with unit stride. T is non-deduced, as in ConstMatrixRef;
/// the same spelling in every declaration of a worker also keeps clang's mangling of it one
/// across translation units (Ref<const Vector<T>> with T deduced came out two ways in clang 14,
/// and a unit declaring the workers extern then missed the instances' symbols).
template <class T>
using ConstVectorRef = Eigen::Ref<const Vector<typename detail::identity<T>::type>>;
/// Writable view of a row-major matrix, for outputs written in place.
template <class T>
using MatrixRef = Eigen::Ref<Matrix<typename detail::identity<T>::type>>;

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

}  // namespace detail

// The compile-time refusal of an unsupported scalar type or of an argument that would be copied
// on every call (a column-major or strided matrix): one check, done where the argument binds
// (ConstMatrixArg) or where T is chosen (enable_if_supported).
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

/// The compile-time refusals of every entry point, in one place: InputRef's converting
/// constructor and enable_if_supported call this, and its static_asserts are the whole diagnostic.
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

/// The main overloads' check of T (a defaulted template parameter): an unsupported T stops at
/// refuse_arguments' static_assert as the overload is considered, and the overload then drops
/// out, so that nothing of its body is compiled for that T: the message is the diagnostic.
template <class T>
using enable_if_supported = std::enable_if_t<refuse_arguments<T>() && supported_scalar<T>, int>;
/// The type of every public entry point's matrix inputs (ConstMatrixArg<T>): a ConstMatrixRef<T>
/// (by inheritance, so the workers take it as one) whose converting constructor refuses, where
/// the argument binds, what would be copied on every call (a column-major or strided matrix)
/// with refuse_arguments' message. Everything else binds as to a ConstMatrixRef<T>: a row-major
/// matrix, Map or row block in place, a ConstMatrixRef<T> without a copy, an expression
/// evaluated.
template <class T>
class InputRef : public Eigen::Ref<const Matrix<T>> {
  using Base = Eigen::Ref<const Matrix<T>>;

 public:
  InputRef(const Base& ref) : Base(ref) {}  // NOLINT(google-explicit-constructor): binds as Base
  template <class A, std::enable_if_t<is_eigen<A>, int> = 0>
  InputRef(const A& arg) : Base(arg) {  // NOLINT(google-explicit-constructor)
    static_cast<void>(refuse_arguments<T, A>());
  }
};

/// The overloads that take T from their first matrix argument (reference::naive_forward(q, k, v),
/// diagnostics::mean_usage(gamma)): any Eigen arguments, passed on to the ConstMatrixArg<T> form
/// with T their scalar type, where they bind or are refused.
template <class... A>
using enable_if_deduced = std::enable_if_t<(is_eigen<A> && ...), int>;

}  // namespace detail

/// Read-only matrix input of the public entry points: binds what ConstMatrixRef<T> binds without
/// a copy and refuses at compile time what it would copy (detail::InputRef). T is non-deduced.
template <class T>
using ConstMatrixArg = detail::InputRef<typename detail::identity<T>::type>;

MIXATTN_END_NAMESPACE
