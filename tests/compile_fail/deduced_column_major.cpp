// Must not compile: a form that takes T from its argument (here diagnostics::mean_usage(gamma))
// refuses a column-major matrix as the forms that take T written do, where it binds.
// tests/CMakeLists.txt expects the build of this file to fail with core.hpp's message.
#include <mixattn/diagnostics.hpp>

int main() {
  const Eigen::MatrixXf gamma = Eigen::MatrixXf::Constant(16, 4, 0.25f);  // N x K, column-major
  return static_cast<int>(mixattn::diagnostics::mean_usage(gamma).size());
}
