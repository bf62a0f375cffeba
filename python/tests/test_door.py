"""Every function and module refuses bad input with an exception that names the function and the
argument: wrong dtype or device (meta tensors stand in for any non-CPU device), wrong rank or
shape, non-tensors, bad cu_seqlens, a state from another configuration, NaN/Inf (unless
check_finite=False, when they reach the outputs); strided, expanded (overlapping) and negated
views are read as the values they show."""

import numpy as np
import pytest
import torch

import mixattn
from test_functional import DOUBLE, gma_inputs, ovq_inputs

GMA_NAMES = ("q", "k", "v", "mean", "var_raw", "prior_logit")


def gma_args():
    return [x.detach() for x in gma_inputs(2, 2, 5, 5, 3, 2, 4, seed=601, contiguous=True)]


def ovq_args():
    return [x.detach() for x in ovq_inputs(2, 2, 5, 3, 2, seed=602, contiguous=True)]


def delta_args():
    """q, k (2, 2, 5, 3), v (2, 2, 5, 2), g <= 0 and beta in [0, 1] (2, 2, 5)."""
    q, k, v = gma_args()[:3]
    gen = torch.Generator().manual_seed(603)
    return [q, k, v, -torch.rand(2, 2, 5, generator=gen, dtype=DOUBLE),
            torch.rand(2, 2, 5, generator=gen, dtype=DOUBLE)]


def replaced(args, i, value):
    out = list(args)
    out[i] = value
    return out


CALLS = {
    "gma": (GMA_NAMES, gma_args, lambda *a, **kw: mixattn.gma_attention(*a, **kw)),
    "gma-causal": (GMA_NAMES, gma_args,
                   lambda *a, **kw: mixattn.gma_attention(*a, causal=True, **kw)),
    "ovq": (("q", "k", "v", "beta"), ovq_args,
            lambda *a, **kw: mixattn.ovq_attention(*a, block=2, max_centroids=3, **kw)),
    "flash": (("q", "k", "v"), lambda: gma_args()[:3],
              lambda *a, **kw: mixattn.flash_attention(*a, **kw)),
    "linear": (("q", "k", "v"), lambda: gma_args()[:3],
               lambda *a, **kw: mixattn.linear_attention(*a, causal=True, **kw)),
    "performer": (("q", "k", "v", "features"),
                  lambda: [*gma_args()[:3], mixattn.performer_features(2, 4, 3, dtype=DOUBLE)],
                  lambda *a, **kw: mixattn.performer_attention(*a, **kw)),
    "vq": (("q", "k", "v", "codebook"), lambda: gma_args()[:4],  # mean as a (2, 4, 3) codebook
           lambda *a, **kw: mixattn.vq_attention(*a, causal=True, **kw)),
    "window": (("q", "k", "v"), lambda: gma_args()[:3],
               lambda *a, **kw: mixattn.sliding_window_attention(*a, window=2, **kw)),
    "rope": (("x",), lambda: gma_args()[2:3],  # v: (2, 2, 5, 2), an even r
             lambda *a, **kw: mixattn.rope(*a, start=3, **kw)),
    "delta": (("q", "k", "v", "g", "beta"), delta_args,
              lambda *a, **kw: mixattn.gated_delta_rule(*a, chunk_size=2, **kw)[0]),
}
FN = {"gma": "gma_attention", "gma-causal": "gma_attention", "ovq": "ovq_attention",
      "flash": "flash_attention", "linear": "linear_attention",
      "performer": "performer_attention", "vq": "vq_attention",
      "window": "sliding_window_attention", "rope": "rope", "delta": "gated_delta_rule"}
# RoPE rotates every row on its own: any batch, heads or tokens is valid (test_baselines.py
# refuses an odd r).
SIZED = sorted(set(CALLS) - {"rope"})


