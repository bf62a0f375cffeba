#!/usr/bin/python3
"""mixattn's PyTorch extension against eager PyTorch, float32, on one thread and on two.

    PYTHON bench/torch_ext_bench.py [--out FILE.json] [--threads 1,2] [--tokens 2048] [--main]
                                    [--only NAME,...]

PYTHON must import both torch and mixattn (bench/run.sh builds the extension into a virtual
environment with python/venv.sh and runs this with it). Measures, at (B, H, N) = (4, 8, 2048),
r = d_v = 64, K = 64:
  torch_ext_<impl>_{forward,fwd_bwd}_{bidir,causal}/2048   impl = mixattn (gma_attention),
        eager_gma (bench/torch_eager.py's gma_chunked on the whole batch: responsibilities as
        two matmuls per head, causal in 64-token chunks carrying the K x d_v prefix state, as
        eager linear attention is written; the broadcast form torch_eager.gma materialises
        B H N K r floats, 1 GiB per intermediate here, and took minutes per call),
        eager_gma_paper (torch_eager.gma_per_head: the paper's broadcast form, one (batch, head)
        pair at a time; fwd_bwd and the training step only, the two points with targets),
        softmax (scaled_dot_product_attention when torch has it, >= 2.0; else the eager
        softmax(Q K^T / sqrt(r) + mask) V)
  torch_ext_<impl>_step_causal/2048   one training step (forward, backward, Adam) of a
        2-layer causal language model, d_model 256, 4 heads (r = d_v = 64), K = 64, N = 2048,
        batch 4: the same model with mixattn.GaussianMixtureAttention, with eager GMA on the
        same parameters (either form), or with softmax attention.
--main (bench/run.sh's main job) measures forward+backward of mixattn and eager_gma alone.
Each thread count runs in its own process, with OMP/OpenBLAS threads set before torch loads
and torch.set_num_threads; one thread is pinned to one core (MIXATTN_BENCH_CPU, default the
last). Every case: one untimed call of each implementation, then one call of each in turn (A B A
B ...), at least --min-calls (3) times and for --min-time seconds; call i of each implementation
is written as its repetition i, so the summary takes eager over mixattn call pair by call pair
and shows the median and [min - max] of those ratios.
Times: CPU time of the calling thread on one thread, wall time on two (names end in
/real_time). Allocator: both sides run in the same process, so under the same policy: PyTorch's
CPU tensors (inputs, outputs, every eager intermediate) and the extension's working memory all
come from glibc malloc, with GLIBC_TUNABLES as bench/run.sh sets it for every other benchmark
(glibc's defaults unless MIXATTN_BENCH_MALLOC=keep; recorded in the context as "malloc").
Writes Google-Benchmark-style JSON for bench/summary.py. Exits 0 with a message when torch or
mixattn is missing. Most of the full set's time is in the paper's broadcast-form eager GMA (many
seconds per forward+backward call on one thread) and in eager softmax, whose N x N float tensors
are 512 MiB each.
"""

import argparse
import json
import os
import subprocess
import sys
import time

B, H, N, R, DV, K = 4, 8, 2048, 64, 64, 64
MODEL = dict(d_model=256, heads=4, vocab=256, layers=2, batch=4, tokens=2048)


def cases(main_job):
    """[(what, impls)]: what = '<kind>_<mode>' or 'step_causal'; the impls measured side by side.
    The main job: forward+backward of mixattn and the matmul-form eager GMA only."""
    out = []
    for mode in ("bidir", "causal"):
        for kind in (("fwd_bwd",) if main_job else ("forward", "fwd_bwd")):
            impls = ["mixattn", "eager_gma"] if main_job else \
                ["mixattn", "eager_gma", "eager_gma_paper", "softmax"]
            if kind == "forward":
                impls.remove("eager_gma_paper")  # seconds per call; measured where targets are
            out.append((f"{kind}_{mode}", impls))
    if not main_job:
        out.append(("step_causal", ["mixattn", "eager_gma", "eager_gma_paper", "softmax"]))
    return out


