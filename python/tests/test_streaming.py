"""Streaming with initial_state / output_final_state: causal GMA against the state-carrying eager
twin (tests/eager.py), gradcheck through the start and end states, a sequence in pieces against
one call (outputs and every gradient), and OVQ pieces carrying the dictionary."""

import pytest
import torch

import eager
import mixattn
from test_functional import DOUBLE, REL, assert_rel, gma_inputs, ovq_inputs

# Pieces against one call, float64: the same sums of the same terms, only grouped differently
# (the prefix restarts from the carried float64 state at each cut, and pieces shorter than the
# library's 32-token chunk take the token-by-token recurrence instead of the chunked scan). On
# these O(1)-conditioned problems of <= 70 tokens that moves results by a few ulps times the
# accumulation length, ~1e-14 of the largest entry; 1e-12 keeps two orders of margin, while a
# lost or doubled term (a dropped start state, a cut token counted twice) changes results by
# O(1/N) >= 1e-2.
PIECES_REL = 1e-12


def random_state(b, h, k, dv, seed, dtype=DOUBLE):
    """A state as a prefix leaves it: S any real, z positive (sums of responsibilities)."""
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(b, h, k, dv, generator=gen, dtype=dtype)
    z = 0.5 + 2 * torch.rand(b, h, k, generator=gen, dtype=dtype)
    return S.requires_grad_(), z.requires_grad_()


def gma_state_call(q, k, v, mean, var_raw, prior, S0, z0, **kw):
    out, (S, z) = mixattn.gma_attention(q, k, v, mean, var_raw, prior, causal=True,
                                        initial_state=(S0, z0), output_final_state=True, **kw)
    return out, S, z


# --- GMA against the eager twin ---------------------------------------------------------------

@pytest.mark.parametrize("contiguous", [False, True])
def test_gma_state_matches_eager(contiguous):
    b, h, n, r, dv, k = 2, 3, 37, 5, 4, 6
    inputs = gma_inputs(b, h, n, n, r, dv, k, seed=101, contiguous=contiguous)
    S0, z0 = random_state(b, h, k, dv, seed=102)
    if not contiguous:
        S0 = S0.detach().transpose(2, 3).contiguous().transpose(2, 3).requires_grad_()
        assert not S0.is_contiguous()
    args = (*inputs, S0, z0)
    ours = gma_state_call(*args, eps=1e-3)
    out, (S, z) = eager.gma_continued(*args, eps=1e-3)
    expected = (out, S, z)
    gen = torch.Generator().manual_seed(103)
    cots = [torch.randn(e.shape, generator=gen, dtype=DOUBLE) for e in expected]
    for name, a, e in zip(("output", "final S", "final z"), ours, expected):
        assert a.dtype == DOUBLE
        assert_rel(a, e, f"gma state {name}")
    g_ours = torch.autograd.grad(ours, args, cots)
    g_eager = torch.autograd.grad(expected, args, cots)
    names = ("q", "k", "v", "mean", "var_raw", "prior_logit", "initial S", "initial z")
    for name, a, e in zip(names, g_ours, g_eager):
        assert_rel(a, e, f"gma state gradient of {name}")


def test_gma_empty_initial_state_is_the_plain_call():
    inputs = gma_inputs(2, 2, 20, 20, 4, 3, 5, seed=111, contiguous=True)
    plain = mixattn.gma_attention(*inputs, causal=True)
    out, (S, z) = mixattn.gma_attention(*inputs, causal=True, output_final_state=True)
    assert_rel(out, plain, "output with output_final_state", rel=PIECES_REL)
    assert S.shape == (2, 2, 5, 3) and z.shape == (2, 2, 5) and S.dtype == z.dtype == DOUBLE
    zeros = (torch.zeros(2, 2, 5, 3, dtype=DOUBLE), torch.zeros(2, 2, 5, dtype=DOUBLE))
    _, (S_e, z_e) = eager.gma_continued(*inputs, *zeros)
    assert_rel(S, S_e, "final S from the empty state")
    assert_rel(z, z_e, "final z from the empty state")
    # Zero tokens: the final state is the initial one.
    S0, z0 = random_state(2, 2, 5, 3, seed=112)
    none = [x[:, :, :0] for x in inputs[:3]] + inputs[3:]
    out, (S, z) = mixattn.gma_attention(*none, causal=True, initial_state=(S0, z0),
                                        output_final_state=True)
    assert out.shape == (2, 2, 0, 3) and torch.equal(S, S0) and torch.equal(z, z0)


