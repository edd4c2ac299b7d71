"""Plots: a pipeline timeline (one row per rank, passes coloured by kind, as in the paper's figures)
and MFU / peak memory against vocabulary size per method."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "W": "#8fd19e",
    "S": "#c44e52",
    "T": "#dd8452",
    "IF": "#8172b3",
    "IB": "#b39ddb",
}
LABELS = {
    "F": "forward",
    "B": "backward",
    "W": "weight grad",
    "S": "S (output fwd)",
    "T": "T (output wgrad)",
    "IF": "input emb fwd",
    "IB": "input emb bwd",
}
_FIELDS = ("rank", "op", "mb", "chunk", "start", "end")
COMM_COLOR = "#555555"


def _record(r) -> tuple:
    """(rank, op, mb, chunk, start, end) from an object with those attributes, a dict or a tuple."""
    if isinstance(r, dict):
        vals = [r.get(k, 0) for k in _FIELDS]
    elif hasattr(r, "start"):
        vals = [getattr(r, k, 0) for k in _FIELDS]
    else:
        vals = list(r)
    op = getattr(vals[1], "value", vals[1])
    return int(vals[0]), str(op), int(vals[2]), int(vals[3]), float(vals[4]), float(vals[5])


def _lane(r) -> str:
    """A record's lane ("compute" unless it says "comm": a collective chain on the communication worker)."""
    if isinstance(r, dict):
        return r.get("lane", "compute")
    return getattr(r, "lane", "compute")


def _comm_spans(records) -> list[tuple]:
    """(rank, start, end) of the collective chains among `records` (any nesting, as `_flatten`)."""
    out = []
    for r in records:
        if isinstance(r, (list, tuple)) and r and not isinstance(r[0], (int, float, str)):
            out += _comm_spans(r)
        elif _lane(r) == "comm":
            rank, _, _, _, start, end = _record(r)
            out.append((rank, start, end))
    return out


def _flatten(records) -> list[tuple]:
    out = []
    for r in records:
        if isinstance(r, (list, tuple)) and r and not isinstance(r[0], (int, float, str)):
            out += _flatten(r)  # per-rank lists
        else:
            out.append(_record(r))
    return out


def plot_timeline(records, path=None, *, ax=None, title: str | None = None, label_microbatches: bool = True):
    """Draw passes (rank, op, mb, chunk, start, end) — simulated (SimResult.timeline) or measured
    (the runtime's records, flat or one list per rank). Collective chains (records of lane "comm") are
    a thin strip under each rank's passes; p2p and the issue of a collective are not drawn.
    Saves to `path` when given; draws into `ax` when given; returns the figure."""
    comm = _comm_spans(records)
    recs = [r for r in _flatten(records) if r[1] in COLORS]
    if not recs:
        raise ValueError("no compute passes to draw")
    ranks = sorted({r[0] for r in recs})
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(14, 0.45 * len(ranks) + 1.3))
    else:
        fig = ax.figure
    span = max(r[5] for r in recs) - min(r[4] for r in recs)
    chunks = {}
    for r in recs:
        if r[1] in ("F", "B", "W"):
            chunks.setdefault(r[0], set()).add(r[3])
    order = {rank: sorted(cs) for rank, cs in chunks.items()}
    for rank, op, mb, chunk, start, end in recs:
        # a rank's second (fourth, ...) chunk is drawn lighter so V shapes and interleaving stay readable
        odd = op in ("F", "B", "W") and order[rank].index(chunk) % 2 == 1
        alpha = 0.6 if odd else 1.0
        ax.broken_barh(
            [(start, end - start)],
            (rank - 0.42, 0.84),
            facecolors=COLORS[op],
            alpha=alpha,
            edgecolor="white",
            linewidth=0.2,
        )
        if label_microbatches and end - start > 0.012 * span:
            ax.text((start + end) / 2, rank, str(mb), ha="center", va="center", fontsize=5, color="white")
    for rank, start, end in comm:  # collective chains: a thin strip under the rank's passes
        if rank in ranks:
            ax.broken_barh([(start, end - start)], (rank + 0.44, 0.12), facecolors=COMM_COLOR)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlabel("seconds from step start")
    present = [op for op in COLORS if any(r[1] == op for r in recs)]
    handles = [Patch(color=COLORS[o], label=LABELS[o]) for o in present]
    if comm:
        handles.append(Patch(color=COMM_COLOR, label="collective chains"))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28 if own else -0.35),
        ncol=len(handles),
        fontsize=7,
        frameon=False,
    )
    if title:
        ax.set_title(title, fontsize=9)
    if own:
        fig.tight_layout()
        if path:
            fig.savefig(path, dpi=110)
            plt.close(fig)
    return fig


def plot_vocab_sweep(rows: list[dict], path: str, title: str = "") -> None:
    """MFU and peak memory (max over ranks) vs vocabulary size, one line per method.
    rows: dicts with keys method, vocab, mfu (fraction), peak_memory_gb."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for m in methods:
        pts = sorted((r["vocab"], r["mfu"] * 100, r["peak_memory_gb"]) for r in rows if r["method"] == m)
        xs = [p[0] / 1000 for p in pts]
        a1.plot(xs, [p[1] for p in pts], marker="o", label=m)
        a2.plot(xs, [p[2] for p in pts], marker="o", label=m)
    for a, y in ((a1, "MFU (%)"), (a2, "peak memory, max over ranks (GB)")):
        a.set_xscale("log", base=2)
        xs = sorted({r["vocab"] / 1000 for r in rows})
        a.set_xticks(xs, [f"{x:g}k" for x in xs])
        a.set_xlabel("vocabulary size")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
    a1.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
