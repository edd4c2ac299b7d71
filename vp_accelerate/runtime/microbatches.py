"""A step's batch checked on the host and cut into the executor's microbatches.

Everything a user can get wrong about a batch (shapes, a sequence longer than the model's positions,
a batch not divisible by the microbatch count, token ids or labels outside the vocabulary) fails here,
before any pass, with a message naming the fix. The ids are checked once on the host, so the IF and S
passes never sync the device to check them again.

The batch comes on the host (the trainer's does), so every decision about it is made here without
touching the device: the valid-token count (summed over the replicas on the gloo group), and each
microbatch's attention case (`models.masks.MicrobatchMasks`: plain, packed or padded). A step then reads
nothing back from the device but its loss (and fp16's found-inf flag).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vp_accelerate.models.masks import MicrobatchMasks
from vp_accelerate.runtime import p2p
from vp_accelerate.runtime.executor import Microbatch
from vp_accelerate.vocab.labels import shift_labels


def check_batch(input_ids: torch.Tensor, labels: torch.Tensor, position_ids, microbatches: int, hf_config) -> None:
    """Raise ValueError naming the cause and the fix for a batch the step cannot take."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and labels must both be [batch, seq]; got {tuple(input_ids.shape)} and {tuple(labels.shape)}"
        )
    b, s = input_ids.shape
    if position_ids is not None and tuple(position_ids.shape) != (b, s):
        raise ValueError(
            f"position_ids must be [batch, seq] like input_ids {tuple(input_ids.shape)}; got "
            f"{tuple(position_ids.shape)}"
        )
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if max_pos and s > max_pos:  # GPT-2 would index past its position table; RoPE models were never trained there
        raise ValueError(
            f"sequence length {s} exceeds the model's max_position_embeddings={max_pos}; use "
            f"sequences of at most {max_pos} tokens (data.seq_len)"
        )
    if b % microbatches:
        raise ValueError(
            f"batch size {b} is not divisible by microbatches={microbatches}; use a batch that is a "
            f"multiple of {microbatches} or change pipeline.microbatches"
        )
    V = hf_config.vocab_size
    bad = (input_ids < 0) | (input_ids >= V)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(
            f"token id {int(input_ids[row, col])} at sample {row}, position {col} is outside the "
            f"vocabulary [0, {V}); the tokenizer and the model disagree (resize the model's vocabulary)"
        )
    bad = ((labels < 0) & (labels != -100)) | (labels >= V)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(
            f"label {int(labels[row, col])} at sample {row}, position {col} is outside [0, {V}) and "
            f"is not the ignore index -100"
        )


def make_microbatches(
    input_ids,
    labels,
    attention_mask,
    position_ids,
    *,
    microbatches: int,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    dp_group,
    loss_scale: float = 1.0,
    mask_uses: int | None = None,
) -> tuple[list[Microbatch], int]:
    """The step's microbatches and its valid-token count over every data-parallel replica (a collective
    over `dp_group`, a gloo group of the replicas, when there is one). Labels follow HF's convention and
    are shifted here. The microbatch's `attention_mask` is its `MicrobatchMasks` (`mask_uses`: the chunk
    forwards of this rank per microbatch, after which its built masks are let go)."""
    check_batch(input_ids, labels, position_ids, microbatches, hf_config)
    b, s = input_ids.shape
    m = microbatches
    shifted = shift_labels(labels, attention_mask)  # the token at t predicts labels[t + 1]
    valid = shifted != -100
    n_valid = valid.sum().to(torch.float64).reshape(1).cpu()
    if dp_group is not None:  # host data: summed on the replicas' gloo group, never through the device
        p2p.collective(dist.all_reduce, n_valid, dp_group, "valid-token count")
    n_total = int(n_valid.item())
    # g in at least float32 (float64 models keep float64: 1/N in float32 would cost 1e-8 relative)
    # (fp16: times the loss scale, a power of two, so the backward runs on S x loss exactly)
    scale = valid.to(torch.promote_types(dtype, torch.float32)) * (loss_scale / max(n_total, 1))
    default_pos = torch.arange(s).unsqueeze(0).expand(b // m, s)
    mbs = []
    for k in range(m):
        sl = slice(k * b // m, (k + 1) * b // m)
        pos = default_pos if position_ids is None else position_ids[sl].long()
        masks = MicrobatchMasks(pos.cpu(), None if attention_mask is None else attention_mask[sl].cpu(), mask_uses)
        mbs.append(
            Microbatch(
                input_ids=_to(input_ids[sl], device),
                labels=_to(shifted[sl], device),
                grad_scale=_to(scale[sl].reshape(-1), device),
                position_ids=_to(pos, device),
                attention_mask=masks,
            )
        )
    return mbs, n_total


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device, queued without waiting for the device (pinned, non-blocking)."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)
