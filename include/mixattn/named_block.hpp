// mixattn/named_block.hpp — named views of parameter blocks: what a layer lists as its
// parameters and gradients (layer.hpp), what the optimiser updates (adam.hpp) and what the
// parameter file stores.
#pragma once

#include "mixattn/core.hpp"

#include <string>
#include <utility>

MIXATTN_BEGIN_NAMESPACE
namespace layer {

/// A named, writable view of one rows x cols row-major block held elsewhere (a parameter or
/// its gradient). It does not own the storage; it stays valid while the owner is alive and not
/// resized. map() gives the Eigen view.
template <class T>
struct NamedBlock {
  std::string name;
  T* data = nullptr;
  Index rows = 0;
  Index cols = 0;
  Eigen::Map<Matrix<T>> map() const { return Eigen::Map<Matrix<T>>(data, rows, cols); }
};

/// Read-only counterpart of NamedBlock (for saving from a const object).
template <class T>
struct ConstNamedBlock {
  std::string name;
  const T* data = nullptr;
  Index rows = 0;
  Index cols = 0;
  ConstNamedBlock() = default;
  ConstNamedBlock(std::string n, const T* d, Index r, Index c)
      : name(std::move(n)), data(d), rows(r), cols(c) {}
  ConstNamedBlock(const NamedBlock<T>& b)  // NOLINT: a writable view is also a readable one
      : name(b.name), data(b.data), rows(b.rows), cols(b.cols) {}
  Eigen::Map<const Matrix<T>> map() const { return Eigen::Map<const Matrix<T>>(data, rows, cols); }
};

}  // namespace layer
MIXATTN_END_NAMESPACE
