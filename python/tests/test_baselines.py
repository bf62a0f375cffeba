"""linear_attention, performer_attention, vq_attention, sliding_window_attention and rope, and
their modules: outputs and gradients against the slow, obvious twins of tests/eager.py in
float64 (non-contiguous inputs, B, H > 1), gradcheck in float64, packed calls against separate
ones, float32 against float64, and the refusals of what they do not provide (states)."""

import pytest
import torch

import eager
import mixattn
from test_functional import DOUBLE, assert_rel, compare_with_eager, flash_inputs
from test_modules import project

CU = [0, 5, 5, 6, 30, 37]  # an empty sequence, one token, one longer than the causal chunk


def split(x):
    return [x[:, :, a:b] for a, b in zip(CU[:-1], CU[1:])]


def features(h, m, r, seed=3, draw="orthogonal"):
    return mixattn.performer_features(h, m, r, seed=seed, draw=draw, dtype=DOUBLE)


def codebook(h, s, r, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(s, h, r, generator=gen, dtype=DOUBLE).transpose(0, 1).requires_grad_()


# Each operator as (function, eager twin, extra inputs (H, r) -> tensors, whether it takes M != N)
def _linear(causal, **kw):
    return (lambda q, k, v: mixattn.linear_attention(q, k, v, causal=causal, **kw),
            lambda q, k, v: eager.linear(q, k, v, causal=causal, **kw))


def _performer(w, causal, **kw):
    return (lambda q, k, v: mixattn.performer_attention(q, k, v, w, causal=causal, **kw),
            lambda q, k, v: eager.performer(q, k, v, w, causal=causal, **kw))


def _window(window, **kw):
    return (lambda q, k, v: mixattn.sliding_window_attention(q, k, v, window=window, **kw),
            lambda q, k, v: eager.sliding_window(q, k, v, window, **kw))


CASES = {
    "linear bidirectional M!=N": (lambda: _linear(False), 29),
    "linear causal": (lambda: _linear(True), None),
    "linear eps": (lambda: _linear(True, eps=0.5), None),
    "performer bidirectional M!=N": (lambda: _performer(features(3, 7, 5), False), 29),
    "performer causal iid": (lambda: _performer(features(3, 9, 5, draw="iid"), True), None),
    "performer scale eps": (lambda: _performer(features(3, 6, 5), True, scale=0.9, eps=0.3),
                            None),
    "window 1": (lambda: _window(1), None),
    "window 4": (lambda: _window(4), None),
    "window 4 scale": (lambda: _window(4, scale=-0.6), None),
    "window >= N": (lambda: _window(100), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case):
    make, m = CASES[case]
    ours, twin = make()
    n = 37
    inputs = flash_inputs(2, 3, n, m or n, 5, 4, seed=len(case))
    if case != "window 1":
        compare_with_eager(ours, twin, inputs, 11, case)
        return
    # Window 1: O_i = v_i, so q and k get exactly zero gradients, which the kernel's softmax
    # over one key reaches up to rounding (~1e-16 of v's).
    out = ours(*inputs)
    assert_rel(out, twin(*inputs), "window 1 output")
    dq, dk, dv = torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert (dv - 1).abs().max() <= 1e-12  # 1 up to rounding (exactly 1 in the -O3 build)
    assert dq.abs().max() <= 1e-12 and dk.abs().max() <= 1e-12


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.8])
def test_vq_matches_eager(causal, scale):
    """Outputs and the gradients of q, v and the codebook exact, k's the straight-through one
    (SPEC 6.3), against the twin's k^ = C_z + k - stop_gradient(k)."""
    n, m = (37, 37) if causal else (37, 29)
    q, k, v = flash_inputs(2, 3, n, m, 5, 4, seed=13 + causal)
    cb = codebook(3, 6, 5, seed=14)
    compare_with_eager(lambda q, k, v, c: mixattn.vq_attention(q, k, v, c, causal=causal,
                                                               scale=scale),
                       lambda q, k, v, c: eager.vq(q, k, v, c, causal=causal, scale=scale),
                       [q, k, v, cb], 12, f"vq causal={causal}")


