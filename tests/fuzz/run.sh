#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and fuzzes each for a while.
#
#   tests/fuzz/run.sh [seconds]        default 60 s per target
#
# Each target starts from its checked-in seed corpus (tests/fuzz/corpus/<target>/, never
# modified) plus whatever earlier runs added to the working corpus in $build/corpus/<target>/.
# A failure leaves crash-* / oom-* / timeout-* files in $build/artifacts/ and makes the script
# exit non-zero; replay one with `$build/tests/fuzz/<target> <file>` (MIXATTN_FUZZ_VERBOSE=1
# prints the decoded case). Environment: CXX (default clang++), MIXATTN_FUZZ_DIR (default
# build/fuzz), MIXATTN_JOBS.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
seconds=${1:-60}
build=${MIXATTN_FUZZ_DIR:-build/fuzz}
jobs=${MIXATTN_JOBS:-$(nproc)}

mkdir -p "$build"

# No build type: no NDEBUG, so Eigen's own bounds assertions stay on next to MIXATTN_ASSERT.
cmake -S . -B "$build" -DCMAKE_CXX_COMPILER="${CXX:-clang++}" -DCMAKE_BUILD_TYPE= \
  -DMIXATTN_BUILD_FUZZERS=ON -DMIXATTN_BUILD_TESTS=OFF -DMIXATTN_BUILD_BENCHMARKS=OFF \
  -DMIXATTN_BUILD_EXAMPLES=OFF -DMIXATTN_INSTALL=OFF >/dev/null
# Targets whose operator header exists (tests/fuzz/CMakeLists.txt skips the others).
help=$(cmake --build "$build" --target help)
targets=()
for src in tests/fuzz/fuzz_*.cpp; do
  t=$(basename "$src" .cpp)
  if grep -qw -- "$t" <<<"$help"; then targets+=("$t"); fi
done
if ((${#targets[@]} == 0)); then
  echo "no fuzz targets (operator headers missing?)" >&2
  exit 1
fi
# All of them in one build: the targets are one source file each, and naming them with --target
# would build them one after another (CMake's top-level Makefile is not parallel across goals).
cmake --build "$build" -j "$jobs"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
mkdir -p "$build/artifacts"
# The targets are single-threaded: fuzz up to $jobs of them at once.
fuzz_one() {  # fuzz_one <target>: fuzzes into $build/<target>.log, returns libFuzzer's status
  local t=$1 work="$build/corpus/$1"
  mkdir -p "$work"
  # A fixed seed and a bounded number of executions (MIXATTN_FUZZ_SEED, default 1;
  # MIXATTN_FUZZ_RUNS, default 20000, -1 for unbounded) bound a CI run. They do not make it
  # reproducible: which edges an input covers depends on the addresses its buffers get (aligned
  # or not) and on scratch reused from earlier inputs, so two runs with the same seed keep
  # different corpora and drift apart. A failing input is therefore printed (hex) with the
  # failure, so that a CI log alone is enough to replay it. Vary the seed and lift the bound for
  # longer campaigns.
  "$build/tests/fuzz/$t" -seed="${MIXATTN_FUZZ_SEED:-1}" -runs="${MIXATTN_FUZZ_RUNS:-20000}" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" \
    "$work" "tests/fuzz/corpus/$t" >"$build/$t.log" 2>&1
}
for t in "${targets[@]}"; do
  while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
  echo "== $t: up to ${seconds} s"
  rm -f "$build/$t.rc"
  touch "$build/$t.started"  # artifacts newer than this are this run's
  (fuzz_one "$t" && echo 0 >"$build/$t.rc" || echo $? >"$build/$t.rc") &
done
wait
status=0
summary=()
for t in "${targets[@]}"; do
  log="$build/$t.log"
  rc=$(cat "$build/$t.rc" 2>/dev/null || echo 1)
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
  if ((rc != 0)); then
    status=1
    summary+=("$t: FAILED after $execs executions (see $log)")
    grep -E 'oracle|runtime error|ERROR|SUMMARY|Test unit written' "$log" | head -n 8
    # The input itself, as hex (`xxd -r -p` turns the lines back into the file to replay).
    find "$build/artifacts" -name "$t-*" -newer "$build/$t.started" | while read -r a; do
      echo "input $(basename "$a") ($(wc -c <"$a") bytes), hex:"
      od -An -v -tx1 "$a" | tr -d ' \n' | fold -w 64
      echo
    done
  else
    summary+=("$t: $execs executions, no failure")
  fi
done
printf '%s\n' "${summary[@]}"
exit $status
