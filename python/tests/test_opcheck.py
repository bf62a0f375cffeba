"""torch.library.opcheck over every registered operator (torch.ops.mixattn.*): the schema (no
unannotated mutation or aliasing), the autograd registration, the fake implementation against
the kernel (shapes, strides, dtypes) and AOTAutograd with dynamic shapes against eager (outputs
and gradients), each over several shapes: bidirectional and causal, M != N, packed, streaming
with states, OVQ with and without gradients through the dictionary; the baselines (linear,
Performer, static VQ, sliding window) bidirectional, causal and packed; the gated delta rule
plain, continuing a state, normalising q and k, and packed; RoPE and its inverse.

The cache forwards skip the AOT check: decoding through a cache is eager-only (mixattn.cache
says why) and a cache advances on every call, so two runs of one call cannot agree.

The checks run the operators on copies of their inputs. A copy of a handle owns nothing: a
copied OVQ state or cache is found through the key in its bytes while the original lives, a
copied record is computed again by the backward from its inputs (both tested below)"""

import pytest
import torch
from torch.library import opcheck

import mixattn  # noqa: F401  (registers the operators)
from test_functional import flash_inputs, gma_inputs, ovq_inputs

ops = torch.ops.mixattn
DOUBLE = torch.float64
GMA_OPTIONS = (1e-6, 1e-4, True)  # eps, var_floor, check_finite
OVQ_OPTIONS = {"plateau": (4, 6, "plateau", 0.0, "greedy_dispersion", "all_centroids", True),
               "linear": (3, 8, "linear", 0.0, "one_shot", "existing_only", False)}


def ovq_options(kind, grad_through_dictionary):
    return (*OVQ_OPTIONS[kind], grad_through_dictionary, 1e-5, True)


def detached(tensors):
    return [t.detach() for t in tensors]


def cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int64)


def gma_forward_cases():
    for name, (b, n, m, causal, packed) in {
            "bidir M!=N": (2, 7, 5, False, None), "causal": (2, 9, 9, True, None),
            "packed causal": (1, 10, 10, True, cu(0, 3, 3, 10)),
            "packed bidir": (1, 8, 8, False, cu(0, 5, 8))}.items():
        inputs = gma_inputs(b, 2, n, m, 3, 4, 5, seed=len(name))
        yield name, (*inputs, causal, *GMA_OPTIONS, True, packed)


def gma_state_cases():
    for name, (b, n, packed, seqs) in {"batched": (2, 6, None, 2),
                                       "packed": (1, 9, cu(0, 4, 9), 2)}.items():
        inputs = gma_inputs(b, 2, n, n, 3, 4, 5, seed=20 + len(name))
        gen = torch.Generator().manual_seed(7)
        S0 = torch.randn(seqs, 2, 5, 4, generator=gen, dtype=DOUBLE).requires_grad_()
        z0 = torch.rand(seqs, 2, 5, generator=gen, dtype=DOUBLE).add_(0.5).requires_grad_()
        yield name, (*inputs, S0, z0, *GMA_OPTIONS, True, packed, None)


def ovq_forward_cases():
    for kind in OVQ_OPTIONS:
        for through in (True, False):
            inputs = ovq_inputs(2, 2, 11, 3, 4, seed=30 + through)
            yield f"{kind} grad_through_dictionary={through}", (
                *inputs, *ovq_options(kind, through), True, None, None)
    inputs = ovq_inputs(1, 2, 12, 3, 4, seed=33)
    yield "packed", (*inputs, *ovq_options("plateau", True), True, None, cu(0, 5, 12))
    # Continuing a state: the first piece's end state is the second's initial_state.
    first = ovq_inputs(2, 2, 7, 3, 4, seed=34)
    with torch.no_grad():
        _, _, state = ops.ovq_forward(*first, *ovq_options("plateau", True), False, None, None)
    inputs = ovq_inputs(2, 2, 6, 3, 4, seed=35)
    yield "streaming", (*inputs, *ovq_options("plateau", True), True, state, None)


