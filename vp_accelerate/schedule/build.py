"""`build_schedule`: one entry point for every schedule kind x method, training or evaluation."""

from __future__ import annotations

from .ir import Schedule, ScheduleError
from .lower import lower
from .registry import SCHEDULES, ScheduleKind, check_pair
from .timing import place

# Which methods each kind supports (kept for callers of the old name; the registry is the source).
SUPPORTED = {name: kind.methods for name, kind in SCHEDULES.items()}


def build_schedule(kind: str, method: str, num_ranks: int, num_microbatches: int,
                   chunks_per_rank: int | None = None, forward_only: bool = False) -> Schedule:
    """The schedule of one optimizer step (or one evaluation step when `forward_only`).

    kind and method: names in schedule.registry's SCHEDULES and METHODS (any case): "1f1b" (1 chunk
    per rank), "vhalf" (2 chunks per rank, V shape, B/W split) or "interleaved" (`chunks_per_rank`
    chunks round-robin, default 2); "baseline", "redis" (same order as baseline, the layer split
    differs), "vocab-1" or "vocab-2".
    """
    sk, meth = check_pair(kind, method)
    v = _check_inputs(sk, num_ranks, num_microbatches, chunks_per_rank, forward_only)
    p, m = num_ranks, num_microbatches
    q = sk.block(p, v, 0).sub_period
    block = sk.block(p, v, meth.barriers * q)
    passes, colls = place(block, p, m, meth, forward_only)
    actions = lower(p, block.chunk_rank, passes, colls)
    return Schedule(kind=sk.name, method=meth.name, num_ranks=p, num_microbatches=m,
                    chunk_rank=block.chunk_rank, split_backward=block.split_backward and not forward_only,
                    forward_only=forward_only, actions=actions)


def _check_inputs(kind: ScheduleKind, p, m, chunks_per_rank, forward_only: bool) -> int:
    # one rank is a degenerate pipeline (no point-to-point traffic, 1-rank vocabulary collectives): the same
    # passes and code paths on a single device, which is what a one-GPU check can run
    if not isinstance(p, int) or p < 1:
        raise ScheduleError(f"num_ranks must be an integer >= 1 (got {p!r})")
    if not isinstance(m, int) or m < p:
        raise ScheduleError(f"num_microbatches ({m!r}) must be >= num_ranks ({p}): with fewer microbatches "
                            f"than stages the pipeline never fills; raise the microbatch count or use fewer ranks")
    if forward_only and not kind.forward_only:
        raise ScheduleError(f"schedule {kind.name!r} has no forward-only (evaluation) variant")
    if kind.chunks_per_rank is not None:
        if chunks_per_rank not in (None, kind.chunks_per_rank):
            flexible = [k for k, s in SCHEDULES.items() if s.chunks_per_rank is None]
            raise ScheduleError(f"{kind.name} holds exactly {kind.chunks_per_rank} chunk(s) per rank (got "
                                f"chunks_per_rank={chunks_per_rank}); use kind={' or '.join(map(repr, flexible))} "
                                f"for another count")
        return kind.chunks_per_rank
    v = kind.default_chunks_per_rank if chunks_per_rank is None else chunks_per_rank
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"chunks_per_rank must be an integer >= 1 (got {v!r})")
    return v
