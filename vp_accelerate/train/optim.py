"""AdamW over a pipeline rank's own parameters, and the warm-up + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR before optimizer step `step` (0-based).

    Linear warm-up from 1/(warmup+1) to 1 over `warmup_steps`, then cosine or linear decay to
    `min_lr_ratio` at the last step, or constant.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"unknown decay {decay!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_optimizer(named_parameters, opt_cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) only; norms and biases are not decayed."""
    decay, no_decay = [], []
    for _, p in named_parameters:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                             eps=opt_cfg.eps)


def build_scheduler(optimizer, lr_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_factor`; its state_dict is plain numbers (safe to load with weights_only)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, lr_cfg.warmup_steps, lr_cfg.decay, lr_cfg.min_lr_ratio))
