"""The tensor-parallel group's collectives for a stage's layers (models/tensor_parallel.py's `TPComm`), and the
checks a layout with tp_size > 1 must pass before any weight is read.

The collectives run on the compute stream, synchronously inside the pass that needs them (F, B, or a
checkpointed layer's recomputation), through `p2p.collective`: under VP_STRICT_P2P=serial they then take their
turn on the rank's one communication worker, in issue order with the p2p batches and the vocabulary chains, as
NCCL orders a rank's communicators with one connection. Every TP rank of a stage runs the same schedule, so
they issue the same collectives in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vp_accelerate.models.tensor_parallel import TPComm, TPError, TPSpec
from vp_accelerate.runtime import p2p
from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.runtime.groups import Groups

NOT_YET = {
    "interlaced": "method interlaced (the paper's baseline) runs its vocabulary steps over the pipeline group only",
}
"""Methods tensor parallelism does not run yet, and why (vocab-1 / vocab-2 shard them over pp x tp)."""


def check_layout(cfg: PipelineConfig, adapter: AdapterConfig | None = None) -> None:
    """Refuse, in one line, what tp_size > 1 does not run yet (before any group or weight)."""
    if cfg.tp_size == 1:
        return
    if cfg.method in NOT_YET:
        raise TPError(
            f"pipeline.tp_size {cfg.tp_size}: {NOT_YET[cfg.method]}, which is not split over TP yet; use method "
            f"vocab-2 (or vocab-1), which shards them over pp x tp ranks"
        )
    if adapter is not None and adapter.enabled and adapter.dropout:
        raise TPError(
            f"pipeline.tp_size {cfg.tp_size}: adapter.dropout {adapter.dropout} under tensor parallelism would draw "
            f"another dropout mask on each TP rank for the same adapter input; use adapter.dropout 0 or tp_size 1"
        )


def sequence_parallel(cfg: PipelineConfig) -> bool:
    """Whether the stage's residual stream runs on 1/tp of the sequence (default: on with tp_size > 1)."""
    return cfg.tp_size > 1 and cfg.sequence_parallel is not False


def comm(groups: Groups) -> TPComm:
    """The TP group's sum, sequence all-gather and sequence reduce-scatter (dim 1 of [b, s, h])."""
    group, size = groups.tp_group, groups.tp_size

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        p2p.collective(dist.all_reduce, out, group, "TP all-reduce")
        return out

    def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        p2p.collective(dist.all_reduce, out, group, "TP max all-reduce", op=dist.ReduceOp.MAX)
        return out

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        # along the sequence: the collective concatenates dim 0, so the sequence goes first and back
        part = x.transpose(0, 1).contiguous()
        out = part.new_empty((part.shape[0] * size, *part.shape[1:]))
        p2p.collective(_gather_into(part), out, group, "TP sequence all-gather")
        return out.transpose(0, 1).contiguous()

    def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        whole = x.transpose(0, 1).contiguous()
        out = whole.new_empty((whole.shape[0] // size, *whole.shape[1:]))
        p2p.collective(_scatter_from(whole), out, group, "TP sequence reduce-scatter")
        return out.transpose(0, 1).contiguous()

    return TPComm(size, groups.tp_rank, all_reduce, all_gather, reduce_scatter, all_reduce_max)


# torch 2.13 renamed the tensor forms (`all_gather_single`, `reduce_scatter_single`); older releases have the old
# names only
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_into(part: torch.Tensor):
    def fn(out, group=None, async_op=False):
        return _ALL_GATHER(out, part, group=group, async_op=async_op)

    return fn


def _scatter_from(whole: torch.Tensor):
    def fn(out, group=None, async_op=False):
        return _REDUCE_SCATTER(out, whole, group=group, async_op=async_op)

    return fn


def spec(cfg: PipelineConfig, groups: Groups) -> TPSpec | None:
    """The stage's TP split, None without tensor parallelism."""
    if groups.tp_size == 1:
        return None
    return TPSpec(comm(groups), sequence_parallel(cfg))


@torch.no_grad()
def sum_partial_grads(params: list[torch.nn.Parameter], groups: Groups) -> None:
    """Sum over the TP group the gradients each TP rank holds a part of (a norm under sequence parallelism, a
    per-head norm on local heads), in one flat all-reduce."""
    if groups.tp_size == 1 or not params:
        return
    for p in params:  # every TP rank sends the same layout of buckets
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    p2p.collective(dist.all_reduce, flat, groups.tp_group, "TP partial-gradient sum")
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
