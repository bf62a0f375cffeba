"""mixattn for PyTorch (CPU): Gaussian Mixture Attention, Online Vector-Quantized attention,
tiled softmax attention, and the papers' baselines (linear attention, Performer, static-codebook
VQ, sliding-window attention, the gated delta rule) with RoPE, forward and hand-derived
backward, from mixattn's C++ kernels.

    import mixattn
    out = mixattn.gma_attention(q, k, v, mean, var_raw, prior_logit, causal=True)
    layer = mixattn.GaussianMixtureAttention(d_model=256, heads=4, components=64, causal=True)

Tensors are (batch, heads, tokens, dim), float32 or float64, on the CPU. Decoding one token at
a time continues a cache in place (mixattn.OvqCache, mixattn.GmaCache; mixattn.cache). See
mixattn.functional and mixattn.modules for the details.
"""

from .cache import GmaCache, OvqCache, OvqState
from .functional import (clear_prepared_cache, flash_attention, gated_delta_rule, gma_attention,
                         linear_attention, ovq_attention, performer_attention, performer_features,
                         release_memory, rope, sliding_window_attention, vq_attention)
from .modules import (GatedDeltaAttention, GaussianMixtureAttention, LinearAttention,
                      OnlineVQAttention, PerformerAttention, SlidingWindowAttention, VQAttention)

from . import _C

__version__ = _C.library_version()  # defined once, in include/mixattn/core.hpp
__all__ = ["gma_attention", "ovq_attention", "flash_attention", "linear_attention",
           "performer_attention", "performer_features", "vq_attention",
           "sliding_window_attention", "gated_delta_rule", "rope", "clear_prepared_cache",
           "release_memory", "GaussianMixtureAttention", "OnlineVQAttention", "LinearAttention",
           "PerformerAttention", "VQAttention", "SlidingWindowAttention", "GatedDeltaAttention",
           "OvqCache", "GmaCache", "OvqState"]
