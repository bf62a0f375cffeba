"""mixattn.gated_delta_rule and mixattn.GatedDeltaAttention: outputs, final states and the
gradients of every input (initial_state included) against a plain PyTorch recurrence written
here token by token from SPEC.md 9.1 (not the library's chunked form), in float64 with
non-contiguous inputs and B, H > 1; gradcheck in float64; a sequence in pieces carrying the
state against one call; packed calls against separate ones; float32 against float64; and the
refusals, each naming the argument."""

import math

import pytest
import torch

import mixattn
from test_functional import DOUBLE, noncontiguous

# The chunked form (WY representation, (I + A)^-1 by substitution, matrix products) and the
# recurrence below compute the same float64 quantities in different orders; on these problems,
# whose state updates are contractions (beta |k|^2 <= 1), the rounding differences stay within a
# few hundred ulps of the norm, so 1e-12 normwise still catches any wrong term (an error of one
# gate or one key's contribution is O(1e-2) relative).
REL = 1e-12


def assert_close(actual, expected, what, rel=REL):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    norm = expected.norm().item()
    err = (actual - expected).norm().item()
    assert err <= rel * max(norm, 1e-300), f"{what}: |diff| {err:.3e}, |expected| {norm:.3e}"


def recurrence(q, k, v, g, beta, scale=None, initial_state=None, normalize=False, eps=1e-6):
    """SPEC 9.1 token by token: S_t = e^(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T,
    o_t = scale S_t^T q_t, written as S' = e^(g_t) S, S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T.
    Returns (o, final state)."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    if normalize:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
    scale = 1.0 / math.sqrt(dk) if scale is None else scale
    S = torch.zeros(b, h, dk, dv, dtype=DOUBLE) if initial_state is None else initial_state
    outs = []
    for t in range(n):
        kt, vt = k[:, :, t], v[:, :, t]
        S = torch.exp(g[:, :, t])[..., None, None] * S
        err = vt - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, beta[:, :, t, None] * err)
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    o = torch.stack(outs, 2) if outs else q.new_zeros(b, h, 0, dv)
    return o, S


def delta_inputs(b, h, n, dk, dv, seed, unit_keys=True, dtype=DOUBLE):
    """q, k, v (B, H, N, d) as non-contiguous views, g in (-0.7, 0] and beta in [0, 1) as
    (B, H, N) views of (B, N, H) tensors. unit_keys: k scaled so that |k_t| ~ 1 (the rule
    without normalisation then stays a contraction)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (noncontiguous(b, h, n, d, gen, dtype) for d in (dk, dk, dv))
    if unit_keys:
        k = k / math.sqrt(dk)
    g = -0.7 * torch.rand(b, n, h, generator=gen, dtype=dtype).transpose(1, 2)
    beta = torch.rand(b, n, h, generator=gen, dtype=dtype).transpose(1, 2)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def start_state(b, h, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(b, h, dk, dv, generator=gen, dtype=DOUBLE)).requires_grad_()


def outputs_and_grads(fn, inputs, seed):
    """(o, final state) and the gradients of every input for random cotangents of both."""
    o, S = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=DOUBLE)).sum() + \
        (S * torch.randn(S.shape, generator=gen, dtype=DOUBLE)).sum()
    return o, S, torch.autograd.grad(loss, inputs)


