#!/usr/bin/env python3
"""Runs mixattn's benchmark binaries for bench/run.sh: round by round, then again for what the
summary cannot judge, then the summary.

    python3 bench/measure.py --build DIR [--results DIR] [--full] [--strict] [--rounds 3]
                             [--retries 3] [--min-time S] [--filter REGEX] [--cpu N]
                             [--not-built BINARY ...] [--torch-python PY] [--torch-side-by-side]
                             [--start EPOCH] [--verbose] [--no-plots]

Where the results go: bench/results/ itself holds the recorded run the README cites, which no run
writes (bench/summary.py --record DIR makes a finished --full run the record). The main job
writes bench/results/latest/, replacing the previous main job's; --full writes a folder of its
own, bench/results/full-<UTC date and time>/; a filtered run (--filter) writes
bench/results/filtered/. --results DIR overrides that, except with bench/results itself.
DIR/run.json records the run (mode, filter, start) and the machine, read from it: /proc/cpuinfo's
model name, family and model and the ISA flags that matter (avx2, avx512f, avx512_bf16, amx), the
OS, and the compiler and its flags from the build directory; bench/summary.py states them.

Every binary runs once per round (--benchmark_repetitions=1, results in
DIR/<binary>.t0.r<round>.json), so each point has one repetition per round, and the two sides of
a ratio (an operator and its floor, 1 and 2 threads, glibc's malloc and the kept one) run seconds
apart in the same process: bench/summary.py takes a ratio round by round. The main job (default)
runs each binary's headline set (MAIN_FILTERS); --full runs every benchmark. Then, up to
--retries times, the points of every row the summary finds impossible or too noisy to judge
(summary.py --plan) are measured again, every round, into DIR/<binary>.t<try>.r<round>.json,
which replace the earlier measurements of those points. A progress line per stage says what
runs, the time elapsed and the time expected (this machine's last run of the same stage, when
recorded in the build directory, else an estimate for 2 idle cores).
Exit status: the summary's, or 1 when a binary failed.
"""

