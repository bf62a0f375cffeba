"""Reading benchmark results for bench/summary.py: quantities with their spread, the points of
the JSON files, and the accessor a target row reads them through.

A measured value is a Quantity: median, [min, max] and, when it comes from repetitions, the value
of each repetition keyed by where it was measured (binary, try, round, repetition). Two
quantities whose repetitions were measured in the same processes (the same keys) combine pair by
pair: a ratio is the median of the per-pair ratios, with their spread. That is what makes a ratio
survive a noisy machine: bench/run.sh runs every binary once per round, so both sides of a pair
ran seconds apart in one process and saw the same machine state. Anything else combines by
interval arithmetic (the spread is the extreme ratios of the operands' spreads).
"""

import json
import os
import re
import statistics

UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
TARGET_N = 4096
MIN_SAMPLES = 3  # repetitions or iterations a timed point needs before it enters a ratio
PEAK_OP = "peak_fma_float"
EXP_OP = "peak_exp_float"


class Quantity:
    """A measured value: median, spread [lo, hi], whether its samples suffice (ok; if not, `why`
    says what is lacking), and, where it has them, its per-repetition `samples` {key: value}.
    `paired` marks a value computed pair by pair from two measured sides (or from an operator
    and the probe run beside it): the values whose spread the noise rule judges."""

    def __init__(self, med, lo=None, hi=None, ok=True, why="", text=None, samples=None,
                 paired=False):
        self.med = med
        self.lo = med if lo is None else lo
        self.hi = med if hi is None else hi
        self.ok, self.why, self.text = ok, why, text
        self.samples, self.paired = samples, paired
        self.exact = False  # a plain number (Quantity.of), not a measurement
        self.refusal = "too few samples"  # the verdict when not ok

    @staticmethod
    def from_samples(samples, ok=True, why="", paired=False):
        values = list(samples.values())
        return Quantity(statistics.median(values), min(values), max(values), ok, why,
                        samples=samples, paired=paired)

    def refuse(self, refusal, why):
        """Withhold the verdict for another reason than sampling (e.g. a busy machine)."""
        self.ok, self.refusal = False, refusal
        self.why = "; ".join(w for w in (self.why, why) if w)
        return self

    @staticmethod
    def of(x):
        if isinstance(x, Quantity):
            return x
        q = Quantity(float(x))
        q.exact = True
        return q

    def _why(self, other):
        whys = [w for w in (self.why, other.why) if w]
        return "; ".join(dict.fromkeys(whys))

    def _combine(self, other, f, interval):
        """f applied pair by pair where both sides have the same repetitions (or one side is a
        plain number); else interval arithmetic: interval(self, other) -> (med, lo, hi)."""
        o = Quantity.of(other)
        ok, why = self.ok and o.ok, self._why(o)
        if self.samples is not None and (o.exact or (o.samples is not None and
                                                     o.samples.keys() == self.samples.keys())):
            s = {k: f(v, o.med if o.exact else o.samples[k]) for k, v in self.samples.items()}
            return Quantity.from_samples(s, ok, why, self.paired or not o.exact or o.paired)
        if self.exact and o.samples is not None:
            s = {k: f(self.med, v) for k, v in o.samples.items()}
            return Quantity.from_samples(s, ok, why, o.paired)
        med, lo, hi = interval(self, o)
        return Quantity(med, min(lo, hi), max(lo, hi), ok, why)

    def __truediv__(self, other):
        return self._combine(other, lambda a, b: a / b,
                             lambda a, b: (a.med / b.med, a.lo / b.hi, a.hi / b.lo))

    def __rtruediv__(self, other):
        return Quantity.of(other) / self

    def __mul__(self, other):
        return self._combine(other, lambda a, b: a * b,
                             lambda a, b: (a.med * b.med, a.lo * b.lo, a.hi * b.hi))

    __rmul__ = __mul__

    def __add__(self, other):
        return self._combine(other, lambda a, b: a + b,
                             lambda a, b: (a.med + b.med, a.lo + b.lo, a.hi + b.hi))

    __radd__ = __add__

    def __sub__(self, other):
        return self._combine(other, lambda a, b: a - b,
                             lambda a, b: (a.med - b.med, a.lo - b.hi, a.hi - b.lo))


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


# ---- formatting ----------------------------------------------------------------------------------

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


def spread_text(q, fmt):
    if fmt(q.lo) == fmt(q.hi):
        return ""
    return f" [{fmt(q.lo)} – {fmt(q.hi)}]"


# ---- points --------------------------------------------------------------------------------------

class Rep:
    """One repetition: wall and CPU seconds per call, iterations, the JSON entry (counters), and
    its key (binary, try, round, ordinal) for pairing."""

    def __init__(self, real, cpu, iterations, entry, key):
        self.real, self.cpu, self.iterations = real, cpu, iterations
        self.entry, self.key = entry, key


