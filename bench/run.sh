#!/usr/bin/env bash
# bench/run.sh — build mixattn's benchmarks, run them, summarise them (bash bench/run.sh --help).
# The rules, the targets and every MIXATTN_BENCH_* variable: docs/benchmarking.md.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash bench/run.sh [--full] [--strict] [--verbose] [--help]

Builds the benchmark binaries (and, where PyTorch is installed, the PyTorch extension), runs them,
prints the headline tables and writes a summary and the plots into the run's own folder, never
over the recorded results (bench/results/summary.md, which the README cites):
bench/results/latest/ for the main job, bench/results/full-<UTC date and time>/ for --full,
bench/results/filtered/ with MIXATTN_BENCH_FILTER. A finished --full run becomes the record with
python3 bench/summary.py --record bench/results/full-<date and time>.

  (default)   the main job: every operator at N = 4096 against tiled and naive softmax attention
              and its GEMM floor, the fraction-of-peak targets, decoding, the 2-thread batched
              rows, the training shapes, and the extension against eager PyTorch at one shape
              (about 10 minutes on 2 idle cores, build included)
  --full      every benchmark at every size: the run the recorded results come from (an hour
              or more on 2 cores), into a folder of its own
  --strict    exit 1 when a row is still impossible or too noisy to judge after re-measuring
              (otherwise it is reported as unreliable and the run ends with exit 0)
  --verbose   show the benchmark binaries' own output (default: build/bench/logs/)
  --help      this text

Environment (docs/benchmarking.md): MIXATTN_BENCH_REPETITIONS, MIXATTN_BENCH_RETRIES,
MIXATTN_BENCH_MIN_TIME, MIXATTN_BENCH_FILTER, MIXATTN_BENCH_CPU, MIXATTN_BENCH_BUILD_DIR,
MIXATTN_BENCH_MALLOC, MIXATTN_BENCH_MEMORY_MANAGER, MIXATTN_BENCH_TORCH.
Exit status: non-zero if a binary did not build or failed, or the summary refused the results.
EOF
}

# Seconds since the job started, as m:ss.
clock() {
  local s=$(($(date +%s) - start))
  printf '%d:%02d' $((s / 60)) $((s % 60))
}

# stage WHAT EXPECTED COMMAND...: one progress line (elapsed, what, expected), then the command.
stage() {
  local what=$1 expected=$2 t0
  shift 2
  t0=$(date +%s)
  echo "== [$(clock)] $what — expected $expected"
  "$@"
  echo "   $what: $(($(date +%s) - t0)) s"
}

configure() {
  local gen=()
  [[ -f $build/CMakeCache.txt ]] || ! command -v ninja >/dev/null || gen=(-G Ninja)
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMIXATTN_BUILD_TESTS=OFF \
    -DMIXATTN_BUILD_EXAMPLES=OFF -DMIXATTN_BUILD_BENCHMARKS=ON -DMIXATTN_INSTALL=OFF >/dev/null
}

