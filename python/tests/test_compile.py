"""torch.compile(fullgraph=True) over mixattn's functions and modules: each traces into one graph
(fullgraph refuses any graph break) and gives the eager outputs and gradients, the same bits for
the functions (the compiled graph calls the same kernels on the same inputs) and within 1e-12
for the modules (whose projections the compiler may evaluate in another order); a small model
of two mixattn layers compiles whole and trains as in eager mode. The same for the baselines
(linear, Performer, static VQ, sliding window), the gated delta rule (streaming and packed
included) and RoPE, whose position compiles as a SymInt.
Decoding through a cache is eager-only: under fullgraph it is refused by name, without fullgraph
it breaks the graph and still gives the eager results.

Every graph is compiled once (dynamic=False, RoPE's position test aside) on small shapes; the
file's time is mostly the compiler's."""

import pytest
import torch
import torch._dynamo.testing

import mixattn
from test_functional import flash_inputs, gma_inputs, ovq_inputs

DOUBLE = torch.float64


def compiled(fn):
    torch._dynamo.reset()  # each test's graphs on their own: no recompilation limit shared
    return torch.compile(fn, fullgraph=True, dynamic=False)


def outputs_and_grads(fn, inputs, seed=0):
    out = fn(*inputs)
    flat = out if isinstance(out, tuple) else (out,)
    flat = [t for t in flat if isinstance(t, torch.Tensor)]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in flat)
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [t.detach() for t in flat], torch.autograd.grad(loss, wanted)


def assert_same(fn, inputs, exact=True):
    eager_out, eager_grads = outputs_and_grads(fn, inputs)
    comp_out, comp_grads = outputs_and_grads(compiled(fn), inputs)
    for what, a, b in [("output", x, y) for x, y in zip(comp_out, eager_out)] + \
                      [("gradient", x, y) for x, y in zip(comp_grads, eager_grads)]:
        if exact:
            assert torch.equal(a, b), f"compiled {what} differs from eager"
        else:
            # Float64 projections in another order: ~1e-16 relative per product.
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


GMA_CALLS = {
    "bidirectional": (lambda: gma_inputs(2, 3, 9, 7, 4, 5, 6, seed=1),
                      lambda *x: mixattn.gma_attention(*x)),
    "causal": (lambda: gma_inputs(2, 3, 9, 9, 4, 5, 6, seed=2),
               lambda *x: mixattn.gma_attention(*x, causal=True)),
    "packed": (lambda: gma_inputs(1, 3, 12, 12, 4, 5, 6, seed=3),
               lambda *x: mixattn.gma_attention(*x, causal=True,
                                                cu_seqlens=torch.tensor([0, 5, 12]))),
    "streaming": (lambda: gma_inputs(2, 3, 8, 8, 4, 5, 6, seed=4),
                  lambda *x: _gma_two_pieces(*x)),
}


def _gma_two_pieces(q, k, v, *mix):
    """A sequence in two pieces carrying the state, and a loss on the final state too."""
    a, (S, z) = mixattn.gma_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], *mix, causal=True,
                                      output_final_state=True)
    b, (S, z) = mixattn.gma_attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], *mix, causal=True,
                                      initial_state=(S, z), output_final_state=True)
    return torch.cat([a, b], 2), S, z


@pytest.mark.parametrize("case", sorted(GMA_CALLS))
def test_gma_compiles_to_the_eager_results(case):
    make, fn = GMA_CALLS[case]
    assert_same(fn, make())


OVQ_OPTIONS = dict(block=3, max_centroids=5)


def _ovq_two_pieces(q, k, v, beta):
    a, state = mixattn.ovq_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], beta,
                                     output_final_state=True, **OVQ_OPTIONS)
    b = mixattn.ovq_attention(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], beta, initial_state=state,
                              **OVQ_OPTIONS)
    return torch.cat([a, b], 2)


OVQ_CALLS = {
    "through the dictionary": lambda *x: mixattn.ovq_attention(*x, **OVQ_OPTIONS),
    "dictionary constant": lambda *x: mixattn.ovq_attention(*x, grad_through_dictionary=False,
                                                           **OVQ_OPTIONS),
    "packed": lambda *x: mixattn.ovq_attention(*x, cu_seqlens=torch.tensor([0, 6, 13]),
                                               **OVQ_OPTIONS),
    "streaming": _ovq_two_pieces,
}