class Point:
    """One benchmark point (operator, N, threads) of one binary: its repetitions of the latest
    try that measured it, over every round."""

    def __init__(self, op, n, threads, source, wall):
        self.op, self.n, self.threads, self.source, self.wall = op, n, threads, source, wall
        self.reps = []
        self.names = set()  # the benchmark names (for a re-measurement's filter)

    @property
    def iterations(self):
        return min(r.iterations for r in self.reps)

    @property
    def warm(self):
        return all(r.entry.get("warm_up_calls", 0) >= 1 for r in self.reps)

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

    def quantity(self, value, paired=False):
        """value(rep) -> float or None, over the repetitions that have it."""
        samples = {r.key: value(r) for r in self.reps}
        samples = {k: v for k, v in samples.items() if v is not None}
        if not samples:
            return None
        ok, why = self.sampling()
        return Quantity.from_samples(samples, ok, why, paired)

    def seconds(self):
        """Seconds per call: wall clock for a /real_time benchmark, else CPU."""
        return self.quantity(lambda r: r.real if self.wall else r.cpu)

    def cpu_seconds(self):
        return self.quantity(lambda r: r.cpu)

    def wall_seconds(self):
        return self.quantity(lambda r: r.real)

    def counter(self, name):
        return self.quantity(lambda r: float(r.entry[name]) if name in r.entry else None)

    def flop_per_call(self):
        c = self.reps[0].entry
        if "flop_per_call" in c:
            return float(c["flop_per_call"])
        if "FLOPS" in c:  # files written before flop_per_call: FLOPS is the per-call count / time
            return float(c["FLOPS"]) * (self.reps[0].real if self.wall else self.reps[0].cpu)
        return None

    def samples_text(self):
        return f"{len(self.reps)}×{self.iterations}"

    def fraction_beside(self, flop):
        """Each repetition's FLOP rate over the FMA peak probe run around that repetition's timed
        calls (counter peak_flops_beside, bench_common.hpp's timed_loop), pair by pair. None for
        a multi-threaded or wall-clock point, or when a repetition lacks the probe."""
        if self.threads != 1 or self.wall:
            return None
        beside = [float(r.entry.get("peak_flops_beside", 0)) for r in self.reps]
        if not beside or not all(b > 0 for b in beside):
            return None
        return self.quantity(lambda r: flop / r.cpu / float(r.entry["peak_flops_beside"]),
                             paired=True)


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


FILE_NAME = re.compile(r"^(?P<binary>[^.]+)(?:\.t(?P<try>\d+))?(?:\.r(?P<round>\d+))?\.json$")


def read_file(path, errors):
    """-> (binary, try, round, context, entries) or None (unreadable: an error is recorded).
    bench/measure.py names its files <binary>.t<try>.r<round>.json (bench_gma.t0.r1.json: round 1
    of bench_gma's first measurement); any other name is try 0, round 0 of the binary named by
    the file name up to its first dot."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        errors.append(f"{path}: unreadable ({e})")
        return None
    context = data.get("context", {})
    name = os.path.basename(path)
    m = FILE_NAME.match(name)
    binary = m.group("binary") if m else name.split(".")[0]
    attempt = int(m.group("try") or 0) if m else 0
    rnd = int(m.group("round") or 0) if m else 0
    return binary, attempt, rnd, context, data.get("benchmarks", [])


def add_entries(candidates, binary, attempt, rnd, entries, errors):
    """Adds a file's repetitions to candidates {(op, n, threads): {binary: {try: Point}}}."""
    ordinal = {}
    for b in entries:
        if b.get("run_type", "iteration") != "iteration":
            continue  # mean / median / stddev aggregates: the repetitions themselves are used
        name = b.get("name", "")
        if b.get("error_occurred"):
            errors.append(f"{name}: {b.get('error_message', 'error')}")
            continue
        op, named, positional = parse_name(name)
        n = int(float(b.get("N", named.get("N", positional[0] if positional else 0))))
        # "threads" is Google Benchmark's own field; the library's worker threads are the
        # worker_threads counter (or the threads: argument of the name).
        threads = int(float(b.get("worker_threads", named.get("threads", 1))))
        unit = UNIT_SECONDS[b.get("time_unit", "ns")]
        wall = name.endswith("/real_time")
        key = (op, n, threads)
        point = candidates.setdefault(key, {}).setdefault(binary, {}).setdefault(
            attempt, Point(op, n, threads, binary, wall))
        ordinal[key] = ordinal.get(key, -1) + 1
        point.reps.append(Rep(b["real_time"] * unit, b["cpu_time"] * unit,
                              int(b.get("iterations", 1)), b, (binary, attempt, rnd, ordinal[key])))
        point.names.add(b.get("run_name", name))


def load(files):
    """-> (points {(op, n, threads): Point}, contexts [(file, context)], errors [str]).
    A point measured again (a later try of bench/run.sh's re-measurement) is taken from its
    latest try only."""
    contexts, errors, candidates = [], [], {}
    for path in files:
        got = read_file(path, errors)
        if got is None:
            continue
        binary, attempt, rnd, context, entries = got
        contexts.append((os.path.basename(path), context))
        add_entries(candidates, binary, attempt, rnd, entries, errors)
    # The same operator may be measured by two binaries (causal flash in bench_reference and
    # bench_ovq): keep the better-sampled measurement.
    points = {}
    for key, by_binary in candidates.items():
        latest = [tries[max(tries)] for tries in by_binary.values()]
        points[key] = max(latest,
                          key=lambda p: (p.sampling()[0], sum(r.iterations for r in p.reps)))
    return points, contexts, errors


# ---- what the rows read from ---------------------------------------------------------------------

class Measurements:
    """The accessor a Target's value function receives. Every method raises Missing when the
    point is absent; the points a row read are in `used` (what a re-measurement re-runs)."""

    def __init__(self, points, contexts):
        self.points, self.contexts = points, contexts
        self.used = []

    def point(self, op, n=TARGET_N, threads=1):
        p = self.points.get((op, n, threads))
        if p is None:
            raise Missing(op, n, threads)
        if p not in self.used:
            self.used.append(p)
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

    def wall_time(self, op, n=TARGET_N, threads=1):
        return self.point(op, n, threads).wall_seconds()

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
        p = self.point(PEAK_OP, 0)
        q = p.flop_per_call() / p.seconds()
        # bench_peak runs in its own process: no pairs with another binary's repetitions.
        return Quantity(q.med, q.lo, q.hi, q.ok, q.why)

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
