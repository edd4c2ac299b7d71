"""The exit codes of the commands, in one place: what a script or a scheduler reads from a run's end, and how a
launched rank leaves with a user error (`exit_launched`).

Imports only the standard library (the launcher, the CLI and every rank read them before anything heavy loads).
"""

import os
import sys

USER_ERROR = 2
"""A user error (a recipe key, a data file and row, a model source, a checkpoint that cannot load), said in one
line with its fix before work is lost; also argparse's code for bad arguments."""

STOPPED = 3
"""Training stopped mid-run on bad data, a bad checkpoint or NaN/inf (every rank says why)."""

PREEMPTED = 75
"""Stopped by a signal after the step's checkpoint was written: resume with --resume (EX_TEMPFAIL of sysexits.h:
"try again later")."""


def exit_launched(code: int) -> None:
    """End a launched rank that stopped with a user error (exit 2) here, skipping the interpreter's native
    teardown: by then the error is said, the lock released, the process group destroyed and nothing else was
    started (no tracker, no checkpoint), so nothing is lost. Why: under torch elastic's launcher a lock refusal
    aborted a rank in that teardown ("terminate called without an active exception", SIGABRT) 3 launches in 38
    on a loaded machine, after the script had ended (no Python frame; docs/reliability.md). A rank that is not
    launched (WORLD_SIZE unset or 1) or any other code returns and exits as usual."""
    if code != USER_ERROR or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(code)
