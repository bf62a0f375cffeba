"""cu_seqlens: packed variable-length sequences along T of (1, H, T, .) tensors, for gma_attention
and flash_attention: against separate calls and the eager twins (outputs and every gradient),
gradcheck, rejections."""

import pytest
import torch

import eager
import mixattn
from test_functional import DOUBLE, assert_rel, gma_inputs, flash_inputs, ovq_inputs
from test_streaming import random_state

# Lengths with an empty sequence, a single token and sequences longer than the causal chunk.
LENGTHS = [5, 0, 1, 40, 12]
CU = [0, 5, 5, 6, 46, 58]

# Packed against separate calls, float64: each (sequence, head) pair is the same single-sequence
# computation, so outputs and q, k, v gradients agree to rounding; the mixture gradients are the
# same per-sequence terms summed in another order (sequence order vs autograd's accumulation),
# a few ulps of O(1) sums: 1e-12 of the largest entry keeps two orders of margin while a
# sequence attending across its boundary moves results by O(1).
SEPARATE_REL = 1e-12


def split(x):
    return [x[:, :, a:b] for a, b in zip(CU[:-1], CU[1:])]


def gradients(outs, inputs, seed):
    out = torch.cat(outs, 2) if isinstance(outs, list) else outs
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return out, torch.autograd.grad(out, inputs, cot)


@pytest.mark.parametrize("causal", [False, True])
def test_gma_packed_equals_separate_calls_and_eager(causal):
    inputs = gma_inputs(1, 3, CU[-1], CU[-1], 5, 4, 6, seed=301)
    q, k, v, *mix = inputs
    cu = torch.tensor(CU, dtype=torch.int32)
    packed, g_packed = gradients(
        mixattn.gma_attention(*inputs, causal=causal, cu_seqlens=cu), inputs, 302)
    assert packed.shape == (1, 3, CU[-1], 4)
    separate, g_separate = gradients(
        [mixattn.gma_attention(a, b, c, *mix, causal=causal)
         for a, b, c in zip(split(q), split(k), split(v))], inputs, 302)
    expected, g_eager = gradients(
        [eager.gma(a, b, c, *mix, causal=causal) for a, b, c in zip(split(q), split(k), split(v))],
        inputs, 302)
    assert_rel(packed, separate, "gma packed output vs separate", rel=SEPARATE_REL)
    assert_rel(packed, expected, "gma packed output vs eager")
    names = ("q", "k", "v", "mean", "var_raw", "prior_logit")
    for name, a, b, e in zip(names, g_packed, g_separate, g_eager):
        assert_rel(a, b, f"gma packed gradient of {name} vs separate", rel=SEPARATE_REL)
        assert_rel(a, e, f"gma packed gradient of {name} vs eager")


@pytest.mark.parametrize("causal", [False, True])
def test_flash_packed_equals_separate_calls_and_eager(causal):
    inputs = flash_inputs(1, 2, CU[-1], CU[-1], 6, 3, seed=311)
    packed, g_packed = gradients(
        mixattn.flash_attention(*inputs, causal=causal, cu_seqlens=CU), inputs, 312)
    separate, g_separate = gradients(
        [mixattn.flash_attention(*x, causal=causal) for x in zip(*map(split, inputs))],
        inputs, 312)
    expected, g_eager = gradients(
        [eager.softmax_attention(*x, causal=causal) for x in zip(*map(split, inputs))],
        inputs, 312)
    assert_rel(packed, separate, "flash packed output vs separate", rel=SEPARATE_REL)
    assert_rel(packed, expected, "flash packed output vs eager")
    for name, a, b, e in zip("qkv", g_packed, g_separate, g_eager):
        assert_rel(a, b, f"flash packed gradient of {name} vs separate", rel=SEPARATE_REL)
        assert_rel(a, e, f"flash packed gradient of {name} vs eager")


@pytest.mark.parametrize("causal", [False, True])
def test_packed_gradcheck(causal):
    cu = [0, 2, 5]
    inputs = gma_inputs(1, 2, 5, 5, 3, 2, 3, seed=321)
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.gma_attention(*x, causal=causal, cu_seqlens=cu), inputs, eps=1e-6,
        atol=1e-7, rtol=1e-5)
    inputs = flash_inputs(1, 2, 5, 5, 3, 2, seed=322)
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.flash_attention(*x, causal=causal, cu_seqlens=cu), inputs, eps=1e-6,
        atol=1e-7, rtol=1e-5)


