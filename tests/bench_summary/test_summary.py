#!/usr/bin/env python3
"""bench/summary.py refuses what it cannot support.

    python3 tests/bench_summary/test_summary.py path/to/bench/summary.py

results.json is a synthetic, well-sampled run: every point warm, 3 repetitions at 0.98, 1.00 and
1.03 times its time, every ratio within its physical bound. Times are the README's 2026-11-29
figures where it has them; FLOP counts, heap sizes and the rest are plausible made-up values (the
tests below derive every expected verdict from them by hand). The decode_* points (bench_decode's
per-token counters mean_s, p99_s, max_s, ...) are made up too, each within its target. So are the
linear_*, performer_*, vq_* points and their floor_* (bench_linear, N = 4096; the
performer and vq ones the linear ones scaled by the ratio of FLOP counts), whose FLOP counts are the floor's closed
form; and the sliding-window points (flash_window256_*, N = 2048, 4096, 8192) with flash's causal
forward at N = 4096, their FLOP counts bench_reference's visible-pair formula; and the
training-shape points (bh32_*, bh8_*, bench_training), whose times are per-head figures
measured on an Intel AVX-512 machine times the pairs (GMA) or made up (OVQ, flash), their FLOP
counts bench_training's formulas. Each test breaks one thing in a copy of it and runs summary.py
as bench/measure.py does, checking the exit status and the rows; the last ones run
bench/measure.py itself over a fake benchmark binary that writes these results.

The class after them runs copies of bench/measure.py and bench/summary.py in a temporary tree whose
bench/results/summary.md stands for the recorded run: which folder each kind of run writes, that
nothing but summary.py --record of a finished unfiltered full run replaces the record, and the
summary's statement of the run, the machine (read from /proc/cpuinfo) and the compiler (read
from the build directory). The last checks which series of the plots get a line.

Rules this file checks that the noise rules (re-measure, then report) changed: an impossible
value fails the summary only with --strict (those tests pass --strict and keep their
assertions; the tests after them check the default); a ratio is taken pair by pair, so the test
of a median above the bound gives its repetitions different factors; quick mode became the main
job.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = None  # set from argv

FWD_1T = "gma_heads_forward_bidir/N:4096/threads:1/real_time"
FWD_2T = "gma_heads_forward_bidir/N:4096/threads:2/real_time"
FWD_ROW = "batched GMA forward, B·H = 8, 2 threads vs 1 (N=4096)"
PEAK_ROW = "GMA bidir forward, fraction of FMA peak (N=4096)"


def base():
    with open(os.path.join(HERE, "results.json")) as f:
        return json.load(f)


def entries(doc, name):
    found = [b for b in doc["benchmarks"] if b["name"] == name]
    assert found, name
    return found


def make_cold_single_iteration(doc, name):
    """What Google Benchmark writes for a slow point in a short run without warm-up: one
    repetition of one iteration, no untimed call before it."""
    first = entries(doc, name)[0]
    doc["benchmarks"] = [b for b in doc["benchmarks"] if b["name"] != name]
    first = dict(first, iterations=1, repetitions=1, repetition_index=0)
    del first["warm_up_calls"]
    doc["benchmarks"].append(first)


def scale_times(doc, name, factor, cpu=True, real=True):
    for b in entries(doc, name):
        if real:
            b["real_time"] *= factor
        if cpu:
            b["cpu_time"] *= factor


SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def set_peak_beside(doc, name, fractions):
    """Gives repetition i of `name` the counter peak_flops_beside (the FMA probe run around its
    timed calls) that makes its FLOP rate fractions[i] of it; None leaves a repetition without."""
    for b, f in zip(entries(doc, name), fractions):
        if f is not None:
            rate = b["flop_per_call"] / (b["cpu_time"] * SECONDS[b.get("time_unit", "ns")])
            b["peak_flops_beside"] = rate / f


def run(doc, *extra, more=None):
    """summary.py over doc (bench_synthetic.json) and `more` {file name: doc} (a re-measurement:
    bench_synthetic.t1.r0.json is try 1). -> (exit status, output, summary.md or "")."""
    with tempfile.TemporaryDirectory() as out:
        paths = []
        for name, d in {"bench_synthetic.json": doc, **(more or {})}.items():
            paths.append(os.path.join(out, name))
            with open(paths[-1], "w") as f:
                json.dump(d, f)
        p = subprocess.run([sys.executable, SUMMARY, "--no-plots", "--out", out, *extra, *paths],
                           capture_output=True, text=True)
        md = ""
        if os.path.exists(os.path.join(out, "summary.md")):
            with open(os.path.join(out, "summary.md")) as f:
                md = f.read()
    return p.returncode, p.stdout + p.stderr, md


def plan(doc, more=None):
    """The rows summary.py --plan asks bench/measure.py to measure again."""
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "plan.json")
        rc, output, _ = run(doc, "--plan", path, more=more)
        assert rc == 0, output
        with open(path) as f:
            return json.load(f)


def scale_reps(doc, name, factors):
    """Repetition i of `name` (wall and CPU time) times factors[i]."""
    for b, f in zip(entries(doc, name), factors):
        b["real_time"] *= f
        b["cpu_time"] *= f


def cell(md, row, column):
    """Cell `column` of a target row in summary.md."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == row:
            return cells[column]
    raise AssertionError(f"no row {row!r} in summary.md")


