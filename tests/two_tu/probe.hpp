// The same computations, compiled once per instruction set: tests/two_tu/{baseline,best}.cpp each
// include this file under different -march flags and are linked into one program with main.cpp.
//
// Only standard types cross between the two translation units. An Eigen object must not: its
// allocation and alignment code (EIGEN_MAX_ALIGN_BYTES: 16 with SSE, 32 with AVX, 64 with AVX-512)
// is not tagged by instruction set, so it is one linker-chosen copy for both TUs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct IsaRun {
  std::string arch;                                // xsimd architecture the TU was compiled for
  std::vector<float> gma, gma_causal, flash, ovq;  // row-major outputs on shared inputs
  std::vector<std::uintptr_t> symbols;  // addresses of the mixattn functions the TU called
};

IsaRun run_baseline();  // baseline.cpp: -march=x86-64-v2
IsaRun run_best();      // best.cpp: -march=native

#ifdef MIXATTN_TWO_TU_BODY
#include <mixattn/mixattn.hpp>

namespace {  // internal linkage: each TU keeps its own copy, compiled for its own instruction set

// Inputs from an integer recurrence, so both TUs see bit-identical values in [-1, 1).
mixattn::Matrix<float> probe_matrix(mixattn::Index rows, mixattn::Index cols, std::uint32_t seed) {
  mixattn::Matrix<float> m(rows, cols);
  std::uint32_t s = seed;
  for (mixattn::Index i = 0; i < m.size(); ++i) {
    s = s * 1664525u + 1013904223u;
    m.data()[i] = static_cast<float>(s >> 8) / 8388608.0f - 1.0f;
  }
  return m;
}

std::vector<float> to_vector(const mixattn::Matrix<float>& m) {
  return std::vector<float>(m.data(), m.data() + m.size());
}

template <class F>
std::uintptr_t address_of(F* f) {
  return reinterpret_cast<std::uintptr_t>(f);
}

// The entry points by exact signature (some names are overloaded).
// In: the entry points' matrix parameter (a ConstMatrixRef<float> refusing wrong kinds).
using In = const mixattn::ConstMatrixArg<float>&;
using Out = mixattn::Matrix<float>;
using GmaForward = Out(const mixattn::gma::Mixture<float>&, In, In, In,
                       const mixattn::gma::Options&, mixattn::gma::Saved<float>*);
using FlashForward = Out(In, In, In, const mixattn::reference::Options&,
                         mixattn::reference::Saved<float>*);
using OvqForward = Out(In, In, In, float, const mixattn::ovq::Options&, mixattn::ovq::State<float>&,
                       mixattn::ovq::Saved<float>*);
using Responsibilities = Out(const mixattn::gma::Mixture<float>&, In, bool);

IsaRun run_probe() {
  using namespace mixattn;
  constexpr Index N = 64, r = 8, dv = 16, K = 6;
  const Matrix<float> q = probe_matrix(N, r, 1), k = probe_matrix(N, r, 2),
                      v = probe_matrix(N, dv, 3);
  gma::Mixture<float> mix;  // not Mixture::random: its floating-point code is compiled per TU too
  mix.mean = probe_matrix(K, r, 4);
  mix.var_raw = probe_matrix(K, r, 5);
  mix.prior_logit = probe_matrix(K, 1, 6);

  IsaRun run;
  run.arch = detail::simd_arch::name();
  gma::Options causal;
  causal.causal = true;
  causal.chunk = 16;
  run.gma = to_vector(gma::forward(mix, q, k, v));
  run.gma_causal = to_vector(gma::forward(mix, q, k, v, causal));
  reference::Options ropt;
  ropt.causal = true;
  run.flash = to_vector(reference::flash_forward<float>(q, k, v, ropt));
  ovq::Options oopt;
  oopt.block = 16;
  oopt.max_centroids = 12;
  ovq::State<float> state = ovq::State<float>::empty(r, dv);
  run.ovq = to_vector(ovq::forward<float>(q, k, v, 0.8f, oopt, state));
  GmaForward* gma_forward = &gma::forward<float>;
  FlashForward* flash_forward = &reference::flash_forward<float>;
  OvqForward* ovq_forward = &ovq::forward<float>;
  Responsibilities* responsibilities = &gma::responsibilities<float>;
  run.symbols = {address_of(gma_forward), address_of(flash_forward), address_of(ovq_forward),
                 address_of(responsibilities)};
  return run;
}

}  // namespace
#endif
