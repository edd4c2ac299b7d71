"""One-shot nn.Modules over the same pass functions, for users who want the vocabulary layers in one go.

Both assume the Megatron convention: the computation around them is replicated on every rank of the
group (same inputs, same loss), so each rank's backward sees the full gradient of its replica. The
pipeline runtime does not use these; it calls the passes itself to schedule them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .embedding import embed_backward, embed_partial
from .output_layer import OutputLayerOptions, c1, c2, s_pass, t_pass, token_mean_grad_scale
from .partition import VocabPartition, shard_tensor


def _new_shard(
    partition: VocabPartition, rank: int, hidden: int, weight: nn.Parameter | None, device, dtype
) -> nn.Parameter:
    if weight is not None:  # tying: reuse the other module's Parameter, one tensor, two gradient paths
        if tuple(weight.shape) != (partition.shard_size, hidden):
            raise ValueError(f"shared weight {tuple(weight.shape)} must be [{partition.shard_size}, {hidden}]")
        return weight
    w = torch.empty(partition.shard_size, hidden, device=device, dtype=dtype)
    nn.init.normal_(w, std=0.02)
    w[partition.valid_rows(rank) :] = 0.0  # padding rows hold no token
    return nn.Parameter(w)


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, partition, rank, group):
        out = embed_partial(ids, weight, partition, rank)
        dist.all_reduce(out, group=group)  # every rank gets the full embedding output
        ctx.save_for_backward(ids)
        ctx.partition, ctx.rank = partition, rank
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # Forward was a sum of the shards' partials; downstream is replicated, so each rank already
        # holds the whole ∂L/∂out: no communication, just the local scatter-add (the IB pass).
        (ids,) = ctx.saved_tensors
        shape = (ctx.partition.shard_size, grad_out.shape[-1])
        grad_w = torch.zeros(shape, dtype=torch.float32, device=grad_out.device)
        embed_backward(ids, grad_out.contiguous(), grad_w, ctx.partition, ctx.rank)
        return None, grad_w.to(grad_out.dtype), None, None, None


class VocabParallelEmbedding(nn.Module):
    """Input embedding whose rows are sharded over `group`; forward returns the full output on every rank."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: dist.ProcessGroup | None = None,
        pad_multiple: int = 1,
        device=None,
        dtype=None,
        weight: nn.Parameter | None = None,
    ):
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.partition = VocabPartition(num_embeddings, dist.get_world_size(group), pad_multiple)
        self.weight = _new_shard(self.partition, self.rank, embedding_dim, weight, device, dtype)

    @torch.no_grad()
    def load_full_weight(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of a full `[vocab_size, h]` weight into the shard."""
        self.weight.copy_(shard_tensor(full, self.partition, self.rank))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _Embed.apply(ids, self.weight, self.partition, self.rank, self.group)


class _LMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, grad_scale, partition, rank, opts, group):
        state = s_pass(x.detach().contiguous(), labels, grad_scale, weight.detach(), partition, rank, opts)
        c1(state, group, async_op=False)
        ctx.state, ctx.group = state, group
        return state.loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        state = ctx.state
        grad_w = torch.zeros(state.weight.shape, dtype=torch.float32, device=state.weight.device)
        t_pass(state, grad_w)
        if state.opts.spec.grad_x_in_t:
            c2(state, ctx.group, async_op=False)
        ctx.state = None
        grad_x = state.grad_x * grad_loss.to(state.grad_x.dtype)
        return grad_x, (grad_w * grad_loss).to(state.weight.dtype), None, None, None, None, None, None


class VocabParallelLMHeadLoss(nn.Module):
    """lm_head + cross-entropy with the lm_head rows sharded over `group`.

    forward(x, labels, num_valid=None) -> the token-mean loss (0-dim fp32, equal on every rank), where x
    `[..., h]` and labels `[...]` are the same on every rank; `num_valid` is the token count to divide by
    (default: the valid labels of this call — pass the step's count when accumulating microbatches).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        group: dist.ProcessGroup | None = None,
        options: OutputLayerOptions | None = None,
        pad_multiple: int = 1,
        device=None,
        dtype=None,
        weight: nn.Parameter | None = None,
    ):
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.partition = VocabPartition(vocab_size, dist.get_world_size(group), pad_multiple)
        self.options = options or OutputLayerOptions()
        self.weight = _new_shard(self.partition, self.rank, hidden_size, weight, device, dtype)

    @torch.no_grad()
    def load_full_weight(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of a full `[vocab_size, h]` weight into the shard."""
        self.weight.copy_(shard_tensor(full, self.partition, self.rank))

    def forward(self, x: torch.Tensor, labels: torch.Tensor, num_valid: int | None = None) -> torch.Tensor:
        ignore = self.options.ignore_index
        if num_valid is None:
            num_valid = int((labels != ignore).sum())
        g = token_mean_grad_scale(labels.reshape(-1), num_valid, ignore).to(x.device)
        return _LMHeadLoss.apply(x, self.weight, labels, g, self.partition, self.rank, self.options, self.group)
