#!/usr/bin/env python3
"""Plots of the two small-scale reproductions (docs/claims.md).

    /usr/bin/python3 examples/plot_claims.py [DIR]      # DIR defaults to examples/results

Reads what `example_char_lm --out DIR` and `example_recall_length --out DIR` write (docs/claims.md:
e.g. build/claims; examples/results holds the recorded files) and draws, into DIR:
  DIR/char_lm.png        held-out bits per character per mixer, one dot per seed, bar = mean;
  DIR/recall_length.png  MQAR accuracy against sequence length, one line per model;
  DIR/recall_dict.png    the OVQ model's accuracy against its dictionary size N_max set at test
                         time, one line per sequence length;
and the same for every other DIR/recall_length*.csv and DIR/recall_dict*.csv (runs of another
configuration, e.g. recall_length_32pairs.csv).
A missing CSV skips its plot. Needs matplotlib (Debian: python3-matplotlib); no display needed.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    if not os.path.exists(path):
        print(f"{path}: missing, plot skipped")
        return None
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def suffix(name, stem):
    """ "recall_length_32pairs" -> " (32pairs)"; the plain name -> "". """
    rest = name[len(stem):].strip("_")
    return f" ({rest.replace('pairs', ' pairs')})" if rest else ""


def plot_char_lm(rows, out, name):
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, m in enumerate(mixers):
        bits = [float(r["held_out_bits"]) for r in rows if r["mixer"] == m]
        ax.bar(i, sum(bits) / len(bits), color="0.85", edgecolor="0.4", width=0.6)
        ax.plot([i] * len(bits), bits, "o", color="C0")
    lo = min(float(r["held_out_bits"]) for r in rows)
    hi = max(float(r["held_out_bits"]) for r in rows)
    ax.set_ylim(lo - 0.25 * (hi - lo + 0.05), hi + 0.25 * (hi - lo + 0.05))
    ax.set_xticks(range(len(mixers)), mixers)
    ax.set_ylabel("held-out bits per character")
    ax.set_title("character LM (KJV text): one dot per seed, bar = mean")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def plot_accuracy_lines(series, out, xlabel, title):
    """One line per (label, [(x, accuracy)]) of `series`, accuracy in % against log2 x."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, (label, pts) in enumerate(series):
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", label=label, color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out recall accuracy (%)")
    ax.set_ylim(0, 102)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def plot_recall(rows, out, name):
    series = [(m, sorted((int(r["length"]), float(r["accuracy"])) for r in rows if r["model"] == m))
              for m in dict.fromkeys(r["model"] for r in rows)]
    plot_accuracy_lines(series, out, "sequence length (trained at the first)",
                        "multi-query associative recall vs length" + suffix(name, "recall_length"))


def plot_dict(rows, out, name):
    series = [(f"N = {length}", sorted((int(r["dict_size"]), float(r["accuracy"])) for r in rows
                                       if int(r["length"]) == length))
              for length in sorted({int(r["length"]) for r in rows})]
    plot_accuracy_lines(series, out, "OVQ dictionary size N_max at test time",
                        "OVQ + window: test-time dictionary size" + suffix(name, "recall_dict"))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "results")
    # recall_length*.csv and recall_dict*.csv: one plot each (e.g. a run with more pairs written
    # as recall_length_32pairs.csv).
    names = [("char_lm", plot_char_lm)]
    for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        stem, ext = os.path.splitext(f)
        if ext == ".csv" and stem.startswith("recall_length"):
            names.append((stem, plot_recall))
        elif ext == ".csv" and stem.startswith("recall_dict"):
            names.append((stem, plot_dict))
    for name, plot in names:
        rows = read(os.path.join(d, name + ".csv"))
        if rows:
            plot(rows, os.path.join(d, name + ".png"), name)


if __name__ == "__main__":
    main()
