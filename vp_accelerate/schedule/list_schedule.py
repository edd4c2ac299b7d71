"""Cost-aware schedule construction: greedy list scheduling of every pass with real pass costs.

The unit-grid block (blocks.py, timing.py) fixes each rank's order assuming every pass lasts its
grid slots. With real costs — a split backward's B ≈ 1.2 F and W ≈ 0.9 F, the vocabulary passes S/T
on every rank, the output layer on one stage for the baseline — that fixed order leaves gaps that
compound along the pipeline (docs/design.md §6). This module keeps the block's order only as a
priority and lets the costs decide the rest, as the zero-bubble V schedules are built from profiled
pass times under a memory limit:

- time runs forward in integer ticks; whenever a rank is free it runs the ready pass of best priority
  (its grid slot in the block's placement), except that it never starts a pass that would delay a
  better one whose inputs are known to arrive before that pass would end (it then runs a shorter
  one, or waits);
- weight-gradient passes (W) come last in priority: they have no consumer, so they fill the gaps the
  dependencies leave, and run earlier only when the activation limit nears;
- which passes go first besides is a `Policy`: the grid order alone, or S first (every rank's S(k) gates
  C1(k), hence the last chunk's B(k): with a large vocabulary S is the longest pass), or W behind
  every pass but the forwards even near the limit; the builder tries each and keeps the fastest;
- a forward may start only while the rank's activations in flight (from F to the pass that frees
  them: W when the backward is split, else B) stay within the block's own peak, per chunk and in all:
  the schedule keeps the block's activation memory (V-Half: about half of 1F1B's, plus one
  microbatch per VP barrier);
- communication is modelled as the runtime runs it: a transfer lands `p2p` ticks after its producer
  ends; a vocabulary collective is issued when the last pass it needs ends (C0 after the last chunk's
  F, C1 after every rank's S, C2 after every T, IF_REDUCE after every IF, IB_BCAST after B of chunk
  0), collectives run one after the other in that order on a communication resource of their own,
  and the pass that reads one waits for it.

The result is timed passes and timed collectives, which `lower()` turns into action lists like any
block placement; every time is consistent (a pass starts after what it depends on has ended), so the
lowered lists keep the properties the validator checks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .ir import Op, ScheduleError
from .timing import COLLECTIVE_ORDER, TimedCollective, TimedPass

TICKS = 1_000_000
"""Ticks the longest pass lasts: pass costs are rounded to integer ticks (every pass lasts >= 1)."""
IF_AHEAD = 4
"""IF(j) may run once F(j - IF_AHEAD) of chunk 0 has started: the input layer's partial embeddings are
computed a few microbatches ahead of their first forward (every rank's IF(j) and the reduce must be
done by then, and a rank may be in the middle of a long pass), not all at the start."""
W_MARGIN = 2
"""W passes wait behind every other ready pass while the rank holds at least this many activations
below its limit; closer to the limit they take their grid turn (or, with `Policy.w_behind_backward`,
go before the forwards only), so that a forward never has to wait for the W that frees its room."""


@dataclass(frozen=True)
class Policy:
    """Which ready passes a free rank prefers, beyond the grid order (module docstring)."""

    s_first: bool = False
    """Every ready S goes first."""
    w_behind_backward: bool = False
    """Near the activation limit, W goes before the forwards but behind every other pass."""


POLICIES = (Policy(), Policy(s_first=True), Policy(w_behind_backward=True))
"""What the builder tries, in this order (the first of equally fast ones wins)."""
_FREE_AFTER = {True: Op.W, False: Op.B}


class Stuck(ScheduleError):
    """The greedy order left every rank waiting for a forward its activation limit forbids."""


@dataclass(frozen=True)
class TickCosts:
    """Pass and communication durations in integer ticks."""

    passes: dict
    """(rank, op, chunk) -> ticks (chunk 0 for the vocabulary passes)."""
    p2p: int
    """Ticks from a producer's end to its data's arrival on the next rank."""
    collectives: dict
    """Collective op -> ticks of its whole chain."""
    tick_s: float
    """Seconds per tick."""


def tick_costs(costs, chunk_rank: tuple[int, ...], ops, collective_ops) -> TickCosts:
    """Quantise `costs` (anything with pass_time(rank, op, chunk), p2p_time() and collective_time(op),
    as cost.CostModel and cost.MeasuredCosts) to ticks."""
    p = max(chunk_rank) + 1
    seconds = {}
    for c, r in enumerate(chunk_rank):
        for op in ops & {Op.F, Op.B, Op.W}:
            seconds[(r, op, c)] = float(costs.pass_time(r, op, c))
    for r in range(p):
        for op in ops - {Op.F, Op.B, Op.W}:
            seconds[(r, op, 0)] = float(costs.pass_time(r, op, 0))
    longest = max(seconds.values())
    if not longest > 0:
        raise ValueError("pass costs must be positive to build a cost-aware schedule")
    tick = longest / TICKS
    colls = {op: max(0, round(float(costs.collective_time(op)) / tick)) for op in collective_ops}
    return TickCosts(
        {k: max(1, round(v / tick)) for k, v in seconds.items()},
        max(0, round(float(costs.p2p_time()) / tick)),
        colls,
        tick,
    )


@dataclass
class _Pass:
    rank: int
    op: Op
    mb: int
    chunk: int
    dur: int
    prio: tuple
    waiting: int = 0  # inputs not yet known
    ready: int = 0  # earliest start once every input is known
    start: int | None = None


class _Limits:
    """Activation memory of one rank: (mb, chunk) activations in flight, per chunk and in all, at most
    the block's peaks (per chunk: if one chunk could fill the rank's limit, another chunk's forward, on
    which the rank's backwards wait, might never run)."""

    def __init__(self, per_chunk: dict, total: int):
        self.per_chunk = dict(per_chunk)
        self.total = total
        self.held = {c: 0 for c in per_chunk}
        self.all = 0

    def allows(self, chunk: int) -> bool:
        return self.held[chunk] < self.per_chunk[chunk] and self.all < self.total

    def pressure(self, margin: int) -> bool:
        return self.all + margin >= self.total

    def take(self, chunk: int, n: int) -> None:
        self.held[chunk] += n
        self.all += n