# --- gradcheck ---------------------------------------------------------------------------------

def test_gma_state_gradcheck():
    # Every input, the initial state included, against a loss on the output and the final state.
    inputs = gma_inputs(2, 2, 5, 5, 3, 2, 3, seed=121)
    state = random_state(2, 2, 3, 2, seed=122)
    assert torch.autograd.gradcheck(lambda *x: gma_state_call(*x), (*inputs, *state), eps=1e-6,
                                    atol=1e-7, rtol=1e-5)


def test_gma_final_state_gradcheck_from_empty_state():
    # Only the final state is used: its gradient must reach q (through gamma_k's mixture), k
    # and v; no initial state given.
    inputs = gma_inputs(1, 2, 4, 4, 3, 2, 3, seed=123)

    def final_state(*x):
        _, (S, z) = mixattn.gma_attention(*x, causal=True, output_final_state=True)
        return S, z

    assert torch.autograd.gradcheck(final_state, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# --- pieces against one call ---------------------------------------------------------------------

def run_pieces(inputs, cuts, dtype=DOUBLE):
    """The causal sequence in pieces [cuts[i], cuts[i+1]), each continuing the previous piece's
    final state through autograd; returns (output, (S, z)) of the whole sequence."""
    q, k, v, *mix = inputs
    state, outs = None, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        out, state = mixattn.gma_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], *mix,
                                           causal=True, initial_state=state,
                                           output_final_state=True)
        outs.append(out)
    return torch.cat(outs, 2), state


@pytest.mark.parametrize("cuts", [[0, 5, 50, 70], [0, 35, 70], [0, 1, 2, 3, 33, 70]])
def test_gma_pieces_equal_one_call(cuts):
    # Pieces shorter and longer than a chunk (32), a cut inside a chunk, single tokens.
    inputs = gma_inputs(2, 2, 70, 70, 6, 5, 7, seed=131)
    one_out, (one_S, one_z) = mixattn.gma_attention(*inputs, causal=True,
                                                    output_final_state=True)
    out, (S, z) = run_pieces(inputs, cuts)
    assert_rel(out, one_out, f"pieces {cuts} output", rel=PIECES_REL)
    assert_rel(S, one_S, f"pieces {cuts} final S", rel=PIECES_REL)
    assert_rel(z, one_z, f"pieces {cuts} final z", rel=PIECES_REL)
    # A loss on every output and the final state: backward runs through the pieces in reverse,
    # each handed its successor's gradient of the state it ended in.
    gen = torch.Generator().manual_seed(132)
    cots = [torch.randn(x.shape, generator=gen, dtype=DOUBLE) for x in (one_out, one_S, one_z)]
    g_one = torch.autograd.grad((one_out, one_S, one_z), inputs, cots)
    g_pieces = torch.autograd.grad((out, S, z), inputs, cots)
    names = ("q", "k", "v", "mean", "var_raw", "prior_logit")
    for name, a, e in zip(names, g_pieces, g_one):
        assert_rel(a, e, f"pieces {cuts} gradient of {name}", rel=PIECES_REL)


