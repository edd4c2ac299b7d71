"""A clean exit for every rank, whether or not `PipelineModel.close()` was called.

At interpreter exit, a thread still inside a collective or a store call, or a process group torn down by
static destructors after Python is gone, can abort the process ("terminate called without an active
exception", SIGABRT) although the script had finished. `register()` installs one `atexit` hook, run
before torch's own teardown, that stops in order: the communication workers (vocabulary chains, strict
p2p batches; they finish what is queued), the watchdog thread, and then destroys the process groups.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

from vp_accelerate.runtime import watchdog
from vp_accelerate.vocab import comm

_REGISTERED = False


def register() -> None:
    """Install the exit hook (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(shutdown)
        _REGISTERED = True


def shutdown() -> None:
    """Stop the workers and the watchdog, then destroy the process groups (idempotent)."""
    stuck = comm.close_workers()
    if watchdog._ACTIVE is not None:
        watchdog._ACTIVE.stop()
    # a worker still inside a collective (a failed run) would crash on a destroyed group: leave it then
    if not stuck and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already torn down by its owner
            pass
