"""Decoding caches (mixattn.OvqCache, mixattn.GmaCache): a call continues the cache's states in
place. Token by token, and in pieces, they give the copying form's outputs and states bit for bit
(the same library calls on the same state values), and the one-call outputs to rounding; they
branch (copy), export and import states, follow parameter changes, carry gradients within a call,
and refuse a call of other shapes, options or dtype, leaving the cache as it was."""

import threading

import numpy as np
import pytest
import torch

import eager
import mixattn
from test_functional import DOUBLE, assert_rel, gma_inputs, ovq_inputs
from test_streaming import PIECES_REL

OVQ = dict(block=4, max_centroids=6)


def tokens(x, a, b):
    return x[:, :, a:b]


def ovq_copying(q, k, v, beta, cuts, start=None, **opts):
    """The copying form over the pieces between `cuts`: (outputs, final state)."""
    state, outs = start, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        out, state = mixattn.ovq_attention(tokens(q, a, b), tokens(k, a, b), tokens(v, a, b),
                                           beta, initial_state=state, output_final_state=True,
                                           **opts)
        outs.append(out)
    return torch.cat(outs, 2), state


def ovq_cached(q, k, v, beta, cuts, cache, **opts):
    return torch.cat([mixattn.ovq_attention(tokens(q, a, b), tokens(k, a, b), tokens(v, a, b),
                                            beta, cache=cache, **opts)
                      for a, b in zip(cuts[:-1], cuts[1:])], 2)


def gma_copying(inputs, cuts, start=None, **opts):
    q, k, v, *mix = inputs
    state, outs = start, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        out, state = mixattn.gma_attention(tokens(q, a, b), tokens(k, a, b), tokens(v, a, b),
                                           *mix, causal=True, initial_state=state,
                                           output_final_state=True, **opts)
        outs.append(out)
    return torch.cat(outs, 2), state


def gma_cached(inputs, cuts, cache, **opts):
    q, k, v, *mix = inputs
    return torch.cat([mixattn.gma_attention(tokens(q, a, b), tokens(k, a, b), tokens(v, a, b),
                                            *mix, causal=True, cache=cache, **opts)
                      for a, b in zip(cuts[:-1], cuts[1:])], 2)


def detached(xs):
    return [x.detach() for x in xs]


