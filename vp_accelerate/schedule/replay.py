"""One replay driver for a schedule's action lists: communication rules and a clock plug in.

Every reader of a schedule that needs to know when things happen replays it here: the validator
(`streams.py`: NCCL's rules, no clock, "does it finish?") and the simulator (`sim/simulate.py`: the
simulator's rules, a cost clock, "when does each pass run?"). What a pass waits on comes from
`deps.consumed`, the function the executor's waits use too.

The model of one rank: a line runs the rank's actions in order. A compute pass starts when the line
reaches it and the communication it consumes is complete; it occupies the line for its cost. A
communication operation (`ir.p2p_batches`: a batch of adjacent p2p actions, or one collective) is
issued when the line reaches it (occupying the line for its issue cost, the host's time to post it)
and starts once its queue lets it (`Rules.queues`); the line does not wait for it (unless
`Rules.blocking_collectives`). Then:
- with `Rules.rendezvous` (NCCL, for every message larger than its internal buffers) a send and its
  receive complete `p2p_time` after both sides have started; without it a send completes when it
  starts (a buffered send) and its receive once started and `p2p_time` after the send; a batch
  completes when all its ops have;
- a collective chain starts once every rank has started it and the previous chain has finished (the
  vocabulary collectives run one at a time, in one global order), and runs its steps back to back;
- with `Rules.connected` set, a communicator not in it is created at its first operation (NCCL's lazy
  creation): a collective point of all its members that blocks the line until every member reaches it,
  and an error if the rank has already issued an operation of another communicator, which may still
  be running on the device (the host never waits for communication inside a step), since a creation
  while another communicator's kernels run can deadlock the GPU.

Times are a max-plus function of the costs, so the order in which the driver visits ranks does not
change them; with the null clock every cost is 0 and only the order matters. A replay that cannot
finish raises ScheduleError naming each rank's blocked operation and what it waits for.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Protocol

from .deps import consumed
from .ir import COLLECTIVES, P2P, Action, Op, Schedule, ScheduleError, p2p_batches

SENDS = (Op.SEND_ACT, Op.SEND_GRAD)


@dataclass(frozen=True)
class Rules:
    """How communication behaves in a replay."""

    name: str
    """What these rules model, for error messages."""
    rendezvous: bool
    """A send completes only once the peer's matching receive has started (NCCL); False: sends are
    buffered and complete when issued."""
    queues: str
    """Which operations of a rank start in issue order, each after the previous one completed:
    "none" (every operation starts when issued), "communicator" (one queue for the pipeline's p2p, one
    for the vocabulary collectives: one stream per communicator) or "rank" (one queue for all: every
    communicator serialised, CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    batches: bool
    """Adjacent p2p actions form one operation that completes as a whole (`ir.p2p_batches`, what the
    executor issues); False: every p2p action is an operation of its own."""
    blocking_collectives: bool = False
    """The line waits for every collective it issues (gloo without a communication worker)."""
    connected: frozenset | None = None
    """None: every communicator exists before the step (creation is not modelled). Otherwise the
    communicators ("pp": the pipeline's p2p batches; "vocab": the vocabulary collectives) connected
    before the step; any other one is created lazily at its first operation (module docstring). A p2p
    batch uses its group's communicator, as torch's batch_isend_irecv does (its first call on a group
    must involve every rank of the group)."""


BUFFERED = Rules("buffered sends (every operation independent)", rendezvous=False, queues="none", batches=False)
"""Sends never wait for the peer (what gloo does with messages it can buffer); a receive is posted where
it stands and waited for by its consumer; collectives start once every rank issued them, one at a time."""


class Clock(Protocol):
    """The costs a timed replay needs (seconds)."""

    def pass_time(self, rank: int, action: Action) -> float: ...

    def issue_time(self, op: Op) -> float: ...

    def p2p_time(self) -> float: ...

    def chain_steps(self, op: Op) -> list[tuple[str, float]]: ...


class NullClock:
    """Every cost is 0: a replay that only checks the order finishes."""

    def pass_time(self, rank: int, action: Action) -> float:
        return 0.0

    def issue_time(self, op: Op) -> float:
        return 0.0

    def p2p_time(self) -> float:
        return 0.0

    def chain_steps(self, op: Op) -> list[tuple[str, float]]:
        return [(op.value, 0.0)]


class CostClock:
    """Pass costs as the replay's clock: anything with `pass_time(rank, op, chunk)`, `p2p_time()` and
    `collective_time(op)` (a cost.CostModel, cost.MeasuredCosts), optionally `chain_steps(op)` (a chain
    step by step) and `issue_time(op)` (the host's time to post an operation)."""

    def __init__(self, costs):
        self.costs = costs
        self.passes: dict = {}  # (rank, op, chunk) -> seconds: the same pass costs the same for every microbatch
        self.chains: dict = {}  # collective op -> its chain's steps
        issue = getattr(costs, "issue_time", lambda op: 0.0)
        self.issue = {op: float(issue(op)) for op in Op}
        self.p2p = float(costs.p2p_time())

    def pass_time(self, rank: int, a: Action) -> float:
        key = (rank, a.op, a.chunk)
        if key not in self.passes:
            self.passes[key] = float(self.costs.pass_time(rank, a.op, a.chunk))
        return self.passes[key]

    def issue_time(self, op: Op) -> float:
        return self.issue[op]

    def p2p_time(self) -> float:
        return self.p2p

    def chain_steps(self, op: Op) -> list[tuple[str, float]]:
        if op not in self.chains:
            if hasattr(self.costs, "chain_steps"):
                self.chains[op] = self.costs.chain_steps(op)
            else:
                self.chains[op] = [(op.value, float(self.costs.collective_time(op)))]
        return self.chains[op]


def makespan(out: Replayed) -> float:
    """When the last pass or chain step of a replay ended."""
    return max([end for *_, end in out.passes] + [end for *_, end in out.chains] + [0.0])


class Comm:
    """One communication operation of a rank: a p2p batch (or action) or a collective. (A plain class
    with slots: a replay makes one per operation, tens of thousands at 32 ranks.)"""

    __slots__ = (
        "rank",
        "index",
        "ops",
        "queue",
        "collective",
        "communicator",
        "issued",
        "start",
        "done",
        "op_done",
        "peers",
    )

    def __init__(self, rank: int, index: int, ops: tuple[Action, ...], queue):
        self.rank = rank
        self.index = index
        """Position among the rank's operations, in issue order."""
        self.ops = ops
        """Its p2p actions, or the one collective."""
        self.queue = queue
        """Key of the in-order queue it runs on (unique when operations are independent)."""
        self.collective = ops[0].op in COLLECTIVES
        self.communicator = "vocab" if self.collective else "pp"
        """The communicator it runs on (the vocabulary group's, or the pipeline group's)."""
        self.issued: float | None = None
        """When the line issued it (None: not yet)."""
        self.start: float | None = None
        """When it started (None: not yet)."""
        self.done: float | None = None
        """When it completed (None: not yet)."""
        self.op_done: dict = {}
        """p2p: index into `ops` -> when that op completed."""
        self.peers: list = [None] * len(ops)
        """p2p: the peer's operation holding the counterpart of each of `ops` (`match_p2p`)."""


@dataclass(frozen=True)
class Replayed:
    """What a replay found: when every pass and collective chain step ran."""

    passes: list[tuple[int, Action, float, float]]
    """(rank, compute action, start, end), in the order the driver ran them."""
    chains: list[tuple[Action, str, float, float]]
    """(collective action, chain step, start, end), in the global collective order."""


class _Line:
    """A rank's program: its items in issue order (compute actions with the operations they read, and
    communication operations)."""

    def __init__(self, s: Schedule, r: int, rules: Rules):
        self.r = r
        self.items: list = []  # (Action, [Comm it reads]) for compute, Comm for communication
        self.comms: list[Comm] = []
        by_key: dict[tuple, Comm] = {}
        # (op, chunk) -> [(op, chunk)] it consumes: deps' rules relate actions of one microbatch, so they
        # are asked once per pass kind and chunk rather than once per action
        reads_of: dict = {}
        for item in p2p_batches(s.actions[r]) if rules.batches else s.actions[r]:
            if isinstance(item, Action) and item.op not in P2P and item.op not in COLLECTIVES:
                kind = (item.op, item.chunk)
                reads = reads_of.get(kind)
                if reads is None:
                    reads = reads_of[kind] = [(op, c) for op, _, c in consumed(s, r, item)]
                self.items.append((item, [(op, item.mb, c) for op, c in reads]))
                continue
            ops = item if isinstance(item, tuple) else (item,)
            if rules.queues == "none":
                queue = len(self.comms)
            elif rules.queues == "rank":
                queue = "all"
            else:
                queue = "vocab" if ops[0].op in COLLECTIVES else "pp"
            op = Comm(r, len(self.comms), ops, queue)
            self.comms.append(op)
            self.items.append(op)
            for a in ops:
                by_key[(a.op, a.mb, a.chunk)] = op
        self.items = [
            item if isinstance(item, Comm) else (item[0], [by_key[k] for k in item[1] if k in by_key])
            for item in self.items
        ]
        self.pc = 0
        self.time = 0.0  # the line is busy until then
        self.waiting: dict = {}  # queue -> issued operations not yet started, in order
        self.last_done: dict = {}  # queue -> the completion time of its last finished operation
        self.busy: dict = {}  # queue -> its started, unfinished operation

    def finished(self) -> bool:
        return self.pc == len(self.items) and all(op.done is not None for op in self.comms)


def replay(s: Schedule, rules: Rules, clock: Clock | None = None) -> Replayed:
    """Replay `s` under `rules` with `clock`'s costs (None: the null clock). Raises ScheduleError when the
    lists cannot finish (a message that is never received, or operations waiting on each other)."""
    # a replay makes tens of thousands of small objects and no reference cycles: the cyclic collector's
    # repeated scans of them (and of the schedule's actions) would take as long as the replay itself
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _Replay(s, rules, clock or NullClock()).run()
    finally:
        if enabled:
            gc.enable()


class _Replay:
    """The replay's state. Ranks are revisited only when something they wait on changed (`dirty`)."""

    def __init__(self, s: Schedule, rules: Rules, clock: Clock):
        self.s, self.rules, self.clock = s, rules, clock
        self.lines = [_Line(s, r, rules) for r in range(s.num_ranks)]
        match_p2p(self.lines)
        self.colls = [[op for op in L.comms if op.collective] for L in self.lines]
        self.next_coll = 0  # index of the next collective chain to run (all ranks share the order)
        self.chain_free = 0.0  # the previous chain ends then
        self.passes: list = []
        self.chains: list = []
        self.dirty = set(range(s.num_ranks))
        self.colls_started = False  # a collective started since the chains were last run
        self.connected = set(rules.connected) if rules.connected is not None else None
        self.arrived: dict = {}  # communicator being created lazily -> ranks blocked in its creation

    def run(self) -> Replayed:
        while self.dirty or self.colls_started:
            if self.colls_started:  # run here, not from _start_next: a long run of chains would recurse
                self.colls_started = False
                self._run_collectives()
                continue
            L = self.lines[self.dirty.pop()]
            self._run_line(L)
            for op in list(L.busy.values()):
                if not op.collective:
                    self._complete_p2p(op)
        if not all(L.finished() for L in self.lines):
            raise ScheduleError(_deadlock(self.s, self.lines, self.rules))
        return Replayed(self.passes, self.chains)

    def _run_line(self, L: _Line) -> None:
        """Run the line as far as its inputs allow."""
        while L.pc < len(L.items):
            item = L.items[L.pc]
            if isinstance(item, Comm):
                if item.issued is None and not self._connect(L, item):
                    return
                if item.issued is None:
                    L.time += sum(self.clock.issue_time(a.op) for a in item.ops)
                    item.issued = L.time
                    L.waiting.setdefault(item.queue, []).append(item)
                    self._start_next(L, item.queue)
                if self.rules.blocking_collectives and item.collective:
                    if item.done is None:
                        return
                    L.time = max(L.time, item.done)
            else:
                a, reads = item
                if any(op.done is None for op in reads):
                    return
                start = max([L.time] + [op.done for op in reads])
                L.time = start + self.clock.pass_time(L.r, a)
                self.passes.append((L.r, a, start, L.time))
            L.pc += 1

    def _connect(self, L: _Line, item: Comm) -> bool:
        """Lazy creation of item's communicator: True once it exists; False while the line is blocked in
        the creation, waiting for the other members. Raises if the rank issued another communicator's
        operation before (it may still run while this one is created)."""
        key = item.communicator
        if self.connected is None or key in self.connected:
            return True
        waiting = self.arrived.setdefault(key, set())
        if L.r not in waiting:
            earlier = next((op for op in L.comms if op.issued is not None and op.communicator != key), None)
            if earlier is not None:
                raise ScheduleError(
                    f"{self.s.describe()}: rank {L.r} would create the {key} communicator at its first operation "
                    f"{_describe(item)} while its {earlier.communicator} operation {_describe(earlier)} may still "
                    "run on the device (NCCL creates a communicator lazily, and a creation while another "
                    "communicator's kernels run can deadlock); connect every communicator before the step "
                    "(runtime.groups.warm_up)"
                )
            waiting.add(L.r)
        if len(waiting) < len(self.lines):
            return False
        self.connected.add(key)
        self.dirty.update(r for r in range(len(self.lines)) if r != L.r)
        return True

    def _start_next(self, L: _Line, q) -> None:
        """Start queue q's next issued operation if the one before it has completed."""
        if q in L.busy or not L.waiting.get(q):
            return
        op = L.waiting[q].pop(0)
        op.start = max(op.issued, L.last_done.get(q, 0.0))
        L.busy[q] = op
        if op.collective:
            self.colls_started = True
        else:  # its peers may now complete their side, and a buffered send completes at once
            self.dirty.update(peer.rank for peer in op.peers)
            self.dirty.add(L.r)

    def _finish(self, op: Comm, t: float) -> None:
        L = self.lines[op.rank]
        op.done = t
        L.last_done[op.queue] = t
        del L.busy[op.queue]
        self.dirty.add(op.rank)
        self._start_next(L, op.queue)

    def _run_collectives(self) -> None:
        """Run every chain whose collective all ranks have started, in the global order."""
        colls, p = self.colls, len(self.lines)
        while self.next_coll < len(colls[0]) and all(colls[r][self.next_coll].start is not None for r in range(p)):
            group = [colls[r][self.next_coll] for r in range(p)]
            end = max([self.chain_free] + [op.start for op in group])
            a = group[0].ops[0]
            for step, seconds in self.clock.chain_steps(a.op):
                self.chains.append((a, step, end, end + seconds))
                end += seconds
            self.chain_free = end
            self.next_coll += 1
            for op in group:
                self._finish(op, end)

    def _complete_p2p(self, op: Comm) -> None:
        """Complete the ops of a started batch whose peer has started; the batch once all have."""
        for j, (a, other) in enumerate(zip(op.ops, op.peers)):
            if j in op.op_done:
                continue
            if a.op in SENDS and not self.rules.rendezvous:
                op.op_done[j] = op.start  # buffered: gone when issued
            elif other.start is None:
                continue
            elif self.rules.rendezvous:  # the transfer starts once both sides are posted
                op.op_done[j] = max(op.start, other.start) + self.clock.p2p_time()
            else:  # the data left when the send started and is there p2p_time later
                op.op_done[j] = max(op.start, other.start + self.clock.p2p_time())
        if len(op.op_done) == len(op.ops):
            self._finish(op, max(op.op_done.values()))


def _message(a: Action, sender: int) -> tuple:
    """A message named by the receive that consumes it: (receiver op, mb, receiver chunk, sender)."""
    if a.op is Op.SEND_ACT:
        return (Op.RECV_ACT, a.mb, a.chunk + 1, sender)
    return (Op.RECV_GRAD, a.mb, a.chunk - 1, sender)


def match_p2p(lines: list[_Line]) -> None:
    """Set every p2p operation's `peers`, matching the k-th send and the k-th receive of each channel
    (messages between two ranks match in issue order); raises ScheduleError when the two sides disagree."""
    sends: dict = {}
    recvs: dict = {}
    for L in lines:
        for op in L.comms:
            for j, a in enumerate(op.ops):
                if a.op in SENDS:
                    sends.setdefault((L.r, a.peer), []).append((op, j, _message(a, L.r)))
                elif a.op in P2P:
                    recvs.setdefault((a.peer, L.r), []).append((op, j, (a.op, a.mb, a.chunk, a.peer), a))
    for channel in set(sends) | set(recvs):
        src, dst = channel
        out, into = sends.get(channel, []), recvs.get(channel, [])
        for k in range(max(len(out), len(into))):
            if k >= len(into):
                op, mb, c, _ = out[k][2]
                raise ScheduleError(
                    f"rank {src} sends to rank {dst} a message for {Action(op, mb, c, src)} that is never received"
                )
            if k >= len(out):
                a = into[k][3]
                raise ScheduleError(f"rank {dst} waits for {a} but rank {src} never sends it")
            if out[k][2] != into[k][2]:
                a = into[k][3]
                op, mb, c, _ = out[k][2]
                raise ScheduleError(
                    f"rank {dst}: {a} is its receive #{k} from rank {src}, whose send #{k} is "
                    f"for {Action(op, mb, c, src)}: p2p between two ranks is matched in issue order"
                )
            (send, i, _), (recv, j, _, _) = out[k], into[k]
            send.peers[i] = recv
            recv.peers[j] = send


def _describe(op: Comm) -> str:
    return f"#{op.index} [{', '.join(str(a) for a in op.ops)}]"


def _deadlock(s: Schedule, lines: list[_Line], rules: Rules) -> str:
    out = []
    for L in lines:
        parts = []
        if L.pc < len(L.items):
            item = L.items[L.pc]
            if isinstance(item, Comm) and item.issued is None:
                parts.append(f"the line is blocked creating the {item.communicator} communicator at {_describe(item)}")
            elif isinstance(item, Comm):
                parts.append(f"the line waits for collective {_describe(item)}")
            else:
                waits = [_describe(op) for op in item[1] if op.done is None]
                parts.append(f"compute at {item[0]} waits for {'; '.join(waits)}")
        for q, ops in L.waiting.items():
            if ops and q in L.busy:
                parts.append(f"op {_describe(ops[0])} waits for {_describe(L.busy[q])} before it")
        for op in L.busy.values():
            if op.collective:
                late = [x.r for x in lines if not any(c.start is not None and c.ops[0] == op.ops[0] for c in x.comms)]
                parts.append(f"collective {_describe(op)} waits for rank(s) {late} to issue it")
                continue
            j = next(j for j in range(len(op.ops)) if j not in op.op_done)
            peer = op.peers[j]
            verb = "post the matching receive" if op.ops[j].op in SENDS else "send"
            parts.append(
                f"p2p batch {_describe(op)} waits for rank {peer.rank} to {verb} (its batch "
                f"{_describe(peer)} has not started)"
            )
        if parts:
            out.append(f"rank {L.r}: " + "; ".join(parts))
    return f"{s.describe()} deadlocks under {rules.name}: " + " | ".join(out)
