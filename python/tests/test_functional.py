"""mixattn.gma_attention, ovq_attention and flash_attention: gradcheck in float64 for every
input, and outputs and gradients against the eager SPEC implementations in tests/eager.py."""

import pytest
import torch

import eager
import mixattn

DOUBLE = torch.float64

# Eager and C++ compute the same float64 formulas in different orders (GEMM blocking, prefix
# chunks, fused log-density, the library's wide accumulators); on these O(1)-conditioned small
# problems the rounding differences are ~1e-15 of the largest entry. 1e-10 of the largest entry
# leaves five orders of magnitude for accumulation length while catching any wrong term.
REL = 1e-10


def assert_rel(actual, expected, what, rel=REL):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= rel * max(scale, 1e-300), f"{what}: max |diff| {err:.3e}, max |expected| {scale:.3e}"


def noncontiguous(b, h, n, d, gen, dtype=DOUBLE):
    """A (b, h, n, d) view of a (b, n, h, d) tensor: what x.view(b, n, h, d).transpose(1, 2)
    gives in a model, never contiguous for h, n > 1."""
    t = torch.randn(b, n, h, d, generator=gen, dtype=dtype).transpose(1, 2)
    assert not t.is_contiguous() or h == 1 or n <= 1
    return t


def gma_inputs(b, h, n, m, r, dv, k, seed, contiguous=False, dtype=DOUBLE):
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        q, kk, v = (torch.randn(b, h, t, d, generator=gen, dtype=dtype)
                    for t, d in ((n, r), (m, r), (m, dv)))
        mean = torch.randn(h, k, r, generator=gen, dtype=dtype)
        var_raw = 0.5 * torch.randn(h, k, r, generator=gen, dtype=dtype)
        prior = 0.5 * torch.randn(h, k, generator=gen, dtype=dtype)
    else:
        q, kk, v = noncontiguous(b, h, n, r, gen, dtype), noncontiguous(b, h, m, r, gen, dtype), \
            noncontiguous(b, h, m, dv, gen, dtype)
        mean = torch.randn(k, h, r, generator=gen, dtype=dtype).transpose(0, 1)
        var_raw = 0.5 * torch.randn(r, k, h, generator=gen, dtype=dtype).permute(2, 1, 0)
        prior = 0.5 * torch.randn(k, h, generator=gen, dtype=dtype).t()
    return [t.requires_grad_() for t in (q, kk, v, mean, var_raw, prior)]


def compare_with_eager(ours_fn, eager_fn, inputs, seed, what):
    """Outputs and the gradients of every input for one random output cotangent."""
    ours = ours_fn(*inputs)
    expected = eager_fn(*inputs)
    assert_rel(ours, expected, what + " output")
    cot = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed),
                      dtype=expected.dtype)
    g_ours = torch.autograd.grad(ours, inputs, cot)
    g_eager = torch.autograd.grad(expected, inputs, cot)
    for i, (a, e) in enumerate(zip(g_ours, g_eager)):
        assert_rel(a, e, f"{what} gradient of input {i}")


# --- GMA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("contiguous", [False, True])
def test_gma_matches_eager(causal, contiguous):
    n = 37
    m = n if causal else 29  # bidirectional: cross-attention with M != N
    inputs = gma_inputs(2, 3, n, m, 5, 4, 6, seed=11 + causal, contiguous=contiguous)
    if not contiguous:
        assert not inputs[0].is_contiguous() and not inputs[3].is_contiguous()
    compare_with_eager(lambda *x: mixattn.gma_attention(*x, causal=causal, eps=1e-6),
                       lambda *x: eager.gma(*x, causal=causal, eps=1e-6), inputs, 5,
                       f"gma causal={causal}")


def test_gma_options_reach_the_kernel():
    # eps and var_floor far from their defaults: a binding that dropped them would differ.
    inputs = gma_inputs(1, 2, 9, 9, 3, 2, 4, seed=3, contiguous=True)
    compare_with_eager(lambda *x: mixattn.gma_attention(*x, causal=True, eps=0.5, var_floor=0.3),
                       lambda *x: eager.gma(*x, causal=True, eps=0.5, var_floor=0.3),
                       inputs, 6, "gma eps/var_floor")


@pytest.mark.parametrize("causal", [False, True])
def test_gma_gradcheck(causal):
    n, m = (5, 5) if causal else (5, 4)
    inputs = gma_inputs(2, 2, n, m, 3, 2, 3, seed=21 + causal)
    assert torch.autograd.gradcheck(
        lambda *x: mixattn.gma_attention(*x, causal=causal), inputs, eps=1e-6, atol=1e-7,
        rtol=1e-5)


# --- flash -----------------------------------------------------------------------------------

