"""Count activation bytes held between a forward pass and its backward, per (microbatch, chunk).

Autograd's saved-tensor hooks see every tensor a forward pass keeps for its backward; summing their
storages (once each, parameters excluded) gives the activation memory of that pass without guessing.
Stashed pass state (the output layer's S->T tensors) is added explicitly. The peak over the step is
what the simulator predicts in microbatches; on CUDA torch.cuda.max_memory_allocated is reported too.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class ActivationMeter:
    """Live activation bytes per key, and the peak of their sum."""

    def __init__(self, exclude: set[int] | None = None) -> None:
        self.exclude = exclude or set()  # storage data_ptrs of parameters
        self.live: dict[object, int] = defaultdict(int)
        self.seen: dict[object, set] = defaultdict(set)
        self.total = 0
        self.peak = 0

    def hooks(self, key):
        """(pack, unpack) for torch.autograd.graph.saved_tensors_hooks, charging `key`."""

        def pack(t: torch.Tensor):
            if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
                return t
            ptr, nbytes = _storage_key(t)
            if ptr not in self.exclude and ptr not in self.seen[key]:
                self.seen[key].add(ptr)
                self.add(key, nbytes)
            return t

        return pack, (lambda t: t)

    def add(self, key, nbytes: int) -> None:
        self.live[key] += nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)

    def release(self, key) -> None:
        self.total -= self.live.pop(key, 0)
        self.seen.pop(key, None)