def test_packed_rejections():
    q, k, v, *mix = gma_inputs(2, 2, 6, 6, 3, 2, 3, seed=331, contiguous=True)
    gma, flash = mixattn.gma_attention, mixattn.flash_attention
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: cu_seqlens packs the sequences "
                                         r"along the tokens of one batch entry"):
        gma(q, k, v, *mix, cu_seqlens=[0, 6])
    one = [x[:1] for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: cu_seqlens is \[0, 5\]; it "
                                         r"must hold N \+ 1 >= 2 nondecreasing offsets from 0 "
                                         r"to the 6 tokens"):
        gma(*one, *mix, cu_seqlens=[0, 5])
    with pytest.raises(ValueError, match=r"cu_seqlens is \[0, 4, 2, 6\]"):
        flash(*one, cu_seqlens=[0, 4, 2, 6])
    with pytest.raises(ValueError, match=r"cu_seqlens is \[6\]"):
        flash(*one, cu_seqlens=[6])
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D int32 or int64 tensor"):
        gma(*one, *mix, cu_seqlens=torch.tensor([0.0, 6.0]))
    with pytest.raises(ValueError, match=r"initial_state and output_final_state need "
                                         r"causal=True"):
        gma(*one, *mix, cu_seqlens=[0, 2, 6], output_final_state=True)
    S0 = torch.zeros(1, 2, 3, 2, dtype=DOUBLE)  # one state, but two sequences
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) has shape \(1, 2, 3, 2\) "
                                         r"but must be \(2, 2, 3, 2\) \(sequences, heads"):
        gma(*one, *mix, causal=True, cu_seqlens=[0, 2, 6], initial_state=(S0, S0[..., 0]))
    with pytest.raises(ValueError, match=r"mixattn.flash_attention: cu_seqlens packs"):
        flash(one[0], one[1][:, :, :4], one[2][:, :, :4], cu_seqlens=[0, 6])


# --- cu_seqlens with a state per sequence (causal streaming) ----------------------------------

def packed_state_call(q, k, v, mean, var_raw, prior, S0, z0, cu=CU):
    out, (S, z) = mixattn.gma_attention(q, k, v, mean, var_raw, prior, causal=True,
                                        cu_seqlens=cu, initial_state=(S0, z0),
                                        output_final_state=True)
    return out, S, z


def test_gma_packed_states_equal_separate_streaming_calls_and_eager():
    heads, r, dv, k = 3, 5, 4, 6
    inputs = gma_inputs(1, heads, CU[-1], CU[-1], r, dv, k, seed=341)
    S0, z0 = random_state(len(LENGTHS), heads, k, dv, seed=342)
    args = (*inputs, S0, z0)
    q, kk, v, *mix = inputs

    def separate(call):
        outs, Ss, zs = [], [], []
        for i, (a, b, c) in enumerate(zip(split(q), split(kk), split(v))):
            o, S, z = call(a, b, c, *mix, S0[i:i + 1], z0[i:i + 1])
            outs.append(o)
            Ss.append(S)
            zs.append(z)
        return torch.cat(outs, 2), torch.cat(Ss), torch.cat(zs)

    def streaming(*x):
        out, (S, z) = mixattn.gma_attention(*x[:6], causal=True, initial_state=x[6:],
                                            output_final_state=True)
        return out, S, z

    def eager_streaming(*x):
        out, (S, z) = eager.gma_continued(*x)
        return out, S, z

    packed = packed_state_call(*args)
    assert packed[0].shape == (1, heads, CU[-1], dv)
    assert packed[1].shape == (len(LENGTHS), heads, k, dv) and packed[2].shape == S0.shape[:3]
    # The empty second sequence passes its state through.
    assert torch.equal(packed[1][1], S0[1]) and torch.equal(packed[2][1], z0[1])
    ones = separate(streaming)
    expected = separate(eager_streaming)
    gen = torch.Generator().manual_seed(343)
    cots = [torch.randn(e.shape, generator=gen, dtype=DOUBLE) for e in expected]
    g_packed = torch.autograd.grad(packed, args, cots)
    g_ones = torch.autograd.grad(ones, args, cots)
    g_eager = torch.autograd.grad(expected, args, cots)
    for name, a, b, e in zip(("output", "final S", "final z"), packed, ones, expected):
        assert_rel(a, b, f"gma packed state {name} vs separate", rel=SEPARATE_REL)
        assert_rel(a, e, f"gma packed state {name} vs eager")
    names = ("q", "k", "v", "mean", "var_raw", "prior_logit", "initial S", "initial z")
    for name, a, b, e in zip(names, g_packed, g_ones, g_eager):
        assert_rel(a, b, f"gma packed state gradient of {name} vs separate", rel=SEPARATE_REL)
        assert_rel(a, e, f"gma packed state gradient of {name} vs eager")


