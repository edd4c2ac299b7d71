"""How the vocabulary collectives run: a `Pending` handle per chain, and the engine that progresses it.

Every collective entry point (C0, C1, C2, IF reduce, IB broadcast) is a *chain*: a function that runs
one or more collectives and the small compute between them (C1: max all-reduce -> rescale -> sums
all-reduce) and returns the step's result. The caller gets a `Pending` at once and only waits on it.

Why a chain must progress on its own: if a dependent collective (C1's sums need C1's max) were issued
by the consuming pass, every rank would wait for the slowest rank to reach its consumer. So:

- gloo (CPU tensors): one communication worker thread per process group runs the chains in
  submission order. One thread per group keeps the collective order identical on every rank (the
  callers submit in schedule order) and means the group is never used from two threads at once —
  gloo process groups are not safe for that. All collectives on a vocabulary group must therefore go
  through `submit` (the pipeline's p2p traffic uses another group).
- NCCL (CUDA tensors): the chain is issued at once on a dedicated CUDA stream that first waits for
  the compute stream (an event after the producer); the consumer's stream waits on the chain's
  done-event. No host synchronisation on the critical path. The caching allocator is told which
  streams use which tensors (`record_stream`) so a buffer is not reused while the other stream reads it.

With `async_op=False` the caller waits at once (same path, same order).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from vp_accelerate.distributed import start_thread


class Pending:
    """Handle of one collective chain in flight; `wait()` completes it and returns the chain's result."""

    def __init__(
        self, works: Sequence[Any] = (), finalize: Callable[[], Any] | None = None, *, job: Any = None, label: str = ""
    ):
        # works + finalize: collectives already issued on the caller's thread (kept for callers that
        # issue their own); job: a chain handed to a communication engine.
        self._works = [w for w in works if w is not None]
        self._finalize = finalize
        self._job = job
        self._done = False
        self._result: Any = None
        self.label = label
        """What the chain is (e.g. "C1"), for timelines."""

    @property
    def done(self) -> bool:
        """True once `wait()` has run (always true for a synchronous call)."""
        return self._done

    @property
    def timer(self) -> "_ThreadJob | _StreamJob | None":
        """What times the chain (`.span()`: its start and end as the communication lane ran it, in
        `time.perf_counter()` seconds on the worker thread, or CUDA events on the communication stream),
        None where nothing does (an already-issued work list). Holds no tensors once the chain's result
        was taken, so it may outlive the result (runtime/clock.py reads it after the step)."""
        return self._job if isinstance(self._job, (_ThreadJob, _StreamJob)) else None

    def ready(self) -> bool:
        """True when `wait()` would not block: the chain has finished (polled, never waited for)."""
        if self._done:
            return True
        if self._job is not None:
            return self._job.ready()
        return all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        """Wait for the chain and return its result (idempotent); re-raises the chain's error."""
        if not self._done:
            if self._job is not None:
                self._result = self._job.result()
            else:
                for w in self._works:
                    w.wait()
                self._works = []
                if self._finalize is not None:
                    self._result = self._finalize()
                    self._finalize = None
            self._done = True
        return self._result


