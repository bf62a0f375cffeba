#!/usr/bin/env python3
"""Summarise mixattn's Google Benchmark JSON results, and refuse numbers that cannot be trusted.

    python3 bench/summary.py [--out DIR] [--no-plots] [--not-built BINARY ...] [--partial]
                             [--strict] [--plan FILE] [FILE.json ...]
    python3 bench/summary.py --record DIR

Reads the JSON files (default: every *.json in DIR but run.json; bench/run.sh writes one per
binary, round and try, e.g. bench_gma.t0.r1.json), prints the headline tables and the targets,
and writes DIR/summary.md plus, when matplotlib is available, DIR/time_vs_n.png and
DIR/memory_vs_n.png (bench/summary_plots.py). DIR defaults to bench/results/latest, the main
job's folder. The summary opens with the run: which one (main job, --full, filtered), the machine
and compiler and the date, from the run.json bench/measure.py wrote beside the JSON files. The
verdict rules are in bench/summary_rules.py and docs/benchmarking.md; the targets in
bench/summary_targets.py.

bench/results/ itself holds the recorded run, which the README cites: --out refuses it.
--record DIR summarises a finished `bash bench/run.sh --full` run's folder (e.g.
bench/results/full-2026-12-06-0325) into bench/results/ — summary.md and the plots (drawn again,
or copied from DIR without matplotlib) — and refuses, writing nothing, unless every file of DIR
is of an unfiltered full run and no target of it fails.

--plan FILE writes the rows whose points should be measured again (impossible or too noisy
ratios) and the benchmarks behind them, as JSON, and nothing else: bench/run.sh re-measures
those and summarises again.

Exit status: 1 when a target's benchmark is missing or a benchmark reported an error, and, with
--strict, when a row is still impossible or too noisy to judge; 0 otherwise (unreliable rows are
then named in a warning and counted as neither met nor missed).

Times are CPU time of the benchmark thread (the machine may be shared; CPU time does not count
time stolen by other processes), except for benchmarks that ask for wall-clock time (name ending
in /real_time: the multi-threaded ones).
"""

import argparse
import glob
import importlib.util
import json
import os
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
RECORD = os.path.join(HERE, "results")  # the recorded --full run, cited by the README
LATEST = os.path.join(RECORD, "latest")  # the main job's folder
RUN_FILE = "run.json"  # bench/measure.py's record of the run and the machine
PLOTS = ("time_vs_n.png", "memory_vs_n.png")

from summary_data import EXP_OP, PEAK_OP, Measurements, load  # noqa: E402
from summary_rules import judge_all  # noqa: E402
from summary_tables import (HEADER, HEADLINE_HEADER, TORCH_EXT_HEADER,  # noqa: E402
                            TRAINING_HEADER, headline_rows, md_table, table_rows, text_table,
                            torch_ext_rows, training_rows)
from summary_targets import TARGETS, producers  # noqa: E402


def run_mode(contexts):
    """'main' or 'full' (bench/run.sh records it in every file's context), else None."""
    modes = {c.get("mixattn_bench_mode") for _, c in contexts} - {None}
    return "main" if "main" in modes else ("full" if "full" in modes else None)


def shown(path):
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return rel if not rel.startswith("..") else os.path.abspath(path)


def read_run(files, out):
    """bench/measure.py's run.json beside the JSON files (else in the output folder), or None."""
    for d in dict.fromkeys([os.path.dirname(os.path.abspath(f)) for f in files[:1]] + [out]):
        try:
            with open(os.path.join(d, RUN_FILE)) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue
    return None


def isa_text(isa):
    have = [k for k, v in isa.items() if v]
    lack = [k for k, v in isa.items() if not v]
    return ", ".join(have or ["none of " + "/".join(isa)]) + (f"; no {', no '.join(lack)}"
                                                             if lack and have else "")


