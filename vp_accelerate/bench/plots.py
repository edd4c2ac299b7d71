"""PNG plots of a benchmark: throughput vs V, per-rank memory, measured timelines side by side."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only; no display on the benchmark machines
import matplotlib.pyplot as plt  # noqa: E402

from vp_accelerate.bench.report import Row, vocab_label  # noqa: E402
from vp_accelerate.bench.timeline import Pass  # noqa: E402
from vp_accelerate.sim.plot import plot_timeline  # noqa: E402  (measured and simulated timelines look alike)


def plot_throughput(rows: list[Row], path: str) -> None:
    """tokens/s against vocabulary size, one line per method."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method in dict.fromkeys(r.method for r in rows):
        pts = sorted((r.vocab, r.tokens_per_s) for r in rows if r.method == method)
        ax.plot(
            [v for v, _ in pts],
            [t for _, t in pts],
            marker="o",
            label=method,
            linestyle="--" if method == "peer" else "-",
        )
    ax.set_xscale("log", base=2)
    vocabs = sorted({r.vocab for r in rows})
    ax.set_xticks(vocabs, [vocab_label(v) for v in vocabs])
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("tokens / s")
    ax.set_title("Training throughput (2 ranks, CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(rows: list[Row], path: str) -> None:
    """Per-rank peak memory bars, one panel per vocabulary size, grouped by method."""
    vocabs = sorted({r.vocab for r in rows})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(3.6 * len(vocabs), 3.8), squeeze=False)
    for ax, vocab in zip(axes[0], vocabs):
        vrows = [r for r in rows if r.vocab == vocab]
        nranks = max(len(r.peak_memory_bytes) for r in vrows)
        width = 0.8 / nranks
        for k in range(nranks):
            ax.bar(
                [i + k * width for i in range(len(vrows))],
                [r.peak_memory_bytes[k] / 2**20 for r in vrows],
                width,
                label=f"rank {k}",
            )
        ax.set_xticks(
            [i + width * (nranks - 1) / 2 for i in range(len(vrows))],
            [r.method for r in vrows],
            rotation=45,
            ha="right",
            fontsize=7,
        )
        ax.set_title(f"V = {vocab_label(vocab)}")
        ax.set_ylabel("peak memory (MiB)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timelines(rows: list[Row], path: str, methods: tuple[str, ...], vocab: int) -> bool:
    """The measured timelines of `methods` at `vocab`, stacked on a shared time axis. False if none ran."""
    chosen = [r for m in methods for r in rows if r.method == m and r.vocab == vocab and r.timeline]
    if not chosen:
        return False
    fig, axes = plt.subplots(len(chosen), 1, figsize=(12, 0.4 + 1.9 * len(chosen)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], chosen):
        plot_timeline(
            [Pass(*p) for p in r.timeline],
            ax=ax,
            title=f"{r.method}, V={vocab_label(vocab)}: step {r.step_s:.2f} s, bubble {r.bubble_rate:.0%}",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_plots(rows: list[Row], out_dir: str, prefix: str = "bench_") -> list[str]:
    """Write every plot into out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{prefix}throughput.png"), os.path.join(out_dir, f"{prefix}memory.png")]
    plot_throughput(rows, paths[0])
    plot_memory(rows, paths[1])
    vocab = max(r.vocab for r in rows)
    base = next((m for m in ("1f1b-baseline", "peer") if any(r.method == m for r in rows)), None)
    tl = os.path.join(out_dir, f"{prefix}timeline.png")
    if plot_timelines(rows, tl, tuple(m for m in (base, "1f1b-vocab-2") if m), vocab):
        paths.append(tl)
    return paths