def point_name(impl, what, threads):
    return f"torch_ext_{impl}_{what}/{N}/threads:{threads}" + ("/real_time" if threads > 1 else "")


def child(threads, min_time, min_calls, main_job, only):
    """Runs every case on `threads` threads; returns the benchmark entries."""
    import torch
    import mixattn
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_eager

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(7)
    q, k, v, d_out = (torch.randn(B, H, N, d, generator=g) for d in (R, R, DV, DV))
    mix = (torch.randn(H, K, R, generator=g), torch.zeros(H, K, R), torch.zeros(H, K))
    ops = {
        "mixattn": lambda q, k, v, mix, causal: mixattn.gma_attention(q, k, v, *mix, causal=causal),
        "eager_gma": torch_eager.gma_chunked,
        "eager_gma_paper": torch_eager.gma_per_head,
        "softmax": torch_eager.softmax_attention,
    }
    entries = []
    for what, impls in cases(main_job):
        impls = [i for i in impls if not only or point_name(i, what, threads) in only]
        if not impls:
            continue
        if what == "step_causal":
            calls = {i: training_step(i, torch, mixattn, torch_eager) for i in impls}
        else:
            calls = {i: attention_call(torch, ops[i], what, (q, k, v, *mix), d_out) for i in impls}
        entries += record_side_by_side(what, calls, threads, min_time, min_calls)
    return entries


def attention_call(torch, op, what, tensors, d_out):
    kind, mode = what.rsplit("_", 1)
    causal = mode == "causal"
    leaves = [t.clone().requires_grad_(kind == "fwd_bwd") for t in tensors]

    def call():
        if kind == "forward":
            with torch.no_grad():
                return op(*leaves[:3], leaves[3:], causal)
        for t in leaves:
            t.grad = None
        op(*leaves[:3], leaves[3:], causal).backward(d_out)
    return call


def record_side_by_side(what, calls, threads, min_time, min_calls):
    """One untimed call of each side, then the sides one call each in turn (A B A B ...): call i
    of every side is repetition i, so the summary takes their ratios pair by pair, each pair
    measured seconds apart. At least min_calls pairs and min_time seconds of them."""
    for fn in calls.values():
        fn()  # the untimed call: allocator, first-call dispatch
    times = {impl: [] for impl in calls}
    t0 = time.perf_counter()
    while len(times[next(iter(calls))]) < min_calls or time.perf_counter() - t0 < min_time:
        for impl, fn in calls.items():
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            times[impl].append((time.perf_counter() - w0, time.thread_time() - c0))
    entries = []
    for impl, pairs in times.items():
        full = point_name(impl, what, threads)
        cpus = sorted(c for _, c in pairs)
        walls = sorted(w for w, _ in pairs)
        print(f"{full:55s} {cpus[len(cpus) // 2] * 1e3:10.1f} ms cpu "
              f"{walls[len(walls) // 2] * 1e3:10.1f} ms wall (median of {len(pairs)} calls)",
              file=sys.stderr, flush=True)
        for i, (w, c) in enumerate(pairs):  # one repetition per timed call
            entries.append({"name": full, "run_name": full, "run_type": "iteration",
                            "repetitions": len(pairs), "repetition_index": i, "iterations": 1,
                            "real_time": w * 1e3, "cpu_time": c * 1e3, "time_unit": "ms",
                            "N": N, "threads": threads, "worker_threads": threads,
                            "warm_up_calls": 1})
    return entries


