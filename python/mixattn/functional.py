"""mixattn's operators on PyTorch tensors: registered operators (torch.ops.mixattn.*) with
autograd wired to the C++ backward passes (mixattn._ops), usable under torch.compile.

Layout: PyTorch's (batch, heads, tokens, dim). Every function accepts float32 or float64 CPU
tensors, contiguous or not: each input is made contiguous once (``Tensor.contiguous()``, a copy
only when it is not already) and that copy is what the forward reads and the backward reuses.
The (batch, head) pairs run in parallel on PyTorch's intra-op threads (``torch.get_num_threads()``).
Bad shapes, dtypes, devices or options raise ``ValueError`` naming the function and the
argument; so do NaN/Inf inputs unless ``check_finite=False`` (then they propagate to the outputs).
An argument of the wrong type (a list where a tensor belongs, a fractional block) raises
``TypeError`` naming it. Decoding caches (``cache=``, mixattn.OvqCache / mixattn.GmaCache) are
continued in place; see mixattn.cache.

The backward passes are the library's hand-derived ones (SPEC.md); they are first-order only
(double backward raises). Under torch.compile the functions trace into one graph (no break):
the checks that need tensor values (cu_seqlens' offsets, the finite checks) are the kernels',
made when the graph runs; decoding through a cache is eager-only (see mixattn.cache).
"""

import collections
import functools
import math
import threading
import weakref

import torch

from . import _C, _args
from ._ops import ops
from .cache import GmaCache, OvqCache, OvqState

__all__ = ["gma_attention", "ovq_attention", "flash_attention", "clear_prepared_cache",
           "release_memory"]


def _contiguous(*tensors):
    """Each input made contiguous once (a copy only if it is not already): the forward reads
    it and the backward reuses it."""
    return tuple(t.contiguous() for t in tensors)


def _compiling():
    return torch.compiler.is_compiling()