# --- the copying form's outputs, bit for bit ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ovq_cache_token_by_token_equals_the_copying_form(dtype):
    q, k, v, beta = (x.to(dtype) for x in detached(ovq_inputs(3, 4, 23, 4, 3, seed=401)))
    cuts = list(range(24))
    cache = mixattn.OvqCache()
    with torch.no_grad():
        ours = ovq_cached(q, k, v, beta, cuts, cache, **OVQ)
        theirs, state = ovq_copying(q, k, v, beta, cuts, **OVQ)
        one = mixattn.ovq_attention(q, k, v, beta, **OVQ)
    assert torch.equal(ours, theirs)
    assert cache.tokens_seen == [23, 23, 23] and state.tokens_seen == [23] * 12
    # The states agree too: a continuation of each gives the same bits.
    more = detached(ovq_inputs(3, 4, 6, 4, 3, seed=402))[:3]
    more = [x.to(dtype) for x in more]
    a = mixattn.ovq_attention(*more, beta, cache=cache, **OVQ)
    b = mixattn.ovq_attention(*more, beta, initial_state=state, **OVQ)
    assert torch.equal(a, b)
    # float64: one call to rounding (PIECES_REL, test_streaming); float32's own rounding
    # (2^-24 through the running means) is checked at 1e-5 of the largest entry.
    assert_rel(ours.double(), one.double(), "ovq cache vs one call",
               rel=PIECES_REL if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gma_cache_token_by_token_equals_the_copying_form(dtype):
    inputs = [x.to(dtype) for x in detached(gma_inputs(2, 3, 19, 19, 5, 4, 6, seed=411))]
    cuts = list(range(20))
    cache = mixattn.GmaCache()
    with torch.no_grad():
        ours = gma_cached(inputs, cuts, cache)
        theirs, (S, z) = gma_copying(inputs, cuts)
        one = mixattn.gma_attention(*inputs, causal=True)
    assert torch.equal(ours, theirs)
    S_c, z_c = cache.state()
    assert torch.equal(S_c, S) and torch.equal(z_c, z) and S_c.dtype == DOUBLE
    assert cache.tokens_seen == [19, 19]
    assert_rel(ours.double(), one.double(), "gma cache vs one call",
               rel=PIECES_REL if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("cuts", [[0, 5, 6, 13, 23], [0, 23], [0, 4, 8, 23]])
def test_caches_in_pieces_equal_the_copying_form(cuts):
    q, k, v, beta = detached(ovq_inputs(2, 2, 23, 4, 3, seed=421))
    with torch.no_grad():
        assert torch.equal(ovq_cached(q, k, v, beta, cuts, mixattn.OvqCache(), **OVQ),
                           ovq_copying(q, k, v, beta, cuts, **OVQ)[0])
    inputs = detached(gma_inputs(2, 2, 23, 23, 4, 3, 5, seed=422))
    with torch.no_grad():
        assert torch.equal(gma_cached(inputs, cuts, mixattn.GmaCache()),
                           gma_copying(inputs, cuts)[0])


def test_caches_of_packed_calls_equal_the_copying_form():
    # Ragged streams continued call after call: each call packs one piece of every sequence.
    pieces = [[0, 3, 3, 7], [0, 1, 5, 6], [0, 0, 2, 2]]  # cu_seqlens of each call
    q, k, v, beta = detached(ovq_inputs(1, 2, 7, 4, 3, seed=431))
    gq, gk, gv, *mix = detached(gma_inputs(1, 2, 7, 7, 4, 3, 5, seed=432))
    ovq_cache, gma_cache = mixattn.OvqCache(), mixattn.GmaCache()
    ovq_state = gma_state = None
    with torch.no_grad():
        for cu in pieces:
            t = cu[-1]
            x = [y[:, :, :t] for y in (q, k, v)]
            a = mixattn.ovq_attention(*x, beta, cu_seqlens=cu, cache=ovq_cache, **OVQ)
            b, ovq_state = mixattn.ovq_attention(*x, beta, cu_seqlens=cu, initial_state=ovq_state,
                                                 output_final_state=True, **OVQ)
            assert torch.equal(a, b)
            x = [y[:, :, :t] for y in (gq, gk, gv)]
            a = mixattn.gma_attention(*x, *mix, causal=True, cu_seqlens=cu, cache=gma_cache)
            b, gma_state = mixattn.gma_attention(*x, *mix, causal=True, cu_seqlens=cu,
                                                 initial_state=gma_state, output_final_state=True)
            assert torch.equal(a, b)
    assert ovq_cache.tokens_seen == [4, 6, 5]  # 3 + 1 + 0, 0 + 4 + 2, 4 + 1 + 0
    assert all(torch.equal(x, y) for x, y in zip(gma_cache.state(), gma_state))


def test_modules_decode_token_by_token_with_a_cache():
    torch.manual_seed(5)
    gma = mixattn.GaussianMixtureAttention(12, heads=3, components=5, causal=True, key_dim=3,
                                           value_dim=2, dtype=DOUBLE)
    ovq = mixattn.OnlineVQAttention(8, heads=2, key_dim=4, value_dim=3, dtype=DOUBLE, **OVQ)
    for layer, cache, width in ((gma, mixattn.GmaCache(), 12), (ovq, mixattn.OvqCache(), 8)):
        x = torch.randn(2, 11, width, dtype=DOUBLE)
        with torch.no_grad():
            whole = layer(x)
            steps = torch.cat([layer(x[:, t:t + 1], cache=cache) for t in range(11)], 1)
        assert_rel(steps, whole, f"{type(layer).__name__} decoded with a cache",
                   rel=PIECES_REL)
    with pytest.raises(ValueError, match="cache needs causal=True"):
        mixattn.GaussianMixtureAttention(12, heads=3, components=5)(
            torch.randn(1, 1, 12), cache=mixattn.GmaCache())


# --- branching, export and import --------------------------------------------------------------

def test_copy_branches_and_state_round_trips():
    q, k, v, beta = detached(ovq_inputs(2, 2, 14, 4, 3, seed=441))
    inputs = detached(gma_inputs(2, 2, 14, 14, 4, 3, 5, seed=442))
    other = detached(ovq_inputs(2, 2, 5, 4, 3, seed=443))[:3]
    g_other = detached(gma_inputs(2, 2, 5, 5, 4, 3, 5, seed=444))[:3]
    with torch.no_grad():
        oc, gc = mixattn.OvqCache(), mixattn.GmaCache()
        ovq_cached(q, k, v, beta, [0, 9], oc, **OVQ)
        gma_cached(inputs, [0, 9], gc)
        # A branch goes on with other tokens first; the original is not moved by it.
        o_branch, g_branch = oc.copy(), gc.copy()
        mixattn.ovq_attention(*other, beta, cache=o_branch, **OVQ)
        mixattn.gma_attention(*g_other, *inputs[3:], causal=True, cache=g_branch)
        assert o_branch.tokens_seen == [14, 14] and oc.tokens_seen == [9, 9]
        main_o = ovq_cached(q, k, v, beta, [9, 14], oc, **OVQ)
        main_g = gma_cached(inputs, [9, 14], gc)
        # Caches made from the copying form's state at token 9 continue as the original did.
        restart_o = mixattn.OvqCache(ovq_copying(q, k, v, beta, [0, 9], **OVQ)[1])
        restart_g = mixattn.GmaCache(initial_state=gma_copying(inputs, [0, 9])[1])
        assert torch.equal(ovq_cached(q, k, v, beta, [9, 14], restart_o, **OVQ), main_o)
        assert torch.equal(gma_cached(inputs, [9, 14], restart_g), main_g)
        # The copying form continues a cache's state() as the cache itself does.
        a = mixattn.ovq_attention(*other, beta, initial_state=oc.state(), **OVQ)
        assert torch.equal(a, mixattn.ovq_attention(*other, beta, cache=oc, **OVQ))
        a = mixattn.gma_attention(*g_other, *inputs[3:], causal=True, initial_state=gc.state())
        assert torch.equal(a, mixattn.gma_attention(*g_other, *inputs[3:], causal=True,
                                                    cache=gc))
    assert mixattn.OvqCache().state() is None and mixattn.GmaCache().state() is None


def test_gma_cache_from_a_float32_state_and_a_wrong_one():
    inputs = detached(gma_inputs(1, 2, 6, 6, 3, 2, 4, seed=451))
    S0 = torch.rand(1, 2, 4, 2, dtype=torch.float32)
    z0 = torch.rand(1, 2, 4, dtype=torch.float32) + 0.5
    with torch.no_grad():
        a = mixattn.gma_attention(*inputs, causal=True,
                                  cache=mixattn.GmaCache(initial_state=(S0, z0)))
        b = mixattn.gma_attention(*inputs, causal=True, initial_state=(S0, z0))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"cache starts from an initial state S of shape "
                                         r"\[1, 2, 4, 2\]"):
        mixattn.gma_attention(*inputs[:3], *(x[:, :3] for x in inputs[3:5]), inputs[5][:, :3],
                              causal=True, cache=mixattn.GmaCache(initial_state=(S0, z0)))
    with pytest.raises(TypeError, match=r"mixattn.GmaCache: initial_state must be a pair"):
        mixattn.GmaCache(initial_state=S0)
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(z\) has shape"):
        mixattn.GmaCache(initial_state=(S0, z0[:, :1]))
    with pytest.raises(TypeError, match=r"mixattn.OvqCache: initial_state must be the state"):
        mixattn.OvqCache((S0, z0))


# --- the mixture prepared once, and its changes ------------------------------------------------

def test_gma_cache_follows_every_parameter_change():
    q, k, v, mean, var_raw, prior = gma_inputs(1, 2, 8, 8, 4, 3, 5, seed=461)
    q, k, v = q.detach(), k.detach(), v.detach()
    opt = torch.optim.SGD([mean, var_raw, prior], lr=0.5)
    gen = torch.Generator().manual_seed(462)
    cache, state = mixattn.GmaCache(), None

    def step(t, params):
        """Token t through the cache and through the copying form, the same parameters."""
        nonlocal state
        x = [y[:, :, t:t + 1] for y in (q, k, v)]
        with torch.no_grad():
            ours = mixattn.gma_attention(*x, *params, causal=True, cache=cache)
            theirs, state = mixattn.gma_attention(*x, *params, causal=True,
                                                  initial_state=state, output_final_state=True)
            e_out, _ = eager.gma_continued(*x, *params, *cache_state_before)
        assert torch.equal(ours, theirs), f"token {t}"
        assert_rel(ours, e_out, f"token {t} against eager")

    params = [mean, var_raw, prior]
    for t in range(8):
        cache_state_before = (cache.state() if cache.bound else
                              (torch.zeros(1, 2, 5, 3, dtype=DOUBLE),
                               torch.zeros(1, 2, 5, dtype=DOUBLE)))
        step(t, params)
        if t == 1:  # an optimizer step, in place
            for p in (mean, var_raw, prior):
                p.grad = torch.randn(p.shape, generator=gen, dtype=DOUBLE)
            opt.step()
        elif t == 2:
            with torch.no_grad():
                var_raw[1, 2, 0] += 0.25
        elif t == 3:
            with torch.no_grad():
                prior.copy_(torch.randn(prior.shape, generator=gen, dtype=DOUBLE))
        elif t == 4:  # new tensor objects with other values
            params = [p.detach() * 1.1 for p in params]
        elif t == 5:
            params = [p.detach().clone() for p in (mean, var_raw, prior)]


def test_gma_cache_module_follows_load_state_dict():
    torch.manual_seed(6)
    a = mixattn.GaussianMixtureAttention(8, heads=2, components=3, causal=True, dtype=DOUBLE)
    b = mixattn.GaussianMixtureAttention(8, heads=2, components=3, causal=True, dtype=DOUBLE)
    x = torch.randn(1, 4, 8, dtype=DOUBLE)
    cache = mixattn.GmaCache()
    with torch.no_grad():
        a(x[:, :2], cache=cache)
        branch = cache.copy()
        a.load_state_dict(b.state_dict())
        got = a(x[:, 2:], cache=cache)
        expected = b(x[:, 2:], cache=branch)
    assert torch.equal(got, expected)


# --- gradients within a cache call ---------------------------------------------------------------

def test_gradients_through_a_cache_call_equal_the_copying_form():
    q, k, v, beta = ovq_inputs(2, 2, 9, 3, 2, seed=471)
    prefix = detached(ovq_inputs(2, 2, 6, 3, 2, seed=472))
    cache = mixattn.OvqCache()
    with torch.no_grad():
        mixattn.ovq_attention(*prefix, cache=cache, **OVQ)
    start = cache.state()
    ours = mixattn.ovq_attention(q, k, v, beta, cache=cache, **OVQ)
    theirs = mixattn.ovq_attention(q, k, v, beta, initial_state=start, **OVQ)
    assert torch.equal(ours.detach(), theirs.detach())
    cot = torch.randn(ours.shape, generator=torch.Generator().manual_seed(473), dtype=DOUBLE)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v, beta), cot),
                    torch.autograd.grad(theirs, (q, k, v, beta), cot)):
        assert torch.equal(a, b)

    inputs = gma_inputs(2, 2, 7, 7, 3, 2, 4, seed=474)
    cache = mixattn.GmaCache()
    with torch.no_grad():
        mixattn.gma_attention(*detached(gma_inputs(2, 2, 5, 5, 3, 2, 4, seed=475))[:3],
                              *inputs[3:], causal=True, cache=cache)
    S0, z0 = cache.state()
    ours = mixattn.gma_attention(*inputs, causal=True, cache=cache)
    theirs = mixattn.gma_attention(*inputs, causal=True, initial_state=(S0, z0))
    assert torch.equal(ours.detach(), theirs.detach())
    # The copying form's backward also takes the (zero) gradient of its final state: the same
    # sums to rounding (1e-12 of the largest entry, as PIECES_REL).
    names = ("q", "k", "v", "mean", "var_raw", "prior_logit")
    for name, a, b in zip(names, torch.autograd.grad(ours, inputs, cot[:, :, :7, :2]),
                          torch.autograd.grad(theirs, inputs, cot[:, :, :7, :2])):
        assert_rel(a, b, f"gradient of {name} through a cache call", rel=PIECES_REL)


