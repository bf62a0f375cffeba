"""Eager PyTorch attention baselines shared by the PyTorch benchmarks (torch_side_by_side.py,
torch_ext_bench.py). Imported only after torch is known to be present.

Every function works on one head (N x r) or on a batch of heads (..., N, r) with a mixture of
shape (..., K, r) broadcasting against it (e.g. q (B, H, N, r) with mean (H, K, r)).
"""

import math

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
    """The paper-style eager GMA; mix = (mean, var_raw, prior_logit)."""
    gq, gk = gamma(q, *mix), gamma(k, *mix)
    if not causal:
        num = gq @ (gk.transpose(-1, -2) @ v)
        den = gq @ gk.sum(-2)[..., None] + EPS
    else:
        state = torch.cumsum(gk[..., :, :, None] * v[..., :, None, :], -3)  # N x K x d_v
        num = torch.einsum("...nk,...nkd->...nd", gq, state)
        den = (gq * torch.cumsum(gk, -2)).sum(-1, keepdim=True) + EPS
    return num / den


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
