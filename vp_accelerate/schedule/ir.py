"""The schedule IR: per rank, an ordered list of actions. The runtime executes it, the simulator
times it, the plotter draws it; nothing else decides order.

Conventions (docs/ARCHITECTURE.md is the contract):
- chunks are numbered in model order; `chunk_rank[c]` is the rank holding chunk c.
- F/B/W act on (mb, chunk). S/T/IF/IB and the collectives carry chunk=0.
- p2p actions name the rank on the other side in `peer`. Collectives name their root in `peer`
  (C0: owner of the last chunk, IF_REDUCE and IB_BCAST: owner of chunk 0) and -1 when there is
  none (C1, C2 are all-reduces).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry imports this module (Op); a Schedule is handed its entries
    from .registry import Method, ScheduleKind


class ScheduleError(ValueError):
    """A schedule (or the request for one) is invalid; the message names the rank/action or input."""


class Op(str, enum.Enum):
    """What one action does. Values are the names the runtime dispatches on (`_do_<value>`)."""

    F = "F"
    B = "B"
    W = "W"
    S = "S"
    T = "T"
    IF = "IF"
    IB = "IB"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    C0 = "C0"
    C1 = "C1"
    C2 = "C2"
    IF_REDUCE = "IF_REDUCE"
    IB_BCAST = "IB_BCAST"

    # the str's hash (what Enum's Python-level __hash__ returns anyway, name == value): ops key the
    # replay's and the executor's dicts, and a C-level hash makes those lookups several times cheaper
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


CHUNK_PASSES = frozenset({Op.F, Op.B, Op.W})
VOCAB_PASSES = frozenset({Op.S, Op.T, Op.IF, Op.IB})
COMPUTE_PASSES = CHUNK_PASSES | VOCAB_PASSES
# Op names of the compute passes, for timelines (TimedAction.op is a string; WAIT and communication
# records are not work).
COMPUTE_OPS = frozenset(op.value for op in COMPUTE_PASSES)
P2P = frozenset({Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD})
COLLECTIVES = frozenset({Op.C0, Op.C1, Op.C2, Op.IF_REDUCE, Op.IB_BCAST})


def chain_collectives(op: Op, method: Method) -> tuple[str, ...]:
    """The collectives one collective action runs on every rank, in order (its chain; vocab/comm.py runs
    the whole chain off the compute thread). C1 is one action of the IR but three collectives with the
    rescale exp(m_i − m) between the first and the last: the validator and the simulator see each."""
    if op is Op.C1:
        if method.grad_barrier is Op.C1:  # C1 also all-reduces the input gradient a_i
            return ("all_reduce max m_i", "all_reduce sum [c_i, t_i]", "all_reduce sum [s_i, a_i] rescaled")
        return ("all_reduce max m_i", "all_reduce sum t_i", "all_reduce sum s_i rescaled")
    return {
        Op.C0: ("broadcast X",),
        Op.C2: ("all_reduce sum grad_x_i",),
        Op.IF_REDUCE: ("reduce embedding",),
        Op.IB_BCAST: ("broadcast grad_emb",),
    }.get(op, ())


@dataclass(frozen=True)
class Action:
    """One step of one rank's program."""

    op: Op
    """What to do."""
    mb: int
    """Microbatch index, 0..num_microbatches-1."""
    chunk: int = 0
    """Model chunk (F/B/W/p2p); 0 for vocabulary passes and collectives."""
    peer: int = -1
    """p2p: the other rank. Collectives: the root rank (C0, IF_REDUCE, IB_BCAST), else -1."""

    def __str__(self) -> str:
        if self.op in CHUNK_PASSES:
            return f"{self.op}(mb={self.mb}, chunk={self.chunk})"
        if self.op in P2P:
            return f"{self.op}(mb={self.mb}, chunk={self.chunk}, peer={self.peer})"
        return f"{self.op}(mb={self.mb})"


@dataclass(frozen=True)
class Schedule:
    """A whole pipeline step as data: every rank's ordered actions plus what they run on."""

    kind: ScheduleKind
    """Schedule kind, an entry of registry.SCHEDULES ("1f1b", "vhalf", "interleaved")."""
    method: Method
    """Method, an entry of registry.METHODS ("baseline", "redis", "vocab-1", "vocab-2")."""
    num_ranks: int
    """Pipeline ranks p (the vocabulary is sharded over all of them in VP)."""
    num_microbatches: int
    """Microbatches m per optimizer step."""
    chunk_rank: tuple[int, ...]
    """Owner rank of each model chunk, in model order."""
    split_backward: bool
    """True when B computes only input gradients and W the weight gradients (V-Half)."""
    forward_only: bool
    """Evaluation: forward passes and the loss, no backward."""
    actions: tuple[tuple[Action, ...], ...]
    """Per rank, in execution order."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_rank)

    @property
    def last_chunk(self) -> int:
        return len(self.chunk_rank) - 1

    @property
    def vocab_parallel(self) -> bool:
        """True for the VP methods (vocabulary passes on every rank)."""
        return self.method.vocab_parallel

    def owner(self, chunk: int) -> int:
        """Rank holding `chunk`."""
        return self.chunk_rank[chunk]

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Chunks held by `rank`, in model order."""
        return tuple(c for c, r in enumerate(self.chunk_rank) if r == rank)

    def describe(self) -> str:
        return (
            f"{self.kind.name}/{self.method.name} p={self.num_ranks} m={self.num_microbatches} "
            f"chunks={self.num_chunks}{' forward-only' if self.forward_only else ''}"
        )


@dataclass(frozen=True)
class TimedAction:
    """One executed action with its times: the timeline format shared by the simulator (predicted),
    the runtime (measured) and the plots. Times are seconds from the step's start."""

    rank: int
    """Rank that ran it."""
    op: str
    """Op name ("F", "S", "C1", ...; the runtime also records "WAIT" for time spent waiting for data)."""
    mb: int
    """Microbatch."""
    chunk: int
    """Chunk (0 for vocabulary work)."""
    start: float
    """Seconds from the step start."""
    end: float
    """Seconds from the step start."""
    lane: str = "compute"
    """"compute": on the rank's compute thread (passes, WAIT, the issue of a collective); "comm": a
    collective chain as it ran on the rank's communication worker (its own timeline row)."""


def p2p_batches(actions) -> list:
    """A rank's actions as the runtime issues them: every maximal run of adjacent p2p actions with one
    peer is one batch (a tuple: one `batch_isend_irecv` call — on NCCL its ops start together and it
    completes as a whole, so a pass waiting for one receive waits for its whole batch: one peer per
    batch keeps it from waiting for another peer's transfer), every other action stands alone. The executor issues exactly these batches and the validator
    replays exactly these, so what is proven deadlock-free is what runs."""
    out: list = []
    run: list = []
    for a in actions:
        if a.op in P2P:
            if run and run[-1].peer != a.peer:  # one batch per peer: a pass waits only for its own peer's
                out.append(tuple(run))
                run = []
            run.append(a)
            continue
        if run:
            out.append(tuple(run))
            run = []
        out.append(a)
    if run:
        out.append(tuple(run))
    return out
