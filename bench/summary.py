#!/usr/bin/env python3
"""Summarise mixattn's Google Benchmark JSON results, and refuse numbers that cannot be trusted.

    python3 bench/summary.py [--out DIR] [--no-plots] [--not-built BINARY ...] [--partial]
                             [FILE.json ...]

Reads the JSON files (default: every *.json in DIR, including the PyTorch side-by-side file written
in the same format), prints a table and the target list, and writes DIR/summary.md plus, when
matplotlib is available, DIR/time_vs_n.png and DIR/memory_vs_n.png (bench/summary_plots.py).

Rules (README, "Benchmarks"):
  - a timed point enters a ratio only if it is warm (the benchmark made one untimed call first:
    counter warm_up_calls) and has at least 3 repetitions or 3 iterations; otherwise every row that
    needs it reads "too few samples" and gives no verdict;
  - every value is checked against its physical bound (a speed-up on p threads above p, a
    fraction of the measured FMA peak above 1, which covers a time below the FLOP count at peak):
    a row whose whole spread lies beyond it reads "impossible: measurement error" and the summary
    fails; a row whose median lies beyond it but whose spread reaches back within it (noise
    around a value at the bound) reads "at the physical bound: no verdict";
  - a thread speed-up (one thread's CPU time over the threads' wall time) gives no verdict when
    the one-thread run did not have a whole core ("machine busy");
  - a target whose benchmark is missing fails the summary (exit 1, naming the benchmark and N),
    unless the binary that makes it did not build (--not-built: bench/run.sh reports that itself),
    the run was filtered (--partial), or the row is optional (the PyTorch side-by-side and the
    extension's benchmark, which run only where PyTorch is). Quick mode (MIXATTN_BENCH_QUICK=1) is
    no exemption: it runs fewer sizes and shorter loops, but every binary's quick set keeps each
    size a target reads, so a target missing from a quick run fails it as it fails a full run;
  - rows show the median over repetitions and the spread [min–max] beside it.
Exit status: 0 when every row could be judged or was refused for too few samples, 1 otherwise.

Times are CPU time of the benchmark thread (the machine may be shared; CPU time does not count
time stolen by other processes), except for benchmarks that ask for wall-clock time (name ending
in /real_time: the multi-threaded ones).

Adding a target row: append a Target to TARGETS (see the examples there). Its `value` receives a
Measurements object `m` and returns a Quantity: m.time(op, n, threads), m.cpu_time(...),
m.counter(op, name, n, threads), m.rate(op, n) (FLOP/s), m.fraction_of_peak(op, n), m.peak_flops(),
m.heap(op, n), combined with + - * / and numbers. A missing point raises Missing, which the
summary turns into the rules above; a point's sampling state travels with the Quantity, so a row
built from a cold point gives no verdict without further code. For example:

    Target("GMA causal decode: p99 latency per token at position 65536",
           lambda m: m.counter("decode_gma_causal", "p99_s", 65536),
           ("<=", 20e-6), fmt=lambda x: f"{x * 1e6:.1f} µs")
    Target(f"8-head GMA fwd+bwd, glibc's default malloc / kept memory (N={N})",
           lambda m: m.time("gma_heads_fwd_bwd_bidir_default_malloc")
                     / m.time("gma_heads_fwd_bwd_bidir"), ("<=", 1.1))

A new benchmark binary also gets a line in PRODUCERS (which binary writes which operator), so a
build failure is told apart from a missing benchmark.
"""

import argparse
import glob
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
TARGET_N = 4096
MIN_SAMPLES = 3  # repetitions or iterations a timed point needs before it enters a ratio


# ---- quantities: a median with its spread and whether it may be judged -------------------------

class Quantity:
    """A measured value: median, spread [lo, hi], and whether its samples suffice (ok; if not,
    `why` says what is lacking). Arithmetic propagates all three; the spread of a ratio is the
    extreme ratios of the operands' spreads."""

    def __init__(self, med, lo=None, hi=None, ok=True, why="", text=None):
        self.med = med
        self.lo = med if lo is None else lo
        self.hi = med if hi is None else hi
        self.ok, self.why, self.text = ok, why, text
        self.refusal = "too few samples"  # the verdict when not ok

    def refuse(self, refusal, why):
        """Withhold the verdict for another reason than sampling (e.g. a busy machine)."""
        self.ok, self.refusal = False, refusal
        self.why = "; ".join(w for w in (self.why, why) if w)
        return self

    @staticmethod
    def of(x):
        return x if isinstance(x, Quantity) else Quantity(float(x))

    def _join(self, other, med, lo, hi):
        whys = [w for w in (self.why, other.why) if w]
        return Quantity(med, min(lo, hi), max(lo, hi), self.ok and other.ok,
                        "; ".join(dict.fromkeys(whys)))

    def __truediv__(self, other):
        o = Quantity.of(other)
        return self._join(o, self.med / o.med, self.lo / o.hi, self.hi / o.lo)

    def __rtruediv__(self, other):
        return Quantity.of(other) / self

    def __mul__(self, other):
        o = Quantity.of(other)
        return self._join(o, self.med * o.med, self.lo * o.lo, self.hi * o.hi)

    __rmul__ = __mul__

    def __add__(self, other):
        o = Quantity.of(other)
        return self._join(o, self.med + o.med, self.lo + o.lo, self.hi + o.hi)

    __radd__ = __add__

    def __sub__(self, other):
        o = Quantity.of(other)
        return self._join(o, self.med - o.med, self.lo - o.hi, self.hi - o.lo)


def all_of(quantities, med, lo=None, hi=None, text=None):
    """A Quantity derived from several others: ok only if all are."""
    bad = [q for q in quantities if not q.ok]
    why = "; ".join(dict.fromkeys(q.why for q in bad if q.why))
    return Quantity(med, lo, hi, not bad, why, text)


class Missing(Exception):
    """A point a row needs is not in the results."""

    def __init__(self, op, n, threads=1, what="time"):
        super().__init__(f"{op} N={n}" + (f" threads={threads}" if threads != 1 else "") +
                         ("" if what == "time" else f" ({what})"))
        self.op, self.n, self.threads = op, n, threads


# ---- loading -------------------------------------------------------------------------------------

