"""Per-chunk logit math shared by the S and T passes: logits, their transform and its derivative.

The model's logit transform z = f(r) of the raw logits r = x Wᵀ (+ b, when the head has a bias) is
    z = softcap · tanh(logit_scale · r / softcap)   (Gemma-2 final softcapping), or
    z = logit_scale · r                             (no softcap),
and enters the gradient through f'(r). f'(r) is recovered from z alone, so a stored z (store mode)
needs no second tensor:  f'(r) = logit_scale · (1 − (z / softcap)²), or the constant logit_scale.
"""

from __future__ import annotations

import torch


def chunk_ranges(rows: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Split the shard's `rows` real rows into [lo, hi) chunks of at most `chunk_size` rows.

    Padded rows are never visited: not computing a logit is the same as giving it −inf (no
    probability mass, zero gradient), and it saves their matmul.
    """
    if rows == 0:
        return []
    step = rows if chunk_size is None else chunk_size
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def chunk_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    lo: int,
    hi: int,
    softcap: float | None,
    logit_scale: float,
    stat_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Transformed logits z = f(x W[lo:hi]ᵀ + b[lo:hi]) of one chunk, `[N, hi − lo]` in `stat_dtype`.

    The matmul runs in the inputs' dtype (bf16 stays bf16 for speed); everything after it in fp32,
    because the softmax statistics are only as good as the logits fed to them. `bias` is the shard's
    output bias (Phi), added in the inputs' dtype as `F.linear` does.
    """
    r = x @ weight[lo:hi].t()
    if bias is not None:
        r = r + bias[lo:hi]
    z = r.to(stat_dtype)
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def chunk_logit_derivative(z: torch.Tensor, softcap: float | None, logit_scale: float) -> torch.Tensor | float:
    """f'(r) at the transformed logits z: a tensor like z with softcapping, else the scalar logit_scale."""
    if softcap is None:
        return float(logit_scale)
    return (1.0 - (z / softcap).square()) * logit_scale


def target_columns(
    local_labels: torch.Tensor, in_shard: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit, col) for chunk [lo, hi): hit[n] is 1.0 where token n's label falls in the chunk, col[n] its column.

    Mask arithmetic with clamped columns instead of nonzero(): no host sync on GPU. Where hit is 0,
    col is a harmless in-range column whose contribution gets multiplied by 0.
    """
    hit = in_shard & (local_labels >= lo) & (local_labels < hi)
    col = (local_labels - lo).clamp(0, hi - lo - 1)
    return hit, col