def flash_inputs(b, h, n, m, r, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    return [noncontiguous(b, h, t, d, gen).requires_grad_()
            for t, d in ((n, r), (m, r), (m, dv))]


@pytest.mark.parametrize("causal,scale", [(False, None), (True, None), (False, 0.3), (True, -0.7)])
def test_flash_matches_eager(causal, scale):
    n, m = (33, 33) if causal else (33, 70)
    inputs = flash_inputs(2, 3, n, m, 8, 5, seed=31)
    compare_with_eager(lambda *x: mixattn.flash_attention(*x, causal=causal, scale=scale),
                       lambda *x: eager.softmax_attention(*x, causal=causal, scale=scale),
                       inputs, 7, f"flash causal={causal} scale={scale}")


@pytest.mark.parametrize("causal", [False, True])
def test_flash_gradcheck(causal):
    inputs = flash_inputs(2, 2, 5, 5 if causal else 4, 3, 2, seed=41)
    assert torch.autograd.gradcheck(lambda *x: mixattn.flash_attention(*x, causal=causal),
                                    inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# --- OVQ -------------------------------------------------------------------------------------

# Small blocks and a small dictionary so that every rule of SPEC 2.3 runs: growth, seeding,
# assignment to old and new centroids, a full dictionary (nu = 0), and a pending last block.
OVQ_CASES = {
    "plateau-greedy": dict(block=6, max_centroids=16),
    "plateau-alpha-oneshot-nobias": dict(block=4, max_centroids=5, growth_alpha=2.5,
                                         seeding="one_shot", count_bias=False),
    "linear-greedy-stop": dict(block=3, max_centroids=7, growth="linear",
                               grad_through_dictionary=False),
    "plateau-oneshot-existing": dict(block=6, max_centroids=16, seeding="one_shot",
                                     assignment="existing_only"),
    "linear-greedy-existing-stop": dict(block=3, max_centroids=7, growth="linear",
                                        assignment="existing_only",
                                        grad_through_dictionary=False),
    "linear-oneshot-stop": dict(block=5, max_centroids=4, growth="linear", seeding="one_shot",
                                grad_through_dictionary=False, norm_eps=0.1),
}


def ovq_inputs(b, h, t, r, dv, seed, contiguous=False):
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        qkv = [torch.randn(b, h, t, d, generator=gen, dtype=DOUBLE) for d in (r, r, dv)]
    else:
        qkv = [noncontiguous(b, h, t, d, gen) for d in (r, r, dv)]
    beta = 1 + 0.3 * torch.randn(h, generator=gen, dtype=DOUBLE)
    return [x.requires_grad_() for x in (*qkv, beta)]


@pytest.mark.parametrize("case", sorted(OVQ_CASES))
def test_ovq_matches_eager(case):
    opts = OVQ_CASES[case]
    inputs = ovq_inputs(2, 2, 26, 4, 3, seed=51, contiguous=case.startswith("linear-oneshot"))
    compare_with_eager(lambda *x: mixattn.ovq_attention(*x, **opts),
                       lambda *x: eager.ovq(*x, **opts), inputs, 8, f"ovq {case}")


def test_ovq_defaults_match_eager():
    # The default options (block 256, N_max 1024) over 300 tokens: block 0 is causal softmax
    # attention over unit-norm keys, block 1 reads a 1-block dictionary.
    inputs = ovq_inputs(1, 2, 300, 4, 3, seed=52, contiguous=True)
    compare_with_eager(mixattn.ovq_attention, eager.ovq, inputs, 9, "ovq defaults")


@pytest.mark.parametrize("assignment", ["all_centroids", "existing_only"])
def test_ovq_gradcheck_through_dictionary(assignment):
    inputs = ovq_inputs(2, 2, 11, 3, 2, seed=61)
    opts = dict(block=3, max_centroids=3, assignment=assignment)
    assert torch.autograd.gradcheck(lambda *x: mixattn.ovq_attention(*x, **opts), inputs,
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


def test_ovq_gradcheck_stopped_at_dictionary():
    # With grad_through_dictionary=False the backward treats the dictionary as a constant, which
    # is the true derivative only where the dictionary does not depend on the variables. Block 1
    # reads the dictionary built from block 0, so block 0's keys and values are held constant
    # here and the check covers q, beta and block 1's k, v; block 0's k and v gradients (the
    # intra-block part only) are checked against the eager twin above.
    q, k, v, beta = ovq_inputs(2, 2, 8, 3, 2, seed=62)
    k0, v0 = k[:, :, :4].detach(), v[:, :, :4].detach()
    k1, v1 = k[:, :, 4:].detach().requires_grad_(), v[:, :, 4:].detach().requires_grad_()

    def f(q, k1, v1, beta):
        return mixattn.ovq_attention(q, torch.cat([k0, k1], 2), torch.cat([v0, v1], 2), beta,
                                     block=4, max_centroids=3, grad_through_dictionary=False)

    assert torch.autograd.gradcheck(f, (q, k1, v1, beta), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_ovq_stop_mode_differs_from_full_gradient():
    # The two gradient modes must not coincide (else the option never reached the kernel).
    q, k, v, beta = ovq_inputs(1, 1, 12, 3, 2, seed=63)
    grads = []
    for through in (True, False):
        out = mixattn.ovq_attention(q, k, v, beta, block=4, max_centroids=3,
                                    grad_through_dictionary=through)
        grads.append(torch.autograd.grad(out.sum(), k)[0])
    assert (grads[0] - grads[1]).abs().max() > 1e-3


# --- float32, threads, errors ---------------------------------------------------------------

def test_float32_follows_float64():
    inputs = gma_inputs(2, 2, 40, 40, 8, 8, 8, seed=71)
    for name, fn in (("gma", lambda q, k, v, *mix: mixattn.gma_attention(q, k, v, *mix, causal=True)),
                     ("flash", lambda q, k, v, *mix: mixattn.flash_attention(q, k, v)),
                     ("ovq", lambda q, k, v, *mix: mixattn.ovq_attention(
                         q, k, v, torch.ones(2, dtype=q.dtype), block=8, max_centroids=6))):
        ref = fn(*inputs)
        single = [x.detach().float().requires_grad_() for x in inputs]
        out = fn(*single)
        assert out.dtype == torch.float32
        # float32 rounding (2^-24 ~ 6e-8) through O(1)-conditioned sums of ~100 terms
        assert_rel(out.double(), ref, f"{name} float32 output", rel=1e-4)
        g32 = torch.autograd.grad(out.sum(), single[:3])
        g64 = torch.autograd.grad(ref.sum(), inputs[:3])
        for i, (a, e) in enumerate(zip(g32, g64)):
            assert a.dtype == torch.float32
            assert_rel(a.double(), e, f"{name} float32 gradient {i}", rel=1e-3)


def test_thread_count_does_not_change_bits():
    inputs = gma_inputs(3, 4, 50, 50, 8, 8, 8, seed=81, contiguous=True)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = mixattn.gma_attention(*inputs, causal=True)
            results.append((out, *torch.autograd.grad(out.sum(), inputs)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_rejections_name_function_and_argument():
    q, k, v, mean, var_raw, prior = gma_inputs(1, 2, 4, 4, 3, 2, 3, seed=91, contiguous=True)
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: q must have 4 dimensions"):
        mixattn.gma_attention(q[0], k, v, mean, var_raw, prior)
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: mean has shape .* dimension 2"):
        mixattn.gma_attention(q, k, v, mean[:, :, :2], var_raw, prior)
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: k is Float but q is Double"):
        mixattn.gma_attention(q, k.float(), v, mean, var_raw, prior)
    with pytest.raises(ValueError, match=r"mixattn.gma_attention: q must be float32 or float64"):
        mixattn.gma_attention(*(x.half() for x in (q, k, v, mean, var_raw, prior)))
    with pytest.raises(ValueError, match=r"causal needs as many queries as keys"):
        mixattn.gma_attention(q, k[:, :, :3], v[:, :, :3], mean, var_raw, prior, causal=True)
    with pytest.raises(ValueError, match=r"mixattn::gma::forward_into: q has a non-finite entry"):
        mixattn.gma_attention(q.detach().clone().fill_(float("nan")), k, v, mean, var_raw, prior)
    beta = torch.ones(2, dtype=DOUBLE)
    with pytest.raises(ValueError, match=r"mixattn.ovq_attention: beta has shape"):
        mixattn.ovq_attention(q, k, v, beta[:1])
    with pytest.raises(ValueError, match=r"assignment is 'nearest'"):
        mixattn.ovq_attention(q, k, v, beta, assignment="nearest")
    with pytest.raises(ValueError, match=r"growth is 'fast'"):
        mixattn.ovq_attention(q, k, v, beta, growth="fast")
    with pytest.raises(ValueError, match=r"mixattn::ovq::forward_into: options.block is 0"):
        mixattn.ovq_attention(q, k, v, beta, block=0)
    with pytest.raises(ValueError, match=r"mixattn.flash_attention: v has shape"):
        mixattn.flash_attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match=r"scale is 0"):
        mixattn.flash_attention(q, k, v, scale=0)


def test_empty_sequences():
    q, k, v, mean, var_raw, prior = gma_inputs(2, 2, 0, 0, 3, 2, 3, seed=92, contiguous=True)
    assert mixattn.gma_attention(q, k, v, mean, var_raw, prior, causal=True).shape == (2, 2, 0, 2)
    assert mixattn.flash_attention(q, k, v).shape == (2, 2, 0, 2)
    assert mixattn.ovq_attention(q, k, v, torch.ones(2, dtype=DOUBLE)).shape == (2, 2, 0, 2)
