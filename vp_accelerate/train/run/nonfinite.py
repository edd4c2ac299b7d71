"""NaN/inf in a training step or in weights about to be saved: find where, say it, agree on every rank.

Every decision here is taken from values that are the same on every rank (the step's loss, the global
gradient norm, an all-reduced flag), so all ranks stop or skip together and no rank is left waiting in a
collective for a peer that has given up.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vp_accelerate.runtime.groups import host_group

from .tracking import gather


class NonFiniteError(RuntimeError):
    """A step or a checkpoint with NaN/inf values; the message names the step and where."""


def nonfinite_tensors(state: dict, prefix: str = "") -> list[str]:
    """Names of floating tensors holding NaN/inf in a (nested) state dict, e.g. a model or optimizer state."""
    bad = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            bad += nonfinite_tensors(value, name + ".")
        elif isinstance(value, (list, tuple)):
            bad += nonfinite_tensors(dict(enumerate(value)), name + ".")
        elif torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
            bad.append(name)
    return bad


def _world_any(flag: bool) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    dist.all_reduce(t, group=host_group())  # a host flag: the gloo side group (the default one is NCCL on GPUs)
    return bool(t.item() > 0)


def step_problem(step: int, res, grad_norm: float, pipe, rows_of_microbatch=None) -> str | None:
    """A message naming what is non-finite in this step, or None when loss and gradients are finite.

    The loss names its microbatch(es) and, through `rows_of_microbatch(mb) -> str`, the data rows they
    came from (this replica's only); a gradient that is non-finite while every microbatch's loss is finite
    names the parameters (gathered from every rank: a collective, reached by all ranks together).
    """
    m = pipe.cfg.microbatches
    if not math.isfinite(res.loss):
        where = []
        for replica, mb in res.nonfinite_microbatches or ():
            origin = f" = {rows_of_microbatch(mb)}" if rows_of_microbatch and replica == pipe.dp_rank else ""
            where.append(f"microbatch {mb} of {m} (replica {replica}){origin}")
        found = "; ".join(where) if where else "no single microbatch (the sum over microbatches overflowed)"
        return f"step {step}: non-finite loss ({res.loss}) in {found}"
    if not math.isfinite(grad_norm):
        names = [n for n, p in pipe.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        per_rank = gather(names)
        listed = "; ".join(
            f"rank {r}: {', '.join(n[:4])}{' ...' if len(n) > 4 else ''}" for r, n in enumerate(per_rank) if n
        )
        return (
            f"step {step}: non-finite gradient (global norm {grad_norm}) although the loss of every "
            f"microbatch was finite ({res.loss:.4f}); parameters with NaN/inf gradients — {listed}"
        )
    return None


def check_weights_before_save(step: int, model_state: dict, optimizer_state: dict) -> None:
    """Collective: raise NonFiniteError on every rank if any rank's weights or optimizer state are NaN/inf,
    so that no checkpoint is ever written with them (the previous one stays `latest`)."""
    bad = nonfinite_tensors(model_state) + nonfinite_tensors(optimizer_state.get("state", {}), "optimizer.")
    if _world_any(bool(bad)):
        per_rank = gather(bad[:4])
        listed = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(per_rank) if n)
        raise NonFiniteError(
            f"refusing to write the checkpoint of step {step}: non-finite values in {listed}; "
            f"the previous checkpoint stays the latest"
        )
