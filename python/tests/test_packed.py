"""cu_seqlens: packed variable-length sequences along T of (1, H, T, .) tensors, for gma_attention
and flash_attention: against separate calls and the eager twins (outputs and every gradient),
gradcheck, rejections."""

import pytest
import torch

import eager
import mixattn
from test_functional import DOUBLE, assert_rel, gma_inputs, flash_inputs

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
    with pytest.raises(ValueError, match=r"cu_seqlens cannot be combined with initial_state"):
        gma(*one, *mix, causal=True, cu_seqlens=[0, 6], output_final_state=True)
    with pytest.raises(ValueError, match=r"mixattn.flash_attention: cu_seqlens packs"):
        flash(one[0], one[1][:, :, :4], one[2][:, :, :4], cu_seqlens=[0, 6])
