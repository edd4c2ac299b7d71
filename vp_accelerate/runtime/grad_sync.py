"""Gradient synchronisation after the backward: tied and data-parallel sums, and global-norm clipping.

Data-parallel gradients are all-reduced in flat buckets: a few large collectives instead of one per tensor.

One all-reduce per parameter pays the collective's fixed cost (a launch, a ring's latency) hundreds of
times per step and never fills the links. The gradients are instead packed, in order, into flat
buffers of one dtype and device of at most `BUCKET_BYTES` (DDP's default bucket size, 25 MiB), each
all-reduced once; a tensor larger than a bucket is reduced in place on its own. The sum of every
element is the same sum as with one call per tensor, so the result does not change. At most
`IN_FLIGHT` buckets are on the wire at a time: the next bucket is packed while the previous reduce
runs, and the extra memory stays at a few buckets rather than a second copy of every gradient.

Overlap (`DPReducer`): a decoder chunk's gradients are final after the rank's last B or W pass of that
chunk (`final_after`), so its buckets are issued right then, while the rest of the pipeline's backward
passes still run; the vocabulary / embedding / head gradients (written by T, IB and the tied sum) follow
after the step. Buckets complete lazily: a pass never waits for a reduce it (or an earlier pass) issued;
each later pass only retires the buckets whose reduce has already completed (`work.is_completed()`, no
wait), and `finish` waits for the rest at the step's end. Each bucket's flat buffer stays alive until it
is retired, so the extra memory is at most the decoder gradients' size (one flat copy), traded for a reduce
that runs while the remaining backward passes compute. With `reduce_dtype=torch.bfloat16` each bucket travels in bf16 (half the bytes; the sum is
rounded to bf16, then added back into the fp32 gradients).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from vp_accelerate.runtime import p2p

BUCKET_BYTES = 25 * 2**20
"""Largest flat buffer packed for one all-reduce."""
IN_FLIGHT = 2
"""Buckets reduced at the same time."""


def unflatten_into(flat: torch.Tensor, members: list[torch.Tensor]) -> None:
    """Copy a flat bucket back into the tensors it was made of, in order (the inverse of their torch.cat)."""
    offset = 0
    for t in members:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def plan_buckets(tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `tensors` in buckets, in order: each bucket holds tensors of one dtype and device
    whose bytes add up to at most `bucket_bytes`; a tensor larger than that is a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[list[int], int]] = {}  # (dtype, device) -> (indices, bytes) being filled
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        key = (t.dtype, t.device)
        if nbytes >= bucket_bytes:
            buckets.append([i])
            continue
        idx, used = open_bucket.get(key, (None, 0))
        if idx is None or used + nbytes > bucket_bytes:
            idx, used = [], 0
            buckets.append(idx)
        idx.append(i)
        open_bucket[key] = (idx, used + nbytes)
    return buckets


def in_place(members: list[torch.Tensor]) -> bool:
    """A bucket of one contiguous tensor travels as it is (no flat copy)."""
    return len(members) == 1 and members[0].is_contiguous()


def pack(members: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A bucket's flat copy (cast to `dtype`), or None when its one contiguous tensor travels in place."""
    cast = dtype is not None and dtype != members[0].dtype
    if in_place(members) and not cast:
        return None  # no copy
    flat = torch.cat([t.reshape(-1) for t in members])
    return flat.to(dtype) if cast else flat


