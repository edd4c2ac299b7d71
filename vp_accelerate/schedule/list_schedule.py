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
- what a pass waits for and after which passes a collective is issued are deps.py's rules
  (`pass_inputs`, `collectives_read`, `triggers`), the ones the validator, the replay and the executor
  use;
- time is the replay driver's under `replay.BUFFERED` (sends that never wait) with the same clock
  (`replay.CostClock`) the builder then times the candidates with, in integer ticks: a transfer lands
  `p2p` after its producer ends, a collective is issued when the last pass it follows ends, the chains
  run one after the other in that order, and the pass that reads one waits for it. (The greedy needs
  the times while it builds the lists; replaying its output under `BUFFERED` gives the same times,
  tests/test_schedule_build.py checks it. Which candidate wins is decided by the replay under NCCL's
  rules.)

The result is timed passes and timed collectives, which `lower()` turns into action lists like any
block placement; every time is consistent (a pass starts after what it depends on has ended), so the
lowered lists keep the properties the validator checks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from . import deps
from .ir import COLLECTIVES, Action, Op, Schedule, ScheduleError
from .timing import COLLECTIVE_ORDER, TimedCollective, TimedPass

TICKS = 1_000_000
"""Ticks the longest pass lasts: pass costs are rounded to integer ticks (every pass lasts >= 1, so a
pass never ends when the one it follows does)."""
IF_AHEAD = 4
"""IF(j) may run once the pass that reads IF_REDUCE(j - IF_AHEAD) (chunk 0's F) has started: the input
layer's partial embeddings are computed a few microbatches ahead of their first forward (every rank's
IF(j) and the reduce must be done by then, and a rank may be in the middle of a long pass), not all at
the start."""
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


class Stuck(ScheduleError):
    """The greedy order left every rank waiting for a forward its activation limit forbids."""


class Ticks:
    """The replay's clock (`replay.CostClock`: pass, p2p and chain times in seconds) in integer ticks,
    for the passes of one placement."""

    def __init__(self, clock, passes: list[TimedPass]):
        seconds = {}
        for tp in passes:
            key = (tp.rank, tp.op, tp.chunk)
            if key not in seconds:
                seconds[key] = float(clock.pass_time(tp.rank, Action(tp.op, tp.mb, tp.chunk)))
        longest = max(seconds.values())
        if not longest > 0:
            raise ValueError("pass costs must be positive to build a cost-aware schedule")
        self.tick_s = longest / TICKS
        """Seconds per tick."""
        self.passes = {k: max(1, round(v / self.tick_s)) for k, v in seconds.items()}
        """(rank, op, chunk) -> ticks."""
        self.p2p = max(0, round(clock.p2p_time() / self.tick_s))
        """Ticks from a producer's end to its data's arrival on the next rank."""
        self._clock = clock
        self._chains: dict = {}

    def chain(self, op: Op) -> int:
        """Ticks of collective `op`'s whole chain."""
        if op not in self._chains:
            seconds = sum(t for _, t in self._clock.chain_steps(op))
            self._chains[op] = max(0, round(seconds / self.tick_s))
        return self._chains[op]


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
    take_op, free_op = deps.activation_passes(split_backward)
    events: list[list] = [[] for _ in range(num_ranks)]
    for tp in passes:
        if tp.op is take_op:
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


def list_schedule(layout: Schedule, grid: list[TimedPass], ticks: Ticks, policy: Policy = Policy()):
    """The passes of the block placement `grid` rescheduled with `ticks`: (timed passes, timed
    collectives, makespan in ticks). `layout` is the schedule whose ranks, chunks and method they are (its
    actions are not read); `grid`'s slots are the priorities, its memory peaks the limits; `policy`
    refines the priorities."""
    return _ListSchedule(layout, grid, ticks, policy).run()