def value(md, row):
    """The value cell (median [min – max]) of a target row."""
    return cell(md, row, 1)


def verdict(md, row):
    """The verdict cell of a target row."""
    return cell(md, row, 3)


class SummaryRules(unittest.TestCase):
    def test_sane_run_passes_with_verdicts(self):
        rc, out, md = run(base())
        self.assertEqual(rc, 0, out)
        # 2.70 ms / 3.29 ms = 0.82 <= 1.5; 22.0 ms / 12.6 ms = 1.75 >= 1.7 (and <= 2 threads).
        self.assertEqual(verdict(md, "GMA bidir forward / its GEMM floor (N=4096)"), "met")
        self.assertEqual(verdict(md, FWD_ROW), "met")
        # 201 MFLOP / 2.70 ms = 74 GFLOP/s against a 16.8 MFLOP / 78 µs = 215 GFLOP/s peak: 0.35.
        self.assertEqual(verdict(md, PEAK_ROW), "NOT MET")
        self.assertIn("0.35", md)
        results = md.split("## Runs")[1]  # past the rules, which name every verdict
        self.assertNotIn("too few samples", results)
        self.assertNotIn("impossible", results)
        self.assertNotIn("main job", md.splitlines()[0])  # no mode in the context
        # Files summarised by hand, without bench/measure.py's run.json: no machine is claimed.
        self.assertIn("- machine, compiler, date: not recorded (no run.json", md)
        # The spread beside the median: 2.70 ms × (0.98, 1.03).
        self.assertIn("2.7 ms [2.65 ms – 2.78 ms]", md)

    def test_cold_single_iteration_point_gives_no_verdict(self):
        doc = base()
        make_cold_single_iteration(doc, FWD_1T)
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)  # no verdict is not a failure
        self.assertTrue(verdict(md, FWD_ROW).startswith("too few samples"), md)
        self.assertIn("cold", verdict(md, FWD_ROW))
        # Rows that do not use the point keep their verdicts.
        self.assertEqual(verdict(md, "GMA bidir forward / its GEMM floor (N=4096)"), "met")

    def test_warm_single_iteration_point_gives_no_verdict(self):
        doc = base()
        make_cold_single_iteration(doc, FWD_1T)
        entries(doc, FWD_1T)[0]["warm_up_calls"] = 1.0
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertIn("1 repetition(s) × 1 iteration(s)", verdict(md, FWD_ROW))

    def test_speedup_above_thread_count_fails(self):
        doc = base()
        # One thread 8× slower than two: 22 ms × 8 / 12.6 ms = 14×, above 2 threads.
        scale_times(doc, FWD_1T, 8.0)
        rc, out, md = run(doc, "--strict")
        self.assertEqual(rc, 1, out)
        self.assertTrue(verdict(md, FWD_ROW).startswith("impossible: measurement error"))
        self.assertIn("FAILED", out)

    def test_median_above_bound_within_its_spread_gives_no_verdict(self):
        # The bound on 2 threads is 2 × 1.05 = 2.1× (private caches). The ratio is taken pair by
        # pair (the synthetic repetitions of both sides carry the same factors): one-thread
        # repetitions 1.16, 1.22 and 1.24 times slower give 22 × (1.16, 1.22, 1.24) / 12.6 =
        # 2.03×, 2.13×, 2.17×: a median above the bound with a pair within it, noise around the
        # bound, not an impossible measurement.
        doc = base()
        scale_reps(doc, FWD_1T, (1.16, 1.22, 1.24))
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertTrue(verdict(md, FWD_ROW).startswith("at the physical bound"), md)
        # 2.03× with its whole spread within the bound: judged (a few percent above 2 is what two
        # cores' private caches allow).
        doc = base()
        scale_times(doc, FWD_1T, 1.16)
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, FWD_ROW), "met", md)
        # The whole spread above the bound: 22 × 1.30 / 12.6 = 2.27× in every pair.
        doc = base()
        scale_times(doc, FWD_1T, 1.30)
        rc, out, md = run(doc, "--strict")
        self.assertEqual(rc, 1, out)
        self.assertTrue(verdict(md, FWD_ROW).startswith("impossible: measurement error"), md)

    def test_issue_scenario_cold_and_above_bound_fails(self):
        # The quick run that certified 7.94× on two cores: a cold single-iteration 1-thread point
        # of 100 ms against a warm 12.6 ms 2-thread point.
        doc = base()
        make_cold_single_iteration(doc, FWD_1T)
        factor = 100.0 / 22.0
        scale_times(doc, FWD_1T, factor)
        rc, out, md = run(doc, "--strict")
        self.assertEqual(rc, 1, out)
        self.assertNotIn("| met", [line for line in md.splitlines() if FWD_ROW in line][0])

    def test_wall_clock_load_cannot_lift_speedup(self):
        # A loaded machine stretches the 1-thread wall clock, not its CPU time: the speed-up is
        # computed from CPU time, so it stays 22.0 / 12.6 = 1.75× and within its bound; but that
        # run had a third of a core, so the 2-thread run had no free cores either: no verdict.
        doc = base()
        scale_times(doc, FWD_1T, 3.0, cpu=False)
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertTrue(verdict(md, FWD_ROW).startswith("machine busy"), md)
        self.assertIn("1.75×", [line for line in md.splitlines() if FWD_ROW in line][0])

    def test_slightly_stretched_wall_clock_keeps_the_verdict(self):
        # 10% between wall and CPU time (timer and scheduler noise on an idle machine) is not a
        # busy machine.
        doc = base()
        scale_times(doc, FWD_1T, 1.10, cpu=False)
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, FWD_ROW), "met")

    def test_rate_above_fma_peak_fails(self):
        doc = base()
        # 201 MFLOP in 0.27 ms is 744 GFLOP/s, 3.5× the 215 GFLOP/s peak.
        scale_times(doc, "gma_forward_bidir/4096", 0.1)
        rc, out, md = run(doc, "--strict")
        self.assertEqual(rc, 1, out)
        self.assertTrue(verdict(md, PEAK_ROW).startswith("impossible: measurement error"))

    def test_fraction_of_peak_is_taken_against_the_probe_beside_each_repetition(self):
        doc = base()
        # Against bench_peak's 215 GFLOP/s the forward is at 0.35 (test above); against probes
        # that ran beside its three repetitions, at 0.84, 0.85 and 0.86: median 0.85 >= 0.80.
        set_peak_beside(doc, "gma_forward_bidir/4096", [0.86, 0.84, 0.85])
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, PEAK_ROW), "met")
        self.assertEqual(value(md, PEAK_ROW), "0.85 [0.84 – 0.86]")
        self.assertIn("FMA peak beside the one-thread repetitions", md)
        # Rows without the probe keep bench_peak's denominator: the causal forward's verdict and
        # value are those of the unchanged run.
        causal = "GMA causal forward, fraction of FMA peak (N=4096)"
        _, _, md0 = run(base())
        self.assertEqual(verdict(md, causal), verdict(md0, causal))

    def test_rate_above_the_probe_beside_it_fails(self):
        doc = base()
        set_peak_beside(doc, "gma_forward_bidir/4096", [1.2, 1.25, 1.3])
        rc, out, md = run(doc, "--strict")
        self.assertEqual(rc, 1, out)
        self.assertTrue(verdict(md, PEAK_ROW).startswith("impossible: measurement error"))

    def test_a_repetition_without_the_probe_falls_back_to_bench_peak(self):
        doc = base()
        set_peak_beside(doc, "gma_forward_bidir/4096", [0.85, 0.85, None])
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, PEAK_ROW), "NOT MET")
        # 201 MFLOP over 2.70 ms × (0.98, 1.00, 1.03), over bench_peak's 215 GFLOP/s (78 µs ×
        # the same factors)
        self.assertEqual(value(md, PEAK_ROW), "0.35 [0.33 – 0.36]")

    def test_floor_above_fma_peak_fails(self):
        doc = base()
        scale_times(doc, "floor_gma_forward_bidir/4096", 0.05)
        rc, out, _ = run(doc, "--strict")
        self.assertEqual(rc, 1, out)
        self.assertIn("floor_gma_forward_bidir/4096", out)

    def test_missing_benchmark_fails_loudly(self):
        doc = base()
        doc["benchmarks"] = [b for b in doc["benchmarks"]
                             if not b["name"].startswith("flash_forward_bidir/4096")]
        rc, out, md = run(doc)
        self.assertEqual(rc, 1, out)
        self.assertIn("MISSING: flash_forward_bidir N=4096", md)
        self.assertNotIn("n/a", md)

    def test_missing_benchmark_fails_the_main_job_too(self):
        # The main job runs fewer sizes, but its set keeps every point a main-job target reads:
        # a missing thread-scaling point is an error there as in a full run.
        doc = base()
        doc["context"]["mixattn_bench_mode"] = "main"
        doc["benchmarks"] = [b for b in doc["benchmarks"] if b["name"] != FWD_2T]
        rc, out, md = run(doc)
        self.assertEqual(rc, 1, out)
        self.assertIn("MISSING: gma_heads_forward_bidir N=4096 threads=2", verdict(md, FWD_ROW))
        # The failure message on stderr names the row and the benchmark.
        failed = out.split("summary: FAILED")[1]
        self.assertIn(FWD_ROW, failed)
        self.assertIn("gma_heads_forward_bidir", failed)
        self.assertNotIn("n/a", md)

    def test_missing_peak_fails_loudly(self):
        doc = base()
        doc["benchmarks"] = [b for b in doc["benchmarks"] if b["name"] != "peak_fma_float"]
        rc, out, md = run(doc)
        self.assertEqual(rc, 1, out)
        self.assertIn("MISSING: peak_fma_float", verdict(md, PEAK_ROW))

    def test_filtered_run_accepts_absent_benchmarks(self):
        doc = base()
        doc["benchmarks"] = [b for b in doc["benchmarks"] if not b["name"].startswith("ovq_")]
        rc, out, md = run(doc, "--partial")
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, "causal flash_forward / OVQ forward (T=65536)"),
                         "not measured (filtered run)")

    def test_binary_that_did_not_build_is_reported_not_failed(self):
        doc = base()
        doc["benchmarks"] = [b for b in doc["benchmarks"] if not b["name"].startswith("peak_")]
        rc, out, md = run(doc, "--not-built", "bench_peak")
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, PEAK_ROW), "not measured (bench_peak did not build)")

    def test_pytorch_rows_need_a_real_blas(self):
        doc = base()
        fwd = entries(doc, "gma_forward_bidir/4096")
        for b in fwd:  # PyTorch eager 58× slower than mixattn, as measured with OpenBLAS
            doc["benchmarks"].append(dict(b, name="torch_gma_forward_bidir/4096",
                                          cpu_time=b["cpu_time"] * 58, real_time=b["real_time"] * 58))
        row = "PyTorch eager GMA forward / mixattn (N=4096)"
        doc["context"]["torch_blas"] = "generic (/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0)"
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertTrue(verdict(md, row).startswith("reference BLAS"), md)
        doc["context"]["torch_blas"] = ("generic (/usr/lib/x86_64-linux-gnu/openblas-pthread/"
                                        "libblas.so.3)")
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, row), "met")

    def test_pytorch_extension_table_needs_three_samples(self):
        doc = base()
        doc["context"]["torch_blas"] = "generic (/usr/lib/x86_64-linux-gnu/openblas-pthread/)"
        # eager: the paper's form 150× slower, the matmul form 12.5×
        for impl, ms in (("mixattn", 20.0), ("eager_gma_paper", 3000.0), ("eager_gma", 250.0)):
            name = f"torch_ext_{impl}_fwd_bwd_causal/2048/threads:1"
            doc["benchmarks"] += [{"name": name, "run_type": "iteration", "iterations": 1,
                                   "real_time": ms, "cpu_time": ms, "time_unit": "ms",
                                   "N": 2048, "threads": 1, "warm_up_calls": 1}] * 3
        row = ("| GMA causal forward+backward | 1 | 20 ms | 3 s | 250 ms | not measured | 150× "
               "| 12.50× |")
        rc, out, md = run(doc)
        self.assertIn(row, md)
        doc["benchmarks"].pop()  # two calls of the matmul form left: no ratio
        rc, out, md = run(doc)
        self.assertIn("| 3 s | 250 ms (too few samples) | not measured | 150× "
                      "| (too few samples) |", md)

    def test_after_block_row_judges_each_tokens_best_pass(self):
        row = "OVQ decode: slowest token after a block completion / mean"
        doc = base()
        for b in doc["benchmarks"]:
            if b["name"].startswith("decode_ovq/"):
                b["after_block_max_s"] = 10 * b["mean_s"]  # one pass interrupted: not the token's
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, row), "met")  # best of 3 passes: 0.85 × 1.5 mean at most
        self.assertIn("one pass's max", md)
        for b in doc["benchmarks"]:
            if b["name"] == "decode_ovq/8192":
                b["after_block_best_max_s"] = 2.5 * b["mean_s"]  # slow in every pass: its cost
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, row), "NOT MET")
        self.assertIn("2.50×", md)

    def test_main_job_says_so_and_keeps_the_rules(self):
        doc = base()
        doc["context"]["mixattn_bench_mode"] = "main"
        make_cold_single_iteration(doc, FWD_1T)
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertTrue(re.match(r"# mixattn benchmark summary — main job", md), md[:200])
        self.assertTrue(verdict(md, FWD_ROW).startswith("too few samples"))

    def test_main_job_leaves_out_the_full_runs_rows(self):
        # The heap-growth rows need N = 16384 and 65536, which only --full measures: a main job
        # without them leaves the rows out; a full run without them fails.
        doc = base()
        doc["benchmarks"] = [b for b in doc["benchmarks"]
                             if not b["name"].startswith("gma_fwd_bwd_causal/")]
        row = "peak extra heap growth of gma_fwd_bwd_causal, N = 16384 → 65536"
        rc, out, md = run(doc)
        self.assertEqual(rc, 1, out)
        self.assertIn("MISSING: gma_fwd_bwd_causal N=16384", verdict(md, row))
        doc["context"]["mixattn_bench_mode"] = "main"
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertNotIn(row, md)


