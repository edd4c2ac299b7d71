"""One step's low-precision weight copies under mixed precision (runtime/precision.py), made once per
step and shared by every microbatch in flight.

Two kinds: the vocabulary shard (and its bias) the S pass multiplies by, and the frozen matmul weights
of a chunk (a LoRA base model, a frozen lm_head) that the executor swaps in for the chunk's forward
passes (and their backward passes, where checkpointed layers recompute), since autocast does not cache
casts of tensors that do not require grad. Each copy is reported to the meter once, as a weight copy,
never as an activation.

A third, for a backward that is not split (1F1B, interleaved): the chunks' trainable linear weights (and the
baseline's full lm_head). Other trainable weights (biases, fused expert tensors) are cast by autocast, whose
cache keeps that cast for the step (`precision.step_weight_casts`). Left to autocast's cache, each
weight's cast is one node made at the step's first forward, and autograd runs the oldest ready node last,
so in every later microbatch's backward that cast's gradient conversion waited until the backward's end: every 16-bit weight gradient of the chunk was alive at once (at 70B, 2 bytes per
parameter of the chunk: ~1.7 GB a layer). Made here as leaves (`trainable`), each copy's gradient goes into
the fp32 `.grad` as soon as it is complete (autograd runs a leaf's accumulation first; a hook adds it into
the master and drops it), the same sum in the same order. A split backward casts per call instead
(`runtime/weight_grad.py`) and keeps autocast's path.
"""

from __future__ import annotations

import torch

from vp_accelerate.runtime import precision
from vp_accelerate.runtime.memory import ActivationMeter


class StepCasts:
    """The low-precision copies of one step; dropped with it (weights change between steps)."""

    def __init__(
        self,
        modules,
        compute_dtype: torch.dtype | None,
        last_chunk: int,
        meter: ActivationMeter,
        split_backward: bool = False,
    ):
        self.modules = modules
        self.compute_dtype = compute_dtype
        """Mixed precision's compute dtype; None: no copies (everything runs in the parameters' dtype)."""
        self.last_chunk = last_chunk
        self.meter = meter
        self._copies: dict[int, torch.Tensor] = {}  # id(weight) -> its copy in the compute dtype
        self._frozen: dict[int, list] = {}  # chunk -> (owner module, name, copy) of its frozen matmul weights
        self.split_backward = split_backward
        """The schedule splits B from W: its linears cast per call, so `trainable` makes no copies."""
        self._trainable: dict[int, list] = {}  # chunk -> (owner module, name, leaf copy) of its trained weights

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in the compute dtype, cast on first use this step (a vocabulary shard, a bias, or a
        frozen matmul weight). The meter counts it once."""
        key = id(weight)
        if key not in self._copies:
            self._copies[key] = weight.detach().to(self.compute_dtype)
            self.meter.add_weight_copy(self._copies[key])
        return self._copies[key]

    def frozen(self, chunk: int) -> list:
        """(module, name, low-precision copy) of the chunk's frozen matmul weights (and the full lm_head's
        on the last chunk) for `precision.swapped`; [] without mixed precision."""
        if self.compute_dtype is None:
            return []
        if chunk not in self._frozen:
            self._frozen[chunk] = [(owner, name, self.weight(w)) for owner, name, w in self._weights(chunk, False)]
        return self._frozen[chunk]

    def _weights(self, chunk: int, trainable: bool) -> list:
        """`precision.matmul_weights` of the chunk (and of the full lm_head on the last chunk)."""
        mods = [self.modules.chunks[chunk]]
        if chunk == self.last_chunk and self.modules.head is not None:
            mods.append(self.modules.head)
        return [t for m in mods for t in precision.matmul_weights(m, trainable)]

    def trainable(self, chunk: int) -> list:
        """(module, name, low-precision leaf copy) of the chunk's trainable linear weights (and the full
        lm_head's on the last chunk) for `precision.swapped`, each copy's gradient added into its fp32
        master's `.grad` as soon as autograd has it; [] without mixed precision or under a split backward."""
        if self.compute_dtype is None or self.split_backward:
            return []
        if chunk not in self._trainable:
            copies = []
            for owner, name, w in self._weights(chunk, True):
                copy = w.detach().to(self.compute_dtype).requires_grad_(True)
                copy.register_post_accumulate_grad_hook(precision.into_master_grad(w))
                self.meter.add_weight_copy(copy)
                copies.append((owner, name, copy))
            self._trainable[chunk] = copies
        return self._trainable[chunk]

    def swaps(self, chunk: int) -> list:
        """Everything `precision.swapped` puts in place for the chunk's passes: its frozen and its trainable
        weights' copies."""
        return self.frozen(chunk) + self.trainable(chunk)
