"""The tables of bench/summary.py: every point, the headline operators, the training shapes, and
the PyTorch extension against eager PyTorch; as text for the terminal or as markdown."""

from summary_data import (Measurements, Missing, PEAK_OP, fmt_bytes, fmt_ratio, fmt_time,
                          spread_text)
from summary_rules import thread_speedup
from summary_targets import TORCH_EXT_N, T_OVQ, torch_blas_checked

N = 4096

# The training step (forward_into + backward_into with reused records) does the work of a
# forward+backward: the same floor and the same softmax comparisons.
SAME_WORK = {"gma_train_step_into_bidir": "gma_fwd_bwd_bidir",
             "gma_train_step_into_bidir_keep": "gma_fwd_bwd_bidir",
             "gma_train_step_into_causal": "gma_fwd_bwd_causal"}
# Points that are not one call over N tokens of one head: no floor or softmax column.
NOT_ONE_HEAD = ("floor_", "peak_", "torch_", "gma_heads", "gma_packed", "gma_separate", "layer_",
                "decode_", "bh")


def floor_of(op):
    op = SAME_WORK.get(op, op)
    if op.startswith(("floor_", "torch_", "peak_")):
        return None
    if op.startswith("naive_") or op.startswith("flash_"):
        return "floor_softmax_" + op.split("_", 1)[1]
    return "floor_" + op


def softmax_of(op, impl):
    """The softmax attention point (impl: flash or naive) doing the same kind of call at the same
    N (OVQ and the sliding window are causal), or None."""
    op = SAME_WORK.get(op, op)
    if op.startswith(NOT_ONE_HEAD) or op == "gma_responsibilities":
        return None
    if op.startswith(impl + "_") and not op.startswith("flash_window"):
        return None
    kind = "fwd_bwd" if "fwd_bwd" in op else "forward"
    mode = "bidir" if "bidir" in op else "causal"
    return f"{impl}_{kind}_{mode}"


HEADER = ["operator", "N", "time/call", "[min – max]", "reps×iters", "t / t_floor",
          "fraction of peak (GFLOP/s)", "speed-up vs flash", "speed-up vs naive",
          "peak extra heap", "note"]


def ratio_cell(f, fmt=fmt_ratio):
    try:
        q = f()
    except (Missing, ZeroDivisionError):
        return "—", None
    return (fmt(q.med) if q.ok else "(too few samples)"), q


def peak_cell(m, p, t):
    """(text, impossibility or None): the fraction of the FMA peak with the GFLOP/s beside it."""
    if p.op == PEAK_OP or p.flop_per_call() is None:
        return "—", None
    text, q = ratio_cell(lambda: m.fraction_of_peak(p.op, p.n, p.threads), lambda x: f"{x:.2f}")
    # A rate above the measured peak times the threads is not a measurement of work done.
    problem = f"{q.med:.2f}× the FMA peak" if q is not None and q.med > p.threads else None
    rate = p.flop_per_call() / t.med / 1e9
    return (f"{text} ({rate:.3g})" if text != "—" else f"({rate:.3g})"), problem


def point_row(m, p, strict=False):
    """One table row; returns (cells, problem: the text of an impossible measurement or None)."""
    t = p.seconds()
    note = [] if t.ok else ["too few samples"]
    one = p.threads == 1
    rel, fl, nv = floor_of(p.op), softmax_of(p.op, "flash"), softmax_of(p.op, "naive")
    floor_txt = ratio_cell(lambda: t / m.time(rel, p.n))[0] if rel and one else "—"
    flash_txt = ratio_cell(lambda: m.time(fl, p.n) / t)[0] if fl and one else "—"
    naive_txt = ratio_cell(lambda: m.time(nv, p.n) / t)[0] if nv and one else "—"
    peak_txt, problem = peak_cell(m, p, t)
    if problem:
        note.append(f"impossible: {problem}" if strict else f"unreliable (noise: {problem})")
    heap = p.counter("peak_heap_bytes")
    name = p.op if one else f"{p.op} ({p.threads} threads)"
    cells = [name, str(p.n) if p.n else "—", fmt_time(t.med),
             "" if t.lo == t.hi else f"{fmt_time(t.lo)} – {fmt_time(t.hi)}",
             p.samples_text(), floor_txt, peak_txt, flash_txt, naive_txt,
             fmt_bytes(heap.med if heap else None), ", ".join(note)]
    return cells, problem


