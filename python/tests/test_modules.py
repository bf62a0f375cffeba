"""GaussianMixtureAttention and OnlineVQAttention: initialisation (SPEC 1.1), the head split and
merge against the eager formulas, and a small model that learns."""

import math

import pytest
import torch

import eager
import mixattn

DOUBLE = torch.float64


def test_gma_initialisation():
    torch.manual_seed(0)
    layer = mixattn.GaussianMixtureAttention(64, heads=4, components=32, init_scale=0.5)
    assert layer.mean.shape == (4, 32, 16) and layer.prior_logit.shape == (4, 32)
    assert torch.equal(layer.var_raw, torch.zeros(4, 32, 16))
    assert torch.equal(layer.prior_logit, torch.zeros(4, 32))
    # 2048 N(0, 0.5^2) draws: the sample std is within 10% of 0.5 with overwhelming probability
    assert abs(layer.mean.std().item() - 0.5) < 0.05 and abs(layer.mean.mean().item()) < 0.05
    # weights ~ N(0, 1/fan_in): 4096 draws per matrix
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
        assert proj.bias is None
        assert abs(proj.weight.std().item() * math.sqrt(proj.in_features) - 1) < 0.1
    torch.manual_seed(0)
    again = mixattn.GaussianMixtureAttention(64, heads=4, components=32, init_scale=0.5)
    assert torch.equal(again.mean, layer.mean)


def test_ovq_initialisation_and_option_checks():
    layer = mixattn.OnlineVQAttention(32, heads=2, key_dim=8, value_dim=4, block=16)
    assert torch.equal(layer.beta, torch.ones(2))
    assert layer.q_proj.out_features == 16 and layer.v_proj.out_features == 8
    with pytest.raises(ValueError, match="seeding"):
        mixattn.OnlineVQAttention(32, heads=2, seeding="random")
    with pytest.raises(TypeError):
        mixattn.OnlineVQAttention(32, heads=2, no_such_option=1)


def project(layer, x, dim_q, dim_v):
    b, n, _ = x.shape
    split = lambda y, d: y.view(b, n, layer.heads, d).transpose(1, 2)
    return (split(layer.q_proj(x), dim_q), split(layer.k_proj(x), dim_q),
            split(layer.v_proj(x), dim_v))


@pytest.mark.parametrize("causal", [False, True])
def test_gma_module_matches_eager(causal):
    torch.manual_seed(1)
    layer = mixattn.GaussianMixtureAttention(12, heads=3, components=5, causal=causal,
                                             key_dim=3, value_dim=2, dtype=DOUBLE)
    x = torch.randn(2, 9, 12, dtype=DOUBLE)
    q, k, v = project(layer, x, 3, 2)
    o = eager.gma(q, k, v, layer.mean, layer.var_raw, layer.prior_logit, causal=causal)
    expected = layer.out_proj(o.transpose(1, 2).reshape(2, 9, 6))
    got = layer(x)
    assert (got - expected).abs().max() <= 1e-10 * expected.abs().max()
    params = list(layer.parameters())
    g1 = torch.autograd.grad(got.square().sum(), params)
    g2 = torch.autograd.grad(expected.square().sum(), params)
    for a, e in zip(g1, g2):
        assert (a - e).abs().max() <= 1e-10 * e.abs().max()


def test_ovq_module_matches_eager():
    torch.manual_seed(2)
    opts = dict(block=4, max_centroids=5)
    layer = mixattn.OnlineVQAttention(8, heads=2, dtype=DOUBLE, **opts)
    with torch.no_grad():
        layer.beta.copy_(torch.tensor([0.7, 1.4]))
    x = torch.randn(2, 13, 8, dtype=DOUBLE)
    q, k, v = project(layer, x, 4, 4)
    expected = layer.out_proj(eager.ovq(q, k, v, layer.beta, **opts).transpose(1, 2).reshape(2, 13, 8))
    got = layer(x)
    assert (got - expected).abs().max() <= 1e-10 * expected.abs().max()
    g1 = torch.autograd.grad(got.square().sum(), layer.beta)[0]
    g2 = torch.autograd.grad(expected.square().sum(), layer.beta)[0]
    assert (g1 - g2).abs().max() <= 1e-10 * g2.abs().max()