def in_buckets(tensors: list[torch.Tensor], start, finish, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Run an asynchronous collective over `tensors` in flat buckets (`plan_buckets`), at most `IN_FLIGHT` at a
    time: `start(members)` issues one bucket's and returns (work, its flat buffer or None); `finish(k, n, work,
    flat, members)` waits for bucket k of n (1-based, in issue order) and unpacks it. Returns the calls made."""
    buckets = plan_buckets(tensors, bucket_bytes)
    pending: list[tuple] = []
    for k, idx in enumerate(buckets, 1):
        members = [tensors[i] for i in idx]
        pending.append((k, len(buckets), *start(members), members))
        if len(pending) >= IN_FLIGHT:
            finish(*pending.pop(0))
    for item in pending:
        finish(*item)
    return len(buckets)


@torch.no_grad()
def all_reduce_buckets(tensors: list[torch.Tensor], group, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Sum every tensor over `group`, in place, in flat buckets (`plan_buckets`). Returns the number of
    all-reduce calls made."""

    def start(members):
        flat = pack(members)
        target = members[0] if flat is None else flat
        return p2p.collective(dist.all_reduce, target, group, "data-parallel bucket all-reduce", async_op=True), flat

    def finish(k, n, work, flat, members) -> None:
        p2p.wait_labelled(work, f"DP bucket {k}/{n}", members[0].device)
        if flat is not None:
            unflatten_into(flat, members)

    return in_buckets(tensors, start, finish, bucket_bytes)


class DPReducer:
    """One step's data-parallel gradient all-reduce, issued bucket by bucket as parameters' gradients
    become final (`after_pass`), finished by `finish`. Every replica runs the same action list, so every
    replica issues the same buckets in the same order."""

    def __init__(
        self,
        group,
        final_after: dict[tuple, list[torch.nn.Parameter]] | None = None,
        reduce_dtype: torch.dtype | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        self.group = group
        self.final_after = final_after or {}
        """(op, mb, chunk) of an action -> the parameters whose gradients are final once it ran."""
        self.reduce_dtype = reduce_dtype
        """dtype the buckets travel in (None: the gradients' own)."""
        self.bucket_bytes = bucket_bytes
        self.done: set[int] = set()  # ids of parameters already issued
        self.pending: list[tuple] = []  # (work, flat, members) in issue order
        self.calls = 0
        """All-reduce calls issued (for tests)."""
        self.waits = 0
        """Buckets still in flight when `finish` waited for them (the rest were retired by `poll`)."""
        self.completed = 0
        """Buckets retired so far, in issue order."""

    def after_pass(self, a) -> None:
        """The executor's hook after each compute pass: retire the buckets already reduced (no wait),
        then issue the buckets that pass made final."""
        self.poll()
        params = self.final_after.get((a.op, a.mb, a.chunk))
        if params:
            self.reduce(params)

    def poll(self) -> None:
        """Retire, in issue order, the buckets whose reduce has completed; never waits."""
        while self.pending and self.pending[0][0].is_completed():
            self._complete(*self.pending.pop(0))

    @torch.no_grad()
    def reduce(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Issue the all-reduce of these parameters' gradients (zeros where none), in flat buckets; they
        complete later (`poll`, `finish`), so issuing never waits for an earlier bucket."""
        grads = []
        for p in params:
            if id(p) in self.done:
                continue
            self.done.add(id(p))
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        for idx in plan_buckets(grads, self.bucket_bytes):
            members = [grads[i] for i in idx]
            flat = pack(members, self.reduce_dtype)
            target = members[0] if flat is None else flat
            # the flat buffer lives in `pending` until the bucket is retired
            work = p2p.collective(dist.all_reduce, target, self.group, "data-parallel bucket all-reduce", async_op=True)
            self.pending.append((work, flat, members))
            self.calls += 1

    def finish(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Issue the remaining parameters (those not made final by a pass) and complete every bucket:
        the step's only waits for the reduce."""
        self.reduce(params)
        while self.pending:
            self.waits += 1
            self._complete(*self.pending.pop(0))

    def _complete(self, work, flat, members) -> None:
        # NCCL: the current stream waits for the reduce (no host sync); gloo: the host waits. Labelled as the
        # bucket's place among all the step's (the watchdog names a bucket that never completes)
        self.completed += 1
        p2p.wait_labelled(work, f"DP bucket {self.completed}/{self.calls}", members[0].device)
        if flat is not None:
            unflatten_into(flat, members)


def final_after(actions, chunks: dict[int, torch.nn.Module]) -> dict[tuple, list[torch.nn.Parameter]]:
    """(op, mb, chunk) of the rank's last B or W pass of each of its decoder chunks -> that chunk's trainable
    parameters: no later pass of the step writes their gradients."""
    from vp_accelerate.schedule.ir import Op  # runtime reads schedule; kept local to this helper

    last: dict[int, tuple] = {}
    for a in actions:
        if a.op in (Op.B, Op.W) and a.chunk in chunks:
            last[a.chunk] = (a.op, a.mb, a.chunk)
    return {key: [p for p in chunks[c].parameters() if p.requires_grad] for c, key in last.items()}


def sync_grads(
    tied_param, tied_group, trainable: list[torch.Tensor], dp_group, reducer: DPReducer | None = None
) -> None:
    """After the step's backward: the tied baseline matrix held by two ranks adds their gradients (over
    `tied_group`), then data-parallel replicas add theirs in flat buckets. Frozen parameters (LoRA) have
    no gradient and no optimizer state, so only `trainable` ones are reduced. With `reducer` (the step's
    `DPReducer`, which issued the decoder chunks' buckets during the backward) the rest is issued there."""
    if tied_param is not None and tied_param.requires_grad:  # a frozen (LoRA) vocabulary has no gradient to add
        if tied_param.grad is None:
            tied_param.grad = torch.zeros_like(tied_param)
        p2p.collective(dist.all_reduce, tied_param.grad, tied_group, "tied gradient sum")
    if reducer is not None:
        reducer.finish(trainable)
    elif dp_group is not None:
        grads = []
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        all_reduce_buckets(grads, dp_group)  # flat buckets of <= 25 MiB, not one call each


@torch.no_grad()
def clip_grad_norm(named_params, is_duplicate, max_norm: float, device: torch.device, pp_group) -> float:
    """Clip by the global L2 norm over the whole pipeline, each parameter counted once (`is_duplicate`
    names the second copy of a matrix a rank holds twice); returns the norm before clipping."""
    # summed on the device (one transfer at the end, not one per parameter); pp_group is NCCL on GPUs
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    params = []
    for name, p in named_params:
        params.append(p)
        if p.grad is not None and not is_duplicate(name):
            sq += p.grad.detach().double().pow(2).sum()
    p2p.collective(dist.all_reduce, sq, pp_group, "gradient norm sum")
    norm = math.sqrt(float(sq.item()))
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