def test_vq_codebook_gradient_sums_the_batch():
    q, k, v = flash_inputs(3, 2, 9, 9, 4, 3, seed=15)
    cb = codebook(2, 5, 4, seed=16)
    total = torch.autograd.grad(mixattn.vq_attention(q, k, v, cb).sum(), cb)[0]
    parts = sum(torch.autograd.grad(mixattn.vq_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                                         cb).sum(), cb)[0] for i in range(3))
    assert_rel(total, parts, "vq codebook gradient vs the batch's sum", rel=1e-12)


@pytest.mark.parametrize("start,base", [(0, 10000.0), (7, 10000.0), (-5, 500.0),
                                        (2**40, 10000.0)])
def test_rope_matches_eager(start, base):
    (x,) = flash_inputs(2, 3, 11, 11, 6, 6, seed=17)[:1]
    compare_with_eager(lambda x: mixattn.rope(x, start, base),
                       lambda x: eager.rope(x, start, base), [x], 13, f"rope start={start}")


def test_rope_keeps_dot_products_relative():
    """(R_m q) . (R_n k) depends on the positions only through n - m (SPEC 8.1)."""
    gen = torch.Generator().manual_seed(18)
    q, k = (torch.randn(1, 1, 1, 8, generator=gen, dtype=DOUBLE) for _ in range(2))
    dots = [(mixattn.rope(q, m) * mixattn.rope(k, m + 3)).sum() for m in (0, 11, 1000)]
    for d in dots[1:]:
        assert abs(d - dots[0]) <= 1e-12 * abs(dots[0])


def test_rope_packed_restarts_positions_in_each_sequence():
    (x,) = flash_inputs(1, 2, CU[-1], CU[-1], 4, 4, seed=19)[:1]
    cu = torch.tensor(CU)
    got = mixattn.rope(x, 3, cu_seqlens=cu)
    expected = torch.cat([eager.rope(p, 3) for p in split(x)], 2)
    assert_rel(got, expected, "rope packed")


# --- gradcheck, float64 ----------------------------------------------------------------------

GRADCHECK = {
    "linear": (lambda q, k, v: mixattn.linear_attention(q, k, v), 4),
    "linear causal": (lambda q, k, v: mixattn.linear_attention(q, k, v, causal=True), None),
    "performer": (lambda q, k, v: mixattn.performer_attention(q, k, v, features(2, 5, 3)), 4),
    "performer causal": (lambda q, k, v: mixattn.performer_attention(
        q, k, v, features(2, 4, 3, draw="iid"), causal=True), None),
    "window": (lambda q, k, v: mixattn.sliding_window_attention(q, k, v, window=2), None),
    "linear packed": (lambda q, k, v: mixattn.linear_attention(
        q, k, v, causal=True, cu_seqlens=[0, 2, 5]), None),
}


@pytest.mark.parametrize("case", sorted(GRADCHECK))
def test_gradcheck(case):
    fn, m = GRADCHECK[case]
    b = 1 if "packed" in case else 2
    inputs = flash_inputs(b, 2, 5, m or 5, 3, 2, seed=21 + len(case))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_vq_gradcheck(causal):
    """q, v and the codebook: the exact gradient (no key within the step of a tie: random
    inputs). k: the forward is constant in k between ties, so gradcheck sees the straight-
    through gradient as wrong; it is checked against the twin above instead."""
    q, k, v = flash_inputs(2, 2, 5, 5 if causal else 4, 3, 2, seed=23 + causal)
    k = k.detach()
    cb = codebook(2, 4, 3, seed=25)
    assert torch.autograd.gradcheck(
        lambda q, v, c: mixattn.vq_attention(q, k, v, c, causal=causal), (q, v, cb), eps=1e-6,
        atol=1e-7, rtol=1e-5)


def test_rope_gradcheck_and_gradgradcheck():
    (x,) = flash_inputs(2, 2, 5, 5, 4, 4, seed=26)[:1]
    fn = lambda x: mixattn.rope(x, 3, cu_seqlens=None)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradgradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


# --- packed, float32, what is not provided ---------------------------------------------------