@pytest.mark.parametrize("case", sorted(OVQ_CALLS))
def test_ovq_compiles_to_the_eager_results(case):
    b = 1 if case == "packed" else 2
    assert_same(OVQ_CALLS[case], ovq_inputs(b, 2, 13, 4, 3, seed=5))


@pytest.mark.parametrize("causal,packed", [(False, False), (True, False), (True, True)])
def test_flash_compiles_to_the_eager_results(causal, packed):
    inputs = flash_inputs(1 if packed else 2, 2, 10, 10, 4, 3, seed=6)
    cu = torch.tensor([0, 4, 10]) if packed else None
    assert_same(lambda *x: mixattn.flash_attention(*x, causal=causal, cu_seqlens=cu), inputs)


W = mixattn.performer_features(2, 5, 4, seed=11, dtype=DOUBLE)
CODES = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(12), dtype=DOUBLE)
BASELINE_CALLS = {
    "linear": lambda q, k, v: mixattn.linear_attention(q, k, v),
    "linear causal packed": lambda q, k, v: mixattn.linear_attention(
        q, k, v, causal=True, cu_seqlens=torch.tensor([0, 4, 10])),
    "performer": lambda q, k, v: mixattn.performer_attention(q, k, v, W),
    "performer causal": lambda q, k, v: mixattn.performer_attention(q, k, v, W, causal=True),
    "vq": lambda q, k, v, c: mixattn.vq_attention(q, k, v, c),
    "vq causal": lambda q, k, v, c: mixattn.vq_attention(q, k, v, c, causal=True, scale=0.6),
    "window": lambda q, k, v: mixattn.sliding_window_attention(q, k, v, window=3),
    "window packed": lambda q, k, v: mixattn.sliding_window_attention(
        q, k, v, window=2, cu_seqlens=torch.tensor([0, 7, 10])),
    "rope then flash": lambda q, k, v: mixattn.flash_attention(
        mixattn.rope(q, 2), mixattn.rope(k, 2), v, causal=True),
}


def _delta_two_pieces(q, k, v, g, beta, S0):
    """A sequence in two pieces carrying the state, from a given state, with a loss on the final
    state too."""
    a, S = mixattn.gated_delta_rule(q[:, :, :4], k[:, :, :4], v[:, :, :4], g[:, :, :4],
                                    beta[:, :, :4], initial_state=S0, output_final_state=True,
                                    chunk_size=3)
    b, S = mixattn.gated_delta_rule(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], g[:, :, 4:],
                                    beta[:, :, 4:], initial_state=S, output_final_state=True,
                                    chunk_size=3)
    return torch.cat([a, b], 2), S


DELTA_CALLS = {
    "plain": lambda q, k, v, g, beta: mixattn.gated_delta_rule(q, k, v, g, beta)[0],
    "l2norm chunk 4": lambda q, k, v, g, beta: mixattn.gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=4, scale=0.5)[0],
    "streaming": _delta_two_pieces,
    "packed": lambda q, k, v, g, beta, S0: mixattn.gated_delta_rule(
        q, k, v, g, beta, initial_state=S0, output_final_state=True,
        cu_seqlens=torch.tensor([0, 4, 10])),
}


@pytest.mark.parametrize("case", sorted(DELTA_CALLS))
def test_gated_delta_rule_compiles_to_the_eager_results(case):
    from test_delta import delta_inputs, start_state
    b = 1 if case == "packed" else 2
    inputs = delta_inputs(b, 2, 10, 4, 3, seed=15)
    if case in ("packed", "streaming"):  # a state to continue: two sequences or batch entries
        inputs.append(start_state(2, 2, 4, 3, seed=16))
    assert_same(DELTA_CALLS[case], inputs)


