"""`build_schedule`: one entry point for every schedule kind x method, training or evaluation."""

from __future__ import annotations

from .ir import Schedule, ScheduleError
from .list_schedule import POLICIES, Stuck, Ticks, list_schedule
from .lower import lower
from .registry import SCHEDULES, ScheduleKind, check_pair
from .replay import CostClock, makespan, replay
from .streams import NCCL
from .timing import place
from .validate import validate


def build_schedule(
    kind: str,
    method: str,
    num_ranks: int,
    num_microbatches: int,
    chunks_per_rank: int | None = None,
    forward_only: bool = False,
    costs=None,
) -> Schedule:
    """The schedule of one optimizer step (or one evaluation step when `forward_only`).

    kind and method: names in schedule.registry's SCHEDULES and METHODS (any case): "1f1b" (1 chunk
    per rank), "vhalf" (2 chunks per rank, V shape, B/W split) or "interleaved" (`chunks_per_rank`
    chunks round-robin, default 2); "baseline", "redis" (same order as baseline, the layer split
    differs), "vocab-1", "vocab-2" or "interlaced" (1F1B only: the vocabulary steps synchronous on every
    rank; built on its grid whatever `costs` says, as an order that moved a step would no longer be one).

    costs: None builds the block's order on its unit grid. Pass costs (anything with
    `pass_time(rank, op, chunk)`, `p2p_time()` and `collective_time(op)`: a cost.CostModel of this
    layout, or measured cost.MeasuredCosts) build a cost-aware order instead (list_schedule.py): the
    block's order as a priority, its activation peaks as the limit, the real pass times deciding the
    rest (a few priority policies); of these and the block's own order the fastest is kept, each timed
    by the replay under NCCL's rules with the same costs (the grid's order when none is faster). Every rank
    must pass the same costs (the order is a pure function of the inputs).
    """
    sk, meth = check_pair(kind, method)
    v = _check_inputs(sk, num_ranks, num_microbatches, chunks_per_rank, forward_only)
    p, m = num_ranks, num_microbatches
    if meth.synchronous:  # its vocabulary step has slots of its own in every period: no backward shift
        block = sk.synchronous_block(p)
    else:
        q = sk.block(p, v, 0).sub_period
        block = sk.block(p, v, meth.barriers * q)
    split = block.split_backward and not forward_only

    def schedule_of(passes, colls) -> Schedule:
        return Schedule(
            kind=sk,
            method=meth,
            num_ranks=p,
            num_microbatches=m,
            chunk_rank=block.chunk_rank,
            split_backward=split,
            forward_only=forward_only,
            actions=lower(p, block.chunk_rank, passes, colls),
        )

    passes, colls = place(block, p, m, meth, forward_only)
    grid = schedule_of(passes, colls)
    if costs is None or p == 1 or meth.synchronous:  # a list schedule would unsynchronise its vocabulary steps
        return grid
    schedule = _cost_aware(grid, schedule_of, passes, costs)
    if schedule is not grid:  # the grid orders are checked by the tests; a cost-aware one is new for every input
        validate(schedule)
    return schedule


def _cost_aware(grid: Schedule, schedule_of, passes, costs) -> Schedule:
    """The fastest of the block's own order (`grid`) and the list schedules of its placement with `costs`
    (one per priority policy), each timed as a GPU runs it: the replay under NCCL's rules (`streams.NCCL`)
    with these costs. The list scheduler builds on the same clock under the replay's buffered rules (sends
    never wait), and NCCL's rendezvous and in-order batches can undo what it gains, so the choice is made
    on the replay under NCCL's."""
    clock = CostClock(costs)
    ticks = Ticks(clock, passes)
    candidates = [grid]
    for policy in POLICIES:
        try:
            new_passes, new_colls, _ = list_schedule(grid, passes, ticks, policy=policy)
        except Stuck:  # this greedy order painted itself into a corner: another may not
            continue
        candidates.append(schedule_of(new_passes, new_colls))
    # min keeps the first of equals: the grid's own order when no list schedule is faster
    return min(candidates, key=lambda s: makespan(replay(s, NCCL, clock)))


def _check_inputs(kind: ScheduleKind, p, m, chunks_per_rank, forward_only: bool) -> int:
    # one rank is a degenerate pipeline (no point-to-point traffic, 1-rank vocabulary collectives): the same
    # passes and code paths on a single device, which is what a one-GPU check can run
    if not isinstance(p, int) or p < 1:
        raise ScheduleError(f"num_ranks must be an integer >= 1 (got {p!r})")
    if not isinstance(m, int) or m < p:
        raise ScheduleError(
            f"num_microbatches ({m!r}) must be >= num_ranks ({p}): with fewer microbatches "
            f"than stages the pipeline never fills; raise the microbatch count or use fewer ranks"
        )
    if forward_only and not kind.forward_only:
        raise ScheduleError(f"schedule {kind.name!r} has no forward-only (evaluation) variant")
    if kind.chunks_per_rank is not None:
        if chunks_per_rank not in (None, kind.chunks_per_rank):
            flexible = [k for k, s in SCHEDULES.items() if s.chunks_per_rank is None]
            raise ScheduleError(
                f"{kind.name} holds exactly {kind.chunks_per_rank} chunk(s) per rank (got "
                f"chunks_per_rank={chunks_per_rank}); use kind={' or '.join(map(repr, flexible))} "
                f"for another count"
            )
        return kind.chunks_per_rank
    v = kind.default_chunks_per_rank if chunks_per_rank is None else chunks_per_rank
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"chunks_per_rank must be an integer >= 1 (got {v!r})")
    return v