def test_gradcheck_of_a_cache_call():
    # Each evaluation continues a fresh copy of the same prefilled cache (a call changes it).
    ovq_base, gma_base = mixattn.OvqCache(), mixattn.GmaCache()
    inputs = gma_inputs(1, 2, 3, 3, 3, 2, 3, seed=481)
    with torch.no_grad():
        mixattn.ovq_attention(*detached(ovq_inputs(1, 2, 5, 3, 2, seed=482)), cache=ovq_base,
                              block=3, max_centroids=3)
        mixattn.gma_attention(*detached(gma_inputs(1, 2, 4, 4, 3, 2, 3, seed=483))[:3],
                              *detached(inputs[3:]), causal=True, cache=gma_base)
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.ovq_attention(*x, cache=ovq_base.copy(), block=3, max_centroids=3),
        ovq_inputs(1, 2, 4, 3, 2, seed=484), eps=1e-6, atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.gma_attention(*x, causal=True, cache=gma_base.copy()), inputs,
        eps=1e-6, atol=1e-7, rtol=1e-5)


# --- refusals ------------------------------------------------------------------------------

def ovq_bound(seed=491):
    q, k, v, beta = detached(ovq_inputs(2, 2, 6, 4, 3, seed=seed))
    cache = mixattn.OvqCache()
    with torch.no_grad():
        mixattn.ovq_attention(q, k, v, beta, cache=cache, **OVQ)
    return cache, (q, k, v, beta)