def table_rows(points, contexts, ns_filter=None, strict=False):
    """-> (rows, problems [(point, text)]): every point (floors are a column of their operator's
    row), and the points whose measurement is impossible (floors too: no GEMM may run above the
    peak either)."""
    m = Measurements(points, contexts)
    rows, problems = [], []
    for key in sorted(points):
        p = points[key]
        cells, problem = point_row(m, p, strict)
        if problem:
            problems.append((p, f"{p.label()}: {cells[-1]}"))
        if p.op.startswith("floor_"):
            continue
        if ns_filter and p.n not in ns_filter and not p.op.startswith("peak_"):
            continue
        rows.append(cells)
    return rows, problems


def text_table(header, rows, group=False):
    """Columns padded to their widths; with group, a blank line between operators (a point's
    thread-count variants stay with it)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    prev = None
    for r in rows:
        name = r[0].split(" (")[0]
        if group and prev is not None and name != prev:
            out.append("")
        prev = name
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(out)


def md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---- the headline operator table -----------------------------------------------------------------

HEADLINE = [  # (label, operator, N, full run only)
    ("GMA bidirectional forward", "gma_forward_bidir", N, False),
    ("GMA bidirectional forward+backward", "gma_fwd_bwd_bidir", N, False),
    ("GMA bidirectional training step (forward_into + backward_into, records reused)",
     "gma_train_step_into_bidir", N, False),
    ("GMA causal forward", "gma_forward_causal", N, False),
    ("GMA causal forward+backward", "gma_fwd_bwd_causal", N, False),
    ("flash forward (bidirectional)", "flash_forward_bidir", N, False),
    ("flash forward+backward (bidirectional)", "flash_fwd_bwd_bidir", N, False),
    ("naive softmax forward (bidirectional)", "naive_forward_bidir", N, False),
    ("OVQ forward", "ovq_forward", N, False),
    ("OVQ forward+backward", "ovq_fwd_bwd", N, False),
    ("OVQ forward, T = 65 536", "ovq_forward", T_OVQ, False),
    ("OVQ forward+backward, T = 65 536", "ovq_fwd_bwd", T_OVQ, True),
    ("linear attention bidirectional forward", "linear_forward_bidir", N, False),
    ("linear attention bidirectional forward+backward", "linear_fwd_bwd_bidir", N, False),
    ("linear attention causal forward", "linear_forward_causal", N, False),
    ("linear attention causal forward+backward", "linear_fwd_bwd_causal", N, False),
    ("Performer (m = 256) bidirectional forward", "performer_forward_bidir", N, False),
    ("Performer (m = 256) bidirectional forward+backward", "performer_fwd_bwd_bidir", N, False),
    ("Performer (m = 256) causal forward", "performer_forward_causal", N, False),
    ("Performer (m = 256) causal forward+backward", "performer_fwd_bwd_causal", N, False),
    ("VQ attention (S = 64) bidirectional forward", "vq_forward_bidir", N, False),
    ("VQ attention (S = 64) bidirectional forward+backward", "vq_fwd_bwd_bidir", N, False),
    ("VQ attention (S = 64) causal forward", "vq_forward_causal", N, False),
    ("VQ attention (S = 64) causal forward+backward", "vq_fwd_bwd_causal", N, False),
    ("sliding-window attention (w = 256) forward", "flash_window256_forward_causal", N, False),
    ("sliding-window attention (w = 256) forward+backward", "flash_window256_fwd_bwd_causal", N,
     False),
]
HEADLINE_HEADER = ["operator (N = 4096 unless said)", "time [min – max]", "ratio to GEMM floor",
                   "fraction of FMA peak (GFLOP/s)", "speed-up vs flash", "speed-up vs naive",
                   "peak extra heap"]


def headline_rows(points, contexts, main_job=False):
    rows, m = [], Measurements(points, contexts)
    for label, op, n, full_only in HEADLINE:
        p = points.get((op, n, 1))
        if p is None:
            if not (main_job and full_only):
                rows.append([label, "not measured", "—", "—", "—", "—", "—"])
            continue
        cells, _ = point_row(m, p)
        time = cells[2] + (f" [{cells[3]}]" if cells[3] else "")
        rows.append([label, time, cells[5], cells[6], cells[7], cells[8], cells[9]])
    return rows


# ---- the training shapes (bench_training.cpp) ----------------------------------------------------

TRAINING_LABELS = {
    "gma_bidir": "GMA bidirectional", "gma_causal": "GMA causal", "ovq": "OVQ",
    "flash_bidir": "flash (bidirectional)", "linear_bidir": "linear attention bidirectional",
    "linear_causal": "linear attention causal", "performer_bidir": "Performer bidirectional",
    "performer_causal": "Performer causal", "vq_bidir": "VQ attention bidirectional",
    "vq_causal": "VQ attention causal"}
TRAINING_HEADER = ["operator (float, K = r = d_v = 64)", "pairs × N", "1 thread [min – max]",
                   "per pair", "fraction of FMA peak (GFLOP/s)", "2 threads", "2 threads vs 1"]


def training_label(op):
    """'bh32_gma_bidir_step' -> (32, 'GMA bidirectional training step')."""
    head, rest = op.split("_", 1)
    name, kind = rest.rsplit("_", 1)
    what = "training step" if kind == "step" else kind
    return int(head[2:]), f"{TRAINING_LABELS.get(name, name)} {what}"


def speedup_cell(m, op, n):
    try:
        q = thread_speedup(op, 2, n)(m)
    except (Missing, ZeroDivisionError):
        return "—"
    if not q.ok:
        return f"{fmt_ratio(q.med)} ({q.refusal})"
    return fmt_ratio(q.med) + spread_text(q, fmt_ratio)


def training_rows(points, contexts):
    rows, m = [], Measurements(points, contexts)
    keys = sorted({(op, n) for (op, n, _) in points if op.startswith("bh") and "_" in op},
                  key=lambda k: (k[0].split("_", 1)[1], -int(k[0].split("_")[0][2:]), k[1]))
    for op, n in keys:
        pairs, label = training_label(op)
        one, two = points.get((op, n, 1)), points.get((op, n, 2))
        cells = [label, f"{pairs} × {n}"]
        if one is not None:
            t = one.seconds()
            cells += [fmt_time(t.med) + spread_text(t, fmt_time), fmt_time(t.med / pairs),
                      peak_cell(m, one, t)[0]]
        else:
            cells += ["not measured", "—", "—"]
        if two is not None:
            t2 = two.seconds()
            cells.append(fmt_time(t2.med) + spread_text(t2, fmt_time))
            cells.append(speedup_cell(m, op, n))
        else:
            cells += ["—", "—"]
        rows.append(cells)
    return rows


# ---- the PyTorch extension against eager PyTorch (bench/torch_ext_bench.py) ----------------------

TORCH_EXT_ROWS = [  # (label, operator suffix, threads)
    *[(f"GMA {mode_label} {kind_label}", f"{kind}_{mode}", threads)
      for threads in (1, 2)
      for mode, mode_label in (("bidir", "bidirectional"), ("causal", "causal"))
      for kind, kind_label in (("forward", "forward"), ("fwd_bwd", "forward+backward"))],
    ("training step, 2-layer causal LM (d_model 256, 4 heads, K = 64, N = 2048, batch 4)",
     "step_causal", 1),
    ("training step, same", "step_causal", 2),
]
TORCH_EXT_HEADER = ["operation", "threads", "mixattn", "eager GMA, paper's form",
                    "eager GMA, matmul form", "eager softmax", "paper's form / mixattn",
                    "matmul form / mixattn"]


def torch_ext_rows(points, contexts):
    """Median time per call of each side (CPU on one thread, wall on two) and the speed-ups over
    the two eager GMAs, call by call. Rows with no measured side are left out."""
    m, rows = Measurements(points, contexts), []
    for label, what, threads in TORCH_EXT_ROWS:
        cells, times = [label, str(threads)], {}
        for impl in ("mixattn", "eager_gma_paper", "eager_gma", "softmax"):
            try:
                q = m.time(f"torch_ext_{impl}_{what}", TORCH_EXT_N, threads)
            except Missing:
                cells.append("not measured")
                continue
            times[impl] = q
            cells.append(fmt_time(q.med) + spread_text(q, fmt_time)
                         + ("" if q.ok else " (too few samples)"))
        for eager in ("eager_gma_paper", "eager_gma"):
            if "mixattn" in times and eager in times:
                r = torch_blas_checked(m, times[eager] / times["mixattn"])
                cells.append(fmt_ratio(r.med) if r.ok else f"({r.refusal})")
            else:
                cells.append("—")
        if times:
            rows.append(cells)
    return rows
