#!/usr/bin/env bash
# bench/run.sh — build and run mixattn's benchmarks, then summarise them.
#
#   bash bench/run.sh                        full sweep (37 to 84 minutes on 2 idle cores)
#   MIXATTN_BENCH_QUICK=1 bash bench/run.sh  subset that still covers every target (23 min on 2 idle
#                                            cores, 10 of them in the PyTorch extension benchmark)
#   MIXATTN_BENCH_TORCH=1 bash bench/run.sh  also the PyTorch eager side-by-side (apt-installs
#                                            python3-torch and libopenblas0-pthread)
# Where PyTorch is installed (install-deps installs it), the PyTorch extension is built into
# $MIXATTN_BENCH_BUILD_DIR/venv and measured against eager PyTorch (bench/torch_ext_bench.py,
# bench/results/torch_ext.json; about 15 minutes on an idle 2-core machine, 9 of them in the
# paper's broadcast-form eager GMA; 54 where PyTorch's OpenBLAS runs its generic kernels).
#
# On a fresh Debian 12 machine run it as root (or with sudo available): it installs the build
# dependencies through cmake/install-deps.sh. Other knobs:
#   MIXATTN_BENCH_MIN_TIME   Google Benchmark --benchmark_min_time in seconds, per repetition
#                            (default 0.2, quick 0.05)
#   MIXATTN_BENCH_REPETITIONS  repetitions of every point (default 3; the summary gives no verdict
#                            from a point with fewer than 3 repetitions and fewer than 3 iterations)
#   MIXATTN_BENCH_FILTER     --benchmark_filter regex applied to every binary (the summary then
#                            accepts absent benchmarks); a filtered run writes its results to
#                            bench/results/filtered/, so that it never replaces the recorded full
#                            run's summary and plots
#   MIXATTN_BENCH_CPU        core the single-threaded binaries are pinned to (default: the last)
#   MIXATTN_BENCH_BUILD_DIR  build directory (default build/bench)
#   MIXATTN_BENCH_MALLOC=keep  make glibc keep freed memory instead of returning it to the kernel
#                            (the binaries through mallopt, the PyTorch run through
#                            GLIBC_TUNABLES), as a comparison; by default everything runs under
#                            glibc's defaults, as a user's program does (bench/bench_common.hpp)
#   MIXATTN_BENCH_MEMORY_MANAGER=0  skip Google Benchmark's extra memory-accounting run (the
#                            default in quick mode)
# Results: bench/results/<binary>.json, bench/results/summary.md, time_vs_n.png, memory_vs_n.png
# (bench/results/filtered/ for a filtered run).
# Exit status: non-zero if a binary did not build, or if bench/summary.py refuses the results (a
# measurement beyond its physical bound, or a missing benchmark).
set -euo pipefail

