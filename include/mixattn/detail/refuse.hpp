// mixattn/detail/refuse.hpp — the compile-time refusal of an unsupported scalar type or of an
// argument that would be copied on every call (a column-major or strided matrix): one check,
// done where the argument binds (ConstMatrixArg) or where T is chosen (enable_if_supported).
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <Eigen/Core>

#include <type_traits>

MIXATTN_BEGIN_NAMESPACE
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
/// Selects the catch-all overloads layer.hpp still declares: T is not supported or an argument
/// would be copied.
template <class T, class... A>
using enable_if_refused =
    std::enable_if_t<(is_eigen<A> && ...) && (!supported_scalar<T> || any_copied_layout<T, A...>),
                     int>;

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

/// Read-only matrix input of the public entry points: binds what ConstMatrixRef<T> binds without
/// a copy and refuses at compile time what it would copy (detail::InputRef). T is non-deduced.
template <class T>
using ConstMatrixArg = detail::InputRef<typename detail::identity<T>::type>;

MIXATTN_END_NAMESPACE