def training_step(impl, torch, mixattn, torch_eager):
    """One Adam step of a 2-layer pre-norm causal LM whose attention is `impl`."""
    nn = torch.nn
    cfg = MODEL

    class EagerGma(mixattn.GaussianMixtureAttention):
        def forward(self, x):
            q, k, v = self._heads(x)
            return self._merge(torch_eager.gma_chunked(q, k, v, (self.mean, self.var_raw,
                                                                 self.prior_logit), self.causal))

    class EagerGmaPaper(mixattn.GaussianMixtureAttention):
        def forward(self, x):
            q, k, v = self._heads(x)
            return self._merge(torch_eager.gma_per_head(q, k, v, (self.mean, self.var_raw,
                                                                  self.prior_logit), self.causal))

    class Softmax(mixattn.GaussianMixtureAttention):  # the same projections, no mixture used
        def forward(self, x):
            q, k, v = self._heads(x)
            return self._merge(torch_eager.softmax_attention(q, k, v, None, True))

    attention = {"mixattn": mixattn.GaussianMixtureAttention, "eager_gma": EagerGma,
                 "eager_gma_paper": EagerGmaPaper, "softmax": Softmax}[impl]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["d_model"]
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = attention(d, cfg["heads"], K, causal=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    torch.manual_seed(0)  # the same initial weights for every impl
    model = nn.Sequential(nn.Embedding(cfg["vocab"], cfg["d_model"]),
                          *[Block() for _ in range(cfg["layers"])],
                          nn.LayerNorm(cfg["d_model"]), nn.Linear(cfg["d_model"], cfg["vocab"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(cfg["vocab"], (cfg["batch"], cfg["tokens"] + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]), y.reshape(-1))
        loss.backward()
        opt.step()

    return step


def set_tokens(n):
    global N
    N = MODEL["tokens"] = n


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "results", "torch_ext.json"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--min-time", type=float, default=None,
                    help="seconds of timed pairs per case beyond the 3 pairs (default 1, main 0)")
    ap.add_argument("--min-calls", type=int, default=3,
                    help="timed calls per point at least (the summary judges none below 3)")
    ap.add_argument("--tokens", type=int, default=N,
                    help="N of every case (default 2048; bench/summary.py reads only 2048: "
                         "another N is a smoke run of this script)")
    ap.add_argument("--main", action="store_true",
                    help="the main job's set: forward+backward, mixattn and the matmul-form "
                         "eager GMA")
    ap.add_argument("--only", default="",
                    help="comma-separated point names (torch_ext_<impl>_<what>/2048/threads:<t>"
                         "[/real_time]): measure these alone (a re-measurement)")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    set_tokens(args.tokens)
    min_time = args.min_time if args.min_time is not None else (0.0 if args.main else 1.0)
    only = set(n for n in args.only.split(",") if n)

    if args.child:
        json.dump(child(args.child, min_time, args.min_calls, args.main, only), sys.stdout)
        return 0
    try:
        import torch  # noqa: F401  (both must import; the children use them)
        import mixattn  # noqa: F401
    except ImportError as e:
        print(f"torch_ext_bench: {e} for {sys.executable}; skipping (bench/run.sh builds the "
              "extension when PyTorch is installed)")
        return 0

    entries = []
    for threads in (int(t) for t in args.threads.split(",")):
        if only and not any(f"/threads:{threads}" in n for n in only):
            continue
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(threads),
               "--min-time", str(min_time), "--min-calls", str(args.min_calls),
               "--tokens", str(N)] + (["--main"] if args.main else []) + \
              (["--only", args.only] if args.only else [])
        if threads == 1 and hasattr(os, "sched_getaffinity"):
            cpu = os.environ.get("MIXATTN_BENCH_CPU", str(max(os.sched_getaffinity(0))))
            cmd = ["taskset", "-c", cpu] + cmd
        print(f"== torch_ext_bench: {threads} thread(s)", flush=True)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True)
        entries += json.loads(proc.stdout)

    sys.path.insert(0, here)
    from torch_eager import HAS_SDPA, write_results
    write_results(args.out, "torch_ext_bench.py", entries,
                  softmax_impl=("scaled_dot_product_attention" if HAS_SDPA
                                else "eager softmax(QK^T/sqrt(r) + mask) V"),
                  shapes=f"B={B} H={H} N={N} r={R} d_v={DV} K={K}; model {MODEL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
