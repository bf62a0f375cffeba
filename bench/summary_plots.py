"""The benchmark figures of bench/summary.py: one question per panel, one colour per operator.

    time_vs_n.png    forward time vs N | forward+backward time vs N
                     fraction of the FMA peak vs N | per-token decode latency vs position
                     (the decode panel appears when the results hold decode_* points,
                     bench/bench_decode.cpp)
    memory_vs_n.png  peak extra heap vs N, forward | forward+backward

Every operator keeps its colour in every panel; its GEMM floor is a thin dashed line of the same
colour; the band around a line is the [min, max] over repetitions; a hollow marker is a point with
too few samples (bench/summary.py gives it no verdict). Grey lines are O(N) and O(N²) slopes.
Lines are labelled at their right end instead of in a legend.

A series of fewer than MIN_LINE_POINTS points (the main job measures most operators at N = 4096
alone, and OVQ's forward at N = 4096 and 65 536) is drawn as markers with [min, max] bars and no
line: a line through two points would show a slope the run did not measure (OVQ's cost per token
grows while its dictionary fills, then stays flat), and beside the grey O(N²) guide it would read
as a growth rate. A panel without a line draws no slope guides.

To add an operator, append to OPERATORS; to add a panel, append to TIME_PANELS (or write a
function like decode_panel and list it in EXTRA_PANELS).
"""

import math
import os
import sys

# (label, colour, forward op, its floor, forward+backward op, its floor). Colours: distinct hues
# from the colour-blind-safe Okabe–Ito and Tol sets, none grey (grey is for the guides).
OPERATORS = [
    ("GMA bidir", "#0072B2", "gma_forward_bidir", "floor_gma_forward_bidir",
     "gma_fwd_bwd_bidir", "floor_gma_fwd_bwd_bidir"),
    ("GMA causal", "#009E73", "gma_forward_causal", "floor_gma_forward_causal",
     "gma_fwd_bwd_causal", "floor_gma_fwd_bwd_causal"),
    ("OVQ", "#AA4499", "ovq_forward", "floor_ovq_forward", "ovq_fwd_bwd", "floor_ovq_fwd_bwd"),
    ("flash bidir", "#D55E00", "flash_forward_bidir", "floor_softmax_forward_bidir",
     "flash_fwd_bwd_bidir", "floor_softmax_fwd_bwd_bidir"),
    ("flash causal", "#999933", "flash_forward_causal", "floor_softmax_forward_causal",
     "flash_fwd_bwd_causal", "floor_softmax_fwd_bwd_causal"),
    ("naive bidir", "#000000", "naive_forward_bidir", None, "naive_fwd_bwd_bidir", None),
    ("linear bidir", "#56B4E9", "linear_forward_bidir", "floor_linear_forward_bidir",
     "linear_fwd_bwd_bidir", "floor_linear_fwd_bwd_bidir"),
    ("linear causal", "#E69F00", "linear_forward_causal", "floor_linear_forward_causal",
     "linear_fwd_bwd_causal", "floor_linear_fwd_bwd_causal"),
]
GUIDE = "#9a9a9a"
MIN_LINE_POINTS = 3  # fewer: markers without a line (module docstring)
# Decoding is causal: a decode_* benchmark takes the colour of the causal operator it names.
DECODE_COLOURS = [("gma", "#009E73"), ("ovq", "#AA4499"), ("flash", "#999933"),
                  ("softmax", "#999933"), ("naive", "#000000")]


def series(points, op, value):
    """[(N, Quantity)] of one-thread points of op, value(point) -> Quantity or None."""
    out = []
    for (o, n, threads), p in sorted(points.items(), key=lambda kv: kv[0][1]):
        if o == op and threads == 1:
            q = value(p)
            if q is not None and q.med > 0:
                out.append((n, q))
    return out


def seconds(p):
    return p.seconds()


def heap(p):
    return p.counter("peak_heap_bytes")


def fraction_of_peak(points):
    peak_point = points.get(("peak_fma_float", 0, 1))
    if peak_point is None:
        return None
    peak = peak_point.flop_per_call() / peak_point.seconds()

    def value(p):
        f = p.flop_per_call()
        return None if f is None else f / p.seconds() / peak
    return value


