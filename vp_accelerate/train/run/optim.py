"""AdamW over a pipeline rank's own parameters (the LR schedule is the recipe's: `recipe/lr_schedule.py`)."""

from __future__ import annotations

import torch


def build_optimizer(named_parameters, opt_cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) only; norms and biases are not decayed."""
    decay, no_decay = [], []
    for _, p in named_parameters:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps
    )
