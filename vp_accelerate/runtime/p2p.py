"""p2p batches as the executor posts them, and NCCL's p2p semantics emulated on gloo.

`Batch` is one `batch_isend_irecv` of the IR (`schedule.ir.p2p_batches`) and completes as a whole: it
waits on every Work torch returned and never pairs them with the ops — on NCCL the call coalesces the
batch and returns ONE Work, on gloo one Work per op.

gloo cannot show what NCCL does with an order, so `VP_STRICT_P2P` makes `install()` replace
`torch.distributed.batch_isend_irecv` (for gloo groups; NCCL groups keep the real one) with an
emulation (the test suite runs under it):
- `1` / `strict`: one Work per batch; a rank's batches of one group run one after the other, in issue
  order, on a worker thread of their own (NCCL: one stream per communicator); each send goes only
  after the peer has posted the matching receive (a small "posted" note, tag 1), so a send completes
  only once its receive is posted, as NCCL's large sends do. An order that would hang on NCCL hangs
  here too, and after `VP_STRICT_P2P_TIMEOUT` seconds (default 300) the worker gives up with an error
  naming the stuck batch; the executor re-raises it and the watchdog ends every rank.
  Each batch's one Work holds its tensors until it is waited on, as torch's Works do (a send's tensor
  stays alive until the sender waits, however early the receiver got it).
- `serial`: as `strict`, and every group of the rank shares one worker (vocab/comm.py), so the p2p
  batches, the vocabulary collectives and every other collective the runtime issues on a device group
  (`collective`: the data-parallel bucket all-reduce, ZeRO-1's broadcasts, the tied and loss sums, the
  norm) progress in one issue order (NCCL with CUDA_DEVICE_MAX_CONNECTIONS=1).
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from vp_accelerate.runtime import watchdog
from vp_accelerate.vocab import comm

HANDSHAKE_TAG = 1  # data goes with tag 0 (P2POp's default); "receive posted" notes with this one
_ORIGINAL = dist.batch_isend_irecv


class Batch:
    """One posted p2p batch; `wait()` (idempotent) returns once every op of it is done."""

    def __init__(self, works, label: str):
        self._works = list(works)
        self.label = label
        """The batch's actions, for errors."""

    def wait(self) -> None:
        works, self._works = self._works, []  # a gloo Work must be waited on once
        for w in works:
            try:
                w.wait()
            except RuntimeError as e:
                raise RuntimeError(f"{e} (the batch: {self.label})") from e

    def is_completed(self) -> bool:
        """True when every op of the batch is done (a poll: never blocks). A Work holds its tensors until
        it is waited on and dropped, so the executor waits a completed send batch at once. gloo's own
        send Works report completion only once waited on; NCCL's and the emulation's report it when done."""
        return all(w.is_completed() for w in self._works)


def post(ops: list[dist.P2POp], label: str) -> Batch:
    """Post one p2p batch (whatever `batch_isend_irecv` is now: torch's, or the emulation, which names
    the batch by `label` in its errors)."""
    _POSTING[0] = label
    try:
        return Batch(dist.batch_isend_irecv(ops), label)
    finally:
        _POSTING[0] = None


_POSTING: list = [None]  # the actions of the batch being posted (torch's signature has no room for them)


def collective(fn, tensor: torch.Tensor, group, label: str, async_op: bool = False, **kwargs):
    """Issue `fn(tensor, group=group, **kwargs)` (dist.all_reduce, dist.broadcast), a collective on a device
    group outside the vocabulary chains. Under VP_STRICT_P2P=serial on gloo it runs on the rank's one
    communication worker, in issue order with the p2p batches and the vocabulary chains (NCCL with one
    connection); elsewhere it is torch's own call. With `async_op` returns a Work (`wait`,
    `is_completed`), else waits."""
    if comm.strict_mode() == "serial" and dist.get_backend(group) == "gloo":
        job = comm.worker(group).submit(lambda: fn(tensor, group=group, **kwargs))
        work = _JobWork(job, f"rank {dist.get_rank()}: {label}", strict_timeout_s(), [tensor])
    else:
        work = fn(tensor, group=group, async_op=True, **kwargs)
    if async_op:
        return work
    with watchdog.waiting(label, tensor.device):  # a rank stuck here is seen (the step's end, between steps)
        work.wait()
    return None


def wait_labelled(work, label: str, device) -> None:
    """Wait for an async collective's `work` (a data-parallel bucket, a ZeRO broadcast) as `label`, so that
    the watchdog can name it if it never completes."""
    with watchdog.waiting(label, device):
        work.wait()


def strict_timeout_s() -> float:
    return float(os.environ.get("VP_STRICT_P2P_TIMEOUT", "300"))


