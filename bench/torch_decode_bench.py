#!/usr/bin/python3
"""Decoding from PyTorch against the library's own decoding, side by side in one process.

    PYTHON bench/torch_decode_bench.py [--rounds 10] [--tokens 256] [--threads 1]
                                       [--cpu N] [--out FILE.json]

PYTHON must import torch and mixattn (the extension built by python/venv.sh, e.g. build/venv/
bin/python). One token per call, float32, r = d_v = 64, one batch entry, 8 heads:
  ovq  ovq_attention(..., cache=OvqCache) with block 256, max_centroids 1024 and linear growth,
       after a 2048-token prefill (the dictionary is full from token 1024 on, as in
       bench/bench_decode.cpp's decode_ovq), against ovq::forward continuing an ovq::State on
       one head (mixattn._C.testing.ovq_decode_seconds, the same loop as decode_ovq);
  gma  gma_attention(..., causal=True, cache=GmaCache) with K = 64 after a 1024-token prefill,
       against gma::forward on a gma::Prepared continuing a gma::State on one head
       (mixattn._C.testing.gma_decode_seconds, as decode_gma).
Three sides alternate, A B C A B C, --rounds times, each decoding the same --tokens positions:
  A  the library, head after head (each one-token call timed in C++, steady_clock): the C++
     per-head time, each head's state hot in the core's caches (bench_decode's loop);
  B  the library, all 8 heads per timed step (one call per head for the same token, timed
     together in C++): what the Python call does without Python, the 8 states taking turns in
     the caches (a full OVQ dictionary is 512 KiB at r = d_v = 64);
  C  one Python call per token for all 8 heads, timed with time.perf_counter around it (the
     Python call, the argument checks and the output tensor included), from a copy of the
     same prefilled cache.
Reported: each side's median per call over all rounds, the range of the rounds' medians, and
the target's verdict
    C <= 1.3 x 8 x A + 20 us
with C / B, what the Python door adds to the library's own 8-head decode. Medians, not means:
every 256th OVQ token completes a block (the dictionary's update), a slow call that every side
takes at the same positions. Run it on a quiet machine; --cpu pins the process to one core
(with --threads 1).
"""

import argparse
import json
import os
import statistics
import sys
import time

HEADS, R, DV, K = 8, 64, 64, 64
OVQ_PREFILL, GMA_PREFILL = 2048, 1024
OVQ_OPTIONS = dict(block=256, max_centroids=1024, growth="linear")


def per_token(x):
    """(1, H, T, d) -> T contiguous (1, H, 1, d) tensors, as a model's projection of one token
    gives them."""
    return [t.unsqueeze(2).contiguous() for t in x.unbind(2)]


def ovq_case(torch, mixattn, tokens):
    gen = torch.Generator().manual_seed(1)
    T = OVQ_PREFILL + tokens
    q, k, v = (torch.randn(1, HEADS, T, d, generator=gen) for d in (R, R, DV))
    beta = torch.ones(HEADS)
    config = mixattn._C.OvqConfig(OVQ_OPTIONS["block"], OVQ_OPTIONS["max_centroids"], "linear",
                                  0.0, "greedy_dispersion", "all_centroids", True, True, 1e-5,
                                  True)
    prefilled = mixattn.OvqCache()
    with torch.no_grad():
        mixattn.ovq_attention(q[:, :, :OVQ_PREFILL], k[:, :, :OVQ_PREFILL],
                              v[:, :, :OVQ_PREFILL], beta, cache=prefilled, **OVQ_OPTIONS)
    steps = list(zip(*(per_token(x[:, :, OVQ_PREFILL:]) for x in (q, k, v))))

    def cpp(all_heads):
        return mixattn._C.testing.ovq_decode_seconds(q[0], k[0], v[0], 1.0, config, OVQ_PREFILL,
                                                     all_heads)

    def python():
        cache, seconds = prefilled.copy(), []
        with torch.no_grad():
            for qt, kt, vt in steps:
                t0 = time.perf_counter()
                mixattn.ovq_attention(qt, kt, vt, beta, cache=cache, **OVQ_OPTIONS)
                seconds.append(time.perf_counter() - t0)
        return seconds
    return cpp, python