def _needs_record(*tensors):
    """Whether autograd will ask for a backward: only then does a forward keep its record (the
    responsibilities, normalisers and so on, several times the output's size)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def release_memory():
    """Frees the records of finished forwards that the kernels keep for reuse (the next forward
    of the same operator and dtype overwrites one instead of touching fresh memory; up to 16 per
    operator and dtype, as many as the forwards a training step holds at once). Records still
    held by an autograd graph are not affected. Never needed for correctness."""
    _C.release_kept_records()


class _PreparedCache:
    """The state path's prepared mixtures (the library's gma::Prepared per head, _C.gma_prepare),
    kept while the parameters are unchanged, so that decoding one token per call does not reduce
    the mixture (K r softplus and logs per head) on every call.

    An entry is keyed on each of mean, var_raw, prior_logit's identity, data pointer, version
    counter (``Tensor._version``, bumped by every in-place change: an optimizer step, copy_,
    load_state_dict), dtype, shape and strides, and on var_floor and check_finite; it holds the
    tensors only weakly and is found only while the very same tensor objects are alive. The
    kernel still checks every head's mixture against the fingerprint it was prepared from (the
    library's, O(K r) and far cheaper than preparing): a change the version counter does not see
    (through ``tensor.data``, as gradcheck perturbs its inputs) makes the call prepare as without
    the cache and drops the entry (forget()). At most `size` entries, least recently used first
    out. Calls from several threads take turns (a lock) over the entries."""

    def __init__(self, size=32):
        self.size, self.entries = size, collections.OrderedDict()
        self.hits = self.misses = self.stale = 0
        self.lock = threading.Lock()

    def get(self, mean, var_raw, prior_logit, var_floor, check_finite):
        with self.lock:
            return self._get(mean, var_raw, prior_logit, var_floor, check_finite)

    def _get(self, mean, var_raw, prior_logit, var_floor, check_finite):
        tensors = (mean, var_raw, prior_logit)

        def prepare():
            return _C.gma_prepare(*(t.detach().contiguous() for t in tensors), var_floor,
                                  check_finite)
        try:
            key = tuple((id(t), t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.stride())
                        for t in tensors) + (var_floor, check_finite)
        except (AttributeError, RuntimeError):  # no version counter (inference tensors)
            return prepare()
        entry = self.entries.get(key)
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors)):
            self.entries.move_to_end(key)
            self.hits += 1
            return entry[1]
        self.misses += 1
        prepared = prepare()
        for dead in [k for k, (refs, _) in self.entries.items() if any(r() is None for r in refs)]:
            del self.entries[dead]
        self.entries[key] = (tuple(weakref.ref(t) for t in tensors), prepared)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return prepared

    def forget(self, prepared):
        """Drops the entry holding `prepared` (found stale by the kernel)."""
        with self.lock:
            self.stale += 1
            for key in [k for k, (_, p) in self.entries.items() if p is prepared]:
                del self.entries[key]


_PREPARED = _PreparedCache()


def clear_prepared_cache():
    """Forgets every prepared mixture of gma_attention's state path (see its docstring), e.g. to
    free their memory; never needed for correctness (the kernel checks each against the
    mixture's fingerprint)."""
    with _PREPARED.lock:
        _PREPARED.entries.clear()


def _gma_state(fn, initial_state, q, v, mean, sequences=None):
    """initial_state as float64 (S, z), or zeros for None, checked against the call's shapes
    (one state per batch entry, or per sequence of a packed call: `sequences` of them)."""
    if q.dim() != 4 or v.dim() != 4 or mean.dim() != 3:
        return None  # the kernel's checks name the bad argument
    b, h, _, dv = v.shape
    if sequences is not None:
        b = sequences
    k = mean.shape[1]
    if initial_state is None:
        return (torch.zeros(b, h, k, dv, dtype=torch.float64),
                torch.zeros(b, h, k, dtype=torch.float64))
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise ValueError(f"{fn}: initial_state must be a pair (S, z) of tensors, S (B, H, K, d_v) "
                         f"and z (B, H, K), got {type(initial_state).__name__}")
    state = []
    for name, t, want in (("initial_state[0] (S)", initial_state[0], (b, h, k, dv)),
                          ("initial_state[1] (z)", initial_state[1], (b, h, k))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)} but must be {want} "
                             f"({'sequences' if sequences is not None else 'batch'}, heads, "
                             "components" + (", value dim)" if len(want) == 4 else ")"))
        if t.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{fn}: {name} must be float32 or float64, got {t.dtype}")
        state.append(t.to(torch.float64))  # differentiable; a no-op for float64
    return tuple(state)