# The whole script is one function, read in full before it runs: editing this file while a run is
# in progress cannot change what that run executes.
main() {
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cd "$root"
  build=$(realpath -m "${MIXATTN_BENCH_BUILD_DIR:-build/bench}")
  results=bench/results
  [[ -n ${MIXATTN_BENCH_FILTER:-} ]] && results=bench/results/filtered
  quick=${MIXATTN_BENCH_QUICK:-0}
  [[ $quick == 0 ]] && quick=
  min_time=${MIXATTN_BENCH_MIN_TIME:-$([[ -n $quick ]] && echo 0.05 || echo 0.2)}
  repetitions=${MIXATTN_BENCH_REPETITIONS:-3}
  py=/usr/bin/python3
  start=$(date +%s)

  echo "== dependencies"
  bash cmake/install-deps.sh bench

  echo "== configure ($build, Release, benchmarks only)"
  cmake_args=(-S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMIXATTN_BUILD_TESTS=OFF
              -DMIXATTN_BUILD_EXAMPLES=OFF -DMIXATTN_BUILD_BENCHMARKS=ON -DMIXATTN_INSTALL=OFF)
  cmake "${cmake_args[@]}" >/dev/null

  mapfile -t targets < <(for f in bench/bench_*.cpp; do basename "$f" .cpp; done)
  # Each binary on its own, so one that does not compile does not cost the others' results.
  built=() failed=()
  for t in "${targets[@]}"; do
    echo "== build $t (log: $build/build-$t.log)"
    if cmake --build "$build" -j"$(nproc)" --target "$t" >"$build/build-$t.log" 2>&1; then
      built+=("$t")
    else
      grep -E "error" "$build/build-$t.log" | head -20
      echo "bench/run.sh: $t failed to build; skipping it (see $build/build-$t.log)" >&2
      failed+=("$t")
    fi
  done
  if ((${#built[@]} == 0)); then
    echo "bench/run.sh: nothing built" >&2
    exit 1
  fi

  mkdir -p "$results"
  rm -f "$results"/*.json

  # One thread: Eigen is built with EIGEN_DONT_PARALLELIZE; pin the process to one core so the OS
  # does not migrate it. The multi-threaded binary (bench_batched) gets every core.
  cpu=${MIXATTN_BENCH_CPU:-$(($(nproc) - 1))}
  pin=()
  command -v taskset >/dev/null && pin=(taskset -c "$cpu")
  export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MIXATTN_BENCH_QUICK=${quick:+1}
  # Google Benchmark's memory run repeats every benchmark once more; quick mode skips it (the
  # peak_heap_bytes counter is measured during the timed calls either way).
  [[ -n $quick ]] && export MIXATTN_BENCH_MEMORY_MANAGER=${MIXATTN_BENCH_MEMORY_MANAGER:-0}

  for t in "${built[@]}"; do
    echo "== $t (min_time ${min_time}s × $repetitions repetitions${quick:+, quick})"
    runner=("${pin[@]}")
    [[ $t == bench_batched ]] && runner=()
    # Every repetition is in the JSON (the summary takes median and spread); the console shows
    # only the aggregates.
    "${runner[@]}" "$build/bench/$t" --benchmark_min_time="$min_time" \
      --benchmark_repetitions="$repetitions" --benchmark_display_aggregates_only=true \
      --benchmark_out="$results/$t.json" --benchmark_out_format=json \
      ${MIXATTN_BENCH_FILTER:+--benchmark_filter="$MIXATTN_BENCH_FILTER"} \
      --benchmark_counters_tabular=false
    # A filter that matches none of a binary's benchmarks leaves an empty file: the binary was
    # filtered out, not broken, and the summary (run with --partial) treats it as absent.
    if [[ -n ${MIXATTN_BENCH_FILTER:-} && ! -s $results/$t.json ]]; then
      echo "== $t: no benchmark matches the filter"
      rm -f "$results/$t.json"
    fi
  done

  # The same malloc policy as the C++ binaries (bench_common.hpp: configure_malloc).
  tunables=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824
  [[ ${MIXATTN_BENCH_MALLOC:-default} == keep ]] || tunables=${GLIBC_TUNABLES:-}

  # The PyTorch extension against eager PyTorch (python/, bench/torch_ext_bench.py), whenever
  # PyTorch is installed: built into a virtual environment in the build directory.
  if [[ -n ${MIXATTN_BENCH_FILTER:-} ]] && ! grep -qE -- "$MIXATTN_BENCH_FILTER" <<<"torch_ext"; then
    echo "== PyTorch extension: filtered out"
  elif "$py" -c "import torch" 2>/dev/null; then
    echo "== PyTorch extension: build (log: $build/build-torch_ext.log)"
    if bash python/venv.sh "$build/venv" >"$build/build-torch_ext.log" 2>&1; then
      GLIBC_TUNABLES=$tunables "$build/venv/bin/python" bench/torch_ext_bench.py \
        --out "$results/torch_ext.json"
    else
      tail -20 "$build/build-torch_ext.log"
      echo "bench/run.sh: the PyTorch extension failed to build; skipping its benchmark" >&2
      failed+=(torch_ext)
    fi
  else
    echo "== PyTorch extension: skipped (no PyTorch for $py)"
  fi

  if [[ ${MIXATTN_BENCH_TORCH:-0} == 1 ]]; then
    echo "== PyTorch side-by-side"
    if ! "$py" -c "import torch" 2>/dev/null; then
      if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; else SUDO=; fi
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        python3-torch libopenblas0-pthread
    fi
    GLIBC_TUNABLES=$tunables "${pin[@]}" "$py" bench/torch_side_by_side.py \
      --out "$results/torch_side_by_side.json"
  fi

  echo "== summary"
  summary_args=(--out "$results")
  for t in "${failed[@]}"; do summary_args+=(--not-built "$t"); done
  [[ -n ${MIXATTN_BENCH_FILTER:-} ]] && summary_args+=(--partial)
  status=0
  "$py" bench/summary.py "${summary_args[@]}" || status=$?
  echo "== done in $(($(date +%s) - start)) s"
  if ((${#failed[@]})); then
    echo "bench/run.sh: these benchmarks did not build: ${failed[*]}" >&2
    exit 1
  fi
  if ((status)); then
    echo "bench/run.sh: bench/summary.py refused the results (see above)" >&2
    exit "$status"
  fi
}

main "$@"