def gma_case(torch, mixattn, tokens):
    gen = torch.Generator().manual_seed(2)
    T = GMA_PREFILL + tokens
    q, k, v = (torch.randn(1, HEADS, T, d, generator=gen) for d in (R, R, DV))
    mean = torch.randn(HEADS, K, R, generator=gen)  # the library's Mixture::random: N(0, 1)
    var_raw, prior = torch.zeros(HEADS, K, R), torch.zeros(HEADS, K)
    prefilled = mixattn.GmaCache()
    with torch.no_grad():
        mixattn.gma_attention(q[:, :, :GMA_PREFILL], k[:, :, :GMA_PREFILL],
                              v[:, :, :GMA_PREFILL], mean, var_raw, prior, causal=True,
                              cache=prefilled)
    steps = list(zip(*(per_token(x[:, :, GMA_PREFILL:]) for x in (q, k, v))))

    def cpp(all_heads):
        return mixattn._C.testing.gma_decode_seconds(q[0], k[0], v[0], mean, var_raw, prior,
                                                     GMA_PREFILL, all_heads)

    def python():
        cache, seconds = prefilled.copy(), []
        with torch.no_grad():
            for qt, kt, vt in steps:
                t0 = time.perf_counter()
                mixattn.gma_attention(qt, kt, vt, mean, var_raw, prior, causal=True, cache=cache)
                seconds.append(time.perf_counter() - t0)
        return seconds
    return cpp, python


def measure(name, cpp, python, rounds):
    """A B C A B C: every call's seconds of each side, and each round's median."""
    sides = (("cpp_per_head", lambda: cpp(False)), ("cpp_8_heads", lambda: cpp(True)),
             ("python_8_heads", python))
    for _, run in sides:  # warm: first-touch pages, the prepared mixtures, the records
        run()
    calls = {side: [] for side, _ in sides}
    medians = {side: [] for side, _ in sides}
    for _ in range(rounds):
        for side, run in sides:
            s = run()
            calls[side] += s
            medians[side].append(statistics.median(s))
    result = {"operator": name, "heads": HEADS, "rounds": rounds}
    for side, _ in sides:
        result[side + "_median_s"] = statistics.median(calls[side])
        result[side + "_round_medians_s"] = [min(medians[side]), max(medians[side])]
    result["target_s"] = 1.3 * HEADS * result["cpp_per_head_median_s"] + 20e-6
    result["met"] = result["python_8_heads_median_s"] <= result["target_s"]
    return result


def line(r):
    us = 1e6

    def side(name):
        lo, hi = r[name + "_round_medians_s"]
        return f"{r[name + '_median_s'] * us:.2f} us ({lo * us:.2f}-{hi * us:.2f})"
    return (f"{r['operator']}: C++ per head {side('cpp_per_head')}; C++ 8 heads per token "
            f"{side('cpp_8_heads')}; Python 8 heads per token {side('python_8_heads')}, "
            f"{r['python_8_heads_median_s'] / r['cpp_8_heads_median_s']:.2f} x the C++ 8 heads; "
            f"target <= 1.3 x 8 x C++ per head + 20 us = {r['target_s'] * us:.2f} us: "
            f"{'met' if r['met'] else 'MISSED'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256, help="decoded positions per round")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--cpu", type=int, default=None, help="pin the process to this core")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        import torch
        import mixattn
    except ImportError as e:
        print(f"torch_decode_bench: skipped ({e})")
        return 0
    torch.set_num_threads(args.threads)
    results = []
    for name, make in (("ovq", ovq_case), ("gma", gma_case)):
        results.append(measure(name, *make(torch, mixattn, args.tokens), args.rounds))
    print(f"one token, {HEADS} heads, float32, r = d_v = 64, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.tokens} tokens; medians per call (range of the round "
          "medians)")
    for r in results:
        print(line(r))
    if args.out:
        context = {"threads": args.threads, "torch": torch.__version__,
                   "mixattn": mixattn.__version__, "tokens": args.tokens, "cpu": args.cpu}
        with open(args.out, "w") as f:
            json.dump({"context": context, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