def gma_attention(q, k, v, mean, var_raw, prior_logit, causal=False, eps=1e-6, var_floor=1e-4,
                  check_finite=True, initial_state=None, output_final_state=False,
                  cu_seqlens=None, cache=None):
    """Gaussian Mixture Attention (SPEC.md section 1), one routing mixture per head.

    q: (B, H, N, r); k: (B, H, M, r); v: (B, H, M, d_v); mean, var_raw: (H, K, r) (variance =
    softplus(var_raw) + var_floor); prior_logit: (H, K) (log prior = log_softmax). Returns
    (B, H, N, d_v). Bidirectional by default (M may differ from N); ``causal=True`` (M == N)
    lets token i see keys j <= i. eps floors the read-out denominator. Gradients flow to all
    six tensors; the mixture's are summed over the batch.

    Streaming (causal only, SPEC.md 1.4): the prefix state after t tokens is the pair
    ``(S, z)``, S = sum_j gamma_k,j v_j^T of shape (B, H, K, d_v) and z = sum_j gamma_k,j of shape
    (B, H, K), one per (batch, head), always float64 (the library's accumulation type, so it
    passes between calls without rounding). ``initial_state=(S, z)`` continues it (None: the
    empty state, zeros; float32 is accepted and widened); ``output_final_state=True`` returns
    ``(out, (S, z))`` with the state after this call's tokens. Running a sequence in pieces, each
    given the previous piece's final state, gives the one-call outputs up to rounding, and
    autograd carries gradients through the states: into ``initial_state`` and from any loss on
    the final state, back to q, k, v and the mixture. Decoding: the state path keeps the mixture
    reduced (the library's gma::Prepared per head) across calls while mean, var_raw and
    prior_logit are the same unchanged tensors (PyTorch's version counter: an optimizer step or
    any in-place change prepares it again; the kernel also checks the mixture's fingerprint, so a
    change through ``.data`` is seen too), so a one-token call costs only its own work.

    Packed variable-length input (as flash-linear-attention): ``cu_seqlens``, N + 1 offsets (a
    1-D int32/int64 tensor or a list), 0 first and T last, with q, k (1, H, T, r) and
    v (1, H, T, d_v) holding N sequences one after another along T; sequence i is tokens
    [cu_seqlens[i], cu_seqlens[i+1]) and attends only within itself (causal or not). The result
    equals N separate calls (the library's packed.hpp; pairs on torch.get_num_threads()
    threads). With initial_state / output_final_state as well (causal), every sequence has its
    own state: S (N, H, K, d_v) and z (N, H, K), sequence i continuing initial_state[.][i] and
    ending in final_state[.][i], as N separate streaming calls would (an empty sequence passes
    its state through unchanged).

    Decoding in place: ``cache=mixattn.GmaCache()`` (causal only; instead of initial_state /
    output_final_state) continues each (batch, head)'s prefix state held by the cache and
    updates it in place, nothing copied; one call runs every (batch, head), and each head's
    mixture stays prepared while mean, var_raw and prior_logit are the same unchanged tensors.
    The outputs are those of the copying form. With ``cu_seqlens`` the cache holds one state per
    sequence. See mixattn.GmaCache.
    """
    fn = "mixattn.gma_attention"
    _args.tensors(fn, _GMA_TENSORS, (q, k, v, mean, var_raw, prior_logit))
    causal, check_finite = _args.flag(fn, "causal", causal), _args.flag(fn, "check_finite",
                                                                         check_finite)
    eps, var_floor = _args.real(fn, "eps", eps), _args.real(fn, "var_floor", var_floor)
    output_final_state = _args.flag(fn, "output_final_state", output_final_state)
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    inputs = (q, k, v, mean, var_raw, prior_logit)
    if cache is not None:
        return _gma_cached(fn, inputs, causal, eps, var_floor, check_finite, initial_state,
                           output_final_state, cu, cache)
    _args.dense(fn, _GMA_TENSORS, inputs)
    if initial_state is None and not output_final_state:
        out, _ = ops.gma_forward(*_contiguous(*inputs), causal, eps, var_floor, check_finite,
                                 _needs_record(*inputs), cu_seqlens=cu)
        return out
    if not causal:
        raise ValueError(f"{fn}: initial_state and output_final_state need causal=True (the "
                         "state is a causal prefix; a bidirectional call has none)")
    out, S, z = _gma_streaming(fn, inputs, eps, var_floor, check_finite, initial_state, cu)
    return (out, (S, z)) if output_final_state else out


_GMA_TENSORS = ("q", "k", "v", "mean", "var_raw", "prior_logit")
_OVQ_TENSORS = ("q", "k", "v", "beta")


def _gma_streaming(fn, inputs, eps, var_floor, check_finite, initial_state, cu):
    """The copying form of the state path: (out, S, z)."""
    q, k, v, mean, var_raw, prior_logit = inputs
    sequences = None if cu is None else cu.shape[0] - 1
    state = _gma_state(fn, initial_state, q, v, mean, sequences)
    if state is None:  # q, v or mean of the wrong rank: let the kernel name it
        state = (torch.zeros(0, dtype=torch.float64),) * 2
    prepared = None
    # The prepared mixtures are found by the tensors' identity and version counters, which a
    # compiled graph cannot key on: it reduces the mixture in the call.
    if not _compiling() and q.dim() == 4 and all(
            t.dim() == d and t.dtype == q.dtype
            for t, d in ((mean, 3), (var_raw, 3), (prior_logit, 2))):
        prepared = _PREPARED.get(mean, var_raw, prior_logit, var_floor, check_finite)
    out, S, z, _ = ops.gma_forward_state(*_contiguous(*inputs, *state), eps, var_floor,
                                         check_finite, _needs_record(*inputs, *state),
                                         cu_seqlens=cu, prepared=prepared)
    if prepared is not None and _C.prepared_stale(prepared):
        _PREPARED.forget(prepared)
    return out, S, z


