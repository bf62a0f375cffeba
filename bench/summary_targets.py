"""The target rows of bench/summary.py: what is measured, its goal, its physical bound.

Adding a target row: append a Target (summary_rules.py) to the list of its group. Its `value`
receives a Measurements object `m` (summary_data.py) and returns a Quantity: m.time(op, n,
threads), m.cpu_time(...), m.wall_time(...), m.counter(op, name, n, threads), m.rate(op, n)
(FLOP/s), m.fraction_of_peak(op, n), m.peak_flops(), m.heap(op, n), combined with + - * / and
numbers. A missing point raises Missing, which the rules turn into a verdict; a point's sampling
state travels with the Quantity, and so do its repetitions: the ratio of two points measured in
the same processes is taken pair by pair. For example:

    Target("GMA causal decode: p99 latency per token at position 65536",
           lambda m: m.counter("decode_gma_causal", "p99_s", 65536),
           ("<=", 20e-6), fmt=lambda x: f"{x * 1e6:.1f} µs")

Mark a row full_only=True when only bench/run.sh --full measures its points (the main job's
benchmark filters are in bench/run.sh). A new benchmark binary also gets a line in PRODUCERS
(which binary writes which operator), so a build failure is told apart from a missing benchmark.
"""

import math

from summary_data import Missing, TARGET_N, all_of, fmt_bytes, fmt_time
from summary_rules import Target, thread_bound, thread_speedup
from summary_targets_more import DECODE_TARGETS, LINEAR_TARGETS, TRAINING_TARGETS

N = TARGET_N
T_OVQ = 65536
PACKED_TOKENS = sum(range(512, 4097, 512))  # bench_batched: gma_packed_fwd_bwd's total rows
LAYER_TOKENS = 2 * 1024  # bench_batched: layer_train_step, B = 2 sequences of 1024


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
    if len(ns) < 2:
        raise Missing("flash_forward_bidir", "a sweep over N")
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


def torch_blas_checked(m, q):
    """PyTorch's matmuls are only as fast as the BLAS it loaded: against the reference BLAS
    (libblas3, which can win the loader's search when both it and OpenBLAS are installed) a
    ratio says nothing about the operators, so no verdict."""
    blas = m.context("torch_blas") or ""
    if not any(fast in blas.lower() for fast in ("openblas", "mkl", "blis")):
        q.refuse("reference BLAS", f"PyTorch loaded {blas or 'an unknown BLAS'}; install "
                                   "libopenblas0-pthread and make it the libblas.so.3 "
                                   "PyTorch loads")
    return q


def torch_ratio(torch_op, op):
    """PyTorch eager time over mixattn's (the side-by-side, N = 4096)."""
    return lambda m: torch_blas_checked(m, m.time(torch_op) / m.time(op))


def torch_ext_ratio(torch_op, op, threads):
    """The extension's benchmark (N = 2048): eager PyTorch's time over mixattn's on `threads`
    threads, call by call (the script alternates the two), with torch_ratio's BLAS rule."""
    def value(m):
        return torch_blas_checked(m, m.time(torch_op, TORCH_EXT_N, threads)
                                  / m.time(op, TORCH_EXT_N, threads))
    return value


def floor_ratio(op):
    return lambda m: m.time(op) / m.time("floor_" + op)


CORE_TARGETS = [
    Target(f"GMA bidir forward / its GEMM floor (N={N})", floor_ratio("gma_forward_bidir"),
           ("<=", 1.5)),
    Target(f"flash_forward / GMA bidir forward (N={N})",
           lambda m: m.time("flash_forward_bidir") / m.time("gma_forward_bidir"), (">=", 12)),
    Target(f"GMA bidir fwd+bwd / its GEMM floor (N={N})", floor_ratio("gma_fwd_bwd_bidir"),
           ("<=", 1.5)),
    Target(f"GMA causal forward / GMA bidir forward (N={N})",
           lambda m: m.time("gma_forward_causal") / m.time("gma_forward_bidir"), ("<=", 2.5)),
    Target("GMA bidir forward faster than flash_forward", crossover, ("<=", 512),
           bound=(None, None), fmt=lambda x: f"N = {x:g}", goal_text="from N ≤ 512",
           full_only=True),
    Target(f"responsibilities / one (N×2r)·(2r×K) GEMM (N={N})",
           floor_ratio("gma_responsibilities"), ("<=", 1.5)),
    Target(f"flash_forward fraction of the GEMM rate (N={N})",
           lambda m: m.time("floor_softmax_forward_bidir") / m.time("flash_forward_bidir"),
           (">=", 0.5), fmt="percent"),
    Target(f"causal flash_forward / OVQ forward (T={T_OVQ})",
           lambda m: m.time("flash_forward_causal", T_OVQ) / m.time("ovq_forward", T_OVQ),
           (">=", 10), full_only=True),
    Target("OVQ forward time per token, T = 16384 … 262144, vs T = 16384", per_token_drift,
           ("within", -0.25, 0.25), bound=(None, None), fmt=lambda x: f"{x:+.0%}",
           goal_text="within ±25%", full_only=True),
    *[Target(f"peak extra heap growth of {op}, N = 16384 → 65536", heap_growth(op),
             ("<=", 4.5), full_only=True)
      for op in ("gma_fwd_bwd_bidir", "gma_fwd_bwd_causal", "ovq_forward")],
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
]

TORCH_TARGETS = [
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
    # at a time (eager_gma_paper, seconds per call: the full run only), and the matmul form eager
    # linear attention is written in (eager_gma, chunked when causal), the stronger of the two.
    *[Target(f"PyTorch eager GMA ({form}) fwd+bwd / mixattn.gma_attention, {mode}, B·H = 32, "
             f"N = 2048, {threads} thread{'s' if threads > 1 else ''}",
             torch_ext_ratio(f"torch_ext_{impl}_fwd_bwd_{mode}",
                             f"torch_ext_mixattn_fwd_bwd_{mode}", threads),
             (">=", 10), optional=TORCH_EXT, full_only=impl == "eager_gma_paper")
      for impl, form in TORCH_EXT_EAGER for mode in ("bidir", "causal") for threads in (1, 2)],
    *[Target(f"2-layer causal LM training step, eager-GMA ({form}) model / mixattn modules "
             f"(d_model 256, N = 2048, batch 4), {threads} thread{'s' if threads > 1 else ''}",
             torch_ext_ratio(f"torch_ext_{impl}_step_causal", "torch_ext_mixattn_step_causal",
                             threads),
             (">=", 3), optional=TORCH_EXT, full_only=True)
      for impl, form in TORCH_EXT_EAGER for threads in (1, 2)],
]

THREAD_TARGETS = [
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
]

TARGETS = [*CORE_TARGETS, *TORCH_TARGETS, *THREAD_TARGETS, *DECODE_TARGETS, *LINEAR_TARGETS,
           *TRAINING_TARGETS]

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
    ("bh", ["bench_training"]),
    ("torch_ext_", ["torch_ext"]),
    ("torch_", ["torch_side_by_side"]),
]


def producers(op):
    return next((b for prefix, b in PRODUCERS if op.startswith(prefix)), [])
