"""Replay a schedule as NCCL runs it, and report any order that can wait in a cycle.

The model (what a GPU launch does with each rank's action list, issued in order by a host that never
blocks):
- compute passes run in order on the rank's compute stream; a pass waits for the communication it
  consumes (its receive's batch, the collective whose result it reads);
- a p2p batch (`ir.p2p_batches`: adjacent p2p actions, one `batch_isend_irecv`) and a collective chain
  start once the compute issued before them is done (torch makes the communicator's stream wait on
  the current stream at issue) and once the previous operation of their communicator is done (one
  stream per communicator: the pipeline's p2p, the vocabulary collectives);
- rendezvous: a send completes only when the peer's matching receive has been posted (its batch has
  started) — true for every message larger than NCCL's internal buffers, as activations are — and a
  batch completes when all its ops have; a collective completes once every rank has started it.
- `serialized=True` adds the rule of `CUDA_DEVICE_MAX_CONNECTIONS=1`: the operations of all
  communicators of a rank start in issue order, one after the other.

Messages on one sender->receiver channel match in issue order. `replay_streams` raises ScheduleError on
a mismatch or a deadlock, naming each rank's blocked operation and what it waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .deps import consumed
from .ir import COLLECTIVES, P2P, Action, Op, Schedule, ScheduleError, p2p_batches

_SENDS = (Op.SEND_ACT, Op.SEND_GRAD)


@dataclass
class _Comm:
    """One communication operation of a rank: a p2p batch or a collective chain."""

    index: int
    """Position in the rank's issue sequence (`p2p_batches`)."""
    ops: tuple[Action, ...]
    """The batch's p2p actions, or the one collective."""
    queue: str
    """Which stream it runs on ("pp" or "vocab"; "all" when serialized)."""
    compute_before: int
    """Compute passes issued before it on this rank (they must be done before it starts)."""
    started: bool = False
    done: bool = False
    matched: set = field(default_factory=set)
    """Indices into `ops` whose peer operation has been posted."""


def _message(a: Action, sender: int) -> tuple:
    """A message named by the receive that consumes it: (receiver op, mb, receiver chunk, sender)."""
    if a.op is Op.SEND_ACT:
        return (Op.RECV_ACT, a.mb, a.chunk + 1, sender)
    return (Op.RECV_GRAD, a.mb, a.chunk - 1, sender)


class _Rank:
    """A rank's program split into its compute stream and its communication operations."""

    def __init__(self, s: Schedule, r: int, serialized: bool):
        self.r = r
        self.compute: list[tuple[Action, list[_Comm]]] = []  # passes with the operations they read
        self.comms: list[_Comm] = []
        by_key: dict[tuple, _Comm] = {}
        pending = []
        for item in p2p_batches(s.actions[r]):
            if isinstance(item, tuple):
                queue = "pp"
                ops = item
            elif item.op in COLLECTIVES:
                queue, ops = "vocab", (item,)
            else:
                pending.append((item, consumed(s, r, item)))
                self.compute.append((item, []))
                continue
            op = _Comm(len(self.comms), ops, "all" if serialized else queue, len(self.compute))
            self.comms.append(op)
            for a in ops:
                by_key[(a.op, a.mb, a.chunk)] = op
        for i, (a, keys) in enumerate(pending):
            self.compute[i] = (a, [by_key[k] for k in keys if k in by_key])
        self.pc = 0  # next compute pass
        self.heads: dict[str, int] = {}  # queue -> index into self.comms of its first unfinished op
        self.queues: dict[str, list[_Comm]] = {}
        for op in self.comms:
            self.queues.setdefault(op.queue, []).append(op)
        self.heads = {q: 0 for q in self.queues}

    def head(self, queue: str) -> _Comm | None:
        ops = self.queues[queue]
        i = self.heads[queue]
        return ops[i] if i < len(ops) else None

    def finished(self) -> bool:
        return self.pc == len(self.compute) and all(self.head(q) is None for q in self.queues)


def _match_p2p(ranks: list[_Rank]) -> dict:
    """(rank, comm index, op index) -> (peer rank, peer comm index, peer op index) for every p2p op,
    matching the k-th send and the k-th receive of each channel; checks the messages agree."""
    sends: dict = {}
    recvs: dict = {}
    for R in ranks:
        for op in R.comms:
            for j, a in enumerate(op.ops):
                if a.op in _SENDS:
                    sends.setdefault((R.r, a.peer), []).append((op.index, j, _message(a, R.r)))
                elif a.op in P2P:
                    recvs.setdefault((a.peer, R.r), []).append((op.index, j, (a.op, a.mb, a.chunk, a.peer), a))
    peers: dict = {}
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
            peers[(src, out[k][0], out[k][1])] = (dst, into[k][0], into[k][1])
            peers[(dst, into[k][0], into[k][1])] = (src, out[k][0], out[k][1])
    return peers