def counts(md):
    """(met, not met, unreliable) from the summary's count line."""
    m = re.search(r"(\d+) met, (\d+) not met, (\d+) unreliable", md)
    assert m, md[:500]
    return tuple(int(g) for g in m.groups())


def only(doc, *names):
    """A copy of doc with the repetitions of `names` alone: a re-measurement's file."""
    d = json.loads(json.dumps(doc))
    d["benchmarks"] = [b for b in d["benchmarks"] if b["name"] in names]
    return d


class NoiseRules(unittest.TestCase):
    """Ratios pair by pair; impossible or too noisy rows measured again, then reported."""

    def test_a_ratio_is_taken_pair_by_pair(self):
        # Both sides slow down together from one repetition to the next (a machine whose speed
        # drifts), by 1, 1.3 and 1.6 times: pair by pair the speed-up stays 22.0 / 12.6 = 1.75×,
        # where the ratio of medians with the extreme ratios of the spreads would span
        # 22 × 0.98 / (12.6 × 1.03 × 1.6) = 1.04×
        # to 22 × 1.03 × 1.6 / (12.6 × 0.98) = 2.94×.
        doc = base()
        scale_reps(doc, FWD_1T, (1.0, 1.3, 1.6))
        scale_reps(doc, FWD_2T, (1.0, 1.3, 1.6))
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(value(md, FWD_ROW), "1.75×")
        self.assertEqual(verdict(md, FWD_ROW), "met")
        self.assertEqual(plan(doc), [])

    def test_an_impossible_point_that_a_re_measurement_fixes(self):
        doc = base()
        scale_times(doc, FWD_1T, 8.0)  # 22 × 8 / 12.6 = 14×, above 2 threads
        items = plan(doc)
        self.assertEqual([i["row"] for i in items], [FWD_ROW])
        self.assertEqual(items[0]["points"], {"bench_synthetic": sorted([FWD_1T, FWD_2T])})
        self.assertIn("13.97× is above 2.10×, the physical bound", items[0]["why"])
        # The two points measured again (try 1), sane this time: they replace try 0's.
        more = {"bench_synthetic.t1.r0.json": only(base(), FWD_1T, FWD_2T)}
        self.assertEqual(plan(doc, more), [])
        rc, out, md = run(doc, "--strict", more=more)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, FWD_ROW), "met")
        self.assertEqual(value(md, FWD_ROW), "1.75×")

    def test_an_impossible_point_that_stays_impossible(self):
        doc = base()
        scale_times(doc, FWD_1T, 8.0)
        broken = only(doc, FWD_1T, FWD_2T)
        more = {f"bench_synthetic.t{t}.r0.json": broken for t in (1, 2, 3)}
        rc, out, md = run(doc, more=more)
        self.assertEqual(rc, 0, out)  # the table and summary.md are written; the run goes on
        self.assertTrue(verdict(md, FWD_ROW).startswith(
            "unreliable (noise: 13.97× is above 2.10×, the physical bound"), verdict(md, FWD_ROW))
        self.assertIn("Headline table", out)
        warning = out.split("summary: WARNING")[1]
        self.assertIn(FWD_ROW, warning)
        self.assertNotIn("FAILED", out)
        # Neither met nor missed: one row fewer met than the sane run, as many not met.
        _, _, md0 = run(base())
        met0, missed0, unreliable0 = counts(md0)
        self.assertEqual(counts(md), (met0 - 1, missed0, unreliable0 + 1))
        # --strict keeps the refusal.
        rc, out, md = run(doc, "--strict", more=more)
        self.assertEqual(rc, 1, out)
        self.assertTrue(verdict(md, FWD_ROW).startswith("impossible: measurement error"))
        self.assertIn(FWD_ROW, out.split("summary: FAILED")[1])

    def test_a_noisy_spread_around_the_goal_is_measured_again_then_unreliable(self):
        # One-thread repetitions 0.9, 1.0 and 1.1 times: pairs 22 × (0.9, 1.0, 1.1) / 12.6 =
        # 1.57×, 1.75× and 1.92×, 22% apart, around the goal 1.7×: the verdict would rest on
        # which pair one believes.
        doc = base()
        scale_reps(doc, FWD_1T, (0.9, 1.0, 1.1))
        items = plan(doc)
        self.assertEqual([i["row"] for i in items], [FWD_ROW])
        self.assertIn("22% apart", items[0]["why"])
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        expected = ("unreliable (noise: pairs spread 1.57× – 1.92× (22% apart) "
                    "around the goal ≥ 1.7×")
        self.assertTrue(verdict(md, FWD_ROW).startswith(expected), verdict(md, FWD_ROW))
        rc, out, md = run(doc, "--strict")
        self.assertEqual(rc, 1, out)

    def test_a_wide_spread_on_one_side_of_the_goal_keeps_its_verdict(self):
        # Pairs 1.75×, 1.92× and 2.08× (19% apart, all within the 2.1× bound) are all above the
        # goal 1.7×: met, whichever pair one believes.
        doc = base()
        scale_reps(doc, FWD_1T, (1.0, 1.1, 1.19))
        self.assertEqual(plan(doc), [])
        rc, out, md = run(doc)
        self.assertEqual(rc, 0, out)
        self.assertEqual(verdict(md, FWD_ROW), "met")