def test_gma_float32_pieces_follow_one_call():
    # float32 inputs, float64 state: the carried state is not rounded to float, so the pieces
    # differ from one call only by float32 rounding of the per-token terms (2^-24 ~ 6e-8
    # through O(1)-conditioned sums of ~60 terms).
    inputs = [x.detach().float().requires_grad_()
              for x in gma_inputs(1, 2, 60, 60, 4, 3, 5, seed=141, contiguous=True)]
    one_out, (one_S, _) = mixattn.gma_attention(*inputs, causal=True, output_final_state=True)
    out, (S, _) = run_pieces(inputs, [0, 7, 45, 60])
    assert out.dtype == torch.float32 and S.dtype == DOUBLE
    assert_rel(out.double(), one_out.double(), "float32 pieces output", rel=1e-5)
    assert_rel(S, one_S, "float32 pieces final S", rel=1e-5)
    g_one = torch.autograd.grad(one_out.sum() + one_S.sum(), inputs)
    g_pieces = torch.autograd.grad(out.sum() + S.sum(), inputs)
    for i, (a, e) in enumerate(zip(g_pieces, g_one)):
        assert a.dtype == torch.float32
        assert_rel(a.double(), e.double(), f"float32 pieces gradient {i}", rel=1e-4)


def test_gma_float32_initial_state_is_widened():
    inputs = gma_inputs(1, 1, 6, 6, 3, 2, 3, seed=151, contiguous=True)
    S0, z0 = random_state(1, 1, 3, 2, seed=152, dtype=torch.float32)
    out, (S, z) = mixattn.gma_attention(*inputs, causal=True, initial_state=(S0, z0),
                                        output_final_state=True)
    ref, (S_r, z_r) = eager.gma_continued(*inputs, S0.double(), z0.double())
    assert_rel(out, ref, "output from a float32 state")
    assert S.dtype == DOUBLE
    gS, gz = torch.autograd.grad(out.sum(), (S0, z0))
    assert gS.dtype == gz.dtype == torch.float32


# --- rejections ------------------------------------------------------------------------------

def test_gma_state_rejections_name_the_argument():
    q, k, v, mean, var_raw, prior = gma_inputs(2, 2, 4, 4, 3, 2, 3, seed=161, contiguous=True)
    mix = (mean, var_raw, prior)
    S0, z0 = random_state(2, 2, 3, 2, seed=162)
    call = mixattn.gma_attention
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: initial_state and "
                                         r"output_final_state need causal=True"):
        call(q, k, v, *mix, initial_state=(S0, z0))
    with pytest.raises(ValueError, match=r"need causal=True"):
        call(q, k, v, *mix, output_final_state=True)
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) has shape \(2, 2, 2, 2\) "
                                         r"but must be \(2, 2, 3, 2\)"):
        call(q, k, v, *mix, causal=True, initial_state=(S0[:, :, :2], z0))
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(z\) has shape \(2, 1, 3\)"):
        call(q, k, v, *mix, causal=True, initial_state=(S0, z0[:, :1]))
    with pytest.raises(ValueError, match=r"initial_state must be a pair \(S, z\)"):
        call(q, k, v, *mix, causal=True, initial_state=S0)
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(z\) must be a tensor"):
        call(q, k, v, *mix, causal=True, initial_state=(S0, None))
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) must be float32 or float64"):
        call(q, k, v, *mix, causal=True, initial_state=(S0.half(), z0))
    with pytest.raises(ValueError, match=r"mixattn::gma::forward_into: state.S has a non-finite"):
        call(q, k, v, *mix, causal=True,
             initial_state=(S0.detach().clone().fill_(float("inf")), z0))
    # The tensors' own checks still name the tensor when the state is in play.
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: q must have 4 dimensions"):
        call(q[0], k, v, *mix, causal=True, initial_state=(S0, z0))


# --- OVQ ---------------------------------------------------------------------------------------

OVQ_STREAM = dict(block=4, max_centroids=6)


def ovq_pieces(inputs, cuts, **opts):
    q, k, v, beta = inputs
    state, outs = None, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        out, state = mixattn.ovq_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], beta,
                                           initial_state=state, output_final_state=True, **opts)
        outs.append(out)
    return torch.cat(outs, 2), state