def finish(pending: Pending, async_op: bool) -> Pending:
    """Complete `pending` now unless the caller asked for an asynchronous op."""
    if not async_op:
        pending.wait()
    return pending


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (torch's src/dst arguments want global ranks)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# ---- the engines ---------------------------------------------------------------------------------


def submit(
    chain: Callable[[], Any],
    group: dist.ProcessGroup | None,
    device: torch.device,
    inputs: Iterable[torch.Tensor] = (),
    label: str = "",
    async_op: bool = True,
) -> Pending:
    """Run `chain` (collectives on `group` and the compute between them) off the caller's critical path.

    `device` is where the chain's tensors live (CUDA: stream engine; else the group's worker thread).
    `inputs` are the tensors the chain reads that the caller's stream produced (CUDA only needs them).
    """
    if device.type == "cuda":
        job: Any = _StreamJob(chain, device, list(inputs))
    else:
        job = worker(group).submit(chain)
    return finish(Pending(job=job, label=label), async_op)


class _ThreadJob:
    """One chain queued on a `CommWorker`."""

    def __init__(self, chain: Callable[[], Any]):
        self.chain = chain
        self.finished = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.start = self.end = 0.0

    def run(self) -> None:
        self.start = time.perf_counter()
        try:
            with torch.no_grad():  # grad mode is per thread; the chains never build graphs
                self.value = self.chain()
        except BaseException as e:  # handed to the waiter, which re-raises it on its own thread
            self.error = e
        finally:
            self.chain = None
            self.end = time.perf_counter()
            self.finished.set()

    def ready(self) -> bool:
        return self.finished.is_set()

    def result(self) -> Any:
        """The chain's value (once: the job lets go of it so that it can be kept as a timer)."""
        while not self.finished.wait(0.25):
            if _FATAL:  # a communication failure elsewhere in this process means this chain cannot end
                raise RuntimeError(_FATAL[0])
        if self.error is not None:
            raise RuntimeError(f"a collective chain failed on the communication worker: {self.error}") from self.error
        value, self.value = self.value, None
        return value

    def span(self) -> tuple[float, float]:
        """(start, end) of the chain on the worker, in `time.perf_counter()` seconds (waits for it)."""
        self.finished.wait()
        return self.start, self.end


_FATAL: list[str] = []  # set once by `fail`: the process's communication is broken


def fail(message: str) -> None:
    """Record that this process's communication is broken (e.g. a p2p batch that can never complete
    under the NCCL emulation), so that a thread waiting on any chain raises `message` instead of waiting
    for the process group's timeout."""
    if not _FATAL:
        _FATAL.append(message)


CLOSE_WAIT_S = 300.0
"""How long closing a worker waits for its queued chains. Long: on a loaded machine a peer can be many
seconds late, and a chain left inside its collective either meets the next model's collectives on the same
group out of order or returns while the interpreter finalizes, which aborts the process."""


class CommWorker:
    """A single daemon thread that runs submitted chains one after another, in submission order."""

    def __init__(self, name: str = "vp-comm"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = start_thread(self._loop, name)  # on this rank's GPU, not GPU 0

    def submit(self, chain: Callable[[], Any]) -> _ThreadJob:
        job = _ThreadJob(chain)
        self._queue.put(job)
        return job

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.run()

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Stop after the chains already queued, waiting up to `timeout_s` for them; True if the thread ended
        (a daemon thread stuck in a collective is left behind)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


_WORKERS: dict[Any, CommWorker] = {}
_WORKERS_LOCK = threading.Lock()
_SERIAL = "serial"  # the one worker every group shares under VP_STRICT_P2P=serial


def strict_mode() -> str | None:
    """The NCCL emulation asked for by VP_STRICT_P2P (runtime/p2p.py): "strict", "serial" or None.
    Under "serial" every group shares one worker: all communicators of a rank progress in one issue
    order, as NCCL's do with CUDA_DEVICE_MAX_CONNECTIONS=1."""
    value = os.environ.get("VP_STRICT_P2P", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return None
    if value in ("1", "true", "yes", "on", "strict"):
        return "strict"
    if value == "serial":
        return "serial"
    raise ValueError(
        f"VP_STRICT_P2P={value!r}: use 1 (NCCL's p2p semantics on gloo), serial (also one issue "
        "order for all communicators of a rank), or 0"
    )


def worker(group: dist.ProcessGroup | None) -> CommWorker:
    """The communication worker of `group` (one per group and process, started on first use)."""
    key = dist.GroupMember.WORLD if group is None else group
    if strict_mode() == "serial":
        key = _SERIAL
    with _WORKERS_LOCK:
        w = _WORKERS.get(key)
        if w is None:
            w = _WORKERS[key] = CommWorker()
        return w


def close_worker(group: dist.ProcessGroup | None) -> None:
    """Stop `group`'s communication worker, if it has one (its queued chains finish first)."""
    key = dist.GroupMember.WORLD if group is None else group
    if strict_mode() == "serial":
        key = _SERIAL
    with _WORKERS_LOCK:
        w = _WORKERS.pop(key, None)
    if w is not None:
        w.close()


def close_workers(timeout_s: float = CLOSE_WAIT_S) -> int:
    """Stop every communication worker (e.g. before destroying the process groups), each after the chains
    already queued, waiting up to `timeout_s` for each; returns how many did not end (stuck in a collective)."""
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    return sum(not w.close(timeout_s) for w in workers)


_STREAMS: dict[torch.device, Any] = {}


def _comm_stream(device: torch.device):
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors reachable from a chain's result (a tensor, a list/tuple of them, or a dataclass state)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if is_dataclass(value) and not isinstance(value, type):
        return [t for f in fields(value) for t in _tensors(getattr(value, f.name))]
    return []


class _StreamJob:
    """A chain issued at once on the device's communication stream, ordered by events."""

    def __init__(self, chain: Callable[[], Any], device: torch.device, inputs: list[torch.Tensor]):
        self.device = device
        compute = torch.cuda.current_stream(device)
        comm = _comm_stream(device)
        ready = torch.cuda.Event()
        ready.record(compute)  # after the producer
        comm.wait_event(ready)
        # the chain's span on the device, for the timeline (runtime/clock.py); `done` orders the consumer too
        self.started = torch.cuda.Event(enable_timing=True)
        self.started.record(comm)
        for t in inputs:  # made on the compute stream, read on the comm stream: keep them until it has
            if t.is_cuda:
                t.record_stream(comm)
        with torch.cuda.stream(comm), torch.no_grad():
            self.value = chain()
        self.done = torch.cuda.Event(enable_timing=True)
        self.done.record(comm)

    def ready(self) -> bool:
        return self.done.query()

    def result(self) -> Any:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(self.done)  # the device waits, the host does not
        for t in _tensors(self.value):  # made on the comm stream, used (and freed) on the consumer's
            if t.is_cuda:
                t.record_stream(consumer)
        value, self.value = self.value, None  # as _ThreadJob: the job may outlive the result as a timer
        return value

    def span(self) -> tuple[Any, Any]:
        """(start, end) of the chain on the communication stream, as CUDA events."""
        return self.started, self.done