import argparse
import glob
import json
import os
import re
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The recorded run (the README's table cites its summary.md): only bench/summary.py --record
# writes here.
RECORD = os.path.join(HERE, "results")
RUN_FILE = "run.json"
# The instruction-set extensions the kernels' speed depends on ("amx": any amx_* flag).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx")

# The binaries in the order they run within a round; the unpinned ones use both cores.
BINARIES = ["bench_peak", "bench_gma", "bench_reference", "bench_ovq", "bench_linear",
            "bench_decode", "bench_batched", "bench_training"]
UNPINNED = {"bench_batched", "bench_training"}
# The main job's headline set: every operator at N = 4096 against tiled and naive softmax
# attention and its GEMM floor, the five fraction-of-peak targets (OVQ's at T = 65536), the decode
# rows, the batched rows on 1 and 2 threads, and the training shapes that carry targets.
MAIN_FILTERS = {
    "bench_peak": ".",
    "bench_gma": "/4096$",
    "bench_reference": "^(naive|flash|floor_softmax)_(forward|fwd_bwd)_(bidir|causal)/4096$"
                       "|^flash_window256_",
    "bench_ovq": "^(ovq|floor_ovq)_(forward|fwd_bwd)/4096$|^(ovq|floor_ovq)_forward/65536$",
    "bench_linear": "/4096$",
    "bench_decode": "^decode_(gma|ovq|softmax_kv)/(1024|8192|32768)/|^decode_noise/",
    "bench_batched": "/N:4096/|^gma_packed_|^gma_separate_|^layer_",
    "bench_training": "^bh32_gma_(bidir|causal)_(forward|step)/N:2048/threads:1$"
                      "|^bh32_gma_bidir_step/N:2048/threads:2/"
                      "|^bh8_ovq_step/N:8192/threads:1$|^bh8_flash_bidir_step/N:2048/threads:1$",
}
# Seconds per stage on 2 idle cores (per round for a binary), until this machine has run it.
ESTIMATES = {
    "main": {"bench_peak": 1, "bench_gma": 5, "bench_reference": 9, "bench_ovq": 3,
             "bench_linear": 10, "bench_decode": 3, "bench_batched": 5, "bench_training": 5,
             "torch_ext": 40},
    "full": {"bench_peak": 1, "bench_gma": 150, "bench_reference": 120, "bench_ovq": 150,
             "bench_linear": 220, "bench_decode": 30, "bench_batched": 60, "bench_training": 150,
             "torch_ext": 1500, "torch_side_by_side": 300},
}


def read_machine(cpuinfo="/proc/cpuinfo", os_release="/etc/os-release"):
    """The machine as it describes itself: the first processor's model name, family, model and
    which of ISA_FLAGS it has, the number of CPUs, the OS's name."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor is enough: they are alike
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    isa = {name: (any(f.startswith("amx") for f in flags) if name == "amx" else name in flags)
           for name in ISA_FLAGS}
    system = ""
    try:
        with open(os_release) as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    system = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {"cpu": fields.get("model name", ""), "family": fields.get("cpu family", ""),
            "model": fields.get("model", ""), "isa": isa if flags else {},
            "cpus": os.cpu_count(), "os": system}


def read_compiler(build):
    """The C++ compiler that built the benchmarks, from the build directory: CMake's record of
    the compiler it identified (id, version, path) and the optimisation and instruction-set
    flags of the benchmark binaries' compile commands."""
    cache = {}
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                key, sep, value = line.rstrip("\n").partition("=")
                if sep and not key.startswith(("#", "//")):
                    cache[key.split(":")[0]] = value
    except OSError:
        pass
    found = {}
    ids = sorted(glob.glob(os.path.join(build, "CMakeFiles", "*", "CMakeCXXCompiler.cmake")),
                 key=os.path.getmtime)
    if ids:
        with open(ids[-1]) as f:
            text = f.read()
        for key in ("CMAKE_CXX_COMPILER_ID", "CMAKE_CXX_COMPILER_VERSION"):
            m = re.search(r'^set\(%s "([^"]*)"\)' % key, text, re.M)
            if m:
                found[key] = m.group(1)
    return {"id": found.get("CMAKE_CXX_COMPILER_ID", ""),
            "version": found.get("CMAKE_CXX_COMPILER_VERSION", ""),
            "path": cache.get("CMAKE_CXX_COMPILER", ""), "flags": bench_flags(build)}


def bench_flags(build):
    """-O and -m flags of a benchmark binary's compile command (Ninja's build.ninja or the
    Makefile generator's flags.make), in order, without repeats."""
    text = ""
    for path in sorted(glob.glob(os.path.join(build, "bench", "CMakeFiles", "bench_*.dir",
                                              "flags.make"))):
        with open(path) as f:
            text = "\n".join(line.split("=", 1)[1] for line in f if line.startswith("CXX_FLAGS"))
        break
    if not text:
        try:
            with open(os.path.join(build, "build.ninja")) as f:
                inside = False
                for line in f:
                    if line.startswith("build "):
                        inside = "/bench_" in line and ".cpp.o:" in line
                    elif inside and line.strip().startswith("FLAGS ="):
                        text = line.split("=", 1)[1]
                        break
        except OSError:
            pass
    flags = [w for w in text.split() if w.startswith(("-O", "-march", "-mtune", "-mavx", "-mfma"))]
    return " ".join(dict.fromkeys(flags))


def shown(path):
    """A path as the user reads it: relative to the repository when inside it."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return rel if not rel.startswith("..") else os.path.abspath(path)


def results_dir(args, now):
    """Where this run writes: its own folder, never the record (module docstring)."""
    if args.results:
        return args.results
    if args.filter:
        return os.path.join(RECORD, "filtered")
    if args.full:
        base = os.path.join(RECORD, "full-" + time.strftime("%Y-%m-%d-%H%M", time.gmtime(now)))
        path, k = base, 1
        while os.path.exists(path):
            k += 1
            path = f"{base}-{k}"
        return path
    return os.path.join(RECORD, "latest")


def is_record(path):
    return os.path.realpath(path) == os.path.realpath(RECORD)


def clear(results):
    """Empties the run's folder of an earlier run's files (results, run record, summary,
    plots), so nothing of that run is mistaken for this one's."""
    for f in os.listdir(results):
        if f.endswith((".json", ".png")) or f == "summary.md":
            os.remove(os.path.join(results, f))


def fingerprint():
    """The record's files with their sizes and modification times."""
    return {f: (st.st_size, st.st_mtime_ns) for f in os.listdir(RECORD)
            for st in [os.stat(os.path.join(RECORD, f))] if os.path.isfile(os.path.join(RECORD, f))}


def write_run(args, now):
    command = "bash bench/run.sh" + (" --full" if args.full else "")
    if args.filter:
        command = f"MIXATTN_BENCH_FILTER='{args.filter}' {command}"
    run = {"mode": args.mode, "command": command, "filter": args.filter,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
           "results": shown(args.results), "machine": read_machine(),
           "compiler": read_compiler(args.build)}
    with open(os.path.join(args.results, RUN_FILE), "w") as f:
        json.dump(run, f, indent=1)
    return run


def children_cpu():
    """User + system seconds of every finished child process so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fmt_clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """One line per stage: its number, the job's elapsed time, what runs, what it is expected to
    take; its own time when it ends. Stage times are kept in the build directory as the next
    run's expectations."""

    def __init__(self, args, stages):
        self.args, self.total, self.done = args, stages, 0
        self.start = args.start or time.time()
        self.path = os.path.join(args.build, f"stage-times-{args.mode}.json")
        try:
            with open(self.path) as f:
                self.last = json.load(f)
        except (OSError, ValueError):
            self.last = {}
        self.times = {}

    def expected(self, key):
        if key in self.last:
            return self.last[key], "last run"
        return (None if ":" in key else ESTIMATES[self.args.mode].get(key)), "estimate"

    def stage(self, key, what, fn):
        self.done += 1
        exp, source = self.expected(key)
        elapsed = fmt_clock(time.time() - self.start)
        hint = f" — expected ~{exp:.0f} s ({source})" if exp else ""
        print(f"== [{self.done:2d}/{self.total} {elapsed}] {what}{hint} ...", end="", flush=True)
        t0, c0 = time.time(), children_cpu()
        result = fn()
        took, cpu = time.time() - t0, children_cpu() - c0
        self.times[key] = took
        print(f" {took:.1f} s (CPU {cpu:.1f} s)", flush=True)
        return result

    def extra_stages(self, n):
        self.total += n

    def save(self):
        if self.args.filter:
            return  # a filtered run's stages are not the whole stages of the next run
        try:
            with open(self.path, "w") as f:
                json.dump({**self.last, **self.times}, f, indent=1)
        except OSError:
            pass


def run_binary(args, binary, attempt, rnd, regex):
    """Runs one binary once; returns an error text or None."""
    exe = os.path.join(args.build, "bench", binary)
    out = os.path.join(args.results, f"{binary}.t{attempt}.r{rnd}.json")
    cmd = [exe, f"--benchmark_min_time={args.min_time}", "--benchmark_repetitions=1",
           f"--benchmark_out={out}", "--benchmark_out_format=json",
           "--benchmark_counters_tabular=false"]
    if regex:
        cmd.append(f"--benchmark_filter={regex}")
    if binary not in UNPINNED and args.cpu is not None:
        cmd = ["taskset", "-c", str(args.cpu)] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MIXATTN_BENCH_MODE=args.mode)
    if args.mode == "main":  # peak_heap_bytes is measured during the timed calls either way
        env.setdefault("MIXATTN_BENCH_MEMORY_MANAGER", "0")
    log = os.path.join(args.build, "logs", f"{binary}.t{attempt}.r{rnd}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        sink = None if args.verbose else f
        status = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    if os.path.exists(out) and os.path.getsize(out) == 0:
        os.remove(out)  # a filter that matches none of the binary's benchmarks
    if status != 0:
        return f"{binary} exited with status {status} (log: {log})"
    return None


def torch_ext_cmd(args, attempt, only=None):
    cmd = [args.torch_python, os.path.join(HERE, "torch_ext_bench.py"), "--out",
           os.path.join(args.results, f"torch_ext.t{attempt}.json")]
    if args.mode == "main":
        cmd.append("--main")
    if only:
        cmd += ["--only", ",".join(only)]
    return cmd


def torch_env(args):
    """The PyTorch runs' environment: the same malloc policy as the C++ binaries
    (bench_common.hpp: configure_malloc), through glibc's tunables."""
    env = dict(os.environ, MIXATTN_BENCH_MODE=args.mode)
    if os.environ.get("MIXATTN_BENCH_MALLOC") == "keep":
        env["GLIBC_TUNABLES"] = ("glibc.malloc.mmap_threshold=33554432:"
                                 "glibc.malloc.trim_threshold=1073741824")
    return env


def run_torch_ext(args, attempt, only=None):
    env = torch_env(args)
    if args.cpu is not None:
        env["MIXATTN_BENCH_CPU"] = str(args.cpu)
    log = os.path.join(args.build, "logs", f"torch_ext.t{attempt}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        status = subprocess.run(torch_ext_cmd(args, attempt, only), env=env,
                                stdout=None if args.verbose else f,
                                stderr=subprocess.STDOUT).returncode
    return None if status == 0 else f"torch_ext_bench.py exited with status {status} (log: {log})"


def run_side_by_side(args):
    out = os.path.join(args.results, "torch_side_by_side.t0.json")
    cmd = [sys.executable, os.path.join(HERE, "torch_side_by_side.py"), "--out", out]
    if args.cpu is not None:
        cmd = ["taskset", "-c", str(args.cpu)] + cmd
    status = subprocess.run(cmd, env=torch_env(args)).returncode
    return None if status == 0 else f"torch_side_by_side.py exited with status {status}"


def summary_args(args):
    out = ["--out", args.results]
    for b in args.not_built:
        out += ["--not-built", b]
    if args.filter:
        out.append("--partial")
    return out


def plan_of(args):
    """The summary's list of rows to measure again."""
    path = os.path.join(args.build, "remeasure.json")
    cmd = [sys.executable, os.path.join(HERE, "summary.py"), "--plan", path, *summary_args(args)]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    with open(path) as f:
        return json.load(f)


def remeasure(args, progress, binaries, attempt, plan, errors):
    """Measures the plan's points again, every round, as try `attempt`; False when none of them
    can be (a binary this run does not run)."""
    runnable = set(binaries) | ({"torch_ext"} if args.torch_python else set())
    by_binary = {}
    for item in plan:
        for binary, names in item["points"].items():
            if binary in runnable:
                by_binary.setdefault(binary, set()).update(names)
    if not by_binary:
        return False
    rows = "; ".join(f"{item['row']} ({item['why']})" for item in plan)
    print(f"== re-measuring (try {attempt}/{args.retries}): {rows}", flush=True)
    runs = [(b, r) for r in range(1, args.rounds + 1) for b in binaries if b in by_binary]
    progress.extra_stages(len(runs) + ("torch_ext" in by_binary))
    for binary, rnd in runs:
        names = sorted(by_binary[binary])
        regex = "^(" + "|".join(n.replace(".", "\\.") for n in names) + ")$"
        what = (f"try {attempt}/{args.retries}, round {rnd}/{args.rounds}: {binary} "
                f"({len(names)} benchmark{'s' if len(names) > 1 else ''})")
        err = progress.stage(f"{binary}:retry", what,
                             lambda: run_binary(args, binary, attempt, rnd, regex))
        if err:
            errors.append(err)
    if "torch_ext" in by_binary:
        err = progress.stage("torch_ext:retry", f"try {attempt}/{args.retries}: torch_ext_bench.py",
                             lambda: run_torch_ext(args, attempt, sorted(by_binary["torch_ext"])))
        if err:
            errors.append(err)
    return True


def measure(args, progress, binaries, errors):
    for rnd in range(1, args.rounds + 1):
        for binary in binaries:
            regex = args.filter or (MAIN_FILTERS.get(binary, ".") if args.mode == "main" else "")
            what = f"round {rnd}/{args.rounds}: {binary}"
            err = progress.stage(binary, what, lambda: run_binary(args, binary, 0, rnd, regex))
            if err:
                errors.append(err)
    if args.torch_python:
        err = progress.stage("torch_ext", "the PyTorch extension against eager PyTorch",
                             lambda: run_torch_ext(args, 0))
        if err:
            errors.append(err)
    if args.torch_side_by_side:
        err = progress.stage("torch_side_by_side", "PyTorch eager side-by-side",
                             lambda: run_side_by_side(args))
        if err:
            errors.append(err)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, help="the build directory (binaries in bench/)")
    ap.add_argument("--results", default="",
                    help="the run's folder (default: bench/results/latest, full-<date> or "
                         "filtered); never bench/results itself, the recorded run")
    ap.add_argument("--full", action="store_true", help="every benchmark, not the headline set")
    ap.add_argument("--strict", action="store_true",
                    help="fail when a row stays impossible or too noisy after the re-measurements")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every binary (repetitions)")
    ap.add_argument("--retries", type=int, default=3, help="re-measurements at most")
    ap.add_argument("--min-time", type=float, default=None,
                    help="--benchmark_min_time per repetition (default: main 0.1, full 0.2)")
    ap.add_argument("--filter", default="", help="--benchmark_filter for every binary")
    ap.add_argument("--cpu", type=int, default=None, help="core for the one-thread binaries")
    ap.add_argument("--binaries", default=",".join(BINARIES))
    ap.add_argument("--not-built", action="append", default=[], metavar="BINARY")
    ap.add_argument("--torch-python", default="", help="python with torch and mixattn")
    ap.add_argument("--torch-side-by-side", action="store_true")
    ap.add_argument("--start", type=float, default=None, help="the job's start (epoch seconds)")
    ap.add_argument("--verbose", action="store_true", help="the binaries' output on the terminal")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    args.mode = "full" if args.full else "main"
    if args.min_time is None:
        args.min_time = 0.2 if args.full else 0.1
    args.build = os.path.abspath(args.build)
    return args


