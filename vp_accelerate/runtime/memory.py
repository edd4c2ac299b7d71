"""Count activation bytes held between a forward pass and its backward, per (microbatch, chunk).

Autograd's saved-tensor hooks see every tensor a forward pass keeps for its backward; summing their
storages (once each, parameters excluded) gives the activation memory of that pass without guessing.
Stashed pass state (the output layer's S->T tensors) is added explicitly. The peak over the step is
what the simulator predicts in microbatches; on CUDA torch.cuda.max_memory_allocated is reported too.

Under mixed precision a forward pass also saves the low-precision copies of the weights it multiplied
by (autocast's cast of a parameter, or the executor's per-step copy of a frozen one). Those are weights,
shared by every microbatch of the step, not activations: each is counted once, in `weight_copy_bytes`,
and never in the activation total. A saved tensor is such a copy when it (or the tensor it views) is a
dtype cast of a Parameter (its grad_fn is ToCopyBackward0 straight from the parameter's AccumulateGrad)
or was registered with `add_weight_copy`. A copy made again for each microbatch is a new storage each
time and so shows up as several copies: the count measures the sharing, it does not assume it.

Communication buffers are counted too, apart from the activations (`add_comm` / `release_comm`): a
posted receive's buffer until its pass takes it, a sent tensor until its batch completes, a collective's
buffer (C0's X, the IF partial, IB's gradient) until its consumer takes it. `comm_peak` is their peak,
`held_peak` the peak of activations and communication buffers together.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def is_parameter_cast(t: torch.Tensor) -> bool:
    """True when `t`, or the tensor it is a view of, is a dtype cast of a Parameter that requires grad
    (autocast's cached low-precision copy of a weight; F.linear saves a transposed view of it)."""
    base = t if t._base is None else t._base
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0" or not fn.next_functions:
        return False
    source = fn.next_functions[0][0]
    return isinstance(getattr(source, "variable", None), torch.nn.Parameter)


class ActivationMeter:
    """Live activation bytes per key, and the peak of their sum."""

    def __init__(self, exclude: set[int] | None = None) -> None:
        self.exclude = exclude or set()  # storage data_ptrs of parameters
        self.live: dict[object, int] = defaultdict(int)
        self.seen: dict[object, set] = defaultdict(set)
        self.total = 0
        self.peak = 0
        self.weight_copies: dict[int, int] = {}  # storage data_ptr -> bytes of a low-precision weight copy
        self.comm: dict[object, int] = {}  # key -> bytes of the communication buffers held under it
        self.comm_total = 0
        self.comm_peak = 0
        self.held_peak = 0  # activations + communication buffers

    def hooks(self, key):
        """(pack, unpack) for torch.autograd.graph.saved_tensors_hooks, charging `key`."""

        def pack(t: torch.Tensor):
            if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
                return t
            ptr, nbytes = _storage_key(t)
            if ptr in self.exclude or ptr in self.seen[key] or ptr in self.weight_copies:
                return t
            if is_parameter_cast(t):  # a weight, not an activation: once per step, whoever saves it
                self.weight_copies[ptr] = nbytes
                return t
            self.seen[key].add(ptr)
            self.add(key, nbytes)
            return t

        return pack, (lambda t: t)

    def add_weight_copy(self, t: torch.Tensor) -> None:
        """Count `t` (a per-step low-precision copy of a weight) once, and never as an activation."""
        ptr, nbytes = _storage_key(t)
        self.weight_copies[ptr] = nbytes

    @property
    def weight_copy_bytes(self) -> int:
        """Bytes of the distinct low-precision weight copies seen this step."""
        return sum(self.weight_copies.values())

    def add(self, key, nbytes: int) -> None:
        self.live[key] += nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)
        self.held_peak = max(self.held_peak, self.total + self.comm_total)

    def release(self, key) -> None:
        self.total -= self.live.pop(key, 0)
        self.seen.pop(key, None)

    def add_comm(self, key, tensors) -> None:
        """Charge the distinct storages of `tensors` (communication buffers) to `key` until `release_comm`."""
        nbytes = storage_bytes(tensors, self.exclude)
        self.comm[key] = self.comm.get(key, 0) + nbytes
        self.comm_total += nbytes
        self.comm_peak = max(self.comm_peak, self.comm_total)
        self.held_peak = max(self.held_peak, self.total + self.comm_total)

    def release_comm(self, key) -> None:
        self.comm_total -= self.comm.pop(key, 0)


class PeakCount:
    """A live count (e.g. weighted microbatches in flight) and its peak over the step."""

    def __init__(self) -> None:
        self.live = 0.0
        self.peak = 0.0

    def add(self, n: float = 1.0) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def remove(self, n: float = 1.0) -> None:
        self.live -= n


def storage_bytes(values, exclude=frozenset()) -> int:
    """Bytes of the distinct tensor storages among `values` (tensors, or lists / tuples of them; anything
    else is skipped), leaving out Parameters and the storages in `exclude` (the parameters': a state that
    refers to a weight shard does not copy it)."""
    seen: dict[int, int] = {}
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    for v in flat:
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device.type != "meta":
            ptr, nbytes = _storage_key(v)
            if ptr not in exclude:
                seen[ptr] = nbytes
    return sum(seen.values())