PACKED = {
    "linear": lambda q, k, v, **kw: mixattn.linear_attention(q, k, v, **kw),
    "linear causal": lambda q, k, v, **kw: mixattn.linear_attention(q, k, v, causal=True, **kw),
    "performer": lambda q, k, v, **kw: mixattn.performer_attention(q, k, v, features(2, 6, 4),
                                                                   **kw),
    "performer causal": lambda q, k, v, **kw: mixattn.performer_attention(
        q, k, v, features(2, 6, 4), causal=True, **kw),
    "vq causal": lambda q, k, v, **kw: mixattn.vq_attention(
        q, k, v, codebook(2, 5, 4, seed=27).detach(), causal=True, **kw),
    "window": lambda q, k, v, **kw: mixattn.sliding_window_attention(q, k, v, window=3, **kw),
}


@pytest.mark.parametrize("case", sorted(PACKED))
def test_packed_equals_separate_calls(case):
    fn = PACKED[case]
    inputs = flash_inputs(1, 2, CU[-1], CU[-1], 4, 3, seed=28)
    packed = fn(*inputs, cu_seqlens=torch.tensor(CU, dtype=torch.int32))
    separate = torch.cat([fn(*p) for p in zip(*(split(x) for x in inputs))], 2)
    assert_rel(packed, separate, f"{case} packed output vs separate", rel=1e-12)
    cot = torch.randn(packed.shape, generator=torch.Generator().manual_seed(29), dtype=DOUBLE)
    for name, a, b in zip("qkv", torch.autograd.grad(packed, inputs, cot),
                          torch.autograd.grad(separate, inputs, cot)):
        assert_rel(a, b, f"{case} packed gradient of {name} vs separate", rel=1e-12)


def test_float32_follows_float64():
    inputs = flash_inputs(2, 2, 40, 40, 8, 8, seed=31)
    w, cb = features(2, 16, 8), codebook(2, 8, 8, seed=32).detach()
    for name, fn in (("linear", lambda q, k, v: mixattn.linear_attention(q, k, v, causal=True)),
                     ("performer", lambda q, k, v: mixattn.performer_attention(
                         q, k, v, w.to(q.dtype), causal=True)),
                     ("vq", lambda q, k, v: mixattn.vq_attention(q, k, v, cb.to(q.dtype))),
                     ("window", lambda q, k, v: mixattn.sliding_window_attention(q, k, v, 5)),
                     ("rope", lambda q, k, v: mixattn.rope(q, 9) * v)):
        ref = fn(*inputs)
        single = [x.detach().float().requires_grad_() for x in inputs]
        out = fn(*single)
        assert out.dtype == torch.float32
        assert_rel(out.double(), ref, f"{name} float32 output", rel=1e-4)
        for i, (a, e) in enumerate(zip(torch.autograd.grad(out.sum(), single, allow_unused=True),
                                       torch.autograd.grad(ref.sum(), inputs, allow_unused=True))):
            if e is not None:
                assert a.dtype == torch.float32
                assert_rel(a.double(), e, f"{name} float32 gradient {i}", rel=1e-3)


def test_performer_features_are_the_library_s_draw():
    w = mixattn.performer_features(3, 10, 4, seed=5)
    assert w.shape == (3, 10, 4) and w.dtype == torch.float32
    again = mixattn.performer_features(3, 10, 4, seed=5, dtype=DOUBLE)
    assert torch.equal(w, again.float())
    # head h is the seed + h draw: heads 1, 2 of seed 5 are heads 0, 1 of seed 6
    assert torch.equal(again[1:], mixattn.performer_features(2, 10, 4, seed=6, dtype=DOUBLE))
    # orthogonal blocks of r rows: the directions of a block are orthogonal
    block = again[0, :4]
    gram = block @ block.T
    assert (gram - torch.diag(gram.diagonal())).abs().max() <= 1e-12 * gram.abs().max()
    iid = mixattn.performer_features(1, 4, 4, seed=5, draw="iid", dtype=DOUBLE)[0]
    assert (iid @ iid.T - torch.diag((iid @ iid.T).diagonal())).abs().max() > 1e-3
    with pytest.raises(ValueError, match="draw is 'gaussian'"):
        mixattn.performer_features(1, 4, 4, draw="gaussian")
    with pytest.raises(ValueError, match="features is 0"):
        mixattn.performer_features(1, 0, 4)


