"""Turn one rank's failure into every rank's prompt exit, instead of a hang until a collective timeout.

A pipeline rank that raises leaves its peers blocked in a receive or a collective, by default for the
process group's timeout (10 minutes to hours). The watchdog shares two facts through the launcher's
key-value store (the one torch.distributed rendezvoused with, so no extra port):
- a failure note: a rank that raises writes "rank R: <error>" before it dies; everyone else sees it
  within a poll interval and exits non-zero naming R;
- a heartbeat: each rank bumps a counter every interval; a rank whose counter stops moving for
  `dead_after_s` (killed with SIGKILL, OOM-killed, a lost node) is declared dead and named.
Counters, not timestamps, so clocks of different nodes never matter.

It also watches this rank's own progress (`Progress`, set by the executor on the compute thread): the
pass it runs and what that pass waits for (a receive's batch, a collective chain). Each heartbeat
publishes it, and the beat carries the count of passes finished; when, inside a step, no rank has
finished a pass for `stall_after_s` (a hang: a peer stuck in a kernel, a collective no rank will ever
join, a deadlocked order), the first rank to see it prints every rank's pass and what it waits for, and
the job ends as for a failure (every rank exits non-zero). A rank that waits long in one pass while its
peers still progress is not stalled.

On a GPU the host runs ahead of the device: `end_step` comes before the step's only host wait, so a hang
inside a kernel or NCCL would show every rank "between steps". Each pass therefore hands its end mark
(the step clock's CUDA event, runtime/clock.py) to `Progress.finished`; the watchdog polls
`event.query()` (never blocks), and while marks are outstanding the rank counts as busy: the report names
the last pass the device finished and the one it is still on, also between steps. On CPU the host is the
device (the host clock's marks are plain numbers, nothing to track); a test hands in marks that complete
later, or never.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch.distributed as dist

from vp_accelerate.distributed import start_thread

_PREFIX = "vp_watchdog"
_LOST = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|Connection refused", re.I)
"""How gloo (and the store) say that the other end of a connection went away."""


class Progress:
    """What this rank's executor is doing now: written by the compute thread (plain attribute stores,
    nothing blocks), read by the watchdog's thread."""

    def __init__(self) -> None:
        self.in_step = False
        self.current = ""
        """The pass running (e.g. "F(mb=3, chunk=1)"), "" between passes."""
        self.waits_for = ""
        """What that pass waits for now, "" while it computes."""
        self.passes_done = 0
        self.last_done = time.monotonic()
        """When the last pass finished (or the step began)."""
        self.device_pending: deque = deque()
        """(pass, mark) the device has not finished yet, in issue order (marks with `query()`)."""
        self.device_last = ""
        """The last pass the device finished (as last polled)."""
        self.device_done = 0
        self.device_since = time.monotonic()
        """When the device was last seen finishing a pass (or was handed one while idle)."""
        self.track_device = False
        """Whether device marks are kept: only while a watchdog thread polls them (`Watchdog` sets it); without
        one a kept mark would never be retired (a CUDA event per pass, for the life of the process)."""
        self.in_wait = ""
        """A labelled wait outside the schedule's passes (the step's end: "DP bucket 7/18", "loss sum",
        "ZeRO broadcast 3/5", or a collective between steps), "" when none: `begin_wait` / `end_wait`."""

    def begin_step(self) -> None:
        self.current, self.waits_for, self.last_done, self.in_step = "", "", time.monotonic(), True

    def enter(self, name: str) -> None:
        self.current, self.waits_for = name, ""

    def waiting(self, what: str) -> None:
        self.waits_for = what

    def finished(self, mark=None) -> None:
        """The host finished the running pass; `mark` is its end on the device (a CUDA event: tracked
        until `query()` says the device got there; anything else: the host is the device)."""
        if mark is not None and hasattr(mark, "query") and self.track_device:
            if not self.device_pending:
                self.device_since = time.monotonic()
            self.device_pending.append((self.current, mark))
        self.passes_done += 1
        self.current, self.waits_for, self.last_done = "", "", time.monotonic()

    def begin_wait(self, label: str) -> bool:
        """A wait on a collective begins. Inside a pass it is what the pass waits for (False: `end_wait`
        then only restores that); outside the passes (the step's end, between steps) it counts as a pass of
        its own, `label`, whose stall the watchdog sees like a pass's (True)."""
        if self.in_step and self.current:
            self.waits_for = label
            return False
        self.current, self.waits_for, self.in_wait, self.last_done = label, "", label, time.monotonic()
        return True

    def end_wait(self, own: bool, mark=None) -> None:
        """The wait `begin_wait` began is over on the host; `mark` is its end on the device (a CUDA event
        after the collective on the current stream: NCCL's wait returns before the device got there)."""
        if not own:
            self.waits_for = ""
            return
        self.in_wait = ""
        self.finished(mark)

    def poll_device(self) -> None:
        """Retire the device marks that completed, in order (never blocks; the watchdog's thread)."""
        while self.device_pending:
            name, mark = self.device_pending[0]
            if not mark.query():
                return
            self.device_pending.popleft()
            self.device_last, self.device_done, self.device_since = name, self.device_done + 1, time.monotonic()

    def device_busy(self) -> bool:
        return bool(self.device_pending)

    def describe_device(self) -> str:
        if not self.device_pending:
            return ""
        last = self.device_last or "nothing yet"
        return f"; device: last finished {last}, still on {self.device_pending[0][0]}"

    def end_step(self) -> None:
        self.in_step = False
        self.current = self.waits_for = ""

    def describe(self) -> str:
        self.poll_device()
        if self.in_wait:
            where = "in the step's end" if not self.in_step else "in"
            return (
                f"{where}: {self.in_wait}, waits for its peers ({self.passes_done} passes done){self.describe_device()}"
            )
        if not self.in_step:
            return f"between steps ({self.passes_done} passes done){self.describe_device()}"
        where = f"in {self.current}" if self.current else "between passes"
        what = f"waits for {self.waits_for}" if self.waits_for else "computing"
        return f"{where}, {what} ({self.passes_done} passes done){self.describe_device()}"

    def stalled_for(self) -> float:
        """Seconds since a pass last finished: on the host inside a step or a labelled wait (`begin_wait`), on
        the device while it still has passes to finish (also between steps); 0 when neither works."""
        self.poll_device()
        now = time.monotonic()
        host = now - self.last_done if self.in_step or self.in_wait else None
        device = now - self.device_since if self.device_pending else None
        if host is None and device is None:
            return 0.0
        return min(x for x in (host, device) if x is not None)


