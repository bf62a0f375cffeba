#!/usr/bin/python3
"""mixattn's PyTorch extension against what a torch 2.13 user would pick instead, float32, on 1
and 2 threads (docs/benchmarking.md, "PyTorch 2.13: against what a PyTorch user would pick",
holds the targets).

    PYTHON bench/torch_vs_pytorch.py [--out FILE.json] [--threads 1,2] [--min-time S]
                                     [--min-calls N] [--only SUBSTRING,...]

PYTHON must import torch and mixattn (build/venv/bin/python after python/venv.sh). Pairs, each
side called in turn (A B A B ...) after one untimed call of each (for torch.compile: after its
compilation), the ratio taken call pair by call pair (median, [min - max]):
  sdpa_{forward,fwd_bwd}_{bidir,causal}      mixattn.flash_attention vs
        F.scaled_dot_product_attention, (B, H, N, d) = (4, 8, 2048, 64)
  gma_fwd_bwd_{bidir,causal}                 mixattn.gma_attention vs GMA in matmul form
        (bench/torch_eager.py's gma_chunked: the log-density expanded into products, causal
        through cumulative sums of chunk states) under torch.compile, and the same code eager;
        K = 64
  lm_step                                    one Adam step of a 2-layer pre-norm causal LM
        (d_model 256, 4 heads, vocab 256, N 2048, batch 4), every model under torch.compile:
        with mixattn.GaussianMixtureAttention, with the matmul-form GMA, with SDPA
  ovq_forward_65536                          mixattn.ovq_attention (block 256, 1024 centroids)
        vs causal SDPA, (1, 1, 65536, 64), forward
Times: wall clock of each call (time.perf_counter). Each thread count runs in a process of its
own, with OMP_NUM_THREADS set before torch loads and torch.set_num_threads. Writes the pairs'
times as JSON (--out) and prints the ratios with their targets.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
B, H, N, D, K = 4, 8, 2048, 64, 64
MODEL = dict(d_model=256, heads=4, vocab=256, layers=2, batch=4, tokens=2048)
OVQ_T = 65536

# (pair, other side, target): the ratio is the other side's time over mixattn's.
TARGETS = [
    *[(f"sdpa_{kind}_{mode}", "sdpa", 1.0) for kind in ("forward", "fwd_bwd")
      for mode in ("bidir", "causal")],
    ("gma_fwd_bwd_bidir", "compiled", 2.0), ("gma_fwd_bwd_bidir", "eager", None),
    ("gma_fwd_bwd_causal", "compiled", 4.0), ("gma_fwd_bwd_causal", "eager", None),
    ("lm_step", "compiled_gma", 1.5), ("lm_step", "sdpa", None),
    ("ovq_forward_65536", "sdpa", 10.0),
]


def pair_calls(name, torch, mixattn, torch_eager):
    """{side: call} of one pair; "mixattn" is one side of every pair."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(7)
    if name.startswith("sdpa_"):
        kind, mode = name[len("sdpa_"):].rsplit("_", 1)
        causal = mode == "causal"
        leaves = [torch.randn(B, H, N, D, generator=g).requires_grad_(kind == "fwd_bwd")
                  for _ in range(3)]
        d_out = torch.randn(B, H, N, D, generator=g)
        ops = {"mixattn": lambda q, k, v: mixattn.flash_attention(q, k, v, causal=causal),
               "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        return {side: attention_call(torch, op, leaves, d_out, kind == "forward")
                for side, op in ops.items()}
    if name.startswith("gma_"):
        causal = name.endswith("causal")
        leaves = [torch.randn(B, H, N, D, generator=g) for _ in range(3)]
        leaves += [torch.randn(H, K, D, generator=g), torch.zeros(H, K, D), torch.zeros(H, K)]
        leaves = [t.requires_grad_() for t in leaves]
        d_out = torch.randn(B, H, N, D, generator=g)
        matmul = lambda q, k, v, *mix: torch_eager.gma_chunked(q, k, v, mix, causal)  # noqa: E731
        ops = {"mixattn": lambda *x: mixattn.gma_attention(*x, causal=causal),
               "compiled": torch.compile(matmul), "eager": matmul}
        return {side: attention_call(torch, op, leaves, d_out, False) for side, op in ops.items()}
    if name == "lm_step":
        return {side: training_step(side, torch, mixattn, torch_eager)
                for side in ("mixattn", "compiled_gma", "sdpa")}
    if name == "ovq_forward_65536":
        q, k, v = (torch.randn(1, 1, OVQ_T, D, generator=g) for _ in range(3))
        beta = torch.ones(1)

        def ovq():
            with torch.no_grad():
                mixattn.ovq_attention(q, k, v, beta, block=256, max_centroids=1024)

        def sdpa():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return {"mixattn": ovq, "sdpa": sdpa}
    raise ValueError(name)


