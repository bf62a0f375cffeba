# Sourced by tests/sanitize.sh and tests/fuzz/run.sh: the one ASan + UBSan build tree they share.
# The suite and the libFuzzer targets are built in it side by side, so the operators' workers
# (tests/instances.cpp) are compiled once for both: at -O1 and instrumented for the fuzzers'
# coverage (tests/fuzz/CMakeLists.txt), the rest of the suite at -O0.
#
#   mixattn_configure_asan DIR [cmake options...]
#
# -O0: clang compiles the suite in about half the time of -O1 under ASan, and the tests then run
# about 4x slower (seconds each), the cheaper side for this build-dominated pass; nothing is
# optimised away before it is checked. The workers are the exception: one file, compiled at -O1,
# since the tests that do the most arithmetic (central differences of the flash reference over
# several tiles, grouped-query packed calls) ran for minutes at -O0, and the fuzzers need speed.
# The compile-only checks (headers on their own, compile-time refusals) are the main pass's: a
# sanitizer has nothing to add to a build that only compiles.
mixattn_asan_flags="-O0 -g1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
mixattn_configure_asan() {
  local dir=$1 cxx=${CXX:-clang++} fuzzers=OFF
  shift
  # libFuzzer comes with clang; another compiler builds no fuzz targets here.
  if "$cxx" --version 2>/dev/null | grep -q clang; then fuzzers=ON; fi
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Sanitize -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_CXX_FLAGS_SANITIZE="$mixattn_asan_flags" \
    -DCMAKE_EXE_LINKER_FLAGS_SANITIZE="$mixattn_asan_flags" \
    -DMIXATTN_BUILD_TESTS=ON -DMIXATTN_BUILD_BENCHMARKS=OFF -DMIXATTN_BUILD_EXAMPLES=OFF \
    -DMIXATTN_BUILD_FUZZERS=$fuzzers -DMIXATTN_INSTALL=OFF -DMIXATTN_TEST_HEADER_CHECKS=OFF \
    -DMIXATTN_TEST_INSTANCE_OPTIONS=-O1 "$@" >/dev/null
}
