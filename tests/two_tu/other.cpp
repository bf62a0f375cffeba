#include <mixattn/mixattn.hpp>

double other_tu_output_sum() {
  using namespace mixattn;
  Matrix<double> q = Matrix<double>::Random(8, 4), k = Matrix<double>::Random(8, 4);
  Matrix<double> v = Matrix<double>::Random(8, 3);
  return reference::flash_forward<double>(q, k, v).sum();
}