def replay_streams(s: Schedule, serialized: bool = False) -> None:
    """Replay `s` under NCCL's stream semantics (module docstring); raise ScheduleError on a deadlock."""
    ranks = [_Rank(s, r, serialized) for r in range(s.num_ranks)]
    peers = _match_p2p(ranks)
    # the k-th collective of every rank is the same one (the collective-order check guarantees it)
    colls = [[op for op in R.comms if op.ops[0].op in COLLECTIVES] for R in ranks]
    coll_pos = [{id(op): k for k, op in enumerate(cs)} for cs in colls]
    while True:
        progress = False
        for R in ranks:
            progress |= _advance(R)
        # complete what the started operations now allow
        for R in ranks:
            for q in R.queues:
                op = R.head(q)
                if op is None or not op.started or op.done:
                    continue
                if op.ops[0].op in COLLECTIVES:
                    k = coll_pos[R.r][id(op)]
                    if all(colls[x][k].started for x in range(len(ranks))):
                        for x in range(len(ranks)):
                            colls[x][k].done = True
                    continue
                for j in range(len(op.ops)):
                    pr, pi, pj = peers[(R.r, op.index, j)]
                    other = ranks[pr].comms[pi]
                    if j not in op.matched and other.started:  # both posted: the transfer happens
                        op.matched.add(j)
                        other.matched.add(pj)
        for R in ranks:
            for q in R.queues:
                while (
                    (op := R.head(q)) is not None
                    and op.started
                    and (op.done or (op.ops[0].op in P2P and len(op.matched) == len(op.ops)))
                ):
                    op.done = True
                    R.heads[q] += 1
                    progress = True
        if all(R.finished() for R in ranks):
            return
        if not progress:
            raise ScheduleError(_deadlock(s, ranks, peers, serialized))


def _advance(R: _Rank) -> bool:
    """Run this rank's compute as far as its inputs allow and start every queue head that may start."""
    progress = False
    while R.pc < len(R.compute) and all(op.done for op in R.compute[R.pc][1]):
        R.pc += 1
        progress = True
    for q in R.queues:
        op = R.head(q)
        if op is not None and not op.started and R.pc >= op.compute_before:
            op.started = True
            progress = True
    return progress


def _describe(op: _Comm) -> str:
    return f"#{op.index} [{', '.join(str(a) for a in op.ops)}]"


def _deadlock(s: Schedule, ranks: list[_Rank], peers: dict, serialized: bool) -> str:
    lines = []
    for R in ranks:
        parts = []
        if R.pc < len(R.compute):
            a, needs = R.compute[R.pc]
            waits = [_describe(op) for op in needs if not op.done]
            parts.append(f"compute at {a} waits for {'; '.join(waits)}")
        for q in R.queues:
            op = R.head(q)
            if op is None:
                continue
            if not op.started:
                if R.pc < op.compute_before:
                    parts.append(f"{q} op {_describe(op)} waits for compute before it")
                continue
            if op.ops[0].op in COLLECTIVES:
                late = [x.r for x in ranks if not any(c.started and c.ops[0] == op.ops[0] for c in x.comms)]
                parts.append(f"collective {_describe(op)} waits for rank(s) {late} to issue it")
            else:
                unmatched = [j for j in range(len(op.ops)) if j not in op.matched]
                j = unmatched[0]
                pr, pi, _ = peers[(R.r, op.index, j)]
                peer_head = ranks[pr].comms[pi]
                verb = "post the matching receive" if op.ops[j].op in _SENDS else "send"
                parts.append(
                    f"p2p batch {_describe(op)} waits for rank {pr} to {verb} (its batch "
                    f"{_describe(peer_head)} has not started)"
                )
        if parts:
            lines.append(f"rank {R.r}: " + "; ".join(parts))
    rule = (
        "all communicators serialised (CUDA_DEVICE_MAX_CONNECTIONS=1)" if serialized else "one stream per communicator"
    )
    return (
        f"{s.describe()} deadlocks under NCCL semantics (sends complete when the peer's receive is posted, "
        f"p2p batches complete in issue order, {rule}): " + " | ".join(lines)
    )
