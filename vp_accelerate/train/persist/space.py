"""A checkpoint write that cannot finish (a full disk, a quota) as one line naming the path and the bytes
needed, the same on every rank, instead of a traceback on one rank and `basic_ios::clear: iostream error`
(torch.save's C++ writer) on another.

Each rank checks the free space for its own files before writing (what its tensors hold, plus a margin for the
containers), and a write that fails anyway (ranks sharing a disk fill it together) is turned into the same line.
"""

from __future__ import annotations

import errno
import os
import shutil

import torch

MARGIN = 1 << 20
"""Bytes added to a rank's tensors for headers, pickled containers and JSON."""


def state_bytes(obj) -> int:
    """Bytes of every tensor in a nested state (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent); None when unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def _full(ckpt_dir: str, need: int, rank: int, free: int) -> str:
    return (
        f"disk full: rank {rank} needs about {need + MARGIN} bytes to write its checkpoint files in {ckpt_dir}, "
        f"{free} are free; free space or set checkpoint.dir on a larger disk"
    )


def too_full(ckpt_dir: str, need: int, rank: int) -> str | None:
    """The line to stop on when the disk cannot hold this rank's files, else None."""
    free = free_bytes(ckpt_dir)
    if free is not None and free < need + MARGIN:
        return _full(ckpt_dir, need, rank, free)
    return None


def write_problem(err: Exception, where: str, ckpt_dir: str, need: int, rank: int) -> str:
    """One line for a failed checkpoint write: a full disk (ENOSPC / EDQUOT, or torch's C++ writer failing while
    the disk has less free than the write needed), else the error itself with the folder it wrote."""
    free = free_bytes(ckpt_dir)
    code = getattr(err, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < need + MARGIN):
        return _full(ckpt_dir, need, rank, free if free is not None else 0)
    return (
        f"rank {rank} cannot write its checkpoint files in {where}: {type(err).__name__}: {' '.join(str(err).split())}"
    )
