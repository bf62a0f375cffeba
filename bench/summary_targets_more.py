"""Target rows of bench/summary.py, continued: decoding (bench_decode), the linear baselines and
the sliding window (bench_linear, bench_reference), and the training shapes (bench_training).
See summary_targets.py for how a row is written."""

from summary_data import Missing, TARGET_N, all_of, fmt_time
from summary_rules import Target, thread_bound, thread_speedup

N = TARGET_N

# ---- decoding (bench_decode.cpp): one token per call at position P -------------------------------

DECODE_POSITIONS = (1024, 8192, 32768)


def decode_latency(op, p):
    """Mean seconds per token at position p, shown with the p99 and the max beside it."""
    def value(m):
        mean, p99, mx = (m.counter(op, c, p) for c in ("mean_s", "p99_s", "max_s"))
        return all_of([mean, p99, mx], mean.med, mean.lo, mean.hi,
                      text=f"{fmt_time(mean.med)} (p99 {fmt_time(p99.med)}, "
                           f"max {fmt_time(mx.med)})")
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
    return all_of(qs, worst, text=fmt_time(worst))


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
    text = (f"{worst:.2f}× (each token's best of {passes:.0f} passes; "
            f"one pass's max {fmt_time(raw)}")
    if m.ns("decode_noise"):
        noise = m.counter("decode_noise", "max_s", m.ns("decode_noise")[0])
        mean = m.counter("decode_noise", "mean_s", m.ns("decode_noise")[0])
        text += f"; {fmt_time(mean.med)} of plain arithmetic has max {fmt_time(noise.med)}"
    return all_of(qs, worst, text=text + ")")


def softmax_vs_gma(p):
    """Softmax-with-KV-cache decode time per token over GMA's, shown with softmax's latency."""
    def value(m):
        mean, p99, mx = (m.counter("decode_softmax_kv", c, p) for c in ("mean_s", "p99_s", "max_s"))
        q = mean / m.counter("decode_gma", "mean_s", p)
        q.text = (f"{q.med:.1f}× (softmax {fmt_time(mean.med)}, p99 {fmt_time(p99.med)}, "
                  f"max {fmt_time(mx.med)})")
        return q
    return value


DECODE_TARGETS = [
    *[Target(f"GMA decode, mean per token at position {p} (p99, max)",
             decode_latency("decode_gma", p), ("<=", 2e-6), fmt=fmt_time)
      for p in DECODE_POSITIONS],
    Target("GMA decode: mean per token at the last position / at 1024",
           decode_flatness("decode_gma"), ("<=", 1.25)),
    *[Target(f"OVQ decode (full 1024-entry dictionary), mean per token at position {p} (p99, max)",
             decode_latency("decode_ovq", p), ("<=", 10e-6), fmt=fmt_time)
      for p in DECODE_POSITIONS],
    Target("OVQ decode: slowest block-completing token", ovq_block_worst, ("<=", 1e-3),
           fmt=fmt_time),
    Target("OVQ decode: slowest token after a block completion / mean", ovq_after_block_ratio,
           ("<=", 2)),
    *[Target(f"softmax+KV cache decode / GMA decode, per token at position {p}",
             softmax_vs_gma(p), (">=", 1)) for p in DECODE_POSITIONS],
]


def floor_ratio(op):
    return lambda m: m.time(op) / m.time("floor_" + op)


def window_per_token(op):
    return lambda m: (m.time(op, 8192) / 8192) / (m.time(op, 2048) / 2048)


# Linear attention (bench_linear, SPEC §4): its floor is GMA's GEMMs with K = r features and no
# responsibilities; its causal form runs GMA's scan, with elementwise features instead of Γ.
LINEAR_TARGETS = [
    *[Target(f"linear attention {mode} {label} / its GEMM floor (N={N})",
             floor_ratio(f"linear_{kind}_{mode}"), ("<=", 1.5))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))
      for mode in ("bidir", "causal")],
    Target(f"linear attention causal forward / GMA causal forward, r = K = 64 (N={N})",
           lambda m: m.time("linear_forward_causal") / m.time("gma_forward_causal"), ("<=", 1)),
    # Performer (bench_linear, SPEC §5): the same read/write with m = 256 random features, plus
    # the feature projections X Wᵀ (and, backward, the exponents' gradient times W) in its floor.
    *[Target(f"Performer {mode} {label} / its GEMM floor (N={N})",
             floor_ratio(f"performer_{kind}_{mode}"), ("<=", 1.5))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))
      for mode in ("bidir", "causal")],
    # Static-codebook VQ attention (bench_linear, SPEC §6): S = 64 one-hot code features on the
    # same read/write, the code GEMMs and, backward, the per-code straight-through states.
    *[Target(f"VQ attention {mode} {label} / its GEMM floor (N={N})",
             floor_ratio(f"vq_{kind}_{mode}"), ("<=", 1.5))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))
      for mode in ("bidir", "causal")],
    # Sliding-window attention (bench_reference, SPEC §7): the tiled kernels skip every key tile
    # outside the window, so a token costs O(w), whatever N. Per-token time at the longest N over
    # the shortest (the edge tiles' share shrinks with N, so above 1 means work that grows with N);
    # and at N = 4096 the w = 256 band holds 1/8.2 of full causal attention's (query, key) pairs.
    *[Target(f"sliding window (w = 256) {label}: time per token at N = 8192 / at N = 2048",
             window_per_token(f"flash_window256_{kind}_causal"), ("<=", 1.25))
      for kind, label in (("forward", "forward"), ("fwd_bwd", "fwd+bwd"))],
    Target(f"sliding window (w = 256) causal forward / flash causal forward (N={N})",
           lambda m: m.time("flash_window256_forward_causal") / m.time("flash_forward_causal"),
           ("<=", 0.25)),
]


# ---- training shapes (bench_training.cpp) --------------------------------------------------------
# B·H (batch, head) pairs per call, every pair's inputs distinct, forward_into + backward_into with
# records reused (the "step"); FLOPs: GMA's forward N·K·(8r + 4 d_v) per pair, causal counted the
# same, a step 3× its forward; the others as bench/ counts them (their GEMM floors). Fraction of
# the FMA peak against the probe beside each one-thread repetition.

def training_op(pairs, op, kind):
    return f"bh{pairs}_{op}_{kind}"


TRAINING_TARGETS = [
    *[Target(f"{label}, {pairs} × {'T' if 'ovq' in op else 'N'} = {n}, fraction of FMA peak",
             (lambda o, n: lambda m: m.fraction_of_peak(o, n))(training_op(pairs, op, kind), n),
             (">=", goal), bound=(0, 1), fmt="fraction")
      for label, pairs, op, kind, n, goal in (
          ("GMA bidir training step", 32, "gma_bidir", "step", 2048, 0.70),
          ("GMA bidir forward", 32, "gma_bidir", "forward", 2048, 0.75),
          ("GMA causal training step", 32, "gma_causal", "step", 2048, 0.60),
          ("GMA causal forward", 32, "gma_causal", "forward", 2048, 0.65),
          ("OVQ training step", 8, "ovq", "step", 8192, 0.55),
          ("flash (bidir) training step", 8, "flash_bidir", "step", 2048, 0.65))],
    Target("GMA bidir training step, 32 × N = 2048, 2 threads vs 1",
           thread_speedup(training_op(32, "gma_bidir", "step"), n=2048), (">=", 1.85),
           bound=thread_bound(2)),
]
