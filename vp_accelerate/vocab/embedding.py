"""The vocabulary-parallel input embedding: IF (lookup + reduce) and IB (broadcast + scatter-add).

Rank i holds rows [start, start + shard_size) of E (docs/design.md §4):
    IF  embed_partial   E_i[id − start] for ids in the shard, 0 otherwise   → [N, h]
        if_reduce       sum the partials into the rank of the first transformer stage
    IB  ib_broadcast    that rank broadcasts ∂L/∂emb to every rank
        embed_backward  scatter-add ∂L/∂emb of the shard's ids into ∇E_i
With tied weights the caller passes the output layer's shard and its grad buffer: both contributions
add into one gradient, locally, because both shards cover the same vocabulary rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import check_float, check_token_ids
from .comm import Pending, global_rank, submit
from .partition import VocabPartition


def _local_ids(ids: torch.Tensor, partition: VocabPartition, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row in the shard, clamped to a valid row; mask of the ids that live in this shard)."""
    start, _ = partition.shard_range(rank)
    local = ids.to(torch.long) - start
    mask = (local >= 0) & (local < partition.valid_rows(rank))
    return local.clamp(0, partition.shard_size - 1), mask


def _check_weight(weight: torch.Tensor, partition: VocabPartition, name: str) -> None:
    check_float(weight, name)
    if weight.dim() != 2 or weight.shape[0] != partition.shard_size:
        raise ValueError(
            f"{name} {tuple(weight.shape)} must be this rank's shard [shard_size={partition.shard_size}, h]"
        )


def embed_partial(
    ids: torch.Tensor, weight: torch.Tensor, partition: VocabPartition, rank: int, check_inputs: bool = True
) -> torch.Tensor:
    """IF (local part): `[*ids.shape, h]` rows of this shard for its ids, zeros for the others."""
    _check_weight(weight, partition, "weight")
    if check_inputs:
        check_token_ids(ids, partition.vocab_size, "input ids")
    local, mask = _local_ids(ids, partition, rank)
    return torch.nn.functional.embedding(local, weight) * mask.unsqueeze(-1).to(weight.dtype)


def if_reduce(
    partial: torch.Tensor,
    dst: int | None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    keep: bool = False,
) -> Pending:
    """IF (collective): sum the partials in place into group rank `dst`; its `wait()` returns the tensor
    (the full embedding output) on `dst`, None elsewhere. Runs on the communication engine. `dst` None: an
    all-reduce, for when several ranks need the sum (the first stage's tensor-parallel ranks); `keep` then
    says whether this rank is one of them."""

    root = None if dst is None else global_rank(group, dst)
    keep = keep if root is None else dist.get_rank() == root

    def chain() -> torch.Tensor | None:
        if root is None:
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
        else:
            dist.reduce(partial, root, op=dist.ReduceOp.SUM, group=group)
        # elsewhere the sum is unspecified and nobody reads it: the handle must not hold [N, h] until the
        # step's end (m of them on every rank but the root); CUDA's record_stream keeps it until the reduce ran
        return partial if keep else None

    return submit(chain, group, partial.device, [partial], "IF_REDUCE", async_op)


def ib_broadcast(
    grad: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Pending:
    """IB (collective): broadcast ∂L/∂emb in place from group rank `src` (grad is the buffer elsewhere)."""
    if not grad.is_contiguous():
        raise ValueError("grad must be contiguous to be broadcast; pass grad.contiguous()")

    def chain() -> torch.Tensor:
        dist.broadcast(grad, global_rank(group, src), group=group)
        return grad

    return submit(chain, group, grad.device, [grad], "IB_BCAST", async_op)


def embed_backward(
    ids: torch.Tensor, grad: torch.Tensor, weight_grad: torch.Tensor, partition: VocabPartition, rank: int
) -> None:
    """IB (local part): scatter-add the rows of `grad` ([*ids.shape, h]) whose ids live here into `weight_grad`."""
    _check_weight(weight_grad, partition, "weight_grad")
    if grad.shape[:-1] != ids.shape or grad.shape[-1] != weight_grad.shape[1]:
        raise ValueError(
            f"grad {tuple(grad.shape)} must be [*ids.shape, h] = [{', '.join(map(str, ids.shape))}, "
            f"{weight_grad.shape[1]}]"
        )
    local, mask = _local_ids(ids.reshape(-1), partition, rank)
    g = grad.reshape(-1, grad.shape[-1]).to(weight_grad.dtype) * mask[:, None].to(weight_grad.dtype)
    # Masked rows add zeros to a clamped (valid) row: no boolean indexing, so no host sync on GPU.
    weight_grad.index_add_(0, local, g)