class _ListSchedule:
    """The list scheduler's state; `run` is the event loop: each rank's next planned start (`decisions`)
    is taken in time order, replanned whenever what it waits for changes."""

    def __init__(self, layout: Schedule, grid: list[TimedPass], ticks: Ticks, policy: Policy):
        self.s, self.ticks, self.policy = layout, ticks, policy
        p = layout.num_ranks
        self.passes: dict = {
            (tp.rank, tp.op, tp.mb, tp.chunk): _Pass(
                tp.rank,
                tp.op,
                tp.mb,
                tp.chunk,
                ticks.passes[(tp.rank, tp.op, tp.chunk)],
                (tp.slot, tp.end, tp.mb, tp.chunk),
            )
            for tp in grid
        }
        self.take_op, self.free_op = deps.activation_passes(layout.split_backward)
        self.limits = (
            None if layout.forward_only else [_Limits(*m) for m in block_memory(grid, layout.split_backward, p)]
        )
        self.consumers: dict = {}  # producer key -> [(consumer key, latency; None: at the producer's start)]
        self.coll_readers: dict = {}  # (collective op, mb) -> [consumer key]
        self.pending_triggers: dict = {}  # (collective op, mb) -> [passes still to end, last end]
        self.trigger_of: dict = {}  # producer key -> [(collective op, mb)]
        self._link_inputs()
        self._link_triggers()
        self.ready_heap: list = [[] for _ in range(p)]  # per rank: (prio, key) of passes whose inputs are known
        for key, ps in self.passes.items():
            if ps.waiting == 0:
                heapq.heappush(self.ready_heap[ps.rank], (ps.prio, key))
        self.free = [0] * p  # each rank is busy until then
        self.issued: list = []  # heap of (issue time, order, mb, op): collectives not yet started
        self.chain_free = 0  # the previous collective chain ends then
        self.decisions: list = []  # heap of (time, rank, key): each rank's next planned start
        self.plan_of: dict = {}  # rank -> its current plan (time, key), or None
        self.out: list[TimedPass] = []
        self.colls: list[TimedCollective] = []

    # ---- the dependency graph, from deps.py ----------------------------------------------------------
    def _needs(self, key, producer, latency) -> None:
        self.passes[key].waiting += 1
        self.consumers.setdefault(producer, []).append((key, latency))

    def _link_inputs(self) -> None:
        """Each pass waits for the passes deps.py says it needs (a remote one's output `p2p` after its
        end) and the collectives it reads; IF(j) besides for the start of IF_REDUCE(j - IF_AHEAD)'s reader."""
        s = self.s
        for key, ps in self.passes.items():
            a = Action(ps.op, ps.mb, ps.chunk)
            for src in deps.pass_inputs(s, ps.rank, a):
                self._needs(key, src, self.ticks.p2p if src[0] != ps.rank else 0)
            for coll in deps.collectives_read(s, ps.rank, a):
                ps.waiting += 1
                self.coll_readers.setdefault(coll, []).append(key)
        for key, ps in self.passes.items():
            if ps.op is Op.IF and ps.mb >= IF_AHEAD:
                for reader in self.coll_readers.get((Op.IF_REDUCE, ps.mb - IF_AHEAD), ()):
                    self._needs(key, reader, None)  # released at that pass's start

    def _link_triggers(self) -> None:
        """Each collective is issued once the passes it follows (deps.triggers) have ended."""
        s = self.s
        for op in deps.vocab_actions(s.method, s.forward_only):
            if op not in COLLECTIVES:
                continue
            for mb in range(s.num_microbatches):
                producers = deps.triggers(s, op, mb)
                self.pending_triggers[(op, mb)] = [len(producers), 0]
                for k in producers:
                    self.trigger_of.setdefault(k, []).append((op, mb))

    # ---- the event loop ------------------------------------------------------------------------------
    def run(self):
        p = self.s.num_ranks
        for r in range(p):
            self._replan(r)
        total, done = len(self.passes), 0
        while done < total:
            if not self.decisions:
                self._start_collectives(float("inf"))
                for r in range(p):
                    self._replan(r)
                if not self.decisions:
                    raise Stuck("no rank can start a pass under the activation limits")
                continue
            t, r, key = heapq.heappop(self.decisions)
            if self.plan_of.get(r) != (t, key):
                continue  # stale
            if self.issued and self.issued[0][0] <= t:  # collectives issued by now change what is ready
                self._start_collectives(t)
                for x in range(p):
                    self._replan(x)
                continue
            self._run_pass(t, r, key)
            done += 1
        self._start_collectives(float("inf"))
        makespan = max(max(tp.end for tp in self.out), self.chain_free)
        return self.out, self.colls, makespan

    def _run_pass(self, t: int, r: int, key) -> None:
        """Start pass `key` on rank r at t; what waits for it learns when its input is there."""
        ps = self.passes[key]
        heap = self.ready_heap[r]
        heap.remove((ps.prio, key))
        heapq.heapify(heap)
        ps.start = t
        end = t + ps.dur
        self.free[r] = end
        self.out.append(TimedPass(r, ps.op, ps.mb, ps.chunk, t, ps.dur))
        if self.limits is not None:
            if ps.op is self.take_op:
                self.limits[r].take(ps.chunk, 1)
            elif ps.op is self.free_op:
                self.limits[r].take(ps.chunk, -1)
        touched = {r}
        for ckey, latency in self.consumers.get(key, ()):
            self._known(ckey, t if latency is None else end + latency)
            touched.add(ckey[0])
        for coll in self.trigger_of.get(key, ()):
            trig = self.pending_triggers[coll]
            trig[0] -= 1
            trig[1] = max(trig[1], end)
            if trig[0] == 0:
                op, mb = coll
                heapq.heappush(self.issued, (trig[1], COLLECTIVE_ORDER[op], mb, op))
        for x in touched:
            self._replan(x)

    def _known(self, key, t: int) -> None:
        """One more input of pass `key` is known to be there at t."""
        ps = self.passes[key]
        ps.ready = max(ps.ready, t)
        ps.waiting -= 1
        if ps.waiting == 0:
            heapq.heappush(self.ready_heap[ps.rank], (ps.prio, key))

    def _start_collectives(self, upto) -> None:
        """Start, in issue order, every collective issued at or before `upto` (all earlier issues are
        known by then: a pass that starts at >= upto ends after it)."""
        while self.issued and self.issued[0][0] <= upto:
            t, _, mb, op = heapq.heappop(self.issued)
            self.chain_free = max(self.chain_free, t) + self.ticks.chain(op)
            self.colls.append(TimedCollective(op, mb, t, deps.root(self.s, op)))
            for key in self.coll_readers.get((op, mb), ()):
                self._known(key, self.chain_free)

    def _replan(self, r: int) -> None:
        plan = self._choose(r)
        self.plan_of[r] = plan
        if plan is not None:
            heapq.heappush(self.decisions, (plan[0], r, plan[1]))

    def _candidates(self, r: int) -> list[_Pass]:
        """Rank r's ready passes, best first: the grid order, refined by the activation limit and the policy."""
        cands = [self.passes[k] for _, k in sorted(self.ready_heap[r])]
        lim = self.limits[r] if self.limits is not None else None
        if lim is not None:
            take = self.take_op  # a pass that takes room: only while the limit allows
            cands = [ps for ps in cands if ps.op is not take or lim.allows(ps.chunk)]
            if not lim.pressure(W_MARGIN):  # W has no consumer: it fills what the others leave
                cands = [ps for ps in cands if ps.op is not Op.W] + [ps for ps in cands if ps.op is Op.W]
            elif self.policy.w_behind_backward:
                cands = (
                    [ps for ps in cands if ps.op is not Op.W and ps.op is not take]
                    + [ps for ps in cands if ps.op is Op.W]
                    + [ps for ps in cands if ps.op is take]
                )
        if self.policy.s_first:
            cands = [ps for ps in cands if ps.op is Op.S] + [ps for ps in cands if ps.op is not Op.S]
        # IF is tiny, and F(j) of chunk 0 waits for every rank's IF(j) (through the reduce): never behind
        return [ps for ps in cands if ps.op is Op.IF] + [ps for ps in cands if ps.op is not Op.IF]

    def _choose(self, r: int):
        """(start time, key) of rank r's next pass, or None while none of its passes can be known to start.
        The best candidate, unless it must wait: then one that ends before the best can start, else the best."""
        if not self.ready_heap[r]:
            return None
        cands = self._candidates(r)
        if not cands:
            return None
        t = max(self.free[r], min(ps.ready for ps in cands))
        best = cands[0]
        if best.ready <= t:
            return t, (best.rank, best.op, best.mb, best.chunk)
        for ps in cands:
            if ps.ready <= t and t + ps.dur <= best.ready:
                return t, (ps.rank, ps.op, ps.mb, ps.chunk)
        return best.ready, (best.rank, best.op, best.mb, best.chunk)