def still_continues_like(cache, reference_state, beta, **opts):
    """The cache, after a refused call, continues exactly as the state it should still hold."""
    more = detached(ovq_inputs(2, 2, 5, 4, 3, seed=499))[:3]
    a = mixattn.ovq_attention(*more, beta, cache=cache, **opts)
    assert torch.equal(a, mixattn.ovq_attention(*more, beta, initial_state=reference_state,
                                                **opts))


def test_ovq_cache_refuses_other_shapes_options_and_dtypes():
    cache, (q, k, v, beta) = ovq_bound()
    before = cache.state()
    call = mixattn.ovq_attention
    cases = [
        (lambda: call(q[:1], k[:1], v[:1], beta, cache=cache, **OVQ),
         r"cache was made for \(batch or sequences, heads, key dim, value dim\) = \(2, 2, 4, 3\)"),
        (lambda: call(q[:, :1], k[:, :1], v[:, :1], beta[:1], cache=cache, **OVQ), r"= \(2, 2,"),
        (lambda: call(q[..., :3], k[..., :3], v, beta, cache=cache, **OVQ), r"= \(2, 2, 4, 3\)"),
        (lambda: call(q, k, v[..., :2], beta, cache=cache, **OVQ), r"= \(2, 2, 4, 3\)"),
        (lambda: call(q.float(), k.float(), v.float(), beta.float(), cache=cache, **OVQ),
         r"cache holds the states of Double calls but q is Float"),
    ]
    for option, value in (("block", 5), ("max_centroids", 7), ("growth", "linear"),
                          ("growth_alpha", 2.0), ("seeding", "one_shot"),
                          ("assignment", "existing_only"), ("count_bias", False),
                          ("norm_eps", 1e-3)):
        opts = dict(OVQ, **{option: value})
        cases.append((lambda opts=opts: call(q, k, v, beta, cache=cache, **opts),
                      r"cache was made with block=4, max_centroids=6, .* but this call has "))
    for fn, message in cases:
        with pytest.raises(ValueError, match=r"mixattn.ovq_attention: .*" + message):
            fn()
    # Options that do not shape the dictionary may change from call to call.
    with torch.no_grad():
        call(q, k, v, beta, cache=cache.copy(), check_finite=False,
             grad_through_dictionary=False, **OVQ)
    # Bad values, refused before any state changes.
    bad_q = q.clone()
    bad_q[1, 1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"mixattn.ovq_attention: q has a non-finite entry "
                                         r"\(check_finite=True\); the cache is left as it was"):
        call(bad_q, k, v, beta, cache=cache, **OVQ)
    bad_v = v.clone()
    bad_v[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"v has a non-finite entry"):
        call(q, k, bad_v, beta, cache=cache, **OVQ)
    with pytest.raises(ValueError, match=r"beta\[1\] is -0.5; the scale factor must be > 0"):
        call(q, k, v, torch.tensor([1.0, -0.5], dtype=DOUBLE), cache=cache, **OVQ)
    with pytest.raises(ValueError, match=r"beta\[1\] is 0; the scale factor must be > 0 \(the "
                                         r"cache is left as it was\)"):
        call(q, k, v, torch.tensor([1.0, 0.0], dtype=DOUBLE), cache=cache, check_finite=False,
             **OVQ)
    assert cache.tokens_seen == [6, 6]
    still_continues_like(cache, before, beta, **OVQ)