def run_lines(run, mode, recorded_from=None):
    """Which run this is, on which machine, built by which compiler, when: from run.json, which
    bench/measure.py read from the machine and the build directory."""
    what = {"main": "main job, `bash bench/run.sh`: the headline set at N = 4096 — not the "
                    "recorded results (those come from `bash bench/run.sh --full`)",
            "full": "full run, `bash bench/run.sh --full`: every benchmark at every size",
            None: "benchmarks run by hand (no mode in their context)"}[mode]
    if recorded_from:
        what = (f"the recorded run: `bash bench/run.sh --full` into {recorded_from}/, made the "
                f"record with `python3 bench/summary.py --record {recorded_from}`")
    lines = [f"- run: {what}"]
    if run is None:
        return lines + [f"- machine, compiler, date: not recorded (no {RUN_FILE} beside the "
                        f"results: they were not written by bench/run.sh)"]
    if run.get("filter"):
        lines.append(f"- filtered: MIXATTN_BENCH_FILTER='{run['filter']}' (a subset; absent "
                     f"benchmarks are no error)")
    m, c = run.get("machine", {}), run.get("compiler", {})
    cpu = m.get("cpu") or "unknown CPU"
    ident = ", ".join(x for x in (f"family {m['family']}" if m.get("family") else "",
                                  f"model {m['model']}" if m.get("model") else "") if x)
    lines.append(f"- machine: {cpu}" + (f" ({ident})" if ident else "") +
                 f", {m.get('cpus', '?')} CPUs; ISA: " +
                 (isa_text(m["isa"]) if m.get("isa") else "unknown (no flags in /proc/cpuinfo)") +
                 (f"; {m['os']}" if m.get("os") else ""))
    compiler = " ".join(x for x in (c.get("id"), c.get("version")) if x) or "unknown"
    extra = ", ".join(x for x in (c.get("path"), c.get("flags")) if x)
    lines.append(f"- compiler: {compiler}" + (f" ({extra})" if extra else ""))
    lines.append(f"- date: {run.get('started', '?').replace('T', ' ').replace('Z', ' UTC')} "
                 f"(the run's start)")
    if not recorded_from:
        lines.append(f"- results: {run.get('results', '?')}/")
    return lines


MODE_TITLE = {
    "main": " — main job (bash bench/run.sh: the headline set at N = 4096; "
            "bash bench/run.sh --full for every size)",
    "full": " — full run (bash bench/run.sh --full)",
    None: ""}


def context_lines(contexts):
    """One line per binary (its rounds and re-measurements ran on the same machine)."""
    lines, files = {}, {}
    for fname, c in contexts:
        binary = fname.split(".")[0]
        files[binary] = files.get(binary, 0) + 1
        if binary in lines:
            continue
        bits = [c.get("date", ""), c.get("host_name", ""),
                f"{c.get('num_cpus', '?')} cpus @ {c.get('mhz_per_cpu', '?')} MHz"]
        if "eigen_simd" in c:
            bits.append(f"Eigen SIMD: {c['eigen_simd']}")
        if "malloc" in c:
            bits.append(f"malloc: {c['malloc']}")
        if "mixattn_bench_mode" in c:
            bits.append(f"{c['mixattn_bench_mode']} run")
        if "torch_version" in c:
            bits.append(f"torch {c['torch_version']}, BLAS: {c.get('torch_blas', '?')}")
        lines[binary] = ", ".join(b for b in bits if b)
    return [f"- `{b}` ({files[b]} file{'s' if files[b] > 1 else ''}): {text}"
            for b, text in lines.items()]


