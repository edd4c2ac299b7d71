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
3. the process groups (destroyed);
4. torch's gloo worker threads (`pt_gloo_runloop`, two per gloo group): waited for until each is parked in
   its wait for new work (`gloo_threads_busy`). Such a thread marks a collective complete (the caller's
   `wait()` returns) and only then drops its reference to the finished work; when that is the last one, the
   work's tensors are released there, and torch (2.13) releases a tensor that has a Python object under
   the GIL (`TensorImpl::decref_pyobject`). A thread still that far behind when the interpreter starts
   finalizing (the script ended: a loaded machine leaves a thread unscheduled for a while) is ended by
   CPython inside that destructor (`take_gil` -> `pthread_exit`), whose unwinding through a `noexcept`
   frame calls std::terminate: SIGABRT after the script's last line. Plain torch does it too (one
   synchronous gloo all-reduce and the script's end); docs/reliability.md has the stack.
A thread that is still inside a collective after `WAIT_S` (a gloo worker still busy after `GLOO_WAIT_S`) would
abort the process later: the hook then says so in one line and leaves at once with exit 1 (`os._exit`, after
flushing), before any teardown.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import platform
import sys
import time

import torch.distributed as dist

from vp_accelerate.runtime import watchdog
from vp_accelerate.vocab import comm

WAIT_S = comm.CLOSE_WAIT_S
"""How long the exit waits for a communication worker's queued chains, and for the watchdog's thread."""

GLOO_WAIT_S = 60.0
"""How long the exit waits for torch's gloo worker threads to let go of their finished collectives."""

_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
"""The futex syscall's number on this machine (None: unknown, the gloo threads are not checked)."""

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
    # the groups' C++ objects (and their threads) live on until the interpreter frees the last Python reference
    # while it finalizes; by then no gloo worker may still hold a finished collective (module docstring)
    deadline = time.monotonic() + GLOO_WAIT_S
    while gloo_threads_busy():
        if time.monotonic() > deadline:
            _leave_now(f"{len(gloo_threads_busy())} gloo worker thread(s) still busy after {GLOO_WAIT_S:.0f} s")
        time.sleep(0.002)  # the GIL is free meanwhile: a worker that must release a tensor under it can


def gloo_threads_busy() -> list[int]:
    """The ids of this process's gloo worker threads (`pt_gloo_runloop`) that are not parked: running, runnable,
    waiting for a lock (the work queue's mutex) or for the GIL (a timed wait). Parked means blocked in a
    condition-variable wait without a timeout (FUTEX_WAIT_BITSET, no timeout), where such a thread waits for
    new work once it dropped every reference to the work it ran. A worker blocked inside a collective, waiting
    for its peer, looks the same: the exit hook first waits for the communication workers' chains, so no
    collective of the pipeline is in flight by then. Read from /proc/self/task (Linux); [] where that cannot
    be read.
    """
    if _FUTEX is None:
        return []
    busy = []
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"{task}/syscall") as f:
                call = f.read().split()
        except OSError:  # the thread ended meanwhile, or /proc is not readable here
            continue
        if not _parked(call):
            busy.append(int(os.path.basename(task)))
    return busy


def _parked(call: list[str]) -> bool:
    """Whether /proc/<tid>/syscall's fields are a condition variable's futex wait (FUTEX_WAIT_BITSET) with no
    timeout (a mutex waits with FUTEX_WAIT, the GIL with a timeout)."""
    try:
        number, op, timeout = int(call[0]), int(call[2], 16), int(call[4], 16)
    except (IndexError, ValueError):  # "running", or a thread not in a syscall
        return False
    return number == _FUTEX and (op & 0x7F) == 9 and timeout == 0


def _leave_now(why: str) -> None:
    """Exit 1 at once, without the interpreter's teardown (which would abort on the stuck thread)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else os.environ.get("RANK", "?")
    print(f"[vp-accelerate] rank {rank} stops at exit: {why}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(1)
