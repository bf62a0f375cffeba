#!/usr/bin/env python3
"""Summarise mixattn's Google Benchmark JSON results.

    python3 bench/summary.py [--out DIR] [FILE.json ...]

Reads the JSON files (default: every *.json in bench/results/, including the PyTorch
side-by-side file written in the same format), prints a table (operator, N, time, ratio to its
GEMM floor, speed-up over FlashAttention at the same N, peak extra heap) and the target check
list, and writes DIR/summary.md plus, when matplotlib is available, DIR/time_vs_n.png and
DIR/memory_vs_n.png (log-log, one line per operator).

Times are CPU time of the benchmark thread (the machine may be shared; CPU time does not count
time stolen by other processes), except for benchmarks that ask for wall-clock time
(name ending in /real_time: the multi-threaded ones).
"""

import argparse
import glob
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
TARGET_N = 4096


# ---- loading -------------------------------------------------------------------------------------

class Run:
    """One benchmark run: operator name, N, threads, seconds per call, counters."""

    def __init__(self, op, n, threads, seconds, iterations, counters, source):
        self.op, self.n, self.threads = op, n, threads
        self.seconds, self.iterations = seconds, iterations
        self.counters, self.source = counters, source


def parse_name(name):
    """'op/4096' or 'op/N:4096/threads:2/real_time' -> (op, {key: value}, positional args)."""
    parts = name.split("/")
    named, positional = {}, []
    for p in parts[1:]:
        if ":" in p:
            k, v = p.split(":", 1)
            named[k] = v
        elif p.isdigit():
            positional.append(int(p))
    return parts[0], named, positional


def load(files):
    runs, contexts, errors, candidates = {}, [], [], {}
    for path in files:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"summary: skipping {path}: {e}", file=sys.stderr)
            continue
        contexts.append((os.path.basename(path), data.get("context", {})))
        for b in data.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration":
                continue  # BigO / RMS / mean aggregates
            name = b.get("name", "")
            if b.get("error_occurred"):
                errors.append(f"{name}: {b.get('error_message', 'error')}")
                continue
            op, named, positional = parse_name(name)
            n = b.get("N", named.get("N", positional[0] if positional else None))
            if n is None:
                continue
            n = int(float(n))
            # "threads" is Google Benchmark's own field; the library's worker threads are the
            # worker_threads counter (or the threads: argument of the name).
            threads = int(float(b.get("worker_threads", named.get("threads", 1))))
            unit = UNIT_SECONDS[b.get("time_unit", "ns")]
            wall = name.endswith("/real_time")
            seconds = (b["real_time"] if wall else b["cpu_time"]) * unit
            run = Run(op, n, threads, seconds, int(b.get("iterations", 1)), b,
                      os.path.basename(path))
            key = (op, n, threads)
            candidates.setdefault(key, {}).setdefault(run.source, []).append(run)
    # Repetitions (--benchmark_repetitions or ->Repetitions) give several runs of one name in
    # one file: take the median repetition. The same operator may be measured by two binaries
    # (causal flash in bench_reference and bench_ovq): keep the better-sampled measurement.
    for key, by_file in candidates.items():
        best = None
        for reps in by_file.values():
            reps.sort(key=lambda r: r.seconds)
            median = reps[len(reps) // 2]
            total = sum(r.iterations for r in reps)
            if best is None or total > best[0]:
                best = (total, median)
        runs[key] = best[1]
    return runs, contexts, errors


# ---- relations between operators -----------------------------------------------------------------

def floor_of(op):
    if op.startswith("floor_") or op.startswith("torch_"):
        return None
    if op.startswith("naive_") or op.startswith("flash_"):
        return "floor_softmax_" + op.split("_", 1)[1]
    return "floor_" + op


def flash_of(op):
    if op.startswith(("flash_", "floor_", "gma_heads")) or op == "gma_responsibilities":
        return None
    kind = "fwd_bwd" if "fwd_bwd" in op else "forward"
    mode = "bidir" if "bidir" in op else "causal"  # OVQ is causal
    return f"flash_{kind}_{mode}"


def get(runs, op, n, threads=1):
    return runs.get((op, n, threads))


# ---- formatting ------------------------------------------------------------------------------------

def fmt_time(s):
    if s is None:
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def fmt_bytes(b):
    if b is None:
        return "—"
    b = float(b)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_ratio(x):
    return "—" if x is None else f"{x:.2f}×" if x < 100 else f"{x:.0f}×"


def table_rows(runs, ns_filter=None):
    rows = []
    ops = sorted({op for (op, _, _) in runs if not op.startswith("floor_")})
    for op in ops:
        for (o, n, threads), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            if o != op or (ns_filter and n not in ns_filter):
                continue
            fl = get(runs, floor_of(op), n) if floor_of(op) else None
            fa = get(runs, flash_of(op), n) if flash_of(op) else None
            name = op if threads == 1 else f"{op} ({threads} threads)"
            rows.append([
                name, str(n), fmt_time(r.seconds),
                fmt_ratio(r.seconds / fl.seconds) if fl else "—",
                fmt_ratio(fa.seconds / r.seconds) if fa else "—",
                fmt_bytes(r.counters.get("peak_heap_bytes")),
            ])
    return rows


HEADER = ["operator", "N", "time/call", "t / t_floor", "speed-up vs flash", "peak extra heap"]


def text_table(rows):
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(HEADER)]
    line = "  ".join(h.ljust(w) for h, w in zip(HEADER, widths))
    out = [line, "-" * len(line)]
    prev = None
    for r in rows:
        group = r[0].split(" (")[0]  # thread-count variants stay in their operator's group
        if prev is not None and group != prev:
            out.append("")
        prev = group
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---- targets -----------------------------------------------------------------------------------------