class Point:
    """One benchmark point (operator, N, threads) from one file: all its repetitions."""

    def __init__(self, op, n, threads, source, wall):
        self.op, self.n, self.threads, self.source, self.wall = op, n, threads, source, wall
        self.reps = []  # [(seconds, cpu_seconds, iterations, counters)]

    def add(self, seconds, cpu_seconds, iterations, counters):
        self.reps.append((seconds, cpu_seconds, iterations, counters))

    @property
    def iterations(self):
        return min(r[2] for r in self.reps)

    @property
    def warm(self):
        return all(r[3].get("warm_up_calls", 0) >= 1 for r in self.reps)

    def sampling(self):
        """(ok, why): warm, and >= MIN_SAMPLES repetitions or iterations per repetition."""
        if not self.warm:
            return False, f"{self.label()}: cold (no untimed call first)"
        if len(self.reps) < MIN_SAMPLES and self.iterations < MIN_SAMPLES:
            return False, (f"{self.label()}: {len(self.reps)} repetition(s) × "
                           f"{self.iterations} iteration(s)")
        return True, ""

    def label(self):
        return f"{self.op}/{self.n}" + (f" on {self.threads} threads" if self.threads != 1 else "")

    def quantity(self, values):
        ok, why = self.sampling()
        return Quantity(statistics.median(values), min(values), max(values), ok, why)

    def seconds(self):
        return self.quantity([r[0] for r in self.reps])

    def cpu_seconds(self):
        return self.quantity([r[1] for r in self.reps])

    def counter(self, name):
        values = [r[3][name] for r in self.reps if name in r[3]]
        return self.quantity(values) if values else None

    def flop_per_call(self):
        c = self.reps[0][3]
        if "flop_per_call" in c:
            return float(c["flop_per_call"])
        if "FLOPS" in c:  # files written before flop_per_call: FLOPS is the per-call count / time
            return float(c["FLOPS"]) * self.reps[0][0]
        return None

    def samples_text(self):
        return f"{len(self.reps)}×{self.iterations}"

    def fraction_beside(self, flop):
        """Each repetition's FLOP rate over the FMA peak probe run around that repetition's timed
        calls (counter peak_flops_beside, bench_common.hpp's timed_loop): median and spread over
        the repetitions. None for a multi-threaded or wall-clock point, or when a repetition
        lacks the probe."""
        if self.threads != 1 or self.wall:
            return None
        beside = [float(r[3].get("peak_flops_beside", 0)) for r in self.reps]
        if not beside or not all(b > 0 for b in beside):
            return None
        return self.quantity([flop / r[0] / b for r, b in zip(self.reps, beside)])


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
    """-> (points {(op, n, threads): Point}, contexts [(file, context)], errors [str])."""
    contexts, errors, candidates = [], [], {}
    for path in files:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            errors.append(f"{path}: unreadable ({e})")
            continue
        source = os.path.basename(path)
        contexts.append((source, data.get("context", {})))
        for b in data.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration":
                continue  # mean / median / stddev aggregates: the repetitions themselves are used
            name = b.get("name", "")
            if b.get("error_occurred"):
                errors.append(f"{name}: {b.get('error_message', 'error')}")
                continue
            op, named, positional = parse_name(name)
            n = b.get("N", named.get("N", positional[0] if positional else 0))
            n = int(float(n))
            # "threads" is Google Benchmark's own field; the library's worker threads are the
            # worker_threads counter (or the threads: argument of the name).
            threads = int(float(b.get("worker_threads", named.get("threads", 1))))
            unit = UNIT_SECONDS[b.get("time_unit", "ns")]
            wall = name.endswith("/real_time")
            key = (op, n, threads)
            by_file = candidates.setdefault(key, {})
            point = by_file.setdefault(source, Point(op, n, threads, source, wall))
            point.add((b["real_time"] if wall else b["cpu_time"]) * unit, b["cpu_time"] * unit,
                      int(b.get("iterations", 1)), b)
    # The same operator may be measured by two binaries (causal flash in bench_reference and
    # bench_ovq): keep the better-sampled measurement.
    points = {key: max(by_file.values(),
                       key=lambda p: (p.sampling()[0], sum(r[2] for r in p.reps)))
              for key, by_file in candidates.items()}
    return points, contexts, errors


# ---- what the rows read from ---------------------------------------------------------------------

PEAK_OP = "peak_fma_float"
EXP_OP = "peak_exp_float"


class Measurements:
    """The accessor a Target's value function receives. Every method raises Missing when the
    point is absent."""

    def __init__(self, points, contexts):
        self.points, self.contexts = points, contexts

    def point(self, op, n=TARGET_N, threads=1):
        p = self.points.get((op, n, threads))
        if p is None:
            raise Missing(op, n, threads)
        return p

    def has(self, op, n=TARGET_N, threads=1):
        return (op, n, threads) in self.points

    def ns(self, op, threads=1):
        return sorted(n for (o, n, t) in self.points if o == op and t == threads)

    def time(self, op, n=TARGET_N, threads=1):
        """Seconds per call (wall clock for /real_time benchmarks, else CPU)."""
        return self.point(op, n, threads).seconds()

    def cpu_time(self, op, n=TARGET_N, threads=1):
        """CPU seconds of the benchmark thread per call: what one thread costs, immune to time
        stolen by other processes (for a one-thread point the honest numerator of a speed-up)."""
        return self.point(op, n, threads).cpu_seconds()

    def counter(self, op, name, n=TARGET_N, threads=1):
        q = self.point(op, n, threads).counter(name)
        if q is None:
            raise Missing(op, n, threads, f"counter {name}")
        return q

    def heap(self, op, n=TARGET_N, threads=1):
        """Peak extra heap per call in bytes; exact, so any one repetition is enough."""
        q = self.counter(op, "peak_heap_bytes", n, threads)
        return Quantity(q.med, q.lo, q.hi)

    def flop_per_call(self, op, n=TARGET_N, threads=1):
        f = self.point(op, n, threads).flop_per_call()
        if f is None:
            raise Missing(op, n, threads, "FLOP count")
        return f

    def rate(self, op, n=TARGET_N, threads=1):
        """FLOP/s."""
        return self.flop_per_call(op, n, threads) / self.time(op, n, threads)

    def peak_flops(self):
        return self.rate(PEAK_OP, 0)

    def fraction_of_peak(self, op, n=TARGET_N, threads=1):
        """FLOP rate over the FMA peak: repetition by repetition against the probe run beside it
        where the point has one (the C++ binaries' one-thread points), else against bench_peak's
        peak_fma_float. The host's speed drifts by several percent within seconds, so a
        denominator measured minutes away would carry that drift into the fraction."""
        q = self.point(op, n, threads).fraction_beside(self.flop_per_call(op, n, threads))
        return q if q is not None else self.rate(op, n, threads) / self.peak_flops()

    def num_cpus(self):
        return max((int(c.get("num_cpus", 0)) for _, c in self.contexts), default=0) or None

    def context(self, key):
        """The first value of a context field over the files, or None."""
        return next((c[key] for _, c in self.contexts if key in c), None)


# ---- targets: the declarative table --------------------------------------------------------------

