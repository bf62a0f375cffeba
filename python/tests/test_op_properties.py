"""Property-based checks of the registered operators (torch.ops.mixattn.*) called directly,
with hypothesis: drawn shapes, and one argument made bad in a drawn way (another dtype, rank or
size, another device or layout, NaN/Inf, a strided, expanded or lazily negated view). Every call
either raises ValueError, TypeError or RuntimeError whose message names the argument, or gives
the result of the clean call: the same bits for the views (the kernels read them made
contiguous), outputs of the right shape for NaN/Inf with check_finite=False (no crash).
Every forward operator is drawn: GMA (with and without a state), OVQ, tiled softmax, linear
attention, Performer, static VQ, sliding window, the gated delta rule (with a start state) and
RoPE.
Fixed seed (derandomize); each example is a handful of small kernel calls."""

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import mixattn  # noqa: F401  (registers the operators)

ops = torch.ops.mixattn
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
OVQ = (3, 5, "plateau", 0.0, "greedy_dispersion", "all_centroids", True, True, 1e-5)
# What a message calls an argument when it is not the schema's name: the library names a
# continued state's parts by their field.
ALIASES = {"S0": ("S0", "initial_state[0]", "state.S"), "z0": ("z0", "initial_state[1]",
                                                              "state.z"),
           "initial_state": ("initial_state", "state.S")}


def names(message, name):
    """Whether the message names the argument (as a word: q in "batch of q", not in "eq")."""
    return any(re.search(rf"(?<!\w){re.escape(alias)}(?!\w)", message)
               for alias in ALIASES.get(name, (name,)))


def clean_call(op, shape, dtype, check_finite, gen):
    """(the operator, its arguments by name in schema order, the names of its float tensors)."""
    b, h, n, m, r, dv, k = shape
    t = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    if op == "gma_forward":
        args = dict(q=t(b, h, n, r), k=t(b, h, m, r), v=t(b, h, m, dv), mean=t(h, k, r),
                    var_raw=t(h, k, r), prior_logit=t(h, k), causal=False, eps=1e-6,
                    var_floor=1e-4, check_finite=check_finite, save=False, cu_seqlens=None)
    elif op == "gma_forward_state":
        args = dict(q=t(b, h, n, r), k=t(b, h, n, r), v=t(b, h, n, dv), mean=t(h, k, r),
                    var_raw=t(h, k, r), prior_logit=t(h, k),
                    S0=torch.randn(b, h, k, dv, generator=gen, dtype=torch.float64),
                    z0=torch.rand(b, h, k, generator=gen, dtype=torch.float64),
                    eps=1e-6, var_floor=1e-4, check_finite=check_finite, save=False,
                    cu_seqlens=None, prepared=None)
    elif op == "ovq_forward":
        args = dict(q=t(b, h, n, r), k=t(b, h, n, r), v=t(b, h, n, dv),
                    beta=torch.rand(h, generator=gen, dtype=dtype) + 0.5,
                    **dict(zip(("block", "max_centroids", "growth", "growth_alpha", "seeding",
                                "assignment", "count_bias", "grad_through_dictionary",
                                "norm_eps"), OVQ)),
                    check_finite=check_finite, save=False, initial_state=None, cu_seqlens=None)
    elif op == "flash_forward":
        args = dict(q=t(b, h, n, r), k=t(b, h, m, r), v=t(b, h, m, dv), causal=False, scale=0.0,
                    check_finite=check_finite, save=False, cu_seqlens=None)
    elif op == "linear_forward":
        args = dict(q=t(b, h, n, r), k=t(b, h, m, r), v=t(b, h, m, dv), causal=False, eps=1e-6,
                    check_finite=check_finite, save=False, cu_seqlens=None)
    elif op in ("performer_forward", "vq_forward"):
        extra = "features" if op == "performer_forward" else "codebook"
        args = {"q": t(b, h, n, r), "k": t(b, h, m, r), "v": t(b, h, m, dv), extra: t(h, k, r),
                "causal": False, "eps": 1e-6, "scale": 0.0, "check_finite": check_finite,
                "save": False, "cu_seqlens": None}
    elif op == "window_forward":
        args = dict(q=t(b, h, n, r), k=t(b, h, n, r), v=t(b, h, n, dv), window=k, scale=0.0,
                    check_finite=check_finite, save=False, cu_seqlens=None)
    elif op == "delta_forward":  # g <= 0 and beta in [0, 1]; a start state of its own
        args = dict(q=t(b, h, n, r), k=t(b, h, n, r), v=t(b, h, n, dv),
                    g=-torch.rand(b, h, n, generator=gen, dtype=dtype),
                    beta=torch.rand(b, h, n, generator=gen, dtype=dtype), scale=0.0,
                    use_qk_l2norm_in_kernel=bool(m % 2), chunk_size=k,
                    check_finite=check_finite, save=False,
                    initial_state=torch.randn(b, h, r, dv, generator=gen, dtype=torch.float64),
                    cu_seqlens=None)
    else:  # rope_forward: r even
        args = dict(x=t(b, h, n, 2 * r), start=m - 3, base=100.0, check_finite=check_finite,
                    cu_seqlens=None)
    floats = [name for name, a in args.items() if isinstance(a, torch.Tensor)]
    return getattr(ops, op).default, args, floats


