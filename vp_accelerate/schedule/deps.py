"""What each action of a rank waits on: the one statement of the IR's dependency rules.

`prerequisites` is what must come earlier in a rank's list (the validator checks it); `consumed` is the
communication a compute pass reads — what it waits for at run time. The executor's waits
(`runtime/executor.py`), the NCCL replay (`streams.py`) and the validator all take them from here.
"""

from __future__ import annotations

from .ir import Action, Op, Schedule


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
    if op in _AFTER:
        return [(_AFTER[op], mb, 0)]
    if op is Op.C0:
        return [(Op.F, mb, last)] if s.owner(last) == r else []
    if op is Op.IB_BCAST:
        return [(Op.B, mb, 0)] if s.owner(0) == r else []
    return []


# vocabulary actions that follow one action of the same microbatch on every rank
_AFTER = {Op.IF_REDUCE: Op.IF, Op.S: Op.C0, Op.C1: Op.S, Op.T: Op.C1, Op.C2: Op.T, Op.IB: Op.IB_BCAST}


def consumed(s: Schedule, rank: int, a: Action) -> list[tuple]:
    """(op, mb, chunk) of the communication compute pass `a` on `rank` reads (receives, collectives)."""
    mb, c, last = a.mb, a.chunk, s.last_chunk
    if a.op is Op.F:
        if c == 0 and s.vocab_parallel:
            return [(Op.IF_REDUCE, mb, 0)]
        return [(Op.RECV_ACT, mb, c)] if c > 0 and s.owner(c - 1) != rank else []
    if a.op is Op.B:
        if c == last:
            barrier = s.method.grad_barrier
            return [(barrier, mb, 0)] if barrier is not None else []
        return [(Op.RECV_GRAD, mb, c)] if s.owner(c + 1) != rank else []
    return {Op.S: [(Op.C0, mb, 0)], Op.T: [(Op.C1, mb, 0)], Op.IB: [(Op.IB_BCAST, mb, 0)]}.get(a.op, [])