class Target:
    """One verdict row.

    name      what is measured (the row's first column)
    value     function(Measurements) -> Quantity (raise Missing via m.* when data is absent)
    goal      ("<=", x), (">=", x) or ("within", lo, hi): judged on the median
    bound     (lo, hi) physical limits of the value (either may be None), or a function
              (Measurements) -> (lo, hi); outside them the row is "impossible: measurement error"
    fmt       "ratio" (1.23×), "fraction" (0.61), "percent" (61%), or a function(x) -> str
    optional  None, or why the row may be absent without failing (e.g. an opt-in run)
    goal_text how to state the goal, when the default ("≥ 1.7×") does not read well
    """

    def __init__(self, name, value, goal, bound=(0, None), fmt="ratio", optional=None,
                 goal_text=None):
        self.name, self.value, self.goal, self.bound = name, value, goal, bound
        self.fmt, self.optional, self._goal_text = fmt, optional, goal_text

    def format(self, x):
        if callable(self.fmt):
            return self.fmt(x)
        if self.fmt == "fraction":
            return f"{x:.2f}"
        if self.fmt == "percent":
            return f"{x:.0%}"
        return f"{x:.2f}×" if abs(x) < 100 else f"{x:.0f}×"

    def goal_text(self):
        if self._goal_text:
            return self._goal_text
        g = self.goal
        limit = (lambda x: f"{x:g}×") if self.fmt == "ratio" else self.format
        if g[0] == "within":
            return f"within [{limit(g[1])}, {limit(g[2])}]"
        return f"{'≤' if g[0] == '<=' else '≥'} {limit(g[1])}"

    def met(self, x):
        g = self.goal
        if g[0] == "within":
            return g[1] <= x <= g[2]
        return x <= g[1] if g[0] == "<=" else x >= g[1]


N = TARGET_N
T_OVQ = 65536
PACKED_TOKENS = sum(range(512, 4097, 512))  # bench_batched: gma_packed_fwd_bwd's total rows
LAYER_TOKENS = 2 * 1024  # bench_batched: layer_train_step, B = 2 sequences of 1024


# How far above p a speed-up on p threads can physically go: p threads bring p private L1 and L2
# caches, so each thread's share of the work can run a little faster than the same work on one
# thread (measured: bench_batched's 8 GMA heads at N = 4096 took 2.29 ms per head on one thread
# and 2.25 ms per head on each of two, 2.03× in all, with every repetition within 1%). Beyond
# this, the measurement is wrong (a disturbed or cold one-thread run).
SUPERLINEAR = 1.05


def thread_bound(threads):
    """A speed-up on `threads` threads cannot exceed the threads (nor the machine's cores) by more
    than private caches allow (SUPERLINEAR)."""
    return lambda m: (0, SUPERLINEAR * min(threads, m.num_cpus() or threads))


BUSY = 1.15  # one thread's wall time over its CPU time above which it did not have a core


def thread_speedup(op, threads=2, n=TARGET_N):
    """One thread's CPU time over `threads` threads' wall time. On a busy machine the one-thread
    CPU time does not grow and the multi-thread wall time can only grow, so load can lower the
    ratio but never lift it above the thread count; when the one-thread run itself did not get a
    whole core (wall time over CPU time above BUSY), the other cores were not free either, and
    the row gives no verdict."""
    def value(m):
        one_cpu, one_wall = m.cpu_time(op, n, 1), m.time(op, n, 1)
        q = one_cpu / m.time(op, n, threads)
        stretch = one_wall.med / one_cpu.med
        if stretch > BUSY:
            q.refuse("machine busy", f"the 1-thread run got {1 / stretch:.0%} of a core "
                                     f"(wall {fmt_time(one_wall.med)}, CPU {fmt_time(one_cpu.med)})")
        return q
    return value


def packed_vs_separate(m):
    """The packed call on one thread over the same (sequence, head) pairs as separate calls in a
    training step's order (every forward, then every backward: a backward needs the loss, which
    needs every forward). The same calls with each backward right after its own forward, whose
    record is then still in cache, an order no training step can use, are shown beside it."""
    packed = m.time("gma_packed_fwd_bwd", PACKED_TOKENS)
    separate = m.time("gma_separate_fwd_then_bwd", PACKED_TOKENS)
    q = packed / separate
    interleaved = m.time("gma_separate_fwd_bwd", PACKED_TOKENS)
    q.text = (f"{q.med:.2f}× ({fmt_time(packed.med)} against {fmt_time(separate.med)}; "
              f"{(packed / interleaved).med:.2f}× against each backward right after its forward, "
              f"{fmt_time(interleaved.med)})")
    return q


def crossover(m):
    """Smallest N from which GMA bidirectional forward beats flash at every measured larger N."""
    ns = [n for n in m.ns("gma_forward_bidir") if m.has("flash_forward_bidir", n)]
    if not ns:
        raise Missing("flash_forward_bidir", "any")
    pairs = [(m.time("gma_forward_bidir", n), m.time("flash_forward_bidir", n)) for n in ns]
    faster = [g.med < f.med for g, f in pairs]
    cross = next((ns[i] for i in range(len(ns)) if all(faster[i:])), math.inf)
    text = (f"from N = {cross}" if cross != math.inf else "never") + f" (measured N ≥ {ns[0]})"
    return all_of([q for pair in pairs for q in pair], cross, text=text)


def per_token_drift(m):
    """Worst relative deviation of OVQ forward time per token over T = 16384 … 262144."""
    ns = [n for n in m.ns("ovq_forward") if 16384 <= n <= 262144]
    for need in (16384, 262144):
        if need not in ns:
            raise Missing("ovq_forward", need)
    per = {n: m.time("ovq_forward", n) / n for n in ns}
    ref = per[16384]
    worst = max(ns, key=lambda n: abs(per[n].med / ref.med - 1))
    dev = per[worst].med / ref.med - 1
    text = f"{ref.med * 1e6:.2f} µs/token at 16384; worst {dev:+.0%} at T = {worst}"
    return all_of(list(per.values()), dev, text=text)


def heap_growth(op):
    def value(m):
        a, b = m.heap(op, 16384), m.heap(op, 65536)
        q = b / a
        q.text = f"{q.med:.2f}× ({fmt_bytes(a.med)} → {fmt_bytes(b.med)})"
        return q
    return value


TORCH = "PyTorch side-by-side runs only with MIXATTN_BENCH_TORCH=1"
TORCH_EXT = "the PyTorch extension's benchmark runs only where PyTorch is installed"
TORCH_EXT_N = 2048  # bench/torch_ext_bench.py: (B, H, N) = (4, 8, 2048), r = d_v = K = 64
TORCH_EXT_EAGER = (("eager_gma_paper", "paper's broadcast form"), ("eager_gma", "matmul form"))


