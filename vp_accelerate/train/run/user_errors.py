"""User errors at launch: one line, every rank stopped, exit code 2 — tracebacks only for bugs.

A user error (`RecipeError`, `DataError`: a recipe key, a data file and row, a model source, each with its
fix) found while a launched run starts must stop every rank, not only the one that found it: the main
process tokenizes the data and downloads the model first while the others wait (they then read its cache),
so an error there would leave them blocked in a barrier until a timeout, each with its own traceback.
`main_process_first` is that order with an error channel: the main process hands its outcome to the others
(one broadcast on the gloo side group), and on an error every rank raises it. Only the copy of the rank that
found it is printed; the others are `quiet`.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import torch.distributed as dist

from vp_accelerate.runtime.groups import host_group

from ..data.read import DataError
from ..recipe.convert import RecipeError

USER_ERRORS = (RecipeError, DataError)
"""What stops a run at its start with one line and exit code 2."""


def _world():
    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _share(outcome):
    """Broadcast rank 0's outcome (None, or (kind, message)) to every rank on the gloo side group."""
    dist = _world()
    box = [outcome]
    dist.broadcast_object_list(box, src=0, group=host_group())
    return box[0]


def _copy(kind: str, message: str, what: str) -> Exception:
    """The error of rank 0 as raised on another rank (quiet: rank 0 prints it)."""
    cls = {"RecipeError": RecipeError, "DataError": DataError}.get(kind)
    err = cls(message) if cls is not None else RuntimeError(f"rank 0 failed while {what}: {kind}: {message}")
    err.quiet = True
    return err


@contextmanager
def main_process_first(what: str = "starting"):
    """Run the block on the main process first, then on the others (accelerate's `main_process_first`), and
    stop every rank when it fails on the main process: a user error is raised on all of them (printed once),
    a bug too (rank 0 keeps the traceback, the others say that rank 0 failed)."""
    dist = _world()
    if dist is None:
        yield
        return
    if dist.get_rank() != 0:
        outcome = _share(None)
        if outcome is not None:
            raise _copy(*outcome, what)
        yield
        return
    try:
        yield
    except BaseException as e:
        kind = (
            "RecipeError"
            if isinstance(e, RecipeError)
            else "DataError"
            if isinstance(e, DataError)
            else type(e).__qualname__
        )
        if isinstance(e, USER_ERRORS):  # said before the others learn it: the launcher stops us when they exit
            report(e)
            e.quiet = True
        _share((kind, str(e)))
        raise
    _share(None)


def report(err: Exception, where: str = "") -> None:
    """Print a user error as one line on stderr ("recipe error: ..." / "data error: ..."), unless it is another
    rank's quiet copy or was said already. `where`: for a recipe error, where its key was set (`load.where`)."""
    if getattr(err, "quiet", False):
        return
    prefix = "recipe error" if isinstance(err, RecipeError) else "data error"
    at = f" {where}" if where and isinstance(err, RecipeError) else ""
    print(f"{prefix}: {' '.join(str(err).split())}{at}", file=sys.stderr, flush=True)


def say_once(message: str) -> None:
    """Print a line that every launched rank would print the same (a recipe error before the process group)
    once per machine: on its first local rank. The others wait a moment before they exit: the launcher stops
    every rank as soon as one exits, and the one that speaks must get to say it first."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    elif int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        time.sleep(SILENT_EXIT_DELAY_S)


SILENT_EXIT_DELAY_S = 3.0
"""How long a rank that says nothing waits before exiting with a user error."""


def leave() -> None:
    """Tear the process group down after a user error, so the rank exits cleanly (no gloo teardown noise)."""
    dist = _world()
    if dist is not None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the error was already said
            pass
