// Must not compile: the packed entry points refuse a column-major argument as the single-sequence
// ones do, where it binds (it would be copied on every call).
// tests/CMakeLists.txt expects the build of this file to fail with core.hpp's message.
#include <mixattn/packed.hpp>

#include <vector>

int main() {
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(16, 8);  // total x (H r), column-major
  const Eigen::MatrixXf k = Eigen::MatrixXf::Random(16, 8);
  const Eigen::MatrixXf v = Eigen::MatrixXf::Random(16, 4);
  const std::vector<mixattn::gma::Mixture<float>> mixtures{
      mixattn::gma::Mixture<float>::random(4, 8, 1)};
  const mixattn::Offsets offsets{0, 16};
  mixattn::gma::PackedSaved<float> saved;
  mixattn::Matrix<float> out;
  mixattn::gma::forward_packed_into<float>(out, mixtures, q, k, v, offsets, offsets,
                                           mixattn::gma::Options{}, &saved);
  return static_cast<int>(out.rows());
}
