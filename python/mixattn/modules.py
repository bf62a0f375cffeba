"""Multi-head attention layers over mixattn's operators, as torch.nn.Modules.

Both take x of shape (batch, tokens, d_model) and return the same shape:

    Q = x W_Q, K = x W_K  (H heads of key_dim r)     V = x W_V  (H heads of value_dim d_v)
    O_h = mixer_h(Q_h, K_h, V_h)                     y = [O_1 ... O_H] W_O

like mixattn::layer::MultiHeadAttention in C++. Initialisation (the C++ layer's, SPEC.md 1.1
for the mixtures), from torch's global RNG (torch.manual_seed makes it reproducible):
projection weights ~ N(0, 1/fan_in), no biases; mixture means ~ N(0, 1) * init_scale,
var_raw = 0 (variance softplus(0) + var_floor ~ 0.693), prior_logit = 0 (uniform priors);
OVQ's beta = 1 per head.
"""

import math

import torch
from torch import nn

from .functional import gma_attention, ovq_attention

__all__ = ["GaussianMixtureAttention", "OnlineVQAttention"]


def _linear(fan_in, fan_out, device, dtype):
    layer = nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_(0.0, 1.0 / math.sqrt(fan_in))
    return layer


class _Projections(nn.Module):
    def __init__(self, d_model, heads, key_dim, value_dim, device, dtype):
        super().__init__()
        if d_model < 1 or heads < 1:
            raise ValueError(f"{type(self).__name__}: d_model is {d_model} and heads is {heads}; "
                             "both must be positive")
        self.d_model, self.heads = d_model, heads
        self.key_dim = key_dim if key_dim is not None else d_model // heads
        self.value_dim = value_dim if value_dim is not None else d_model // heads
        if self.key_dim < 1 or self.value_dim < 1:
            raise ValueError(f"{type(self).__name__}: key_dim is {self.key_dim} and value_dim is "
                             f"{self.value_dim}; both must be positive")
        self.q_proj = _linear(d_model, heads * self.key_dim, device, dtype)
        self.k_proj = _linear(d_model, heads * self.key_dim, device, dtype)
        self.v_proj = _linear(d_model, heads * self.value_dim, device, dtype)
        self.out_proj = _linear(heads * self.value_dim, d_model, device, dtype)

    def _split(self, x, proj, dim):
        b, n, _ = x.shape
        return proj(x).view(b, n, self.heads, dim).transpose(1, 2)  # (B, H, N, dim), a view

    def _heads(self, x):
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__}: x has shape {tuple(x.shape)}; expected "
                             f"(batch, tokens, {self.d_model})")
        return (self._split(x, self.q_proj, self.key_dim), self._split(x, self.k_proj, self.key_dim),
                self._split(x, self.v_proj, self.value_dim))

    def _merge(self, o):
        b, _, n, _ = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(b, n, self.heads * self.value_dim))


class GaussianMixtureAttention(_Projections):
    """Multi-head Gaussian Mixture Attention (SPEC.md section 1), one mixture of `components`
    diagonal Gaussians per head. x: (batch, tokens, d_model) -> (batch, tokens, d_model).

    Parameters: q_proj, k_proj (d_model -> heads * key_dim), v_proj (d_model -> heads *
    value_dim), out_proj, mean and var_raw (heads, components, key_dim), prior_logit (heads,
    components). key_dim and value_dim default to d_model // heads.

    Streaming (causal only): ``forward(x, initial_state=None, output_final_state=False)`` as
    gma_attention: the state is the pair (S (batch, heads, K, value_dim), z (batch, heads, K)),
    float64; with output_final_state the module returns ``(y, (S, z))``. Gradients flow through
    the states.

    Packed variable-length input: ``forward(x, cu_seqlens=...)`` with x (1, T, d_model) holding
    the sequences one after another, as gma_attention (with a state: one per sequence).

    Decoding in place (causal only): ``forward(x, cache=mixattn.GmaCache())`` continues the
    cache's states and updates them, as gma_attention's ``cache``; each head's mixture stays
    prepared until the parameters change (an optimizer step, load_state_dict).
    """

    def __init__(self, d_model, heads, components, causal=False, key_dim=None, value_dim=None,
                 eps=1e-6, var_floor=1e-4, init_scale=1.0, device=None, dtype=None):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype)
        if components < 1:
            raise ValueError(f"GaussianMixtureAttention: components is {components}; must be >= 1")
        self.components, self.causal = components, bool(causal)
        self.eps, self.var_floor = float(eps), float(var_floor)
        shape = (heads, components, self.key_dim)
        self.mean = nn.Parameter(torch.randn(shape, device=device, dtype=dtype) * init_scale)
        self.var_raw = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))
        self.prior_logit = nn.Parameter(torch.zeros(heads, components, device=device, dtype=dtype))

    def forward(self, x, initial_state=None, output_final_state=False, cu_seqlens=None,
                cache=None):
        q, k, v = self._heads(x)
        o = gma_attention(q, k, v, self.mean, self.var_raw, self.prior_logit, causal=self.causal,
                          eps=self.eps, var_floor=self.var_floor, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          cache=cache)
        if output_final_state:
            return self._merge(o[0]), o[1]
        return self._merge(o)

    def extra_repr(self):
        return (f"d_model={self.d_model}, heads={self.heads}, components={self.components}, "
                f"causal={self.causal}, key_dim={self.key_dim}, value_dim={self.value_dim}")


class OnlineVQAttention(_Projections):
    """Multi-head Online Vector-Quantized attention (SPEC.md section 2), causal; every sequence
    starts from an empty dictionary. x: (batch, tokens, d_model) -> (batch, tokens, d_model).

    Parameters: the four projections and beta (heads,), initialised to 1. The remaining keywords
    are mixattn.ovq_attention's options (block, max_centroids, growth, seeding, count_bias,
    grad_through_dictionary, ...).

    Streaming: ``forward(x, initial_state=None, output_final_state=False)`` as ovq_attention (an
    opaque state, forward only); with output_final_state the module returns ``(y, state)``.
    Packed variable-length input: ``forward(x, cu_seqlens=...)`` with x (1, T, d_model), as
    ovq_attention (one dictionary per sequence).

    Decoding in place: ``forward(x, cache=mixattn.OvqCache())`` continues the cache's
    dictionaries and updates them, as ovq_attention's ``cache``.
    """

    def __init__(self, d_model, heads, key_dim=None, value_dim=None, device=None, dtype=None,
                 **ovq_options):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype)
        self.beta = nn.Parameter(torch.ones(heads, device=device, dtype=dtype))
        self.ovq_options = dict(ovq_options)
        # Reject unknown or bad options now rather than at the first forward.
        q = torch.zeros(1, heads, 0, self.key_dim, dtype=self.beta.dtype)
        ovq_attention(q, q, q.new_zeros(1, heads, 0, self.value_dim), self.beta.detach().cpu(),
                      **self.ovq_options)

    def forward(self, x, initial_state=None, output_final_state=False, cu_seqlens=None,
                cache=None):
        q, k, v = self._heads(x)
        o = ovq_attention(q, k, v, self.beta, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          cache=cache, **self.ovq_options)
        if output_final_state:
            return self._merge(o[0]), o[1]
        return self._merge(o)

    def extra_repr(self):
        opts = "".join(f", {k}={v!r}" for k, v in self.ovq_options.items())
        return (f"d_model={self.d_model}, heads={self.heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}{opts}")
