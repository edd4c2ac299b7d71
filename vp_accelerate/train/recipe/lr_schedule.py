"""The learning-rate schedule a recipe's `lr` section names, and its check.

Schedules: this project's `cosine` / `linear` / `constant` (warm-up from 1/(w+1), decay to `min_lr_ratio`
at the last step; the names recipes have always used), or any `transformers.get_scheduler` name with its
`scheduler_specific_kwargs`. Both are LambdaLRs whose state_dict is plain numbers.
"""

from __future__ import annotations

import difflib
import math

import torch
from transformers import SchedulerType, get_scheduler

from .convert import RecipeError


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


OWN = ("cosine", "linear", "constant")

#: transformers' own `linear` / `cosine` (the plain names are this project's, kept as they were)
HF_ALIASES = {"linear_hf": "linear", "cosine_hf": "cosine"}

#: get_scheduler names left out: they step on a metric (eval loss), not on the step number
_UNSUPPORTED = ("reduce_lr_on_plateau", "greedy")


def hf_names() -> list[str]:
    return [s.value for s in SchedulerType if s.value not in OWN + _UNSUPPORTED] + list(HF_ALIASES)


def _hf_kwargs(lr_cfg) -> dict:
    """scheduler_specific_kwargs, with `min_lr_ratio` filled in where the schedule has a floor."""
    name = HF_ALIASES.get(lr_cfg.decay, lr_cfg.decay)
    kw = dict(lr_cfg.scheduler_kwargs)
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") and not {"min_lr", "min_lr_rate"} & set(kw):
        kw["min_lr_rate"] = lr_cfg.min_lr_ratio
    if name == "warmup_stable_decay":
        kw.setdefault("min_lr_ratio", lr_cfg.min_lr_ratio)
    return kw


def build_scheduler(optimizer, lr_cfg, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The recipe's schedule; its state_dict is plain numbers (safe to load with weights_only)."""
    if lr_cfg.decay in OWN:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total_steps, lr_cfg.warmup_steps, lr_cfg.decay, lr_cfg.min_lr_ratio)
        )
    return get_scheduler(
        HF_ALIASES.get(lr_cfg.decay, lr_cfg.decay),
        optimizer,
        num_warmup_steps=lr_cfg.warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=_hf_kwargs(lr_cfg),
    )


def check_schedule(lr_cfg, total_steps: int) -> None:
    """Build the schedule on a dummy optimizer: an unknown name or bad kwargs is a RecipeError naming the key."""
    if lr_cfg.decay not in OWN:
        names = hf_names()
        if lr_cfg.decay not in names:
            hint = difflib.get_close_matches(lr_cfg.decay, list(OWN) + names, n=1)
            more = f"; did you mean {hint[0]!r}?" if hint else ""
            raise RecipeError(
                f"lr.decay: unknown schedule {lr_cfg.decay!r}{more} (known: {', '.join(list(OWN) + names)})"
            )
    elif lr_cfg.scheduler_kwargs:
        raise RecipeError(f"lr.scheduler_kwargs: {lr_cfg.decay!r} takes none (they are for transformers' schedules)")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        sched = build_scheduler(opt, lr_cfg, total_steps)
        for _ in range(min(total_steps, 3)):
            opt.step()
            sched.step()
    except (TypeError, ValueError) as e:
        raise RecipeError(f"lr.scheduler_kwargs: {lr_cfg.decay!r} with {dict(lr_cfg.scheduler_kwargs)}: {e}") from None
