"""`build_schedule`: one entry point for every schedule kind x method, training or evaluation."""

from __future__ import annotations

from . import blocks
from .ir import KINDS, METHODS, Schedule, ScheduleError
from .lower import lower
from .timing import place

# Which methods each kind supports, and the chunks per rank it needs (None: any >= 1).
SUPPORTED = {
    "1f1b": ("baseline", "redis", "vocab-1", "vocab-2"),
    "vhalf": ("baseline", "vocab-1", "vocab-2"),
    "interleaved": ("baseline", "vocab-2"),
}
BARRIERS = {"baseline": 0, "redis": 0, "vocab-2": 1, "vocab-1": 2}


def build_schedule(kind: str, method: str, num_ranks: int, num_microbatches: int,
                   chunks_per_rank: int | None = None, forward_only: bool = False) -> Schedule:
    """The schedule of one optimizer step (or one evaluation step when `forward_only`).

    kind: "1f1b" (1 chunk per rank), "vhalf" (2 chunks per rank, V shape, B/W split) or "interleaved"
    (`chunks_per_rank` chunks round-robin, default 2). method: "baseline", "redis" (same order as
    baseline, the layer split differs), "vocab-1" or "vocab-2".
    """
    v = _check_inputs(kind, method, num_ranks, num_microbatches, chunks_per_rank)
    p, m = num_ranks, num_microbatches
    block_fn = {"1f1b": lambda s: blocks.one_f_one_b(p, s), "vhalf": lambda s: blocks.v_half(p, s),
                "interleaved": lambda s: blocks.interleaved(p, v, s)}[kind]
    q = block_fn(0).sub_period
    block = block_fn(BARRIERS[method] * q)
    passes, colls = place(block, p, m, method, forward_only)
    actions = lower(p, block.chunk_rank, passes, colls)
    return Schedule(kind=kind, method=method, num_ranks=p, num_microbatches=m,
                    chunk_rank=block.chunk_rank, split_backward=block.split_backward and not forward_only,
                    forward_only=forward_only, actions=actions)


def _check_inputs(kind, method, p, m, chunks_per_rank) -> int:
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    if method not in METHODS:
        raise ScheduleError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method not in SUPPORTED[kind]:
        raise ScheduleError(f"schedule {kind!r} does not support method {method!r}; it supports "
                            f"{', '.join(SUPPORTED[kind])} (use 1f1b for the others)")
    if not isinstance(p, int) or p < 2:
        raise ScheduleError(f"num_ranks must be an integer >= 2 (got {p!r}); with one rank there is no pipeline")
    if not isinstance(m, int) or m < p:
        raise ScheduleError(f"num_microbatches ({m!r}) must be >= num_ranks ({p}): with fewer microbatches "
                            f"than stages the pipeline never fills; raise the microbatch count or use fewer ranks")
    fixed = {"1f1b": 1, "vhalf": 2}
    if kind in fixed:
        if chunks_per_rank not in (None, fixed[kind]):
            raise ScheduleError(f"{kind} holds exactly {fixed[kind]} chunk(s) per rank (got chunks_per_rank="
                                f"{chunks_per_rank}); use kind='interleaved' for another count")
        return fixed[kind]
    v = 2 if chunks_per_rank is None else chunks_per_rank
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"chunks_per_rank must be an integer >= 1 (got {v!r})")
    return v
