#!/usr/bin/env python3
"""Summarise mixattn's Google Benchmark JSON results, and refuse numbers that cannot be trusted.

    python3 bench/summary.py [--out DIR] [--no-plots] [--not-built BINARY ...] [--partial]
                             [--strict] [--plan FILE] [FILE.json ...]

Reads the JSON files (default: every *.json in DIR; bench/run.sh writes one per binary, round and
try, e.g. bench_gma.t0.r1.json), prints the headline tables and the targets, and writes
DIR/summary.md plus, when matplotlib is available, DIR/time_vs_n.png and DIR/memory_vs_n.png
(bench/summary_plots.py). The verdict rules are in bench/summary_rules.py and
docs/benchmarking.md; the targets in bench/summary_targets.py.

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
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

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


def print_terminal(title, points, contexts, checks, main_job, errors):
    """The targets, then the headline tables: what a user reads when the run ends."""
    print(title + "\n")
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


def summary_md(title, points, contexts, checks, main_job, errors, all_rows, plots):
    target_rows = [[r.name, r.measured, r.goal, r.verdict + (f" ({r.note})" if r.note else "")]
                   for r in checks]
    md = [f"# {title}", "", RULES_MD, "", "## Runs", *context_lines(contexts), "",
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
    ap.add_argument("--out", default=os.path.join(HERE, "results"),
                    help="directory for summary.md and the plots (default: bench/results)")
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


def main(argv=None):
    args = parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(args.out, "*.json")))
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

    title = "mixattn benchmark summary" + MODE_TITLE[mode]
    print_terminal(title, points, contexts, checks, main_job, errors)
    plots = []
    if not args.no_plots:
        import summary_plots
        plots = summary_plots.plot_all(points, args.out, "main job, N = 4096" if main_job else "")
    os.makedirs(args.out, exist_ok=True)
    md_path = os.path.join(args.out, "summary.md")
    with open(md_path, "w") as f:
        f.write(summary_md(title, points, contexts, checks, main_job, errors, all_rows, plots))
    print(f"\nwrote {md_path}" + "".join(f", {p}" for p in plots))

    unreliable = [f"{r.name}: {r.verdict}" for r in checks if r.state == "unreliable"]
    unreliable += [text for _, text in problems]
    failures = [f"{r.name}: {r.verdict}" + (f" ({r.note})" if r.note else "")
                for r in checks if r.fails] + errors
    if args.strict:
        failures += [text for _, text in problems]
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
