// Two translation units built for different instruction sets (baseline.cpp: -march=x86-64-v2,
// best.cpp: -march=native) include the whole library, run the same GMA, flash and OVQ calls on the
// same inputs, and are linked into this one program. It checks that
//   1. each TU ran its own code: the TUs report different xsimd architectures, and every mixattn
//      function they called has a different address in each (one symbol per instruction set; if
//      the linker had merged them, one TU would be running the other's instructions);
//   2. their results agree to float rounding.
// Exit code 77 (skipped) when this CPU's best instruction set is x86-64-v2 itself.
#include "probe.hpp"

#include <cmath>
#include <cstdio>

namespace {

// Every output is a convex combination of rows of v (|v| < 1), so an absolute tolerance fits. Each
// TU's result is within ~n u of the exact one, with u = 2^-24 and n ~ 100 the longest chain of
// roundings here (64-key sums, 8-term dot products and exp's argument error, which exp turns into
// the same relative error of a weight): ~6e-6. The TUs differ in summation order (4, 8 or 16
// lanes) and FMA contraction (none at x86-64-v2), so their difference is bounded by about twice
// that; 2e-5 leaves a small margin and is still far below any real error (O(0.01) and up). OVQ
// also makes discrete choices (nearest centroid, seeding) on these inputs; none is within rounding
// of a tie, or the comparison would fail.
constexpr float kTolerance = 2e-5f;

bool same_values(const char* what, const std::vector<float>& a, const std::vector<float>& b) {
  if (a.empty() || a.size() != b.size()) {
    std::printf("%s: sizes %zu and %zu\n", what, a.size(), b.size());
    return false;
  }
  float worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      std::printf("%s: non-finite value at %zu\n", what, i);
      return false;
    }
    worst = std::fmax(worst, std::fabs(a[i] - b[i]));
  }
  std::printf("%-10s max |baseline - best| = %.3g (tolerance %.3g)\n", what, worst, kTolerance);
  return worst <= kTolerance;
}

}  // namespace

int main() {
  const IsaRun low = run_baseline(), high = run_best();
  std::printf("baseline TU: %s, best TU: %s\n", low.arch.c_str(), high.arch.c_str());
  if (low.arch == high.arch) {
    std::printf("this CPU's best instruction set is the baseline: nothing to compare\n");
    return 77;
  }
  bool ok = true;
  for (std::size_t i = 0; i < low.symbols.size(); ++i) {
    if (low.symbols[i] == high.symbols[i]) {
      std::printf("function %zu of probe.hpp's list: one symbol for both instruction sets\n", i);
      ok = false;
    }
  }
  ok &= same_values("gma", low.gma, high.gma);
  ok &= same_values("gma causal", low.gma_causal, high.gma_causal);
  ok &= same_values("flash", low.flash, high.flash);
  ok &= same_values("ovq", low.ovq, high.ovq);
  std::printf("two translation units, two instruction sets: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
