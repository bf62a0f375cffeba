// Must not compile: the caller-owned-output form refuses a column-major argument as the
// value-returning form does (here the decoding form, continuing a State into a reused output).
// tests/CMakeLists.txt expects the build of this file to fail with core.hpp's message.
#include <mixattn/gma.hpp>

int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(16, 8);  // N x r, column-major
  const mixattn::Matrix<float> k = mixattn::Matrix<float>::Random(16, 8);
  const mixattn::Matrix<float> v = mixattn::Matrix<float>::Random(16, 4);
  const auto mix = mixattn::gma::Mixture<float>::random(4, 8, 1);
  mixattn::gma::Options opt;
  opt.causal = true;
  auto state = mixattn::gma::State<float>::empty(4, 4);
  mixattn::gma::Saved<float> saved;
  mixattn::Matrix<float> out;
  mixattn::gma::forward_into(out, mix, q, k, v, opt, state, &saved);
  return static_cast<int>(out.rows());
}