def install() -> bool:
    """Put the emulation in place when VP_STRICT_P2P asks for it, torch's own otherwise (idempotent);
    True if the emulation is active."""
    strict = comm.strict_mode() is not None
    dist.batch_isend_irecv = _strict_batch_isend_irecv if strict else _ORIGINAL
    return strict


def _strict_batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list:
    group = p2p_op_list[0].group
    if dist.get_backend(group) != "gloo":  # a real NCCL group already has these semantics
        return _ORIGINAL(p2p_op_list)
    rank = dist.get_rank()
    counts = _COUNTS.setdefault(group, [0])
    counts[0] += 1
    what = _POSTING[0] or ", ".join(
        f"{'send to' if op.op is dist.isend else 'receive from'} rank {op.peer}" for op in p2p_op_list
    )
    label = f"rank {rank}: p2p batch #{counts[0]} [{what}]"
    timeout_s = strict_timeout_s()
    job = comm.worker(group).submit(lambda: _run_batch(p2p_op_list, label, timeout_s))
    # ONE Work for the whole batch, as on NCCL, holding the batch's tensors until it is waited on
    return [_JobWork(job, label, timeout_s, [op.tensor for op in p2p_op_list])]


_COUNTS: dict = {}  # group -> batches posted on it (for names in errors)


class _JobWork:
    """The single Work of an emulated batch: done when the worker has finished the batch.

    Like torch's Works (NCCL's keeps its tensors alive for the caching allocator until waited on), it
    holds the batch's tensors until `wait()` returns, so a caller that never waits on a completed send
    keeps the sent tensor alive under the emulation as it would on a GPU."""

    def __init__(self, job, label: str, timeout_s: float, tensors: list):
        self.job, self.label, self.timeout_s = job, label, timeout_s
        self._tensors = tensors

    def wait(self, timeout=None) -> bool:
        # the worker gives up after timeout_s on its own; the margin covers the batches queued before
        if not self.job.finished.wait(self.timeout_s * 2 + 30):
            raise RuntimeError(f"{self.label} never started: an earlier p2p batch of this rank is stuck")
        if self.job.error is not None:
            raise RuntimeError(str(self.job.error)) from self.job.error
        self.job.result()
        self._tensors = []
        return True

    def is_completed(self) -> bool:
        return self.job.finished.is_set()


def _wait(work, deadline: float, label: str, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError as e:
        if time.monotonic() < deadline and "imed out" not in str(e):
            raise  # a real failure (a peer died), not a wait that never ends
        raise RuntimeError(
            f"{label} did not complete in {strict_timeout_s():.0f} s under NCCL semantics: {what}. On NCCL this "
            "order would hang (a send completes only once the peer has posted the matching receive, and a "
            "rank's p2p batches complete in issue order); schedule.validate replays an order under these "
            "rules"
        ) from e


def _run_batch(ops: list[dist.P2POp], label: str, timeout_s: float) -> None:
    """On the worker: every receive first tells its peer it is posted; every send waits for that note
    before it goes; the batch is done when all of its ops are."""
    group = ops[0].group
    if group in _FAILED:  # the batches behind a stuck one never run (NCCL: the stream is blocked)
        raise RuntimeError(f"{label} cannot run: {_FAILED[group]}")
    try:
        _post_and_wait(ops, label, time.monotonic() + timeout_s)
    except RuntimeError as e:
        _FAILED[group] = str(e)
        comm.fail(str(e))  # whatever this rank's compute thread waits on now, it learns of it at once
        raise


_FAILED: dict = {}  # group -> the error of its first failed batch


def _post_and_wait(ops: list[dist.P2POp], label: str, deadline: float) -> None:
    notes, data = [], []
    for op in ops:
        if op.op is dist.irecv:
            notes.append(dist.isend(torch.ones(1, dtype=torch.uint8), op.peer, group=op.group, tag=HANDSHAKE_TAG))
            data.append(
                (dist.irecv(op.tensor, op.peer, group=op.group, tag=op.tag), f"its receive from rank {op.peer}")
            )
    for op in ops:
        if op.op is dist.isend:
            note = torch.empty(1, dtype=torch.uint8)
            _wait(
                dist.irecv(note, op.peer, group=op.group, tag=HANDSHAKE_TAG),
                deadline,
                label,
                f"its send to rank {op.peer} waits for that rank to post the matching receive",
            )
            data.append((dist.isend(op.tensor, op.peer, group=op.group, tag=op.tag), f"its send to rank {op.peer}"))
    for work, what in data:
        _wait(work, deadline, label, f"{what} did not finish")
    for work in notes:  # the peer took the note before it sent what this batch received
        _wait(work, deadline, label, "a receive-posted note was never taken")
