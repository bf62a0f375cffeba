"""Multi-head attention layers over mixattn's operators, as torch.nn.Modules.

Each takes x of shape (batch, tokens, d_model) and returns the same shape:

    Q = x W_Q, K = x W_K  (H heads of key_dim r)     V = x W_V  (H heads of value_dim d_v)
    Q, K = RoPE(Q), RoPE(K)  (with rope=True)
    O_h = mixer_h(Q_h, K_h, V_h)                     y = [O_1 ... O_H] W_O

like mixattn::layer::MultiHeadAttention in C++. Initialisation (the C++ layer's, SPEC.md 1.1
for the mixtures), from torch's global RNG (torch.manual_seed makes it reproducible):
projection weights ~ N(0, 1/fan_in), no biases; mixture means ~ N(0, 1) * init_scale,
var_raw = 0 (variance softplus(0) + var_floor ~ 0.693), prior_logit = 0 (uniform priors);
OVQ's beta = 1 per head; VQ codebooks ~ N(0, 1) * codebook_scale; Performer's directions drawn
from a seed (taken from torch's global RNG unless given).

RoPE (SPEC.md 8.4): ``rope=True`` rotates every head's queries and keys (mixattn.rope, base
``rope_base``) before its mixer, row n of a sequence at position start + n (positions restart in
every sequence of a packed call). ``forward(..., start=)`` gives the first token's position;
left out, it is 0, or the tokens a cache (or an OVQ state) has already taken.
"""

import math

import torch
from torch import nn

from .cache import OvqState, _Cache
from .functional import (gated_delta_rule, gma_attention, linear_attention, ovq_attention,
                         performer_attention, performer_features, rope, sliding_window_attention,
                         vq_attention)

__all__ = ["GaussianMixtureAttention", "OnlineVQAttention", "LinearAttention",
           "PerformerAttention", "VQAttention", "SlidingWindowAttention", "GatedDeltaAttention"]


def _linear(fan_in, fan_out, device, dtype):
    layer = nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_(0.0, 1.0 / math.sqrt(fan_in))
    return layer


