"""What the kernels keep between calls does not change any result: a forward that needs no
gradient keeps no record and computes the same output; a forward reusing the record of an
earlier, finished call (other shapes, other mode) computes the same outputs and gradients as
one on fresh memory, also with several records alive at once."""

import pytest
import torch

import mixattn
from test_functional import flash_inputs, gma_inputs, ovq_inputs


def gma_call(causal, n, m, seed):
    inputs = gma_inputs(2, 3, n, m, 5, 4, 6, seed=seed)
    return inputs, lambda *x: mixattn.gma_attention(*x, causal=causal)


def gma_state_call(n, seed):
    inputs = gma_inputs(2, 3, n, n, 5, 4, 6, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    s0 = torch.randn(2, 3, 6, 4, generator=gen, dtype=torch.float64).requires_grad_()
    z0 = torch.rand(2, 3, 6, generator=gen, dtype=torch.float64).add_(0.5).requires_grad_()

    def fn(*x):
        out, (s, z) = mixattn.gma_attention(*x[:6], causal=True, initial_state=tuple(x[6:]),
                                            output_final_state=True)
        return out + s.sum() + z.sum()  # a loss on the final state too
    return inputs + [s0, z0], fn


def flash_call(causal, n, m, seed):
    inputs = flash_inputs(2, 3, n, m, 8, 5, seed=seed)
    return inputs, lambda *x: mixattn.flash_attention(*x, causal=causal)


def ovq_call(t, seed):
    inputs = ovq_inputs(2, 2, t, 4, 3, seed=seed)
    return inputs, lambda *x: mixattn.ovq_attention(*x, block=4, max_centroids=5)


def run(call):
    """Output and every input's gradient for a fixed cotangent."""
    inputs, fn = call
    out = fn(*inputs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return [out.detach()] + list(torch.autograd.grad(out, inputs, cot))


# Pairs of calls of one operator that differ in shapes and mode: the second reuses the first's
# record once it is finished.
CASES = {
    "gma": (lambda: gma_call(False, 37, 29, 1), lambda: gma_call(True, 50, 50, 2)),
    "gma-state": (lambda: gma_state_call(23, 3), lambda: gma_call(True, 41, 41, 4)),
    "flash": (lambda: flash_call(True, 33, 33, 5), lambda: flash_call(False, 20, 45, 6)),
    "ovq": (lambda: ovq_call(30, 7), lambda: ovq_call(17, 8)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reused_records_give_the_results_of_fresh_ones(case):
    first, second = CASES[case]
    mixattn.release_memory()
    fresh = [run(first()), run(second())]
    # The first call now runs on the second's finished record, the second on the first's.
    again = [run(first()), run(second())]
    # Both forwards alive at once, backwards in reverse order: two records in use.
    calls = [first(), second()]
    outs = [fn(*inputs) for inputs, fn in calls]
    cots = [torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=o.dtype)
            for o in outs]
    alive = [None, None]
    for i in (1, 0):
        alive[i] = [outs[i].detach()] + list(torch.autograd.grad(outs[i], calls[i][0], cots[i]))
    for results in (again, alive):
        for f, r in zip(fresh, results):
            for a, b in zip(f, r):
                assert torch.equal(a, b)


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_without_gradient_keeps_no_record_and_gives_the_same_output(case):
    for make in CASES[case]:
        inputs, fn = make()
        with_grad = fn(*inputs)
        assert with_grad.requires_grad
        with torch.no_grad():
            without = fn(*inputs)
        assert not without.requires_grad
        assert torch.equal(with_grad.detach(), without)
        detached = [t.detach() for t in inputs]
        assert torch.equal(fn(*detached), without)  # no input needs a gradient: no record


def test_backward_of_a_forward_that_kept_no_record_is_refused():
    q, k, v, mean, var_raw, prior = (t.detach() for t in gma_inputs(1, 2, 9, 9, 3, 2, 4, seed=9))
    out, saved = torch.ops.mixattn.gma_forward(q, k, v, mean, var_raw, prior, False, 1e-6, 1e-4,
                                               True, False, None)
    with pytest.raises(ValueError, match="holds no record"):
        torch.ops.mixattn.gma_backward(q, k, v, mean, var_raw, prior, torch.ones_like(out), saved,
                                       False, 1e-6, 1e-4, True, None)

