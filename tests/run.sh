#!/usr/bin/env bash
# The test command. On a fresh Debian 12 machine (as root) it installs what it needs, then:
#   1. builds the tests and examples optimised for this CPU and runs ctest (the benchmarks are
#      built by the main command, bench/run.sh); then builds the PyTorch extension into a
#      virtual environment and runs its pytest suite (tests/python.sh; skipped without PyTorch);
#   2. builds and runs the test suite again for the instruction sets most users' binaries are built
#      for: the x86-64 baseline (-march=x86-64, SSE2) and x86-64-v3 (AVX2 + FMA), each skipped
#      where xsimd selects the same SIMD architecture for it as for -march=native (x86-64-v3 on
#      an AVX2 machine without AVX-512: the main pass already ran those kernels). These passes
#      build the test files that exercise the kernels (GMA forward, backward, backward kernel,
#      causal scan and state; OVQ backward, dictionary, exactness, streaming and reference
#      rules; the gated delta rule; the SSD layer; the softmax reference; the layer: every SIMD
#      kernel against its twin and every finite-difference check), and skip what does not depend
#      on the ISA or costs the most: argument validation, thread, exception, diagnostics and
#      stress files, the header checks (whether a header compiles on its own does not depend on
#      -march; every header is compiled at that -march all the same, by the operators'
#      instances file), the consumer.* projects (they test packaging, not kernels), the
#      examples, and the two-TU program (its two files set their own -march, so it would be the
#      main pass's again);
#   3. builds and runs the whole suite again under AddressSanitizer + UndefinedBehaviorSanitizer,
#      with the libFuzzer targets built in the same tree and their seed corpora replayed by its
#      ctest, the threaded tests under ThreadSanitizer, and the PyTorch extension's tests with
#      the extension built under ASan + UBSan (tests/sanitize.sh);
#   4. runs every fuzz target for a bounded time, a share of one wall-time budget each
#      (tests/fuzz/run.sh).
# Environment: MIXATTN_JOBS (default nproc), MIXATTN_FUZZ_TOTAL_SECONDS (the fuzzers' wall time
# in all, default 120, shared by the targets), MIXATTN_FUZZ_SECONDS (instead, a time per target),
# MIXATTN_SKIP_ISA=1 / MIXATTN_SKIP_SANITIZERS=1 / MIXATTN_SKIP_FUZZ=1 to skip step 2, 3 or 4,
# MIXATTN_SKIP_PYTHON=1 to leave out the extension.
# Options: --quick runs the main suite alone (step 1's build and ctest: no extension, no extra
# instruction sets, sanitizers or fuzzers), for day-to-day work; --help prints this header.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
quick=0
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "tests/run.sh: unknown option $arg (--quick, --help)" >&2; exit 2 ;;
  esac
done
bash cmake/install-deps.sh test
jobs=${MIXATTN_JOBS:-$(nproc)}
build=${MIXATTN_BUILD_DIR:-build/test}
# Ninja for new build trees (cmake/install-deps.sh installs it; CMake keeps an existing tree's
# generator, and a CMAKE_GENERATOR already set wins): make compiles a target's files only after
# every target it links is built, so the operators' instances (the longest file) held back every
# test file; Ninja holds back only the link. tests/sanitize.sh and tests/fuzz/run.sh inherit it.
if [[ -z ${CMAKE_GENERATOR:-} ]] && command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi
start=$SECONDS

echo "== build and test ($build)"
# -O2 without debug info: the suite's build time dominates CI; assertions stay on in the tests.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG" \
  -DMIXATTN_BUILD_TESTS=ON -DMIXATTN_BUILD_EXAMPLES=ON -DMIXATTN_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 900
echo "== main suite: $((SECONDS - start)) s"
if ((quick)); then
  echo "== main suite passed (--quick: no extension, instruction-set, sanitizer or fuzz passes)"
  exit 0
fi
if [[ ${MIXATTN_SKIP_PYTHON:-0} != 1 ]]; then
  bash tests/python.sh
fi

# The SIMD architecture xsimd selects under -march=$1 (the kernels' code path), or nothing if the
# probe does not compile.
simd_arch_for() {
  printf '#include <xsimd/xsimd.hpp>\n#include <cstdio>\nint main() { std::puts(xsimd::default_arch::name()); }\n' |
    "${CXX:-c++}" -std=c++17 "-march=$1" -x c++ - -o "$build-arch-probe" 2>/dev/null &&
    "$build-arch-probe" && rm -f "$build-arch-probe"
}

if [[ ${MIXATTN_SKIP_ISA:-0} != 1 && $(uname -m) == x86_64 ]]; then
  native_arch=$(simd_arch_for native || true)
  for isa in x86-64 x86-64-v3; do
    # A pass whose SIMD architecture is the main pass's own (-march=native on an AVX2 machine
    # without AVX-512 selects fma3+avx2, as x86-64-v3 does) would run the same kernels again.
    if [[ -n $native_arch && $(simd_arch_for "$isa" || true) == "$native_arch" ]]; then
      echo "== -march=$isa: skipped (its SIMD architecture, $native_arch, is the main pass's)"
      continue
    fi
    isa_start=$SECONDS
    echo "== build and test at -march=$isa ($build-$isa)"
    cmake -S . -B "$build-$isa" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -DNDEBUG" -DMIXATTN_ARCH_FLAGS="-march=$isa" \
      -DMIXATTN_BUILD_TESTS=ON -DMIXATTN_BUILD_EXAMPLES=OFF -DMIXATTN_BUILD_BENCHMARKS=OFF \
      -DMIXATTN_TEST_FILTER='^test_(gma_(forward|backward|backward_kernel|causal_scan|state)|ovq_(backward|dictionary|exactness|streaming|reference_rules)|reference|layer|delta|ssd)$' -DMIXATTN_INSTALL=OFF \
      -DMIXATTN_TEST_TWO_TU=OFF -DMIXATTN_TEST_HEADER_CHECKS=OFF >/dev/null
    cmake --build "$build-$isa" -j "$jobs"
    ctest --test-dir "$build-$isa" --output-on-failure -j "$jobs" --timeout 900 \
      -E '^(StressTest\.|consumer\.)'
    echo "== suite at -march=$isa: $((SECONDS - isa_start)) s"
  done
fi

if [[ ${MIXATTN_SKIP_SANITIZERS:-0} != 1 ]]; then
  bash tests/sanitize.sh
fi
if [[ ${MIXATTN_SKIP_FUZZ:-0} != 1 ]]; then
  # The targets were built beside the suite in the sanitizer pass's ASan + UBSan tree
  # (tests/asan_tree.sh). One wall-time budget shared by every target
  # (MIXATTN_FUZZ_TOTAL_SECONDS, default 120), unless MIXATTN_FUZZ_SECONDS asks for a time per
  # target.
  fuzz_dir=${MIXATTN_SANITIZE_DIR:-build}/asan
  if [[ -n ${MIXATTN_FUZZ_SECONDS:-} ]]; then
    MIXATTN_FUZZ_DIR=$fuzz_dir bash tests/fuzz/run.sh --seconds "$MIXATTN_FUZZ_SECONDS"
  else
    MIXATTN_FUZZ_DIR=$fuzz_dir bash tests/fuzz/run.sh --total "${MIXATTN_FUZZ_TOTAL_SECONDS:-120}"
  fi
fi
echo "== all tests passed in $((SECONDS - start)) s"