def test_gma_packed_state_gradcheck():
    cu = [0, 2, 2, 5]
    inputs = gma_inputs(1, 2, 5, 5, 3, 2, 3, seed=351)
    state = random_state(3, 2, 3, 2, seed=352)
    assert torch.autograd.gradcheck(lambda *x: packed_state_call(*x, cu=cu), (*inputs, *state),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


# --- OVQ: one dictionary per sequence -----------------------------------------------------------

OVQ_OPTS = dict(block=4, max_centroids=6)  # several blocks and a full dictionary in 40 tokens


def test_ovq_packed_equals_separate_calls_and_eager():
    inputs = ovq_inputs(1, 2, CU[-1], 3, 4, seed=361)
    q, k, v, beta = inputs
    packed, state = mixattn.ovq_attention(*inputs, cu_seqlens=CU, output_final_state=True,
                                          **OVQ_OPTS)
    assert packed.shape == (1, 2, CU[-1], 4) and state.batch == len(LENGTHS)
    packed, g_packed = gradients(packed, inputs, 362)
    separate, g_separate = gradients(
        [mixattn.ovq_attention(a, b, c, beta, **OVQ_OPTS)
         for a, b, c in zip(split(q), split(k), split(v))], inputs, 362)
    expected, g_eager = gradients(
        [eager.ovq(a, b, c, beta, **OVQ_OPTS) for a, b, c in zip(split(q), split(k), split(v))],
        inputs, 362)
    assert_rel(packed, separate, "ovq packed output vs separate", rel=SEPARATE_REL)
    assert_rel(packed, expected, "ovq packed output vs eager")
    for name, a, b, e in zip(("q", "k", "v", "beta"), g_packed, g_separate, g_eager):
        assert_rel(a, b, f"ovq packed gradient of {name} vs separate", rel=SEPARATE_REL)
        assert_rel(a, e, f"ovq packed gradient of {name} vs eager")


def test_ovq_packed_state_continues_each_sequence():
    # Two packed calls carrying the per-sequence dictionaries equal one packed call over the
    # sequences joined: sequence i's first piece then its second piece.
    first, second = [3, 0, 9], [6, 2, 0]
    inputs = ovq_inputs(1, 2, sum(first) + sum(second), 3, 4, seed=371, contiguous=True)
    q, k, v, beta = (x.detach() for x in inputs)
    cu1 = [0, *torch.tensor(first).cumsum(0).tolist()]
    cu2 = [0, *torch.tensor(second).cumsum(0).tolist()]
    cut = cu1[-1]
    piece1 = [x[:, :, :cut] for x in (q, k, v)]
    piece2 = [x[:, :, cut:] for x in (q, k, v)]
    out1, state = mixattn.ovq_attention(*piece1, beta, cu_seqlens=cu1, output_final_state=True,
                                        **OVQ_OPTS)
    out2 = mixattn.ovq_attention(*piece2, beta, cu_seqlens=cu2, initial_state=state, **OVQ_OPTS)
    for i in range(len(first)):
        whole = [torch.cat([a[:, :, cu1[i]:cu1[i + 1]], b[:, :, cu2[i]:cu2[i + 1]]], 2)
                 for a, b in zip(piece1, piece2)]
        one = mixattn.ovq_attention(*whole, beta, **OVQ_OPTS)
        got = torch.cat([out1[:, :, cu1[i]:cu1[i + 1]], out2[:, :, cu2[i]:cu2[i + 1]]], 2)
        assert_rel(got, one, f"ovq packed pieces of sequence {i} vs one call", rel=SEPARATE_REL)
    with pytest.raises(ValueError, match=r"initial_state was made for \(batch or sequences, "
                                         r"heads, key dim, value dim\) = \(3, 2, 3, 4\)"):
        mixattn.ovq_attention(*piece2, beta, cu_seqlens=[0, cu2[-1]], initial_state=state,
                              **OVQ_OPTS)


def test_ovq_packed_gradcheck():
    inputs = ovq_inputs(1, 2, 7, 3, 2, seed=381)
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.ovq_attention(*x, cu_seqlens=[0, 3, 7], block=2, max_centroids=3),
        inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