def run(fn, args):
    out = fn(*args.values())
    return out if isinstance(out, tuple) else (out,)


def output_shape(op, args):
    """The shape of a call's output: (B, H, N, d_v), or x's for RoPE."""
    if op == "rope_forward":
        return args["x"].shape
    return (*args["q"].shape[:3], args["v"].shape[3])


def bad_value(kind, t, gen):
    """t made bad in the way `kind` says; None if that is not possible for t."""
    if kind == "dtype":
        return t.to(torch.float16 if t.dtype != torch.float16 else torch.int64)
    if kind == "int":
        return t.to(torch.int64)
    if kind == "complex":
        return t.to(torch.complex64)
    if kind == "rank":
        return t.unsqueeze(0)
    if kind == "size":  # one more along the first axis: batch or heads, never free
        return torch.cat([t, t[:1]], 0)
    if kind == "meta":
        return t.to("meta")
    if kind == "sparse":
        return t.to_sparse()
    if kind in ("nan", "inf"):
        if t.numel() == 0:
            return None
        bad = t.clone()
        bad.view(-1)[int(torch.randint(t.numel(), (1,), generator=gen))] = \
            math.nan if kind == "nan" else -math.inf
        return bad
    raise ValueError(kind)


def same_values(kind, t):
    """t as a view of the same values: strided, expanded (stride 0 along a size-1 axis),
    lazily negated."""
    if kind == "strided":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else \
            torch.stack([t, t], -1)[..., 0]
    if kind == "expanded":
        return t[:1].expand_as(t) if t.shape[:1] == (1,) else None
    if kind == "negated":
        return torch._neg_view(-t)
    raise ValueError(kind)


shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(0, 7), st.integers(0, 7),
                   st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
OPS = ["gma_forward", "gma_forward_state", "ovq_forward", "flash_forward", "linear_forward",
       "performer_forward", "vq_forward", "window_forward", "delta_forward", "rope_forward"]
# RoPE rotates each row of x on its own: any batch, heads or tokens is a valid call (the "size"
# change), and a meta x alone is a shape computation, as for any PyTorch operator.
VALID_CHANGES = {"rope_forward": ("size", "meta")}


@SETTINGS
@given(op=st.sampled_from(OPS), shape=shapes, double=st.booleans(), seed=st.integers(0, 2**16),
       which=st.integers(0, 100), kind=st.sampled_from(
           ["dtype", "int", "complex", "rank", "size", "meta", "sparse", "nan", "inf"]))
def test_a_bad_argument_is_refused_by_name(op, shape, double, seed, which, kind):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    fn, args, floats = clean_call(op, shape, dtype, True, gen)
    name = floats[which % len(floats)]
    bad = bad_value(kind, args[name], gen)
    if bad is None:
        return
    args = dict(args, **{name: bad})
    try:
        out = run(fn, args)
    except (ValueError, TypeError, RuntimeError) as e:
        assert names(str(e), name), f"{op}: {kind} {name} refused without naming it: {e}"
        return
    if kind in VALID_CHANGES.get(op, ()):
        assert out[0].shape == output_shape(op, args) and out[0].device == bad.device
        return
    # Accepted: only NaN/Inf that no output reads (a call without outputs) may be.
    assert kind in ("nan", "inf") and out[0].numel() == 0, f"{op}: {kind} {name} accepted"


@SETTINGS
@given(op=st.sampled_from(OPS), shape=shapes, double=st.booleans(), seed=st.integers(0, 2**16),
       which=st.integers(0, 100), kind=st.sampled_from(["strided", "expanded", "negated"]))
def test_a_view_gives_the_bits_of_the_contiguous_call(op, shape, double, seed, which, kind):
    if kind == "expanded":
        shape = (1,) + shape[1:]
    gen = torch.Generator().manual_seed(seed)
    fn, args, floats = clean_call(op, shape, torch.float64 if double else torch.float32, True,
                                  gen)
    name = floats[which % len(floats)]
    view = same_values(kind, args[name])
    if view is None:
        return
    try:
        want = run(fn, args)
    except (ValueError, RuntimeError) as e:  # a clean call the library refuses (e.g. no tokens)
        with pytest.raises(type(e)):
            run(fn, dict(args, **{name: view}))
        return
    got = run(fn, dict(args, **{name: view}))
    for a, b in zip(got, want):
        if a.dtype != torch.uint8:  # handles: compared by their kind alone
            assert torch.equal(a, b), f"{op}: {kind} {name} changed the result"


@SETTINGS
@given(op=st.sampled_from(OPS), shape=shapes, seed=st.integers(0, 2**16),
       which=st.integers(0, 100), value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_non_finite_inputs_unchecked_do_not_crash(op, shape, seed, which, value):
    gen = torch.Generator().manual_seed(seed)
    fn, args, floats = clean_call(op, shape, torch.float64, False, gen)
    name = floats[which % len(floats)]
    t = args[name].clone()
    if t.numel():
        t.view(-1)[0] = value
    try:
        out = run(fn, dict(args, **{name: t}))
    except (ValueError, RuntimeError) as e:  # refused for its shape or options, by name
        assert "mixattn" in str(e)
        return
    assert out[0].shape == output_shape(op, args)
