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

__all__ = ["gma_attention", "ovq_attention", "flash_attention", "linear_attention",
           "performer_attention", "performer_features", "vq_attention",
           "sliding_window_attention", "gated_delta_rule", "rope", "clear_prepared_cache",
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


# --- the papers' baselines (SPEC 4-7) and RoPE (SPEC 8) -----------------------------------------

def _no_state(fn, initial_state, output_final_state, why):
    """The baselines have no state form in the library: initial_state / output_final_state are
    refused by name rather than ignored."""
    if initial_state is not None:
        raise ValueError(f"{fn}: initial_state is not supported: {why}")
    if _args.flag(fn, "output_final_state", output_final_state):
        raise ValueError(f"{fn}: output_final_state is not supported: {why}")


def _positive_scale(fn, scale, default):
    """scale=None: the library's default (0 to the kernel); otherwise a finite number > 0."""
    if scale is None:
        return 0.0
    scale = _args.real(fn, "scale", scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{fn}: scale is {scale}; it must be finite and > 0 (None: {default})")
    return scale


_NO_STATE = ("{} has no streaming state in the library (SPEC.md {}); run each sequence in one call "
             "(cu_seqlens packs sequences of different lengths into one)")


def linear_attention(q, k, v, causal=False, eps=1e-6, check_finite=True, initial_state=None,
                     output_final_state=False, cu_seqlens=None):
    """Linear attention (SPEC.md section 4; Katharopoulos et al. 2020) with the feature map
    phi(x) = elu(x) + 1: O_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i) . sum_j phi(k_j) + eps),
    the sums over every key (bidirectional, M may differ from N) or over j <= i
    (``causal=True``, M == N). O((N + M) r d_v), nothing N x M.

    q: (B, H, N, r); k: (B, H, M, r); v: (B, H, M, d_v). Returns (B, H, N, d_v). Gradients flow
    to q, k and v. ``cu_seqlens``: packed variable-length sequences along T of (1, H, T, .)
    tensors, as in gma_attention (each sequence attends within itself; equal to separate calls).
    No streaming state: ``initial_state`` and ``output_final_state=True`` raise ValueError.
    """
    fn = "mixattn.linear_attention"
    _args.tensors(fn, _OVQ_TENSORS[:3], (q, k, v))
    _args.dense(fn, _OVQ_TENSORS[:3], (q, k, v))
    _no_state(fn, initial_state, output_final_state, _NO_STATE.format("linear attention", "4.4"))
    causal, check_finite = _args.flag(fn, "causal", causal), _args.flag(fn, "check_finite",
                                                                         check_finite)
    eps = _args.real(fn, "eps", eps)
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    out, _ = ops.linear_forward(*_contiguous(q, k, v), causal, eps, check_finite,
                                _needs_record(q, k, v), cu_seqlens=cu)
    return out


def performer_features(heads, features, key_dim, seed=0, draw="orthogonal",
                       dtype=torch.float32):
    """Performer's random directions (SPEC.md 5.1) for ``heads`` heads: a (heads, features,
    key_dim) tensor, head h's W_h drawn as the library's
    ``performer::Features<double>::random(features, key_dim, seed + h, draw)`` (mt19937_64 and
    Box-Muller in double: the same W on every platform; float32 is the double draw rounded).
    ``draw``: 'orthogonal' (FAVOR+'s blocks of key_dim orthogonal rows, each scaled by an
    independent chi norm) or 'iid' (every entry N(0, 1)). Redraw with another seed as the paper
    does during training, or keep W fixed; a backward must see the W its forward saw."""
    fn = "mixattn.performer_features"
    heads, m = _args.integer(fn, "heads", heads), _args.integer(fn, "features", features)
    r, seed = _args.integer(fn, "key_dim", key_dim), _args.integer(fn, "seed", seed)
    if not 0 <= seed < 2**64 - max(heads, 0):
        raise ValueError(f"{fn}: seed is {seed}; it must be in [0, 2^64 - heads)")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{fn}: dtype must be torch.float32 or torch.float64, got {dtype}")
    if not isinstance(draw, str):
        raise TypeError(f"{fn}: draw must be 'orthogonal' or 'iid', got {draw!r}")
    return _C.performer_features(heads, m, r, seed, draw).to(dtype)


def performer_attention(q, k, v, features, causal=False, eps=1e-6, scale=None,
                        check_finite=True, initial_state=None, output_final_state=False,
                        cu_seqlens=None):
    """Performer attention with FAVOR+ positive random features (SPEC.md section 5;
    Choromanski et al. 2021): every row x of q and k gets the m features
    phi(x)_l = exp(s w_l . x - s^2 |x|^2 / 2 - c) / sqrt(m), whose products estimate
    exp(s^2 q . k), then linear attention's read-out (bidirectional or ``causal=True``).
    c is SPEC 5.2's stabiliser (a query row's largest exponent; one over all keys of a call).

    q: (B, H, N, r); k: (B, H, M, r); v: (B, H, M, d_v); features: (H, m, r), head h's
    directions W_h (performer_features draws them). scale: s (None: r^(-1/4), which estimates
    softmax attention's exp(q . k / sqrt(r))). Returns (B, H, N, d_v). Gradients flow to q, k
    and v; the features are a constant input (no gradient: one that requires a gradient is
    refused, pass ``features.detach()``). ``cu_seqlens`` as in linear_attention (each sequence
    has its own stabiliser, as a separate call would). No streaming state: the keys' stabiliser
    is taken over the whole call (SPEC 5.2), and ``initial_state`` / ``output_final_state=True``
    raise ValueError.
    """
    fn = "mixattn.performer_attention"
    names = (*_OVQ_TENSORS[:3], "features")
    _args.tensors(fn, names, (q, k, v, features))
    _args.dense(fn, names, (q, k, v, features))
    _no_state(fn, initial_state, output_final_state, _NO_STATE.format("Performer", "5.2"))
    if features.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{fn}: features requires a gradient, but the directions are a constant "
                         "input (SPEC.md 5.1: none flows to them); pass features.detach()")
    causal, check_finite = _args.flag(fn, "causal", causal), _args.flag(fn, "check_finite",
                                                                         check_finite)
    eps, scale = _args.real(fn, "eps", eps), _positive_scale(fn, scale, "r^(-1/4)")
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    out, _ = ops.performer_forward(*_contiguous(q, k, v, features), causal, eps, scale,
                                   check_finite, _needs_record(q, k, v), cu_seqlens=cu)
    return out


def vq_attention(q, k, v, codebook, causal=False, eps=1e-6, scale=None, check_finite=True,
                 initial_state=None, output_final_state=False, cu_seqlens=None):
    """Static-codebook vector-quantised attention (SPEC.md section 6; Transformer-VQ, Lingle
    2023): every key is replaced by its nearest code k^_j = C_{z_j}, z_j = argmin_s |k_j - C_s|^2
    (ties to the lowest s), and every query attends over the quantised keys with softmax
    weights e^(tau q_i . k^_j), bidirectionally or ``causal=True``; computed in linear time as
    attention over the S codes with a log-count bias.

    q: (B, H, N, r); k: (B, H, M, r); v: (B, H, M, d_v); codebook: (H, S, r), head h's codes.
    scale: tau (None: 1/sqrt(r)). Returns (B, H, N, d_v). Gradients flow to q, v and the
    codebook (exact; summed over the batch), and to k straight through the quantiser (SPEC 6.3:
    the gradient with respect to k^, as k^ = k + stop_gradient(C_z - k); the output itself does
    not change with k between ties). ``cu_seqlens`` as in linear_attention. The codebook is
    static within a call: no streaming state, and ``initial_state`` /
    ``output_final_state=True`` raise ValueError.
    """
    fn = "mixattn.vq_attention"
    names = (*_OVQ_TENSORS[:3], "codebook")
    _args.tensors(fn, names, (q, k, v, codebook))
    _args.dense(fn, names, (q, k, v, codebook))
    _no_state(fn, initial_state, output_final_state,
              _NO_STATE.format("static VQ attention", "6.4"))
    causal, check_finite = _args.flag(fn, "causal", causal), _args.flag(fn, "check_finite",
                                                                         check_finite)
    eps, scale = _args.real(fn, "eps", eps), _positive_scale(fn, scale, "1/sqrt(r)")
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    out, _ = ops.vq_forward(*_contiguous(q, k, v, codebook), causal, eps, scale, check_finite,
                            _needs_record(q, k, v, codebook), cu_seqlens=cu)
    return out


def sliding_window_attention(q, k, v, window=256, scale=None, check_finite=True,
                             initial_state=None, output_final_state=False, cu_seqlens=None):
    """Sliding-window causal softmax attention (SPEC.md section 7; Longformer's and Mistral's
    local attention): query i attends to the ``window`` keys i - window < j <= i,
    softmax(scale q k^T + band mask) v, on the tiled kernels of flash_attention, which skip the
    key tiles outside every window: O(N window (r + d_v)).

    q, k: (B, H, N, r); v: (B, H, N, d_v) (as many keys as queries: it is causal). window >= 1
    (window >= N is causal softmax attention); scale=None means 1/sqrt(r). Returns
    (B, H, N, d_v). Gradients flow to q, k and v. ``cu_seqlens`` as in linear_attention. No
    streaming state (no cache of the last window keys): ``initial_state`` /
    ``output_final_state=True`` raise ValueError.
    """
    fn = "mixattn.sliding_window_attention"
    _args.tensors(fn, _OVQ_TENSORS[:3], (q, k, v))
    _args.dense(fn, _OVQ_TENSORS[:3], (q, k, v))
    _no_state(fn, initial_state, output_final_state,
              _NO_STATE.format("sliding-window attention", "7"))
    window = _args.integer(fn, "window", window)
    if window < 1:
        raise ValueError(f"{fn}: window is {window}; it must be >= 1")
    check_finite = _args.flag(fn, "check_finite", check_finite)
    if scale is None:
        scale = 0.0  # the library's "1/sqrt(r)"
    else:
        scale = _args.real(fn, "scale", scale)
        if scale == 0 or not math.isfinite(scale):
            raise ValueError(f"{fn}: scale is {scale}; it must be finite and non-zero "
                             "(None: 1/sqrt(r))")
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    out, _ = ops.window_forward(*_contiguous(q, k, v), window, scale, check_finite,
                                _needs_record(q, k, v), cu_seqlens=cu)
    return out


_DELTA_TENSORS = ("q", "k", "v", "g", "beta")


def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64,
                     check_finite=True):
    """The gated delta rule (SPEC.md section 9; Gated DeltaNet, Yang, Kautz & Hatamizadeh 2024),
    causal, with flash-linear-attention's chunk_gated_delta_rule keywords. Per (batch, head) a
    state S (d_k x d_v) is decayed, corrected towards each key's value and read:

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T,   o_t = scale S_t^T q_t

    q, k: (B, H, N, d_k); v: (B, H, N, d_v); g (log decay, <= 0) and beta (in [0, 1]): (B, H, N).
    scale: None is 1/sqrt(d_k) (else finite and > 0). ``use_qk_l2norm_in_kernel=True``
    normalises q and k inside (x / sqrt(|x|^2 + 1e-6)), with the gradient through it; without it
    the keys' norms are the caller's (the rule is contractive while beta_t |k_t|^2 <= 2).
    ``chunk_size``: the chunk length C of the chunked form (SPEC 9.2), >= 1; it changes only
    the rounding. Returns ``(o, final_state)``: o (B, H, N, d_v) in q's dtype, final_state the
    state after the last token, (B, H, d_k, d_v) float64 (the library's accumulation type, for
    float32 inputs too, so it passes between calls unrounded), or None unless
    ``output_final_state=True``.

    ``initial_state`` (B, H, d_k, d_v; None: zeros; float32 is widened) is the state to continue:
    running a sequence in pieces, each given the previous piece's final state, gives the
    one-call outputs up to rounding. Gradients flow to q, k, v, g, beta and initial_state, and
    from a loss on final_state back to all of them. The backward is first-order only.

    ``cu_seqlens``: packed variable-length sequences along T of (1, H, T, .) tensors and (1, H, T)
    gates, as in gma_attention (the library's packed entry points); each sequence has its own
    state: initial_state and final_state are then (N, H, d_k, d_v) for N sequences.
    g > 0 or beta outside [0, 1] raise ValueError naming them (always: the chunked form's
    decays rest on them); NaN/Inf too unless ``check_finite=False``.
    """
    fn = "mixattn.gated_delta_rule"
    _args.tensors(fn, _DELTA_TENSORS, (q, k, v, g, beta))
    _args.dense(fn, _DELTA_TENSORS, (q, k, v, g, beta))
    scale = _positive_scale(fn, scale, "1/sqrt(d_k)")
    normalize = _args.flag(fn, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    chunk = _args.integer(fn, "chunk_size", chunk_size)
    if chunk < 1:
        raise ValueError(f"{fn}: chunk_size is {chunk}; it must be >= 1")
    check_finite = _args.flag(fn, "check_finite", check_finite)
    output_final_state = _args.flag(fn, "output_final_state", output_final_state)
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, q)
    start = None
    if initial_state is not None:
        _args.tensors(fn, ("initial_state",), (initial_state,))
        _args.dense(fn, ("initial_state",), (initial_state,))
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{fn}: initial_state must be float32 or float64, got "
                             f"{initial_state.dtype}")
        start = initial_state.to(torch.float64).contiguous()  # differentiable; a no-op for float64
    out, final, _ = ops.delta_forward(*_contiguous(q, k, v, g, beta), scale, normalize, chunk,
                                      check_finite, _needs_record(q, k, v, g, beta, start),
                                      initial_state=start, cu_seqlens=cu)
    return out, (final if output_final_state else None)


