"""Eager PyTorch attention baselines shared by the PyTorch benchmarks (torch_side_by_side.py,
torch_ext_bench.py). Imported only after torch is known to be present.

Every function works on one head (N x r) or on a batch of heads (..., N, r) with a mixture of
shape (..., K, r) broadcasting against it (e.g. q (B, H, N, r) with mean (H, K, r)).

Two eager GMAs: gma, the paper's broadcast form (N x K x r differences; the side-by-side's
baseline, one head at a time; gma_per_head runs it over a batch of heads, the extension
benchmark's "paper-style" baseline), and gma_chunked, the matmul form eager linear attention
is written in (the extension benchmark's stronger eager baseline, whole batches: the broadcast
form would form B H N K r floats per intermediate there).
"""

import ctypes
import datetime
import json
import math
import os
import platform

import torch
import torch.nn.functional as F

EPS = 1e-6
VAR_FLOOR = 1e-4
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")  # PyTorch >= 2.0


def gamma(x, mean, var_raw, prior_logit):
    # SPEC 1.2, written the way the paper's reference code does: broadcast N x K x r.
    var = F.softplus(var_raw) + VAR_FLOOR
    diff = x[..., :, None, :] - mean[..., None, :, :]
    s = (torch.log_softmax(prior_logit, -1)[..., None, :] - 0.5 * torch.log(var).sum(-1)[..., None, :]
         - 0.5 * (diff * diff / var[..., None, :, :]).sum(-1))
    return torch.softmax(s, -1)


def gma(q, k, v, mix, causal):
    """The paper-style eager GMA; mix = (mean, var_raw, prior_logit). The causal prefix sums are
    materialised token by token (N x K x d_v)."""
    gq, gk = gamma(q, *mix), gamma(k, *mix)
    if not causal:
        num = gq @ (gk.transpose(-1, -2) @ v)
        den = gq @ gk.sum(-2)[..., None] + EPS
    else:
        state = torch.cumsum(gk[..., :, :, None] * v[..., :, None, :], -3)  # N x K x d_v
        num = torch.einsum("...nk,...nkd->...nd", gq, state)
        den = (gq * torch.cumsum(gk, -2)).sum(-1, keepdim=True) + EPS
    return num / den


def gma_per_head(q, k, v, mix, causal):
    """gma(), the paper's broadcast form, on a batch (B, H, N, r) with a mixture (H, K, r), run one
    (batch, head) pair at a time: its N x K x r intermediates are then N K r floats (32 MiB at
    N = 2048, K = r = 64) instead of B H N K r (1 GiB for B H = 32), which is the form of the
    paper's code that fits in memory and runs fastest here."""
    b, h = q.shape[:2]
    outs = [gma(q[i, j], k[i, j], v[i, j], tuple(t[j] for t in mix), causal)
            for i in range(b) for j in range(h)]
    return torch.stack(outs).reshape(b, h, *outs[0].shape)


def gamma_matmul(x, mean, var_raw, prior_logit):
    """SPEC 1.2 with the quadratic form expanded into matmuls, as an eager GMM is usually written:
    sum_j (x_j - mu_kj)^2 / var_kj = x^2 . (1/var_k) - 2 x . (mu_k / var_k) + mu_k^2 . (1/var_k).
    Nothing of size N x K x r is formed, so the batched call ((B, H, N, r) against (H, K, r))
    stays two (N x r) @ (r x K) products per head."""
    var = F.softplus(var_raw) + VAR_FLOOR
    inv = 1.0 / var                                                   # (..., K, r)
    const = (torch.log_softmax(prior_logit, -1) - 0.5 * torch.log(var).sum(-1)
             - 0.5 * (mean * mean * inv).sum(-1))                     # (..., K)
    s = const[..., None, :] - 0.5 * ((x * x) @ inv.transpose(-1, -2)) \
        + x @ (mean * inv).transpose(-1, -2)
    return torch.softmax(s, -1)


