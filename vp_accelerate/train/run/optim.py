"""AdamW over a pipeline rank's own parameters (the LR schedule is the recipe's: `recipe/lr_schedule.py`)."""

from __future__ import annotations

import torch


def build_optimizer(pipe, opt_cfg, row_trained=()) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices (dim >= 2) only; norms and biases are not decayed, nor a vocabulary
    weight of which only some rows train (`row_trained`, ids of such weights: decay would move the frozen rows).
    Its state is sharded over the data-parallel replicas with `pipeline.zero: 1` (`PipelineModel.make_optimizer`)."""
    decay, no_decay = [], []
    for _, p in pipe.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in row_trained else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # on CUDA one fused kernel over all tensors (no full-size temporaries as foreach makes); CPU has no fused AdamW
    fused = {"fused": True} if decay + no_decay and all(p.is_cuda for p in decay + no_decay) else {}
    return pipe.make_optimizer(
        [g for g in groups if g["params"]],
        torch.optim.AdamW,
        lr=opt_cfg.lr,
        betas=tuple(opt_cfg.betas),
        eps=opt_cfg.eps,
        **fused,
    )
