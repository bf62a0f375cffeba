"""Every ```python block of README.md and docs/**/*.md runs as written.

The blocks of one page run in order in one namespace (a later block may use what an earlier one
made), one test per page. Some blocks' results are also checked (CHECKS below): a check runs after
every block that assigns all of the names it reads, and each check must have run on the page it
names, once that page exists.
"""

import ast
import os
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mixattn")

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^\s`]*)\s*$")


def pages():
    found = ["README.md"]
    for dirpath, _, files in os.walk(os.path.join(ROOT, "docs")):
        found += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if f.endswith(".md")]
    return sorted(set(found), key=lambda p: (p != "README.md", p))


def python_blocks(rel):
    """(first line number, code) of every ```python block of the page, in order."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3)
        start, body = i + 1, []
        i += 1
        close = re.compile(r"^ {0,3}" + re.escape(fence[0]) + "{%d,}\\s*$" % len(fence))
        while i < len(lines) and not close.match(lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        if lang == "python":
            blocks.append((start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def assigned_names(code):
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def check_quick_start(scope):
    """The README's quick start: shapes, and a finite gradient for all six inputs."""
    assert scope["out"].shape == (2, 4, 1024, 64)
    assert scope["y"].shape == (8, 512, 256)
    assert all(scope[n].grad is not None and torch.isfinite(scope[n].grad).all()
               for n in ("q", "k", "v", "mean", "var_raw", "prior_logit"))


def check_streaming(scope):
    """A prompt and then one token at a time equal one call over the whole sequence (float32
    rounding of O(1) outputs through sums of a few hundred terms stays far below 1e-4)."""
    pieces = torch.cat(scope["outs"], 2)
    assert pieces.shape == scope["whole"].shape == (1, 4, 300, 64)
    S, z = scope["state"]
    assert S.shape == (1, 4, 32, 64) and z.shape == (1, 4, 32) and S.dtype == torch.float64
    assert torch.allclose(pieces, scope["whole"], rtol=1e-4, atol=1e-5)


# (page the check belongs to, names a block must assign for the check to run after it, check)
CHECKS = [
    ("README.md", {"out", "y", "q", "mean"}, check_quick_start),
    ("docs/python.md", {"outs", "whole", "state"}, check_streaming),
]
ran = set()


@pytest.mark.parametrize("rel", [p for p in pages() if python_blocks(p)])
def test_page_blocks_run(rel):
    scope = {"__name__": "__doc__"}
    for line, code in python_blocks(rel):
        exec(compile(code, f"{os.path.join(ROOT, rel)}:{line}", "exec"), scope)
        names = assigned_names(code)
        for k, (_, needs, check) in enumerate(CHECKS):
            if needs <= names:
                check(scope)
                ran.add((k, rel))


@pytest.mark.parametrize("k", range(len(CHECKS)), ids=[c[2].__name__ for c in CHECKS])
def test_check_ran_on_its_page(k):
    rel, needs, check = CHECKS[k]
    if not os.path.isfile(os.path.join(ROOT, rel)):
        pytest.skip(f"{rel} does not exist")
    if (k, rel) not in ran:  # test_page_blocks_run did not run it (or ran in another process)
        scope = {"__name__": "__doc__"}
        for line, code in python_blocks(rel):
            exec(compile(code, f"{os.path.join(ROOT, rel)}:{line}", "exec"), scope)
            if needs <= assigned_names(code):
                check(scope)
                ran.add((k, rel))
    assert (k, rel) in ran, (f"{check.__name__}: no python block of {rel} assigns "
                             f"{sorted(needs)}; the check of that example has nothing to check")
