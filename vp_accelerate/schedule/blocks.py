"""Repeating building blocks of the pipeline schedules, on a unit-time grid.

A block says when each transformer pass (F, B, W of a chunk) of microbatch u of the first repetition
starts, in slots; a pass lasts `durations[op]` slots, in proportion to its real cost (1F1B's full
backward is two forwards). Repetition g (microbatches g*group .. g*group +
group-1) is the same block shifted by g*period. Within a rank every pass of the block has a distinct
start modulo `period`, so the repeated block never puts two passes of one rank in one slot, and every
dependency starts at least one slot after what it depends on ended. The grid only fixes the ORDER of
each rank's work; the simulator times that order with real costs.

`backward_shift` delays every B/W by that many slots: VP delays them one sub-period (the time the
block needs per microbatch) per collective barrier, to make room for S (and T) between the last
chunk's F and B. Every block below keeps distinct residues under such a shift.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Op, ScheduleError


@dataclass(frozen=True)
class Block:
    """One repetition of a schedule on the unit grid."""

    group: int
    """Microbatches per repetition (1 for 1F1B and V-Half, p for interleaved 1F1B)."""
    period: int
    """Slots per repetition on every rank."""
    chunk_rank: tuple[int, ...]
    """Owner rank of each chunk, model order."""
    split_backward: bool
    """Whether W is a pass of its own."""
    offsets: dict
    """(op, u, chunk) -> start slot of that pass of microbatch u (0 <= u < group) in repetition 0."""
    durations: dict
    """op -> slots one pass lasts: proportional to its real cost, so the grid order matches execution."""
    sync: int | None = None
    """The residue (modulo `period`) where each period's synchronous vocabulary step begins: `SYNC_SLOTS`
    slots no pass of any rank occupies (the synchronous methods' blocks); None for the others."""

    @property
    def sub_period(self) -> int:
        """Slots per microbatch: the shift that delays B by 'one microbatch' in the steady state."""
        return self.period // self.group

    def time(self, op: Op, mb: int, chunk: int) -> int:
        g, u = divmod(mb, self.group)
        return self.offsets[(op, u, chunk)] + g * self.period


def one_f_one_b(p: int, backward_shift: int) -> Block:
    """1F1B: F one slot, B (input + weight gradients) two; F of stage r at r, B at 3p-2-2r; period 3."""
    offsets = {}
    for r in range(p):
        offsets[(Op.F, 0, r)] = r
        offsets[(Op.B, 0, r)] = 3 * p - 2 - 2 * r + backward_shift
    return _checked(Block(1, 3, tuple(range(p)), False, offsets, {Op.F: 1, Op.B: 2}))


def v_half(p: int, backward_shift: int) -> Block:
    """V-Half (Pipeline Parallelism with Controllable Memory): 2p chunks, rank i holds chunks i and
    2p-1-i, six slots per microbatch (F, B, W of two chunks). Offsets from the paper (docs/design.md §6):
    F0 at 2i, F1 at 3p-i-2, B1 at 3p+d+2i-1, B0 at 6p+d-i-2 with d = 3 (p even) / 0 (p odd) plus the
    VP shift; W of each chunk takes the first free residue after its B."""
    d = (3 if p % 2 == 0 else 0) + backward_shift
    chunk_rank = tuple(list(range(p)) + list(reversed(range(p))))
    offsets = {}
    for i in range(p):
        c0, c1 = i, 2 * p - 1 - i
        offsets[(Op.F, 0, c0)] = 2 * i
        offsets[(Op.F, 0, c1)] = 3 * p - i - 2
        offsets[(Op.B, 0, c1)] = 3 * p + d + 2 * i - 1
        offsets[(Op.B, 0, c0)] = 6 * p + d - i - 2
        used = {offsets[(op, 0, c)] % 6 for op in (Op.F, Op.B) for c in (c0, c1)}
        for c in (c1, c0):  # B1 comes before B0, so W1 picks first
            t = offsets[(Op.B, 0, c)] + 1
            while t % 6 in used:
                t += 1
            offsets[(Op.W, 0, c)] = t
            used.add(t % 6)
    return _checked(Block(1, 6, chunk_rank, True, offsets, {Op.F: 1, Op.B: 1, Op.W: 1}))


def interleaved(p: int, v: int, backward_shift: int) -> Block:
    """Interleaved 1F1B (Megatron): v chunks per rank round-robin (chunk c on rank c % p), microbatches
    in groups of p. F of (u, c) at 2(c+u) (even slots), B at 2(vp-1+u)+1+2(vp-1-c) (odd slots); rank r
    then has vp + p - 1 - 2r chunk activations in flight, Megatron's warm-up count."""
    n = v * p
    offsets = {}
    for u in range(p):
        for c in range(n):
            offsets[(Op.F, u, c)] = 2 * (c + u)
            offsets[(Op.B, u, c)] = 2 * (n - 1 + u) + 1 + 2 * (n - 1 - c) + backward_shift
    return _checked(Block(p, 2 * n, tuple(c % p for c in range(n)), False, offsets, {Op.F: 1, Op.B: 1}))


SYNC_SLOTS = 2
"""Slots of a synchronous vocabulary step: S (and IF) in the first, T (and IB) in the second, the output
layer's statistics all-reduced (C1) between them."""


def one_f_one_b_synchronous(p: int) -> Block:
    """1F1B around a synchronous vocabulary step (the interlaced pipeline): period 5, F one slot, B two,
    residues 3-4 of every period left free on every rank for the step all ranks run together. A rank's F
    and B then take residues 0 and 1-2 ("A") or 2 and 0-1 ("B"); F(0) of rank r starts at the first
    residue of its pattern after rank r-1's F ends, which alternates the patterns (A, B, A, ...: half a
    period per stage), and B(0) of rank r at the first after rank r+1's B, and for the last rank after
    the step that follows its F. The gradient then moves one stage per period (a B of one pattern ends
    where the other's would start), so rank 0 holds about 1.5p microbatches where 1F1B holds p: the
    interlaced pipeline's memory. Everything starts one period late so that microbatch 0's input
    embedding (IF) has a step before its first F."""
    period = 3 + SYNC_SLOTS
    pattern = {"A": (0, 1), "B": (2, 0)}  # (F residue, B residue)

    def at_or_after(t: int, residue: int) -> int:
        return t + (residue - t) % period

    kinds, f = [], []
    for r in range(p):
        if r == 0:
            kinds.append("A")
            f.append(period)
            continue
        best = min(("A", "B"), key=lambda k: at_or_after(f[-1] + 1, pattern[k][0]))
        kinds.append(best)
        f.append(at_or_after(f[-1] + 1, pattern[best][0]))
    b = [0] * p
    step = at_or_after(f[-1] + 1, 3)  # the synchronous step of the last rank's F
    b[p - 1] = at_or_after(step + SYNC_SLOTS, pattern[kinds[-1]][1])
    for r in range(p - 2, -1, -1):
        b[r] = at_or_after(b[r + 1] + 2, pattern[kinds[r]][1])
    offsets = {}
    for r in range(p):
        offsets[(Op.F, 0, r)] = f[r]
        offsets[(Op.B, 0, r)] = b[r]
    return _checked(Block(1, period, tuple(range(p)), False, offsets, {Op.F: 1, Op.B: 2}, sync=3))


def _checked(block: Block) -> Block:
    """Internal invariant: a rank never holds two passes in one slot modulo the period."""
    seen: dict = {}
    for (op, u, c), t in block.offsets.items():
        for k in range(block.durations[op]):
            key = (block.chunk_rank[c], (t + k) % block.period)
            if key in seen:
                raise ScheduleError(
                    f"internal: block passes {seen[key]} and {(op, u, c)} collide on rank {key[0]} at residue {key[1]}"
                )
            seen[key] = (op, u, c)
    if block.sync is not None:
        taken = sorted({res for (_, res) in seen if (res - block.sync) % block.period < SYNC_SLOTS})
        if taken:
            raise ScheduleError(f"internal: a pass takes residue {taken[0]} of the synchronous step")
    return block
