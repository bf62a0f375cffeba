#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and fuzzes each for a while.
#
#   tests/fuzz/run.sh [seconds]                 every target, up to `seconds` each (default 60)
#   tests/fuzz/run.sh --total SECONDS           every target, SECONDS of wall time in all: each
#                                               gets SECONDS / ceil(targets / jobs) (the test
#                                               command's form, tests/run.sh)
#   tests/fuzz/run.sh --target fuzz_packed --seconds 3600 --runs -1
#                                               one target (--target repeats), for longer
#   tests/fuzz/run.sh --campaign                the long campaign, outside CI: every target
#                                               (none held back) to 1 000 000 executions or an
#                                               hour, whichever comes first, from a random seed;
#                                               then each working corpus is minimised into the
#                                               checked-in seeds (libFuzzer -merge=1: only inputs
#                                               that reach new edges), to review and commit
#
# Options: --target NAME (a tests/fuzz/NAME.cpp; repeatable; only those are built), --seconds S
# (per target), --total S (wall time for all, see above), --runs N (executions per target,
# default 20000, -1 unbounded; MIXATTN_FUZZ_RUNS), --campaign (see above; --seconds and --runs
# still apply after it), --help. MIXATTN_FUZZ_ALL=1 includes the
# targets held back from the default run (below).
# Each target starts from its checked-in seed corpus (tests/fuzz/corpus/<target>/, changed only
# by --campaign) plus whatever earlier runs added to the working corpus in $build/corpus/<target>/.
# A failure leaves crash-* / oom-* / timeout-* files in $build/artifacts/ and makes the script
# exit non-zero; replay one with `$build/tests/fuzz/<target> <file>` (MIXATTN_FUZZ_VERBOSE=1
# prints the decoded case). Environment: CXX (default clang++), MIXATTN_FUZZ_DIR (default
# build/fuzz), MIXATTN_JOBS, MIXATTN_FUZZ_SEED, MIXATTN_FUZZ_RUNS.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
seconds=60
total=""
campaign=0
only=()
while (($#)); do
  case $1 in
    --target) only+=("$2"); shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --total) total=$2; shift 2 ;;
    --runs) export MIXATTN_FUZZ_RUNS=$2; shift 2 ;;
    --campaign)
      campaign=1 seconds=3600
      export MIXATTN_FUZZ_RUNS=1000000 MIXATTN_FUZZ_ALL=1
      export MIXATTN_FUZZ_SEED=${MIXATTN_FUZZ_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
      shift ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    [0-9]*) seconds=$1; shift ;;
    *) echo "tests/fuzz/run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
build=${MIXATTN_FUZZ_DIR:-build/fuzz}
jobs=${MIXATTN_JOBS:-$(nproc)}

mkdir -p "$build"
if [[ -z ${CMAKE_GENERATOR:-} ]] && command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi

# The ASan + UBSan tree of tests/sanitize.sh (tests/asan_tree.sh): no NDEBUG, so Eigen's own
# bounds assertions stay on next to MIXATTN_ASSERT; the test command points MIXATTN_FUZZ_DIR at
# the tree its sanitizer pass built, so nothing is compiled again here.
. tests/asan_tree.sh
mixattn_configure_asan "$build"
# Targets whose operator header exists (tests/fuzz/CMakeLists.txt skips the others).
help=$(cmake --build "$build" --target help)
targets=()
for src in tests/fuzz/fuzz_*.cpp; do
  t=$(basename "$src" .cpp)
  if grep -qw -- "$t" <<<"$help"; then targets+=("$t"); fi
done
# Held back from the default run (still built; run them with --target or MIXATTN_FUZZ_ALL=1):
# targets with an open finding that is not yet told apart from a defect of their own oracle
# (docs/testing.md, "Fuzzing").
held_back=()
if ((${#only[@]} == 0)) && [[ ${MIXATTN_FUZZ_ALL:-0} != 1 ]]; then
  kept=()
  for t in "${targets[@]}"; do
    if printf '%s\n' "${held_back[@]}" | grep -qx -- "$t"; then continue; fi
    kept+=("$t")
  done
  echo "== held back (open findings, docs/testing.md): ${held_back[*]}"
  targets=("${kept[@]}")
fi
if ((${#only[@]} > 0)); then
  for t in "${only[@]}"; do
    if ! printf '%s\n' "${targets[@]}" | grep -qx -- "$t"; then
      echo "tests/fuzz/run.sh: no fuzz target $t (targets: ${targets[*]})" >&2
      exit 2
    fi
  done
  targets=("${only[@]}")
fi
if ((${#targets[@]} == 0)); then
  echo "no fuzz targets (operator headers missing?)" >&2
  exit 1
fi
if [[ -n $total ]]; then  # the targets run $jobs at a time: ceil(targets / jobs) rounds
  rounds=$(((${#targets[@]} + jobs - 1) / jobs))
  seconds=$((total / rounds > 1 ? total / rounds : 1))
fi
# Only the targets (and the workers they link), side by side in one Ninja build.
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

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
  local extra=()
  # The parameter file parser may allocate what the model needs (a few KiB here) and a name of
  # up to 64 KiB, never what a hostile size field asks for.
  if [[ $t == fuzz_layer_load ]]; then extra=(-malloc_limit_mb=64); fi
  "$build/tests/fuzz/$t" -seed="${MIXATTN_FUZZ_SEED:-1}" -runs="${MIXATTN_FUZZ_RUNS:-20000}" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 "${extra[@]}" \
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
# Into the seeds go only inputs that reach new edges (hit counts aside): the seeds stay few.
extra_merge=(-use_counters=0 -rss_limit_mb=2048 -timeout=10)
if ((campaign)); then echo "== campaign seed: $MIXATTN_FUZZ_SEED"; fi
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
    # libFuzzer's last status line: "#<runs> DONE cov: <edges> ft: <features> corp: <n>/<size>".
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -n 1 || true)
    line="$t: $execs executions, no failure${cov:+ ($cov)}"
    if ((campaign)); then
      before=$(find "tests/fuzz/corpus/$t" -type f | wc -l)
      "$build/tests/fuzz/$t" -merge=1 "${extra_merge[@]}" "tests/fuzz/corpus/$t" "$build/corpus/$t" \
        >"$build/$t.merge.log" 2>&1 || { status=1; line+="; the merge failed (see $build/$t.merge.log)"; }
      line+="; $(($(find "tests/fuzz/corpus/$t" -type f | wc -l) - before)) inputs added to the seeds"
    fi
    summary+=("$line")
  fi
done
printf '%s\n' "${summary[@]}"
exit $status
