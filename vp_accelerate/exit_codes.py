"""The exit codes of the commands, in one place: what a script or a scheduler reads from a run's end.

Imports nothing (the launcher, the CLI and every rank read them before anything heavy loads).
"""

USER_ERROR = 2
"""A user error (a recipe key, a data file and row, a model source, a checkpoint that cannot load), said in one
line with its fix before work is lost; also argparse's code for bad arguments."""

STOPPED = 3
"""Training stopped mid-run on bad data, a bad checkpoint or NaN/inf (every rank says why)."""

PREEMPTED = 75
"""Stopped by a signal after the step's checkpoint was written: resume with --resume (EX_TEMPFAIL of sysexits.h:
"try again later")."""