def torch_ratio(torch_op, op):
    """PyTorch eager time over mixattn's. PyTorch's matmuls are only as fast as the BLAS it
    loaded: against the reference BLAS (libblas3, which can win the loader's search when both it
    and OpenBLAS are installed) the ratio says nothing about the operators, so no verdict."""
    def value(m):
        return torch_blas_checked(m, m.time(torch_op) / m.time(op))
    return value


def torch_blas_checked(m, q):
    blas = m.context("torch_blas") or ""
    if not any(fast in blas.lower() for fast in ("openblas", "mkl", "blis")):
        q.refuse("reference BLAS", f"PyTorch loaded {blas or 'an unknown BLAS'}; install "
                                   "libopenblas0-pthread and make it the libblas.so.3 "
                                   "PyTorch loads")
    return q


def torch_ext_ratio(torch_op, op, threads):
    """The extension's benchmark (N = 2048): eager PyTorch's time over mixattn's, on `threads`
    threads, with torch_ratio's BLAS rule (the eager side is matmuls)."""
    def value(m):
        return torch_blas_checked(m, m.time(torch_op, TORCH_EXT_N, threads)
                                  / m.time(op, TORCH_EXT_N, threads))
    return value

# ---- decoding (bench_decode.cpp): one token per call at position P -------------------------------

DECODE_POSITIONS = (1024, 8192, 32768)


def fmt_us(x):
    return fmt_time(x)


def decode_latency(op, p):
    """Mean seconds per token at position p, shown with the p99 and the max beside it."""
    def value(m):
        mean, p99, mx = (m.counter(op, c, p) for c in ("mean_s", "p99_s", "max_s"))
        return all_of([mean, p99, mx], mean.med, mean.lo, mean.hi,
                      text=f"{fmt_us(mean.med)} (p99 {fmt_us(p99.med)}, max {fmt_us(mx.med)})")
    return value


def decode_flatness(op):
    """Mean latency per token at the last measured position over the first (1024)."""
    def value(m):
        ns = [n for n in m.ns(op) if n >= 1024]
        if 1024 not in ns or len(ns) < 2:
            raise Missing(op, 1024 if 1024 not in ns else "a second position")
        q = m.counter(op, "mean_s", ns[-1]) / m.counter(op, "mean_s", 1024)
        q.text = f"{q.med:.2f}× (P = 1024 → {ns[-1]})"
        return q
    return value


def ovq_block_worst(m):
    """The slowest block-completing token over every measured position."""
    qs = [m.counter("decode_ovq", "block_max_s", n) for n in m.ns("decode_ovq")]
    if not qs:
        raise Missing("decode_ovq", "any", what="counter block_max_s")
    worst = max(q.med for q in qs)
    return all_of(qs, worst, text=fmt_us(worst))


def ovq_after_block_ratio(m):
    """The slowest token right after a block completion over the mean, worst position. Each
    token's time is its least over identical passes of the generation (bench_decode replays it),
    so that the machine's own interruptions, which land on a token in one pass and not in the
    others, do not count as the token's cost; the single-pass max is shown beside it, and the
    same max for a fixed amount of plain arithmetic (decode_noise) as the machine's share."""
    qs = [m.counter("decode_ovq", "after_block_best_max_s", n)
          / m.counter("decode_ovq", "mean_s", n) for n in m.ns("decode_ovq")]
    if not qs:
        raise Missing("decode_ovq", "any", what="counter after_block_best_max_s")
    worst = max(q.med for q in qs)
    raw = max(m.counter("decode_ovq", "after_block_max_s", n).med for n in m.ns("decode_ovq"))
    passes = m.counter("decode_ovq", "passes", m.ns("decode_ovq")[0]).med
    text = f"{worst:.2f}× (each token's best of {passes:.0f} passes; one pass's max {fmt_us(raw)}"
    if m.ns("decode_noise"):
        noise = m.counter("decode_noise", "max_s", m.ns("decode_noise")[0])
        mean = m.counter("decode_noise", "mean_s", m.ns("decode_noise")[0])
        text += f"; {fmt_us(mean.med)} of plain arithmetic has max {fmt_us(noise.med)}"
    return all_of(qs, worst, text=text + ")")


def softmax_vs_gma(p):
    """Softmax-with-KV-cache decode time per token over GMA's, shown with softmax's latency."""
    def value(m):
        mean, p99, mx = (m.counter("decode_softmax_kv", c, p) for c in ("mean_s", "p99_s", "max_s"))
        q = mean / m.counter("decode_gma", "mean_s", p)
        q.text = (f"{q.med:.1f}× (softmax {fmt_us(mean.med)}, p99 {fmt_us(p99.med)}, "
                  f"max {fmt_us(mx.med)})")
        return q
    return value


DECODE_TARGETS = [
    *[Target(f"GMA decode, mean per token at position {p} (p99, max)",
             decode_latency("decode_gma", p), ("<=", 2e-6), fmt=fmt_us)
      for p in DECODE_POSITIONS],
    Target("GMA decode: mean per token at the last position / at 1024",
           decode_flatness("decode_gma"), ("<=", 1.25)),
    *[Target(f"OVQ decode (full 1024-entry dictionary), mean per token at position {p} (p99, max)",
             decode_latency("decode_ovq", p), ("<=", 10e-6), fmt=fmt_us)
      for p in DECODE_POSITIONS],
    Target("OVQ decode: slowest block-completing token", ovq_block_worst, ("<=", 1e-3),
           fmt=fmt_us),
    Target("OVQ decode: slowest token after a block completion / mean", ovq_after_block_ratio,
           ("<=", 2)),
    *[Target(f"softmax+KV cache decode / GMA decode, per token at position {p}",
             softmax_vs_gma(p), (">=", 1)) for p in DECODE_POSITIONS],
]


