"""The README's PyTorch examples run as written."""

import os
import re

import torch

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def run_block(name):
    with open(README) as f:
        text = f.read()
    block = re.search(rf"<!-- {name}:begin -->\s*```python\n(.*?)```\s*<!-- {name}:end -->",
                      text, re.S)
    assert block, f"README.md has no {name} block"
    scope = {}
    exec(compile(block.group(1), f"README.md ({name})", "exec"), scope)
    return scope


def test_readme_example_runs():
    scope = run_block("python-example")
    assert scope["out"].shape == (2, 4, 1024, 64)
    assert scope["y"].shape == (8, 512, 256)
    assert all(scope[n].grad is not None and torch.isfinite(scope[n].grad).all()
               for n in ("q", "k", "v", "mean", "var_raw", "prior_logit"))


def test_readme_streaming_example_runs():
    # The prompt and the 44 decoded tokens equal one call over all 300 tokens (float32 rounding
    # of O(1) outputs through sums of a few hundred terms stays far below 1e-4).
    scope = run_block("python-streaming")
    pieces = torch.cat(scope["outs"], 2)
    assert pieces.shape == scope["whole"].shape == (1, 4, 300, 64)
    S, z = scope["state"]
    assert S.shape == (1, 4, 32, 64) and z.shape == (1, 4, 32) and S.dtype == torch.float64
    assert torch.allclose(pieces, scope["whole"], rtol=1e-4, atol=1e-5)