def test_cache_arguments_are_checked():
    cache, (q, k, v, beta) = ovq_bound()
    inputs = detached(gma_inputs(2, 2, 3, 3, 4, 3, 5, seed=501))
    with pytest.raises(TypeError, match=r"mixattn.ovq_attention: cache must be a "
                                        r"mixattn.OvqCache, got GmaCache"):
        mixattn.ovq_attention(q, k, v, beta, cache=mixattn.GmaCache(), **OVQ)
    with pytest.raises(TypeError, match=r"mixattn.gma_attention: cache must be a "
                                        r"mixattn.GmaCache, got OvqCache"):
        mixattn.gma_attention(*inputs, causal=True, cache=cache)
    with pytest.raises(ValueError, match=r"give either cache or initial_state"):
        mixattn.ovq_attention(q, k, v, beta, cache=cache, output_final_state=True, **OVQ)
    with pytest.raises(ValueError, match=r"give either cache or initial_state"):
        mixattn.gma_attention(*inputs, causal=True, cache=mixattn.GmaCache(),
                              initial_state=(torch.zeros(2, 2, 5, 3, dtype=DOUBLE),
                                             torch.zeros(2, 2, 5, dtype=DOUBLE)))
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: cache needs causal=True"):
        mixattn.gma_attention(*inputs, cache=mixattn.GmaCache())
    assert cache.tokens_seen == [6, 6]


