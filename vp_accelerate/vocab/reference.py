"""Single-process float64 reference of embedding → output layer → cross-entropy, through autograd.

The model it checks: X = x0 + E[ids] (the embedding feeds X directly, so ∂L/∂emb = ∂L/∂X), logits =
f(X Wᵀ) with the options' logit scale / softcap, loss = token mean of torch's cross-entropy (label
smoothing, ignore_index) over all valid tokens. With `tied`, W is E; an optional output bias b makes the
raw logits X Wᵀ + b.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ReferenceResult:
    """Float64 loss and gradients of the reference model."""

    loss: torch.Tensor
    """0-dim token-mean loss."""
    grad_x: torch.Tensor
    """[N, h] ∂L/∂X."""
    grad_w: torch.Tensor
    """[V, h] ∂L/∂W (the total gradient of the shared tensor when tied)."""
    grad_e: torch.Tensor
    """[V, h] ∂L/∂E (equal to grad_w when tied)."""
    grad_b: torch.Tensor | None = None
    """[V] ∂L/∂b when the output layer has a bias, else None."""


def reference(
    x0: torch.Tensor,
    ids: torch.Tensor,
    labels: torch.Tensor,
    emb: torch.Tensor,
    weight: torch.Tensor | None,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
) -> ReferenceResult:
    """Loss and gradients in float64; `weight=None` ties the output weight to `emb`; `bias` [V] or None."""
    e = emb.detach().to(torch.float64).requires_grad_(True)
    b = None if bias is None else bias.detach().to(torch.float64).requires_grad_(True)
    w = e if weight is None else weight.detach().to(torch.float64).requires_grad_(True)
    x = (x0.to(torch.float64) + e[ids]).detach().requires_grad_(True)
    # Split the graph at X so ∂L/∂X and ∂L/∂E are both visible: ∂L/∂E gathers X's gradient by hand below.
    z = x @ w.t()
    if b is not None:
        z = z + b
    z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    n_valid = max(int((labels != ignore_index).sum()), 1)
    loss = (
        F.cross_entropy(z, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum")
        / n_valid
    )
    gx, gw, *gb = torch.autograd.grad(loss, [x, w] + ([b] if b is not None else []))
    grad_e = torch.zeros_like(e).index_add_(0, ids, gx)
    if weight is None:
        grad_e = grad_e + gw  # tied: the output layer's contribution lands on the same tensor
        gw = grad_e
    return ReferenceResult(loss=loss.detach(), grad_x=gx, grad_w=gw, grad_e=grad_e, grad_b=gb[0] if gb else None)