# Linear attention (bench_linear, SPEC §4): its floor is GMA's GEMMs with K = r features and no
# responsibilities; its causal form runs GMA's scan, with elementwise features instead of Γ.
LINEAR_TARGETS = [
    *[Target(f"linear attention {mode} {label} / its GEMM floor (N={N})",
             (lambda op: lambda m: m.time(op) / m.time("floor_" + op))(f"linear_{kind}_{mode}"),
             ("<=", goal))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))
      for mode, goal in (("bidir", 1.5), ("causal", 1.5))],
    Target(f"linear attention causal forward / GMA causal forward, r = K = 64 (N={N})",
           lambda m: m.time("linear_forward_causal") / m.time("gma_forward_causal"), ("<=", 1)),
    # Performer (bench_linear, SPEC §5): the same read/write with m = 256 random features, plus
    # the feature projections X Wᵀ (and, backward, the exponents' gradient times W) in its floor.
    *[Target(f"Performer {mode} {label} / its GEMM floor (N={N})",
             (lambda op: lambda m: m.time(op) / m.time("floor_" + op))(f"performer_{kind}_{mode}"),
             ("<=", 1.5))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))
      for mode in ("bidir", "causal")],
    # Static-codebook VQ attention (bench_linear, SPEC §6): S = 64 one-hot code features on the
    # same read/write, the code GEMMs and, backward, the per-code straight-through states.
    *[Target(f"VQ attention {mode} {label} / its GEMM floor (N={N})",
             (lambda op: lambda m: m.time(op) / m.time("floor_" + op))(f"vq_{kind}_{mode}"),
             ("<=", 1.5))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))
      for mode in ("bidir", "causal")],
    # Sliding-window attention (bench_reference, SPEC §7): the tiled kernels skip every key tile
    # outside the window, so a token costs O(w), whatever N. Per-token time at the longest N over
    # the shortest (the edge tiles' share shrinks with N, so above 1 means work that grows with N);
    # and at N = 4096 the w = 256 band holds 1/8.2 of full causal attention's (query, key) pairs.
    *[Target(f"sliding window (w = 256) {label}: time per token at N = 8192 / at N = 2048",
             (lambda op: lambda m: (m.time(op, 8192) / 8192) / (m.time(op, 2048) / 2048))(
                 f"flash_window256_{kind}_causal"), ("<=", 1.25))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))],
    Target(f"sliding window (w = 256) causal forward / flash causal forward (N={N})",
           lambda m: m.time("flash_window256_forward_causal") / m.time("flash_forward_causal"),
           ("<=", 0.25)),
]


TARGETS = [
    Target(f"GMA bidir forward / its GEMM floor (N={N})",
           lambda m: m.time("gma_forward_bidir") / m.time("floor_gma_forward_bidir"),
           ("<=", 1.5)),
    Target(f"flash_forward / GMA bidir forward (N={N})",
           lambda m: m.time("flash_forward_bidir") / m.time("gma_forward_bidir"), (">=", 12)),
    Target(f"GMA bidir fwd+bwd / its GEMM floor (N={N})",
           lambda m: m.time("gma_fwd_bwd_bidir") / m.time("floor_gma_fwd_bwd_bidir"),
           ("<=", 1.5)),
    Target(f"GMA causal forward / GMA bidir forward (N={N})",
           lambda m: m.time("gma_forward_causal") / m.time("gma_forward_bidir"), ("<=", 2.5)),
    Target("GMA bidir forward faster than flash_forward", crossover, ("<=", 512),
           bound=(None, None), fmt=lambda x: f"N = {x:g}", goal_text="from N ≤ 512"),
    Target(f"responsibilities / one (N×2r)·(2r×K) GEMM (N={N})",
           lambda m: m.time("gma_responsibilities") / m.time("floor_gma_responsibilities"),
           ("<=", 1.5)),
    Target(f"flash_forward fraction of the GEMM rate (N={N})",
           lambda m: m.time("floor_softmax_forward_bidir") / m.time("flash_forward_bidir"),
           (">=", 0.5), fmt="percent"),
    Target(f"causal flash_forward / OVQ forward (T={T_OVQ})",
           lambda m: m.time("flash_forward_causal", T_OVQ) / m.time("ovq_forward", T_OVQ),
           (">=", 10)),
    Target("OVQ forward time per token, T = 16384 … 262144, vs T = 16384", per_token_drift,
           ("within", -0.25, 0.25), bound=(None, None), fmt=lambda x: f"{x:+.0%}",
           goal_text="within ±25%"),
    *[Target(f"peak extra heap growth of {op}, N = 16384 → 65536", heap_growth(op),
             ("<=", 4.5)) for op in ("gma_fwd_bwd_bidir", "gma_fwd_bwd_causal", "ovq_forward")],
    # Fraction of the measured FMA peak: the operator's FLOP count (stated in bench/, the GEMM
    # work of its floor) over its time, over the FLOP/s of register-only FMAs measured around the
    # same repetition (Measurements.fraction_of_peak).
    # The forward+backward is measured as a training step runs it, forward_into + backward_into
    # with reused records: the value-returning pair (gma_fwd_bwd_bidir, in the operator table)
    # also allocates and first-touches ~6 MiB of fresh results and records per call, and under
    # glibc's defaults those page faults take about as long as the arithmetic itself.
    *[Target(f"{label}, fraction of FMA peak ({'T' if op.startswith('ovq') else 'N'}={n})",
             (lambda op, n: lambda m: m.fraction_of_peak(op, n))(op, n), (">=", goal),
             bound=(0, 1), fmt="fraction")
      for label, op, n, goal in (
          ("GMA bidir forward", "gma_forward_bidir", N, 0.80),
          ("GMA bidir fwd+bwd (training step: forward_into + backward_into)",
           "gma_train_step_into_bidir", N, 0.70),
          ("GMA causal forward", "gma_forward_causal", N, 0.65),
          ("flash_forward (bidir)", "flash_forward_bidir", N, 0.65),
          ("OVQ forward", "ovq_forward", T_OVQ, 0.60))],
    Target(f"PyTorch eager GMA forward / mixattn (N={N})",
           torch_ratio("torch_gma_forward_bidir", "gma_forward_bidir"), (">=", 25),
           optional=TORCH),
    Target(f"PyTorch eager GMA fwd+bwd / mixattn (N={N})",
           torch_ratio("torch_gma_fwd_bwd_bidir", "gma_fwd_bwd_bidir"), (">=", 40),
           optional=TORCH),
    # The PyTorch extension (bench/torch_ext_bench.py, float32, (B, H, N) = (4, 8, 2048),
    # r = d_v = K = 64): eager PyTorch over mixattn's extension, both in one process, on the same
    # number of threads (CPU time on one thread, wall time on two).
    # Two eager baselines (bench/torch_eager.py): the paper's broadcast form, one (batch, head)
    # at a time (eager_gma_paper), and the matmul form eager linear attention is written in
    # (eager_gma, chunked when causal), the stronger of the two.
    *[Target(f"PyTorch eager GMA ({form}) fwd+bwd / mixattn.gma_attention, {mode}, B·H = 32, "
             f"N = 2048, {threads} thread{'s' if threads > 1 else ''}",
             torch_ext_ratio(f"torch_ext_{impl}_fwd_bwd_{mode}",
                             f"torch_ext_mixattn_fwd_bwd_{mode}", threads),
             (">=", 10), optional=TORCH_EXT)
      for impl, form in TORCH_EXT_EAGER for mode in ("bidir", "causal") for threads in (1, 2)],
    *[Target(f"2-layer causal LM training step, eager-GMA ({form}) model / mixattn modules "
             f"(d_model 256, N = 2048, batch 4), {threads} thread{'s' if threads > 1 else ''}",
             torch_ext_ratio(f"torch_ext_{impl}_step_causal", "torch_ext_mixattn_step_causal",
                             threads),
             (">=", 3), optional=TORCH_EXT)
      for impl, form in TORCH_EXT_EAGER for threads in (1, 2)],
    # Speed-up on 2 threads (thread_speedup: bounded by 2, no verdict on a busy machine).
    *[Target(f"batched GMA {kind}, B·H = 8, 2 threads vs 1 (N={N})",
             thread_speedup(f"gma_heads_{kind}_bidir"), (">=", 1.7), bound=thread_bound(2))
      for kind in ("forward", "fwd_bwd")],
    # Training loops (bench_gma, bench_batched): caller-owned records, glibc's default malloc.
    Target(f"GMA bidir fwd+bwd via _into, glibc's default malloc / kept memory (N={N})",
           lambda m: m.time("gma_train_step_into_bidir")
                     / m.time("gma_train_step_into_bidir_keep"), ("<=", 1.1)),
    Target("packed GMA fwd+bwd, 8 sequences of 512 … 4096, H = 4, 2 threads vs 1",
           thread_speedup("gma_packed_fwd_bwd", n=PACKED_TOKENS), (">=", 1.85),
           bound=thread_bound(2)),
    Target("packed GMA fwd+bwd on 1 thread / the same pairs as separate calls, every forward "
           "then every backward", packed_vs_separate, ("<=", 1.0)),
    Target("layer training step, B·H = 8, N = 1024, d_model = 256, 2 threads vs 1",
           thread_speedup("layer_train_step", n=LAYER_TOKENS), (">=", 1.8),
           bound=thread_bound(2)),
    *DECODE_TARGETS,
    *LINEAR_TARGETS,
]

