"""Process-group plumbing shared by every layer: spawn local gloo ranks, and read a launcher's env.

`spawn` is what tests, the self-test and the benchmarks use to run a function on N local ranks
(gloo on CPU). Under `accelerate launch` / `torchrun` the processes already exist and
`init_from_env` joins the group they describe.

Each process's GPU is `cuda:LOCAL_RANK` (`local_device`), made the current device before any process
group exists: NCCL builds its communicators on the current device, so a process that never called
`torch.cuda.set_device` would put every rank of the machine on GPU 0. On NCCL the group is also created
with `device_id` (`init_kwargs`): torch then binds the group to that GPU and connects its communicator
at once (and those of later `new_group`s at their creation) instead of at their first operation, when
another communicator's kernels may be running (a known way to deadlock; runtime/groups.warm_up).

The same holds for the helper threads (the watchdog, the communication workers, the checkpoint writer): CUDA's
current device is per thread, and a new thread's is device 0. Their first CUDA call (an event's `query()` or
`synchronize()`) would create a context on GPU 0 for every rank of the node (about 0.5 GB each): they are
started with `start_thread`, which makes the starting thread's device theirs first.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import re
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def start_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    """Start `target` in a daemon thread whose current CUDA device is this thread's (when CUDA is in use in
    this process; nothing is initialised otherwise)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def free_port() -> int:
    """A TCP port on the loopback interface that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_device(strict: bool | None = None) -> torch.device:
    """This process's device, made current: `cuda:LOCAL_RANK` when CUDA is available and LOCAL_RANK is
    set, else the current CUDA device, else the CPU.

    A LOCAL_RANK beyond the visible GPUs is an error when `strict` (NCCL: ranks cannot share a GPU); on
    gloo (CPU tests on a machine that has a GPU) it falls back to the current device. `strict=None`
    means strict when the process group already exists and is NCCL.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    raw = os.environ.get("LOCAL_RANK")
    if raw is not None:
        index, count = int(raw), torch.cuda.device_count()
        if strict is None:
            strict = dist.is_initialized() and dist.get_backend() == "nccl"
        if index < count:
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        if strict:
            raise RuntimeError(
                f"LOCAL_RANK={index} but this machine shows {count} CUDA device(s): start at most "
                f"{count} processes per machine (--nproc_per_node / --num_processes), or make more "
                f"GPUs visible (CUDA_VISIBLE_DEVICES)"
            )
    return torch.device("cuda", torch.cuda.current_device())


def init_kwargs(backend: str, device: torch.device | None = None) -> dict:
    """Extra `init_process_group` arguments: `device_id` (this process's GPU) on NCCL, nothing on gloo."""
    if backend != "nccl":
        return {}
    return {"device_id": device if device is not None else local_device(strict=True)}


class RankFailed(RuntimeError):
    """Raised in the parent when one or more spawned ranks raised; names each failing rank."""


