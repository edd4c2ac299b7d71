"""One rank's checkpoint files written while training goes on: the state copied to host memory, then written,
fsynced, hashed and verified by a background thread.

`snapshot` copies every tensor of a nested state (model, optimizer, trainer state) to the host: on CPU a clone,
on CUDA into pinned buffers of up to `BUCKET_BYTES` each (reused by the next save, which waits for this one),
copied without blocking the host, with an event the writer waits for. Training may then change the live
tensors: the checkpoint holds the values of the step it was taken at.

`RankWrite` runs `write_rank_files` in a thread (or inline: the synchronous save). Each file is written through
an xxh3-128 hash of the bytes as they go out, fsynced, then read back and hashed again: the record in
`files.json` is the read-back one, and a file whose bytes on disk differ from those written is a write problem
(the checkpoint is not completed). The thread runs no collective: the ranks agree that every write verified
later, on the main thread (`store.complete_save`), before `latest` moves.
"""

from __future__ import annotations

import copy
import json
import os
import signal

import torch
import xxhash

from vp_accelerate.distributed import start_thread
from vp_accelerate.models.stream_export import write_safetensors

from . import files, space

BUCKET_BYTES = 64 << 20
"""Bytes of one pinned host buffer a CUDA snapshot copies into (a tensor larger than this gets its own)."""

_ALIGN = 64
"""Byte alignment of a tensor inside a pinned bucket (every dtype's view of the bytes is valid)."""


class SimulatedCrash(RuntimeError):
    """Raised at a named save stage by tests (`_crash_after`): never taken for a write error."""


def crash(stage: str, at: str | None) -> None:
    """Tests: raise at `stage` when `at` names it; "kill:STAGE": die there as a SIGKILL would, nothing cleaned up."""
    if at == stage:
        raise SimulatedCrash(f"simulated crash after {stage}")
    if at == f"kill:{stage}":
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------- snapshot
class Snapshot:
    """Host copies of a rank's state; `ready()` waits for the device copies (a no-op on CPU).

    `pinned`: the buckets of the previous snapshot, reused (and extended) in place. `bucketed`: the device types
    whose tensors are copied into buckets ("cuda"; tests add "cpu" to check the buckets without a GPU); any
    other tensor is cloned."""

    def __init__(self, pinned: list[torch.Tensor] | None = None, bucketed: tuple[str, ...] = ("cuda",)):
        self.pinned = pinned if pinned is not None else []
        self.bucketed = bucketed
        self.event = None
        """The CUDA event recorded after the last copy, None when nothing was copied from a GPU."""
        self._used = 0
        self._fill = 0
        self._from_gpu = False

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def copy(self, state):
        """`state` with every tensor replaced by its host copy and every container rebuilt."""
        out = self._copy(state)
        if self._from_gpu:  # the copies are queued on the current stream: the writer waits for this event
            self.event = torch.cuda.Event()
            self.event.record()
        return out

    def _copy(self, x):
        if isinstance(x, torch.Tensor):
            t = x.detach()
            if t.device.type in self.bucketed:
                return self._to_bucket(t)
            return t.clone(memory_format=torch.contiguous_format)
        if isinstance(x, dict):
            return {k: self._copy(v) for k, v in x.items()}
        if isinstance(x, list):
            return [self._copy(v) for v in x]
        if isinstance(x, tuple):
            return tuple(self._copy(v) for v in x)
        return copy.deepcopy(x)  # numbers, strings, numpy state: nothing training changes in place

    def _to_bucket(self, t: torch.Tensor) -> torch.Tensor:
        """`t` copied (without blocking the host) into the current bucket, the next one when it is full."""
        n = t.numel() * t.element_size()
        start = -(-self._fill // _ALIGN) * _ALIGN
        if self._used == 0 or start + n > self.pinned[self._used - 1].numel():
            size = max(n, BUCKET_BYTES)
            if self._used == len(self.pinned) or self.pinned[self._used].numel() < size:
                pin = torch.cuda.is_available()  # page-locked: the copy runs without the host waiting
                self.pinned[self._used : self._used + 1] = [torch.empty(size, dtype=torch.uint8, pin_memory=pin)]
            self._used += 1  # else the previous save's bucket, big enough, is reused
            start = 0
        host = self.pinned[self._used - 1][start : start + n].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=t.device.type == "cuda")
        self._from_gpu |= t.device.type == "cuda"
        self._fill = start + n
        return host