def attention_call(torch, op, leaves, d_out, forward_only):
    def call():
        if forward_only:
            with torch.no_grad():
                return op(*leaves)
        for t in leaves:
            t.grad = None
        op(*leaves).backward(d_out)
    return call


def training_step(side, torch, mixattn, torch_eager):
    """One Adam step of a 2-layer pre-norm causal LM whose attention is `side`'s, compiled."""
    nn = torch.nn
    cfg = MODEL

    class MatmulGma(mixattn.GaussianMixtureAttention):
        def forward(self, x):
            q, k, v = self._heads(x)
            return self._merge(torch_eager.gma_chunked(q, k, v, (self.mean, self.var_raw,
                                                                 self.prior_logit), True))

    class Sdpa(mixattn.GaussianMixtureAttention):  # the same projections, no mixture used
        def forward(self, x):
            q, k, v = self._heads(x)
            return self._merge(nn.functional.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=True))

    attention = {"mixattn": mixattn.GaussianMixtureAttention, "compiled_gma": MatmulGma,
                 "sdpa": Sdpa}[side]

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

    torch.manual_seed(0)  # the same initial weights for every side
    model = nn.Sequential(nn.Embedding(cfg["vocab"], cfg["d_model"]),
                          *[Block() for _ in range(cfg["layers"])],
                          nn.LayerNorm(cfg["d_model"]), nn.Linear(cfg["d_model"], cfg["vocab"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(cfg["vocab"], (cfg["batch"], cfg["tokens"] + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    forward = torch.compile(model)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = forward(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]), y.reshape(-1))
        loss.backward()
        opt.step()
    return step


def side_by_side(calls, min_time, min_calls):
    """One untimed call of each side, then one call of each in turn: {side: [seconds]}."""
    for call in calls.values():
        call()
    times = {side: [] for side in calls}
    start = time.perf_counter()
    while len(times["mixattn"]) < min_calls or time.perf_counter() - start < min_time:
        for side, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[side].append(time.perf_counter() - t0)
    return times


def child(threads, min_time, min_calls, only):
    import torch
    import mixattn
    sys.path.insert(0, HERE)
    import torch_eager

    torch.set_num_threads(threads)
    results = {}
    for name in dict.fromkeys(t[0] for t in TARGETS):
        if only and not any(o in name for o in only):
            continue
        calls = pair_calls(name, torch, mixattn, torch_eager)
        results[name] = side_by_side(calls, min_time, min_calls)
        print(f"  {threads} thread(s) {name}: " + ", ".join(
            f"{s} {statistics.median(t) * 1e3:.1f} ms" for s, t in results[name].items()),
            file=sys.stderr, flush=True)
    return results


def table(runs):
    lines = ["| pair | other side | threads | ratio (median [min - max]) | target | met |",
             "|---|---|---|---|---|---|"]
    for name, other, target in TARGETS:
        for threads, results in sorted(runs.items()):
            if name not in results:
                continue
            t = results[name]
            ratios = [o / m for o, m in zip(t[other], t["mixattn"])]
            med = statistics.median(ratios)
            verdict = "report" if target is None else ("yes" if min(ratios) >= target else
                                                       "no" if max(ratios) < target else
                                                       "median " + ("yes" if med >= target else
                                                                    "no"))
            lines.append(f"| {name} | {other} | {threads} | {med:.2f}x [{min(ratios):.2f} - "
                         f"{max(ratios):.2f}] | {'-' if target is None else f'>= {target}x'} "
                         f"| {verdict} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--min-time", type=float, default=3.0)
    ap.add_argument("--min-calls", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated substrings of pair names")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    if args.child:
        json.dump(child(args.child, args.min_time, args.min_calls, only), sys.stdout)
        return
    runs = {}
    for threads in (int(t) for t in args.threads.split(",")):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        out = subprocess.run([sys.executable, __file__, "--child", str(threads), "--min-time",
                              str(args.min_time), "--min-calls", str(args.min_calls), "--only",
                              args.only], env=env, stdout=subprocess.PIPE, check=True)
        runs[threads] = json.loads(out.stdout)
    import torch
    context = dict(torch=torch.__version__, python=sys.version.split()[0],
                   executable=sys.executable, date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                  time.gmtime()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(context=context, runs=runs), f, indent=1)
    print(f"torch {context['torch']}, {context['date']}")
    print(table(runs))


if __name__ == "__main__":
    main()