def peak_lines(points):
    out = []
    p = points.get((PEAK_OP, 0, 1))
    if p:
        q = p.flop_per_call() / p.seconds()
        label = p.reps[0].entry.get("label", "")
        out.append(f"- FMA peak (one thread, float, {label}): {q.med / 1e9:.1f} GFLOP/s"
                   f" [{q.lo / 1e9:.1f} – {q.hi / 1e9:.1f}]")
    beside = [float(r.entry["peak_flops_beside"]) for q in points.values()
              if q.threads == 1 and not q.wall for r in q.reps if "peak_flops_beside" in r.entry]
    if beside:
        out.append(f"- FMA peak beside the one-thread repetitions (the same probe around each "
                   f"one's timed calls, {len(beside)} repetitions): median "
                   f"{statistics.median(beside) / 1e9:.1f} GFLOP/s "
                   f"[{min(beside) / 1e9:.1f} – {max(beside) / 1e9:.1f}]")
    e = points.get((EXP_OP, 0, 1))
    if e and e.counter("exp_per_call"):
        q = e.counter("exp_per_call").med / e.seconds()
        out.append(f"- exp throughput (xsimd::exp, float): {q.med / 1e9:.2f} G exp/s"
                   f" [{q.lo / 1e9:.2f} – {q.hi / 1e9:.2f}]")
    return out


RULES_MD = (
    "Float, one thread unless stated; time is the median over repetitions of CPU time per call "
    "(wall clock for the multi-threaded rows), with [min – max] over the repetitions beside it. "
    "Every binary runs once per round, so a repetition of a ratio's two sides ran in one process "
    "seconds apart: a ratio is the median of its per-pair ratios, with their [min – max]. "
    "Every point is timed after one untimed call. A point with fewer than 3 repetitions and "
    "fewer than 3 iterations, or without the untimed call, gives no ratio (\"too few samples\"). "
    "`t / t_floor`: time over the time of the Eigen GEMMs of the same shapes; `fraction of peak`: "
    "the operator's FLOP count (its floor's GEMM work) per second over the FLOP/s of "
    "register-only FMA chains, for a one-thread row repetition by repetition against the chains "
    "run around that repetition's timed calls, for the others against bench_peak's; `speed-up "
    "vs flash` / `vs naive`: tiled / naive softmax attention's time over this operator's at the "
    "same N (same mode). A value beyond its physical bound (speed-up above the thread count, "
    "fraction of peak above 1) over its whole spread, or a ratio whose pairs spread over more "
    "than 10% around its goal, is measured again (up to 3 times); if it stays so, its row reads "
    "\"unreliable (noise: …)\" and counts as neither met nor missed (with --strict it fails the "
    "run). A median beyond the bound whose spread reaches back within it gets no verdict. A "
    "thread speed-up is one thread's CPU time over the threads' wall time, and gives no verdict "
    "(\"machine busy\") when the one-thread run's wall time exceeds its CPU time by more than "
    "15%. Peak extra heap: high-water mark of heap allocated during one call, outputs included.")


def retry_plan(rows, problems):
    """The rows (and points) to measure again: [{row, why, points: {binary: [names]}}]."""
    plan = []
    for r in rows:
        if r.retry:
            plan.append({"row": r.name, "why": r.retry, "points": names_by_binary(r.points)})
    for p, text in problems:
        plan.append({"row": p.label(), "why": text, "points": names_by_binary([p])})
    return plan


def names_by_binary(points):
    out = {}
    for p in points:
        out.setdefault(p.source, set()).update(p.names)
    return {b: sorted(n) for b, n in out.items()}


def verdict_counts(checks):
    count = {s: sum(r.state == s for r in checks)
             for s in ("met", "missed", "none", "unreliable", "missing", "absent")}
    return (f"{count['met']} met, {count['missed']} not met, {count['unreliable']} unreliable "
            f"(noise), {count['none']} without a verdict, {count['missing']} missing, "
            f"{count['absent']} not measured — of {len(checks)} targets")