class _Projections(nn.Module):
    def __init__(self, d_model, heads, key_dim, value_dim, device, dtype, rope=False,
                 rope_base=10000.0):
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
        self.rope, self.rope_base = bool(rope), float(rope_base)
        if self.rope and self.key_dim % 2:
            raise ValueError(f"{type(self).__name__}: rope=True needs an even key_dim (column "
                             f"pairs are rotated), got {self.key_dim}")
        if self.rope and not (math.isfinite(self.rope_base) and self.rope_base > 0):
            raise ValueError(f"{type(self).__name__}: rope_base is {self.rope_base}; it must be "
                             "finite and > 0")
        self.q_proj = _linear(d_model, heads * self.key_dim, device, dtype)
        self.k_proj = _linear(d_model, heads * self.key_dim, device, dtype)
        self.v_proj = _linear(d_model, heads * self.value_dim, device, dtype)
        self.out_proj = _linear(heads * self.value_dim, d_model, device, dtype)

    def _split(self, x, proj, dim):
        b, n, _ = x.shape
        return proj(x).view(b, n, self.heads, dim).transpose(1, 2)  # (B, H, N, dim), a view

    def _heads(self, x, start=0, cu_seqlens=None):
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__}: x has shape {tuple(x.shape)}; expected "
                             f"(batch, tokens, {self.d_model})")
        q, k = self._split(x, self.q_proj, self.key_dim), self._split(x, self.k_proj, self.key_dim)
        if self.rope:
            q = rope(q, start, self.rope_base, cu_seqlens=cu_seqlens)
            k = rope(k, start, self.rope_base, cu_seqlens=cu_seqlens)
        return q, k, self._split(x, self.v_proj, self.value_dim)

    def _start(self, start, initial_state=None, cache=None):
        """RoPE's first position: `start` if given; else the tokens the cache or OVQ state has
        taken (the same for every stream), or 0."""
        name = type(self).__name__
        if start is not None:
            if not self.rope:
                raise ValueError(f"{name}: start is RoPE's first position, but the module was "
                                 "made with rope=False")
            return start
        if not self.rope:
            return 0
        if isinstance(cache, _Cache):
            seen = cache.tokens_seen
        elif isinstance(initial_state, OvqState):
            seen = initial_state.tokens_seen
        elif initial_state is not None:
            raise ValueError(f"{name}: rope=True continuing initial_state needs start=, the "
                             "position of x's first token (the state does not count tokens)")
        else:
            seen = []
        if len(set(seen)) > 1:
            raise ValueError(f"{name}: rope=True: the streams have taken {sorted(set(seen))} "
                             "tokens; one position for all of them is needed: pass start=")
        return seen[0] if seen else 0

    def _rope_repr(self):
        return f", rope=True, rope_base={self.rope_base}" if self.rope else ""

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

    ``rope=True`` rotates queries and keys first (see the module docstring); continuing an
    ``initial_state`` then needs ``start=``, the position of x's first token.
    """

    def __init__(self, d_model, heads, components, causal=False, key_dim=None, value_dim=None,
                 eps=1e-6, var_floor=1e-4, init_scale=1.0, rope=False, rope_base=10000.0,
                 device=None, dtype=None):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype, rope, rope_base)
        if components < 1:
            raise ValueError(f"GaussianMixtureAttention: components is {components}; must be >= 1")
        self.components, self.causal = components, bool(causal)
        self.eps, self.var_floor = float(eps), float(var_floor)
        shape = (heads, components, self.key_dim)
        self.mean = nn.Parameter(torch.randn(shape, device=device, dtype=dtype) * init_scale)
        self.var_raw = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))
        self.prior_logit = nn.Parameter(torch.zeros(heads, components, device=device, dtype=dtype))

    def forward(self, x, initial_state=None, output_final_state=False, cu_seqlens=None,
                cache=None, start=None):
        q, k, v = self._heads(x, self._start(start, initial_state, cache), cu_seqlens)
        o = gma_attention(q, k, v, self.mean, self.var_raw, self.prior_logit, causal=self.causal,
                          eps=self.eps, var_floor=self.var_floor, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          cache=cache)
        if output_final_state:
            return self._merge(o[0]), o[1]
        return self._merge(o)

    def extra_repr(self):
        return (f"d_model={self.d_model}, heads={self.heads}, components={self.components}, "
                f"causal={self.causal}, key_dim={self.key_dim}, value_dim={self.value_dim}"
                f"{self._rope_repr()}")


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

    ``rope=True`` rotates queries and keys first (see the module docstring).
    """

    def __init__(self, d_model, heads, key_dim=None, value_dim=None, rope=False,
                 rope_base=10000.0, device=None, dtype=None, **ovq_options):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype, rope, rope_base)
        self.beta = nn.Parameter(torch.ones(heads, device=device, dtype=dtype))
        self.ovq_options = dict(ovq_options)
        # Reject unknown or bad options now rather than at the first forward.
        q = torch.zeros(1, heads, 0, self.key_dim, dtype=self.beta.dtype)
        ovq_attention(q, q, q.new_zeros(1, heads, 0, self.value_dim), self.beta.detach().cpu(),
                      **self.ovq_options)

    def forward(self, x, initial_state=None, output_final_state=False, cu_seqlens=None,
                cache=None, start=None):
        q, k, v = self._heads(x, self._start(start, initial_state, cache), cu_seqlens)
        o = ovq_attention(q, k, v, self.beta, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          cache=cache, **self.ovq_options)
        if output_final_state:
            return self._merge(o[0]), o[1]
        return self._merge(o)

    def extra_repr(self):
        opts = "".join(f", {k}={v!r}" for k, v in self.ovq_options.items())
        return (f"d_model={self.d_model}, heads={self.heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}{opts}{self._rope_repr()}")


class _Stateless(_Projections):
    """The baselines' modules: no state, so forward(x, cu_seqlens=None, start=None) also takes
    initial_state and output_final_state only to refuse them by name (the functions do)."""

    def _mix(self, q, k, v, **kw):
        raise NotImplementedError

    def forward(self, x, initial_state=None, output_final_state=False, cu_seqlens=None,
                start=None):
        q, k, v = self._heads(x, self._start(start), cu_seqlens)
        return self._merge(self._mix(q, k, v, initial_state=initial_state,
                                     output_final_state=output_final_state,
                                     cu_seqlens=cu_seqlens))


class LinearAttention(_Stateless):
    """Multi-head linear attention (SPEC.md section 4, elu + 1 features),
    x: (batch, tokens, d_model) -> (batch, tokens, d_model). Parameters: the four projections
    (the heads own none). Bidirectional, or causal with ``causal=True``. No streaming state.
    Packed input: ``forward(x, cu_seqlens=...)`` with x (1, T, d_model)."""

    def __init__(self, d_model, heads, causal=False, key_dim=None, value_dim=None, eps=1e-6,
                 rope=False, rope_base=10000.0, device=None, dtype=None):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype, rope, rope_base)
        self.causal, self.eps = bool(causal), float(eps)

    def _mix(self, q, k, v, **kw):
        return linear_attention(q, k, v, causal=self.causal, eps=self.eps, **kw)

    def extra_repr(self):
        return (f"d_model={self.d_model}, heads={self.heads}, causal={self.causal}, "
                f"key_dim={self.key_dim}, value_dim={self.value_dim}{self._rope_repr()}")


