"""Mixed precision with fp32 master weights: low-precision compute, fp32 parameters, gradients and
optimizer state, and a dynamic loss scaler for fp16.

Where the low precision is used (the executor applies it):
- decoder chunks run their forward under `torch.autocast(device_type, dtype)`; backward follows the
  dtypes autocast recorded, and the weight gradients land in the fp32 `.grad` (autocast's casts are
  differentiable; the linears' step copies of `StepCasts.trainable` add theirs through a hook as soon as
  each is made), so microbatches accumulate in fp32;
- the vocabulary passes cast X and their weight shard to the low dtype for the matmuls; the softmax
  statistics (max, sum, target logit) and the loss stay fp32, and ∇W accumulates into the fp32 grad;
- activations and gradients between stages, C0's X and IB's embedding gradient travel in the compute
  dtype (half the bytes of fp32); a received activation is widened back to the parameters' dtype before
  the chunk runs, so each stage's residual stream is fp32 as in one process. C0 is exact that way (the S
  pass multiplies X in the compute dtype anyway); the IF reduce stays fp32. Without mixed precision
  everything travels in the parameters' dtype.

One low-precision copy of each weight per step (`step_weight_casts`, `frozen_matmul_weights`): every
microbatch in flight shares it, and it is freed at the end of the step. Without that, each forward pass
would cast for itself and every microbatch between its F and B would hold its own copy of every weight.

The modes themselves (their names, parameter and compute dtypes, loss scaling) are the table
`vp_accelerate.modes.PRECISIONS`; "pure-bf16" needs nothing of this file: its parameters are bf16 and
everything runs and travels in their dtype, as "no" does.

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
from transformers.pytorch_utils import Conv1D

from vp_accelerate import modes
from vp_accelerate.models.stage import FullHead
from vp_accelerate.runtime import p2p


def resolve(mode: str | None) -> str:
    """The canonical mode ("no" when unset); raises ModeError (a ValueError) for an unknown one, naming the
    valid ones."""
    return modes.precision("no" if mode is None else mode).name


def low_dtype(mode: str) -> torch.dtype | None:
    """The autocast compute dtype of a mode with fp32 master weights, None when compute runs in the
    parameters' own dtype ("no", "pure-bf16")."""
    entry = modes.precision(mode)
    return getattr(torch, entry.compute_dtype) if entry.master_weights else None