def test_states_and_bad_options_are_refused_by_name():
    q, k, v = (x.detach() for x in flash_inputs(1, 2, 6, 6, 4, 3, seed=33))
    w, cb = features(2, 4, 4), codebook(2, 3, 4, seed=34).detach()
    calls = {"linear_attention": lambda **kw: mixattn.linear_attention(q, k, v, **kw),
             "performer_attention": lambda **kw: mixattn.performer_attention(q, k, v, w, **kw),
             "vq_attention": lambda **kw: mixattn.vq_attention(q, k, v, cb, **kw),
             "sliding_window_attention":
                 lambda **kw: mixattn.sliding_window_attention(q, k, v, **kw)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"mixattn.{name}: initial_state is not supported"):
            call(initial_state=torch.zeros(1))
        with pytest.raises(ValueError, match=rf"mixattn.{name}: output_final_state is not"):
            call(output_final_state=True)
    with pytest.raises(ValueError, match="features requires a gradient"):
        mixattn.performer_attention(q, k, v, w.clone().requires_grad_())
    with pytest.raises(ValueError, match="mixattn.performer_attention: scale is -1"):
        mixattn.performer_attention(q, k, v, w, scale=-1)
    with pytest.raises(ValueError, match="mixattn.performer_attention: features has shape"):
        mixattn.performer_attention(q, k, v, w[:, :, :3])
    with pytest.raises(ValueError, match="mixattn.vq_attention: codebook has shape"):
        mixattn.vq_attention(q, k, v, cb[:1])
    with pytest.raises(ValueError, match="mixattn.sliding_window_attention: window is 0"):
        mixattn.sliding_window_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="causal needs as many queries as keys"):
        mixattn.linear_attention(q, k[:, :, :4], v[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="non-finite"):
        mixattn.linear_attention(q, k.clone().fill_(float("nan")), v)
    with pytest.raises(ValueError, match=r"mixattn::rope::apply_into: x .* r must be even"):
        mixattn.rope(q[..., :3])
    with pytest.raises(ValueError, match="mixattn.rope: base is -2"):
        mixattn.rope(q, base=-2.0)


def test_empty_sequences():
    q, k, v = (x.detach() for x in flash_inputs(2, 2, 0, 0, 4, 3, seed=35))
    assert mixattn.linear_attention(q, k, v, causal=True).shape == (2, 2, 0, 3)
    assert mixattn.performer_attention(q, k, v, features(2, 4, 4)).shape == (2, 2, 0, 3)
    assert mixattn.vq_attention(q, k, v, codebook(2, 3, 4, seed=36)).shape == (2, 2, 0, 3)
    assert mixattn.sliding_window_attention(q, k, v).shape == (2, 2, 0, 3)
    assert mixattn.rope(q).shape == (2, 2, 0, 4)


@pytest.mark.parametrize("op", ["performer", "vq"])
def test_no_queries_after_a_longer_call(op):
    """A backward over no queries (N = 0 beside M = 3 keys: zero gradients for k and v) after a
    longer call, whose records the kernels keep and hand to the next forward."""
    w, cb = features(2, 4, 4), codebook(2, 3, 4, seed=37)
    call = {"performer": lambda q, k, v: mixattn.performer_attention(q, k, v, w),
            "vq": lambda q, k, v: mixattn.vq_attention(q, k, v, cb)}[op]
    for n in (6, 0):
        q, k, v = flash_inputs(2, 2, n, 3, 4, 3, seed=38 + n)
        out = call(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


# --- modules -----------------------------------------------------------------------------------

def _module_twin(layer, x, mixer):
    q, k, v = project(layer, x, layer.key_dim, layer.value_dim)
    if layer.rope:
        q, k = eager.rope(q, 0, layer.rope_base), eager.rope(k, 0, layer.rope_base)
    o = mixer(q, k, v)
    b, n, _ = x.shape
    return layer.out_proj(o.transpose(1, 2).reshape(b, n, layer.heads * layer.value_dim))


MODULES = {
    "linear": (lambda: mixattn.LinearAttention(12, 3, causal=True, key_dim=4, dtype=DOUBLE),
               lambda l: lambda q, k, v: eager.linear(q, k, v, causal=True)),
    "performer": (lambda: mixattn.PerformerAttention(12, 3, features=6, seed=4, dtype=DOUBLE),
                  lambda l: lambda q, k, v: eager.performer(q, k, v, l.directions)),
    "vq": (lambda: mixattn.VQAttention(12, 3, codes=5, causal=True, dtype=DOUBLE),
           lambda l: lambda q, k, v: eager.vq(q, k, v, l.codebook, causal=True)),
    "window rope": (lambda: mixattn.SlidingWindowAttention(12, 3, window=3, rope=True,
                                                           rope_base=100.0, dtype=DOUBLE),
                    lambda l: lambda q, k, v: eager.sliding_window(q, k, v, 3)),
    "linear rope": (lambda: mixattn.LinearAttention(12, 2, key_dim=6, rope=True, dtype=DOUBLE),
                    lambda l: lambda q, k, v: eager.linear(q, k, v)),
}


@pytest.mark.parametrize("case", sorted(MODULES))
def test_module_matches_eager(case):
    torch.manual_seed(37)
    make, twin = MODULES[case]
    layer = make()
    x = torch.randn(2, 9, 12, dtype=DOUBLE)
    got, expected = layer(x), _module_twin(layer, x, twin(layer))
    assert_rel(got, expected, f"{case} module output")
    params = list(layer.parameters())
    for p, a, e in zip(params, torch.autograd.grad(got.square().sum(), params),
                       torch.autograd.grad(expected.square().sum(), params)):
        assert_rel(a, e, f"{case} module gradient of a {tuple(p.shape)} parameter")


def test_modules_take_packed_sequences_and_positions():
    torch.manual_seed(38)
    cu = [0, 7, 7, 8, 20]
    x = torch.randn(1, cu[-1], 8, dtype=DOUBLE)
    parts = [x[:, a:b] for a, b in zip(cu[:-1], cu[1:])]
    for layer in (mixattn.LinearAttention(8, 2, causal=True, rope=True, dtype=DOUBLE),
                  mixattn.PerformerAttention(8, 2, features=5, causal=True, dtype=DOUBLE),
                  mixattn.VQAttention(8, 2, codes=4, dtype=DOUBLE),
                  mixattn.SlidingWindowAttention(8, 2, window=3, rope=True, dtype=DOUBLE)):
        got = layer(x, cu_seqlens=cu)
        expected = torch.cat([layer(p) for p in parts], 1)
        assert_rel(got, expected, f"{type(layer).__name__} packed", rel=1e-12)
    # start= is the first token's position: linear attention's elu features are not rotation-
    # invariant, so shifting every position changes the output
    layer = mixattn.LinearAttention(8, 2, causal=True, rope=True, dtype=DOUBLE)
    assert not torch.allclose(layer(x, start=5), layer(x))
    with pytest.raises(ValueError, match="rope=False"):
        mixattn.VQAttention(8, 2, dtype=DOUBLE)(x, start=3)


def test_performer_module_directions_are_a_constant_buffer():
    layer = mixattn.PerformerAttention(8, 2, features=5, seed=9)
    assert layer.directions.shape == (2, 5, 4) and not layer.directions.requires_grad
    assert "directions" in layer.state_dict() and "directions" not in dict(
        layer.named_parameters())
    assert torch.equal(layer.directions, mixattn.performer_features(2, 5, 4, seed=9))
    layer.redraw(10)
    assert torch.equal(layer.directions, mixattn.performer_features(2, 5, 4, seed=10))
    layer(torch.randn(2, 6, 8)).sum().backward()  # no gradient for the directions
    assert layer.directions.grad is None


def test_rope_modules_decode_at_the_cache_s_position():
    """With rope=True a cache call's positions continue from the tokens the cache has taken:
    a prompt and then one token at a time equal one call."""
    torch.manual_seed(39)
    x = torch.randn(2, 12, 8, dtype=DOUBLE)
    for layer, cache in ((mixattn.GaussianMixtureAttention(8, 2, 3, causal=True, rope=True,
                                                           dtype=DOUBLE), mixattn.GmaCache()),
                         (mixattn.OnlineVQAttention(8, 2, rope=True, block=4, max_centroids=5,
                                                    dtype=DOUBLE), mixattn.OvqCache())):
        with torch.no_grad():
            pieces = [layer(x[:, :7], cache=cache)]
            pieces += [layer(x[:, t:t + 1], cache=cache) for t in range(7, 12)]
            whole = layer(x)
        assert_rel(torch.cat(pieces, 1), whole, f"{type(layer).__name__} rope decoding",
                   rel=1e-12)
