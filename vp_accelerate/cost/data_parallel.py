"""What data parallelism adds to a step: the gradient synchronisation across replicas and the optimizer
step, with or without ZeRO-1, priced as the runtime runs them.

ZeRO-1 (`zero=1`, `runtime/zero.py`, torch's ZeroRedundancyOptimizer scheme) gives each parameter one owner
among the d data-parallel replicas of a pipeline rank: only the owner keeps its Adam m and v (8 bytes per
parameter) and updates it. The fp32 parameters (the master copy under bf16 / fp16: the 16-bit copy is the
step's cast) and the fp32 gradients stay whole on every replica. Static memory per parameter goes from
2 + 4 + 4 + 8 = 18 bytes to 10 + 8/d. (Megatron's distributed optimizer also shards the fp32 master copy,
6 + 12/d; the runtime does not, so neither does the plan: at d = 2 a parameter costs 14 bytes, not 12.)

Communication: the fp32 gradients are all-reduced either way (a ring moves 2(d-1)/d of them per rank), so
clipping and the fp16 overflow check see whole gradients; with ZeRO-1 each owner then broadcasts its
updated fp32 parameters, so every replica receives the (d-1)/d of them it does not own: 12 bytes per
parameter on the wire against 8 without it. `grad_sync_time` runs both after the pipeline drains (the
pessimistic price, and the planner's bound); `overlapped_sync_time` prices them as the runtime runs them
(runtime/grad_sync.py `DPReducer`): each decoder chunk's buckets are issued right after the rank's last B
(or W) of that chunk and reduce, one after another on the rank's data-parallel link, while the rest of the
backward computes; the vocabulary shards (and the baseline's whole embedding / head outside a chunk) are
reduced after the rank's last pass; the step waits for the slowest rank's last bucket, then ZeRO-1's
broadcast. A chunk whose last backward is the step's last pass (1F1B's chunk 0: its B of the last
microbatch ends the step) hides nothing; a chunk that finishes earlier (V-Half's second chunk on rank 0,
every chunk of a rank other than the slowest) hides its reduce behind the passes that follow it.

The optimizer step itself is memory-bound: a fused AdamW (torch.optim.AdamW(fused=True) on CUDA: one
kernel over all tensors) reads the fp32 parameter, gradient, m and v and writes the parameter, m, v and
the 16-bit copy: OPTIMIZER_STEP_BYTES per parameter of HBM traffic, for the rank's (ZeRO-1: 1/d of its)
parameters; the trainer builds exactly that one on CUDA (`train/run/optim.py`).

ZeRO-1's owners are whole parameters, largest first to the least loaded replica (`assign_owners`, which
runtime/zero.py uses and the planner prices: a replica's share is at least its largest matrix).
"""

from __future__ import annotations

import math

from vp_accelerate.modes import ZERO_LEVELS

OPTIMIZER_STEP_BYTES = 30
"""HBM bytes per parameter of one fused AdamW step: reads fp32 param, grad, m, v (16), writes param, m, v
(12) and the 16-bit weight copy (2)."""


MASTER_BYTES = 4
"""Bytes per parameter of the fp32 parameters (the master copy), which ZeRO-1's owners broadcast."""

SHARDED_BYTES = 8
"""Bytes per parameter ZeRO-1 shards over the replicas: Adam's m and v (runtime/zero.py)."""


def check_zero(zero: int) -> int:
    """`zero` if it is a ZeRO stage the planner knows; ValueError naming the choices otherwise."""
    if zero not in ZERO_LEVELS:
        raise ValueError(f"zero must be one of {ZERO_LEVELS} (0: no sharding, 1: ZeRO-1), got {zero!r}")
    return zero


def optimizer_shards(zero: int, dp: int) -> int:
    """Ranks the optimizer state of one pipeline rank is spread over (CostModel.optimizer_shards)."""
    return dp if check_zero(zero) >= 1 else 1


def grad_sync_time(
    params: float, dp: int, zero: int, bandwidth: float, latency: float, grad_bytes: int = 4, weight_bytes: int = 2
) -> float:
    """Seconds to synchronise `params` parameters' gradients over `dp` replicas at `bandwidth` bytes/s
    (ring collectives): an all-reduce of the gradients, and with ZeRO-1 the owners' broadcast of the
    updated fp32 parameters (see the module docstring). 0 for dp = 1."""
    if dp <= 1:
        return 0.0
    share = (dp - 1) / dp
    allreduce = 2 * share * params * grad_bytes / bandwidth + latency
    if check_zero(zero) >= 1:
        return allreduce + share * params * MASTER_BYTES / bandwidth + latency
    return allreduce


def optimizer_step_time(params: float, dp: int, zero: int, mem_bandwidth: float) -> float:
    """Seconds of one fused AdamW step over a rank's `params` parameters (1/dp of them under ZeRO-1)."""
    return params / optimizer_shards(zero, dp) * OPTIMIZER_STEP_BYTES / mem_bandwidth


def overlapped_sync_time(
    ready: list[list[tuple[float, float]]],
    after: list[tuple[float, float]],
    dp: int,
    zero: int,
    bandwidth: float,
    latency: float,
    grad_bytes: int = 4,
) -> float:
    """Seconds the data-parallel sync adds after the step's last pass, with each decoder chunk's reduce
    overlapping the passes after it (module docstring).

    ready: per rank, (seconds before the step's end at which a chunk's gradients are final, their bytes) for
    each of its decoder chunks; after: per rank, (seconds before the step's end at which its last pass ends,
    the gradient bytes reduced only then). 0 for dp = 1; never more than `grad_sync_time` of the rank with
    the most bytes."""
    if dp <= 1:
        return 0.0
    share = (dp - 1) / dp

    def reduce(nbytes: float) -> float:
        return 2 * share * nbytes / bandwidth + latency if nbytes > 0 else 0.0

    end = 0.0
    for chunks, (lead, rest) in zip(ready, after):
        t = -math.inf
        for before, nbytes in sorted(chunks, key=lambda x: -x[0]):  # in the order they become final
            t = max(t, -before) + reduce(nbytes)
        t = max(t, -lead) + reduce(rest)
        if check_zero(zero) >= 1:  # the owners broadcast the updated fp32 parameters after the optimizer step
            params = (sum(n for _, n in chunks) + rest) / grad_bytes
            t = max(t, 0.0) + share * params * MASTER_BYTES / bandwidth + latency
        end = max(end, t)
    return end


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """The owner (0..world-1) of each parameter of `sizes` (element counts): largest first to the least
    loaded owner (ties: the lower index), so each share is within one parameter of sum/world. The same
    on every replica, since it depends on the sizes alone."""
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        o = min(range(world), key=lambda r: (load[r], r))
        owners[i] = o
        load[o] += sizes[i]
    return owners