def test_gma_cache_refusals_leave_it_as_it_was():
    inputs = detached(gma_inputs(2, 2, 4, 4, 4, 3, 5, seed=511))
    q, k, v, mean, var_raw, prior = inputs
    cache = mixattn.GmaCache()
    with torch.no_grad():
        mixattn.gma_attention(*inputs, causal=True, cache=cache)
    S, z = cache.state()
    call = mixattn.gma_attention
    for fn, message in [
        (lambda: call(q[:1], k[:1], v[:1], mean, var_raw, prior, causal=True, cache=cache),
         r"cache was made for \(batch or sequences, heads, key dim, value dim\) = \(2, 2, 4, 3\)"),
        (lambda: call(q, k, v, mean[:, :4], var_raw[:, :4], prior[:, :4], causal=True,
                      cache=cache), r"cache was made for 5 components"),
        (lambda: call(q, k, v, mean, var_raw, prior, causal=True, cache=cache, eps=1e-3),
         r"cache was made with eps=1e-06, var_floor=0.0001 but this call has eps=0.001"),
        (lambda: call(q, k, v, mean, var_raw, prior, causal=True, cache=cache, var_floor=0.1),
         r"var_floor=0.1"),
        (lambda: call(*(x.float() for x in inputs), causal=True, cache=cache),
         r"cache holds the states of Double calls but q is Float"),
        (lambda: call(q.clone().fill_(float("nan")), k, v, mean, var_raw, prior, causal=True,
                      cache=cache), r"q has a non-finite entry"),
        (lambda: call(q, k, v, mean.clone().fill_(float("inf")), var_raw, prior, causal=True,
                      cache=cache), r"mean has a non-finite entry"),
    ]:
        with pytest.raises(ValueError, match=r"mixattn.gma_attention: .*" + message):
            fn()
    S2, z2 = cache.state()
    assert torch.equal(S, S2) and torch.equal(z, z2) and cache.tokens_seen == [4, 4]
    cache.reset()
    assert not cache.bound and cache.state() is None
    with torch.no_grad():  # unbound again: another configuration is welcome
        call(*(x.float() for x in inputs), causal=True, cache=cache, eps=1e-3)
    assert "float32" in repr(cache) and cache.tokens_seen == [4, 4]