def flash_forward_cases():
    for name, (b, n, m, causal, scale, packed) in {
            "bidir M!=N": (2, 9, 13, False, 0.0, None), "causal": (2, 11, 11, True, 0.4, None),
            "packed": (1, 12, 12, True, 0.0, cu(0, 2, 12))}.items():
        yield name, (*flash_inputs(b, 2, n, m, 4, 3, seed=40 + len(name)), causal, scale, True,
                     True, packed)


# (name, (B, N, M, causal, cu_seqlens)) of the baselines' calls: bidirectional with M != N,
# causal, packed with an empty sequence.
BASELINE_SHAPES = {"bidir M!=N": (2, 7, 10, False, None), "causal": (2, 9, 9, True, None),
                   "packed": (1, 11, 11, True, cu(0, 4, 4, 11))}


def baseline_forward_cases():
    """(operator, case, arguments) of linear_forward, performer_forward, vq_forward and
    window_forward (causal only: its cases with M == N)."""
    for name, (b, n, m, causal, packed) in BASELINE_SHAPES.items():
        q, k, v = flash_inputs(b, 2, n, m, 4, 3, seed=80 + len(name))
        gen = torch.Generator().manual_seed(81)
        w = torch.randn(2, 5, 4, generator=gen, dtype=DOUBLE)  # N(0, 1) directions: a constant
        codes = torch.randn(2, 6, 4, generator=gen, dtype=DOUBLE).requires_grad_()
        yield "linear_forward", name, (q, k, v, causal, 1e-6, True, True, packed)
        yield "performer_forward", name, (q, k, v, w, causal, 1e-6, 0.0, True, True, packed)
        yield "vq_forward", name, (q, k, v, codes, causal, 1e-6, 0.7, True, True, packed)
        if causal:
            yield "window_forward", name, (q, k, v, 3, 0.0, True, True, packed)


def delta_forward_cases():
    """Plain, continuing a state (gradients into it), with the queries and keys normalised
    inside, and packed with an empty sequence and one state per sequence."""
    from test_delta import delta_inputs
    for name, (b, n, start, normalize, packed) in {
            "plain": (2, 9, False, False, None), "state": (2, 7, True, False, None),
            "l2norm": (2, 8, True, True, None),
            "packed": (1, 11, True, False, cu(0, 4, 4, 11))}.items():
        q, k, v, g, beta = delta_inputs(b, 2, n, 3, 4, seed=85 + len(name))
        S0 = None
        if start:
            streams = b if packed is None else packed.shape[0] - 1
            gen = torch.Generator().manual_seed(86)
            S0 = torch.randn(streams, 2, 3, 4, generator=gen, dtype=DOUBLE).requires_grad_()
        yield name, (q, k, v, g, beta, 0.0, normalize, 3, True, True, S0, packed)


def rope_cases():
    for name, (b, n, start, packed) in {"batched": (2, 6, 0, None), "start": (2, 5, 9, None),
                                        "packed": (1, 10, 3, cu(0, 3, 3, 10))}.items():
        (x,) = flash_inputs(b, 2, n, n, 6, 6, seed=90 + len(name))[:1]
        yield name, (x, start, 500.0, True, packed)


FORWARDS = ([("gma_forward", n, a) for n, a in gma_forward_cases()]
            + [("gma_forward_state", n, a) for n, a in gma_state_cases()]
            + [("ovq_forward", n, a) for n, a in ovq_forward_cases()]
            + [("flash_forward", n, a) for n, a in flash_forward_cases()]
            + list(baseline_forward_cases())
            + [("delta_forward", n, a) for n, a in delta_forward_cases()]
            + [("rope_forward", n, a) for n, a in rope_cases()]
            + [("rope_backward", n, a) for n, a in rope_cases()])


@pytest.mark.parametrize("op,case,args", FORWARDS, ids=[f"{o}[{c}]" for o, c, _ in FORWARDS])
def test_forward_operators(op, case, args):
    opcheck(getattr(ops, op).default, args)