def _cache_arguments(fn, cache, kind, initial_state, output_final_state, causal=True):
    """The checks of a cache= call common to both operators."""
    if not isinstance(cache, kind):
        raise TypeError(f"{fn}: cache must be a mixattn.{kind.__name__}, got "
                        f"{type(cache).__name__}")
    if initial_state is not None or output_final_state:
        raise ValueError(f"{fn}: cache continues its own state; give either cache or "
                         "initial_state / output_final_state (the copying form), not both")
    if not causal:
        raise ValueError(f"{fn}: cache needs causal=True (the state is a causal prefix)")


@torch.compiler.disable
def _gma_cached(fn, inputs, causal, eps, var_floor, check_finite, initial_state,
                output_final_state, cu, cache):
    """Eager-only (see mixattn.cache): under torch.compile the call is left to eager PyTorch."""
    _cache_arguments(fn, cache, GmaCache, initial_state, output_final_state, causal)
    save = _needs_record(*inputs)
    if save:
        _args.dense(fn, _GMA_TENSORS, inputs)
        inputs = _contiguous(*inputs)
    return ops.gma_forward_cached(*inputs, cache._handle, eps, var_floor, check_finite, save,
                                  cu_seqlens=cu)[0]


def _make_ovq_options(block, max_centroids, growth, growth_alpha, seeding, assignment,
                      count_bias, grad_through_dictionary, norm_eps, check_finite):
    fn = "mixattn.ovq_attention"
    return (_args.integer(fn, "block", block), _args.integer(fn, "max_centroids", max_centroids),
            str(growth), _args.real(fn, "growth_alpha", growth_alpha), str(seeding),
            str(assignment),
            _args.flag(fn, "count_bias", count_bias),
            _args.flag(fn, "grad_through_dictionary", grad_through_dictionary),
            _args.real(fn, "norm_eps", norm_eps), _args.flag(fn, "check_finite", check_finite))


# The options checked once per distinct set of keyword values: a one-token decoding call would
# otherwise spend a noticeable part of its time on them.
_cached_ovq_options = functools.lru_cache(maxsize=64, typed=True)(_make_ovq_options)


def _ovq_options(*options):
    if _compiling():
        return _make_ovq_options(*options)
    try:
        return _cached_ovq_options(*options)
    except TypeError:  # an unhashable option, or one of the wrong type: _make names it
        return _make_ovq_options(*options)