def print_terminal(title, run, points, contexts, checks, main_job, errors):
    """The targets, then the headline tables: what a user reads when the run ends."""
    print(title + "\n")
    print("\n".join(run) + "\n")
    w = max((len(r.name) for r in checks), default=0)
    print("Targets (float, 1 thread, N = 4096, K = 64, r = d_v = 64 unless stated):")
    for r in checks:
        note = f" ({r.note})" if r.note else ""
        print(f"  {r.name.ljust(w)}  {r.measured}  (goal {r.goal})  → {r.verdict}{note}")
    for line in peak_lines(points):
        print(line)
    if errors:
        print("\nBenchmarks that reported errors:\n  " + "\n  ".join(errors))
    torch = torch_ext_rows(points, contexts)
    if torch:
        print("\nFrom PyTorch (float32, (B, H, N) = (4, 8, 2048), r = d_v = K = 64):")
        print(text_table(TORCH_EXT_HEADER, torch))
    training = training_rows(points, contexts)
    if training:
        print("\nTraining shapes (B·H pairs per call, every pair's inputs distinct):")
        print(text_table(TRAINING_HEADER, training))
    print("\nHeadline table (float, one thread, K = r = d_v = 64; every point in summary.md):")
    print(text_table(HEADLINE_HEADER, headline_rows(points, contexts, main_job)))
    print("\n" + verdict_counts(checks))


def summary_md(title, run, points, contexts, checks, main_job, errors, all_rows, plots):
    target_rows = [[r.name, r.measured, r.goal, r.verdict + (f" ({r.note})" if r.note else "")]
                   for r in checks]
    md = [f"# {title}", "", "## This run", *run, "", RULES_MD, "",
          "## Runs of the binaries", *context_lines(contexts), "",
          "## Machine limits (bench_peak)", *(peak_lines(points) or ["- not measured"]), "",
          "## Targets", verdict_counts(checks), "",
          md_table(["target", "measured [min – max]", "goal", "verdict"], target_rows), "",
          "## Headline table", md_table(HEADLINE_HEADER, headline_rows(points, contexts, main_job)),
          "", "## Training shapes (bench_training: B·H pairs per call, every pair's inputs "
          "distinct, 1 and 2 threads)",
          md_table(TRAINING_HEADER, training_rows(points, contexts)), "",
          "## From PyTorch (bench/torch_ext_bench.py, float32, (B, H, N) = (4, 8, 2048), "
          "r = d_v = K = 64)",
          md_table(TORCH_EXT_HEADER, torch_ext_rows(points, contexts)), "",
          "## All results", md_table(HEADER, all_rows), ""]
    if errors:
        md += ["## Errors", *[f"- {e}" for e in errors], ""]
    for p in plots:
        md += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    return "\n".join(md)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="Google Benchmark JSON files")
    ap.add_argument("--out", default=LATEST,
                    help="directory for summary.md and the plots (default: bench/results/latest; "
                         "never bench/results, the recorded run: see --record)")
    ap.add_argument("--record", metavar="DIR",
                    help="make DIR, a finished bash bench/run.sh --full run, the recorded results "
                         "in bench/results/")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--not-built", action="append", default=[], metavar="BINARY",
                    help="a benchmark binary that did not build (its rows are not measured)")
    ap.add_argument("--partial", action="store_true",
                    help="the run was filtered: absent benchmarks are not an error")
    ap.add_argument("--strict", action="store_true",
                    help="fail (exit 1) on a row still impossible or too noisy to judge")
    ap.add_argument("--plan", metavar="FILE",
                    help="write the rows to measure again, as JSON, and nothing else")
    return ap.parse_args(argv)


def result_files(directory):
    return sorted(f for f in glob.glob(os.path.join(directory, "*.json"))
                  if os.path.basename(f) != RUN_FILE)


def record_refusal(args, run, mode, failures):
    """Why args.record's folder cannot become the recorded run, or None."""
    if run is None:
        return f"it has no {RUN_FILE}: it was not written by bash bench/run.sh"
    if run.get("mode") != "full" or mode != "full":
        what = "main job" if "main" in (run.get("mode"), mode) else "run of unknown mode"
        return f"it is a {what}: only bash bench/run.sh --full measures what the record holds"
    if run.get("filter") or args.partial:
        return f"it was filtered (MIXATTN_BENCH_FILTER='{run.get('filter', '')}')"
    if failures:
        return "its summary fails:\n  " + "\n  ".join(failures)
    return None


