#!/usr/bin/env python3
"""Heatmaps of the CSV files example_listops writes (SPEC 1.7 diagnostics).

    /usr/bin/python3 examples/plot_diagnostics.py [DIR]      # DIR defaults to "."

Reads DIR/listops_responsibilities.csv (one row per token: position, token, category, then the
K responsibilities of its key) and DIR/listops_affinity.csv (the N x N attention weights GMA
applies implicitly, tokens naming rows and columns) and writes DIR/listops_responsibilities.png
and DIR/listops_affinity.png. Needs matplotlib (Debian: python3-matplotlib); no display needed.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_responsibilities(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    first_k = header.index("category") + 1
    tokens = [r[1] for r in body]
    gamma = [[float(x) for x in r[first_k:]] for r in body]
    return tokens, header[first_k:], gamma


def read_affinity(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    columns = rows[0][1:]
    labels = [r[0] for r in rows[1:]]
    weights = [[float(x) for x in r[1:]] for r in rows[1:]]
    return labels, columns, weights


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "."
    tokens, components, gamma = read_responsibilities(
        os.path.join(directory, "listops_responsibilities.csv"))
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(components) + 2), max(4, 0.25 * len(tokens))))
    im = ax.imshow(gamma, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_yticks(range(len(tokens)), tokens)
    ax.set_xticks(range(len(components)), components)
    ax.set_xlabel("mixture component")
    ax.set_ylabel("token")
    ax.set_title("key responsibilities (layer 0, head 0)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    out = os.path.join(directory, "listops_responsibilities.png")
    fig.savefig(out, dpi=120)
    print("wrote", out)

    rows, cols, weights = read_affinity(os.path.join(directory, "listops_affinity.csv"))
    size = max(4, 0.3 * len(cols) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    im = ax.imshow(weights, cmap="magma")
    ax.set_xticks(range(len(cols)), cols, rotation=90)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    ax.set_title("implicit attention weights (layer 0, head 0)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    out = os.path.join(directory, "listops_affinity.png")
    fig.savefig(out, dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    main()
