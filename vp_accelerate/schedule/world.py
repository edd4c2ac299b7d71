"""The NCCL replay of a whole world's recorded programs: every rank's ordered operations on every communicator
(the dry run records them from the real runtime, train/dryrun), replayed under the rules of `streams.py`
with `CUDA_DEVICE_MAX_CONNECTIONS=1` (`NCCL_SERIALIZED`), extended to the host side of a rank.

The model of one rank:
- the host thread walks the rank's program in order. A device operation (a p2p batch, a collective on a
  device communicator) is issued and the host moves on; a host collective (gloo side groups: token counts,
  flags, object gathers) blocks the host until it completes; a host read of a device value (`.item()`,
  `bool(t)`) blocks until every device operation issued before it has completed;
- device operations of all communicators of a rank run in issue order, one after the other (one hardware
  connection): the head of the rank's device queue is the only one started;
- a collective completes once every member has started the same operation (the k-th on that communicator,
  of the same kind, size, root and identity, e.g. a data-parallel bucket's parameter names: mismatched
  collectives never complete, as NCCL hangs on them or, for equal sizes, silently combines the wrong
  tensors, which the replay calls a deadlock);
- a p2p batch is one Work: its sends and receives match in issue order on each (communicator, sender,
  receiver) channel and must agree in bytes (a send of the wrong size never matches: NCCL would truncate or
  hang), a send completes when the peer's batch holding the matching receive has started
  (rendezvous, true for messages larger than NCCL's buffers) and the batch when all its ops have.

`replay_world` returns None when every rank finishes, else a `Deadlock` naming each blocked rank, its
started operations and what each waits for. There is no clock: it decides whether the programs finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class CommOp:
    """One operation of a rank's program."""

    lane: str
    """"dev": a device communicator's work; "host": a blocking host collective; "sync": a host read of a
    device value (waits for the rank's earlier device operations)."""
    comm: str
    """The communicator, "<dev|host>:<member global ranks>#<k>" (the k-th group of that kind and members);
    "" for a sync."""
    kind: str
    """The torch.distributed call (all_reduce, broadcast, batch_isend_irecv, ...) or "read"."""
    p2p: tuple = ()
    """A p2p batch's ops: ("send" | "recv", peer global rank, bytes) each; () for a collective."""
    nbytes: int = 0
    """Bytes of a collective's tensor(s) (members must agree)."""
    label: str = ""
    """The phase of the run that issued it (build, train_step, optimizer, save, eval), for messages."""
    ident: str = ""
    """What a collective carries, where the members must agree on more than its size: a data-parallel bucket's
    or a ZeRO-1 broadcast's parameter names (NCCL sums two equal-size buckets swapped on one replica without
    a word); "" when the kind and size are all there is."""
    root: int | None = None
    """A broadcast's (reduce's) source global rank; None for the others."""

    def members(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.comm.split(":", 1)[1].rsplit("#", 1)[0].strip("()").split(",") if x.strip())

    def describe(self) -> str:
        if self.p2p:
            return f"{self.kind}[{', '.join(f'{d} {p} ({nb} bytes)' for d, p, nb in self.p2p)}] on {self.comm} ({self.label})"
        root = f" from {self.root}" if self.root is not None else ""
        ident = f" [{self.ident[:60]}]" if self.ident else ""
        return f"{self.kind}{root} of {self.nbytes} bytes{ident} on {self.comm or 'the host'} ({self.label})"


@dataclass
class Deadlock:
    """Where a world's programs stop: per blocked rank, its started operations and what each waits for."""

    blocked: dict[int, list[str]]
    """rank -> lines "<op> waits for <what>"."""

    def describe(self, limit: int = 8) -> str:
        lines = [f"rank {r}: " + "; ".join(w) for r, w in sorted(self.blocked.items())[:limit]]
        more = len(self.blocked) - limit
        return "deadlock:\n  " + "\n  ".join(lines) + (f"\n  ... and {more} more ranks" if more > 0 else "")


def _keys(program: list[CommOp], rank: int):
    """Per op: a collective's (comm, k, kind, bytes, identity, root); a batch's component keys (comm, src,
    dst, j, bytes)."""
    coll: dict[str, int] = {}
    chan: dict[tuple, int] = {}
    out = []
    for op in program:
        if op.lane == "sync":
            out.append(None)
        elif op.p2p:
            comps = []
            for d, peer, nb in op.p2p:
                src, dst = (rank, peer) if d == "send" else (peer, rank)
                c = (op.comm, src, dst, d)
                j = chan.get(c, 0)
                chan[c] = j + 1
                comps.append((op.comm, src, dst, j, nb))
            out.append(tuple(comps))
        else:
            k = coll.get(op.comm, 0)
            coll[op.comm] = k + 1
            out.append((op.comm, k, op.kind, op.nbytes, op.ident, op.root))
    return out


def replay_world(programs: dict[int, list[CommOp]]) -> Deadlock | None:
    """Replay every rank's program (module docstring); None when all finish."""
    keys = {r: _keys(p, r) for r, p in programs.items()}
    pos = dict.fromkeys(programs, 0)  # the host thread's next op
    queue = {r: deque() for r in programs}  # issued device ops, in order
    matched: set = set()  # p2p components whose both sides have started (rendezvous done)
    while True:
        progressed = False
        for r, prog in programs.items():  # the host walks on until it blocks
            while pos[r] < len(prog):
                op = prog[pos[r]]
                if op.lane == "dev":
                    queue[r].append(pos[r])
                elif op.lane == "sync":
                    if queue[r]:
                        break
                else:
                    break  # a host collective: started, completes below
                pos[r] += 1
                progressed = True
        started: dict[int, list[int]] = {}
        for r, prog in programs.items():
            s = []
            if queue[r]:
                s.append(queue[r][0])
            if pos[r] < len(prog) and prog[pos[r]].lane == "host":
                s.append(pos[r])
            started[r] = s
        coll_at: dict[tuple, set] = {}
        comp_at: dict[tuple, set] = {}
        for r, idxs in started.items():
            for i in idxs:
                k = keys[r][i]
                if programs[r][i].p2p:
                    for c in k:
                        comp_at.setdefault(c, set()).add(r)
                else:
                    coll_at.setdefault(k, set()).add(r)
        matched.update(c for c, rs in comp_at.items() if len(rs) == 2)
        completed = []
        for r, idxs in started.items():
            for i in idxs:
                op, k = programs[r][i], keys[r][i]
                if op.p2p:
                    if all(c in matched for c in k):
                        completed.append((r, i))
                elif set(op.members()) <= coll_at.get(k, set()):
                    completed.append((r, i))
        for r, i in completed:
            progressed = True
            if queue[r] and queue[r][0] == i:
                queue[r].popleft()
            else:
                pos[r] += 1
        if not progressed:
            break
    blocked = {}
    for r, prog in programs.items():
        if pos[r] < len(prog) or queue[r]:
            waits = []
            for i in ([queue[r][0]] if queue[r] else []) + ([pos[r]] if pos[r] < len(prog) else []):
                op = prog[i]
                if op.lane == "sync":
                    waits.append(f"{op.describe()} waits for its device queue")
                    continue
                if op.p2p:
                    peers = sorted({p for _d, p, _nb in op.p2p})
                    waits.append(f"{op.describe()} waits for ranks {peers}")
                else:
                    waits.append(f"{op.describe()} waits for members {list(op.members())}")
            blocked[r] = waits
    return Deadlock(blocked) if blocked else None
