"""mixattn for PyTorch (CPU): Gaussian Mixture Attention, Online Vector-Quantized attention and
tiled softmax attention, forward and hand-derived backward, from mixattn's C++ kernels.

    import mixattn
    out = mixattn.gma_attention(q, k, v, mean, var_raw, prior_logit, causal=True)
    layer = mixattn.GaussianMixtureAttention(d_model=256, heads=4, components=64, causal=True)

Tensors are (batch, heads, tokens, dim), float32 or float64, on the CPU. Decoding one token at
a time continues a cache in place (mixattn.OvqCache, mixattn.GmaCache; mixattn.cache). See
mixattn.functional and mixattn.modules for the details.
"""

from .cache import GmaCache, OvqCache, OvqState
from .functional import (clear_prepared_cache, flash_attention, gma_attention, ovq_attention,
                         release_memory)
from .modules import GaussianMixtureAttention, OnlineVQAttention

from . import _C

__version__ = _C.library_version()  # defined once, in include/mixattn/core.hpp
__all__ = ["gma_attention", "ovq_attention", "flash_attention", "clear_prepared_cache",
           "release_memory", "GaussianMixtureAttention", "OnlineVQAttention", "OvqCache",
           "GmaCache", "OvqState"]