def test_a_cache_serves_one_call_at_a_time():
    # A long call on one thread (the GIL released inside it); another thread reading the cache
    # meanwhile is refused. The long call itself may be refused too, if it starts while the
    # reader holds the cache: it then tries again, which it may, since a refused call leaves the
    # cache as it was. Its result is the copying form's.
    gen = torch.Generator().manual_seed(521)
    q, k, v = (torch.randn(1, 2, 30000, 16, generator=gen) for _ in range(3))
    mix = (torch.randn(2, 32, 16, generator=gen), torch.zeros(2, 32, 16), torch.zeros(2, 32))
    cache, done, refused, result = mixattn.GmaCache(), threading.Event(), [], []

    def long_call():
        try:
            with torch.no_grad():
                while not result:
                    try:
                        result.append(mixattn.gma_attention(q, k, v, *mix, causal=True,
                                                            cache=cache))
                    except RuntimeError as e:
                        assert "cache is in use by a call on another thread" in str(e)
        finally:
            done.set()

    worker = threading.Thread(target=long_call)
    worker.start()
    while not done.is_set():
        try:
            cache.tokens_seen
        except RuntimeError as e:
            refused.append(str(e))
    worker.join()
    assert result and refused
    assert "mixattn.GmaCache.tokens_seen: cache is in use by a call on another thread" in refused[0]
    with torch.no_grad():
        assert torch.equal(result[0], mixattn.gma_attention(
            q, k, v, *mix, causal=True, initial_state=(torch.zeros(1, 2, 32, 16, dtype=DOUBLE),
                                                       torch.zeros(1, 2, 32, dtype=DOUBLE))))
    assert cache.tokens_seen == [30000]