@pytest.mark.parametrize("cuts", [[0, 3, 10, 17, 23], [0, 8, 23], [0, 1, 2, 23]])
def test_ovq_pieces_equal_one_call(cuts):
    # Cuts inside a block and on a block boundary; the dictionary fills (max_centroids 6).
    inputs = ovq_inputs(2, 2, 23, 4, 3, seed=171)
    one = mixattn.ovq_attention(*inputs, **OVQ_STREAM)
    out, state = ovq_pieces(inputs, cuts, **OVQ_STREAM)
    assert (state.batch, state.heads) == (2, 2)
    assert_rel(out, one, f"ovq pieces {cuts} output", rel=PIECES_REL)
    # The final states agree too: a continuation of either gives the same output.
    gen = torch.Generator().manual_seed(172)
    more = [torch.randn(2, 2, 6, d, generator=gen, dtype=DOUBLE) for d in (4, 4, 3)]
    _, one_state = mixattn.ovq_attention(*inputs, output_final_state=True, **OVQ_STREAM)
    a = mixattn.ovq_attention(*more, inputs[3], initial_state=state, **OVQ_STREAM)
    b = mixattn.ovq_attention(*more, inputs[3], initial_state=one_state, **OVQ_STREAM)
    assert_rel(a, b, f"ovq pieces {cuts} continuation", rel=PIECES_REL)
    # Against the eager twin over the whole sequence (one call: 23 + 6 tokens).
    whole = [torch.cat([x.detach(), m], 2) for x, m in zip(inputs[:3], more)]
    assert_rel(torch.cat([one.detach(), b], 2), eager.ovq(*whole, inputs[3].detach(),
                                                          **OVQ_STREAM),
               "ovq continued against eager")


def test_ovq_state_is_not_changed_by_continuing_it():
    inputs = ovq_inputs(1, 2, 10, 3, 2, seed=181)
    _, state = mixattn.ovq_attention(*inputs, output_final_state=True, **OVQ_STREAM)
    more = [x.detach()[:, :, :5] for x in inputs[:3]]
    first = mixattn.ovq_attention(*more, inputs[3], initial_state=state, **OVQ_STREAM)
    second = mixattn.ovq_attention(*more, inputs[3], initial_state=state, **OVQ_STREAM)
    assert torch.equal(first, second)
    fresh = mixattn.ovq_attention(*more, inputs[3], **OVQ_STREAM)
    assert (first - fresh).abs().max() > 1e-3  # the state was read


def test_ovq_gradcheck_within_a_continued_call():
    # The dictionary the call starts from is a constant of q, k, v, beta of this call, so the
    # backward's gradients are the true ones here.
    first = [x.detach() for x in ovq_inputs(2, 2, 7, 3, 2, seed=191)]
    _, state = mixattn.ovq_attention(*first, output_final_state=True, block=3, max_centroids=3)
    inputs = ovq_inputs(2, 2, 6, 3, 2, seed=192)
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.ovq_attention(*x, block=3, max_centroids=3, initial_state=state),
        inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_ovq_state_rejections():
    inputs = ovq_inputs(2, 2, 5, 3, 2, seed=201)
    _, state = mixattn.ovq_attention(*inputs, output_final_state=True, **OVQ_STREAM)
    q, k, v, beta = inputs
    with pytest.raises(ValueError, match=r"initial_state must be the state an earlier"):
        mixattn.ovq_attention(q, k, v, beta, initial_state=(q, k), **OVQ_STREAM)
    with pytest.raises(ValueError, match=r"initial_state was made for \(batch or sequences, heads, "
                                         r"key dim, value dim\) = \(2, 2, 3, 2\)"):
        mixattn.ovq_attention(q[:1], k[:1], v[:1], beta, initial_state=state, **OVQ_STREAM)
    with pytest.raises(ValueError, match=r"initial_state holds ovq-state/Double dictionaries "
                                         r"but q is Float"):
        mixattn.ovq_attention(*(x.float() for x in inputs), initial_state=state, **OVQ_STREAM)
    # Options that disagree with the state's: its pending block does not fit block=3.
    with pytest.raises(ValueError, match=r"mixattn::ovq::forward_into: state.pending_keys"):
        mixattn.ovq_attention(q, k, v, beta, initial_state=state, block=3, max_centroids=6)


