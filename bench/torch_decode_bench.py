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
The two sides alternate, A B A B, --rounds times: A decodes the same --tokens positions of each
of the 8 heads with the library (each call timed in C++, steady_clock), B decodes them with one
Python call per token for all 8 heads (each call timed with time.perf_counter around it, so the
Python call, argument checks and output tensor are included), from a copy of the same prefilled
cache. Reported: the median per call of each side over all rounds, the range of the rounds'
medians, and the target's verdict
    Python median <= 1.3 x 8 x C++ per-head median + 20 us
(decoding 8 heads costs about what 8 library calls do, plus the call's fixed overhead).
Medians, not means: every 256th OVQ token completes a block (the dictionary's update), a slow
call that both sides take at the same positions. Run it on a quiet machine; --cpu pins the
process to one core (with --threads 1).
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

    def cpp():
        return [s for h in range(HEADS) for s in mixattn._C.testing.ovq_decode_seconds(
            q[0, h], k[0, h], v[0, h], 1.0, config, OVQ_PREFILL)]

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

    def cpp():
        return [s for h in range(HEADS) for s in mixattn._C.testing.gma_decode_seconds(
            q[0, h], k[0, h], v[0, h], mean[h], var_raw[h], prior[h], GMA_PREFILL)]

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
    """A B A B: every call's seconds of each side, and each round's median."""
    cpp(), python()  # warm: first-touch pages, the prepared mixtures, the records
    calls = {"cpp": [], "python": []}
    medians = {"cpp": [], "python": []}
    for _ in range(rounds):
        for side, run in (("cpp", cpp), ("python", python)):
            s = run()
            calls[side] += s
            medians[side].append(statistics.median(s))
    cpp_med, py_med = statistics.median(calls["cpp"]), statistics.median(calls["python"])
    bound = 1.3 * HEADS * cpp_med + 20e-6
    return {
        "operator": name, "heads": HEADS, "rounds": rounds,
        "cpp_per_head_median_s": cpp_med, "python_8_heads_median_s": py_med,
        "cpp_round_medians_s": [min(medians["cpp"]), max(medians["cpp"])],
        "python_round_medians_s": [min(medians["python"]), max(medians["python"])],
        "target_s": bound, "met": py_med <= bound,
        "ratio_to_8_cpp": py_med / (HEADS * cpp_med),
    }


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
    us = 1e6
    print(f"one token, {HEADS} heads, float32, r = d_v = 64, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.tokens} tokens, medians (range of round medians)")
    for r in results:
        print(f"{r['operator']}: C++ per head {r['cpp_per_head_median_s'] * us:.2f} us "
              f"({r['cpp_round_medians_s'][0] * us:.2f}-{r['cpp_round_medians_s'][1] * us:.2f}); "
              f"Python, 8 heads {r['python_8_heads_median_s'] * us:.2f} us "
              f"({r['python_round_medians_s'][0] * us:.2f}-"
              f"{r['python_round_medians_s'][1] * us:.2f}) = {r['ratio_to_8_cpp']:.2f} x 8 C++; "
              f"target <= {r['target_s'] * us:.2f} us: {'met' if r['met'] else 'MISSED'}")
    if args.out:
        context = {"threads": args.threads, "torch": torch.__version__,
                   "mixattn": mixattn.__version__, "tokens": args.tokens, "cpu": args.cpu}
        with open(args.out, "w") as f:
            json.dump({"context": context, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