# ----------------------------------------------------------------------------------------- writing
class _Hashing:
    """A file object that hashes every byte written through it."""

    def __init__(self, f):
        self.f, self.hash = f, xxhash.xxh3_128()

    def write(self, b) -> int:
        self.hash.update(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _write_verified(path: str, write) -> None:
    """`write(file)` into `path`, fsynced; the bytes on disk must hash as those written."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        write(out)
        f.flush()
    fsync_file(path)
    on_disk = files.digest(path)
    if on_disk != out.hash.hexdigest():
        raise OSError(
            f"{path}: the bytes read back differ from those written (xxh3 {on_disk} != {out.hash.hexdigest()})"
        )


def _safetensors_to(model_state: dict):
    """A writer of `model_state` as one safetensors file, tensor by tensor."""

    def write(f) -> None:
        entries = [(n, tuple(t.shape), t.dtype, lambda t=t: t) for n, t in model_state.items()]
        write_safetensors(None, entries, sink=f)

    return write


RANK_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.pt")


def write_rank_files(rdir: str, model_state: dict, optimizer_state: dict, trainer_state: dict, at=None) -> None:
    """One rank's shard, optimizer and trainer state, each written, fsynced and verified, then their sizes and
    hashes (files.json, the rank's last file: its presence says the others are whole)."""
    os.makedirs(rdir, exist_ok=True)
    _write_verified(os.path.join(rdir, "model.safetensors"), _safetensors_to(model_state))
    crash("weights", at)
    for name, obj in (("optimizer.pt", optimizer_state), ("trainer_state.pt", trainer_state)):
        _write_verified(os.path.join(rdir, name), lambda f, obj=obj: torch.save(obj, f))
    write_json(os.path.join(rdir, files.MANIFEST), files.record(rdir, RANK_FILES))
    fsync_dir(rdir)


class RankWrite:
    """This rank's files of one checkpoint, written by `work` in a thread (`background`) or inline; `wait`
    returns the write problem (a line naming the file, a full disk) or None, and re-raises a test's crash."""

    def __init__(self, work, ckpt_dir: str, where: str, need: int, rank: int, background: bool, problem=None):
        self.problem: str | None = problem
        """A problem found before the write (rank 0's model/ files): then nothing is written."""
        self._crash: SimulatedCrash | None = None
        self._args = (ckpt_dir, where, need, rank)
        self._work = work
        self._thread = None
        if background:
            # on this rank's GPU: the snapshot's `event.synchronize()` must not make a context on GPU 0
            self._thread = start_thread(self._run, f"checkpoint-writer-{rank}")
        else:
            self._run()

    def _run(self) -> None:
        ckpt_dir, where, need, rank = self._args
        self.problem = self.problem or space.too_full(ckpt_dir, need, rank)
        if self.problem is not None:
            return
        try:
            self._work()
        except SimulatedCrash as e:
            self._crash = e
        except (OSError, RuntimeError) as e:  # torch.save's C++ writer says `basic_ios::clear` on a full disk
            self.problem = space.write_problem(e, where, ckpt_dir, need, rank)
        except Exception as e:  # noqa: BLE001 - any other failure of the thread is this save's problem, said
            self.problem = f"rank {rank} failed writing {where}: {type(e).__name__}: {e}"

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str | None:
        if self._thread is not None:
            self._thread.join()
        if self._crash is not None:
            raise self._crash
        return self.problem