@pytest.mark.parametrize("case", sorted(CALLS))
def test_each_tensor_argument_is_named_when_bad(case):
    names, make, call = CALLS[case]
    fn = rf"mixattn\.{FN[case]}: "
    for i, name in enumerate(names):
        args = make()
        t = args[i]
        checks = [
            (t.to("meta"), ValueError, rf"{name} must be a dense CPU tensor, got a meta tensor"),
            (t.to_sparse(), ValueError, rf"{name} must be a dense CPU tensor, got a cpu "
                                        r"torch.sparse_coo tensor"),
            (t.half(), ValueError, rf"{name} must be float32 or float64, got Half"),
            (t.to(torch.bfloat16), ValueError, rf"{name} must be float32 or float64"),
            (t.long(), ValueError, rf"{name} must be float32 or float64, got Long"),
            (t.unsqueeze(0), ValueError, rf"{name} must have {t.dim()} dimensions"),
            (t.tolist(), TypeError, rf"{name} must be a torch.Tensor, got list"),
        ]
        if i > 0:
            checks.append((t.float(), ValueError, rf"{name} is Float but q is Double"))
        if case == "ovq" and name == "beta":  # a list or array is OVQ's per-head beta
            checks[6] = ("2", TypeError, r"beta must be a tensor of one value per head")
        for value, error, message in checks:
            with pytest.raises(error, match=fn + message):
                call(*replaced(args, i, value))


@pytest.mark.parametrize("case", SIZED)
def test_wrong_sizes_are_named(case):
    names, make, call = CALLS[case]
    args = make()
    fn = rf"mixattn\.{FN[case]}: "
    # One size of each tensor off by one against the others (q's batch for q itself).
    for i, name in enumerate(names):
        t = args[i]
        bigger = torch.cat([t, t.narrow(0, 0, 1)], 0)
        with pytest.raises(ValueError, match=fn + rf"\w+ has shape"):
            call(*replaced(args, i, bigger))
    with pytest.raises(ValueError, match=fn + r"q has shape \[2, 2, 5, 0\]: its key dim"):
        call(*[x[..., :0] if j < 2 else (x[..., :0] if names[j] in ("mean", "var_raw") else x)
               for j, x in enumerate(args)])