# --- decoding: the prepared mixture kept across calls --------------------------------------------

def decode(inputs, mixture=None):
    """One token per call from the empty state; `mixture(mix)` gives each call's mixture."""
    q, k, v, *mix = inputs
    state, outs = None, []
    for t in range(q.shape[2]):
        out, state = mixattn.gma_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                           *(mixture(mix) if mixture else mix), causal=True,
                                           initial_state=state, output_final_state=True)
        outs.append(out)
    return torch.cat(outs, 2), state


def test_gma_decode_reuses_the_prepared_mixture_with_the_same_bits():
    from mixattn import functional
    cache = functional._PREPARED
    inputs = gma_inputs(2, 3, 9, 9, 5, 4, 6, seed=131, contiguous=True)
    mixattn.clear_prepared_cache()
    hits, misses, stale = cache.hits, cache.misses, cache.stale
    with torch.no_grad():
        out, (S, z) = decode(inputs)
    assert (cache.hits - hits, cache.misses - misses, cache.stale - stale) == (8, 1, 0)
    # The kernel with and without the prepared mixture: the same reduction, so the same bits.
    q, k, v, *mix = (x.detach() for x in inputs)
    prepared = cache.get(*mix, 1e-4, True)
    S0, z0 = (t.detach() for t in random_state(2, 3, 6, 4, seed=132))
    forward = torch.ops.mixattn.gma_forward_state
    plain = forward(q, k, v, *mix, S0, z0, 1e-6, 1e-4, True, False, None, None)
    fast = forward(q, k, v, *mix, S0, z0, 1e-6, 1e-4, True, False, None, prepared)
    assert not mixattn._C.prepared_stale(prepared)  # the kernel used it
    for a, b in zip(fast[:3], plain[:3]):
        assert torch.equal(a, b)
    # Against the eager twin, token by token and as one call.
    expected, (S_e, z_e) = eager.gma_continued(*inputs, torch.zeros(2, 3, 6, 4, dtype=DOUBLE),
                                               torch.zeros(2, 3, 6, dtype=DOUBLE))
    assert_rel(out, expected, "decoded output")
    assert_rel(S, S_e, "decoded final S")
    assert_rel(z, z_e, "decoded final z")


def test_gma_decode_sees_every_parameter_update():
    inputs = gma_inputs(1, 2, 6, 6, 4, 3, 5, seed=141, contiguous=True)
    q, k, v, mean, var_raw, prior = inputs
    gen = torch.Generator().manual_seed(142)
    opt = torch.optim.SGD([mean, var_raw, prior], lr=0.5)

    def step(t, state):
        """Token t continuing `state`, ours against the eager twin on the current mixture."""
        args = (q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], mean, var_raw, prior)
        with torch.no_grad():
            out, new = mixattn.gma_attention(*args, causal=True, initial_state=state,
                                             output_final_state=True)
            e_out, e_new = eager.gma_continued(*args, *state)
        assert_rel(out, e_out, f"token {t} output")
        assert_rel(new[0], e_new[0], f"token {t} S")
        return new

    state = (torch.zeros(1, 2, 5, 3, dtype=DOUBLE), torch.zeros(1, 2, 5, dtype=DOUBLE))
    state = step(0, step(1, state))                          # the cache is warm
    for p in (mean, var_raw, prior):                         # an optimizer step, in place
        p.grad = torch.randn(p.shape, generator=gen, dtype=DOUBLE)
    opt.step()
    state = step(2, state)
    with torch.no_grad():                                    # each parameter alone, in place
        var_raw[1, 2, 0] += 0.25
    state = step(3, state)
    from mixattn import functional
    stale = functional._PREPARED.stale
    prior.data[0, 1] -= 0.5                                  # unseen by the version counter
    state = step(4, state)
    assert functional._PREPARED.stale == stale + 1           # the fingerprint caught it
    step(5, state)


