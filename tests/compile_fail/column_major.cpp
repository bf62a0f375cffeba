// Must not compile: a column-major matrix (Eigen's default) would be copied on every call.
// tests/CMakeLists.txt expects the build of this file to fail with core.hpp's message.
#include <mixattn/gma.hpp>

int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(16, 8);  // N x r, column-major
  const mixattn::Matrix<float> k = mixattn::Matrix<float>::Random(16, 8);
  const mixattn::Matrix<float> v = mixattn::Matrix<float>::Random(16, 4);
  const auto mix = mixattn::gma::Mixture<float>::random(4, 8, 1);
  return static_cast<int>(mixattn::gma::forward(mix, q, k, v).rows());
}
