"""Preemption: a stop signal (SIGTERM, what SLURM and most schedulers send before they kill a job; SIGUSR1, what
`sbatch --signal=USR1@120` sends ahead of the time limit) ends the run at the next step boundary with a
checkpoint, instead of killing it mid-step and losing up to `checkpoint.every` steps.

The handler only records the signal; the decision is taken at the end of each step from a value every rank
agrees on (the largest signal number seen by any rank, one all-reduce of one number on the gloo side group),
so all ranks stop after the same step even when the signal reaches them at different moments, or reaches only
some of them (the launcher forwards it to its own ranks, a scheduler may signal only the launchers). A signal
arriving inside a save lets the save finish; the step it ends is then not saved twice.

The process exits with `exit_codes.PREEMPTED` (75, EX_TEMPFAIL of sysexits.h: "try again later") after saying
"stopped by SIGTERM at step N; resume with --resume". A signal in the run's last step stops nothing: there is
nothing to resume, so the run saves, exports and exits as usual (`trainer.py`). Under `accelerate launch` the
launcher passes the signals named by PET_SIGNALS_TO_HANDLE (torchrun's --signals-to-handle; SIGTERM but not
SIGUSR1 by default) to its ranks and waits `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (30 by default) before
killing them: `vp-accelerate launch` adds SIGUSR1 and raises the wait to `SHUTDOWN_TIMEOUT_S`, unless they are set.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vp_accelerate.runtime import watchdog
from vp_accelerate.runtime.groups import host_group

SHUTDOWN_TIMEOUT_S = 600
"""Seconds `vp-accelerate launch` gives its ranks to finish a step and save after a signal (when
TORCH_ELASTIC_SHUTDOWN_TIMEOUT is not set)."""


class Preempted(Exception):
    """Raised on every rank after the checkpoint of a signal-stopped run is written."""

    def __init__(self, signame: str, step: int, saved: bool):
        self.signame, self.step, self.saved = signame, step, saved
        if saved:
            what = f"stopped by {signame} at step {step}; resume with --resume"
        else:
            what = f"stopped by {signame} at step {step}; checkpointing is off (checkpoint.enabled), nothing saved"
        super().__init__(what)


@dataclass
class StopSignals:
    """The signals that stop a run with a checkpoint, and the one received (installed for the training loop)."""

    names: tuple[str, ...]
    """Signal names (`checkpoint.stop_signals`)."""
    received: int = 0
    """The signal number this process received (0: none yet)."""

    def __post_init__(self):
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        for name in self.names:
            num = getattr(signal, name)
            self._previous[num] = signal.signal(num, self._handle)
        return self

    def restore(self) -> None:
        for num, handler in self._previous.items():
            signal.signal(num, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received = max(self.received, signum)  # a second signal (the launcher forwarding it) changes nothing

    def agreed(self) -> int:
        """The signal any rank received (0 when none): a collective, called by every rank after each step."""
        seen = torch.tensor([self.received], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():
            with watchdog.waiting("stop-signal agreement"):  # a peer that failed: its one line, no traceback
                dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=host_group())
        return int(seen.item())


def signal_name(num: int) -> str:
    return signal.Signals(num).name