def gma_chunked(q, k, v, mix, causal, chunk=64):
    """Eager GMA the way linear attention is written in eager PyTorch: responsibilities by
    gamma_matmul; bidirectional as Gamma_Q (Gamma_K^T V); causal in chunks of `chunk` tokens
    (the chunkwise form of linear attention): the masked chunk-local Gamma_Q Gamma_K^T plus the
    prefix state (K x d_v) of the earlier chunks, so no N x K x d_v or N x N tensor is formed.
    mix = (mean, var_raw, prior_logit); the same result as gma() up to rounding."""
    gq, gk = gamma_matmul(q, *mix), gamma_matmul(k, *mix)
    if not causal:
        num = gq @ (gk.transpose(-1, -2) @ v)
        den = gq @ gk.sum(-2)[..., None] + EPS
        return num / den
    n = q.shape[-2]
    pad = -n % chunk
    if pad:  # zero responsibilities and values add nothing; the padded queries are dropped
        gq, gk, v = (F.pad(t, (0, 0, 0, pad)) for t in (gq, gk, v))
    c = (n + pad) // chunk
    gq, gk, v = (t.reshape(*t.shape[:-2], c, chunk, t.shape[-1]) for t in (gq, gk, v))
    kv = gk.transpose(-1, -2) @ v                                     # (..., c, K, d_v)
    S = torch.cumsum(kv, -3) - kv                                     # before each chunk
    zc = gk.sum(-2)                                                   # (..., c, K)
    z = torch.cumsum(zc, -2) - zc
    local = (gq @ gk.transpose(-1, -2)).tril()                        # (..., c, chunk, chunk)
    num = gq @ S + local @ v
    den = (gq * z[..., None, :]).sum(-1, keepdim=True) + local.sum(-1, keepdim=True) + EPS
    out = (num / den).reshape(*q.shape[:-2], n + pad, v.shape[-1])
    return out[..., :n, :]


def softmax_attention(q, k, v, _mix, causal):
    """scaled_dot_product_attention when torch has it (>= 2.0), else softmax(Q K^T / sqrt(r)
    + mask) V."""
    if HAS_SDPA:
        batched = q.dim() > 2
        out = F.scaled_dot_product_attention(q if batched else q[None], k if batched else k[None],
                                             v if batched else v[None], is_causal=causal)
        return out if batched else out[0]
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def blas_in_use():
    """The BLAS PyTorch calls. Debian's torch says BLAS_INFO=generic and uses whatever
    libblas.so.3 the alternatives system points at: name the library actually mapped after a
    matmul."""
    config = torch.__config__.show()
    blas_info = next((line.split("=", 1)[1].strip() for line in config.replace(",", "\n").splitlines()
                      if "BLAS_INFO" in line), "unknown")
    torch.randn(64, 64) @ torch.randn(64, 64)
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f
                           if "blas" in line.lower() and line.split()[-1].startswith("/")})
    except OSError:
        libs = []
    # BLAS_INFO says how torch was built, not which kernels run: OpenBLAS picks those at load time
    core = next((openblas_core(lib) for lib in libs if "libopenblas" in lib), None)
    return (f"{blas_info} ({', '.join(libs) if libs else 'no BLAS library mapped'})"
            + (f", OpenBLAS kernels: {core}" if core else ""))


def openblas_core(path):
    """The kernel set OpenBLAS chose for this CPU (openblas_get_corename), or None."""
    try:
        lib = ctypes.CDLL(path)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return None


def write_results(path, executable, entries, **context):
    """Google-Benchmark-style JSON for bench/summary.py: the run's context (date, host, torch,
    its BLAS, the run's mode, malloc policy, and `context`) and the entries."""
    full = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host_name": platform.node(),
        "executable": executable,
        "num_cpus": os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_blas": blas_in_use(),
        **context,
        "mixattn_bench_mode": os.environ.get("MIXATTN_BENCH_MODE", "full"),
        "malloc": ("GLIBC_TUNABLES " + os.environ["GLIBC_TUNABLES"]
                   if os.environ.get("GLIBC_TUNABLES") else "default"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"context": full, "benchmarks": entries}, f, indent=1)
    print(f"wrote {path}")