def rope(x, start=0, base=10000.0, check_finite=True, cu_seqlens=None):
    """Rotary position embedding (SPEC.md section 8; RoFormer): row n of every (batch, head) of
    x (B, H, N, r), r even, is the token at position p = start + n, and each pair of adjacent
    columns (2i, 2i + 1) is rotated by the angle p theta_i, theta_i = base^(-2i/r) (the
    interleaved convention of RoFormer and LLaMA's reference code; angles and their sines in
    double). Apply it to q and k before attention: q_m . k_n then depends on the positions only
    through n - m. Returns a tensor like x.

    ``start``: the first row's position (e.g. the tokens already decoded). ``cu_seqlens``: x is
    (1, H, T, r) holding sequences one after another along T, and positions restart at
    ``start`` in every sequence. Gradients flow to x (the inverse rotation); RoPE
    differentiates to any order. Positions and base get no gradient.
    """
    fn = "mixattn.rope"
    _args.tensors(fn, ("x",), (x,))
    _args.dense(fn, ("x",), (x,))
    if not isinstance(start, torch.SymInt):
        start = _args.integer(fn, "start", start)
        if not -2**63 <= start < 2**63:
            raise ValueError(f"{fn}: start is {start}; it must fit in a 64-bit integer")
    check_finite = _args.flag(fn, "check_finite", check_finite)
    base = _args.real(fn, "base", base)
    if not _compiling():  # traced, base may be symbolic: the kernel checks it when the graph runs
        if not (math.isfinite(base) and base > 0):
            raise ValueError(f"{fn}: base is {base}; it must be finite and > 0")
    cu = None if cu_seqlens is None else _args.offsets(fn, cu_seqlens, x)
    (x,) = _contiguous(x)
    return ops.rope_forward(x, start, base, check_finite, cu_seqlens=cu)