@pytest.mark.parametrize("case", sorted(CALLS))
def test_non_finite_inputs_are_named_or_passed_through(case):
    names, make, call = CALLS[case]
    # The binding's name, or the library function's that found it (mixattn::gma::forward_into).
    fn = rf"(mixattn\.{FN[case]}|mixattn::\w+::\w+)"
    for i, name in enumerate(names):
        for bad in (float("nan"), float("inf"), -float("inf")):
            args = make()
            t = args[i].clone()
            t.view(-1)[t.numel() // 2] = bad
            # Performer's directions are the library's features.w; the gated delta rule's gates
            # are checked against their ranges first (g = inf > 0, beta = +-inf outside [0, 1]).
            with pytest.raises(ValueError, match=rf"{fn}.*({name}(\.w)? has a non-finite entry|"
                                                 rf"{name} is -?(nan|inf), not finite|"
                                                 rf"{name} has -?inf at row)"):
                call(*replaced(args, i, t))
    # check_finite=False: no check; a NaN in q reaches the outputs (documented) -- no crash.
    args = make()
    args[0] = args[0].clone()
    args[0][0, 0, 0, 0] = float("nan")
    out = call(*args, check_finite=False)
    assert torch.isnan(out).any() and out.shape[:2] == (2, 2)


@pytest.mark.parametrize("case", sorted(CALLS))
def test_strided_expanded_and_negated_views_read_as_their_values(case):
    names, make, call = CALLS[case]
    args = make()
    expected = call(*args)
    # q's first batch entry expanded over the batch: stride 0, entries overlapping in memory.
    expanded = replaced(args, 0, args[0][:1].expand(2, -1, -1, -1))
    assert expanded[0].stride(0) == 0
    assert torch.equal(call(*expanded), call(*replaced(args, 0, args[0][:1].repeat(2, 1, 1, 1))))
    # Every tensor as a strided view (every other entry of a wider tensor).
    strided = [torch.stack([x, torch.full_like(x, 7.0)], -1)[..., 0] for x in args]
    assert not strided[0].is_contiguous()
    assert torch.equal(call(*strided), expected)
    # A lazily negated view (the neg bit): read as the negated values it shows.
    negated = torch._neg_view(-args[0])
    assert negated.is_neg()
    assert torch.equal(call(*replaced(args, 0, negated)), expected)


def test_bad_cu_seqlens_are_named():
    q, k, v, *mix = gma_args()
    q, k, v = (x[:1] for x in (q, k, v))  # (1, H, 5, .)
    beta = torch.ones(2, dtype=DOUBLE)
    calls = [
        ("gma_attention", lambda cu: mixattn.gma_attention(q, k, v, *mix, cu_seqlens=cu)),
        ("gma_attention", lambda cu: mixattn.gma_attention(q, k, v, *mix, causal=True,
                                                           cu_seqlens=cu,
                                                           cache=mixattn.GmaCache())),
        ("ovq_attention", lambda cu: mixattn.ovq_attention(q, k, v, beta, cu_seqlens=cu)),
        ("flash_attention", lambda cu: mixattn.flash_attention(q, k, v, cu_seqlens=cu)),
    ]
    for name, call in calls:
        fn = rf"mixattn\.{name}: cu_seqlens"
        for cu, message in [
            ([0, 2], r" is \[0, 2\]; it must hold N \+ 1 >= 2 nondecreasing offsets from 0 to the "
                     r"5 tokens of q"),
            ([1, 5], r" is \[1, 5\]"), ([0, 3, 2, 5], r" is \[0, 3, 2, 5\]"), ([5], r" is \[5\]"),
            ([0, 6], r" is \[0, 6\]"), ([-1, 5], r" is \[-1, 5\]"), ([], r" is \[\]"),
            (torch.tensor([0.0, 5.0]), r" must be a 1-D int32 or int64 tensor, got torch.float32"),
            (torch.tensor([[0, 5]]), r" must be a 1-D int32 or int64 tensor"),
            (torch.tensor([0, 5]).to("meta"), r" must be a CPU tensor, got a meta tensor"),
        ]:
            with pytest.raises(ValueError, match=fn + message):
                call(cu)
        for cu in ([0, 2.5, 5], ["0", "5"], 5, np.array([0.0, 5.0])):
            with pytest.raises(TypeError, match=fn + r" must be a 1-D int32/int64 tensor or a "
                                                     r"sequence of integers"):
                call(cu)
        # Valid: NumPy integers, an int32 tensor, empty sequences.
        assert call(np.array([0, 0, 5, 5])).shape == (1, 2, 5, 2)
        assert call(torch.tensor([0, 2, 5], dtype=torch.int32)).shape == (1, 2, 5, 2)
    with pytest.raises(ValueError, match=r"cu_seqlens packs the sequences along the tokens of one "
                                         r"batch entry"):
        mixattn.flash_attention(*gma_args()[:3], cu_seqlens=[0, 5])


def test_options_of_the_wrong_type_are_named():
    args = gma_args()
    q, k, v, beta = ovq_args()
    for call, message in [
        (lambda: mixattn.ovq_attention(q, k, v, beta, block=2.5), r"block must be an integer, "
                                                                   r"got 2.5"),
        (lambda: mixattn.ovq_attention(q, k, v, beta, max_centroids="8"), r"max_centroids must "
                                                                           r"be an integer"),
        (lambda: mixattn.ovq_attention(q, k, v, beta, norm_eps="small"), r"norm_eps must be a "
                                                                          r"real number"),
        (lambda: mixattn.ovq_attention(q, k, v, beta, count_bias="no"), r"count_bias must be "
                                                                         r"True or False"),
        (lambda: mixattn.gma_attention(*args, causal="yes"), r"causal must be True or False"),
        (lambda: mixattn.gma_attention(*args, eps=None), r"eps must be a real number"),
        (lambda: mixattn.gma_attention(*args, var_floor=torch.ones(2)), r"var_floor must be a "
                                                                         r"real number"),
        (lambda: mixattn.flash_attention(*args[:3], scale="1"), r"scale must be a real number"),
        (lambda: mixattn.flash_attention(*args[:3], check_finite=2), r"check_finite must be "
                                                                      r"True or False"),
    ]:
        with pytest.raises(TypeError, match=message):
            call()
    # Integral values of other types are what they say.
    with torch.no_grad():
        a = mixattn.ovq_attention(q, k, v, beta, block=np.int64(2), max_centroids=3.0)
        assert torch.equal(a, mixattn.ovq_attention(q, k, v, beta, block=2, max_centroids=3))
        assert torch.equal(mixattn.gma_attention(*args, causal=np.bool_(True)),
                           mixattn.gma_attention(*args, causal=True))
    for scale, message in [(float("inf"), r"scale is inf; it must be finite"),
                           (float("nan"), r"scale is nan"), (0, r"scale is 0")]:
        with pytest.raises(ValueError, match=r"mixattn.flash_attention: " + message):
            mixattn.flash_attention(*args[:3], scale=scale)
    for bad, message in [(dict(eps=0.0), r"eps"), (dict(eps=float("nan")), r"eps"),
                         (dict(var_floor=-1.0), r"var_floor"),
                         (dict(var_floor=float("inf")), r"var_floor")]:
        with pytest.raises(ValueError, match=r"mixattn::gma::.*" + message):
            mixattn.gma_attention(*args, **bad)
    for bad, message in [(dict(block=0), r"block"), (dict(max_centroids=-1), r"max_centroids"),
                         (dict(norm_eps=0.0), r"norm_eps"), (dict(growth_alpha=-1.0),
                                                             r"growth_alpha")]:
        with pytest.raises(ValueError, match=r"mixattn::ovq::.*" + message):
            mixattn.ovq_attention(q, k, v, beta, **bad)


def test_states_from_another_configuration_are_refused():
    q, k, v, beta = ovq_args()
    _, state = mixattn.ovq_attention(q, k, v, beta, block=2, max_centroids=3,
                                     output_final_state=True)
    # Options the library's own state checks accept (5 tokens seen and 1 pending fit block 4
    # as they fit block 2), but not the ones the state was made with.
    for other in (dict(block=4, max_centroids=3), dict(block=2, max_centroids=4),
                  dict(block=2, max_centroids=3, seeding="one_shot"),
                  dict(block=2, max_centroids=3, norm_eps=0.5)):
        with pytest.raises(ValueError, match=r"mixattn.ovq_attention: initial_state was made "
                                             r"with block=2, max_centroids=3, .* but this call "
                                             r"has "):
            mixattn.ovq_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], beta,
                                  initial_state=state, **other)
    # The state's own options, and a change of check_finite, are welcome.
    mixattn.ovq_attention(q, k, v, beta, initial_state=state, block=2, max_centroids=3,
                          check_finite=False)
    with pytest.raises(ValueError, match=r"initial_state was made for \(batch or sequences, "
                                         r"heads, key dim, value dim\) = \(2, 2, 3, 2\)"):
        mixattn.ovq_attention(q[..., :2], k[..., :2], v, beta, initial_state=state, block=2,
                              max_centroids=3)


