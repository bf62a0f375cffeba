"""Decoding caches: the state of every (batch, head) kept by the kernels and continued in place.

    cache = mixattn.OvqCache()
    for t in range(T):                       # one token per call, all heads and batch entries
        out = mixattn.ovq_attention(q_t, k_t, v_t, beta, cache=cache)

A call given ``cache=`` continues each (batch, head)'s state where the previous call left it and
updates it in place: nothing of a dictionary (OVQ) or prefix state (GMA) is copied, so a
one-token call costs what the library's own decoding costs plus the call's overhead. The
copying form (``initial_state`` / ``output_final_state``) stays for branching; ``copy()`` makes
an independent branch of a cache, ``state()`` a snapshot in the copying form's type, and the
constructors take one to start from.

A cache binds to the first call it serves: the dtype, the number of streams (batch entries, or
sequences of a packed call), heads, key and value dims, and the options that shape its states
(OVQ: block, max_centroids, growth, growth_alpha, seeding, assignment, count_bias, norm_eps;
GMA: the components, eps and var_floor). A later call that differs raises ValueError naming
``cache``; ``reset()`` empties and unbinds it. A call refused for its arguments (shapes,
options, NaN/Inf inputs, a non-positive beta) leaves the cache as it was. A cache serves one
call at a time: using it from two threads at once raises RuntimeError (give each thread its
own). No gradient flows into or out of a cache's states; within a call, gradients reach the
call's inputs (and parameters) with the state it started from held constant.

Decoding through a cache is eager-only: under torch.compile the call is left to eager PyTorch
(a graph break; ``fullgraph=True`` refuses it). A cache's states are the library's own objects
(OVQ's dictionaries grow call by call, GMA keeps each head's prepared mixture), continued in
place by one operator call; a compiled graph would copy them on every call, which is what a
cache exists to avoid.
"""

import torch

from . import _C

__all__ = ["OvqCache", "GmaCache", "OvqState"]


class OvqState:
    """The dictionaries an ``ovq_attention(..., output_final_state=True)`` call ended with, one
    per (batch, head) or (sequence, head) of a packed call: opaque, never changed (a call given
    it continues a copy), no gradient flows through it. ``batch``, ``heads`` and ``tokens_seen``
    (per (stream, head) pair) describe it."""

    __slots__ = ("_handle",)

    def __init__(self, handle):
        self._handle = handle

    @property
    def kind(self):
        return _C.ovq_state_info(self._handle)[0]

    @property
    def batch(self):
        return _C.ovq_state_info(self._handle)[1]

    @property
    def heads(self):
        return _C.ovq_state_info(self._handle)[2]

    @property
    def tokens_seen(self):
        return _C.ovq_state_info(self._handle)[3]

    def __repr__(self):
        kind, batch, heads, _ = _C.ovq_state_info(self._handle)
        return f"OvqState({kind}, streams={batch}, heads={heads})"


class _Cache:
    """A handle (an empty tensor whose storage owns the C++ cache) and the methods over it."""

    __slots__ = ("_handle",)

    @classmethod
    def _wrap(cls, handle):
        cache = cls.__new__(cls)
        cache._handle = handle
        return cache

    def copy(self):
        """An independent copy: the same binding and states, continued separately (a branch)."""
        return self._wrap(_C.cache_copy(self._handle))

    def __deepcopy__(self, memo):
        return self.copy()

    def reset(self):
        """Empties the cache and unbinds it, as if new."""
        _C.cache_reset(self._handle)

    @property
    def bound(self):
        """Whether a call has bound the cache (its dtype, sizes and options) yet."""
        return _C.cache_bound(self._handle)

    @property
    def tokens_seen(self):
        """Tokens each stream (batch entry, or sequence of a packed call) has taken through the
        cache, a list (empty before the first call)."""
        return _C.cache_tokens_seen(self._handle)

    def __repr__(self):
        return _C.cache_repr(self._handle)


class OvqCache(_Cache):
    """In-place decoding state of ``ovq_attention(..., cache=)`` and ``OnlineVQAttention(x,
    cache=)``: every (batch, head)'s dictionary and unfinished block (the library's
    ``ovq::State``).

    ``OvqCache()`` starts empty (every stream from an empty dictionary) and binds to its first
    call; ``OvqCache(initial_state)`` starts from a copy of a state that
    ``ovq_attention(..., output_final_state=True)`` returned (and is bound to its dtype, sizes
    and options). ``state()`` returns a copy of the states in that same type (None before the
    first call), which the copying form can continue."""

    __slots__ = ()

    def __init__(self, initial_state=None):
        if initial_state is None:
            self._handle = _C.ovq_cache()
        elif isinstance(initial_state, OvqState):
            self._handle = _C.ovq_cache_from_state(initial_state._handle)
        else:
            raise TypeError("mixattn.OvqCache: initial_state must be the state an earlier "
                            "ovq_attention(..., output_final_state=True) returned, got "
                            f"{type(initial_state).__name__}")

    def state(self):
        """A copy of the states as the copying form's opaque state (``initial_state=`` of
        ovq_attention), or None before the first call."""
        handle = _C.ovq_cache_state(self._handle)
        return None if handle is None else OvqState(handle)


class GmaCache(_Cache):
    """In-place decoding state of ``gma_attention(..., causal=True, cache=)`` and
    ``GaussianMixtureAttention(x, cache=)``: every (batch, head)'s causal prefix state (S, z)
    (the library's ``gma::State``, float64), plus each head's mixture prepared once (the
    library's ``gma::Prepared``) and kept while ``mean``, ``var_raw`` and ``prior_logit`` are the
    same tensor objects, unchanged: PyTorch's version counter sees every in-place change (an
    optimizer step, ``copy_``, ``load_state_dict``), after which the next call prepares the
    mixture again. A change made through ``.data`` bypasses the version counter (as it bypasses
    autograd's own checks): call ``reset()`` or pass the tensors anew after one.

    ``GmaCache()`` starts from the empty state; ``GmaCache(initial_state=(S, z))`` from a copy
    of a state of the copying form (S (B, H, K, d_v), z (B, H, K), float32 or float64).
    ``state()`` returns copies ``(S, z)`` (float64; None before the first call)."""

    __slots__ = ()

    def __init__(self, initial_state=None):
        if initial_state is None:
            self._handle = _C.gma_cache()
            return
        if (not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2
                or not all(isinstance(t, torch.Tensor) for t in initial_state)):
            raise TypeError("mixattn.GmaCache: initial_state must be a pair (S, z) of tensors, "
                            f"got {type(initial_state).__name__}")
        S, z = initial_state
        for name, t in (("initial_state[0] (S)", S), ("initial_state[1] (z)", z)):
            if t.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"mixattn.GmaCache: {name} must be float32 or float64, got "
                                 f"{t.dtype}")
        self._handle = _C.gma_cache_from(S.detach().to(torch.float64),
                                         z.detach().to(torch.float64))

    def state(self):
        """Copies ``(S, z)`` of every (batch, head)'s prefix state, float64, as the copying form
        takes them (``initial_state=``), or None before the first call."""
        return _C.gma_cache_state(self._handle)