def test_ovq_beta_as_a_number_list_or_array():
    q, k, v, beta = detached(ovq_inputs(1, 3, 9, 4, 3, seed=531))
    with torch.no_grad():
        per_head = mixattn.ovq_attention(q, k, v, beta, **OVQ)
        assert torch.equal(mixattn.ovq_attention(q, k, v, beta.tolist(), **OVQ), per_head)
        assert torch.equal(mixattn.ovq_attention(q, k, v, beta.numpy(), **OVQ), per_head)
        assert torch.equal(mixattn.ovq_attention(q, k, v, 1.25, **OVQ),
                           mixattn.ovq_attention(q, k, v, torch.full((3,), 1.25, dtype=DOUBLE),
                                                 **OVQ))
        assert torch.equal(mixattn.ovq_attention(q.float(), k.float(), v.float(),
                                                 np.float32(2), **OVQ),
                           mixattn.ovq_attention(q.float(), k.float(), v.float(),
                                                 torch.full((3,), 2.0), **OVQ))
    for bad in ("1.0", None, True, [[1.0, 2.0, 3.0], [1.0]], {"a": 1}):
        with pytest.raises(TypeError, match=r"mixattn.ovq_attention: beta must be a tensor"):
            mixattn.ovq_attention(q, k, v, bad, **OVQ)
    with pytest.raises(ValueError, match=r"mixattn.ovq_attention: beta has shape \[2\]"):
        mixattn.ovq_attention(q, k, v, [1.0, 2.0], **OVQ)


def test_the_decode_timing_entry_points():
    # mixattn._C.testing (bench/torch_decode_bench.py): one time per one-token call, head after
    # head (heads x calls) or all heads per step (calls).
    gen = torch.Generator().manual_seed(541)
    q, k, v = (torch.randn(3, 10, 4, generator=gen) for _ in range(3))
    mix = (torch.randn(3, 5, 4, generator=gen), torch.zeros(3, 5, 4), torch.zeros(3, 5))
    config = mixattn._C.OvqConfig(4, 6, "plateau", 0.0, "greedy_dispersion", "all_centroids",
                                  True, True, 1e-5, True)
    for all_heads, count in ((False, 3 * 6), (True, 6)):
        for seconds in (mixattn._C.testing.gma_decode_seconds(q, k, v, *mix, 4, all_heads),
                        mixattn._C.testing.ovq_decode_seconds(q, k, v, 1.0, config, 4,
                                                              all_heads)):
            assert len(seconds) == count and all(0 <= s < 1 for s in seconds)
    with pytest.raises(ValueError, match=r"prefill is 10; it must be in \[1, tokens\)"):
        mixattn._C.testing.ovq_decode_seconds(q, k, v, 1.0, config, 10, True)
    with pytest.raises(ValueError, match=r"q must be float32"):
        mixattn._C.testing.gma_decode_seconds(*(x.double() for x in (q, k, v, *mix)), 4, True)


def test_gma_cache_under_inference_mode():
    # Decoding under torch.inference_mode: the module's parameters keep their version counters;
    # tensors made inside it have none, so the cache prepares their mixture on every call and
    # still sees an in-place change (which inference mode does not count).
    inputs = detached(gma_inputs(1, 2, 6, 6, 3, 2, 4, seed=551))
    with torch.no_grad():
        expected = mixattn.gma_attention(*inputs, causal=True, cache=mixattn.GmaCache())
    cache = mixattn.GmaCache()
    with torch.inference_mode():
        mix = [x.clone() for x in inputs[3:]]  # inference tensors
        got = torch.cat([mixattn.gma_attention(*(y[:, :, t:t + 1] for y in inputs[:3]), *mix,
                                               causal=True, cache=cache) for t in range(6)], 2)
        assert torch.equal(got, expected)
        mix[0].mul_(2)  # in place, no version counter to bump
        x = [y[:, :, :1] for y in inputs[:3]]
        changed = mixattn.gma_attention(*x, *mix, causal=True, cache=cache.copy())
    branch = cache.copy()
    with torch.no_grad():
        reference = mixattn.gma_attention(*x, *(m.clone() for m in mix), causal=True,
                                          cache=branch)
    assert torch.equal(changed, reference)
    with torch.no_grad():  # and the change matters
        assert not torch.equal(changed, mixattn.gma_attention(*x, *inputs[3:], causal=True,
                                                              cache=cache.copy()))