_JOINING = "while joining the process group: "  # what a rank's report starts with when fn never ran
# rank 0's store could not bind the port free_port chose: another process took it in between
_PORT_TAKEN = re.compile(_JOINING + r".*(EADDRINUSE|address already in use)", re.I | re.S)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    backend: str,
    timeout_s: float,
    threads: int,
    results,
    env: dict,
    log: str,
) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's of when it started
    os.environ.update(env)
    # this rank's stderr into a file the parent echoes: a rank that dies without reporting (an abort, the OOM
    # killer) is named with its last lines, C++'s included ("terminate called ..."), which go to fd 2 directly
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(threads)
    joined = False
    try:
        # NCCL: this rank's GPU made current and bound to the group (device_id) before the group exists
        extra = init_kwargs(backend)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **extra
        )
        joined = True
        out = fn(*args, **kwargs)
        # plain pickle copies tensor data in-band; torch's queue would share file descriptors, which
        # die with this process before the parent reads them
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent, then exit non-zero
        where = "" if joined else _JOINING
        results.put((rank, "error", f"{where}{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()  # flush the report before the hard exit below
        # Leave without the barrier in destroy_process_group: peers may be blocked in a collective,
        # and the parent tears them down once it has the error.
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What a fork server imports once, so that each spawned rank starts in a fraction of a second instead of
# importing torch and transformers anew (seconds per rank). Nothing here creates threads or touches a
# device, so forking from it is safe. accelerate is there for ranks that run `vp-accelerate train` itself
# (the tests' training runs); peft because the trainer's learning-rate schedule (transformers.get_scheduler)
# and LoRA import it: a third of the trainer's import time, paid by every rank otherwise (it starts no thread,
# touches no device and imports neither pyarrow nor datasets). The trainer stays out: it imports pyarrow,
# which starts a native thread (a fork copies no thread), and datasets, which reads HF_DATASETS_CACHE once at
# import (a rank must read its caller's). vp_accelerate.runtime loads its engine on first use (a recipe is
# checked without torch): the engine is preloaded here by name, as nearly every rank runs it (it reads the
# environment only when called: VP_STRICT_P2P, RANK). The fork server skips a module it cannot import.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "vp_accelerate.runtime",
    "vp_accelerate.runtime.pipeline",
    "accelerate",
    "peft",
]


def process_context():
    """Fresh processes for `spawn` (and the tests' rank helpers): forked from a fork server with the heavy
    imports done (Linux), or spawned (elsewhere, or with VP_SPAWN_METHOD=spawn). Either way no state of
    the caller is inherited: each rank gets the caller's environment, sys.path and main module, nothing else."""
    method = os.environ.get("VP_SPAWN_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def spawn(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` fresh processes joined in one process group.

    `fn` must be a module-level function (it is pickled). Returns the list of per-rank return values
    (each must be picklable). If any rank raises, every rank is stopped and `RankFailed` is raised
    with each failing rank's traceback, so a test never hangs on a peer blocked in a collective.
    A port that another process took between choosing it and binding it (several jobs starting ranks
    at once) is retried on a fresh port, twice at most; `fn` had not run then.
    """
    for _ in range(2):
        try:
            return _spawn_once(fn, world_size, args, kwargs, backend, timeout_s, threads)
        except RankFailed as e:
            if not _PORT_TAKEN.search(str(e)):
                raise
    return _spawn_once(fn, world_size, args, kwargs, backend, timeout_s, threads)


def _spawn_once(fn, world_size, args, kwargs, backend, timeout_s, threads) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="vp-spawn-") as logs:
        paths = [os.path.join(logs, f"rank{r}.stderr") for r in range(world_size)]
        try:
            return _run_ranks(fn, world_size, args, kwargs, backend, timeout_s, threads, paths)
        finally:
            for path in paths:  # each rank's stderr, rank 0 first, as if it had written here
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        sys.stderr.write(f.read())
            sys.stderr.flush()


def _last_lines(path: str, lines: int = 5) -> str:
    """The last `lines` non-empty lines a rank wrote to stderr, joined by " / " ("" if none)."""
    try:
        with open(path, errors="replace") as f:
            tail = [line.strip() for line in f.read().splitlines() if line.strip()][-lines:]
    except OSError:
        return ""
    return " / ".join(tail)


def _run_ranks(fn, world_size, args, kwargs, backend, timeout_s, threads, logs) -> list[Any]:
    ctx = process_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            daemon=True,
            args=(
                *(r, world_size, port, fn, args, kwargs, backend, timeout_s, threads, results),
                *(dict(os.environ), logs[r]),
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline_s = timeout_s + 60.0
    start = time.monotonic()
    while len(outs) + len(errors) < world_size:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive() and p.exitcode not in (0, None) and r not in outs and r not in errors
            ]
            for r in dead:
                errors[r] = _died(procs[r].exitcode, logs[r])
            if errors:
                break  # a dead rank (killed, out of memory) leaves its peers blocked: stop them too
            if time.monotonic() - start > deadline_s:
                for r in range(world_size):
                    if r not in outs and r not in errors:
                        errors[r] = f"no result within {deadline_s:.0f} s"
            continue
        if status == "ok":
            outs[rank] = pickle.loads(value)
        else:
            errors[rank] = value
        if errors:
            # one failure is enough (peers may be blocked waiting for the failed rank); take the reports
            # already on their way, so each failing rank is named with its own error. A failure to join (fn
            # never ran) waits for the others as long as they may take to join: on a loaded machine the rank
            # whose port was taken may still be starting (its imports took 10 s and more beside four busy jobs)
            # when its peer reports "connection closed", and only its report says to retry on another port.
            joining = any(str(v).startswith(_JOINING) for v in errors.values()) and not any(
                _PORT_TAKEN.search(str(v)) for v in errors.values()
            )  # a taken port already said: nothing to wait for
            until = time.monotonic() + (max(10.0, timeout_s) if joining else 1.0)
            while len(outs) + len(errors) < world_size and time.monotonic() < until:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    alive = [p for r, p in enumerate(procs) if r not in outs and r not in errors and p.is_alive()]
                    if not joining or not alive:
                        break
                    continue
                if status == "ok":
                    outs[rank] = pickle.loads(value)
                else:
                    errors[rank] = value
            break
    for p in procs:
        p.join(timeout=5.0 if not errors else 0.5)
    for r, p in enumerate(procs):  # name ranks that died silently (killed, out of memory) before we stop the rest
        if r not in outs and r not in errors and not p.is_alive() and p.exitcode not in (0, None):
            errors[r] = _died(p.exitcode, logs[r])
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        lines = [f"rank {r} failed: {msg}" for r, msg in sorted(errors.items())]
        raise RankFailed(f"{len(errors)} of {world_size} ranks failed\n" + "\n".join(lines))
    return [outs[r] for r in range(world_size)]


def _died(code: int, log: str) -> str:
    """What a rank that exited without reporting left: its exit code and its last lines on stderr."""
    tail = _last_lines(log)
    return f"process exited with code {code} without reporting" + (f"; its last lines: {tail}" if tail else "")


LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
"""Variables a launcher sets in each process it starts (torchrun / torch elastic, accelerate launch)."""


def launched() -> bool:
    """Whether this process is a rank a launcher started (torchrun, accelerate launch, vp-accelerate launch)."""
    if any(k in os.environ for k in LAUNCHER_ENV):
        return True
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def enable_fault_stacks() -> bool:
    """In a launched rank: Python's faulthandler on for all threads, so a rank killed by a fatal signal (SIGABRT
    from a C++ `std::terminate`, SIGSEGV, SIGBUS, SIGFPE, SIGILL) prints every thread's Python stack on stderr
    before it dies, instead of only the launcher's "exitcode -6". Prints nothing otherwise. Left as it is when
    faulthandler is on already (PYTHONFAULTHANDLER, pytest). True when it is on after the call."""
    if faulthandler.is_enabled():
        return True
    if not launched():
        return False
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):  # no file descriptor (a notebook's stream, closed)
            continue
        faulthandler.enable(file=stream, all_threads=True)
        return True
    return False


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group a launcher (accelerate launch, torchrun) described in the env.

    Returns (rank, world_size). A single process with no launcher env gets a 1-rank group, so the
    same code runs on a laptop. The backend is NCCL when CUDA is available, gloo otherwise. With CUDA,
    `cuda:LOCAL_RANK` becomes the current device first and the group is bound to it (`device_id`), so
    its communicator connects now. A group someone else made (accelerate, without `device_id`) connects
    its communicators at their first operation: `runtime.groups.warm_up` does that before step 1.
    """
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        device = local_device(strict=backend == "nccl")
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **init_kwargs(backend, device))
    else:
        local_device()
    return dist.get_rank(), dist.get_world_size()