FAKE_BINARY = """#!{python}
# A benchmark binary for bench/measure.py: writes tests/bench_summary/results.json's repetitions
# that match --benchmark_filter, with FWD_1T 8 times slower (an impossible 14× speed-up) in the
# first measurement (try 0) and, if broken_after, in every re-measurement too.
import json, os, re, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
with open({results!r}) as f:
    doc = json.load(f)
doc["context"]["mixattn_bench_mode"] = os.environ["MIXATTN_BENCH_MODE"]  # as bench_common.hpp
doc["benchmarks"] = [b for b in doc["benchmarks"]
                     if re.search(args.get("benchmark_filter", "."), b["name"])]
if ".t0." in args["benchmark_out"] or {broken_after}:
    for b in doc["benchmarks"]:
        if b["name"] == {fwd!r}:
            b["real_time"] *= 8
            b["cpu_time"] *= 8
with open(args["benchmark_out"], "w") as f:
    json.dump(doc, f)
"""


def measure(broken_after, *extra):
    """bench/measure.py over a fake binary, 2 rounds, up to 3 re-measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "build", "bench", "bench_fake")
        os.makedirs(os.path.dirname(exe))
        with open(exe, "w") as f:
            f.write(FAKE_BINARY.format(python=sys.executable, broken_after=broken_after,
                                       results=os.path.join(HERE, "results.json"), fwd=FWD_1T))
        os.chmod(exe, 0o755)
        results = os.path.join(tmp, "results")
        p = subprocess.run([sys.executable, os.path.join(os.path.dirname(SUMMARY), "measure.py"),
                            "--build", os.path.join(tmp, "build"), "--results", results,
                            "--binaries", "bench_fake", "--rounds", "2", "--no-plots", *extra],
                           capture_output=True, text=True)
        with open(os.path.join(results, "summary.md")) as f:
            md = f.read()
        files = sorted(os.listdir(results))
    return p.returncode, p.stdout + p.stderr, md, files


class MeasureRetries(unittest.TestCase):
    """bench/measure.py re-measures what summary.py --plan names, up to 3 times."""

    def test_a_re_measurement_fixes_an_impossible_point(self):
        rc, out, md, files = measure(False)
        self.assertEqual(rc, 0, out)
        self.assertIn("re-measuring (try 1/3)", out)
        self.assertNotIn("try 2/3", out)
        self.assertEqual(verdict(md, FWD_ROW), "met")
        self.assertIn("bench_fake.t1.r2.json", files)
        self.assertTrue(re.match(r"# mixattn benchmark summary — main job", md), md[:200])

    def test_a_point_that_stays_impossible_is_reported_after_three_tries(self):
        rc, out, md, files = measure(True)
        self.assertEqual(rc, 0, out)
        self.assertIn("re-measuring (try 3/3)", out)
        self.assertNotIn("try 4", out)
        self.assertTrue(verdict(md, FWD_ROW).startswith("unreliable (noise:"), verdict(md, FWD_ROW))
        self.assertIn("summary: WARNING", out)
        rc, out, md, files = measure(True, "--strict")
        self.assertEqual(rc, 1, out)
        self.assertTrue(verdict(md, FWD_ROW).startswith("impossible: measurement error"))


RECORDED = "# the recorded run (stands for the README's bench/results/summary.md)\n"
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: a second processor, not read
"""


