"""Calls from several Python threads at once give the results of the same calls made one after
another, bit for bit (every operator, forward and backward, the state and packed paths and the
caches, each thread with its own cache); and the kernels release the GIL, so that other Python
threads run while one computes."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import mixattn
from test_functional import gma_inputs, ovq_inputs


def gma_job(seed):
    inputs = gma_inputs(2, 2, 30, 30, 4, 3, 5, seed=seed)
    out = mixattn.gma_attention(*inputs, causal=seed % 2 == 0)
    return [out.detach()] + list(torch.autograd.grad(out.square().sum(), inputs))


def gma_state_job(seed):
    inputs = gma_inputs(1, 2, 20, 20, 4, 3, 5, seed=seed)
    out, (S, z) = mixattn.gma_attention(*inputs, causal=True, output_final_state=True)
    out2, _ = mixattn.gma_attention(*inputs, causal=True, initial_state=(S, z),
                                    output_final_state=True)
    return [out2.detach()] + list(torch.autograd.grad(out2.sum() + S.sum(), inputs))


def gma_packed_job(seed):
    inputs = gma_inputs(1, 2, 25, 25, 4, 3, 5, seed=seed)
    out = mixattn.gma_attention(*inputs, causal=True, cu_seqlens=[0, 7, 7, 25])
    return [out.detach()] + list(torch.autograd.grad(out.sum(), inputs))


def ovq_job(seed):
    inputs = ovq_inputs(2, 2, 25, 4, 3, seed=seed)
    out = mixattn.ovq_attention(*inputs, block=4, max_centroids=5)
    return [out.detach()] + list(torch.autograd.grad(out.square().sum(), inputs))


def flash_job(seed):
    q, k, v = gma_inputs(2, 2, 30, 30, 4, 3, 5, seed=seed)[:3]
    out = mixattn.flash_attention(q, k, v, causal=seed % 2 == 1)
    return [out.detach()] + list(torch.autograd.grad(out.sum(), (q, k, v)))


def decode_job(seed):
    """Token by token through each operator's cache (the thread's own caches)."""
    q, k, v, beta = (x.detach() for x in ovq_inputs(1, 2, 12, 4, 3, seed=seed))
    mix = [x.detach() for x in gma_inputs(1, 2, 1, 1, 4, 3, 5, seed=seed)[3:]]
    ovq_cache, gma_cache, outs = mixattn.OvqCache(), mixattn.GmaCache(), []
    with torch.no_grad():
        for t in range(12):
            x = [y[:, :, t:t + 1] for y in (q, k, v)]
            outs.append(mixattn.ovq_attention(*x, beta, cache=ovq_cache, block=4,
                                              max_centroids=5))
            outs.append(mixattn.gma_attention(*x, *mix, causal=True, cache=gma_cache))
    return outs


JOBS = [gma_job, gma_state_job, gma_packed_job, ovq_job, flash_job, decode_job]


def test_concurrent_calls_give_the_serial_results():
    work = [(job, seed) for seed in (1, 2, 3) for job in JOBS]
    serial = [job(seed) for job, seed in work]
    for threads in (2, 4):
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = list(pool.map(lambda w: w[0](w[1]), work * 2))
        for (job, seed), expected, got in zip(work * 2, serial * 2, results):
            assert len(expected) == len(got)
            for a, b in zip(expected, got):
                assert torch.equal(a, b), f"{job.__name__}({seed}) on {threads} threads"


def test_the_kernels_release_the_gil():
    # This thread keeps running Python while another is inside long forwards: it could not if the
    # kernel held the GIL. The loop stamps the time every 1000 iterations; with the GIL held for a
    # whole call no stamp could fall inside it (10 ms margins for the switches at its start and
    # end). The worker repeats the call until 0.3 s have passed inside calls, so a fast machine
    # still gives the loop time to run.
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 8192, 32, generator=gen) for _ in range(3))
    spans, done = [], threading.Event()

    def long_calls():
        try:
            with torch.no_grad():
                while sum(b - a for a, b in spans) < 0.3 and len(spans) < 50:
                    t0 = time.perf_counter()
                    mixattn.flash_attention(q, k, v, causal=True)
                    spans.append((t0, time.perf_counter()))
        finally:
            done.set()

    worker = threading.Thread(target=long_calls)
    stamps, count = [], 0
    worker.start()
    while not done.is_set():
        count += 1
        if count % 1000 == 0:
            stamps.append(time.perf_counter())
    worker.join()
    assert spans, "the call failed"
    interiors = [(a + 0.01, b - 0.01) for a, b in spans if b - a > 0.03]
    assert sum(b - a for a, b in interiors) > 0.1, f"calls too short to tell: {spans}"
    inside = sum(any(a < t < b for a, b in interiors) for t in stamps)
    assert inside >= 10, (inside, len(spans))