def test_modules_refuse_bad_input():
    def layers():
        return (mixattn.GaussianMixtureAttention(8, heads=2, components=3, causal=True),
                mixattn.OnlineVQAttention(8, heads=2, block=4),
                mixattn.LinearAttention(8, heads=2, rope=True),
                mixattn.PerformerAttention(8, heads=2, features=3, seed=1),
                mixattn.VQAttention(8, heads=2, codes=3),
                mixattn.SlidingWindowAttention(8, heads=2, window=2, rope=True),
                mixattn.GatedDeltaAttention(8, heads=2, chunk_size=2))

    for layer, on_meta in zip(layers(), layers()):
        name = type(layer).__name__
        for x in (torch.randn(2, 3), torch.randn(2, 3, 7)):
            with pytest.raises(ValueError, match=rf"{name}: x has shape .* expected \(batch, "
                                                 r"tokens, 8\)"):
                layer(x)
        with pytest.raises(RuntimeError):  # torch's own Linear refuses a float64 x
            layer(torch.randn(1, 3, 8, dtype=DOUBLE))
        with pytest.raises(ValueError, match=r"must be a dense CPU tensor, got a meta tensor"):
            on_meta.to("meta")(torch.randn(1, 3, 8, device="meta"))
    with pytest.raises(ValueError, match=r"GaussianMixtureAttention: components is 0"):
        mixattn.GaussianMixtureAttention(8, heads=2, components=0)
    with pytest.raises(ValueError, match=r"OnlineVQAttention: d_model is 8 and heads is 0"):
        mixattn.OnlineVQAttention(8, heads=0)
    with pytest.raises(ValueError, match=r"VQAttention: codes is 0"):
        mixattn.VQAttention(8, heads=2, codes=0)
    with pytest.raises(ValueError, match=r"SlidingWindowAttention: window is 0"):
        mixattn.SlidingWindowAttention(8, heads=2, window=0)
    with pytest.raises(ValueError, match=r"LinearAttention: rope=True needs an even key_dim"):
        mixattn.LinearAttention(8, heads=2, key_dim=3, rope=True)