# ---- axes helpers ---------------------------------------------------------------------------------

def fmt_n(n, _=None):
    n = int(round(n))
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def fmt_seconds(s, _=None):
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale * 0.999:
            return f"{s / scale:g} {unit}"
    return f"{s / 1e-9:g} ns"


def fmt_bytes(b, _=None):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale * 0.999:
            return f"{b / scale:g} {unit}"
    return f"{b:g} B"


def n_axis(ax, ns, ticker):
    lo, hi = min(ns), max(ns)
    ax.set_xscale("log", base=2)
    # Room at the right for the line-end labels.
    ax.set_xlim(lo / 1.3, hi * 4.0)
    ticks = [2 ** k for k in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]
    if len(ticks) > 8:
        ticks = ticks[::2]
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(fmt_n))
    ax.xaxis.set_minor_locator(ticker.NullLocator())


def log_y_axis(ax, ticker, formatter, base=10):
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=base, numticks=12))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(formatter))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def draw_series(ax, pts, colour, floor=False):
    """Draws a series; returns whether it drew a line through its points."""
    xs = [n for n, _ in pts]
    if len(pts) < MIN_LINE_POINTS:
        for n, q in pts:
            ax.errorbar([n], [q.med], yerr=[[q.med - q.lo], [q.hi - q.med]], color=colour,
                        marker="_" if floor else "o", markersize=9 if floor else 4.5,
                        linestyle="none", elinewidth=0.9, capsize=2.5, zorder=4,
                        markerfacecolor=colour if floor or q.ok else "white")
        return False
    if floor:
        ax.plot(xs, [q.med for _, q in pts], color=colour, linestyle=(0, (4, 3)), linewidth=0.9,
                alpha=0.75, zorder=2)
        return True
    ax.fill_between(xs, [q.lo for _, q in pts], [q.hi for _, q in pts], color=colour,
                    alpha=0.14, linewidth=0, zorder=1)
    ax.plot(xs, [q.med for _, q in pts], color=colour, linewidth=2.0, zorder=3)
    for n, q in pts:
        ax.plot([n], [q.med], marker="o", markersize=3.5, color=colour, zorder=4,
                markerfacecolor=colour if q.ok else "white")
    return True


def guides(ax, log_y, slopes=((1, "∝ N"), (2, "∝ N²"))):
    """Grey slopes (O(N) and O(N²) by default) from the lower left of the data; returns their
    end labels for end_labels, which keeps them clear of the operators' labels."""
    if not log_y:
        return []
    labels = []
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    xs0 = x0 * 1.3
    xs1 = x1 / 4.0  # the right edge of the data
    ya = y0 * 2.0
    for power, label in slopes:
        yb = ya * (xs1 / xs0) ** power
        xe = xs1 if yb <= y1 else xs0 * (y1 / ya) ** (1.0 / power)
        ye = min(yb, y1)
        ax.plot([xs0, xe], [ya, ye], color=GUIDE, linewidth=0.9, linestyle=(0, (1, 2)), zorder=0)
        labels.append((xe, ye, label, GUIDE))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    return labels


def end_labels(ax, labels, log_y, fontsize=8):
    """Text at each line's right end, pushed apart vertically so none overlap."""
    if not labels:
        return
    to_disp = ax.transData.transform
    to_data = ax.transData.inverted().transform
    placed = sorted(((to_disp((x, y))[1], x, y, text, colour) for x, y, text, colour in labels))
    gap = fontsize * 1.5 * ax.figure.dpi / 72.0
    ys = [p[0] for p in placed]
    for i in range(1, len(ys)):
        ys[i] = max(ys[i], ys[i - 1] + gap)
    # Pull the stack back down, only as far as needed, if it rose above the axes.
    top = ax.transAxes.transform((0, 1))[1] - gap / 2
    if ys and ys[-1] > top:
        ys[-1] = top
        for i in range(len(ys) - 2, -1, -1):
            ys[i] = min(ys[i], ys[i + 1] - gap)
    for (_, x, y, text, colour), yd in zip(placed, ys):
        xd = to_disp((x, y))[0] + 6
        xl, yl = to_data((xd, yd))
        ax.annotate(text, xy=(x, y), xytext=(xl, yl), color=colour, fontsize=fontsize,
                    va="center", ha="left", fontweight="normal" if colour == GUIDE else "bold",
                    arrowprops=dict(arrowstyle="-", color=colour, linewidth=0.5, alpha=0.6)
                    if abs(yd - to_disp((x, y))[1]) > gap / 2 else None)