def test_modules_take_packed_sequences():
    # x (1, T, d_model) with cu_seqlens equals the module on each sequence alone; GMA causal with
    # a state per sequence too.
    torch.manual_seed(3)
    cu = [0, 7, 7, 8, 20]
    x = torch.randn(1, cu[-1], 8, dtype=DOUBLE)
    parts = [x[:, a:b] for a, b in zip(cu[:-1], cu[1:])]
    layers = (mixattn.GaussianMixtureAttention(8, heads=2, components=3, causal=True,
                                               dtype=DOUBLE),
              mixattn.OnlineVQAttention(8, heads=2, dtype=DOUBLE, block=4, max_centroids=5))
    for layer in layers:
        got = layer(x, cu_seqlens=cu)
        expected = torch.cat([layer(p) for p in parts], 1)
        assert got.shape == x.shape
        assert (got - expected).abs().max() <= 1e-12 * expected.abs().max(), type(layer)
    gma = layers[0]
    y, (S, z) = gma(x, cu_seqlens=cu, output_final_state=True)
    assert S.shape == (len(cu) - 1, 2, 3, 4) and z.shape == (len(cu) - 1, 2, 3)
    for i, p in enumerate(parts):
        _, (S_i, z_i) = gma(p, output_final_state=True)
        assert (S[i] - S_i[0]).abs().max() <= 1e-12 * (1 + S_i.abs().max())
        assert (z[i] - z_i[0]).abs().max() <= 1e-12 * (1 + z_i.abs().max())


class TinyModel(torch.nn.Module):
    """features -> causal GMA -> OVQ -> readout, with residuals; the DDP test uses it too."""

    def __init__(self, d_in=4, d_model=16):
        super().__init__()
        self.embed = torch.nn.Linear(d_in, d_model)
        self.gma = mixattn.GaussianMixtureAttention(d_model, heads=2, components=4, causal=True)
        self.ovq = mixattn.OnlineVQAttention(d_model, heads=2, block=4, max_centroids=4)
        self.readout = torch.nn.Linear(d_model, 1)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.gma(h)
        h = h + self.ovq(h)
        return self.readout(h).squeeze(-1)


def running_mean_task(batch, tokens, d_in, gen):
    """Target: the running mean of each sequence's first feature (a causal aggregation)."""
    x = torch.randn(batch, tokens, d_in, generator=gen)
    y = torch.cumsum(x[..., 0], 1) / torch.arange(1, tokens + 1)
    return x, y


def test_tiny_model_learns():
    torch.manual_seed(3)
    model = TinyModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    x_test, y_test = running_mean_task(32, 16, 4, gen)
    with torch.no_grad():
        before = torch.nn.functional.mse_loss(model(x_test), y_test).item()
    for _ in range(60):
        x, y = running_mean_task(16, 16, 4, gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        after = torch.nn.functional.mse_loss(model(x_test), y_test).item()
    # A model that does not learn stays near its initial loss; predicting 0 everywhere already
    # gives ~mean(1/t) ~ 0.21. Require the held-out loss to fall by 3x.
    print(f"tiny model: held-out loss {before:.4f} -> {after:.4f}")
    assert after < before / 3, f"held-out loss {before:.4f} -> {after:.4f}"


def test_version_is_the_library_s():
    import os
    import re
    core = os.path.join(os.path.dirname(__file__), "..", "..", "include", "mixattn", "core.hpp")
    with open(core) as f:
        parts = dict(re.findall(r"^#define MIXATTN_VERSION_(MAJOR|MINOR|PATCH) +([0-9]+)$",
                                f.read(), re.M))
    assert mixattn.__version__ == f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
