"""Turn grid-placed passes and collectives into each rank's ordered action list, adding p2p.

Sort key of everything on a rank: (time, phase, ...).
- a pass ending at grid time e: (e, 0, slot order, mb, chunk, 1, 0); passes of one rank never
  overlap, so sorting by end is sorting by start;
- the p2p of boundary e: (e, 0.5, peer pair, ...) on the sender AND on the receiver of every message
  whose producer ends at e. The executor posts adjacent p2p actions with one peer as one batch, so
  each rank's p2p at e form one batch per peer, in the order of the pairs {rank, peer}, and each meets,
  op for op, the peer's batch of the same pair at e. That is what NCCL needs: a send completes only
  once the peer's matching receive is posted, and a rank's batches complete in issue order; with every
  batch's counterpart at the same global time and every rank taking the pairs of one boundary in one
  global order, no batch can wait behind one that waits for it. (One batch per peer rather than one
  per boundary: a pass waits for the whole batch of its receive, and a batch holding another peer's
  transfer made it wait for that too — on 8 ranks V-Half + VP lost its lead over 1F1B to it.) (A receive posted at its consumer instead could sit behind a send the peer
  cannot complete until it has received: the classic 1F1B deadlock.) On one channel the receives
  are thereby issued in send order, as messages between two ranks are matched;
- a collective at boundary t: (t, 1, its global collective order, mb, 0, 0, 0) on every rank: issued
  after the passes that end by t and the p2p of t, before a pass still under way at t, so no rank
  holds up a collective by a pass it does not need.
Every operation waits only for operations of an earlier key or its counterparts of the same key, on
every rank and communicator, so the lists cannot deadlock even with all communicators serialised
(`schedule.streams` replays them under those rules; the validator runs it).
"""

from __future__ import annotations

from .ir import Action, Op
from .timing import COLLECTIVE_ORDER, TimedCollective, TimedPass, slot_order


def lower(
    num_ranks: int, chunk_rank: tuple[int, ...], passes: list[TimedPass], collectives: list[TimedCollective]
) -> tuple[tuple[Action, ...], ...]:
    keyed: list[list] = [[] for _ in range(num_ranks)]
    pass_key: dict = {}
    for p in passes:
        key = (p.end, 0, slot_order(p.op), p.mb, p.chunk, 1, 0)
        keyed[p.rank].append((key, Action(p.op, p.mb, p.chunk)))
        if p.op in (Op.F, Op.B):
            pass_key[(p.op, p.mb, p.chunk)] = key
    for c in collectives:
        key = (c.time, 1, COLLECTIVE_ORDER[c.op], c.mb, 0, 0, 0)
        action = Action(c.op, c.mb, 0, c.root)  # one immutable object shared by all ranks
        for r in range(num_ranks):
            keyed[r].append((key, action))

    # every message goes in the p2p batch of the global time its producer ends and of its pair of ranks,
    # on both sides: the sender's send and the receiver's receive share one key, so each rank's batches
    # meet its peers' batch by batch (NCCL completes a send only once the matching receive is posted, and a rank's
    # batches in issue order; a receive posted later, at its consumer, could wait behind a send the
    # peer cannot complete). The batch sits after the passes that end at that time (phase 0) and before
    # the collectives of that boundary (phase 1), the same relative order on every rank.
    last = len(chunk_rank) - 1
    for (op, mb, c), key in pass_key.items():
        src = chunk_rank[c]
        if op is Op.F and c < last and chunk_rank[c + 1] != src:
            dst = chunk_rank[c + 1]
            pair = (min(src, dst), max(src, dst))
            keyed[src].append(((key[0], 0.5, pair, 0, mb, c, 0), Action(Op.SEND_ACT, mb, c, dst)))
            keyed[dst].append(((key[0], 0.5, pair, 1, mb, c, 0), Action(Op.RECV_ACT, mb, c + 1, src)))
        if op is Op.B and c > 0 and chunk_rank[c - 1] != src:
            dst = chunk_rank[c - 1]
            pair = (min(src, dst), max(src, dst))
            keyed[src].append(((key[0], 0.5, pair, 0, mb, c, 1), Action(Op.SEND_GRAD, mb, c, dst)))
            keyed[dst].append(((key[0], 0.5, pair, 1, mb, c, 1), Action(Op.RECV_GRAD, mb, c - 1, src)))

    return tuple(tuple(a for _, a in sorted(rank, key=lambda x: x[0])) for rank in keyed)