class Tree:
    """A temporary repository: copies of bench/*.py, a recorded bench/results/summary.md and
    plots, and a build directory with the fake benchmark binary and CMake's record of a compiler
    (a version no real one has, so a summary that names it read it from the build)."""

    def __init__(self, tmp):
        self.root = tmp
        self.bench = os.path.join(tmp, "bench")
        self.record = os.path.join(self.bench, "results")
        os.makedirs(self.record)
        for f in glob.glob(os.path.join(os.path.dirname(SUMMARY), "*.py")):
            shutil.copy(f, self.bench)
        for name in ("summary.md", "time_vs_n.png", "memory_vs_n.png"):
            with open(os.path.join(self.record, name), "w") as f:
                f.write(RECORDED)
        self.build = os.path.join(tmp, "build")
        exe = os.path.join(self.build, "bench", "bench_fake")
        os.makedirs(os.path.dirname(exe))
        with open(exe, "w") as f:
            f.write(FAKE_BINARY.format(python=sys.executable, broken_after=False,
                                       results=os.path.join(HERE, "results.json"), fwd=FWD_1T))
        os.chmod(exe, 0o755)
        with open(os.path.join(self.build, "CMakeCache.txt"), "w") as f:
            f.write("//C++ compiler\nCMAKE_CXX_COMPILER:FILEPATH=/opt/cc/bin/g++-99\n")
        os.makedirs(os.path.join(self.build, "CMakeFiles", "3.25.1"))
        with open(os.path.join(self.build, "CMakeFiles", "3.25.1", "CMakeCXXCompiler.cmake"),
                  "w") as f:
            f.write('set(CMAKE_CXX_COMPILER "/opt/cc/bin/g++-99")\n'
                    'set(CMAKE_CXX_COMPILER_ID "GNU")\nset(CMAKE_CXX_COMPILER_VERSION "99.1.0")\n')
        with open(os.path.join(self.build, "build.ninja"), "w") as f:
            f.write("build bench/CMakeFiles/bench_fake.dir/bench_fake.cpp.o: CXX_COMPILER "
                    "bench/bench_fake.cpp\n  DEFINES = -DNDEBUG\n"
                    "  FLAGS = -O3 -DNDEBUG -std=gnu++17 -march=native -O3\n")

    def measure(self, *extra):
        p = subprocess.run([sys.executable, os.path.join(self.bench, "measure.py"), "--build",
                            self.build, "--binaries", "bench_fake", "--rounds", "2",
                            "--no-plots", *extra], capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr

    def summary(self, *args):
        p = subprocess.run([sys.executable, os.path.join(self.bench, "summary.py"), *args],
                           capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr

    def folders(self):
        return sorted(d for d in os.listdir(self.record)
                      if os.path.isdir(os.path.join(self.record, d)))

    def read(self, *path):
        with open(os.path.join(self.record, *path)) as f:
            return f.read()

    def record_untouched(self):
        return all(self.read(name) == RECORDED
                   for name in ("summary.md", "time_vs_n.png", "memory_vs_n.png"))


def this_cpu():
    """/proc/cpuinfo's first model name, family, model and the avx2, avx512f, avx512_bf16 and
    amx flags it has, read here independently."""
    found = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            found.setdefault(key.strip(), value.strip())
    flags = found.get("flags", "").split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in flags]
    isa += ["amx"] if any(f.startswith("amx") for f in flags) else []
    return (found.get("model name", ""), found.get("cpu family", ""), found.get("model", ""),
            ", ".join(isa))


class ResultsFolders(unittest.TestCase):
    """Every run writes its own folder; only a finished unfiltered full run becomes the record,
    and only through summary.py --record."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.tree = Tree(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def test_the_main_job_writes_bench_results_latest(self):
        t = self.tree
        os.makedirs(os.path.join(t.record, "latest"))
        stale = os.path.join(t.record, "latest", "bench_old.t0.r1.json")
        with open(stale, "w") as f:
            json.dump(base(), f)  # an earlier main job's file: not part of this run
        rc, out = t.measure()
        self.assertEqual(rc, 0, out)
        self.assertTrue(t.record_untouched())
        self.assertEqual(t.folders(), ["latest"])
        self.assertFalse(os.path.exists(stale))
        self.assertIn("this run's results: bench/results/latest/", out.splitlines()[-1])
        self.assertNotIn("--record", out)
        md = t.read("latest", "summary.md")
        self.assertTrue(md.startswith("# mixattn benchmark summary — main job"), md[:100])
        this_run = md.split("## This run\n")[1].split("\n\n")[0]
        self.assertIn("- run: main job, `bash bench/run.sh`", this_run)
        self.assertIn("not the recorded results", this_run)
        self.assertIn("- results: bench/results/latest/", this_run)
        # The machine as /proc/cpuinfo gives it, the compiler as the build directory records it.
        name, family, model, isa = this_cpu()
        self.assertIn(f"- machine: {name} (family {family}, model {model}), "
                      f"{os.cpu_count()} CPUs; ISA: {isa}", this_run)
        self.assertIn("- compiler: GNU 99.1.0 (/opt/cc/bin/g++-99, -O3 -march=native)", this_run)
        self.assertRegex(this_run, r"- date: 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC")
        # The terminal says it too.
        self.assertIn("- compiler: GNU 99.1.0", out)

    def test_a_full_run_writes_a_folder_of_its_own(self):
        t = self.tree
        rc, out = t.measure("--full")
        self.assertEqual(rc, 0, out)
        self.assertTrue(t.record_untouched())
        [folder] = t.folders()
        self.assertRegex(folder, r"^full-20\d\d-\d\d-\d\d-\d{4}$")
        md = t.read(folder, "summary.md")
        self.assertTrue(md.startswith("# mixattn benchmark summary — full run"), md[:100])
        self.assertIn("- run: full run, `bash bench/run.sh --full`", md)
        self.assertIn(f"- results: bench/results/{folder}/", md)
        self.assertIn(f"python3 bench/summary.py --record bench/results/{folder}", out)
        # A second full run keeps the first.
        rc, out = t.measure("--full")
        self.assertEqual(rc, 0, out)
        self.assertEqual(len(t.folders()), 2, t.folders())

    def test_a_filtered_run_writes_bench_results_filtered(self):
        t = self.tree
        rc, out = t.measure("--full", "--filter", "gma")
        self.assertEqual(rc, 0, out)
        self.assertTrue(t.record_untouched())
        self.assertEqual(t.folders(), ["filtered"])
        self.assertIn("- filtered: MIXATTN_BENCH_FILTER='gma'", t.read("filtered", "summary.md"))
        self.assertNotIn("--record", out)

    def test_no_run_writes_the_record(self):
        t = self.tree
        rc, out = t.measure("--results", t.record)
        self.assertEqual(rc, 2, out)
        self.assertIn("holds the recorded run", out)
        rc, out = t.measure("--full", "--results", os.path.join(t.bench, ".", "results"))
        self.assertEqual(rc, 2, out)
        rc, out = t.summary("--out", t.record, "--no-plots",
                            os.path.join(HERE, "results.json"))
        self.assertEqual(rc, 2, out)
        self.assertTrue(t.record_untouched())
        self.assertEqual(t.folders(), [])

    def test_only_a_finished_unfiltered_full_run_becomes_the_record(self):
        t = self.tree
        for extra in ((), ("--full", "--filter", "."), ("--full",)):
            rc, out = t.measure(*extra)
            self.assertEqual(rc, 0, out)
        full = next(d for d in t.folders() if d.startswith("full-"))
        for refused, why in (("latest", "main job"), ("filtered", "it was filtered")):
            rc, out = t.summary("--record", os.path.join(t.record, refused))
            self.assertEqual(rc, 1, out)
            self.assertIn(why, out)
            self.assertTrue(t.record_untouched())
        # A full run whose summary fails (a target's benchmark missing) is refused too.
        broken = os.path.join(t.record, "full-broken")
        shutil.copytree(os.path.join(t.record, full), broken)
        for path in glob.glob(os.path.join(broken, "bench_fake.*.json")):
            with open(path) as f:
                doc = json.load(f)
            doc["benchmarks"] = [b for b in doc["benchmarks"] if not b["name"].startswith(
                "gma_fwd_bwd_causal/")]
            with open(path, "w") as f:
                json.dump(doc, f)
        rc, out = t.summary("--record", broken)
        self.assertEqual(rc, 1, out)
        self.assertIn("its summary fails", out)
        self.assertTrue(t.record_untouched())
        # Without plots to draw (--no-plots stands for a machine without matplotlib) nor the
        # run's own to copy, the record's plots would be stale beside its new summary: refused.
        rc, out = t.summary("--record", os.path.join(t.record, full), "--no-plots")
        self.assertEqual(rc, 1, out)
        self.assertIn("plots could not be replaced", out)
        self.assertTrue(t.record_untouched())
        # The full run: its summary and plots (the run's own, copied) replace the record's; the
        # record says where it came from and keeps the run's machine line.
        for name in PLOTS:
            with open(os.path.join(t.record, full, name), "w") as f:
                f.write("the full run's plot\n")
        rc, out = t.summary("--record", os.path.join(t.record, full), "--no-plots")
        self.assertEqual(rc, 0, out)
        md = t.read("summary.md")
        self.assertTrue(md.startswith("# mixattn benchmark summary — full run"), md[:100])
        self.assertIn(f"- run: the recorded run: `bash bench/run.sh --full` into "
                      f"bench/results/{full}/", md)
        self.assertIn("- compiler: GNU 99.1.0", md)
        self.assertEqual(md.split("## This run")[1].split("## Runs of")[0].count("- results:"), 0)
        for name in PLOTS:
            self.assertEqual(t.read(name), "the full run's plot\n")

    def test_the_machine_line_names_the_isa_flags_that_matter(self):
        sys.path.insert(0, self.tree.bench)
        try:
            import measure
            import summary
        finally:
            sys.path.pop(0)
        cpuinfo = os.path.join(self.tmp.name, "cpuinfo")
        with open(cpuinfo, "w") as f:
            f.write(CPUINFO)
        m = measure.read_machine(cpuinfo, os_release=os.path.join(self.tmp.name, "none"))
        self.assertEqual((m["cpu"], m["family"], m["model"]),
                         ("Intel(R) Xeon(R) Platinum 8480+", "6", "143"))
        self.assertEqual(m["isa"], {"avx2": True, "avx512f": True, "avx512_bf16": True,
                                    "amx": True})
        lines = summary.run_lines({"machine": m, "compiler": {}, "started": "x"}, "full")
        self.assertIn("- machine: Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143), "
                      f"{os.cpu_count()} CPUs; ISA: avx2, avx512f, avx512_bf16, amx", lines)
        with open(cpuinfo, "w") as f:
            f.write(CPUINFO.replace("avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8",
                                    ""))
        m = measure.read_machine(cpuinfo)
        line = summary.run_lines({"machine": m, "compiler": {}, "started": "x"}, "main")[1]
        self.assertTrue(line.endswith("ISA: avx2; no avx512f, no avx512_bf16, no amx; "
                                      + m["os"]) if m["os"] else
                        line.endswith("ISA: avx2; no avx512f, no avx512_bf16, no amx"), line)


PLOTS = ("time_vs_n.png", "memory_vs_n.png")


class Recorder:
    """Stands for a matplotlib Axes (or anything reached from it): records every call."""

    def __getattr__(self, name):
        return Recorder(self.calls, name)

    def __init__(self, calls=None, name=None):
        self.calls = [] if calls is None else calls
        self.name = name

    def __call__(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return Recorder(self.calls)

    def __getitem__(self, key):
        return Recorder(self.calls)


class Plots(unittest.TestCase):
    """A series of fewer than 3 points gets no line (two points joined read as a growth rate the
    run did not measure: the main job has OVQ's forward at N = 4096 and 65536 alone), and a
    panel without a line gets no slope guides. Drawn on a recorder: no matplotlib needed."""

    def setUp(self):
        sys.path.insert(0, os.path.dirname(SUMMARY))
        import summary_plots
        from summary_data import Quantity
        sys.path.pop(0)
        self.plots, self.Quantity = summary_plots, Quantity

    def pts(self, *ns):
        return [(n, self.Quantity(n * 2e-6, n * 1.9e-6, n * 2.1e-6)) for n in ns]

    def lines(self, calls):
        """The x values of every line drawn through more than one point, and the bands."""
        return [c[1][0] for c in calls if c[0] in ("plot", "fill_between") and len(c[1][0]) > 1]

    def test_two_points_are_markers_without_a_line(self):
        ax = Recorder()
        self.assertFalse(self.plots.draw_series(ax, self.pts(4096, 65536), "#AA4499"))
        self.assertEqual(self.lines(ax.calls), [])
        self.assertEqual([c[1][0] for c in ax.calls if c[0] == "errorbar"], [[4096], [65536]])
        # Its floor likewise.
        ax = Recorder()
        self.assertFalse(self.plots.draw_series(ax, self.pts(4096, 65536), "#AA4499", floor=True))
        self.assertEqual(self.lines(ax.calls), [])

    def test_three_points_are_a_line(self):
        ax = Recorder()
        self.assertTrue(self.plots.draw_series(ax, self.pts(1024, 4096, 16384), "#AA4499"))
        self.assertIn([1024, 4096, 16384], self.lines(ax.calls))

    def test_slope_guides_only_beside_a_line(self):
        p = self.plots
        saved = {f: getattr(p, f) for f in ("guides", "n_axis", "log_y_axis", "end_labels")}
        asked = []
        p.guides = lambda ax, log_y, *rest: asked.append(bool(log_y)) or []
        p.n_axis = p.log_y_axis = p.end_labels = lambda *a, **k: None
        try:
            # The main job's forward panel: OVQ at two sizes, GMA at one.
            points = {("ovq_forward", n, 1): q for n, q in self.pts(4096, 65536)}
            points.update({("gma_forward_bidir", n, 1): q for n, q in self.pts(4096)})
            ax = Recorder()
            self.assertTrue(p.operator_panel(ax, points, None, 2, lambda q: q, True, str))
            self.assertEqual(self.lines(ax.calls), [])
            # A full run's: OVQ at four sizes.
            points.update({("ovq_forward", n, 1): q for n, q in self.pts(1024, 16384)})
            self.assertTrue(p.operator_panel(Recorder(), points, None, 2, lambda q: q, True, str))
        finally:
            for f, fn in saved.items():
                setattr(p, f, fn)
        self.assertEqual(asked, [False, True])


if __name__ == "__main__":
    SUMMARY = sys.argv.pop(1)
    unittest.main(verbosity=2)
