"""`vp-accelerate launch [accelerate launch options] train RECIPE [train options]`: `accelerate launch ... -m
vp_accelerate train ...`, ending with the run's own exit code.

accelerate's multi-process launcher (torch elastic) answers any rank that exits non-zero with a Python
traceback and a ChildFailedError report of its own (~40 lines) and exit code 1, whatever the rank said; a
launched process cannot change that. This runs the same launcher in this process and, when the first rank
to fail exited with 2 (a user error: the rank has said it in one line) or 3 (training stopped: NaN/inf,
checkpoint mismatch), exits with that code and adds nothing. Any other failure (a bug, a signal) keeps
torch elastic's full report.
"""

from __future__ import annotations

import logging
import subprocess
import sys

USAGE = (
    "usage: vp-accelerate launch [accelerate launch options] train RECIPE [train options]\n"
    "  e.g. vp-accelerate launch --config_file configs/accelerate_cpu_2proc.yaml train recipes/quickstart.yaml\n"
    "  runs `accelerate launch ... -m vp_accelerate train ...`; exit code 2 for a user error (recipe, data, "
    "model source: said in one line), 3 when training stopped, the launcher's report for anything else"
)

RUN_CODES = (2, 3)
"""Exit codes a rank chooses (user error, training stopped): passed on without the launcher's report."""


def launch_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "train" not in argv:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    # accelerate and torch: only a launch loads them, not the usage answer above
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    at = argv.index("train")
    args = launch_command_parser().parse_args([*argv[:at], "--module", "vp_accelerate", *argv[at:]])
    # elastic's own log lines repeat what its report (kept for real failures) says
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        launch_command(args)
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
