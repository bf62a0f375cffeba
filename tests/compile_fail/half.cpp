// Must not compile: Eigen::half is not a supported scalar type. tests/CMakeLists.txt expects the
// build of this file to fail with core.hpp's one message naming float and double.
#include <mixattn/reference.hpp>

int main() {
  using H = Eigen::half;
  const mixattn::Matrix<H> q = mixattn::Matrix<H>::Zero(4, 2);
  return static_cast<int>(mixattn::reference::flash_forward(q, q, q).rows());
}