def test_gma_decode_gradcheck_with_a_warm_cache():
    # One token continuing a state, the mixture prepared by an earlier call; gradcheck perturbs
    # the inputs through .data, which only the kernel's fingerprint check sees.
    inputs = gma_inputs(2, 2, 1, 1, 3, 2, 3, seed=151)
    state = random_state(2, 2, 3, 2, seed=152)
    gma_state_call(*inputs, *state)
    assert torch.autograd.gradcheck(lambda *x: gma_state_call(*x), (*inputs, *state), eps=1e-6,
                                    atol=1e-7, rtol=1e-5)


# --- the modules' states --------------------------------------------------------------------------

def test_gma_module_continues_its_state():
    torch.manual_seed(3)
    layer = mixattn.GaussianMixtureAttention(12, heads=3, components=5, causal=True, key_dim=3,
                                             value_dim=2, dtype=DOUBLE)
    x = torch.randn(2, 9, 12, dtype=DOUBLE)
    whole = layer(x)
    y1, s1 = layer(x[:, :4], output_final_state=True)
    y2, (S, z) = layer(x[:, 4:], initial_state=s1, output_final_state=True)
    assert_rel(torch.cat([y1, y2], 1), whole, "module in pieces", rel=PIECES_REL)
    # The end state against the eager twin on the module's own projections.
    b, n = x.shape[:2]
    split = lambda y, d: y.view(b, n, 3, d).transpose(1, 2)
    q, k, v = split(layer.q_proj(x), 3), split(layer.k_proj(x), 3), split(layer.v_proj(x), 2)
    _, (S_e, z_e) = eager.gma_continued(q, k, v, layer.mean, layer.var_raw, layer.prior_logit,
                                        torch.zeros(2, 3, 5, 2, dtype=DOUBLE),
                                        torch.zeros(2, 3, 5, dtype=DOUBLE), eps=layer.eps)
    assert_rel(S, S_e, "module final S")
    assert_rel(z, z_e, "module final z")
    # Gradients through the module's state: x and the initial state, gradcheck.
    small = torch.randn(1, 3, 12, dtype=DOUBLE, requires_grad=True)
    S0, z0 = random_state(1, 3, 5, 2, seed=161)
    assert torch.autograd.gradcheck(
        lambda x, S0, z0: (lambda y, st: (y, *st))(*layer(x, initial_state=(S0, z0),
                                                          output_final_state=True)),
        (small, S0, z0), eps=1e-6, atol=1e-7, rtol=1e-5)
    bidir = mixattn.GaussianMixtureAttention(12, heads=3, components=5, key_dim=3, value_dim=2)
    with pytest.raises(ValueError, match="causal"):
        bidir(x.float(), output_final_state=True)


def test_ovq_module_continues_its_state():
    torch.manual_seed(4)
    layer = mixattn.OnlineVQAttention(8, heads=2, key_dim=4, value_dim=3, dtype=DOUBLE,
                                      **OVQ_STREAM)
    x = torch.randn(2, 11, 8, dtype=DOUBLE)
    whole = layer(x)
    y1, s1 = layer(x[:, :6], output_final_state=True)
    y2, s2 = layer(x[:, 6:], initial_state=s1, output_final_state=True)
    assert (s2.batch, s2.heads) == (2, 2)
    assert_rel(torch.cat([y1, y2], 1), whole, "OVQ module in pieces", rel=PIECES_REL)
