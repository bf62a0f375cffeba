"""The README's PyTorch example runs as written."""

import os
import re

import torch

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def test_readme_example_runs():
    with open(README) as f:
        text = f.read()
    block = re.search(r"<!-- python-example:begin -->\s*```python\n(.*?)```\s*"
                      r"<!-- python-example:end -->", text, re.S)
    assert block, "README.md has no python-example block"
    scope = {}
    exec(compile(block.group(1), "README.md (python-example)", "exec"), scope)
    assert scope["out"].shape == (2, 4, 1024, 64)
    assert scope["y"].shape == (8, 512, 256)
    assert all(scope[n].grad is not None and torch.isfinite(scope[n].grad).all()
               for n in ("q", "k", "v", "mean", "var_raw", "prior_logit"))