def block_memory(passes: list[TimedPass], split_backward: bool, num_ranks: int):
    """Per rank, ({chunk: peak (mb, chunk) activations in flight}, peak in all) of a placement: what the
    cost-aware schedule must not exceed."""
    free_op = _FREE_AFTER[split_backward]
    events: list[list] = [[] for _ in range(num_ranks)]
    for tp in passes:
        if tp.op is Op.F:
            events[tp.rank].append((tp.slot, 1, tp.chunk, 1))
        elif tp.op is free_op:
            events[tp.rank].append((tp.end, 0, tp.chunk, -1))
    out = []
    for r in range(num_ranks):
        held: dict = {}
        peak: dict = {}
        cur = top = 0
        for _, _, c, n in sorted(events[r]):
            held[c] = held.get(c, 0) + n
            peak[c] = max(peak.get(c, 0), held[c])
            cur += n
            top = max(top, cur)
        out.append((peak, top))
    return out


def list_schedule(
    grid: list[TimedPass],
    grid_colls: list[TimedCollective],
    chunk_rank: tuple[int, ...],
    num_ranks: int,
    method,
    split_backward: bool,
    forward_only: bool,
    costs: TickCosts,
    policy: Policy = Policy(),
):
    """The passes of the block placement `grid` rescheduled with `costs`: (timed passes, timed
    collectives, makespan in ticks). `grid`'s slots are the priorities, its memory peaks the limits.
    `policy` refines the priorities."""
    p = num_ranks
    last = len(chunk_rank) - 1
    vocab = method.vocab_parallel
    barrier = method.grad_barrier
    free_op = _FREE_AFTER[split_backward]

    def prio(tp: TimedPass) -> tuple:
        return (tp.slot, tp.end, tp.mb, tp.chunk)

    passes: dict = {}
    for tp in grid:
        passes[(tp.rank, tp.op, tp.mb, tp.chunk)] = _Pass(
            tp.rank, tp.op, tp.mb, tp.chunk, costs.passes[(tp.rank, tp.op, tp.chunk)], prio(tp)
        )
    num_mb = 1 + max(tp.mb for tp in grid)
    limits = None
    if not forward_only:
        limits = [_Limits(*m) for m in block_memory(grid, split_backward, p)]

    # what each pass waits for: its inputs (passes whose end it needs) and collectives
    consumers: dict = {}  # producer key -> [(consumer key, latency)]
    coll_readers: dict = {}  # (collective op, mb) -> [consumer key]

    def needs(key, producer, latency: int = 0):
        passes[key].waiting += 1
        consumers.setdefault(producer, []).append((key, latency))

    def reads(key, coll):
        passes[key].waiting += 1
        coll_readers.setdefault(coll, []).append(key)

    for key, ps in passes.items():
        r, op, mb, c = key
        if op is Op.F:
            if c > 0:
                src = chunk_rank[c - 1]
                needs(key, (src, Op.F, mb, c - 1), costs.p2p if src != r else 0)
            elif vocab:
                reads(key, (Op.IF_REDUCE, mb))
        elif op is Op.B:
            needs(key, (r, Op.F, mb, c))
            if c < last:
                src = chunk_rank[c + 1]
                needs(key, (src, Op.B, mb, c + 1), costs.p2p if src != r else 0)
            elif barrier is not None:
                reads(key, (barrier, mb))
        elif op is Op.W:
            needs(key, (r, Op.B, mb, c))
        elif op is Op.S:
            reads(key, (Op.C0, mb))
        elif op is Op.T:
            reads(key, (Op.C1, mb))
        elif op is Op.IB:
            reads(key, (Op.IB_BCAST, mb))
        elif op is Op.IF and mb >= IF_AHEAD:
            needs(key, (chunk_rank[0], Op.F, mb - IF_AHEAD, 0), None)  # released at that F's start

    # collective triggers: the passes each one is issued after
    triggers: dict = {}  # (op, mb) -> passes still to end
    trigger_of: dict = {}  # producer key -> [(op, mb)]
    roots = {Op.C0: chunk_rank[last], Op.IF_REDUCE: chunk_rank[0], Op.IB_BCAST: chunk_rank[0], Op.C1: -1, Op.C2: -1}
    if vocab:
        for mb in range(num_mb):
            plan = {
                Op.C0: [(chunk_rank[last], Op.F, mb, last)],
                Op.C1: [(r, Op.S, mb, 0) for r in range(p)],
                Op.IF_REDUCE: [(r, Op.IF, mb, 0) for r in range(p)],
            }
            if not forward_only:
                plan[Op.IB_BCAST] = [(chunk_rank[0], Op.B, mb, 0)]
                if barrier is Op.C2:
                    plan[Op.C2] = [(r, Op.T, mb, 0) for r in range(p)]
            for op, prods in plan.items():
                triggers[(op, mb)] = [len(prods), 0]
                for k in prods:
                    trigger_of.setdefault(k, []).append((op, mb))

    ready_heap: list = [[] for _ in range(p)]  # per rank: (prio, key) of passes whose inputs are known
    free = [0] * p
    for key, ps in passes.items():
        if ps.waiting == 0:
            heapq.heappush(ready_heap[ps.rank], (ps.prio, key))
    issued: list = []  # (trigger time, order, mb, op): collectives awaiting their start
    stream = 0
    colls: list[TimedCollective] = []
    out: list[TimedPass] = []

    def known(key, t: int) -> None:
        ps = passes[key]
        ps.ready = max(ps.ready, t)
        ps.waiting -= 1
        if ps.waiting == 0:
            heapq.heappush(ready_heap[ps.rank], (ps.prio, key))

    def start_collectives(upto: int) -> None:
        """Start, in issue order, every collective issued at or before `upto` (all earlier issues are
        known by then: a pass that starts at >= upto ends after it)."""
        nonlocal stream
        while issued and issued[0][0] <= upto:
            t, _, mb, op = heapq.heappop(issued)
            stream = max(stream, t) + costs.collectives[op]
            colls.append(TimedCollective(op, mb, t, roots[op]))
            for key in coll_readers.get((op, mb), ()):
                known(key, stream)

    def choose(r: int):
        """(start time, key) of rank r's next pass, or None while none of its passes can be known to start."""
        heap = ready_heap[r]
        if not heap:
            return None
        t0 = free[r]
        lim = limits[r] if limits is not None else None
        cands = [passes[k] for _, k in sorted(heap)]
        if lim is not None:
            cands = [ps for ps in cands if ps.op is not Op.F or lim.allows(ps.chunk)]
            if not lim.pressure(W_MARGIN):  # W has no consumer: it fills what the others leave
                cands = [ps for ps in cands if ps.op is not Op.W] + [ps for ps in cands if ps.op is Op.W]
            elif policy.w_behind_backward:
                cands = (
                    [ps for ps in cands if ps.op not in (Op.W, Op.F)]
                    + [ps for ps in cands if ps.op is Op.W]
                    + [ps for ps in cands if ps.op is Op.F]
                )
        if policy.s_first:
            cands = [ps for ps in cands if ps.op is Op.S] + [ps for ps in cands if ps.op is not Op.S]
        # IF is tiny, and F(j) of chunk 0 waits for every rank's IF(j) (through the reduce): never behind
        cands = [ps for ps in cands if ps.op is Op.IF] + [ps for ps in cands if ps.op is not Op.IF]
        if not cands:
            return None
        t = max(t0, min(ps.ready for ps in cands))
        best = cands[0]
        if best.ready <= t:
            return t, (best.rank, best.op, best.mb, best.chunk)
        for ps in cands:
            if ps.ready <= t and t + ps.dur <= best.ready:
                return t, (ps.rank, ps.op, ps.mb, ps.chunk)
        return best.ready, (best.rank, best.op, best.mb, best.chunk)

    decisions: list = []  # (time, rank, key): each rank's next planned start
    plan_of: dict = {}

    def replan(r: int) -> None:
        c = choose(r)
        plan_of[r] = c
        if c is not None:
            heapq.heappush(decisions, (c[0], r, c[1]))

    for r in range(p):
        replan(r)
    total = len(passes)
    done = 0
    while done < total:
        if not decisions:
            start_collectives(float("inf"))
            for r in range(p):
                replan(r)
            if not decisions:
                raise Stuck("no rank can start a pass under the activation limits")
            continue
        t, r, key = heapq.heappop(decisions)
        if plan_of.get(r) is None or plan_of[r][1] != key or plan_of[r][0] != t:
            continue  # stale
        if issued and issued[0][0] <= t:  # collectives issued by now change what is ready
            start_collectives(t)
            for x in range(p):
                replan(x)
            continue
        ps = passes[key]
        heap = ready_heap[r]
        heap.remove((ps.prio, key))
        heapq.heapify(heap)
        ps.start = t
        end = t + ps.dur
        free[r] = end
        done += 1
        out.append(TimedPass(r, ps.op, ps.mb, ps.chunk, t, ps.dur))
        touched = {r}
        if limits is not None:
            if ps.op is Op.F:
                limits[r].take(ps.chunk, 1)
            elif ps.op is free_op:
                limits[r].take(ps.chunk, -1)
        for ckey, latency in consumers.get(key, ()):
            known(ckey, t if latency is None else end + latency)
            touched.add(ckey[0])
        for coll in trigger_of.get(key, ()):
            trig = triggers[coll]
            trig[0] -= 1
            trig[1] = max(trig[1], end)
            if trig[0] == 0:
                op, mb = coll
                heapq.heappush(issued, (trig[1], COLLECTIVE_ORDER[op], mb, op))
        for x in touched:
            replan(x)
    start_collectives(float("inf"))
    makespan = max(max(tp.end for tp in out), stream)
    return out, colls, makespan
