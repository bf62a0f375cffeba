// Must not compile: the gated delta rule's g given as a column of a row-major matrix (strided)
// would be copied on every call. tests/CMakeLists.txt expects the build of this file to fail with
// detail/common/vector_arg.hpp's message.
#include <mixattn/delta.hpp>

int main() {
  const mixattn::Matrix<float> q = mixattn::Matrix<float>::Random(16, 8);
  const mixattn::Matrix<float> v = mixattn::Matrix<float>::Random(16, 4);
  const mixattn::Matrix<float> gates = -mixattn::Matrix<float>::Random(16, 2).cwiseAbs();
  const mixattn::Vector<float> beta = mixattn::Vector<float>::Constant(16, 0.5f);
  return static_cast<int>(mixattn::delta::forward<float>(q, q, v, gates.col(0), beta).rows());
}
