#!/usr/bin/env bash
# Builds the whole test suite with AddressSanitizer + UndefinedBehaviorSanitizer and runs it under
# ctest; any sanitizer report fails the run (no recovery, leaks included). Then, when
# include/mixattn/batched.hpp exists (a multi-threaded entry point), builds test_thread_safety and
# the batched tests with ThreadSanitizer and runs them. Then, where PyTorch is installed, builds
# the PyTorch extension with ASan+UBSan and runs its tests (leaks not checked there).
#
#   tests/sanitize.sh            ASan+UBSan pass, the TSan pass, the extension's pass
#   tests/sanitize.sh asan       ASan+UBSan only
#   tests/sanitize.sh tsan       TSan only
#   tests/sanitize.sh python     the PyTorch extension only
#
# Environment: CXX (default clang++: its -fsanitize=undefined also covers float-cast-overflow),
# MIXATTN_JOBS (default nproc), MIXATTN_SANITIZE_DIR (default build: build/asan, build/tsan and
# build/asan-python), MIXATTN_SKIP_PYTHON=1 (leave the extension out of the default pass).
#
# Skipped under the sanitizers (ctest -E):
#   - StressTest.*      the million-token stress runs (test_stress_*.cpp): ~10x slower under
#                       ASan; their smaller siblings in the same files still run;
#   - consumer.*        configure and build separate consumer projects with the default
#                       compiler: nothing of the library is sanitized there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
what=${1:-all}
jobs=${MIXATTN_JOBS:-$(nproc)}
cxx=${CXX:-clang++}
base=${MIXATTN_SANITIZE_DIR:-build}
# Ninja for new build trees, as in tests/run.sh (which sets it when it calls this script).
if [[ -z ${CMAKE_GENERATOR:-} ]] && command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi

. tests/asan_tree.sh

configure() {  # configure <dir> <flags> [cmake options...]
  local dir=$1 flags=$2
  shift 2
  # The compile-only checks (headers on their own, compile-time refusals) are the main pass's:
  # a sanitizer has nothing to add to a build that only compiles.
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Sanitize -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_CXX_FLAGS_SANITIZE="$flags" -DCMAKE_EXE_LINKER_FLAGS_SANITIZE="$flags" \
    -DMIXATTN_BUILD_TESTS=ON -DMIXATTN_BUILD_BENCHMARKS=OFF -DMIXATTN_BUILD_EXAMPLES=OFF \
    -DMIXATTN_BUILD_FUZZERS=OFF -DMIXATTN_INSTALL=OFF -DMIXATTN_TEST_HEADER_CHECKS=OFF "$@" >/dev/null
}

status=0
start=$SECONDS
if [[ $what == all || $what == asan ]]; then
  dir=$base/asan
  echo "== ASan+UBSan: configuring $dir with $cxx"
  mixattn_configure_asan "$dir"
  echo "== ASan+UBSan: building the suite and the fuzz targets (-j$jobs)"
  cmake --build "$dir" -j "$jobs"
  echo "== ASan+UBSan: running ctest"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" -E '^(StressTest[./]|consumer\.)' ||
    status=1
  echo "== ASan+UBSan: $((SECONDS - start)) s"
fi

if [[ $what == all || $what == tsan ]]; then
  if [[ -f include/mixattn/batched.hpp ]]; then
    t0=$SECONDS
    dir=$base/tsan
    flags="-O1 -g1 -fsanitize=thread -fno-omit-frame-pointer"
    targets=(test_thread_safety)
    for f in tests/test_*batched*.cpp; do
      [[ -f $f ]] && targets+=("$(basename "$f" .cpp)")
    done
    filter="^($(IFS='|'; echo "${targets[*]}"))\$"
    echo "== TSan: configuring $dir with $cxx"
    # Only these test files, and nothing else, so that one build compiles them side by side
    # (naming them with --target would build them one after another).
    configure "$dir" "$flags" -DMIXATTN_TEST_FILTER="$filter" -DMIXATTN_TEST_TWO_TU=OFF
    echo "== TSan: building ${targets[*]}"
    cmake --build "$dir" -j "$jobs"
    export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
    # gtest_discover_tests names tests by suite, so run the binaries directly.
    for t in "${targets[@]}"; do
      echo "== TSan: $t"
      "$dir/tests/$t" --gtest_brief=1 || status=1
    done
    echo "== TSan: $((SECONDS - t0)) s"
  else
    echo "== TSan: include/mixattn/batched.hpp not present, skipped"
  fi
fi
if [[ $what == python || ($what == all && ${MIXATTN_SKIP_PYTHON:-0} != 1) ]]; then
  # The PyTorch extension (python/) built with g++'s ASan+UBSan (PyTorch builds extensions with
  # the compiler it was built with) and its pytest suite run in that interpreter. The runtime
  # must come first: LD_PRELOAD puts libasan (and libstdc++, whose __cxa_throw ASan intercepts:
  # PyTorch's threads throw and catch internally) ahead of python3, which links neither. Leak
  # checking is off: the interpreter and PyTorch keep their allocations until exit by design.
  # --capture=sys leaves file descriptor 2 alone, so that a report reaches the log.
  # test_the_kernels_release_the_gil is left to the optimised build (tests/python.sh): it times
  # one thread against another over causal softmax at 8192 tokens, half a minute of this build's
  # -O0 kernels, and the same calls run from two threads in test_threads.py's other tests here.
  if /usr/bin/python3 -c "import ensurepip, venv" 2>/dev/null; then  # torch comes from pip
    t0=$SECONDS
    venv=$base/asan-python
    echo "== ASan+UBSan, PyTorch extension: building into $venv"
    MIXATTN_TORCH_SANITIZE=address,undefined bash python/venv.sh "$venv"
    echo "== ASan+UBSan, PyTorch extension: pytest python/tests"
    LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" \
      ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      "$venv/bin/python" -m pytest -q -p no:cacheprovider --capture=sys python/tests \
      --deselect python/tests/test_threads.py::test_the_kernels_release_the_gil || status=1
    echo "== ASan+UBSan, PyTorch extension: $((SECONDS - t0)) s"
  else
    echo "== ASan+UBSan, PyTorch extension: SKIPPED (/usr/bin/python3 has no venv)"
  fi
fi
echo "== sanitizers: $([[ $status == 0 ]] && echo clean || echo FAILED) in $((SECONDS - start)) s"
exit $status
