"""mixattn's operators on PyTorch tensors, with autograd wired to the C++ backward passes.

Layout: PyTorch's (batch, heads, tokens, dim). Every function accepts float32 or float64 CPU
tensors, contiguous or not: each input is made contiguous once (``Tensor.contiguous()``, a copy
only when it is not already) and that copy is what the forward reads and the backward reuses.
The (batch, head) pairs run in parallel on PyTorch's intra-op threads (``torch.get_num_threads()``).
Bad shapes, dtypes or options raise ``ValueError`` naming the function and the argument; so do
NaN/Inf inputs unless ``check_finite=False``.

The backward passes are the library's hand-derived ones (SPEC.md); they are first-order only
(double backward raises).
"""

import torch
from torch.autograd.function import once_differentiable

from . import _C

__all__ = ["gma_attention", "ovq_attention", "flash_attention"]


def _contiguous(*tensors):
    return tuple(t.contiguous() for t in tensors)


def _grads(ctx, grads):
    """The gradients autograd asked for, None for the others."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


class _GmaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mean, var_raw, prior_logit, causal, eps, var_floor, check_finite):
        inputs = _contiguous(q, k, v, mean, var_raw, prior_logit)
        out, saved = _C.gma_forward(*inputs, causal, eps, var_floor, check_finite)
        ctx.save_for_backward(*inputs)
        ctx.record = saved
        ctx.options = (causal, eps, var_floor, check_finite)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grads = _C.gma_backward(*ctx.saved_tensors, grad_out.contiguous(), ctx.record,
                                *ctx.options)
        return _grads(ctx, grads) + (None,) * 4


class _OvqFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, config):
        inputs = _contiguous(q, k, v, beta)
        out, saved = _C.ovq_forward(*inputs, config)
        ctx.save_for_backward(*inputs)
        ctx.record = saved
        ctx.config = config
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grads = _C.ovq_backward(*ctx.saved_tensors, grad_out.contiguous(), ctx.record, ctx.config)
        return _grads(ctx, grads) + (None,)


class _FlashFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, check_finite):
        inputs = _contiguous(q, k, v)
        out, saved = _C.flash_forward(*inputs, causal, scale, check_finite)
        ctx.save_for_backward(*inputs)
        ctx.record = saved
        ctx.options = (causal, scale, check_finite)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grads = _C.flash_backward(*ctx.saved_tensors, grad_out.contiguous(), ctx.record,
                                  *ctx.options)
        return _grads(ctx, grads) + (None,) * 3


def gma_attention(q, k, v, mean, var_raw, prior_logit, causal=False, eps=1e-6, var_floor=1e-4,
                  check_finite=True):
    """Gaussian Mixture Attention (SPEC.md section 1), one routing mixture per head.

    q: (B, H, N, r); k: (B, H, M, r); v: (B, H, M, d_v); mean, var_raw: (H, K, r) (variance =
    softplus(var_raw) + var_floor); prior_logit: (H, K) (log prior = log_softmax). Returns
    (B, H, N, d_v). Bidirectional by default (M may differ from N); ``causal=True`` (M == N)
    lets token i see keys j <= i. eps floors the read-out denominator. Gradients flow to all
    six tensors; the mixture's are summed over the batch.
    """
    return _GmaFunction.apply(q, k, v, mean, var_raw, prior_logit, bool(causal), float(eps),
                              float(var_floor), bool(check_finite))


def ovq_attention(q, k, v, beta, block=256, max_centroids=1024, growth="plateau",
                  growth_alpha=0.0, seeding="greedy_dispersion", assignment="all_centroids",
                  count_bias=True, grad_through_dictionary=True, norm_eps=1e-5,
                  check_finite=True):
    """Online Vector-Quantized attention (SPEC.md section 2), causal, every sequence of the batch
    from an empty dictionary.

    q, k: (B, H, T, r); v: (B, H, T, d_v); beta: (H,), the per-head scale (logits use
    beta * sqrt(r)). Returns (B, H, T, d_v). Options are those of ``mixattn::ovq::Options``:
    block (C), max_centroids (N_max), growth ('plateau' or 'linear'), growth_alpha (0: N_max),
    seeding ('greedy_dispersion' or 'one_shot'), assignment ('all_centroids', or
    'existing_only': non-seed tokens join only centroids older than their block), count_bias,
    grad_through_dictionary (False:
    the dictionary is a constant for the backward), norm_eps. Gradients flow to q, k, v and
    beta (summed over the batch).
    """
    config = _C.OvqConfig(int(block), int(max_centroids), str(growth), float(growth_alpha),
                          str(seeding), str(assignment), bool(count_bias),
                          bool(grad_through_dictionary),
                          float(norm_eps), bool(check_finite))
    return _OvqFunction.apply(q, k, v, beta, config)


def flash_attention(q, k, v, causal=False, scale=None, check_finite=True):
    """Softmax attention softmax(scale q k^T + mask) v (SPEC.md section 3), tiled with an online
    softmax (O(N) memory, FlashAttention-2 schedule).

    q: (B, H, N, r); k: (B, H, M, r); v: (B, H, M, d_v). Returns (B, H, N, d_v).
    scale=None means 1/sqrt(r) (any other finite non-zero value is used as is); ``causal=True`` (M == N) masks keys j > i.
    """
    if scale is not None and float(scale) == 0:  # the library reads 0 as "the default"
        raise ValueError("mixattn.flash_attention: scale is 0; use None for 1/sqrt(r)")
    return _FlashFunction.apply(q, k, v, bool(causal), 0.0 if scale is None else float(scale),
                                bool(check_finite))
