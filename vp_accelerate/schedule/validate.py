"""`validate(schedule)`: raise ScheduleError naming the rank and action of the first violation.

Checks, in order:
1. each action is legal on its rank (ownership, peers, method) and its local prerequisites came
   earlier on that rank (cross-rank data arrives only through a receive or a collective);
2. counts: every expected action exactly once per rank;
3. every rank issues the vocabulary collectives in the same global order, each expanded into the
   collectives of its chain (`chain_collectives`: C1 is max -> sums), as the communication worker runs them;
4. a replay under NCCL's semantics finishes (`streams.replay_streams`): the p2p batches the executor
   issues (`ir.p2p_batches`), sends that complete only once the peer's receive is posted, each rank's
   batches in issue order, and every communicator of a rank serialised in issue order
   (CUDA_DEVICE_MAX_CONNECTIONS=1); messages between two ranks match in issue order, none left unreceived.
"""

from __future__ import annotations

from .deps import prerequisites, root, vocab_actions
from .ir import COLLECTIVES, Action, Op, Schedule, ScheduleError, chain_collectives
from .streams import replay_streams


def validate(schedule: Schedule) -> None:
    _check_header(schedule)
    for r in range(schedule.num_ranks):
        _check_rank(schedule, r)
    _check_collective_order(schedule)
    _replay(schedule)


def _err(rank: int, i: int, a: Action, why: str) -> ScheduleError:
    return ScheduleError(f"rank {rank}, action #{i} {a}: {why}")


def _check_header(s: Schedule) -> None:
    if len(s.actions) != s.num_ranks:
        raise ScheduleError(f"{len(s.actions)} action lists for {s.num_ranks} ranks")
    bad = [c for c, r in enumerate(s.chunk_rank) if not 0 <= r < s.num_ranks]
    if bad:
        raise ScheduleError(f"chunk {bad[0]} is owned by rank {s.chunk_rank[bad[0]]}, outside 0..{s.num_ranks - 1}")
    if s.forward_only and s.split_backward:
        raise ScheduleError("a forward-only schedule cannot split the backward")


def _expected(s: Schedule, r: int) -> set:
    """(op, mb, chunk) of every action rank r must run exactly once."""
    out = set()
    last = s.last_chunk
    vocab = vocab_actions(s.method, s.forward_only)
    for mb in range(s.num_microbatches):
        for c in s.chunks_of(r):
            out.add((Op.F, mb, c))
            if c < last and s.owner(c + 1) != r:
                out.add((Op.SEND_ACT, mb, c))
            if c > 0 and s.owner(c - 1) != r:
                out.add((Op.RECV_ACT, mb, c))
            if not s.forward_only:
                out.add((Op.B, mb, c))
                if s.split_backward:
                    out.add((Op.W, mb, c))
                if c > 0 and s.owner(c - 1) != r:
                    out.add((Op.SEND_GRAD, mb, c))
                if c < last and s.owner(c + 1) != r:
                    out.add((Op.RECV_GRAD, mb, c))
        out.update((op, mb, 0) for op in vocab)
    return out


def _check_rank(s: Schedule, r: int) -> None:
    done: set = set()
    roots = {op: root(s, op) for op in COLLECTIVES}
    expected = _expected(s, r)
    needs_of: dict = {}
    for i, a in enumerate(s.actions[r]):
        key = (a.op, a.mb, a.chunk)
        if key in done:
            raise _err(r, i, a, "runs twice")
        if key not in expected:
            raise _err(
                r,
                i,
                a,
                "does not belong on this rank for this schedule "
                f"({s.describe()}, rank holds chunks {list(s.chunks_of(r))})",
            )
        kind = (a.op, a.chunk)  # deps' rules relate actions of one microbatch: asked once per op and chunk
        need = needs_of.get(kind)
        if need is None:
            need = needs_of[kind] = [(op, c) for op, _, c in prerequisites(s, r, a)]
        missing = [(op, a.mb, c) for op, c in need if (op, a.mb, c) not in done]
        if missing:
            op, mb, c = missing[0]
            raise _err(r, i, a, f"runs before {Action(op, mb, c)} on this rank")
        if a.op in roots and a.peer != roots[a.op]:
            raise _err(r, i, a, f"root must be rank {roots[a.op]}" if roots[a.op] >= 0 else "has no root (peer -1)")
        if a.op in (Op.SEND_ACT, Op.RECV_GRAD) and a.peer != s.owner(a.chunk + 1):
            raise _err(r, i, a, f"peer must be rank {s.owner(a.chunk + 1)} (owner of chunk {a.chunk + 1})")
        if a.op in (Op.RECV_ACT, Op.SEND_GRAD) and a.peer != s.owner(a.chunk - 1):
            raise _err(r, i, a, f"peer must be rank {s.owner(a.chunk - 1)} (owner of chunk {a.chunk - 1})")
        done.add(key)
    missing = sorted(expected - done, key=lambda k: (k[1], k[2], k[0].value))
    if missing:
        op, mb, c = missing[0]
        raise ScheduleError(f"rank {r} never runs {Action(op, mb, c)} ({len(missing)} expected actions missing)")


def _collectives(s: Schedule, r: int) -> list:
    """(action index, action, collective of its chain) for every collective rank r runs, in order."""
    return [
        (i, a, sub)
        for i, a in enumerate(s.actions[r])
        if a.op in COLLECTIVES
        for sub in chain_collectives(a.op, s.method)
    ]


def _check_collective_order(s: Schedule) -> None:
    ref = [(a.op, a.mb, sub) for _, a, sub in _collectives(s, 0)]
    for r in range(1, s.num_ranks):
        mine = _collectives(s, r)
        for k, (i, a, sub) in enumerate(mine):
            if k >= len(ref) or (a.op, a.mb, sub) != ref[k]:
                other = f"{Action(ref[k][0], ref[k][1])} ({ref[k][2]})" if k < len(ref) else "nothing"
                raise _err(
                    r,
                    i,
                    a,
                    f"is this rank's collective #{k} ({sub}) but rank 0's is {other}: "
                    "all ranks must issue the vocabulary collectives in one order",
                )
        if len(mine) < len(ref):
            raise ScheduleError(f"rank {r} issues {len(mine)} collectives, rank 0 issues {len(ref)}")


def _replay(s: Schedule) -> None:
    """Deadlock freedom under NCCL's semantics (`streams.replay_streams`). The serialised rule (every
    communicator of a rank in one issue order) only adds waits to the per-communicator one, so an order
    that passes it passes both; on a failure the relaxed rule tells which of the two it breaks."""
    try:
        replay_streams(s, serialized=True)
    except ScheduleError:
        replay_streams(s, serialized=False)  # raises if the order deadlocks even with one stream each
        raise
