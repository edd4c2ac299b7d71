"""Turn grid-placed passes and collectives into each rank's ordered action list, adding p2p.

Sort key of everything on a rank: (time, phase, slot order, mb, chunk, sub, seq).
- a pass ending at grid time e: (e, 0, slot order, mb, chunk, 1, 0); its sends follow it (sub 2);
  passes of one rank never overlap, so sorting by end is sorting by start;
- a collective at boundary t: (t, 1, its global collective order, mb, 0, 0, 0) on every rank: issued
  after the passes that end by t and before a pass still under way at t, so no rank holds up a
  collective by a pass it does not need;
- receives precede their consumer (sub 0). p2p between a pair of ranks is matched in issue order
  (NCCL semantics), so on each sender->receiver channel the receives are issued in send order: a
  receive goes right before its own consumer or before the consumer of any later-sent message on the
  channel, whichever comes first (suffix minimum). Placing it no earlier keeps the receiver free.
Every receive sorts after its send in global time, and collectives sit at one global time, so the
lists cannot deadlock (the validator checks it anyway).
"""

from __future__ import annotations

from collections import defaultdict

from .ir import Action, Op
from .timing import COLLECTIVE_ORDER, SLOT_ORDER, TimedCollective, TimedPass


def lower(num_ranks: int, chunk_rank: tuple[int, ...], passes: list[TimedPass],
          collectives: list[TimedCollective]) -> tuple[tuple[Action, ...], ...]:
    keyed: list[list] = [[] for _ in range(num_ranks)]
    pass_key: dict = {}
    for p in passes:
        key = (p.end, 0, SLOT_ORDER.get(p.op, 0), p.mb, p.chunk, 1, 0)
        keyed[p.rank].append((key, Action(p.op, p.mb, p.chunk)))
        if p.op in (Op.F, Op.B):
            pass_key[(p.op, p.mb, p.chunk)] = key
    for c in collectives:
        key = (c.time, 1, COLLECTIVE_ORDER[c.op], c.mb, 0, 0, 0)
        action = Action(c.op, c.mb, 0, c.root)  # one immutable object shared by all ranks
        for r in range(num_ranks):
            keyed[r].append((key, action))

    # messages: (src, dst) -> [(send key, consumer key, recv action)]
    channels: dict = defaultdict(list)
    last = len(chunk_rank) - 1
    for (op, mb, c), key in pass_key.items():
        src = chunk_rank[c]
        if op is Op.F and c < last and chunk_rank[c + 1] != src:
            dst = chunk_rank[c + 1]
            send_key = key[:5] + (2, 0)
            keyed[src].append((send_key, Action(Op.SEND_ACT, mb, c, dst)))
            channels[(src, dst)].append((send_key, pass_key[(Op.F, mb, c + 1)], Action(Op.RECV_ACT, mb, c + 1, src)))
        if op is Op.B and c > 0 and chunk_rank[c - 1] != src:
            dst = chunk_rank[c - 1]
            send_key = key[:5] + (2, 0)
            keyed[src].append((send_key, Action(Op.SEND_GRAD, mb, c, dst)))
            channels[(src, dst)].append((send_key, pass_key[(Op.B, mb, c - 1)], Action(Op.RECV_GRAD, mb, c - 1, src)))

    for (src, dst), msgs in channels.items():
        msgs.sort(key=lambda x: x[0])
        earliest = None
        placed = []
        for i in range(len(msgs) - 1, -1, -1):  # suffix minimum of consumer keys
            consumer = msgs[i][1]
            earliest = consumer if earliest is None or consumer < earliest else earliest
            placed.append((earliest[:5] + (0, i), msgs[i][2]))
        keyed[dst] += placed

    return tuple(tuple(a for _, a in sorted(rank, key=lambda x: x[0])) for rank in keyed)
