"""Run one step's schedule on this rank and make its numbers known on every rank.

PipelineModel's train_step / eval_step are these functions in order: the executor over the rank's parts
(`rank_parts.py`), then the loss, the bubble rate (from the step's clock, runtime/clock.py) and the
NaN/inf microbatches reduced over the groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vp_accelerate.runtime import p2p, precision, watchdog
from vp_accelerate.runtime.clock import Clock
from vp_accelerate.runtime.executor import Executor, Microbatch, StepOutput
from vp_accelerate.runtime.groups import Groups
from vp_accelerate.schedule.ir import COMPUTE_OPS, TimedAction


def run_schedule(
    ex: Executor, mbs: list[Microbatch], clock: Clock, device: torch.device, compute_dtype, watchdog
) -> StepOutput:
    """Run the executor over the microbatches, one low-precision cast per weight per step, its marks on
    `clock`; a failure is reported to the watchdog first, so peers blocked on this rank exit now, naming it."""
    try:
        with precision.step_weight_casts(device, compute_dtype):
            return ex.run(mbs, clock)
    except BaseException as e:
        if watchdog is not None:
            watchdog.report_failure(e)
            if watchdog.lost_peer(e):  # a peer was killed: say so in one line, not with gloo's traceback
                watchdog.stop_for_lost_peer(e)
        raise


def finish_loss(loss_sum: torch.Tensor, vocab_parallel: bool, last_stage: bool, groups: Groups) -> float:
    """Make the step's loss known on every rank of every replica."""
    loss = loss_sum.detach().to(torch.float64).reshape(1).clone()  # on the device: pp/dp groups are NCCL on GPUs
    if not vocab_parallel:  # only the last stage computed it
        if not last_stage:
            loss.zero_()
        p2p.collective(dist.all_reduce, loss, groups.pp_group, "loss sum")
    if groups.dp_group is not None:  # g used the global token count: replicas' parts add up
        p2p.collective(dist.all_reduce, loss, groups.dp_group, "loss sum")
    return float(loss.item())


def bubble_rate(records: list[TimedAction], step_time: float, groups: Groups) -> float:
    """Mean over the pipeline's ranks of 1 - (time in compute passes) / (step time)."""
    busy = sum(r.end - r.start for r in records if r.op in COMPUTE_OPS)
    rate = torch.tensor([1.0 - busy / step_time if step_time > 0 else 0.0], dtype=torch.float64)
    with watchdog.waiting("bubble rate sum"):
        dist.all_reduce(rate, group=groups.pp_host_group)  # a host number: the gloo side group
    return float(rate.item()) / groups.pp_size


def nonfinite_microbatches(losses: dict[int, torch.Tensor], microbatches: int, groups: Groups) -> tuple:
    """Which (replica, microbatch) had a NaN/inf loss. Called on every rank when the step's loss is not
    finite (it is the same everywhere); baseline losses live on the last stage only, hence the reduce."""
    m = microbatches
    flags = torch.zeros(groups.dp_size * m, dtype=torch.float64)
    for mb, value in losses.items():
        if not torch.isfinite(value).all():
            flags[groups.dp_rank * m + mb] = 1.0
    with watchdog.waiting("non-finite microbatch flags"):
        dist.all_reduce(flags, group=groups.host_group)  # host flags of the whole world: gloo
    return tuple((int(i) // m, int(i) % m) for i in flags.nonzero().flatten().tolist())
