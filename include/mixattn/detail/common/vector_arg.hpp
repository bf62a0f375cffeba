// mixattn/detail/common/vector_arg.hpp — the type of the operators' vector inputs (the gated delta
// rule's g and beta, the SSD layer's dt: delta::ConstVectorArg, ssd::ConstVectorArg): read in
// place, with the compile-time refusal of a strided vector that ConstMatrixArg gives the
// matrices (core.hpp).
//
// Internal: included by mixattn/delta.hpp and mixattn/ssd.hpp.
#pragma once

#include "mixattn/detail/internal_header_check.hpp"

#include "mixattn/core.hpp"

#include <Eigen/Core>

#include <type_traits>
#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace detail {

/// Whether A is an Eigen object (a VectorBlock's EigenBase is its Block's, which
/// detail::is_eigen, an is_base_of test on EigenBase<A>, does not see).
template <class D>
std::true_type vector_arg_eigen_test(const Eigen::EigenBase<D>*);
std::false_type vector_arg_eigen_test(...);
template <class A>
constexpr bool vector_arg_is_eigen =
    decltype(vector_arg_eigen_test(std::declval<const A*>()))::value;
/// The type Eigen binds A as (its EigenBase's Derived: a VectorBlock binds as its Block).
template <class D>
D vector_arg_eigen_derived(const Eigen::EigenBase<D>*);

/// True when A would bind to Eigen::Ref<const Vector<T>> only through a hidden copy: stored data
/// of scalar T that is strided (a column of a row-major matrix, a row of a column-major one).
template <class T, class A, class = void>
struct vector_arg_copied : std::false_type {};
template <class T, class A>
struct vector_arg_copied<T, A, std::enable_if_t<vector_arg_is_eigen<A>>> {
  using D = decltype(vector_arg_eigen_derived(std::declval<const A*>()));
  static constexpr bool value =
      std::is_same<typename D::Scalar, T>::value && bool(int(D::Flags) & Eigen::DirectAccessBit) &&
      !bool(Eigen::internal::traits<Eigen::Ref<const Vector<T>>>::template match<
            D>::MatchAtCompileTime);
};

/// The type of a vector input (delta::ConstVectorArg<T>, ssd::ConstVectorArg<T>): an
/// Eigen::Ref<const Vector<T>> whose converting constructor refuses, where the argument binds, a
/// strided vector (copied on every call). A Vector<T>, a segment of one, a Map or a row of a
/// row-major matrix bind in place.
template <class T>
class ConstVectorArgRef : public Eigen::Ref<const Vector<T>> {
  using Base = Eigen::Ref<const Vector<T>>;

 public:
  ConstVectorArgRef(const Base& ref) : Base(ref) {}  // NOLINT(google-explicit-constructor)
  template <class A, std::enable_if_t<vector_arg_is_eigen<A>, int> = 0>
  ConstVectorArgRef(const A& arg) : Base(arg) {  // NOLINT(google-explicit-constructor)
    static_assert(
        !vector_arg_copied<T, A>::value,
        "mixattn reads its vector inputs (g, beta, dt) in place; this vector is strided (a column "
        "of a row-major matrix or a row of a column-major one) and would be copied on every call. "
        "Pass a contiguous vector: a Vector<T>, a segment of one, a Map, or a row of a row-major "
        "matrix");
  }
};

}  // namespace detail
MIXATTN_END_NAMESPACE
