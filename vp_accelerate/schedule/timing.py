"""Place every pass and collective of a step on one global grid (the building-block method).

Transformer passes come from the block. For the VP methods every sub-period of the block (one
microbatch's worth of slots) is stretched by two slots that hold the vocabulary passes on all ranks
at the same time:

    [S slot][first half of the sub-period][T slot][second half]

and the block's backward passes were already delayed one sub-period per barrier (blocks.py), so
between the last chunk's F(k) and B(k) there is always an S slot (and, for vocab-1, a T slot after
it). Placement rules, with collectives at slot boundaries, identical on every rank:
- C0(k) at the start of the first S slot after F(k, last) ends; S(k) in that slot; C1(k) at its end.
- T(k) in the next T slot; C2(k) (vocab-1) at that T slot's end; B(k, last) after C1 / C2.
- IF(j) in the S slot just before F(j, 0); IF_REDUCE(j) at that slot's end, beside C1.
- IB_BCAST(j) at the first S-slot end (the C1 boundary) after B(j, 0) ends; IB(j) in the next T slot.
Because every collective has one global time, all ranks issue them in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import Block
from .ir import Op, ScheduleError

# Order of collectives sharing one boundary; any fixed order works since it is global.
COLLECTIVE_ORDER = {Op.C0: 0, Op.IF_REDUCE: 1, Op.C1: 2, Op.IB_BCAST: 3, Op.C2: 4}
# Order of passes sharing one gap slot on a rank: input passes first, they are cheap.
SLOT_ORDER = {Op.IF: 0, Op.S: 1, Op.IB: 0, Op.T: 1}


@dataclass(frozen=True)
class TimedPass:
    """A compute pass at a grid slot."""

    rank: int
    """Rank running it."""
    op: Op
    """F, B, W, S, T, IF or IB."""
    mb: int
    """Microbatch."""
    chunk: int
    """Chunk (0 for vocabulary passes)."""
    slot: int
    """Grid slot it starts in (lasts one slot; gap slots may hold several, ordered by SLOT_ORDER)."""


@dataclass(frozen=True)
class TimedCollective:
    """A collective at a grid boundary (between slot t-1 and slot t), run by every rank."""

    op: Op
    """C0, C1, C2, IF_REDUCE or IB_BCAST."""
    mb: int
    """Microbatch."""
    time: int
    """Boundary: after every pass that started before `time`, before every pass starting at it."""
    root: int
    """Root rank, or -1 for all-reduces."""


def place(block: Block, num_ranks: int, num_mb: int, method: str, forward_only: bool):
    """All passes and collectives of the step on the grid: (list[TimedPass], list[TimedCollective])."""
    vocab = method in ("vocab-1", "vocab-2")
    q = block.sub_period
    half = (q + 1) // 2       # T slot sits before this residue of the sub-period
    span = q + 2 if vocab else q

    def stretch(t: int) -> int:
        if not vocab:
            return t
        n, rho = divmod(t, q)
        return n * span + 1 + rho + (1 if rho >= half else 0)

    def s_slot_at_or_after(t: int) -> int:
        return -(-t // span) * span

    def t_slot_at_or_after(t: int) -> int:
        return -(-(t - half - 1) // span) * span + half + 1

    ops = (Op.F,) if forward_only else (Op.F, Op.B, Op.W)
    passes: list[TimedPass] = []
    start: dict = {}
    for mb in range(num_mb):
        u = mb % block.group
        for (op, bu, c), _ in block.offsets.items():
            if bu != u or op not in ops:
                continue
            t = stretch(block.time(op, mb, c))
            start[(op, mb, c)] = t
            passes.append(TimedPass(block.chunk_rank[c], op, mb, c, t))
    colls: list[TimedCollective] = []
    if not vocab:
        return passes, colls

    last = len(block.chunk_rank) - 1
    first_owner, last_owner = block.chunk_rank[0], block.chunk_rank[last]
    barrier_end = {}
    for mb in range(num_mb):
        s = s_slot_at_or_after(start[(Op.F, mb, last)] + 1)
        colls.append(TimedCollective(Op.C0, mb, s, last_owner))
        colls.append(TimedCollective(Op.C1, mb, s + 1, -1))
        passes += [TimedPass(r, Op.S, mb, 0, s) for r in range(num_ranks)]
        barrier_end[mb] = s + 1
        if not forward_only:
            t = t_slot_at_or_after(s + 1)
            passes += [TimedPass(r, Op.T, mb, 0, t) for r in range(num_ranks)]
            if method == "vocab-1":
                colls.append(TimedCollective(Op.C2, mb, t + 1, -1))
                barrier_end[mb] = t + 1
            if start[(Op.B, mb, last)] < barrier_end[mb]:
                raise ScheduleError(f"internal: B(mb={mb}, chunk={last}) at slot {start[(Op.B, mb, last)]} "
                                    f"before its barrier at {barrier_end[mb]}; the block shift is too small")
        # IF(j): the S slot holding F(j, 0)'s sub-period starts right before F(j, 0).
        base = block.time(Op.F, mb, 0)
        s_in = (base // q) * span
        passes += [TimedPass(r, Op.IF, mb, 0, s_in) for r in range(num_ranks)]
        colls.append(TimedCollective(Op.IF_REDUCE, mb, s_in + 1, first_owner))
        if not forward_only:
            b_end = start[(Op.B, mb, 0)] + 1
            bcast = s_slot_at_or_after(b_end - 1) + 1  # first S-slot end >= b_end
            colls.append(TimedCollective(Op.IB_BCAST, mb, bcast, first_owner))
            t = t_slot_at_or_after(bcast)
            passes += [TimedPass(r, Op.IB, mb, 0, t) for r in range(num_ranks)]
    return passes, colls