def targets(runs):
    """[(description, measured text, target text, met: True/False/None)]."""
    out = []

    def t(op, n=TARGET_N, threads=1):
        r = get(runs, op, n, threads)
        return r.seconds if r else None

    def ratio_check(desc, num, den, limit, at_most, target_txt, fmt="{:.2f}×"):
        if num is None or den is None:
            out.append((desc, "not measured", target_txt, None))
            return
        x = num / den
        out.append((desc, fmt.format(x), target_txt, x <= limit if at_most else x >= limit))

    N = TARGET_N
    ratio_check(f"GMA bidir forward / its GEMM floor (N={N})",
                t("gma_forward_bidir"), t("floor_gma_forward_bidir"), 1.5, True, "≤ 1.5×")
    ratio_check(f"flash_forward / GMA bidir forward (N={N})",
                t("flash_forward_bidir"), t("gma_forward_bidir"), 12, False, "≥ 12×")
    ratio_check(f"GMA bidir fwd+bwd / its GEMM floor (N={N})",
                t("gma_fwd_bwd_bidir"), t("floor_gma_fwd_bwd_bidir"), 1.5, True, "≤ 1.5×")
    ratio_check(f"GMA causal forward / GMA bidir forward (N={N})",
                t("gma_forward_causal"), t("gma_forward_bidir"), 2.5, True, "≤ 2.5×")

    # Crossover: smallest N from which GMA forward beats flash at every measured larger N.
    ns = sorted(n for (op, n, th) in runs if op == "gma_forward_bidir" and th == 1
                and get(runs, "flash_forward_bidir", n))
    if ns:
        faster = [t("gma_forward_bidir", n) < t("flash_forward_bidir", n) for n in ns]
        cross = None
        for i in range(len(ns)):
            if all(faster[i:]):
                cross = ns[i]
                break
        measured = (f"from N = {cross}" if cross is not None else "never") + \
            f" (measured N ≥ {ns[0]})"
        out.append(("GMA bidir forward faster than flash_forward", measured, "from N ≤ 512",
                    cross is not None and cross <= 512))
    else:
        out.append(("GMA bidir forward faster than flash_forward", "not measured",
                    "from N ≤ 512", None))

    ratio_check(f"responsibilities / one (N×2r)·(2r×K) GEMM (N={N})",
                t("gma_responsibilities"), t("floor_gma_responsibilities"), 1.5, True, "≤ 1.5×")
    ratio_check(f"flash_forward fraction of the GEMM rate (N={N})",
                t("floor_softmax_forward_bidir"), t("flash_forward_bidir"), 0.5, False, "≥ 50%",
                fmt="{:.0%}")
    T = 65536
    ratio_check(f"causal flash_forward / OVQ forward (T={T})",
                t("flash_forward_causal", T), t("ovq_forward", T), 10, False, "≥ 10×")

    per_token = {n: get(runs, "ovq_forward", n).seconds / n
                 for (op, n, th) in runs if op == "ovq_forward" and 16384 <= n <= 262144}
    if 16384 in per_token and 262144 in per_token:
        ref = per_token[16384]
        worst_n = max(per_token, key=lambda n: abs(per_token[n] / ref - 1))
        dev = per_token[worst_n] / ref - 1
        out.append(("OVQ forward time per token, T = 16384 … 262144, vs T = 16384",
                    f"{ref * 1e6:.2f} µs/token at 16384; worst {dev:+.0%} at T = {worst_n}",
                    "within ±25%", abs(dev) <= 0.25))
    else:
        out.append(("OVQ forward time per token, T = 16384 … 262144", "not measured",
                    "within ±25%", None))

    for op in ("gma_fwd_bwd_bidir", "gma_fwd_bwd_causal", "ovq_forward"):
        a, b = get(runs, op, 16384), get(runs, op, 65536)
        desc = f"peak extra heap growth of {op}, N = 16384 → 65536"
        if a and b and a.counters.get("peak_heap_bytes") and b.counters.get("peak_heap_bytes"):
            x = b.counters["peak_heap_bytes"] / a.counters["peak_heap_bytes"]
            out.append((desc, f"{x:.2f}× ({fmt_bytes(a.counters['peak_heap_bytes'])} → "
                              f"{fmt_bytes(b.counters['peak_heap_bytes'])})", "≤ 4.5×", x <= 4.5))
        else:
            out.append((desc, "not measured", "≤ 4.5×", None))

    ratio_check(f"PyTorch eager GMA forward / mixattn (N={N})",
                t("torch_gma_forward_bidir"), t("gma_forward_bidir"), 25, False, "≥ 25×")
    ratio_check(f"PyTorch eager GMA fwd+bwd / mixattn (N={N})",
                t("torch_gma_fwd_bwd_bidir"), t("gma_fwd_bwd_bidir"), 40, False, "≥ 40×")

    for kind in ("forward", "fwd_bwd"):
        op = f"gma_heads_{kind}_bidir"
        ratio_check(f"batched GMA {kind}, B·H = 8, 2 threads vs 1 (N={N}, wall clock)",
                    t(op, N, 1), t(op, N, 2), 1.7, False, "≥ 1.7×")
    return out