NAMES = ("q", "k", "v", "g", "beta", "initial_state")
CASES = {  # (N, keywords, unit keys, an initial state)
    "plain": (37, {}, True, False),
    "chunk 4": (37, dict(chunk_size=4), True, False),
    "chunk 1": (9, dict(chunk_size=1), True, False),
    "one chunk longer than N": (5, dict(chunk_size=64), True, True),
    "l2norm": (37, dict(use_qk_l2norm_in_kernel=True, chunk_size=8), False, False),
    "scale": (37, dict(scale=0.35, chunk_size=16), True, False),
    "initial state": (37, dict(chunk_size=8), True, True),
    "l2norm initial state": (21, dict(use_qk_l2norm_in_kernel=True, chunk_size=4), False, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_recurrence(case):
    n, kw, unit, with_state = CASES[case]
    b, h, dk, dv = 2, 3, 5, 4
    inputs = delta_inputs(b, h, n, dk, dv, seed=len(case), unit_keys=unit)
    if with_state:
        inputs.append(start_state(b, h, dk, dv, seed=100 + n))
    normalize = kw.get("use_qk_l2norm_in_kernel", False)

    def ours(*x):
        return mixattn.gated_delta_rule(*x[:5], initial_state=x[5] if with_state else None,
                                        output_final_state=True, **kw)

    def twin(*x):
        return recurrence(*x[:5], scale=kw.get("scale"),
                          initial_state=x[5] if with_state else None, normalize=normalize)

    o, S, grads = outputs_and_grads(ours, inputs, seed=n)
    o_t, S_t, grads_t = outputs_and_grads(twin, inputs, seed=n)
    assert o.dtype == DOUBLE and S.dtype == DOUBLE and S.shape == (b, h, dk, dv)
    assert_close(o, o_t, f"{case}: output")
    assert_close(S, S_t, f"{case}: final state")
    for name, a, e in zip(NAMES, grads, grads_t):
        assert_close(a, e, f"{case}: gradient of {name}")


@pytest.mark.parametrize("normalize", [False, True])
def test_gradcheck_every_input_and_the_state(normalize):
    b, h, n, dk, dv = 2, 2, 7, 3, 2
    inputs = delta_inputs(b, h, n, dk, dv, seed=11 + normalize, unit_keys=not normalize)
    inputs.append(start_state(b, h, dk, dv, seed=12))

    def fn(q, k, v, g, beta, S0):
        return mixattn.gated_delta_rule(q, k, v, g, beta, initial_state=S0,
                                        output_final_state=True, chunk_size=3,
                                        use_qk_l2norm_in_kernel=normalize)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_packed_with_states():
    cu = [0, 3, 3, 8]
    q, k, v, g, beta = (t.detach()[:1].contiguous().requires_grad_()
                        for t in delta_inputs(1, 2, 8, 3, 2, seed=13))
    S0 = start_state(3, 2, 3, 2, seed=14)

    def fn(q, k, v, g, beta, S0):
        return mixattn.gated_delta_rule(q, k, v, g, beta, initial_state=S0,
                                        output_final_state=True, cu_seqlens=cu, chunk_size=2)
    assert torch.autograd.gradcheck(fn, (q, k, v, g, beta, S0), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("cuts", [[0, 37], [0, 1, 37], [0, 10, 10, 23, 36, 37], [0, 16, 32, 37]])
def test_pieces_carrying_the_state_equal_one_call(cuts):
    """Outputs, final state and the gradients of every input through the chained states."""
    b, h, dk, dv = 2, 2, 4, 3
    inputs = delta_inputs(b, h, 37, dk, dv, seed=21)
    inputs.append(start_state(b, h, dk, dv, seed=22))

    def one(q, k, v, g, beta, S0):
        return mixattn.gated_delta_rule(q, k, v, g, beta, initial_state=S0,
                                        output_final_state=True, chunk_size=8)

    def pieces(q, k, v, g, beta, S0):
        outs, S = [], S0
        for a, c in zip(cuts[:-1], cuts[1:]):
            o, S = mixattn.gated_delta_rule(q[:, :, a:c], k[:, :, a:c], v[:, :, a:c],
                                            g[:, :, a:c], beta[:, :, a:c], initial_state=S,
                                            output_final_state=True, chunk_size=8)
            outs.append(o)
        return torch.cat(outs, 2), S

    o, S, grads = outputs_and_grads(one, inputs, seed=23)
    o_p, S_p, grads_p = outputs_and_grads(pieces, inputs, seed=23)
    assert_close(o_p, o, f"pieces {cuts}: output")
    assert_close(S_p, S, f"pieces {cuts}: final state")
    for name, a, e in zip(NAMES, grads_p, grads):
        assert_close(a, e, f"pieces {cuts}: gradient of {name}")


CU = [0, 5, 5, 6, 30, 37]  # an empty sequence, one token, sequences longer than a chunk


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_equals_separate_calls(with_state):
    h, dk, dv = 3, 4, 2
    q, k, v, g, beta = (t.detach()[:1].requires_grad_()
                        for t in delta_inputs(1, h, CU[-1], dk, dv, seed=31))
    sequences = len(CU) - 1
    S0 = start_state(sequences, h, dk, dv, seed=32) if with_state else None
    inputs = [q, k, v, g, beta] + ([S0] if with_state else [])

    def packed(*x):
        return mixattn.gated_delta_rule(*x[:5], initial_state=x[5] if with_state else None,
                                        output_final_state=True, cu_seqlens=CU, chunk_size=4)

    def separate(*x):
        outs, ends = [], []
        for i, (a, c) in enumerate(zip(CU[:-1], CU[1:])):
            o, S = mixattn.gated_delta_rule(
                *(t[:, :, a:c] for t in x[:5]),
                initial_state=x[5][i:i + 1] if with_state else None, output_final_state=True,
                chunk_size=4)
            outs.append(o)
            ends.append(S)
        return torch.cat(outs, 2), torch.cat(ends, 0)

    o, S, grads = outputs_and_grads(packed, inputs, seed=33)
    o_s, S_s, grads_s = outputs_and_grads(separate, inputs, seed=33)
    assert S.shape == (sequences, h, dk, dv)
    # Each (sequence, head) item is the single-sequence call on the same rows: equal up to the
    # rounding of operands read at other alignments (GEMM kernels), far below REL.
    assert_close(o, o_s, "packed output")
    assert_close(S, S_s, "packed final states")
    for name, a, e in zip(NAMES, grads, grads_s):
        assert_close(a, e, f"packed gradient of {name}")
    if not with_state:  # an empty sequence ends in the zero state it started from
        assert torch.count_nonzero(S[1]) == 0


def test_float32_follows_float64():
    """float32 inputs give float32 outputs and a float64 state, close to the float64 call:
    float32's 6e-8 rounding over 37 contracting steps, well within 1e-5 relative."""
    inputs = [t.detach() for t in delta_inputs(2, 2, 37, 4, 3, seed=41)]
    S0 = start_state(2, 2, 4, 3, seed=42).detach()
    o64, S64 = mixattn.gated_delta_rule(*inputs, initial_state=S0, output_final_state=True,
                                        chunk_size=8)
    o32, S32 = mixattn.gated_delta_rule(*(t.float() for t in inputs), initial_state=S0.float(),
                                        output_final_state=True, chunk_size=8)
    assert o32.dtype == torch.float32 and S32.dtype == DOUBLE
    assert_close(o32.double(), o64, "float32 output", rel=1e-5)
    assert_close(S32, S64, "float32 final state", rel=1e-5)


def test_final_state_only_when_asked_and_defaults():
    q, k, v, g, beta = (t.detach() for t in delta_inputs(1, 2, 6, 3, 2, seed=43))
    o, S = mixattn.gated_delta_rule(q, k, v, g, beta)
    assert S is None and o.shape == (1, 2, 6, 2)
    twin, _ = recurrence(q, k, v, g, beta)
    assert_close(o, twin, "defaults: scale 1/sqrt(d_k), no normalisation")


def test_double_backward_raises():
    inputs = delta_inputs(1, 1, 4, 2, 2, seed=44)
    o, _ = mixattn.gated_delta_rule(*inputs)
    (dq,) = torch.autograd.grad(o.sum(), inputs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="first-order only"):
        dq.sum().backward()


def test_refusals_name_the_argument():
    q, k, v, g, beta = (t.detach().contiguous() for t in delta_inputs(2, 2, 5, 3, 2, seed=45))
    fn = r"mixattn[.:]+gated_delta_rule|mixattn::delta::\w+"
    call = mixattn.gated_delta_rule
    bad_g, bad_beta, low_beta = g.clone(), beta.clone(), beta.clone()
    bad_g[1, 0, 2] = 0.25
    bad_beta[0, 1, 4] = 1.5
    low_beta[0, 0, 0] = -0.1
    for args, kw, error, message in [
        ((q, k, v, bad_g, beta), {}, ValueError, r"g has 0.25 at row 2 of 5; g is a log decay"),
        ((q, k, v, g, bad_beta), {}, ValueError, r"beta has 1.5 at row 4 of 5"),
        ((q, k, v, g, low_beta), {}, ValueError, r"beta has -0.1 at row 0"),
        ((q, k, v, g[:, :, :4], beta), {}, ValueError,
         r"g has shape \[2, 2, 4\] but dimension 2 must be 5 \(tokens of q\)"),
        ((q, k, v, g, beta[:1]), {}, ValueError, r"beta has shape \[1, 2, 5\]"),
        ((q, k, v, g, beta.unsqueeze(-1)), {}, ValueError, r"beta must have 3 dimensions"),
        ((q, k[:, :, :4], v[:, :, :4], g, beta), {}, ValueError,
         r"the gated delta rule is causal: k has shape"),
        ((q, k, v, g, beta), dict(initial_state=torch.zeros(2, 2, 3, 3, dtype=DOUBLE)),
         ValueError, r"initial_state has shape \[2, 2, 3, 3\] but must be \[2, 2, 3, 2\] "
                     r"\(batch, heads, key dim, value dim\)"),
        ((q, k, v, g, beta), dict(initial_state=torch.zeros(2, 2, 3, 2, dtype=torch.int64)),
         ValueError, r"initial_state must be float32 or float64, got torch.int64"),
        ((q, k, v, g, beta), dict(initial_state=[[0.0]]), TypeError,
         r"initial_state must be a torch.Tensor, got list"),
        ((q, k, v, g, beta), dict(scale=0.0), ValueError, r"scale is 0.0; it must be finite"),
        ((q, k, v, g, beta), dict(scale=-1.0), ValueError, r"scale is -1.0"),
        ((q, k, v, g, beta), dict(scale=math.inf), ValueError, r"scale is inf"),
        ((q, k, v, g, beta), dict(chunk_size=0), ValueError, r"chunk_size is 0; it must be >= 1"),
        ((q, k, v, g, beta), dict(chunk_size=2.5), TypeError, r"chunk_size must be an integer"),
        ((q, k, v, g, beta), dict(use_qk_l2norm_in_kernel="yes"), TypeError,
         r"use_qk_l2norm_in_kernel must be True or False"),
        ((q, k, v, g, beta), dict(output_final_state=2), TypeError,
         r"output_final_state must be True or False"),
        ((q, k, v, g.float(), beta), {}, ValueError, r"g is Float but q is Double"),
        ((q, k, v, g, beta.tolist()), {}, TypeError, r"beta must be a torch.Tensor, got list"),
        ((q, k, v, g, beta), dict(cu_seqlens=[0, 5]), ValueError,
         r"cu_seqlens packs the sequences along the tokens of one batch entry"),
    ]:
        with pytest.raises(error, match=rf"({fn}).*{message}"):
            call(*args, **kw)
    # A packed call's state is one per sequence.
    with pytest.raises(ValueError, match=r"initial_state has shape \[1, 2, 3, 2\] but must be "
                                         r"\[2, 2, 3, 2\] \(sequences, heads"):
        call(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=[0, 2, 5],
             initial_state=torch.zeros(1, 2, 3, 2, dtype=DOUBLE))
    # NaN reaches the output with check_finite=False (documented), and is refused without.
    nan_v = v.clone()
    nan_v[0, 0, 1, 0] = math.nan
    with pytest.raises(ValueError, match=r"v has a non-finite entry"):
        call(q, k, nan_v, g, beta)
    assert torch.isnan(call(q, k, nan_v, g, beta, check_finite=False)[0]).any()


# --- the module ----------------------------------------------------------------------------------

def module_twin(layer, x, initial_state=None):
    """GatedDeltaAttention's forward from its parameters with the recurrence: the projections,
    the gates of SPEC-style Gated DeltaNet, normalised q and k, the output projection."""
    b, n, _ = x.shape
    h, dk, dv = layer.heads, layer.key_dim, layer.value_dim
    q = (x @ layer.q_proj.weight.T).view(b, n, h, dk).transpose(1, 2)
    k = (x @ layer.k_proj.weight.T).view(b, n, h, dk).transpose(1, 2)
    v = (x @ layer.v_proj.weight.T).view(b, n, h, dv).transpose(1, 2)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T).transpose(1, 2)
    a = x @ layer.a_proj.weight.T + layer.dt_bias
    g = (-torch.exp(layer.A_log) * torch.log1p(torch.exp(a))).transpose(1, 2)
    o, S = recurrence(q, k, v, g, beta, initial_state=initial_state, normalize=True)
    return o.transpose(1, 2).reshape(b, n, h * dv) @ layer.out_proj.weight.T, S


def test_module_matches_its_formula():
    torch.manual_seed(51)
    layer = mixattn.GatedDeltaAttention(12, heads=3, chunk_size=4, dtype=DOUBLE)
    x = torch.randn(2, 19, 12, dtype=DOUBLE, requires_grad=True)
    S0 = start_state(2, 3, 4, 4, seed=52)
    y, S = layer(x, initial_state=S0, output_final_state=True)
    y_t, S_t = module_twin(layer, x, S0)
    assert y.shape == (2, 19, 12) and S.shape == (2, 3, 4, 4)
    assert_close(y, y_t, "module output")
    assert_close(S, S_t, "module final state")
    params = [x, S0, *layer.parameters()]
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(53), dtype=DOUBLE)
    for a, e in zip(torch.autograd.grad((y * cot).sum() + S.sum(), params),
                    torch.autograd.grad((y_t * cot).sum() + S_t.sum(), params)):
        assert_close(a, e, "module gradient")
    for p in (layer.A_log, layer.dt_bias):  # the gates' parameters are learned
        assert torch.autograd.grad(layer(x).square().sum(), p)[0].abs().max() > 0


def test_module_streams_and_packs():
    torch.manual_seed(54)
    layer = mixattn.GatedDeltaAttention(8, heads=2, chunk_size=4, rope=True, dtype=DOUBLE)
    x = torch.randn(1, 15, 8, dtype=DOUBLE)
    with torch.no_grad():
        whole = layer(x)
        a, S = layer(x[:, :6], output_final_state=True)
        b = layer(x[:, 6:], initial_state=S, start=6)
        assert_close(torch.cat([a, b], 1), whole, "module in pieces")
        packed = layer(torch.cat([x, x[:, :4]], 1), cu_seqlens=[0, 15, 19])
        assert_close(packed[:, :15], whole, "module packed, first sequence")
        assert_close(packed[:, 15:], layer(x[:, :4]), "module packed, second sequence")
    with pytest.raises(ValueError, match=r"rope=True continuing initial_state needs start="):
        layer(x[:, 6:], initial_state=S)
    with pytest.raises(ValueError, match=r"GatedDeltaAttention: chunk_size is 0"):
        mixattn.GatedDeltaAttention(8, heads=2, chunk_size=0)


def test_module_learns_a_copy_task():
    """A few Adam steps on a small causal regression lower the loss: the gates and projections
    receive usable gradients in float32."""
    torch.manual_seed(55)
    layer = mixattn.GatedDeltaAttention(16, heads=2)
    x = torch.randn(4, 24, 16)
    target = torch.roll(x, 1, dims=1)  # the previous token: needs the state
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = (layer(x) - target)[:, 1:].square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
