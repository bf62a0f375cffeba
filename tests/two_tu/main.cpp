// Two translation units include the umbrella header; linking them proves no duplicate symbols.
#include <mixattn/mixattn.hpp>

#include <cstdio>

double other_tu_output_sum();

int main() {
  using namespace mixattn;
  Matrix<double> q = Matrix<double>::Random(16, 4), k = Matrix<double>::Random(16, 4);
  Matrix<double> v = Matrix<double>::Random(16, 3);
  auto mix = gma::Mixture<double>::random(3, 4, 11);
  const double here = gma::forward(mix, q, k, v).sum();
  const double there = other_tu_output_sum();
  const bool ok = std::isfinite(here) && std::isfinite(there);
  std::printf("two translation units: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
