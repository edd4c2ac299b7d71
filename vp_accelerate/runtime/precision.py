"""Mixed precision with fp32 master weights: low-precision compute, fp32 parameters, gradients and
optimizer state, and a dynamic loss scaler for fp16.

Where the low precision is used (the executor applies it):
- decoder chunks run their forward under `torch.autocast(device_type, dtype)`; backward follows the
  dtypes autocast recorded, and the weight gradients land in the fp32 `.grad` (autocast's casts are
  differentiable), so microbatches accumulate in fp32;
- the vocabulary passes cast X and their weight shard to the low dtype for the matmuls; the softmax
  statistics (max, sum, target logit) and the loss stay fp32, and ∇W accumulates into the fp32 grad;
- activations and gradients between stages travel in the parameters' dtype (fp32), so receive buffers
  need not know what the sender computed in.

fp16's narrow exponent makes small gradients underflow, so its backward runs on the loss times a
power-of-two scale S (folded into the per-token gradient weights g; exact). After the step the
gradients are unscaled (×1/S, exact), checked for inf/NaN on every pipeline rank together, and a step
with overflow is reported as skipped and halves S; 2000 clean steps in a row double it (torch's
GradScaler defaults).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

MIXED_PRECISIONS = ("no", "bf16", "fp16")
LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve(mode: str | None) -> str:
    """The canonical mode ("no" when unset); raises for an unknown one, naming the valid ones."""
    mode = "no" if mode is None else str(mode).lower()
    if mode not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision: must be one of {MIXED_PRECISIONS}, got {mode!r}")
    return mode


def low_dtype(mode: str) -> torch.dtype | None:
    """The compute dtype of a mode, None for "no"."""
    return LOW_DTYPES.get(mode)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast on the device's type in `dtype`; a no-op context when dtype is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16 (the state is saved with checkpoints)."""

    scale: float = 2.0 ** 16
    """Current S: the backward runs on S x loss."""
    growth_factor: float = 2.0
    """S is multiplied by this after `growth_interval` clean steps in a row."""
    backoff_factor: float = 0.5
    """S is multiplied by this after a step with inf/NaN gradients (which is skipped)."""
    growth_interval: int = 2000
    """Clean steps in a row before S grows."""
    clean_steps: int = 0
    """Clean steps since the last change of S."""
    skipped_steps: int = 0
    """Steps skipped for overflow so far."""

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, 1.0)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@torch.no_grad()
def unscale_and_check(params, scale: float, device: torch.device, group) -> bool:
    """Multiply every gradient by 1/scale in place; True when any gradient on any rank of `group` (a
    device group) holds inf/NaN. One host sync, after the all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        found = torch.maximum(found, (~torch.isfinite(g)).any().to(found.dtype).reshape(1))
    if grads and scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / scale)
    if group is not None and dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item() > 0)