# Which binary writes which operator (first matching prefix), to tell "did not build" from
# "missing". Extend when adding a benchmark binary.
PRODUCERS = [
    ("gma_heads_", ["bench_batched"]), ("gma_packed_", ["bench_batched"]),
    ("gma_separate_", ["bench_batched"]), ("layer_", ["bench_batched"]),
    ("gma_", ["bench_gma"]), ("floor_gma_", ["bench_gma"]),
    ("linear_", ["bench_linear"]), ("floor_linear_", ["bench_linear"]),
    ("performer_", ["bench_linear"]), ("floor_performer_", ["bench_linear"]),
    ("vq_", ["bench_linear"]), ("floor_vq_", ["bench_linear"]),
    ("ovq_", ["bench_ovq"]), ("floor_ovq_", ["bench_ovq"]),
    ("flash_forward_causal", ["bench_reference", "bench_ovq"]),
    ("naive_", ["bench_reference"]), ("flash_", ["bench_reference"]),
    ("floor_softmax_", ["bench_reference"]),
    ("peak_", ["bench_peak"]),
    ("decode_", ["bench_decode"]),
    ("torch_ext_", ["torch_ext"]),
    ("torch_", ["torch_side_by_side"]),
]


def producers(op):
    return next((b for prefix, b in PRODUCERS if op.startswith(prefix)), [])


# ---- judging -------------------------------------------------------------------------------------

class Row:
    """A judged target: measured text, goal text, verdict, and whether it fails the summary."""

    def __init__(self, name, measured, goal, verdict, fails=False, note=""):
        self.name, self.measured, self.goal = name, measured, goal
        self.verdict, self.fails, self.note = verdict, fails, note


def spread_text(q, fmt):
    if q.lo == q.hi:
        return ""
    return f" [{fmt(q.lo)} – {fmt(q.hi)}]"


def judge(target, m, not_built, partial):
    try:
        q = target.value(m)
    except Missing as e:
        built_missing = [b for b in producers(e.op) if b in not_built]
        if built_missing:
            return Row(target.name, "not measured", target.goal_text(),
                       f"not measured ({', '.join(built_missing)} did not build)")
        if target.optional:
            return Row(target.name, "not measured", target.goal_text(),
                       f"not measured ({target.optional})")
        if partial:
            return Row(target.name, "not measured", target.goal_text(),
                       "not measured (filtered run)")
        return Row(target.name, "missing", target.goal_text(), f"MISSING: {e}", fails=True)
    except ZeroDivisionError:
        return Row(target.name, "a zero time or count", target.goal_text(),
                   "impossible: measurement error", fails=True)
    measured = q.text or (target.format(q.med) + spread_text(q, target.format))
    bound = target.bound(m) if callable(target.bound) else target.bound
    lo, hi = bound
    if (lo is not None and q.med < lo) or (hi is not None and q.med > hi):
        limit = f"above {target.format(hi)}" if hi is not None and q.med > hi else \
            f"below {target.format(lo)}"
        # Impossible when every pairing of the repetitions lies beyond the bound. A median past
        # it whose spread reaches back within it is what noise does to a value at the bound
        # (a perfectly scaling run measures above p threads about half the time): no verdict,
        # and no failure.
        if (lo is not None and q.hi < lo) or (hi is not None and q.lo > hi):
            return Row(target.name, measured, target.goal_text(),
                       "impossible: measurement error", fails=True,
                       note=f"{target.format(q.med)} is {limit}, the physical bound")
        return Row(target.name, measured, target.goal_text(),
                   "at the physical bound: no verdict",
                   note=f"the median {target.format(q.med)} is {limit}, the physical bound, "
                        f"within its spread")
    if not q.ok:
        return Row(target.name, measured, target.goal_text(), q.refusal, note=q.why)
    return Row(target.name, measured, target.goal_text(),
               "met" if target.met(q.med) else "NOT MET")


def judge_all(points, contexts, not_built=(), partial=False, targets=None):
    m = Measurements(points, contexts)
    return [judge(t, m, set(not_built), partial) for t in (targets or TARGETS)]


# ---- the per-point table -------------------------------------------------------------------------

# The training step (forward_into + backward_into with reused records) does the work of a
# forward+backward: the same floor and the same flash comparison.
SAME_WORK = {"gma_train_step_into_bidir": "gma_fwd_bwd_bidir",
             "gma_train_step_into_bidir_keep": "gma_fwd_bwd_bidir"}


def floor_of(op):
    op = SAME_WORK.get(op, op)
    if op.startswith(("floor_", "torch_", "peak_")):
        return None
    if op.startswith("naive_") or op.startswith("flash_"):
        return "floor_softmax_" + op.split("_", 1)[1]
    return "floor_" + op


