"""One writer per output dir: a second run into the same `logging.output_dir` or `checkpoint.dir` is refused.

Two runs in one folder both "succeed": metrics.jsonl holds every step twice, wandb gets two runs, and one
run's save deletes the other's `step_X.tmp` as if a crashed save had left it. So the run's rank 0 holds an
exclusive `fcntl.flock` on `<dir>/.vp-accelerate.lock` for the run's whole life; the file says who holds it
(host, pid, start time). The second run's ranks stop with exit 2 and one line naming the first. A folder is
locked by its real path (symlinks followed), so two spellings of one folder are one lock, and the trainer locks
the checkpoint folder itself too, not only the output dir that usually holds it: another run's checkpoint.dir
may name it directly.

Stale locks: the kernel drops a flock when its process dies (kill -9 included), so a crashed run never
blocks the next one on the same file system; the file left behind is just overwritten. On a network file
system whose server lost track of a dead client the message says to delete the lock file once that run is
known to be gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from ..recipe import RecipeError

LOCK_FILE = ".vp-accelerate.lock"

_HELD: dict[str, int] = {}
"""Real path of a dir -> the open descriptor holding its lock (closed on exit, which releases it)."""


def _holder(fd: int) -> dict:
    """Who holds the lock, as its file says; {} for a record that is unreadable or not ours (the message then
    says "?" rather than failing on it)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        who = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}
    if not isinstance(who, dict):
        return {}
    if not isinstance(who.get("since"), (int, float)) or isinstance(who.get("since"), bool):
        who.pop("since", None)
    return {k: v for k, v in who.items() if k == "since" or isinstance(v, (str, int))}


def acquire(folder: str, what: str = "logging.output_dir") -> str:
    """Hold the lock of `folder` (created if needed) for this process's life; RecipeError naming the holder
    when another process holds it. Returns the lock file's path. Taking a lock this process holds is a no-op.
    The lock is that of the folder's real path: through a symlink or `..`, one folder is one lock."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"{what}: cannot create {folder}: {e.strerror}; choose a writable {what}") from None
    folder = os.path.realpath(folder)
    path = os.path.join(folder, LOCK_FILE)
    if folder in _HELD:
        return path
    try:
        # O_NOFOLLOW: a lock file that is a symlink would have its target truncated by the record written below.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise RecipeError(
                f"{what}: the lock file {path} is a symbolic link (to {os.readlink(path)!r}); a run writes its own "
                f"record there, so remove the link"
            ) from None
        raise RecipeError(
            f"{what}: cannot create the lock file {path}: {e.strerror}; choose a writable {what}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        who = _holder(fd)
        os.close(fd)
        try:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"])) if "since" in who else "?"
        except (OverflowError, OSError, ValueError):
            since = "?"
        raise RecipeError(
            f"{what}: another run is writing into {folder} (host {who.get('host', '?')}, pid {who.get('pid', '?')}, "
            f"started {since}); wait for it to end or give this run another {what}. The lock ({path}) is released "
            f"when that process exits, even if killed; only if it is gone and the lock stays (a network file "
            f"system), delete {path}"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode())
    os.fsync(fd)
    _HELD[folder] = fd
    return path


def release(folder: str) -> None:
    """Let go of `folder`'s lock (a run that ends in this process; exiting releases it too)."""
    fd = _HELD.pop(os.path.realpath(folder), None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    for folder in list(_HELD):
        release(folder)
