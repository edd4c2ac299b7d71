"""What data parallelism adds to a step: the gradient synchronisation across replicas and the optimizer
step, with or without ZeRO-1.

ZeRO-1 (`zero=1`, Rajbhandari et al.; Megatron-LM's distributed optimizer) shards the optimizer state
over the d data-parallel replicas of a pipeline rank: each replica keeps the fp32 master copy and Adam's
m and v (12 bytes per parameter) of 1/d of the parameters, while the 16-bit weights (2 bytes) and the
fp32 gradients (4 bytes) stay whole. Static memory per parameter goes from 2 + 4 + 12 = 18 bytes to
6 + 12/d. (ZeRO-2 would shard the gradients too, ZeRO-3 the weights; neither is planned.)

Why this formula and not torch's ZeroRedundancyOptimizer's: that one shards only what the optimizer
owns, Adam's m and v (8 bytes), and leaves the fp32 parameters (this runtime's master copy) whole on
every replica: 2 + 4 + 4 + 8/d = 10 + 8/d. ZeRO-1 as planned here shards the fp32 master copy with the
optimizer state, as Megatron's distributed optimizer does, since that is what makes a 70B model fit on
80 GB GPUs at modest dp (at d = 2: 12 bytes per parameter against 14).

Communication: without ZeRO the fp32 gradients are all-reduced (a ring moves 2(d-1)/d of them per
rank). With ZeRO-1 they are reduce-scattered ((d-1)/d of the fp32 gradients), each replica updates its
shard, and the updated 16-bit weights are all-gathered ((d-1)/d of 2 bytes per parameter): 6 instead of
8 bytes per parameter on the wire, as Megatron's distributed optimizer moves them. Both run after the
pipeline drains, not overlapped with the backward (pessimistic next to bucketed overlap).

The optimizer step itself is memory-bound: a fused AdamW (torch.optim.AdamW(fused=True) on CUDA: one
kernel over all tensors) reads the fp32 parameter, gradient, m and v and writes the parameter, m, v and
the 16-bit copy: OPTIMIZER_STEP_BYTES per parameter of HBM traffic, for the rank's (ZeRO-1: 1/d of its)
parameters. The runtime builds torch's default AdamW (the foreach implementation on CUDA, a few passes
over the same tensors); the planner times the fused one and says so.
"""

from __future__ import annotations

ZERO_LEVELS = (0, 1)
"""ZeRO stages the planner knows: 0 (every replica keeps the whole optimizer state) and 1 (sharded)."""

OPTIMIZER_STEP_BYTES = 30
"""HBM bytes per parameter of one fused AdamW step: reads fp32 param, grad, m, v (16), writes param, m, v
(12) and the 16-bit weight copy (2)."""


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
    (ring collectives): an all-reduce of the gradients, or with ZeRO-1 a reduce-scatter of the gradients
    and an all-gather of the updated 16-bit weights (see the module docstring). 0 for dp = 1."""
    if dp <= 1:
        return 0.0
    share = (dp - 1) / dp
    if check_zero(zero) >= 1:
        return share * params * (grad_bytes + weight_bytes) / bandwidth + 2 * latency
    return 2 * share * params * grad_bytes / bandwidth + latency


def optimizer_step_time(params: float, dp: int, zero: int, mem_bandwidth: float) -> float:
    """Seconds of one fused AdamW step over a rank's `params` parameters (1/dp of them under ZeRO-1)."""
    return params / optimizer_shards(zero, dp) * OPTIMIZER_STEP_BYTES / mem_bandwidth