class Watchdog:
    """Background thread: heartbeat this rank, watch the others, exit the process if one fails."""

    def __init__(
        self,
        interval_s: float = 1.0,
        dead_after_s: float = 60.0,
        name: str = "default",
        stall_after_s: float | None = None,
    ):
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self.stall_after_s = stall_after_s
        self.progress = Progress()
        """This rank's executor's progress (the executor is handed this object)."""
        self._published = ""
        self.key = f"{_PREFIX}/{name}"
        self._stop = threading.Event()
        self._beats = 0
        self.store.set(f"{self.key}/beat/{self.rank}", "0")
        self.progress.track_device = True  # this thread retires the device marks
        self._thread = start_thread(self._run, "vp-watchdog")  # on this rank's GPU (its `query()`), not GPU 0

    def report_failure(self, error: BaseException) -> None:
        """Tell every peer that this rank failed (call before re-raising)."""
        try:
            self.store.set(f"{self.key}/failed", f"rank {self.rank}: {type(error).__name__}: {error}")
        except Exception:  # noqa: BLE001 - the store may be gone already; the heartbeat still reports us
            pass

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop watching (at a normal end: peers may then finish or exit in any order).

        Joins the thread: one still inside a store call while the interpreter tears the process group
        down aborts the process ("terminate called without an active exception")."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s)
        # nobody polls the device marks any more: keep none (an executor may run on without a watchdog)
        self.progress.track_device = False
        self.progress.device_pending.clear()
        try:
            self.store.set(f"{self.key}/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    @staticmethod
    def lost_peer(error: BaseException) -> bool:
        """Whether `error` (or what caused it) is a connection a peer closed: the peer died (killed, out of
        memory) or left."""
        while error is not None:
            if _LOST.search(str(error)):
                return True
            error = error.__cause__ or error.__context__
        return False

    def stop_for_lost_peer(self, error: BaseException, where: str = "in the middle of a step") -> None:
        """End this rank with one line after a peer's connection closed under it: the peer's own failure note
        when it left one (it raised), else the connection that was lost (killed: no note). Never returns."""
        note = None
        try:
            if self.store.check([f"{self.key}/failed"]):
                note = self.store.get(f"{self.key}/failed").decode()
        except Exception:  # noqa: BLE001 - the store went with rank 0 (killed): no note to read
            pass
        if note and not note.startswith(f"rank {self.rank}:"):
            self._exit(f"peer failed — {note}")
        match = _LOST.search(str(error)) or _LOST.search(str(error.__cause__ or error.__context__))
        self._exit(
            f"a peer's connection closed {where} ({match.group(0) if match else error}): "
            "the peer was killed, ran out of memory or crashed; its own log says why"
        )

    def stop_for_peer_failure(self, error: BaseException, label: str = "", wait_s: float | None = None) -> None:
        """After a collective failed under this rank: a peer's failure note (it may still be on its way: wait
        up to two heartbeats) or a lost connection ends this rank with one line (never returns); an error
        of this rank's own returns, to be raised."""
        deadline = time.monotonic() + (2 * self.interval_s if wait_s is None else wait_s)
        while True:
            try:
                if self.store.check([f"{self.key}/failed"]):
                    note = self.store.get(f"{self.key}/failed").decode()
                    if not note.startswith(f"rank {self.rank}:"):
                        self._exit(f"peer failed — {note}")
                    # this rank already failed or stalled (said above): its peers left the collective for that
                    self._exit(f"after its own failure (above), a collective failed too: {_first_line(error)}")
            except Exception:  # noqa: BLE001 - the store went with rank 0: a lost connection, said below
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if self.lost_peer(error):
            self.stop_for_lost_peer(error, f"in {label}" if label else "in a collective")

    def _exit(self, why: str) -> None:
        print(f"[vp-accelerate] rank {self.rank} stops: {why}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in range(self.world) if r != self.rank}
        passes = {r: 0 for r in range(self.world)}  # every rank's finished passes, as last published
        progressed = time.monotonic()  # when some rank last finished a pass (as this rank saw it)
        while not self._stop.wait(self.interval_s):
            try:
                self._beats += 1
                # the beat carries this rank's count of finished passes: a stall is no pass on ANY rank
                done = self.progress.passes_done + self.progress.device_done  # host and device passes
                self.store.set(f"{self.key}/beat/{self.rank}", f"{self._beats} {done}")
                self._publish_progress()
                if self.store.check([f"{self.key}/failed"]):
                    note = self.store.get(f"{self.key}/failed").decode()
                    if not note.startswith(f"rank {self.rank}:"):
                        self._exit(f"peer failed — {note}")
                now = time.monotonic()
                counts = {self.rank: self.progress.passes_done + self.progress.device_done}
                for r, (last, since) in list(seen.items()):
                    if self.store.check([f"{self.key}/done/{r}"]):
                        del seen[r]  # finished normally
                        continue
                    beat, _, done = self.store.get(f"{self.key}/beat/{r}").decode().partition(" ")
                    counts[r] = int(done or 0)
                    if int(beat) != last:
                        seen[r] = (int(beat), now)
                    elif now - since > self.dead_after_s:
                        self._exit(f"rank {r} stopped answering for {self.dead_after_s:.0f} s (killed or hung)")
                if any(passes.get(r) != n for r, n in counts.items()):
                    passes.update(counts)
                    progressed = now
                # a rank that waits long in one pass while its peers progress is not stalled: only a step
                # in which no rank finished a pass for stall_after_s is
                stalled = min(self.progress.stalled_for(), now - progressed)
                if self.stall_after_s is not None and stalled > self.stall_after_s:
                    self._stall(stalled)
            except Exception:  # noqa: BLE001
                # The store lives with rank 0 and goes when it exits, normally at the end of a run. A rank
                # 0 that died mid-step closes its sockets, which its peers' receives report on their own;
                # a rank inside a pass that does not communicate (stalled) would not notice: it stops here.
                if (self.progress.in_step or self.progress.in_wait) and not self._stop.is_set():
                    self._exit("lost the launcher's key-value store (rank 0 exited) in the middle of a step")
                return

    def _publish_progress(self) -> None:
        text = self.progress.describe()
        if text != self._published:
            self.store.set(f"{self.key}/pass/{self.rank}", text)
            self._published = text

    def _stall(self, seconds: float) -> None:
        """No pass finished for `seconds`: print every rank's pass and what it waits for, end the job."""
        time.sleep(1.5 * self.interval_s)  # every live peer publishes its state once more meanwhile
        self._publish_progress()
        lines = []
        for r in range(self.world):
            key = f"{self.key}/pass/{r}"
            state = self.store.get(key).decode() if self.store.check([key]) else "no report yet"
            lines.append(f"  rank {r}: {state}")
        table = "\n".join(lines)
        print(
            f"[vp-accelerate] rank {self.rank}: no pass finished for {seconds:.0f} s (watchdog_stall_s="
            f"{self.stall_after_s:g}); where every rank is:\n{table}",
            file=sys.stderr,
            flush=True,
        )
        self.report_failure(RuntimeError(f"stalled: no pass finished for {seconds:.0f} s\n{table}"))
        # peers read the note at their next heartbeat; rank 0 hosts the store, which goes with it
        time.sleep(2 * self.interval_s)
        self._exit("stalled (see above)")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


_ACTIVE: Watchdog | None = None


def start(dead_after_s: float, stall_after_s: float | None = None) -> Watchdog:
    """The process's watchdog, started on first use: one thread however many models a process builds
    (the latest model's `stall_after_s` applies). At interpreter exit `runtime/shutdown.py`'s hook stops it,
    after the communication workers drained (a peer that dies meanwhile is still seen): no exit hook of its
    own, which would run first (atexit runs the last registered first)."""
    global _ACTIVE
    if _ACTIVE is None or _ACTIVE.stopped:
        _ACTIVE = Watchdog(dead_after_s=dead_after_s, stall_after_s=stall_after_s)
    _ACTIVE.stall_after_s = stall_after_s
    return _ACTIVE


def active() -> Watchdog | None:
    """The process's running watchdog, None when there is none (one rank, disabled, stopped)."""
    return _ACTIVE if _ACTIVE is not None and not _ACTIVE.stopped else None


def _device_mark(device):
    """A CUDA event recorded now on `device`'s current stream (what a collective's wait queued), else None."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@contextmanager
def waiting(label: str, device=None):
    """Wrap a wait on a collective, so the watchdog sees it. Outside the schedule's passes (the step's end:
    the DP buckets, the tied and loss sums, the clip norm, the fp16 overflow check, the ZeRO broadcasts; a
    collective between steps) the wait counts as a pass named `label`: a rank stuck there (or its device,
    through a CUDA event recorded after the collective on `device`'s stream) stalls like a pass, and every
    rank prints one line within `stall_after_s`. Inside a pass it is what the pass waits for.

    A failure of the collective that a peer caused (a peer reported its own failure, or its connection
    closed) ends this rank with the watchdog's one line, not gloo's traceback: a peer that raised between
    steps leaves its peers in a collective it never joins (or one of another size)."""
    dog = active()
    if dog is None:
        yield
        return
    own = dog.progress.begin_wait(label)
    try:
        yield
    except Exception as e:
        dog.progress.end_wait(own)
        dog.stop_for_peer_failure(e, label)
        raise
    dog.progress.end_wait(own, _device_mark(device) if dog.progress.track_device else None)