def main(argv=None):
    args = parse_args(argv)
    given = [b for b in args.binaries.split(",") if b and b not in args.not_built]
    binaries = [b for b in BINARIES if b in given] + [b for b in given if b not in BINARIES]
    now = args.start or time.time()
    args.results = results_dir(args, now)
    if is_record(args.results):
        print(f"bench/measure.py: {shown(RECORD)} holds the recorded run the README cites: a run "
              f"writes a folder of its own (python3 bench/summary.py --record DIR makes a --full "
              f"run's folder the record)", file=sys.stderr)
        return 2
    record_before = fingerprint()
    os.makedirs(args.results, exist_ok=True)
    clear(args.results)
    write_run(args, now)
    stages = args.rounds * len(binaries) + bool(args.torch_python) + args.torch_side_by_side
    progress = Progress(args, stages)
    errors = []
    measure(args, progress, binaries, errors)
    for attempt in range(1, args.retries + 1):
        plan = plan_of(args)
        if not plan or not remeasure(args, progress, binaries, attempt, plan, errors):
            break
    final = summary_args(args) + (["--strict"] if args.strict else []) + \
        (["--no-plots"] if args.no_plots else [])
    print(f"== [{fmt_clock(time.time() - progress.start)}] summary", flush=True)
    status = subprocess.run([sys.executable, os.path.join(HERE, "summary.py"), *final]).returncode
    progress.save()
    where = shown(args.results)
    kept = "is unchanged" if fingerprint() == record_before else "CHANGED during the run"
    print(f"== this run's results: {where}/ (summary.md, plots, the JSON files); the recorded "
          f"run in {shown(RECORD)}/ {kept}", flush=True)
    if args.full and not args.filter and status == 0 and not errors:
        print(f"== to make this run the recorded results the README cites: "
              f"python3 bench/summary.py --record {where}", flush=True)
    if errors:
        print("bench/measure.py: " + "; ".join(errors), file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