class PerformerAttention(_Stateless):
    """Multi-head Performer attention (SPEC.md section 5, FAVOR+ positive random features),
    x: (batch, tokens, d_model) -> (batch, tokens, d_model).

    Parameters: the four projections. The buffer ``directions`` (heads, features, key_dim)
    holds every head's random directions W_h, drawn by mixattn.performer_features from ``seed``
    (None: one drawn from torch's global RNG) with ``draw`` ('orthogonal' or 'iid'); a constant
    (no gradient), kept in the state dict, redrawn by ``redraw(seed)`` (the paper redraws
    periodically during training). ``scale`` is s (None: key_dim^(-1/4)). Bidirectional or
    causal; no streaming state.
    """

    def __init__(self, d_model, heads, features=64, causal=False, key_dim=None, value_dim=None,
                 eps=1e-6, scale=None, draw="orthogonal", seed=None, rope=False,
                 rope_base=10000.0, device=None, dtype=None):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype, rope, rope_base)
        self.causal, self.eps, self.scale, self.draw = bool(causal), float(eps), scale, draw
        self.features = int(features)
        self.register_buffer("directions", self._draw(seed, device, dtype))

    def _draw(self, seed, device, dtype):
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        w = performer_features(self.heads, self.features, self.key_dim, seed=seed, draw=self.draw,
                               dtype=torch.float64)
        return w.to(device=device, dtype=dtype if dtype is not None else
                    torch.get_default_dtype())

    @torch.no_grad()
    def redraw(self, seed=None):
        """New directions for every head from `seed` (None: one from torch's global RNG)."""
        self.directions.copy_(self._draw(seed, self.directions.device, self.directions.dtype))

    def _mix(self, q, k, v, **kw):
        return performer_attention(q, k, v, self.directions, causal=self.causal, eps=self.eps,
                                   scale=self.scale, **kw)

    def extra_repr(self):
        return (f"d_model={self.d_model}, heads={self.heads}, features={self.features}, "
                f"causal={self.causal}, key_dim={self.key_dim}, value_dim={self.value_dim}, "
                f"draw={self.draw!r}{self._rope_repr()}")


class VQAttention(_Stateless):
    """Multi-head static-codebook VQ attention (SPEC.md section 6, Transformer-VQ style),
    x: (batch, tokens, d_model) -> (batch, tokens, d_model).

    Parameters: the four projections and ``codebook`` (heads, codes, key_dim), initialised
    ~ N(0, 1) * codebook_scale (keys of unit-variance x are ~ N(0, 1) entrywise at
    initialisation, as the C++ layer argues). The keys' gradient, and so W_K's, is the
    straight-through one (SPEC 6.3). ``scale`` is tau (None: 1/sqrt(key_dim)). Bidirectional
    or causal; no streaming state.
    """

    def __init__(self, d_model, heads, codes=64, causal=False, key_dim=None, value_dim=None,
                 eps=1e-6, scale=None, codebook_scale=1.0, rope=False, rope_base=10000.0,
                 device=None, dtype=None):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype, rope, rope_base)
        if codes < 1:
            raise ValueError(f"VQAttention: codes is {codes}; must be >= 1")
        self.codes, self.causal, self.eps, self.scale = int(codes), bool(causal), float(eps), scale
        self.codebook = nn.Parameter(
            torch.randn(heads, self.codes, self.key_dim, device=device, dtype=dtype)
            * codebook_scale)

    def _mix(self, q, k, v, **kw):
        return vq_attention(q, k, v, self.codebook, causal=self.causal, eps=self.eps,
                            scale=self.scale, **kw)

    def extra_repr(self):
        return (f"d_model={self.d_model}, heads={self.heads}, codes={self.codes}, "
                f"causal={self.causal}, key_dim={self.key_dim}, value_dim={self.value_dim}"
                f"{self._rope_repr()}")


class SlidingWindowAttention(_Stateless):
    """Multi-head sliding-window causal softmax attention (SPEC.md section 7): token i of a
    sequence attends to the ``window`` tokens up to itself. x: (batch, tokens, d_model) ->
    (batch, tokens, d_model). Parameters: the four projections. With ``rope=True``, the local
    layers of OVQ's hybrid models (SPEC 8.4). No streaming state.
    """

    def __init__(self, d_model, heads, window=256, key_dim=None, value_dim=None, scale=None,
                 rope=False, rope_base=10000.0, device=None, dtype=None):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype, rope, rope_base)
        if window < 1:
            raise ValueError(f"SlidingWindowAttention: window is {window}; must be >= 1")
        self.window, self.scale = int(window), scale

    def _mix(self, q, k, v, **kw):
        return sliding_window_attention(q, k, v, window=self.window, scale=self.scale, **kw)

    def extra_repr(self):
        return (f"d_model={self.d_model}, heads={self.heads}, window={self.window}, "
                f"key_dim={self.key_dim}, value_dim={self.value_dim}{self._rope_repr()}")