def flash_of(op):
    op = SAME_WORK.get(op, op)
    if op.startswith(("flash_", "floor_", "gma_heads", "peak_", "torch_ext_")) or \
            op == "gma_responsibilities":
        return None
    kind = "fwd_bwd" if "fwd_bwd" in op else "forward"
    mode = "bidir" if "bidir" in op else "causal"  # OVQ is causal
    return f"flash_{kind}_{mode}"


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
    return f"{x:.2f}×" if x < 100 else f"{x:.0f}×"


HEADER = ["operator", "N", "time/call", "[min – max]", "reps×iters", "t / t_floor",
          "fraction of peak (GFLOP/s)", "speed-up vs flash", "peak extra heap", "note"]


def point_row(m, p):
    """One table row; returns (cells, fails: impossible measurement)."""
    t = p.seconds()
    note, fails = [] if t.ok else ["too few samples"], False

    def ratio(f, fmt=fmt_ratio):
        try:
            q = f()
        except (Missing, ZeroDivisionError):
            return "—", None
        return (fmt(q.med) if q.ok else "(too few samples)"), q

    rel = floor_of(p.op)
    floor_txt, _ = ratio(lambda: t / m.time(rel, p.n)) if rel and p.threads == 1 else ("—", None)
    fl = flash_of(p.op)
    flash_txt, _ = ratio(lambda: m.time(fl, p.n) / t) if fl and p.threads == 1 else ("—", None)
    peak_txt, peak_q = "—", None
    if p.op != PEAK_OP and p.flop_per_call() is not None:
        peak_txt, peak_q = ratio(lambda: m.fraction_of_peak(p.op, p.n, p.threads),
                                 lambda x: f"{x:.2f}")
        # A rate above the measured peak times the threads is not a measurement of work done.
        if peak_q is not None and peak_q.med > p.threads:
            fails = True
            note.append(f"impossible: {peak_q.med:.2f}× the FMA peak")
        rate = p.flop_per_call() / t.med / 1e9
        peak_txt = (f"{peak_txt} ({rate:.3g})" if peak_txt != "—" else f"({rate:.3g})")
    heap = p.counter("peak_heap_bytes")
    name = p.op if p.threads == 1 else f"{p.op} ({p.threads} threads)"
    cells = [name, str(p.n) if p.n else "—", fmt_time(t.med),
             "" if t.lo == t.hi else f"{fmt_time(t.lo)} – {fmt_time(t.hi)}",
             p.samples_text(), floor_txt, peak_txt, flash_txt,
             fmt_bytes(heap.med if heap else None), ", ".join(note)]
    return cells, fails


def table_rows(points, contexts, ns_filter=None):
    m = Measurements(points, contexts)
    rows, failures = [], []
    for key in sorted(points):
        p = points[key]
        cells, fails = point_row(m, p)
        if fails:  # floors too: no GEMM may run above the peak either
            failures.append(f"{p.label()}: {cells[-1]}")
        if p.op.startswith("floor_"):
            continue  # a floor is the t / t_floor column of its operator's row
        if ns_filter and p.n not in ns_filter and not p.op.startswith("peak_"):
            continue
        rows.append(cells)
    return rows, failures


def text_table(header, rows):
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    prev = None
    for r in rows:
        group = r[0].split(" (")[0]  # thread-count variants stay in their operator's group
        if prev is not None and group != prev:
            out.append("")
        prev = group
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(out)


def md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---- the README's operator table -----------------------------------------------------------------

HEADLINE = [  # (label, operator, N)
    ("GMA bidirectional forward", "gma_forward_bidir", N),
    ("GMA bidirectional forward+backward", "gma_fwd_bwd_bidir", N),
    ("GMA bidirectional training step (forward_into + backward_into, records reused)",
     "gma_train_step_into_bidir", N),
    ("GMA causal forward", "gma_forward_causal", N),
    ("GMA causal forward+backward", "gma_fwd_bwd_causal", N),
    ("flash forward (bidirectional)", "flash_forward_bidir", N),
    ("flash forward+backward (bidirectional)", "flash_fwd_bwd_bidir", N),
    ("OVQ forward, T = 65 536", "ovq_forward", T_OVQ),
    ("OVQ forward+backward, T = 65 536", "ovq_fwd_bwd", T_OVQ),
    ("linear attention bidirectional forward", "linear_forward_bidir", N),
    ("linear attention bidirectional forward+backward", "linear_fwd_bwd_bidir", N),
    ("linear attention causal forward", "linear_forward_causal", N),
    ("linear attention causal forward+backward", "linear_fwd_bwd_causal", N),
    ("Performer (m = 256) bidirectional forward", "performer_forward_bidir", N),
    ("Performer (m = 256) bidirectional forward+backward", "performer_fwd_bwd_bidir", N),
    ("Performer (m = 256) causal forward", "performer_forward_causal", N),
    ("Performer (m = 256) causal forward+backward", "performer_fwd_bwd_causal", N),
    ("VQ attention (S = 64) bidirectional forward", "vq_forward_bidir", N),
    ("VQ attention (S = 64) bidirectional forward+backward", "vq_fwd_bwd_bidir", N),
    ("VQ attention (S = 64) causal forward", "vq_forward_causal", N),
    ("VQ attention (S = 64) causal forward+backward", "vq_fwd_bwd_causal", N),
    ("sliding-window attention (w = 256) forward", "flash_window256_forward_causal", N),
    ("sliding-window attention (w = 256) forward+backward", "flash_window256_fwd_bwd_causal", N),
]
HEADLINE_HEADER = ["operator (N = 4096 unless said)", "time [min – max]", "ratio to GEMM floor",
                   "fraction of FMA peak (GFLOP/s)", "speed-up vs flash", "peak extra heap"]


def headline_rows(points, contexts):
    rows = []
    for label, op, n in HEADLINE:
        p = points.get((op, n, 1))
        if p is None:
            rows.append([label, "not measured", "—", "—", "—", "—"])
            continue
        cells, _ = point_row(Measurements(points, contexts), p)
        time = cells[2] + (f" [{cells[3]}]" if cells[3] else "")
        rows.append([label, time, cells[5], cells[6], cells[7], cells[8]])
    return rows


# ---- the README's "From PyTorch" table (bench/torch_ext_bench.py) -------------------------------

TORCH_EXT_ROWS = [  # (label, operator suffix, threads)
    *[(f"GMA {mode_label} {kind_label}", f"{kind}_{mode}", threads)
      for threads in (1, 2)
      for mode, mode_label in (("bidir", "bidirectional"), ("causal", "causal"))
      for kind, kind_label in (("forward", "forward"), ("fwd_bwd", "forward+backward"))],
    ("training step, 2-layer causal LM (d_model 256, 4 heads, K = 64, N = 2048, batch 4)",
     "step_causal", 1),
    ("training step, same", "step_causal", 2),
]
TORCH_EXT_HEADER = ["operation", "threads", "mixattn", "eager GMA, paper's form",
                    "eager GMA, matmul form", "eager softmax", "paper's form / mixattn",
                    "matmul form / mixattn"]


