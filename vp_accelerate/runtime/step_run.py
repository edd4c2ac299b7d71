"""Run one step's schedule on this rank and make its numbers known on every rank.

PipelineModel's train_step / eval_step are these functions in order: the executor over the rank's parts
(`rank_parts.py`), then the loss, the bubble rate and the NaN/inf microbatches reduced over the groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vp_accelerate.runtime import precision
from vp_accelerate.runtime.executor import Executor, Microbatch, StepOutput
from vp_accelerate.runtime.groups import Groups
from vp_accelerate.runtime.rank_parts import RankParts
from vp_accelerate.schedule.ir import COMPUTE_OPS, Schedule, TimedAction


def make_executor(
    parts: RankParts,
    groups: Groups,
    schedule: Schedule,
    mb_rows: int,
    seq: int,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None,
    device: torch.device,
) -> Executor:
    """The executor of `schedule` on this rank for microbatches of `mb_rows` x `seq` tokens."""
    layout = parts.layout
    mine = layout.chunks_of(groups.pp_rank)
    layers = {c: layout.chunk_layers[c][1] - layout.chunk_layers[c][0] for c in mine}
    total = sum(layers.values())  # 0 on a stage the balanced split emptied (its chunk runs only the norm)
    return Executor(
        schedule,
        parts.mods,
        groups,
        parts.partition,
        parts.out_opts,
        act_shape=(mb_rows, seq, parts.hf_config.hidden_size),
        # stages exchange activations / gradients in the compute dtype under mixed precision
        act_dtype=compute_dtype or dtype,
        param_dtype=dtype,
        device=device,
        weight_grads=parts.weight_grads,
        chunk_weight={c: n / total if total else 0.0 for c, n in layers.items()},
        compute_dtype=compute_dtype,
    )


def run_schedule(ex: Executor, mbs: list[Microbatch], device: torch.device, compute_dtype, watchdog) -> StepOutput:
    """Run the executor over the microbatches, one low-precision cast per weight per step; a failure is
    reported to the watchdog first, so peers blocked on this rank exit now, naming it."""
    try:
        with precision.step_weight_casts(device, compute_dtype):
            out = ex.run(mbs)
        out.weight_copy_bytes = ex.meter.weight_copy_bytes
        return out
    except BaseException as e:
        if watchdog is not None:
            watchdog.report_failure(e)
        raise


def finish_loss(loss_sum: torch.Tensor, vocab_parallel: bool, last_stage: bool, groups: Groups) -> float:
    """Make the step's loss known on every rank of every replica."""
    loss = loss_sum.detach().to(torch.float64).reshape(1).clone()  # on the device: pp/dp groups are NCCL on GPUs
    if not vocab_parallel:  # only the last stage computed it
        if not last_stage:
            loss.zero_()
        dist.all_reduce(loss, group=groups.pp_group)
    if groups.dp_group is not None:  # g used the global token count: replicas' parts add up
        dist.all_reduce(loss, group=groups.dp_group)
    return float(loss.item())


def bubble_rate(records: list[TimedAction], step_time: float, groups: Groups) -> float:
    """Mean over the pipeline's ranks of 1 - (time in compute passes) / (step time)."""
    busy = sum(r.end - r.start for r in records if r.op in COMPUTE_OPS)
    rate = torch.tensor([1.0 - busy / step_time if step_time > 0 else 0.0], dtype=torch.float64)
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
    dist.all_reduce(flags, group=groups.host_group)  # host flags of the whole world: gloo
    return tuple((int(i) // m, int(i) % m) for i in flags.nonzero().flatten().tolist())
