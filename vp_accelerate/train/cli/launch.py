"""`vp-accelerate launch [accelerate launch options] train RECIPE [train options]`: `accelerate launch ... -m
vp_accelerate train ...`, ending with the run's own exit code.

accelerate's multi-process launcher (torch elastic) answers any rank that exits non-zero with a Python
traceback and a ChildFailedError report of its own (~40 lines) and exit code 1, whatever the rank said; a
launched process cannot change that. This runs the same launcher in this process and, when the first rank
to fail exited with 2 (a user error: the rank has said it in one line) or 3 (training stopped: NaN/inf,
checkpoint mismatch) or 75 (stopped by a signal after saving a checkpoint), exits with that code and adds
nothing. Any other failure (a bug, a signal) keeps torch elastic's full report.

Preemption: the launcher (torch elastic's agent) passes the signals it handles on to its ranks, which finish
their step, save and exit 75 (`train/run/preemption.py`). It handles the list of torchrun's
`--signals-to-handle`, which `accelerate launch` has no option for and which torch reads from the
PET_SIGNALS_TO_HANDLE variable (default SIGTERM, SIGINT, SIGHUP, SIGQUIT; torch then overwrites
TORCHELASTIC_SIGNALS_TO_HANDLE with it, so setting that one does nothing). Any other signal kills the launcher
at once and its ranks are killed mid-save or orphaned; this adds SIGUSR1 (`sbatch --signal=USR1@SECONDS`, and
in `checkpoint.stop_signals` by default) when PET_SIGNALS_TO_HANDLE is not set. Torch elastic kills ranks that take longer than
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 unless set), so this sets it to preemption.SHUTDOWN_TIMEOUT_S when it
is not set: a save of a large model takes longer than 30 s.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from vp_accelerate import exit_codes

USAGE = (
    "usage: vp-accelerate launch [accelerate launch options] train RECIPE [train options]\n"
    "  e.g. vp-accelerate launch --config_file configs/accelerate_cpu_2proc.yaml train recipes/quickstart.yaml\n"
    "  runs `accelerate launch ... -m vp_accelerate train ...`; exit code 2 for a user error (recipe, data, "
    "model source: said in one line), 3 when training stopped, the launcher's report for anything else"
)

RUN_CODES = (exit_codes.USER_ERROR, exit_codes.STOPPED, exit_codes.PREEMPTED)
"""Exit codes a rank chooses (user error, training stopped, stopped by a signal after saving): passed on without
the launcher's report."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""Signals a scheduler sends to stop a job that the launcher answers with 75 (its ranks saved first)."""

SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""The launcher's PET_SIGNALS_TO_HANDLE unless set: torch's default and SIGUSR1 (the ranks stop on SIGTERM and
SIGUSR1 by default: `checkpoint.stop_signals`; a signal a rank does not handle kills it)."""


def _signal_of(code) -> signal.Signals | None:
    """The stop signal an exit code 128 + N stands for (SIGTERM, SIGUSR1, ...), None for any other code."""
    if isinstance(code, int) and code > 128:
        try:
            return signal.Signals(code - 128)
        except ValueError:
            return None
    return None


GPU_MEMORY_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_NVLS_ENABLE": "0"}
"""Set for the ranks unless already set: expandable segments against fragmentation (NVIDIA's first fix for a
fragmentation out-of-memory, in most NeMo launch templates), and NCCL without NVLink SHARP, whose buffers cost
memory per communicator (NeMo's launcher and JAX-Toolbox turn it off for memory). cost/memory.py prices the
reserve on both; NVLS speeds large in-node all-reduces, which a pipeline's memory-tight layouts rarely run."""


def launch_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "train" not in argv:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    # accelerate and torch: only a launch loads them, not the usage answer above
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..run.preemption import SHUTDOWN_TIMEOUT_S

    at = argv.index("train")
    args = launch_command_parser().parse_args([*argv[:at], "--module", "vp_accelerate", *argv[at:]])
    # elastic's own log lines repeat what its report (kept for real failures) says
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))  # time to save after a signal
    # torchrun's --signals-to-handle, read when accelerate builds torchrun's parser (the agent passes these on)
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE)
    for key, value in GPU_MEMORY_ENV.items():  # the reserve the planner prices assumes these (cost/memory.py)
        os.environ.setdefault(key, value)
    try:
        launch_command(args)
    except (SignalException, SystemExit) as e:  # accelerate turns the agent's SignalException into exit 128 + sig
        sig = e.sigval if isinstance(e, SignalException) else _signal_of(e.code)
        if sig not in STOP_SIGNALS:  # Ctrl-C (130) and the like keep their usual exit
            raise
        # the agent has given its ranks the signal and waited for them (they save, or are killed at the limit)
        print(
            f"launcher stopped by {sig.name}: its ranks were asked to save and stop (each says the step it saved, "
            f"or that the run had already finished); a run that had not finished resumes with --resume",
            file=sys.stderr,
        )
        return exit_codes.PREEMPTED
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if failure.exitcode in RUN_CODES:
            return failure.exitcode
        raise
    except subprocess.CalledProcessError as e:  # accelerate's single-process launcher
        if e.returncode in RUN_CODES:
            return e.returncode
        raise
    return 0