def check_rows(checks):
    verdict = {True: "met", False: "NOT MET", None: "n/a"}
    return [[d, m, tg, verdict[ok]] for d, m, tg, ok in checks]


# ---- plots ---------------------------------------------------------------------------------------------

def plot(runs, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("summary: matplotlib not available, skipping plots", file=sys.stderr)
        return []
    ops = sorted({op for (op, n, th) in runs if th == 1 and not op.startswith("gma_heads")})
    # One colour per operator; a floor is drawn dashed in the colour of the operator it bounds.
    palette = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    main_ops = [op for op in ops if not op.startswith("floor_")]
    colour = {op: palette[i % len(palette)] for i, op in enumerate(main_ops)}
    for op in main_ops:
        fl = floor_of(op)
        if fl and fl not in colour:
            colour[fl] = colour[op]
    written = []
    for fname, key, ylabel, title in (
            ("time_vs_n.png", None, "time per call [s]", "Time per call vs N (float, 1 thread)"),
            ("memory_vs_n.png", "peak_heap_bytes", "peak extra heap [bytes]",
             "Peak extra heap per call vs N")):
        fig, ax = plt.subplots(figsize=(11, 8))
        for op in ops:
            if key is not None and op.startswith("floor_"):
                continue  # a floor's heap is Eigen's GEMM blocking buffer, not a property
            pts = sorted((n, r.seconds if key is None else r.counters.get(key))
                         for (o, n, th), r in runs.items() if o == op and th == 1)
            pts = [(n, y) for n, y in pts if y]
            if not pts:
                continue
            style = dict(linestyle="--", linewidth=1, alpha=0.7) if op.startswith("floor_") \
                else dict(linestyle="-", linewidth=1.8, marker="o", markersize=3)
            style["color"] = colour.get(op, "gray")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=op, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


# ---- main ------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="Google Benchmark JSON files")
    ap.add_argument("--out", default=os.path.join(HERE, "results"),
                    help="directory for summary.md and the plots (default: bench/results)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(args.out, "*.json")))
    if not files:
        print("summary: no JSON files (run bash bench/run.sh first)", file=sys.stderr)
        return 1
    runs, contexts, errors = load(files)
    if not runs:
        print("summary: no benchmark runs in " + ", ".join(files), file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)

    console_ns = {4 ** k for k in range(20)}  # every other power of two on the console
    print(text_table(table_rows(runs, console_ns)))
    print("\n(console shows N = 4^k; every N is in summary.md)\n")
    checks = targets(runs)
    crow = check_rows(checks)
    w = max(len(r[0]) for r in crow)
    print("Targets (float, 1 thread, N = 4096, K = 64, r = d_v = 64 unless stated):")
    for d, m, tg, v in crow:
        print(f"  [{v:^7}] {d.ljust(w)}  measured {m};  target {tg}")
    if errors:
        print("\nBenchmarks that reported errors:\n  " + "\n  ".join(errors))

    plots = [] if args.no_plots else plot(runs, args.out)

    ctx_lines = []
    for fname, c in contexts:
        bits = [c.get("date", ""), c.get("host_name", ""),
                f"{c.get('num_cpus', '?')} cpus @ {c.get('mhz_per_cpu', '?')} MHz"]
        if "eigen_simd" in c:
            bits.append(f"Eigen SIMD: {c['eigen_simd']}")
        if "malloc" in c:
            bits.append(f"malloc: {c['malloc']}")
        if c.get("mixattn_bench_quick") == "1":
            bits.append("quick mode")
        if "torch_version" in c:
            bits.append(f"torch {c['torch_version']}, BLAS: {c.get('torch_blas', '?')}")
        ctx_lines.append(f"- `{fname}`: " + ", ".join(b for b in bits if b))
    md = ["# mixattn benchmark summary", "",
          "Float, one thread unless stated; time is CPU time per call (wall clock for the "
          "multi-threaded rows). `t / t_floor`: time over the time of the Eigen GEMMs of the "
          "same shapes; `speed-up vs flash`: FlashAttention-style softmax attention time over "
          "this operator's time at the same N (same mode: bidirectional or causal, forward or "
          "forward+backward). Peak extra heap: high-water mark of heap allocated during one "
          "call, outputs included.", "", "## Runs", *ctx_lines, "",
          "## Targets", md_table(["target", "measured", "goal", "verdict"], crow), "",
          "## All results", md_table(HEADER, table_rows(runs)), ""]
    if errors:
        md += ["## Errors", *[f"- {e}" for e in errors], ""]
    for p in plots:
        md += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    md_path = os.path.join(args.out, "summary.md")
    with open(md_path, "w") as f:
        f.write("\n".join(md))
    print(f"\nwrote {md_path}" + "".join(f", {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