# ---- panels --------------------------------------------------------------------------------------

def operator_panel(ax, points, ticker, which, value, log_y, y_formatter, floors=True,
                   y_base=10):
    """Operators (column `which`: 2 forward, 4 forward+backward) with their floors dashed."""
    labels, all_ns, ys, lines = [], [], [], False
    for entry in OPERATORS:
        label, colour, op, floor = entry[0], entry[1], entry[which], entry[which + 1]
        pts = series(points, op, value)
        if not pts:
            continue
        lines = draw_series(ax, pts, colour) or lines
        labels.append((pts[-1][0], pts[-1][1].med, label, colour))
        all_ns += [n for n, _ in pts]
        ys += [q.lo for _, q in pts] + [q.hi for _, q in pts]
        fl = series(points, floor, value) if floors and floor else []
        if fl:
            draw_series(ax, fl, colour, floor=True)
            ys += [q.med for _, q in fl]
    if not all_ns:
        ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color=GUIDE)
        return False
    n_axis(ax, all_ns, ticker)
    if log_y:
        log_y_axis(ax, ticker, y_formatter, y_base)
        ax.set_ylim(min(ys) / 2.0, max(ys) * 2.0)
    else:
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(y_formatter))
    ax.grid(True, which="major", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    end_labels(ax, labels + guides(ax, log_y and lines), log_y)
    return True


def time_panel(which, title):
    def draw(ax, points, ticker):
        ok = operator_panel(ax, points, ticker, which, seconds, True, fmt_seconds)
        ax.set_title(title, loc="left", fontsize=11)
        ax.set_xlabel("sequence length N [tokens]")
        ax.set_ylabel("time per call [log scale]")
        return ok
    return draw


def peak_panel(ax, points, ticker):
    value = fraction_of_peak(points)
    if value is None:
        ax.text(0.5, 0.5, "peak not measured (bench_peak)", transform=ax.transAxes, ha="center",
                color=GUIDE)
        return False
    operator_panel(ax, points, ticker, 2, value, False, lambda x, _=None: f"{x:.0%}")
    ax.set_ylim(0, 1.05)
    ax.axhline(1.0, color=GUIDE, linewidth=0.9)
    ax.text(ax.get_xlim()[0] * 1.05, 1.0, "measured FMA peak", color=GUIDE, fontsize=8,
            va="bottom")
    ax.set_title("Forward: fraction of the FMA peak (operator's FLOP count / time / peak)",
                 loc="left", fontsize=11)
    ax.set_xlabel("sequence length N [tokens]")
    ax.set_ylabel("fraction of one core's FMA peak")
    return True


DECODE_FILE = "bench_decode.json"
# The per-token latency of a decode point: the first of these counters it has, else its time
# per call (a call that decodes one token).
DECODE_COUNTERS = ("s_per_token", "mean_s", "latency_mean_s")


def is_decode(point):
    """A point at a position N >= 1 (bench_decode's decode_noise, N = 0, is no position)."""
    return (point.source == DECODE_FILE or point.op.startswith("decode_")) and point.n >= 1


def decode_latency(p):
    return next((p.counter(c) for c in DECODE_COUNTERS if p.counter(c)), None) or p.seconds()


def decode_panel(ax, points, ticker):
    """Per-token decode latency vs position: one line per benchmark of bench_decode.json (or
    named decode_*), its N being the position in the sequence."""
    ops = sorted({p.op for p in points.values() if is_decode(p)})
    labels, all_ns, ys, lines = [], [], [], False
    for i, op in enumerate(ops):
        pts = series(points, op, decode_latency)
        if not pts:
            continue
        colour = next((c for key, c in DECODE_COLOURS if key in op), f"C{i}")
        lines = draw_series(ax, pts, colour) or lines
        words = (op[len("decode_"):] if op.startswith("decode_") else op).split("_")
        label = " ".join(w.upper() if w in ("gma", "ovq") else w for w in words)
        labels.append((pts[-1][0], pts[-1][1].med, label, colour))
        all_ns += [n for n, _ in pts]
        ys += [q.lo for _, q in pts] + [q.hi for _, q in pts]
    if not all_ns:
        return False
    n_axis(ax, all_ns, ticker)
    log_y_axis(ax, ticker, fmt_seconds)
    ax.set_ylim(min(ys) / 2.0, max(ys) * 2.0)
    ax.grid(True, which="major", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    # A linear-time decoder costs the same per token at every position; softmax grows with N.
    end_labels(ax, labels + guides(ax, lines, ((0, "constant"), (1, "∝ N"))), True)
    ax.set_title("Decoding: latency per token vs position", loc="left", fontsize=11)
    ax.set_xlabel("position in the sequence [tokens]")
    ax.set_ylabel("time per token [log scale]")
    return True


def has_decode(points):
    return any(is_decode(p) for p in points.values())


EXTRA_PANELS = [(has_decode, decode_panel)]  # (available(points), draw(ax, points, ticker))


# ---- figures -------------------------------------------------------------------------------------

def time_figure(plt, ticker, points, mode):
    extra = [draw for available, draw in EXTRA_PANELS if available(points)]
    rows = 2 + (len(extra) + 1) // 2 - (1 if extra else 0)
    height = 5.2 * rows + 0.9
    fig = plt.figure(figsize=(14, height))
    grid = fig.add_gridspec(rows, 2, hspace=0.32, wspace=0.22, top=1 - 1.25 / height,
                            bottom=0.5 / height)
    time_panel(2, "Forward: time per call vs N")(fig.add_subplot(grid[0, 0]), points, ticker)
    time_panel(4, "Forward + backward: time per call vs N")(fig.add_subplot(grid[0, 1]), points,
                                                            ticker)
    bottom = [peak_panel] + extra
    for i, draw in enumerate(bottom):
        r, c = 1 + i // 2, i % 2
        span = grid[r, :] if len(bottom) == 1 else grid[r, c]
        draw(fig.add_subplot(span), points, ticker)
    key = ("float, one thread, K = 64, r = d_v = 64 · solid: operator (band: min–max over "
           "repetitions; hollow marker: too few samples) · dashed: its GEMM floor · "
           "dotted grey: O(N), O(N²) · "
           f"fewer than {MIN_LINE_POINTS} sizes: markers with min–max bars, no line")
    fig.suptitle("mixattn: linear-time GMA and OVQ against O(N²) softmax attention" +
                 (f" — {mode}" if mode else ""), x=0.06, ha="left", fontsize=14,
                 y=1 - 0.25 / height, va="top")
    fig.text(0.06, 1 - 0.62 / height, key, fontsize=9, color="#555555", ha="left", va="top")
    return fig


def memory_figure(plt, ticker, points, mode):
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    for ax, which, title in ((axes[0], 2, "Forward: peak extra heap per call vs N"),
                             (axes[1], 4, "Forward + backward: peak extra heap per call vs N")):
        # No floors: a floor's heap is Eigen's GEMM blocking buffer, not a property of the work.
        operator_panel(ax, points, ticker, which, heap, True, fmt_bytes, floors=False, y_base=4)
        ax.set_title(title, loc="left", fontsize=11)
        ax.set_xlabel("sequence length N [tokens]")
        ax.set_ylabel("peak extra heap [log scale]")
    fig.suptitle("mixattn: memory per call (outputs, saved state and scratch)" +
                 (f" — {mode}" if mode else ""), x=0.06, ha="left", fontsize=14)
    fig.text(0.06, 0.905, "float, one thread · dotted grey: O(N), O(N²)", fontsize=9,
             color="#555555", ha="left")
    fig.subplots_adjust(top=0.84, wspace=0.22)
    return fig


def plot_all(points, out_dir, mode=""):
    """Writes the figures into out_dir, `mode` (e.g. "main job, N = 4096") in their titles;
    returns their paths ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker as ticker
    except ImportError:
        print("summary: matplotlib not available, skipping plots", file=sys.stderr)
        return []
    written = []
    for name, build in (("time_vs_n.png", time_figure), ("memory_vs_n.png", memory_figure)):
        fig = build(plt, ticker, points, mode)
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