def param_dtype(mode: str, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype to build the parameters in: the mode's (float32 master weights for bf16/fp16, bfloat16 for
    pure-bf16), or for "no" the caller's `dtype` (float32 when None). A `dtype` the mode contradicts raises,
    naming the fix."""
    entry = modes.precision(mode)
    if entry.param_dtype is None:
        return torch.float32 if dtype is None else dtype
    want = getattr(torch, entry.param_dtype)
    if dtype is not None and dtype != want:
        raise ValueError(
            f"mixed_precision={entry.name} keeps the parameters in {want}: build the model with dtype={want} "
            f"(or leave dtype unset), got {dtype}; or set mixed_precision: no to train in {dtype}"
        )
    return want


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast on the device's type in `dtype`; a no-op context when dtype is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def step_weight_casts(device: torch.device, dtype: torch.dtype | None):
    """Enclose one step's passes so that autocast casts each trainable weight once for all microbatches.

    torch.autocast caches its low-precision cast of every fp32 leaf tensor that requires grad (the
    weights) while any autocast region is open, and clears the cache when the outermost region exits
    (torch/amp/autocast_mode.py). Each forward pass is its own region, so on its own each microbatch
    would cast again and its graph would keep its own copy of every weight until its backward. This
    enclosing region (autocast off inside it: nothing else changes precision) keeps the cache for the
    whole step: the first forward casts, later microbatches reuse that copy and their backwards add
    into the same fp32 .grad through it, and the copies go when the step ends, after the last backward
    and before the optimizer changes the weights. The cache is cleared on exit even inside a caller's
    own autocast region, so no cast outlives the weights it was made from.

    On CUDA the autograd engine runs backward on a device thread, where no region is open: an
    activation-checkpointed layer's recompute opens and closes one there, and closing it would clear
    the (process-wide) cache in the middle of the step. Backward therefore runs on the calling thread
    while the step lasts (torch.autograd.set_multithreading_enabled(False)), inside this region.
    Frozen weights (requires_grad=False) are not cached by autocast: see `frozen_matmul_weights`.
    """
    if dtype is None:
        yield
        return
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast(device_type=device.type, dtype=dtype, enabled=False))
            if device.type == "cuda":
                stack.enter_context(torch.autograd.set_multithreading_enabled(False))
            yield
    finally:
        torch.clear_autocast_cache()


def matmul_weights(module: torch.nn.Module, trainable: bool) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """(owner, name, parameter) of every fp32 matmul weight under `module` (the `weight` of each nn.Linear,
    GPT-2 Conv1D and full lm_head) that requires grad (`trainable`) or does not. Embeddings and norms are left
    alone: autocast does not cast them.

    Frozen ones (a LoRA base layer, a frozen vocabulary): autocast casts these for every call without caching
    them (it caches only tensors that require grad), so the executor casts each once per step and swaps the
    copy in (`swapped`). Trainable ones (a decoder chunk's linears, LoRA's adapters, the baseline's head): under
    a backward that is not split the executor makes their step copies itself too (`StepCasts.trainable`), as
    leaves whose gradient goes into the fp32 .grad as soon as it is made."""
    found = []
    for sub in module.modules():
        if not isinstance(sub, (torch.nn.Linear, Conv1D, FullHead)):
            continue
        w = sub._parameters.get("weight")
        if w is not None and w.requires_grad == trainable and w.dtype == torch.float32:
            found.append((sub, "weight", w))
    return found


def frozen_matmul_weights(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """`matmul_weights(module, trainable=False)`."""
    return matmul_weights(module, trainable=False)


def into_master_grad(master: torch.nn.Parameter):
    """A post-accumulate-grad hook for a low-precision leaf copy of `master`: add the copy's gradient into
    master's fp32 `.grad` (what autograd's cast backward would do) and drop it at once. Hooks registered on
    the master itself (`Tensor.register_hook`) still see each microbatch's gradient in master's dtype first,
    as they did when it flowed through the cast."""

    def hook(copy: torch.Tensor) -> None:
        g, copy.grad = copy.grad, None
        if master._backward_hooks:
            g = g.to(master.dtype)
            for user_hook in master._backward_hooks.values():
                out = user_hook(g)
                g = g if out is None else out
        if master.grad is None:
            master.grad = g.to(master.dtype)
        else:
            master.grad.add_(g)

    return hook


def hold_frozen(chunks, dtype: torch.dtype) -> int:
    """Cast the frozen fp32 weights of the decoder layers' nn.Linear / Conv1D (a LoRA base model) to the
    compute `dtype` in place, for good: they never change, so the step's cast of each (`frozen_matmul_weights`)
    would make the same tensor every step, and holding it alone takes 2 bytes per parameter instead of 4 + 2.
    Autocast runs them as before (their inputs are cast to `dtype`); the adapters, biases and norms stay fp32.
    The full lm_head is left alone (the baseline ties it to the embedding). Returns the parameters cast."""
    count = 0
    for chunk in chunks:
        for sub in chunk.modules():
            if not isinstance(sub, (torch.nn.Linear, Conv1D)):
                continue
            w = sub._parameters.get("weight")
            if w is not None and not w.requires_grad and w.dtype == torch.float32:
                w.data = w.data.to(dtype)
                count += w.numel()
    return count


@contextlib.contextmanager
def swapped(copies: list[tuple[torch.nn.Module, str, torch.Tensor]]):
    """Put each tensor in place of its module's parameter `name` for the duration (as
    torch.func.functional_call does), and the parameters back afterwards, even on error."""
    saved = []
    try:
        for owner, name, tensor in copies:
            saved.append((owner, name, owner._parameters[name]))
            owner._parameters[name] = tensor
        yield
    finally:
        for owner, name, param in reversed(saved):
            owner._parameters[name] = param


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16 (the state is saved with checkpoints)."""

    scale: float = 2.0**16
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


def loss_scaler_for(mode: str) -> LossScaler | None:
    """A fresh dynamic loss scaler for a mode with loss scaling (fp16), else None."""
    return LossScaler() if modes.precision(mode).loss_scaling else None


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
        p2p.collective(dist.all_reduce, found, group, "overflow check", op=dist.ReduceOp.MAX)
    return bool(found.item() > 0)


REDUCE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
"""`pipeline.dp_reduce_dtype` values: the dtype data-parallel gradient buckets travel in."""


def reduce_dtype(name: str | None) -> torch.dtype | None:
    """The dtype of `pipeline.dp_reduce_dtype` (None: the gradients' own)."""
    if name is None:
        return None
    key = str(name).strip().lower()
    if key not in REDUCE_DTYPES:
        raise ValueError(f"dp_reduce_dtype: unknown value {name!r}; use bf16, or null for the gradients' dtype")
    return REDUCE_DTYPES[key]