def torch_ext_rows(points, contexts):
    """Median time per call of each side (CPU on one thread, wall on two) and the speed-ups over
    the two eager GMAs (the paper's form is measured only for forward+backward and the step)."""
    m, rows = Measurements(points, contexts), []
    for label, what, threads in TORCH_EXT_ROWS:
        cells, times = [label, str(threads)], {}
        for impl in ("mixattn", "eager_gma_paper", "eager_gma", "softmax"):
            try:
                q = m.time(f"torch_ext_{impl}_{what}", TORCH_EXT_N, threads)
            except Missing:
                cells.append("not measured")
                continue
            times[impl] = q
            cells.append(fmt_time(q.med) + spread_text(q, fmt_time)
                         + ("" if q.ok else " (too few samples)"))
        for eager in ("eager_gma_paper", "eager_gma"):
            if "mixattn" in times and eager in times:
                r = torch_blas_checked(m, times[eager] / times["mixattn"])
                cells.append(fmt_ratio(r.med) if r.ok else f"({r.refusal})")
            else:
                cells.append("—")
        rows.append(cells)
    return rows


# ---- main ----------------------------------------------------------------------------------------

def is_quick(contexts):
    return any(c.get("mixattn_bench_quick") == "1" for _, c in contexts)


def context_lines(contexts):
    lines = []
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
        lines.append(f"- `{fname}`: " + ", ".join(b for b in bits if b))
    return lines


def peak_lines(points):
    out = []
    p = points.get((PEAK_OP, 0, 1))
    if p:
        q = p.flop_per_call() / p.seconds()
        label = p.reps[0][3].get("label", "")
        out.append(f"- FMA peak (one thread, float, {label}): {q.med / 1e9:.1f} GFLOP/s"
                   f" [{q.lo / 1e9:.1f} – {q.hi / 1e9:.1f}]")
    beside = [float(r[3]["peak_flops_beside"]) for q in points.values()
              if q.threads == 1 and not q.wall for r in q.reps if "peak_flops_beside" in r[3]]
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
    "Every point is timed after one untimed call. A point with fewer than 3 repetitions and "
    "fewer than 3 iterations, or without the untimed call, gives no ratio (\"too few samples\"). "
    "`t / t_floor`: time over the time of the Eigen GEMMs of the same shapes; `fraction of peak`: "
    "the operator's FLOP count (its floor's GEMM work) per second over the FLOP/s of "
    "register-only FMA chains, for a one-thread row repetition by repetition against the chains "
    "run around that repetition's timed calls (median over the repetitions), for the others "
    "against bench_peak's; `speed-up vs flash`: FlashAttention-style softmax "
    "attention time over this operator's time at the same N (same mode). A value beyond its "
    "physical bound (speed-up above the thread count, fraction of peak above 1) over its whole "
    "spread is reported as a measurement error and fails the summary; one whose median is beyond "
    "it but whose spread reaches back within it gets no verdict. A thread speed-up is one thread's CPU time over "
    "the threads' wall time, and gives no verdict (\"machine busy\") when the one-thread run's "
    "wall time exceeds its CPU time by more than 15%. Peak extra heap: high-water mark of heap "
    "allocated during one call, outputs included.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="Google Benchmark JSON files")
    ap.add_argument("--out", default=os.path.join(HERE, "results"),
                    help="directory for summary.md and the plots (default: bench/results)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--not-built", action="append", default=[], metavar="BINARY",
                    help="a benchmark binary that did not build (its rows are not measured)")
    ap.add_argument("--partial", action="store_true",
                    help="the run was filtered: absent benchmarks are not an error")
    args = ap.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(args.out, "*.json")))
    if not files:
        print("summary: no JSON files (run bash bench/run.sh first)", file=sys.stderr)
        return 1
    points, contexts, errors = load(files)
    if not points:
        print("summary: no benchmark runs in " + ", ".join(files), file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    quick = is_quick(contexts)
    title = "mixattn benchmark summary" + (
        " — QUICK MODE (MIXATTN_BENCH_QUICK=1: fewer sizes, shorter runs)" if quick else "")

    print(title + "\n")
    console_ns = {4 ** k for k in range(20)}  # every other power of two on the console
    rows, point_failures = table_rows(points, contexts, console_ns)
    print(text_table(HEADER, rows))
    print("\n(console shows N = 4^k; every N is in summary.md)\n")
    checks = judge_all(points, contexts, args.not_built, args.partial)
    w = max(len(r.name) for r in checks)
    print("Targets (float, 1 thread, N = 4096, K = 64, r = d_v = 64 unless stated):")
    for r in checks:
        note = f" ({r.note})" if r.note else ""
        print(f"  {r.name.ljust(w)}  {r.measured}  (goal {r.goal})  → {r.verdict}{note}")
    for line in peak_lines(points):
        print(line)
    if errors:
        print("\nBenchmarks that reported errors:\n  " + "\n  ".join(errors))

    plots = []
    if not args.no_plots:
        sys.path.insert(0, HERE)
        import summary_plots
        plots = summary_plots.plot_all(points, args.out, quick)

    all_rows, all_failures = table_rows(points, contexts)
    target_rows = [[r.name, r.measured, r.goal, r.verdict + (f" ({r.note})" if r.note else "")]
                   for r in checks]
    md = [f"# {title}", "", RULES_MD, "", "## Runs", *context_lines(contexts), "",
          "## Machine limits (bench_peak)", *(peak_lines(points) or ["- not measured"]), "",
          "## Targets", md_table(["target", "measured [min – max]", "goal", "verdict"],
                                 target_rows), "",
          "## README table", md_table(HEADLINE_HEADER, headline_rows(points, contexts)), "",
          "## README table: From PyTorch (bench/torch_ext_bench.py, float32, (B, H, N) = "
          "(4, 8, 2048), r = d_v = K = 64)",
          md_table(TORCH_EXT_HEADER, torch_ext_rows(points, contexts)), "",
          "## All results", md_table(HEADER, all_rows), ""]
    if errors:
        md += ["## Errors", *[f"- {e}" for e in errors], ""]
    for p in plots:
        md += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    md_path = os.path.join(args.out, "summary.md")
    with open(md_path, "w") as f:
        f.write("\n".join(md))
    print(f"\nwrote {md_path}" + "".join(f", {p}" for p in plots))

    failures = [f"{r.name}: {r.verdict}" + (f" ({r.note})" if r.note else "")
                for r in checks if r.fails] + all_failures + errors
    if failures:
        print("\nsummary: FAILED — these numbers cannot be trusted or are missing:\n  " +
              "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
