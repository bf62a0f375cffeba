"""The verdict rules of bench/summary.py: what a target row is, and how a measured value becomes
"met", "NOT MET", no verdict, or a value that cannot be trusted.

  - a row built from a cold point (no untimed call first) or from a point with fewer than 3
    repetitions and fewer than 3 iterations gives no verdict ("too few samples");
  - a value whose whole spread lies beyond its physical bound (a speed-up on p threads above
    p × SUPERLINEAR, a fraction of the FMA peak above 1) is impossible: bench/run.sh measures its
    points again (up to 3 times); if it stays impossible the row reads "unreliable (noise: …)"
    and counts as neither met nor missed, unless the run is --strict, where it reads
    "impossible: measurement error" and fails the summary;
  - a value whose median lies beyond the bound but whose spread reaches back within it is noise
    around a value at the bound: measured again too, then "at the physical bound: no verdict";
  - a ratio taken pair by pair whose per-pair values spread by more than NOISE (max / min) with
    the goal inside that spread has a verdict that depends on which pair one believes: measured
    again, then "unreliable (noise: …)" (--strict: a failure);
  - a target whose benchmark is missing fails the summary, unless its binary did not build, the
    run was filtered, the row is optional (PyTorch), or the row belongs to the full run only and
    this is the main job.
"""

from summary_data import Missing, fmt_time, spread_text

# How far above p a speed-up on p threads can physically go: p threads bring p private L1 and L2
# caches, so each thread's share of the work can run a little faster than the same work on one
# thread. Beyond this, the measurement is wrong (a disturbed or cold one-thread run).
SUPERLINEAR = 1.05
BUSY = 1.15  # one thread's wall time over its CPU time above which it did not have a core
# The widest spread (max / min - 1) of per-pair values a verdict may rest on when the goal lies
# inside it: pairs measured seconds apart in one process agree within a few percent on an idle
# machine.
NOISE = 0.10


class Target:
    """One verdict row.

    name      what is measured (the row's first column)
    value     function(Measurements) -> Quantity (raise Missing via m.* when data is absent)
    goal      ("<=", x), (">=", x) or ("within", lo, hi): judged on the median
    bound     (lo, hi) physical limits of the value (either may be None), or a function
              (Measurements) -> (lo, hi); outside them the value cannot be a measurement
    fmt       "ratio" (1.23×), "fraction" (0.61), "percent" (61%), or a function(x) -> str
    optional  None, or why the row may be absent without failing (e.g. an opt-in run)
    goal_text how to state the goal, when the default ("≥ 1.7×") does not read well
    full_only True for a row that only bench/run.sh --full measures (a sweep over N, the
              largest sizes): the main job leaves it out
    """

    def __init__(self, name, value, goal, bound=(0, None), fmt="ratio", optional=None,
                 goal_text=None, full_only=False):
        self.name, self.value, self.goal, self.bound = name, value, goal, bound
        self.fmt, self.optional, self._goal_text = fmt, optional, goal_text
        self.full_only = full_only

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

    def thresholds(self):
        return self.goal[1:]


def thread_bound(threads):
    """A speed-up on `threads` threads cannot exceed the threads (nor the machine's cores) by more
    than private caches allow (SUPERLINEAR)."""
    return lambda m: (0, SUPERLINEAR * min(threads, m.num_cpus() or threads))


def thread_speedup(op, threads=2, n=4096):
    """One thread's CPU time over `threads` threads' wall time, pair by pair (both run in one
    process, one after the other). On a busy machine the one-thread CPU time does not grow and
    the multi-thread wall time can only grow, so load can lower the ratio but never lift it
    above the thread count; when the one-thread run itself did not get a whole core (wall time
    over CPU time above BUSY), the other cores were not free either: no verdict."""
    def value(m):
        one_cpu, one_wall = m.cpu_time(op, n, 1), m.wall_time(op, n, 1)
        q = one_cpu / m.time(op, n, threads)
        stretch = one_wall.med / one_cpu.med
        if stretch > BUSY:
            q.refuse("machine busy",
                     f"the 1-thread run got {1 / stretch:.0%} of a core "
                     f"(wall {fmt_time(one_wall.med)}, CPU {fmt_time(one_cpu.med)})")
        return q
    return value


# ---- judging -------------------------------------------------------------------------------------