def main(argv=None):
    args = parse_args(argv)
    if args.record:
        if args.plan or args.files:
            print("summary: --record DIR takes the folder's own files, and no --plan",
                  file=sys.stderr)
            return 2
        source = os.path.abspath(args.record)
        if os.path.realpath(source) == os.path.realpath(RECORD):
            print(f"summary: {shown(RECORD)} is the record already", file=sys.stderr)
            return 2
        files, args.out = result_files(source), RECORD
    else:
        if os.path.realpath(args.out) == os.path.realpath(RECORD) and not args.plan:
            print(f"summary: {shown(RECORD)} holds the recorded run the README cites; write "
                  f"another folder with --out, or make a finished --full run the record with "
                  f"--record DIR", file=sys.stderr)
            return 2
        files = args.files or result_files(args.out)
    if not files:
        print("summary: no JSON files (run bash bench/run.sh first)", file=sys.stderr)
        return 1
    points, contexts, errors = load(files)
    if not points:
        print("summary: no benchmark runs in " + ", ".join(files), file=sys.stderr)
        return 1
    mode = run_mode(contexts)
    main_job = mode == "main"
    checks = judge_all(TARGETS, Measurements(points, contexts), producers, args.not_built,
                       args.partial, main_job, args.strict)
    all_rows, problems = table_rows(points, contexts, strict=args.strict)
    if args.plan:
        plan = retry_plan(checks, problems)
        with open(args.plan, "w") as f:
            json.dump(plan, f, indent=1)
        for item in plan:
            print(f"  {item['row']}: {item['why']}")
        return 0

    unreliable = [f"{r.name}: {r.verdict}" for r in checks if r.state == "unreliable"]
    unreliable += [text for _, text in problems]
    failures = [f"{r.name}: {r.verdict}" + (f" ({r.note})" if r.note else "")
                for r in checks if r.fails] + errors
    if args.strict:
        failures += [text for _, text in problems]
    run = read_run(files, args.out)
    if args.record:
        why = record_refusal(args, run, mode, failures)
        drawable = not args.no_plots and importlib.util.find_spec("matplotlib") is not None
        if not why and not drawable and not all(os.path.isfile(os.path.join(source, name))
                                                for name in PLOTS):
            why = (f"the record's plots could not be replaced: without matplotlib they are "
                   f"copied from the run's folder, which lacks some of {', '.join(PLOTS)}")
        if why:
            print(f"summary: {shown(source)} cannot become the recorded run: {why}\n"
                  f"{shown(RECORD)}/ is unchanged", file=sys.stderr)
            return 1
    title = "mixattn benchmark summary" + MODE_TITLE[mode]
    lines = run_lines(run, mode, shown(source) if args.record else None)
    print_terminal(title, lines, points, contexts, checks, main_job, errors)
    os.makedirs(args.out, exist_ok=True)
    plots = []
    if not args.no_plots:
        import summary_plots
        plots = summary_plots.plot_all(points, args.out, "main job, N = 4096" if main_job else "")
    if args.record and not plots:
        # Without matplotlib, the plots the full run drew from the same results.
        for name in PLOTS:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(args.out, name))
                plots.append(os.path.join(args.out, name))
    md_path = os.path.join(args.out, "summary.md")
    with open(md_path, "w") as f:
        f.write(summary_md(title, lines, points, contexts, checks, main_job, errors, all_rows,
                           plots))
    print(f"\nwrote {shown(md_path)}" + "".join(f", {shown(p)}" for p in plots))

    if failures:
        print("\nsummary: FAILED — these numbers cannot be trusted or are missing:\n  " +
              "\n  ".join(failures), file=sys.stderr)
        return 1
    if unreliable:
        print("\nsummary: WARNING — unreliable after re-measuring (noise), counted neither met "
              "nor missed:\n  " + "\n  ".join(unreliable), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
