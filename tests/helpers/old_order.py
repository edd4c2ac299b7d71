"""The lowering's previous p2p order, for tests that show NCCL's rules reject it."""

from __future__ import annotations

import dataclasses

from vp_accelerate.schedule import Op
from vp_accelerate.schedule.deps import consumed
from vp_accelerate.schedule.ir import COMPUTE_PASSES


def receives_at_consumers(s):
    """`s` with each receive posted right before the pass that consumes it (as the lowering once did)."""
    lists = []
    for r, acts in enumerate(s.actions):
        recvs = {(a.op, a.mb, a.chunk): a for a in acts if a.op in (Op.RECV_ACT, Op.RECV_GRAD)}
        out = []
        for a in acts:
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                continue
            if a.op in COMPUTE_PASSES:
                out += [recvs[k] for k in consumed(s, r, a) if k in recvs]
            out.append(a)
        lists.append(tuple(out))
    return dataclasses.replace(s, actions=tuple(lists))
