"""Property-based checks (hypothesis): shapes, splits, offsets and options drawn at random, the
functions checked against each other -- a sequence in pieces (copying form and cache) against one
call, a packed batch against separate calls, float64 gradcheck on small draws, any cu_seqlens
either refused with ValueError naming it or equal to the separate calls; the same for the gated
delta rule (pieces carrying the state, packed with a state per sequence, gradcheck through the
start state).

Bounded for the test command's time: a fixed number of examples per property, derandomized (the
same draws on every run, so a failure is reproducible; hypothesis prints the falsifying example),
no deadline (a busy machine's timings are not a property), no example database written."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import mixattn  # noqa: E402
from test_functional import DOUBLE, assert_rel  # noqa: E402
from test_streaming import PIECES_REL  # noqa: E402

FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None)
SLOW = settings(max_examples=8, deadline=None, derandomize=True, database=None)


@st.composite
def sizes(draw, max_tokens=24):
    """(B, H, N, r, d_v, K) of a small problem, N possibly 0."""
    return (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, max_tokens)),
            draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 6)))


@st.composite
def cuts(draw, n):
    """0 = c_0 <= c_1 <= ... <= c_m = n: a split of n tokens into pieces (empty ones too)."""
    inner = draw(st.lists(st.integers(0, n), max_size=4))
    return [0] + sorted(inner) + [n]


def tensors(seed, b, h, n, r, dv, k, requires_grad=False):
    """q, k, v and a mixture: N(0, 1) entries, var_raw and prior_logit scaled by 0.5."""
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(b, h, n, d, generator=gen, dtype=DOUBLE) for d in (r, r, dv)]
    out += [torch.randn(h, k, r, generator=gen, dtype=DOUBLE),
            0.5 * torch.randn(h, k, r, generator=gen, dtype=DOUBLE),
            0.5 * torch.randn(h, k, generator=gen, dtype=DOUBLE)]
    return [t.requires_grad_(requires_grad) for t in out]


OVQ_OPTIONS = st.fixed_dictionaries({
    "block": st.integers(1, 6), "max_centroids": st.integers(1, 8),
    "growth": st.sampled_from(["plateau", "linear"]),
    "seeding": st.sampled_from(["greedy_dispersion", "one_shot"]),
    "assignment": st.sampled_from(["all_centroids", "existing_only"]),
    "count_bias": st.booleans()})


def piece(x, a, b):
    return x[:, :, a:b]


@FAST
@given(sizes(), st.data(), st.integers(0, 2**31 - 1))
def test_gma_pieces_copying_and_cached_equal_one_call(shape, data, seed):
    b, h, n, r, dv, k = shape
    split = data.draw(cuts(n))
    q, kk, v, *mix = tensors(seed, *shape)
    with torch.no_grad():
        one, (S1, z1) = mixattn.gma_attention(q, kk, v, *mix, causal=True,
                                              output_final_state=True)
        cache, state, copying, cached = mixattn.GmaCache(), None, [], []
        for a, c in zip(split[:-1], split[1:]):
            x = [piece(t, a, c) for t in (q, kk, v)]
            out, state = mixattn.gma_attention(*x, *mix, causal=True, initial_state=state,
                                               output_final_state=True)
            copying.append(out)
            cached.append(mixattn.gma_attention(*x, *mix, causal=True, cache=cache))
    copying, cached = torch.cat(copying, 2), torch.cat(cached, 2)
    assert torch.equal(copying, cached)
    assert_rel(copying, one, f"pieces {split} vs one call", rel=PIECES_REL)
    assert_rel(state[0], S1, "final S", rel=PIECES_REL)
    assert all(torch.equal(x, y) for x, y in zip(cache.state(), state))


@FAST
@given(sizes(max_tokens=30), st.data(), OVQ_OPTIONS, st.integers(0, 2**31 - 1))
def test_ovq_pieces_copying_and_cached_equal_one_call(shape, data, options, seed):
    b, h, n, r, dv, _ = shape
    split = data.draw(cuts(n))
    q, k, v = tensors(seed, *shape)[:3]
    beta = 0.5 + torch.rand(h, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)
    with torch.no_grad():
        one = mixattn.ovq_attention(q, k, v, beta, **options)
        cache, state, copying, cached = mixattn.OvqCache(), None, [], []
        for a, c in zip(split[:-1], split[1:]):
            x = [piece(t, a, c) for t in (q, k, v)]
            out, state = mixattn.ovq_attention(*x, beta, initial_state=state,
                                               output_final_state=True, **options)
            copying.append(out)
            cached.append(mixattn.ovq_attention(*x, beta, cache=cache, **options))
    copying, cached = torch.cat(copying, 2), torch.cat(cached, 2)
    assert torch.equal(copying, cached)
    assert_rel(copying, one, f"pieces {split} vs one call, {options}", rel=PIECES_REL)
    assert cache.tokens_seen == [n] * b


@st.composite
def packed_batch(draw):
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=4))
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return cu


@FAST
@given(packed_batch(), st.integers(1, 3), st.booleans(), st.integers(0, 2**31 - 1))
def test_packed_equals_separate_calls(cu, heads, causal, seed):
    T = cu[-1]
    q, k, v, *mix = tensors(seed, 1, heads, T, 3, 2, 4)
    beta = torch.ones(heads, dtype=DOUBLE)
    ranges = list(zip(cu[:-1], cu[1:]))
    for name, call in [
        ("gma", lambda *x, **kw: mixattn.gma_attention(*x, *mix, causal=causal, **kw)),
        ("flash", lambda *x, **kw: mixattn.flash_attention(*x, causal=causal, **kw)),
        ("ovq", lambda *x, **kw: mixattn.ovq_attention(*x, beta, block=3, max_centroids=4,
                                                       **kw)),
    ]:
        with torch.no_grad():
            packed = call(q, k, v, cu_seqlens=cu)
            separate = [call(*(piece(t, a, b) for t in (q, k, v))) for a, b in ranges]
        # Each (sequence, head) pair is the single-sequence computation: equal to rounding of
        # the summation order at most (PIECES_REL); a sequence seeing its neighbours is O(1).
        assert_rel(packed, torch.cat(separate, 2), f"{name} packed {cu}", rel=PIECES_REL)


@SLOW
@given(sizes(max_tokens=4), st.booleans(), st.integers(0, 2**31 - 1))
def test_gradcheck_on_small_draws(shape, causal, seed):
    b, h, n, r, dv, k = shape
    inputs = tensors(seed, b, h, n, r, dv, k, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *x: mixattn.gma_attention(*x, causal=causal), inputs,
                                    eps=1e-6, atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradcheck(lambda *x: mixattn.flash_attention(*x, causal=causal),
                                    inputs[:3], eps=1e-6, atol=1e-7, rtol=1e-5)
    beta = (0.5 + torch.rand(h, generator=torch.Generator().manual_seed(seed),
                             dtype=DOUBLE)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.ovq_attention(*x, block=2, max_centroids=2), (*inputs[:3], beta),
        eps=1e-6, atol=1e-7, rtol=1e-5)


@FAST
@given(st.lists(st.integers(-3, 12), max_size=6), st.integers(0, 2**31 - 1))
def test_any_cu_seqlens_is_refused_or_equals_separate_calls(cu, seed):
    T = 9
    q, k, v, *mix = tensors(seed, 1, 2, T, 3, 2, 4)
    valid = (len(cu) >= 2 and cu[0] == 0 and cu[-1] == T
             and all(a <= b for a, b in zip(cu, cu[1:])))
    for call in (lambda *x, **kw: mixattn.gma_attention(*x, *mix, causal=True, **kw),
                 lambda *x, **kw: mixattn.flash_attention(*x, **kw),
                 lambda *x, **kw: mixattn.gma_attention(*x, *mix, causal=True,
                                                        cache=mixattn.GmaCache(), **kw)):
        for given_as in (cu, torch.tensor(cu, dtype=torch.int64)):
            if not valid:
                with pytest.raises(ValueError, match=r"mixattn\.\w+_attention: cu_seqlens is"):
                    call(q, k, v, cu_seqlens=given_as)
                continue
            with torch.no_grad():
                packed = call(q, k, v, cu_seqlens=given_as)
                separate = torch.cat([call(*(piece(t, a, b) for t in (q, k, v)))
                                      for a, b in zip(cu[:-1], cu[1:])], 2)
            assert_rel(packed, separate, f"cu_seqlens {cu}", rel=PIECES_REL)


def delta_tensors(seed, b, h, n, r, dv):
    """q, k, v (k scaled to |k| ~ 1), g in (-1, 0] and beta in [0, 1): a contracting rule."""
    q, k, v = tensors(seed, b, h, n, r, dv, 1)[:3]
    gen = torch.Generator().manual_seed(seed + 1)
    g = -torch.rand(b, h, n, generator=gen, dtype=DOUBLE)
    beta = torch.rand(b, h, n, generator=gen, dtype=DOUBLE)
    return [q, k / r ** 0.5, v, g, beta]


@FAST
@given(sizes(max_tokens=30), st.data(), st.integers(1, 9), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_delta_pieces_equal_one_call(shape, data, chunk, normalize, seed):
    b, h, n, r, dv, _ = shape
    split = data.draw(cuts(n))
    x = delta_tensors(seed, b, h, n, r, dv)
    kw = dict(chunk_size=chunk, use_qk_l2norm_in_kernel=normalize, output_final_state=True)
    with torch.no_grad():
        one, S1 = mixattn.gated_delta_rule(*x, **kw)
        outs, state = [], None
        for a, c in zip(split[:-1], split[1:]):
            out, state = mixattn.gated_delta_rule(*(piece(t, a, c) for t in x),
                                                  initial_state=state, **kw)
            outs.append(out)
    assert_rel(torch.cat(outs, 2), one, f"delta pieces {split}, chunk {chunk}", rel=PIECES_REL)
    assert_rel(state, S1, "delta final state", rel=PIECES_REL)


@FAST
@given(packed_batch(), st.integers(1, 3), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_delta_packed_equals_separate_calls(cu, heads, chunk, seed):
    x = delta_tensors(seed, 1, heads, cu[-1], 3, 2)
    gen = torch.Generator().manual_seed(seed + 2)
    S0 = torch.randn(len(cu) - 1, heads, 3, 2, generator=gen, dtype=DOUBLE)
    with torch.no_grad():
        packed, S = mixattn.gated_delta_rule(*x, initial_state=S0, output_final_state=True,
                                             cu_seqlens=cu, chunk_size=chunk)
        separate = [mixattn.gated_delta_rule(*(piece(t, a, b) for t in x),
                                             initial_state=S0[i:i + 1], output_final_state=True,
                                             chunk_size=chunk)
                    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
    assert_rel(packed, torch.cat([o for o, _ in separate], 2), f"delta packed {cu}",
               rel=PIECES_REL)
    assert_rel(S, torch.cat([s for _, s in separate], 0), f"delta packed states {cu}",
               rel=PIECES_REL)


@SLOW
@given(sizes(max_tokens=5), st.integers(1, 3), st.booleans(), st.integers(0, 2**31 - 1))
def test_delta_gradcheck_on_small_draws(shape, chunk, normalize, seed):
    b, h, n, r, dv, _ = shape
    x = [t.requires_grad_() for t in delta_tensors(seed, b, h, n, r, dv)]
    S0 = torch.randn(b, h, r, dv, generator=torch.Generator().manual_seed(seed),
                     dtype=DOUBLE).requires_grad_()
    # gradcheck steps each entry by 1e-6: the gates are moved 1e-3 inside their ranges (g <= 0,
    # beta in [0, 1]) so that no step leaves them.
    with torch.no_grad():
        x[3].sub_(1e-3)
        x[4].clamp_(1e-3, 1 - 1e-3)
    assert torch.autograd.gradcheck(
        lambda *a: mixattn.gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                            chunk_size=chunk, use_qk_l2norm_in_kernel=normalize),
        (*x, S0), eps=1e-6, atol=1e-7, rtol=1e-5)