class Row:
    """A judged target. state: met, missed, none (no verdict), unreliable, missing, absent (not
    measured, not an error). retry: the row's points should be measured again (noise)."""

    def __init__(self, name, measured, goal, verdict, state, fails=False, note="", retry="",
                 points=()):
        self.name, self.measured, self.goal = name, measured, goal
        self.verdict, self.state, self.fails, self.note = verdict, state, fails, note
        self.retry, self.points = retry, list(points)


def missing_row(target, e, producers, not_built, partial, main_job):
    built_missing = [b for b in producers(e.op) if b in not_built]
    goal = target.goal_text()
    if built_missing:
        return Row(target.name, "not measured", goal,
                   f"not measured ({', '.join(built_missing)} did not build)", "absent")
    if target.optional:
        return Row(target.name, "not measured", goal, f"not measured ({target.optional})", "absent")
    if partial:
        return Row(target.name, "not measured", goal, "not measured (filtered run)", "absent")
    if main_job and target.full_only:
        return None  # the main job does not measure it: the row is left out
    return Row(target.name, "missing", goal, f"MISSING: {e}", "missing", fails=True)


def beyond_bound(target, q, bound):
    """None, or (impossible, text) when the median lies beyond the physical bound."""
    lo, hi = bound
    if not ((lo is not None and q.med < lo) or (hi is not None and q.med > hi)):
        return None
    limit = f"above {target.format(hi)}" if hi is not None and q.med > hi else \
        f"below {target.format(lo)}"
    # Impossible when every pairing of the repetitions lies beyond the bound. A median past it
    # whose spread reaches back within it is what noise does to a value at the bound.
    impossible = (lo is not None and q.hi < lo) or (hi is not None and q.lo > hi)
    return impossible, limit


def noisy(target, q):
    """The per-pair spread's width when it is too wide for the verdict to rest on, else None."""
    if not q.paired or q.lo <= 0 or q.hi / q.lo - 1 <= NOISE:
        return None
    if not any(q.lo < t < q.hi for t in target.thresholds()):
        return None  # the whole spread is on one side of the goal: the verdict holds
    return q.hi / q.lo - 1


def judge_value(target, q, bound, strict, points):
    """The row of a measured value q (rules in the module's docstring)."""
    measured = q.text or (target.format(q.med) + spread_text(q, target.format))
    goal = target.goal_text()
    spread = f"{target.format(q.lo)} – {target.format(q.hi)}"
    past = beyond_bound(target, q, bound)
    if past and past[0]:
        why = f"{target.format(q.med)} is {past[1]}, the physical bound"
        if strict:
            return Row(target.name, measured, goal, "impossible: measurement error", "unreliable",
                       fails=True, note=why, retry=why, points=points)
        return Row(target.name, measured, goal, f"unreliable (noise: {why}; spread {spread})",
                   "unreliable", retry=why, points=points)
    if past:
        why = (f"the median {target.format(q.med)} is {past[1]}, the physical bound, "
               "within its spread")
        return Row(target.name, measured, goal, "at the physical bound: no verdict", "none",
                   note=why, retry=why, points=points)
    if not q.ok:
        return Row(target.name, measured, goal, q.refusal, "none", note=q.why)
    width = noisy(target, q)
    if width is not None:
        why = f"pairs spread {spread} ({width:.0%} apart) around the goal {goal}"
        return Row(target.name, measured, goal, f"unreliable (noise: {why})", "unreliable",
                   fails=strict, retry=why, points=points)
    met = target.met(q.med)
    return Row(target.name, measured, goal, "met" if met else "NOT MET", "met" if met else "missed")


def judge(target, m, opts, producers):
    """opts: not_built (set), partial, main_job, strict."""
    m.used = []
    try:
        q = target.value(m)
    except Missing as e:
        return missing_row(target, e, producers, opts["not_built"], opts["partial"],
                           opts["main_job"])
    except ZeroDivisionError:
        return Row(target.name, "a zero time or count", target.goal_text(),
                   "impossible: measurement error", "unreliable", fails=True)
    bound = target.bound(m) if callable(target.bound) else target.bound
    return judge_value(target, q, bound, opts["strict"], list(m.used))


def judge_all(targets, m, producers, not_built=(), partial=False, main_job=False, strict=False):
    opts = dict(not_built=set(not_built), partial=partial, main_job=main_job, strict=strict)
    rows = [judge(t, m, opts, producers) for t in targets]
    return [r for r in rows if r is not None]
