"""Turn the ranks' raw records into result rows, a markdown table and JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, astuple, dataclass, field

from vp_accelerate.bench.config import BenchConfig
from vp_accelerate.bench.methods import get_method
from vp_accelerate.bench.timeline import Pass, balanced_bound_s, bubble_rate
from vp_accelerate.bench.worker import MemoryRecord, StepRecord


@dataclass
class Row:
    """Result for one (vocab, method), over all ranks and timed repetitions."""

    vocab: int
    method: str
    tokens_per_s: float
    """Tokens of the step (microbatches x microbatch size x seq) / median step time."""
    step_s: float
    """Median over repetitions of the step time (slowest rank, between barriers)."""
    step_s_all: list[float]
    """Every repetition's step time, for judging the noise."""
    ratio_to_peer: float | None
    """tokens_per_s / the peer's at the same vocab (None if the peer was not run)."""
    bubble_rate: float
    """1 - sum of all ranks' compute-pass time / (p x step time), of the median repetition."""
    balanced_bound_s: float
    """Total measured pass time / p x (1 + the schedule's warm-up/cool-down fraction)."""
    efficiency: float
    """balanced_bound_s / step_s: 1.0 means perfectly balanced with no bubble beyond the ramp."""
    pass_time_s: list[float]
    """Per rank, compute-pass time of the median repetition."""
    peak_memory_bytes: list[int]
    """Per rank: parameter bytes + allocator peak of a step started with freed gradients."""
    peak_activation_bytes: list[int]
    """Per rank: allocator peak of a step started with gradients allocated (activations + transients)."""
    param_bytes: list[int]
    memory_imbalance: float
    """max / min of peak_memory_bytes over ranks."""
    loss: float
    timeline: list[list] = field(default_factory=list)
    """Passes (rank, op, mb, chunk, start, end) of the median repetition, seconds from its start."""


def _median_rep(reps: dict[int, list[StepRecord]]) -> int:
    times = sorted((max(r.step_s for r in recs), rep) for rep, recs in reps.items())
    return times[(len(times) - 1) // 2][1]


def build_rows(cfg: BenchConfig, methods: list[str], mem: list[MemoryRecord], steps: list[StepRecord]) -> list[Row]:
    rows: list[Row] = []
    for vocab in cfg.vocabs:
        peer_tps = None
        for name in methods:
            reps: dict[int, list[StepRecord]] = {}
            for s in steps:
                if s.vocab == vocab and s.method == name:
                    reps.setdefault(s.rep, []).append(s)
            step_all = [max(r.step_s for r in reps[k]) for k in sorted(reps)]
            med = _median_rep(reps)
            med_step = max(r.step_s for r in reps[med])
            passes: list[Pass] = sorted((p for r in reps[med] for p in r.passes), key=lambda p: (p.rank, p.start))
            ms = sorted((m for m in mem if m.vocab == vocab and m.method == name), key=lambda m: m.rank)
            peaks = [m.peak_memory_bytes for m in ms]
            p = cfg.world_size
            bound = balanced_bound_s(passes, p, cfg.microbatches, get_method(name).schedule)
            tps = cfg.tokens_per_step / statistics.median(step_all)
            if name == "peer":
                peer_tps = tps
            rows.append(
                Row(
                    vocab=vocab,
                    method=name,
                    tokens_per_s=tps,
                    step_s=statistics.median(step_all),
                    step_s_all=step_all,
                    ratio_to_peer=None,
                    bubble_rate=bubble_rate(passes, p, med_step),
                    balanced_bound_s=bound,
                    efficiency=bound / med_step if med_step > 0 else 0.0,
                    pass_time_s=[sum(x.end - x.start for x in passes if x.rank == r) for r in range(p)],
                    peak_memory_bytes=peaks,
                    peak_activation_bytes=[m.peak_activation_bytes for m in ms],
                    param_bytes=[m.param_bytes for m in ms],
                    memory_imbalance=max(peaks) / max(1, min(peaks)),
                    loss=reps[med][0].loss,
                    timeline=[list(astuple(x)) for x in passes],
                )
            )
        for row in rows:
            if row.vocab == vocab and peer_tps:
                row.ratio_to_peer = row.tokens_per_s / peer_tps
    return rows


def vocab_label(v: int) -> str:
    """32768 -> "32k"; sizes that are not a multiple of 1024 stay as they are."""
    return f"{v // 1024}k" if v % 1024 == 0 else str(v)


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}" if b >= 10 * 2**20 else f"{b / 2**20:.2f}"


def markdown_table(rows: list[Row]) -> str:
    """One line per (vocab, method); memory in MiB per rank."""
    head = (
        "| V | method | tokens/s | vs peer | bubble | efficiency | peak mem MiB (per rank) | "
        "act MiB (per rank) | params MiB (per rank) | mem max/min | loss |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = f"{r.ratio_to_peer:.2f}x" if r.ratio_to_peer is not None else "-"
        lines.append(
            f"| {vocab_label(r.vocab)} | {r.method} | {r.tokens_per_s:,.0f} | {ratio} | {r.bubble_rate:.1%} | "
            f"{r.efficiency:.0%} | {' / '.join(map(_mib, r.peak_memory_bytes))} | "
            f"{' / '.join(map(_mib, r.peak_activation_bytes))} | {' / '.join(map(_mib, r.param_bytes))} | "
            f"{r.memory_imbalance:.2f} | {r.loss:.4f} |"
        )
    return "\n".join(lines)


def write_json(rows: list[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1)
