"""Place every pass and collective of a step on one global grid (the building-block method).

Transformer passes come from the block, each lasting its `durations` slots. For the VP methods one
S gap and one T gap of one slot each are inserted into every sub-period of the block (one
microbatch's worth of slots), at base times n*q (S) and n*q + ceil(q/2) (T): a pass starting at base
time x moves to x + (number of gap points <= x), the same map on every rank, so every dependency
keeps its order. On a rank whose pass straddles a gap point, that rank's gap slot comes right after
the pass. The block's backward passes were already delayed one sub-period per barrier (blocks.py), so
between the last chunk's F(k) and B(k) there is an S gap (and, for vocab-1, a T gap after it).

Placement rules (collectives get one global time, identical on every rank):
- C0(k) at the start of the first S gap after F(k, last) ends; S(k) in that gap on every rank; C1(k)
  when the last rank's S(k) ends.
- T(k) in the first T gap after C1(k); C2(k) (vocab-1) when the last rank's T(k) ends; the last
  chunk's B(k) starts after C1 (vocab-2) or C2 (vocab-1).
- IF(j) in the last S gap that ends, on every rank, before F(j, 0) starts; IF_REDUCE(j) beside that
  gap's C1 (piggybacked on the output layer's collective slot).
- IB_BCAST(j) at the first C1-type boundary after B(j, 0) ends; IB(j) in the T gap after it.
- any other vocabulary pass of `registry.VOCAB_ACTIONS` (a new one) in the gap slot of the pass it
  follows, after it, or else beside the built-in pass that follows the same collective (`_place_extra`).

A synchronous method (`Method.synchronous`, the interlaced pipeline) has no gaps: its block leaves the
same `blocks.SYNC_SLOTS` residues of every period free on every rank, and each such step at slots a, a+1
holds, on every rank: C0(k) at boundary a, S(k) in slot a, C1(k) at a+1, T(k) in slot a+1, C2(k) at a+2,
for the microbatch k whose last F ended by a (at most one: one F per period); IF(j) beside S and
IF_REDUCE(j) beside C1 in the last step before F(j, 0); IB_BCAST(j) beside C0 and IB(j) beside T in the
first step after B(j, 0) (`_place_sync`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import SYNC_SLOTS, Block
from .deps import vocab_actions
from .ir import CHUNK_PASSES, COLLECTIVES, Op, ScheduleError
from .registry import VOCAB_ACTIONS, Method

# Order of collectives sharing one boundary; any fixed order works since it is global.
COLLECTIVE_ORDER = {Op.C0: 0, Op.IF_REDUCE: 1, Op.C1: 2, Op.IB_BCAST: 3, Op.C2: 4}
# Order of passes sharing one gap slot on a rank: input passes first, they are cheap.
SLOT_ORDER = {Op.IF: 0, Op.S: 1, Op.IB: 0, Op.T: 1}
EXTRA_ORDER = 2
"""Slot order of a pass placed by `_place_extra`: after the pass whose slot it shares."""


def slot_order(op) -> int:
    """Where `op` goes among the passes of one gap slot (chunk passes never share one)."""
    return SLOT_ORDER.get(op, 0 if op in CHUNK_PASSES else EXTRA_ORDER)


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
    """Grid slot it starts in (gap slots may hold several passes, ordered by SLOT_ORDER)."""
    length: int = 1
    """Slots it lasts."""

    @property
    def end(self) -> int:
        return self.slot + self.length


@dataclass(frozen=True)
class TimedCollective:
    """A collective at a grid boundary (between slot t-1 and slot t), run by every rank."""

    op: Op
    """C0, C1, C2, IF_REDUCE or IB_BCAST."""
    mb: int
    """Microbatch."""
    time: int
    """Boundary: each rank issues it after its passes that end by `time`, before those ending later
    (a pass under way at `time` runs after the issue: the collective does not wait for it)."""
    root: int
    """Root rank, or -1 for all-reduces."""


def place(block: Block, num_ranks: int, num_mb: int, method: Method, forward_only: bool):
    """All passes and collectives of the step on the grid: (list[TimedPass], list[TimedCollective])."""
    ops = (Op.F,) if forward_only else (Op.F, Op.B, Op.W)
    base: dict = {}  # (op, mb, chunk) -> base start
    for mb in range(num_mb):
        u = mb % block.group
        for op, bu, c in block.offsets:
            if bu == u and op in ops:
                base[(op, mb, c)] = block.time(op, mb, c)
    if not method.vocab_parallel:
        return [
            TimedPass(block.chunk_rank[c], op, mb, c, t, block.durations[op]) for (op, mb, c), t in base.items()
        ], []
    if method.synchronous:
        return _place_sync(block, num_ranks, num_mb, method, forward_only, base)
    return _place_vocab(block, num_ranks, num_mb, method, forward_only, base)


def _place_vocab(block: Block, p: int, num_mb: int, method: Method, forward_only: bool, base: dict):
    q = block.sub_period
    half = (q + 1) // 2
    dur = block.durations
    last = len(block.chunk_rank) - 1
    first_owner, last_owner = block.chunk_rank[0], block.chunk_rank[last]

    def gaps_upto(x: int) -> int:  # gap points (S at n*q, T at n*q + half) at or before base time x
        return (x // q + 1) + ((x - half) // q + 1 if x >= half else 0)

    def stretch(x: int) -> int:
        return x + gaps_upto(x)

    # a pass that straddles a gap point pushes that rank's gap slot to its own end
    straddle: dict = {}
    for (op, mb, c), x in base.items():
        for y in range(x + 1, x + dur[op]):
            if y % q in (0, half):
                straddle[(block.chunk_rank[c], y)] = stretch(x) + dur[op]

    def slot(r: int, gap: int) -> int:
        return max(stretch(gap) - 1, straddle.get((r, gap), -1))

    def last_end(gap: int) -> int:  # when the slowest rank's pass in this gap ends
        return max(slot(r, gap) for r in range(p)) + 1

    def first_t_gap_from(t: int) -> int:  # first T gap whose slot starts at or after t on every rank
        g = max(0, (t - 2) // (q + 2) - 1) * q + half
        while min(slot(r, g) for r in range(p)) < t:
            g += q
        return g

    passes = [TimedPass(block.chunk_rank[c], op, mb, c, stretch(x), dur[op]) for (op, mb, c), x in base.items()]
    colls: list[TimedCollective] = []
    for mb in range(num_mb):
        f_end = base[(Op.F, mb, last)] + dur[Op.F]
        s_gap = -(-f_end // q) * q
        colls.append(TimedCollective(Op.C0, mb, stretch(s_gap) - 1, last_owner))
        passes += [TimedPass(r, Op.S, mb, 0, slot(r, s_gap)) for r in range(p)]
        c1 = last_end(s_gap)
        colls.append(TimedCollective(Op.C1, mb, c1, -1))
        if not forward_only:
            t_gap = first_t_gap_from(c1)
            passes += [TimedPass(r, Op.T, mb, 0, slot(r, t_gap)) for r in range(p)]
            barrier = c1
            if method.grad_barrier is Op.C2:
                barrier = last_end(t_gap)
                colls.append(TimedCollective(Op.C2, mb, barrier, -1))
            b_last = stretch(base[(Op.B, mb, last)])
            if b_last < barrier:
                raise ScheduleError(
                    f"internal: B(mb={mb}, chunk={last}) at {b_last} before its barrier at "
                    f"{barrier}; the block's backward shift is too small"
                )
        # IF(j): the latest S gap whose slowest slot ends before F(j, 0) starts
        f0 = base[(Op.F, mb, 0)]
        in_gap = (f0 // q) * q
        while last_end(in_gap) > stretch(f0):
            in_gap -= q
        if in_gap < 0:
            raise ScheduleError(f"internal: no S gap before F(mb={mb}, chunk=0)")
        passes += [TimedPass(r, Op.IF, mb, 0, slot(r, in_gap)) for r in range(p)]
        colls.append(TimedCollective(Op.IF_REDUCE, mb, last_end(in_gap), first_owner))
        if not forward_only:
            b0 = base[(Op.B, mb, 0)]
            b_end = stretch(b0) + dur[Op.B]
            g = (b0 // q) * q
            while last_end(g) < b_end:
                g += q
            bcast = last_end(g)
            colls.append(TimedCollective(Op.IB_BCAST, mb, bcast, first_owner))
            t_gap = first_t_gap_from(bcast)
            passes += [TimedPass(r, Op.IB, mb, 0, slot(r, t_gap)) for r in range(p)]
    return passes + _place_extra(passes, method, forward_only), colls


def _place_sync(block: Block, p: int, num_mb: int, method: Method, forward_only: bool, base: dict):
    """Every rank's vocabulary passes in the synchronous steps of `block` (module docstring)."""
    if block.sync is None:
        raise ScheduleError(f"internal: method {method.name} needs a block with a synchronous step")
    per, sync = block.period, block.sync
    dur = block.durations
    last = len(block.chunk_rank) - 1
    first_owner, last_owner = block.chunk_rank[0], block.chunk_rank[last]

    def step_from(t: int) -> int:  # the first step starting at or after t
        return t + (sync - t) % per

    def step_before(t: int) -> int:  # the last step ending at or before t
        return step_from(t - SYNC_SLOTS - per + 1)

    passes = [TimedPass(block.chunk_rank[c], op, mb, c, x, dur[op]) for (op, mb, c), x in base.items()]
    colls: list[TimedCollective] = []
    for mb in range(num_mb):
        a = step_from(base[(Op.F, mb, last)] + dur[Op.F])
        colls += [TimedCollective(Op.C0, mb, a, last_owner), TimedCollective(Op.C1, mb, a + 1, -1)]
        passes += [TimedPass(r, Op.S, mb, 0, a) for r in range(p)]
        if not forward_only:
            passes += [TimedPass(r, Op.T, mb, 0, a + 1) for r in range(p)]
            barrier = a + 1
            if method.grad_barrier is Op.C2:
                barrier = a + 2
                colls.append(TimedCollective(Op.C2, mb, barrier, -1))
            if base[(Op.B, mb, last)] < barrier:
                raise ScheduleError(f"internal: B(mb={mb}, chunk={last}) before its synchronous step")
        a = step_before(base[(Op.F, mb, 0)])
        if a < 0:
            raise ScheduleError(f"internal: no synchronous step before F(mb={mb}, chunk=0)")
        passes += [TimedPass(r, Op.IF, mb, 0, a) for r in range(p)]
        colls.append(TimedCollective(Op.IF_REDUCE, mb, a + 1, first_owner))
        if not forward_only:
            a = step_from(base[(Op.B, mb, 0)] + dur[Op.B])
            colls.append(TimedCollective(Op.IB_BCAST, mb, a, first_owner))
            passes += [TimedPass(r, Op.IB, mb, 0, a + 1) for r in range(p)]
    return passes + _place_extra(passes, method, forward_only), colls


def _place_extra(passes: list[TimedPass], method: Method, forward_only: bool) -> list[TimedPass]:
    """Every rank's registered vocabulary passes other than S, T, IF and IB, in the gap slot of the pass
    each follows (after it), or else of the built-in pass that follows the same collective."""
    ops = vocab_actions(method, forward_only)
    extra = [op for op in ops if op not in COLLECTIVES and op not in SLOT_ORDER]
    if not extra:
        return []
    slot_of = {(tp.rank, tp.op, tp.mb): tp.slot for tp in passes if tp.op in SLOT_ORDER}
    out = []
    for op in extra:
        follows = VOCAB_ACTIONS[op].follows
        anchor = follows if follows in SLOT_ORDER else None
        if anchor is None:
            anchor = next(
                (a.op for a in VOCAB_ACTIONS.values() if a.follows == follows and a.op in SLOT_ORDER and a.op in ops),
                None,
            )
        if anchor is None:
            raise ScheduleError(
                f"{op} follows {follows}: the unit grid places a new pass only after S, T, IF or IB, or after "
                "a collective one of them follows (add its placement to schedule/timing.py)"
            )
        out += [TimedPass(r, op, mb, 0, t) for (r, a, mb), t in slot_of.items() if a is anchor]
    return out
