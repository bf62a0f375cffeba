#!/usr/bin/python3
"""PyTorch eager baselines at mixattn's benchmark shapes, one thread.

    /usr/bin/python3 bench/torch_side_by_side.py [--out FILE.json] [--min-time SECONDS]

Measures, float32, K = 64 components, r = d_v = 64, N = 256 ... 8192 (in bench/run.sh's main job,
MIXATTN_BENCH_MODE=main: N = 4096), forward (under no_grad) and forward+backward:
  torch_gma_{forward,fwd_bwd}_{bidir,causal}      the paper-style eager GMA: (x − μ)² broadcast
                                                  over N x K x r, log-softmax, matmuls; causal by
                                                  cumulative sums over an N x K x d_v tensor
  torch_softmax_{forward,fwd_bwd}_{bidir,causal}  softmax attention: scaled_dot_product_attention
                                                  when torch has it (>= 2.0), else
                                                  softmax(Q Kᵀ / √r + mask) V
Writes Google-Benchmark-style JSON that bench/summary.py reads next to the C++ results.
Exits 0 with a message when torch is not installed.
"""

import argparse
import os
import sys
import time

# One thread everywhere: torch.set_num_threads covers ATen's OpenMP pool, but Debian's torch calls
# OpenBLAS through libblas.so.3, whose own thread pool only these variables bound. Set before
# torch is imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

K, R, DV = 64, 64, 64


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "results", "torch_side_by_side.json"))
    ap.add_argument("--min-time", type=float, default=None,
                    help="seconds of timed calls per case (default 0.5, main job 0.1)")
    args = ap.parse_args()
    main_job = os.environ.get("MIXATTN_BENCH_MODE") == "main"
    min_time = args.min_time if args.min_time is not None else (0.1 if main_job else 0.5)

    try:
        import torch
    except ImportError:
        print("torch_side_by_side: PyTorch is not installed for " + sys.executable +
              "; skipping (MIXATTN_BENCH_TORCH=1 bash bench/run.sh installs python3-torch)")
        return 0
    torch.set_num_threads(1)
    print(torch.__config__.show())
    print(torch.__config__.parallel_info())
    sys.path.insert(0, here)
    from torch_eager import HAS_SDPA as has_sdpa, blas_in_use, gma, softmax_attention, write_results
    blas = blas_in_use()
    print(f"torch {torch.__version__}, BLAS: {blas}, threads: {torch.get_num_threads()}")

    def time_case(fn):
        fn()  # warm-up (allocator, first-call dispatch)
        # Three repetitions of at least min_time each, as bench/run.sh asks of the C++ binaries:
        # bench/summary.py takes their median and shows their spread.
        reps = []
        for _ in range(3):
            iters, wall, cpu = 0, 0.0, 0.0
            while wall < min_time or iters == 0:
                w0, c0 = time.perf_counter(), time.thread_time()
                fn()
                cpu += time.thread_time() - c0
                wall += time.perf_counter() - w0
                iters += 1
            reps.append((iters, wall / iters, cpu / iters))
        return reps

    g = torch.Generator().manual_seed(7)
    ns = [4096] if main_job else [256, 512, 1024, 2048, 4096, 8192]
    results = []
    for n in ns:
        q = torch.randn(n, R, generator=g)
        k = torch.randn(n, R, generator=g)
        v = torch.randn(n, DV, generator=g)
        d_out = torch.randn(n, DV, generator=g)
        mix = [torch.randn(K, R, generator=g), torch.zeros(K, R), torch.zeros(K)]
        for op_name, op in (("gma", gma), ("softmax", softmax_attention)):
            for causal in (False, True):
                mode = "causal" if causal else "bidir"
                for kind in ("forward", "fwd_bwd"):
                    leaves = [t.clone().requires_grad_(kind == "fwd_bwd")
                              for t in (q, k, v, *mix)]
                    qq, kk, vv = leaves[:3]
                    mix_t = leaves[3:]

                    if kind == "forward":
                        def call():
                            with torch.no_grad():
                                return op(qq, kk, vv, mix_t, causal)
                    else:
                        def call():
                            for t in leaves:
                                t.grad = None
                            out = op(qq, kk, vv, mix_t, causal)
                            out.backward(d_out)
                            return out
                    name = f"torch_{op_name}_{kind}_{mode}/{n}"
                    reps = time_case(call)
                    for rep, (iters, wall, cpu) in enumerate(reps):
                        print(f"{name:40s} {cpu * 1e3:10.3f} ms cpu {wall * 1e3:10.3f} ms wall"
                              f"  ({iters} iterations)", flush=True)
                        results.append({"name": name, "run_name": name, "run_type": "iteration",
                                        "repetitions": len(reps), "repetition_index": rep,
                                        "iterations": iters, "real_time": wall * 1e3,
                                        "cpu_time": cpu * 1e3, "time_unit": "ms", "N": n,
                                        "warm_up_calls": 1})

    write_results(args.out, "torch_side_by_side.py", results,
                  torch_threads=torch.get_num_threads(),
                  softmax_impl="scaled_dot_product_attention" if has_sdpa else "softmax(QK^T)V")
    return 0


if __name__ == "__main__":
    sys.exit(main())
