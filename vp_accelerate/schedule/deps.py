"""What each action of a rank waits on: the one statement of the IR's dependency rules.

`prerequisites` is what must come earlier in a rank's list (the validator checks it); `consumed` is the
communication a compute pass reads — what it waits for at run time. The executor's waits
(`runtime/executor.py`), the replay driver (`replay.py`), the validator and the cost-aware builder
(`list_schedule.py`) all take them from here. The vocabulary actions' rules come from their
`registry.VOCAB_ACTIONS` entries (what each follows, its root, after which chunk pass it is issued);
the chunk passes' rules are stated below. What the builder needs besides is derived from these two
functions: `vocab_actions` (which actions a step has), `pass_inputs` / `collectives_read` (what a pass
waits for, as passes and collectives), `triggers` (after which passes a collective is issued) and
`root`.

Every rule relates actions of one microbatch (each action it names has the microbatch of the action
asked about), so a reader may ask once per op and chunk and substitute the microbatch (the replay does).
"""

from __future__ import annotations

from .ir import COLLECTIVES, Action, Op, Schedule
from .registry import VOCAB_ACTIONS, Method


def vocab_actions(method: Method, forward_only: bool) -> tuple[Op, ...]:
    """The vocabulary actions every rank runs once per microbatch of a step of `method` (none without VP)."""
    if not method.vocab_parallel:
        return ()
    return tuple(
        a.op
        for a in VOCAB_ACTIONS.values()
        if method.barriers >= a.min_barriers and not (a.training_only and forward_only)
    )


def activation_passes(split_backward: bool) -> tuple[Op, Op]:
    """(the pass that leaves a (mb, chunk) activation on its rank, the pass that frees it): F, and the
    last pass that reads what F saved — W when the backward is split, else B. The builder's activation
    limits count these."""
    return Op.F, Op.W if split_backward else Op.B


def root(s: Schedule, op: Op) -> int:
    """The root rank of collective `op` (the rank that broadcasts or is reduced into), -1 for none."""
    entry = VOCAB_ACTIONS.get(op)
    if entry is None or entry.root is None:
        return -1
    return s.owner(0 if entry.root == "first" else s.last_chunk)


def prerequisites(s: Schedule, r: int, a: Action) -> list[tuple]:
    """(op, mb, chunk) of the actions that must already have run on rank r before `a`: its inputs made on
    this rank, or received (a receive) or reduced (a collective) into it. The validator checks every
    list against these rules."""
    mb, c, last = a.mb, a.chunk, s.last_chunk
    op = a.op
    if op is Op.F:
        need = []
        if c == 0 and s.vocab_parallel:
            need.append((Op.IF_REDUCE, mb, 0))
        if c > 0:
            need.append((Op.F, mb, c - 1) if s.owner(c - 1) == r else (Op.RECV_ACT, mb, c))
        return need
    if op is Op.B:
        need = [(Op.F, mb, c)]
        if c == last:
            if s.method.grad_barrier is not None:  # the output layer's input gradient is complete
                need.append((s.method.grad_barrier, mb, 0))
        else:
            need.append((Op.B, mb, c + 1) if s.owner(c + 1) == r else (Op.RECV_GRAD, mb, c))
        return need
    if op is Op.W or op is Op.SEND_GRAD:
        return [(Op.B, mb, c)]
    if op is Op.SEND_ACT:
        return [(Op.F, mb, c)]
    entry = VOCAB_ACTIONS.get(op)
    if entry is None:
        return []
    if entry.follows is not None:
        return [(entry.follows, mb, 0)]
    if entry.after_chunk is not None:  # issued by its root after that chunk's pass
        chunk = 0 if entry.root == "first" else last
        return [(entry.after_chunk, mb, chunk)] if s.owner(chunk) == r else []
    return []


def consumed(s: Schedule, rank: int, a: Action) -> list[tuple]:
    """(op, mb, chunk) of the communication compute pass `a` on `rank` reads (receives, collectives)."""
    return [k for k in prerequisites(s, rank, a) if k[0] in _COMMUNICATION]


_RECEIVES = {Op.RECV_ACT: (Op.F, -1), Op.RECV_GRAD: (Op.B, +1)}  # what a receive brings: (pass, chunk step)
_COMMUNICATION = COLLECTIVES | frozenset(_RECEIVES)


def pass_inputs(s: Schedule, r: int, a: Action) -> list[tuple]:
    """(rank, op, mb, chunk) of the compute passes whose end compute pass `a` on rank r waits for: those it
    needs on its own rank, and the senders of what it receives (`prerequisites`, a receive replaced by
    the pass that produced the message)."""
    out = []
    for op, mb, c in prerequisites(s, r, a):
        if op in _RECEIVES:
            src, step = _RECEIVES[op]
            out.append((s.owner(c + step), src, mb, c + step))
        elif op not in COLLECTIVES:
            out.append((r, op, mb, c))
    return out


def collectives_read(s: Schedule, r: int, a: Action) -> list[tuple]:
    """(collective op, mb) of the collectives whose result compute pass `a` on rank r reads."""
    return [(op, mb) for op, mb, _ in prerequisites(s, r, a) if op in COLLECTIVES]


def triggers(s: Schedule, op: Op, mb: int) -> list[tuple]:
    """(rank, op, mb, chunk) of the passes after which collective (op, mb) is issued: its prerequisites on
    every rank (C1 after every rank's S; C0 after the last chunk's F on its owner)."""
    a = Action(op, mb, 0, root(s, op))
    return [(r, *k) for r in range(s.num_ranks) for k in prerequisites(s, r, a)]