# Every binary in one build (each is one translation unit, so -j2 keeps both cores busy), going
# on past a binary that does not compile; the PyTorch extension builds beside it.
build_all() {
  local keep=(-k) t ext_pid=
  grep -q "CMAKE_GENERATOR:INTERNAL=Ninja" "$build/CMakeCache.txt" && keep=(-k 0)
  for t in "${targets[@]}"; do rm -f "$build/bench/$t"; done
  if [[ -n $torch ]]; then
    bash python/venv.sh "$build/venv" >"$build/build-torch_ext.log" 2>&1 &
    ext_pid=$!
  fi
  cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" -- "${keep[@]}" \
    >"$build/build.log" 2>&1 || true
  for t in "${targets[@]}"; do
    if [[ -x $build/bench/$t ]]; then built+=("$t"); else failed+=("$t"); fi
  done
  if ((${#failed[@]})); then
    grep -E "error" "$build/build.log" | head -20
    echo "bench/run.sh: ${failed[*]} failed to build; skipping (see $build/build.log)" >&2
  fi
  if [[ -n $ext_pid ]] && ! wait "$ext_pid"; then
    tail -20 "$build/build-torch_ext.log"
    echo "bench/run.sh: the PyTorch extension failed to build; skipping its benchmark" >&2
    failed+=(torch_ext)
    torch=
  fi
}

# The whole script is one function, read in full before it runs: editing this file while a run is
# in progress cannot change what that run executes.
main() {
  local full= strict= verbose= arg
  for arg in "$@"; do
    case $arg in
      --full) full=1 ;;
      --strict) strict=1 ;;
      --verbose) verbose=1 ;;
      -h | --help) usage; return 0 ;;
      *) echo "bench/run.sh: unknown option $arg" >&2; usage >&2; return 2 ;;
    esac
  done
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cd "$root"
  start=$(date +%s)
  build=$(realpath -m "${MIXATTN_BENCH_BUILD_DIR:-build/bench}")
  if [[ ${MIXATTN_BENCH_QUICK:-0} != 0 && -z $full ]]; then
    echo "== MIXATTN_BENCH_QUICK is the default now: the main job"
  fi
  py=/usr/bin/python3
  mkdir -p "$build"

  stage "dependencies (cmake/install-deps.sh bench)" "a few seconds once installed" \
    bash cmake/install-deps.sh bench
  stage "configure ($build, Release, benchmarks only)" "~10 s" configure
  mapfile -t targets < <(for f in bench/bench_*.cpp; do basename "$f" .cpp; done)
  # The PyTorch extension's benchmark runs where /usr/bin/python3 can make the virtual
  # environment python/venv.sh puts torch 2.13.0 into (cmake/install-deps.sh installs venv),
  # unless filtered out.
  torch=
  if "$py" -c "import ensurepip, venv" 2>/dev/null && { [[ -z ${MIXATTN_BENCH_FILTER:-} ]] ||
      grep -qE -- "$MIXATTN_BENCH_FILTER" <<<"torch_ext"; }; then
    torch=1
  fi
  built=() failed=()
  stage "build ${#targets[@]} binaries (-j$(nproc))${torch:+ and the PyTorch extension}" \
    "~5 min on 2 idle cores from a fresh clone, seconds when up to date" build_all
  if ((${#built[@]} == 0)); then
    echo "bench/run.sh: nothing built" >&2
    exit 1
  fi

  # bench/measure.py picks the run's folder (bench/results/latest, full-<date> or filtered).
  local args=(--build "$build" --start "$start"
              --binaries "$(IFS=,; echo "${built[*]}")"
              --rounds "${MIXATTN_BENCH_REPETITIONS:-3}" --retries "${MIXATTN_BENCH_RETRIES:-3}")
  local t
  for t in "${failed[@]}"; do args+=(--not-built "$t"); done
  [[ -n $full ]] && args+=(--full)
  [[ -n $strict ]] && args+=(--strict)
  [[ -n $verbose ]] && args+=(--verbose)
  [[ -n ${MIXATTN_BENCH_MIN_TIME:-} ]] && args+=(--min-time "$MIXATTN_BENCH_MIN_TIME")
  [[ -n ${MIXATTN_BENCH_FILTER:-} ]] && args+=(--filter "$MIXATTN_BENCH_FILTER")
  # One thread: Eigen is built with EIGEN_DONT_PARALLELIZE; the one-thread binaries are pinned to
  # one core so the OS does not migrate them. The multi-threaded binaries get every core.
  command -v taskset >/dev/null && args+=(--cpu "${MIXATTN_BENCH_CPU:-$(($(nproc) - 1))}")
  [[ -n $torch ]] && args+=(--torch-python "$build/venv/bin/python")
  [[ ${MIXATTN_BENCH_TORCH:-0} == 1 ]] && args+=(--torch-side-by-side)

  status=0
  "$py" bench/measure.py "${args[@]}" || status=$?
  echo "== done in $(clock) (m:ss)"
  if ((${#failed[@]})); then
    echo "bench/run.sh: these did not build: ${failed[*]}" >&2
    exit 1
  fi
  if ((status)); then
    echo "bench/run.sh: the summary refused the results or a benchmark failed (see above)" >&2
    exit "$status"
  fi
}

main "$@"
