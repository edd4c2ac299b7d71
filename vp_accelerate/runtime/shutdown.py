"""A clean exit for every rank, whether or not `PipelineModel.close()` was called.

At interpreter exit, a daemon thread still inside a C++ call (a collective, a store call) aborts the
process when that call returns after the interpreter started finalizing: Python ends such a thread with
`pthread_exit`, whose unwinding through torch's C++ frames calls std::terminate ("terminate called without
an active exception", SIGABRT, exit 134) although the script had finished. A loaded machine makes it
likely: a peer that is seconds late keeps this rank's last chain in its collective past any short wait.

`register()` installs one `atexit` hook, run before torch's own teardown, that stops in order:
1. the communication workers (vocabulary chains, strict p2p batches): each finishes what is queued, as
   long as it takes (up to `WAIT_S`); the watchdog still runs meanwhile, so a peer that died ends this
   rank with its one line rather than a hang;
2. the watchdog thread (waited for until it left its store call);
3. the process groups (destroyed).
A thread that is still inside a collective after `WAIT_S` would abort the process later: the hook then
says so in one line and leaves at once with exit 1 (`os._exit`, after flushing), before any teardown.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import torch.distributed as dist

from vp_accelerate.runtime import watchdog
from vp_accelerate.vocab import comm

WAIT_S = comm.CLOSE_WAIT_S
"""How long the exit waits for a communication worker's queued chains, and for the watchdog's thread."""

_REGISTERED = False


def register() -> None:
    """Install the exit hook (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(shutdown)
        _REGISTERED = True


def shutdown() -> None:
    """Stop the workers and the watchdog, then destroy the process groups (idempotent)."""
    stuck = comm.close_workers(timeout_s=WAIT_S)
    dog = watchdog._ACTIVE
    if dog is not None:
        dog.stop()
        # stop() waits a few heartbeats; a store call slowed by load may take longer: wait it out here
        dog._thread.join(WAIT_S)
        stuck += dog._thread.is_alive()
    if stuck:
        _leave_now(f"{stuck} communication thread(s) still inside a collective or store call after {WAIT_S:.0f} s")
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already torn down by its owner
            pass


def _leave_now(why: str) -> None:
    """Exit 1 at once, without the interpreter's teardown (which would abort on the stuck thread)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else os.environ.get("RANK", "?")
    print(f"[vp-accelerate] rank {rank} stops at exit: {why}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(1)
