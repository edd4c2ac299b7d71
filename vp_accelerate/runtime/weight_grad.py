"""Split a backward pass into B (input gradient) and W (weight gradient) for zero-bubble schedules.

V-Half needs B, which the previous stage waits for, separate from W, which nobody waits for. The
weight gradients of a decoder layer are almost all in its nn.Linear layers, so we route those through
an autograd function that, while deferral is on, computes only ∂x in backward and queues (x, ∂y) for
the W pass. Norm weights and biases are tiny and keep their gradient in B.
"""

from __future__ import annotations

import types
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F


class WeightGradStore:
    """Queues the deferred weight-gradient GEMMs of each (microbatch, chunk) until its W pass."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None  # set by the executor around a B pass
        self.queues: dict[tuple[int, int], list] = defaultdict(list)

    def defer(self, item) -> None:
        self.queues[self.key].append(item)

    @torch.no_grad()  # the queued x needs grad (an activation): with grad mode on, ∂W would carry a graph
    def flush(self, key: tuple[int, int]) -> None:
        """Run the W pass of `key`: accumulate every queued weight gradient."""
        for x, gy, weight in self.queues.pop(key, ()):
            gw = gy.reshape(-1, gy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
            if weight.grad is None:
                weight.grad = gw.to(weight.dtype)
            else:
                # a 16-bit ∂W is added into the fp32 grad as it is read (the same sums as casting it first,
                # the cast being exact), so no fp32 copy of the weight's size exists next to it
                weight.grad.add_(gw)

    def queued(self, key: tuple[int, int]) -> list[torch.Tensor]:
        """The tensors `key`'s W pass will read (each linear's input and output gradient)."""
        return [t for x, gy, _ in self.queues.get(key, ()) for t in (x, gy)]

    def pending_bytes(self) -> int:
        return sum(
            x.numel() * x.element_size() + gy.numel() * gy.element_size()
            for q in self.queues.values()
            for x, gy, _ in q
        )


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        # Under autocast (mixed precision) compute as autocast's linear would: inputs cast to the autocast
        # dtype, the cast x saved for ∂W. Gradients are returned in each input's own dtype, so an fp32
        # master weight gets an fp32 .grad.
        device_type = x.device.type
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if torch.is_autocast_enabled(device_type):
            dt = torch.get_autocast_dtype(device_type)
            x = x.to(dt)
            w = weight.to(dt)
            bias = bias.to(dt) if bias is not None else None
        else:
            w = weight
        ctx.save_for_backward(x)
        # The Parameter itself, not a saved tensor: under saved-tensor hooks (activation metering) an
        # unpacked saved input can be an alias whose .grad is not the Parameter's.
        ctx.weight = weight
        ctx.store = store
        ctx.has_bias = bias is not None
        with torch.autocast(device_type, enabled=False):
            return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        gy = gy.to(x.dtype)
        gx = gy.matmul(weight.to(gy.dtype)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        gb = (
            gy.reshape(-1, gy.shape[-1]).sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        )
        if ctx.store.key is not None and ctx.needs_input_grad[1]:
            ctx.store.defer((x, gy, weight))
            return gx, None, gb, None
        gw = (
            gy.reshape(-1, gy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype)
            if ctx.needs_input_grad[1]
            else None
        )
        return gx, gw, gb, None


def _deferred_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _DeferredLinear.apply(x, self.weight, self.bias, self._vp_weight_grad_store)


def install(module: nn.Module, store: WeightGradStore) -> int:
    """Route every nn.Linear under `module` through the store; returns how many were patched.

    GPT-2's Conv1D is a linear layer with a transposed weight; it keeps its plain backward, so its
    weight gradient is computed in B (correct, only less deferred).
    """
    count = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub._vp_weight_grad_store = store
            sub.forward = types.MethodType(_deferred_forward, sub)
            count += 1
    return count
