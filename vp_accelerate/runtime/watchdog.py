"""Turn one rank's failure into every rank's prompt exit, instead of a hang until a collective timeout.

A pipeline rank that raises leaves its peers blocked in a receive or a collective, by default for the
process group's timeout (10 minutes to hours). The watchdog shares two facts through the launcher's
key-value store (the one torch.distributed rendezvoused with, so no extra port):
- a failure note: a rank that raises writes "rank R: <error>" before it dies; everyone else sees it
  within a poll interval and exits non-zero naming R;
- a heartbeat: each rank bumps a counter every interval; a rank whose counter stops moving for
  `dead_after_s` (killed with SIGKILL, OOM-killed, a lost node) is declared dead and named.
Counters, not timestamps, so clocks of different nodes never matter.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import torch.distributed as dist

_PREFIX = "vp_watchdog"


class Watchdog:
    """Background thread: heartbeat this rank, watch the others, exit the process if one fails."""

    def __init__(self, interval_s: float = 1.0, dead_after_s: float = 60.0, name: str = "default"):
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self.key = f"{_PREFIX}/{name}"
        self._stop = threading.Event()
        self._beats = 0
        self.store.set(f"{self.key}/beat/{self.rank}", "0")
        self._thread = threading.Thread(target=self._run, name="vp-watchdog", daemon=True)
        self._thread.start()

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
        try:
            self.store.set(f"{self.key}/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    def _exit(self, why: str) -> None:
        print(f"[vp-accelerate] rank {self.rank} stops: {why}", file=sys.stderr, flush=True)
        os._exit(1)

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in range(self.world) if r != self.rank}
        while not self._stop.wait(self.interval_s):
            try:
                self._beats += 1
                self.store.set(f"{self.key}/beat/{self.rank}", str(self._beats))
                if self.store.check([f"{self.key}/failed"]):
                    note = self.store.get(f"{self.key}/failed").decode()
                    if not note.startswith(f"rank {self.rank}:"):
                        self._exit(f"peer failed — {note}")
                now = time.monotonic()
                for r, (last, since) in list(seen.items()):
                    if self.store.check([f"{self.key}/done/{r}"]):
                        del seen[r]  # finished normally
                        continue
                    beat = int(self.store.get(f"{self.key}/beat/{r}"))
                    if beat != last:
                        seen[r] = (beat, now)
                    elif now - since > self.dead_after_s:
                        self._exit(f"rank {r} stopped answering for {self.dead_after_s:.0f} s (killed or hung)")
            except Exception:  # noqa: BLE001
                # The store lives with rank 0 and goes when it exits, normally at the end of a run. A rank
                # 0 that died mid-step closes its sockets, which its peers' receives report on their own.
                return


_ACTIVE: Watchdog | None = None


def start(dead_after_s: float) -> Watchdog:
    """The process's watchdog, started on first use: one thread however many models a process builds.
    It is stopped at interpreter exit if nobody stopped it before."""
    global _ACTIVE
    if _ACTIVE is None or _ACTIVE.stopped:
        _ACTIVE = Watchdog(dead_after_s=dead_after_s)
        atexit.register(_ACTIVE.stop)
    return _ACTIVE