def ovq_attention(q, k, v, beta, block=256, max_centroids=1024, growth="plateau",
                  growth_alpha=0.0, seeding="greedy_dispersion", assignment="all_centroids",
                  count_bias=True, grad_through_dictionary=True, norm_eps=1e-5,
                  check_finite=True, initial_state=None, output_final_state=False,
                  cu_seqlens=None, cache=None):
    """Online Vector-Quantized attention (SPEC.md section 2), causal, every sequence of the batch
    from an empty dictionary (or from ``initial_state``).

    q, k: (B, H, T, r); v: (B, H, T, d_v); beta: (H,), the per-head scale (logits use
    beta * sqrt(r)); a number is every head's beta, a list or NumPy array the per-head values
    (neither receives a gradient). Returns (B, H, T, d_v). Options are those of
    ``mixattn::ovq::Options``:
    block (C), max_centroids (N_max), growth ('plateau' or 'linear'), growth_alpha (0: N_max),
    seeding ('greedy_dispersion' or 'one_shot'), assignment ('all_centroids', or
    'existing_only': non-seed tokens join only centroids older than their block), count_bias,
    grad_through_dictionary (False:
    the dictionary is a constant for the backward), norm_eps. Gradients flow to q, k, v and
    beta (summed over the batch).

    Streaming: ``output_final_state=True`` returns ``(out, state)``, where state is an opaque
    ``mixattn.OvqState`` holding each (batch, head)'s dictionary and unfinished block (the
    library's ``ovq::State``); ``initial_state=state`` continues it (the object is copied, not
    changed, so it may be continued more than once). Every piece must have the state's dtype,
    B, H, r and d_v and the options that shape a dictionary (all but check_finite and
    grad_through_dictionary); others raise ValueError. Pieces carrying the state give the
    one-call outputs up to rounding.
    The state is forward only: NO gradient flows into or out of it (the library has no
    gradient with respect to a dictionary). Within a call, gradients still flow to q, k, v and
    beta, with the dictionary the call started from held constant.

    ``cu_seqlens``: packed variable-length sequences along T of (1, H, T, .) tensors, as in
    gma_attention; each sequence has its own dictionary (the state then holds one per
    (sequence, head), and continues a packed or a batched call with as many sequences).

    Decoding in place: ``cache=mixattn.OvqCache()`` (instead of initial_state /
    output_final_state) continues each (batch, head)'s dictionary held by the cache and updates
    it in place, nothing copied: the outputs of the copying form at the cost of the library's own
    decoding. See mixattn.OvqCache.
    """
    fn = "mixattn.ovq_attention"
    _args.tensors(fn, ("q", "k", "v"), (q, k, v))
    beta = _args.beta(fn, beta, q)
    options = _ovq_options(block, max_centroids, growth, growth_alpha, seeding, assignment,
                           count_bias, grad_through_dictionary, norm_eps, check_finite)
    output_final_state = _args.flag(fn, "output_final_state", output_final_state)
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    if cache is not None:
        return _ovq_cached(fn, q, k, v, beta, options, initial_state, output_final_state, cu,
                           cache)
    _args.dense(fn, _OVQ_TENSORS, (q, k, v, beta))
    if initial_state is not None and not isinstance(initial_state, OvqState):
        raise ValueError(f"{fn}: initial_state must be the state an earlier "
                         "ovq_attention(..., output_final_state=True) returned, got "
                         f"{type(initial_state).__name__}")
    start = None if initial_state is None else initial_state._handle
    out, _, end = ops.ovq_forward(*_contiguous(q, k, v, beta), *options,
                                  _needs_record(q, k, v, beta), initial_state=start,
                                  cu_seqlens=cu)
    return (out, OvqState(end)) if output_final_state else out


@torch.compiler.disable
def _ovq_cached(fn, q, k, v, beta, options, initial_state, output_final_state, cu, cache):
    """Eager-only (see mixattn.cache): under torch.compile the call is left to eager PyTorch."""
    _cache_arguments(fn, cache, OvqCache, initial_state, output_final_state)
    save = _needs_record(q, k, v, beta)
    if save:
        _args.dense(fn, _OVQ_TENSORS, (q, k, v, beta))
        q, k, v, beta = _contiguous(q, k, v, beta)
    return ops.ovq_forward_cached(q, k, v, beta, *options, cache._handle, save,
                                  cu_seqlens=cu)[0]


def flash_attention(q, k, v, causal=False, scale=None, check_finite=True, cu_seqlens=None):
    """Softmax attention softmax(scale q k^T + mask) v (SPEC.md section 3), tiled with an online
    softmax (O(N) memory, FlashAttention-2 schedule).

    q: (B, H, N, r); k: (B, H, M, r); v: (B, H, M, d_v). Returns (B, H, N, d_v).
    scale=None means 1/sqrt(r) (any other finite non-zero value is used as is); ``causal=True``
    (M == N) masks keys j > i.
    ``cu_seqlens``: packed variable-length sequences along T of (1, H, T, .) tensors, as in
    gma_attention.
    """
    fn = "mixattn.flash_attention"
    _args.tensors(fn, _OVQ_TENSORS[:3], (q, k, v))
    _args.dense(fn, _OVQ_TENSORS[:3], (q, k, v))
    causal, check_finite = _args.flag(fn, "causal", causal), _args.flag(fn, "check_finite",
                                                                         check_finite)
    if scale is None:
        scale = 0.0  # the library's "1/sqrt(r)"
    else:
        scale = _args.real(fn, "scale", scale)
        if scale == 0:
            raise ValueError(f"{fn}: scale is 0; use None for 1/sqrt(r)")
        if not math.isfinite(scale):
            raise ValueError(f"{fn}: scale is {scale}; it must be finite (None: 1/sqrt(r))")
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    out, _ = ops.flash_forward(*_contiguous(q, k, v), causal, scale, check_finite,
                               _needs_record(q, k, v), cu_seqlens=cu)
    return out