class GatedDeltaAttention(_Projections):
    """Multi-head gated delta rule (SPEC.md section 9), the token mixer of Gated DeltaNet, causal.
    x: (batch, tokens, d_model) -> (batch, tokens, d_model).

    Parameters: the four projections, and the gates' own: a_proj and b_proj (d_model -> heads,
    no bias), A_log and dt_bias (heads,). Each token's gates come from the layer input x, as
    Gated DeltaNet computes them, per head h:

        beta_t = sigmoid(x_t . w_b,h),    g_t = -exp(A_log_h) softplus(x_t . w_a,h + dt_bias_h)

    so g_t <= 0 and beta_t in [0, 1] for any parameters (the bounds reached only by rounding). Initialisation (Gated DeltaNet's and
    Mamba2's): A_log = log A with A ~ U(1, 16); dt_bias = softplus^-1(dt) with dt log-uniform in
    [1e-3, 0.1]; a_proj and b_proj as the other projections. q and k are L2-normalised inside
    (``use_qk_l2norm=True``: the rule is then contractive whatever the projections do).
    ``scale`` (None: 1/sqrt(key_dim)) and ``chunk_size`` are gated_delta_rule's. The paper's
    short convolutions, output gate and norm are left to the model around the module (the other
    modules' shape: projections, mixer, output projection).

    Streaming: ``forward(x, initial_state=None, output_final_state=False)`` as gated_delta_rule:
    the state is S (batch, heads, key_dim, value_dim), float64; with output_final_state the
    module returns ``(y, S)``, and gradients flow through the states. Packed variable-length
    input: ``forward(x, cu_seqlens=...)`` with x (1, T, d_model) (one state per sequence).
    ``rope=True`` rotates queries and keys first (see the module docstring); continuing an
    ``initial_state`` then needs ``start=``.
    """

    def __init__(self, d_model, heads, key_dim=None, value_dim=None, scale=None,
                 use_qk_l2norm=True, chunk_size=64, rope=False, rope_base=10000.0, device=None,
                 dtype=None):
        super().__init__(d_model, heads, key_dim, value_dim, device, dtype, rope, rope_base)
        if int(chunk_size) < 1:
            raise ValueError(f"GatedDeltaAttention: chunk_size is {chunk_size}; must be >= 1")
        self.scale, self.use_qk_l2norm = scale, bool(use_qk_l2norm)
        self.chunk_size = int(chunk_size)
        self.a_proj = _linear(d_model, heads, device, dtype)
        self.b_proj = _linear(d_model, heads, device, dtype)
        a = torch.empty(heads, device=device, dtype=torch.float64).uniform_(1.0, 16.0)
        lo, hi = math.log(1e-3), math.log(0.1)
        dt = torch.exp(torch.rand(heads, device=device, dtype=torch.float64) * (hi - lo) + lo)
        self.A_log = nn.Parameter(torch.log(a).to(dtype=self.a_proj.weight.dtype))
        # softplus^-1(dt) = dt + log(1 - exp(-dt)), in float64 before rounding.
        self.dt_bias = nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(
            dtype=self.a_proj.weight.dtype))

    def gates(self, x):
        """(g, beta) of x (batch, tokens, d_model), each (batch, heads, tokens)."""
        beta = torch.sigmoid(self.b_proj(x))
        g = -torch.exp(self.A_log) * nn.functional.softplus(self.a_proj(x) + self.dt_bias)
        return g.transpose(1, 2), beta.transpose(1, 2)

    def forward(self, x, initial_state=None, output_final_state=False, cu_seqlens=None,
                start=None):
        q, k, v = self._heads(x, self._start(start, initial_state), cu_seqlens)
        g, beta = self.gates(x)
        o, state = gated_delta_rule(q, k, v, g, beta, scale=self.scale,
                                    initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                    use_qk_l2norm_in_kernel=self.use_qk_l2norm,
                                    chunk_size=self.chunk_size)
        y = self._merge(o)
        return (y, state) if output_final_state else y

    def extra_repr(self):
        return (f"d_model={self.d_model}, heads={self.heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, use_qk_l2norm={self.use_qk_l2norm}, "
                f"chunk_size={self.chunk_size}{self._rope_repr()}")
