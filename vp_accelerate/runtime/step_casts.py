"""One step's low-precision weight copies under mixed precision (runtime/precision.py), made once per
step and shared by every microbatch in flight.

Two kinds: the vocabulary shard (and its bias) the S pass multiplies by, and the frozen matmul weights
of a chunk (a LoRA base model, a frozen lm_head) that the executor swaps in for the chunk's forward
passes, since autocast does not cache casts of tensors that do not require grad. Trainable weights of
the chunks need nothing here: autocast caches their casts for the step (`precision.step_weight_casts`).
Each copy is reported to the meter once, as a weight copy, never as an activation.
"""

from __future__ import annotations

import torch

from vp_accelerate.runtime import precision
from vp_accelerate.runtime.memory import ActivationMeter


class StepCasts:
    """The low-precision copies of one step; dropped with it (weights change between steps)."""

    def __init__(self, modules, compute_dtype: torch.dtype | None, last_chunk: int, meter: ActivationMeter):
        self.modules = modules
        self.compute_dtype = compute_dtype
        """Mixed precision's compute dtype; None: no copies (everything runs in the parameters' dtype)."""
        self.last_chunk = last_chunk
        self.meter = meter
        self._copies: dict[int, torch.Tensor] = {}  # id(weight) -> its copy in the compute dtype
        self._frozen: dict[int, list] = {}  # chunk -> (owner module, name, copy) of its frozen matmul weights

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
            mods = [self.modules.chunks[chunk]]
            if chunk == self.last_chunk and self.modules.head is not None:
                mods.append(self.modules.head)
            self._frozen[chunk] = [
                (owner, name, self.weight(w)) for m in mods for owner, name, w in precision.frozen_matmul_weights(m)
            ]
        return self._frozen[chunk]