@pytest.mark.parametrize("case", sorted(BASELINE_CALLS))
def test_baselines_compile_to_the_eager_results(case):
    inputs = flash_inputs(1 if "packed" in case else 2, 2, 10, 10, 4, 3, seed=13)
    if case.startswith("vq"):
        inputs.append(CODES.clone().requires_grad_())
    assert_same(BASELINE_CALLS[case], inputs)


def test_rope_position_is_not_specialised():
    """start is a SymInt: a decoding loop over positions compiles once with dynamic shapes."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda x, p: mixattn.rope(x, p), backend=counter, fullgraph=True,
                       dynamic=True)
    (x,) = flash_inputs(1, 2, 1, 1, 4, 3, seed=14)[:1]
    for p in range(3, 8):
        torch.testing.assert_close(fn(x, p), mixattn.rope(x, p), rtol=0, atol=0)
    assert counter.frame_count == 1


def test_modules_compile_to_the_eager_results():
    torch.manual_seed(7)
    gma = mixattn.GaussianMixtureAttention(16, 2, 4, causal=True, dtype=DOUBLE)
    ovq = mixattn.OnlineVQAttention(16, 2, block=4, max_centroids=6, dtype=DOUBLE)
    x = torch.randn(2, 11, 16, dtype=DOUBLE, requires_grad=True)
    others = (mixattn.LinearAttention(16, 2, causal=True, rope=True, dtype=DOUBLE),
              mixattn.PerformerAttention(16, 2, features=6, dtype=DOUBLE),
              mixattn.VQAttention(16, 2, codes=5, causal=True, dtype=DOUBLE),
              mixattn.SlidingWindowAttention(16, 2, window=4, rope=True, dtype=DOUBLE),
              mixattn.GatedDeltaAttention(16, 2, chunk_size=4, dtype=DOUBLE))
    for layer in (gma, ovq, *others):
        params = list(layer.parameters())
        assert_same(lambda x, *p: layer(x), [x, *params], exact=False)


class TwoLayers(torch.nn.Module):
    """A pre-norm causal language model's body: GMA then OVQ, each with a residual."""

    def __init__(self, d=16, vocab=11):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d, dtype=DOUBLE)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d, dtype=DOUBLE) for _ in range(2))
        self.gma = mixattn.GaussianMixtureAttention(d, 2, 4, causal=True, dtype=DOUBLE)
        self.ovq = mixattn.OnlineVQAttention(d, 2, block=4, max_centroids=8, dtype=DOUBLE)
        self.head = torch.nn.Linear(d, vocab, dtype=DOUBLE)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.gma(self.norms[0](x))
        x = x + self.ovq(self.norms[1](x))
        return self.head(x)


def test_a_two_layer_model_compiles_whole_and_trains_as_in_eager():
    torch.manual_seed(8)
    eager_model = TwoLayers()
    compiled_model = TwoLayers()
    compiled_model.load_state_dict(eager_model.state_dict())
    step = compiled(lambda m, t: torch.nn.functional.cross_entropy(
        m(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()))
    tokens = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(9))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_model, compiled_model)]
    for _ in range(3):
        losses = []
        for model, opt, fn in ((eager_model, opts[0], None), (compiled_model, opts[1], step)):
            opt.zero_grad()
            loss = (fn(model, tokens) if fn else torch.nn.functional.cross_entropy(
                model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_decoding_through_a_cache_is_eager_only():
    q, k, v, *mix = (t.detach() for t in gma_inputs(1, 2, 6, 6, 3, 4, 5, seed=10))
    cache = mixattn.GmaCache()

    def decode(q, k, v):
        return mixattn.gma_attention(q, k, v, *mix, causal=True, cache=cache)

    with pytest.raises(Exception, match="_gma_cached"):
        compiled(decode)(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    assert not cache.bound  # the refused call never ran
    # Without fullgraph the cache call runs eagerly between compiled pieces.
    loose = torch.compile(decode, dynamic=False)
    steps = torch.cat([loose(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
                       for t in range(6)], 2)
    # Token by token against one call: the same sums in another order (float64, ~1e-16 each).
    torch.testing.assert_close(steps, mixattn.gma_attention(q, k, v, *mix, causal=True),
                               rtol=1e-12, atol=1e-14)
