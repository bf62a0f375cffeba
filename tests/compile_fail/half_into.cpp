// Must not compile: Eigen::half is not a supported scalar type, in the caller-owned-output form
// either. tests/CMakeLists.txt expects the build of this file to fail with core.hpp's one message
// naming float and double.
#include <mixattn/reference.hpp>

int main() {
  using H = Eigen::half;
  const mixattn::Matrix<H> q = mixattn::Matrix<H>::Zero(4, 2);
  mixattn::Matrix<H> out;
  mixattn::reference::naive_forward_into(out, q, q, q, mixattn::reference::Options{},
                                         static_cast<mixattn::reference::Saved<H>*>(nullptr));
  return static_cast<int>(out.rows());
}