def backward_cases():
    """Each backward operator with a record from its forward, inputs needing no gradient (the
    backward operators are first-order only: their own autograd raises)."""
    for _, args in gma_forward_cases():
        args = (*detached(args[:6]), *args[6:])
        out, saved = ops.gma_forward(*args)
        yield "gma_backward", (*args[:6], torch.randn_like(out), saved, *args[6:10], args[11])
    for _, args in gma_state_cases():
        args = (*detached(args[:8]), *args[8:])
        out, S, z, saved = ops.gma_forward_state(*args)
        yield "gma_backward_state", (*args[:8], torch.randn_like(out), torch.randn_like(S),
                                     None, saved, *args[8:11], args[12])
    for _, args in ovq_forward_cases():
        args = (*detached(args[:4]), *args[4:])
        out, saved, _ = ops.ovq_forward(*args)
        yield "ovq_backward", (*args[:4], torch.randn_like(out), saved, *args[4:14], args[15],
                               args[16])
    for _, args in flash_forward_cases():
        args = (*detached(args[:3]), *args[3:])
        out, saved = ops.flash_forward(*args)
        yield "flash_backward", (*args[:3], torch.randn_like(out), saved, *args[3:6], args[7])
    for op, _, args in baseline_forward_cases():
        tensors = 4 if op in ("performer_forward", "vq_forward") else 3
        args = (*detached(args[:tensors]), *args[tensors:])
        out, saved = getattr(ops, op)(*args)
        yield op.replace("forward", "backward"), (*args[:tensors], torch.randn_like(out), saved,
                                                  *args[tensors:-2], args[-1])


    for _, args in delta_forward_cases():
        args = (*detached(args[:5]), *args[5:10],
                None if args[10] is None else args[10].detach(), args[11])
        out, S, saved = ops.delta_forward(*args)
        yield "delta_backward", (*args[:5], torch.randn_like(out), saved, *args[5:9],
                                 torch.randn_like(S), args[10], args[11])


BACKWARDS = list(backward_cases())


@pytest.mark.parametrize("op,args", BACKWARDS, ids=[f"{o}[{i}]" for i, (o, _) in
                                                    enumerate(BACKWARDS)])
def test_backward_operators(op, args):
    opcheck(getattr(ops, op).default, args)


def test_a_copied_record_is_computed_again_or_refused_by_name():
    """A record's copy owns nothing: the backward runs the forward again where its inputs
    suffice (the same gradients) and refuses by name where they do not (a cache call's record
    holds the start state that only the cache had)."""
    q, k, v, *mix = detached(gma_inputs(2, 2, 7, 7, 3, 4, 5, seed=70))
    out, saved = ops.gma_forward(q, k, v, *mix, True, *GMA_OPTIONS, True, None)
    g = torch.randn_like(out)
    grads = ops.gma_backward(q, k, v, *mix, g, saved, True, *GMA_OPTIONS, None)
    again = ops.gma_backward(q, k, v, *mix, g, saved.clone(), True, *GMA_OPTIONS, None)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)
    x = detached(ovq_inputs(2, 2, 5, 3, 4, seed=72))
    cache = mixattn.OvqCache()
    out, saved = ops.ovq_forward_cached(*x, *ovq_options("plateau", True), cache._handle, True,
                                        None)
    with pytest.raises(ValueError, match="saved is a copy of a ovq-cache/Double record"):
        ops.ovq_backward(*x, torch.ones_like(out), saved.clone(), *ovq_options("plateau", True),
                         None, None)


def test_a_copied_state_is_found_while_the_original_lives():
    first = detached(ovq_inputs(2, 2, 7, 3, 4, seed=73))
    options = ovq_options("plateau", True)
    _, _, state = ops.ovq_forward(*first, *options, False, None, None)
    copy = state.clone()
    x = detached(ovq_inputs(2, 2, 6, 3, 4, seed=74))
    assert torch.equal(ops.ovq_forward(*x, *options, False, state, None)[0],
                       ops.ovq_forward(*x, *options, False, copy, None)[0])
    del state
    with pytest.raises(ValueError, match="initial_state must be the state an earlier"):
        ops.ovq_forward(*x, *options, False, copy, None)
