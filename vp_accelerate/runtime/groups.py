"""Process groups for PP x DP: which ranks form a pipeline, a vocabulary group, a data-parallel group.

Rank layout: global rank = dp_rank * pp_size + pp_rank, so each pipeline replica is a contiguous
block of ranks (on a GPU node, neighbouring stages share NVLink). Every rank must create every group
in the same order (torch.distributed.new_group is collective), which `build_groups` does.

Device groups and host groups: the pipeline, vocabulary and data-parallel groups use the default
backend (NCCL on GPUs), which only takes tensors on the rank's device. Host-side bookkeeping (object
gathers for logs and export, flags, timings) goes over gloo side groups created next to them
(`host_group`, `pp_host_group`), so it never stages host data through the GPU. The rule every caller
follows: a tensor on a device group lives on the rank's device; a host group gets CPU tensors and
Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

_HOST_GROUP = None  # the world's gloo side group, shared by every Groups of this process


@dataclass(frozen=True)
class Groups:
    """This rank's place in the PP x DP grid and the process groups it talks over."""

    rank: int
    """Global rank."""
    world_size: int
    """All processes."""
    pp_size: int
    """Pipeline ranks per replica; the vocabulary is sharded over these."""
    dp_size: int
    """Data-parallel replicas of the whole pipeline."""
    pp_rank: int
    """Position in this replica's pipeline (also this rank's vocabulary shard index)."""
    dp_rank: int
    """Which replica this rank belongs to."""
    pp_ranks: tuple[int, ...]
    """Global ranks of this replica's pipeline, indexed by pp_rank (torch p2p and src/dst take global ranks)."""
    pp_group: object
    """Point-to-point traffic between stages of this replica."""
    vocab_group: object
    """Vocabulary collectives (C0, C1, C2, IF reduce, IB broadcast) of this replica. A group of its own,
    so collectives never interleave with point-to-point traffic on one communicator."""
    dp_group: object
    """Gradient all-reduce between the replicas of this pipeline rank (None when dp_size == 1)."""
    host_group: object = None
    """gloo group of every rank: host-side bookkeeping (object gathers, flags) of the whole world."""
    pp_host_group: object = None
    """gloo group of this replica's pipeline ranks (group rank = pp_rank): host-side bookkeeping of one
    pipeline, e.g. gathering the model for export without staging it through GPU memory."""

    def global_rank(self, pp_rank: int) -> int:
        return self.pp_ranks[pp_rank]


def build_groups(pp_size: int | None = None, dp_size: int = 1) -> Groups:
    """Create the groups for the current world (torch.distributed must be initialized)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp_size is None:
        if world % dp_size:
            raise ValueError(
                f"world size {world} is not divisible by dp_size={dp_size}; "
                f"launch a multiple of {dp_size} processes or change pipeline.dp_size"
            )
        pp_size = world // dp_size
    if pp_size * dp_size != world:
        raise ValueError(
            f"pp_size={pp_size} x dp_size={dp_size} = {pp_size * dp_size} but {world} processes "
            f"were launched; make pp_size x dp_size equal the number of processes"
        )
    pp_rank, dp_rank = rank % pp_size, rank // pp_size
    mine = {"host_group": host_group()}
    for d in range(dp_size):
        ranks = list(range(d * pp_size, (d + 1) * pp_size))
        pp_group = dist.new_group(ranks)
        vocab_group = dist.new_group(ranks)
        pp_host_group = dist.new_group(ranks, backend="gloo")
        if d == dp_rank:
            mine.update(pp_ranks=tuple(ranks), pp_group=pp_group, vocab_group=vocab_group, pp_host_group=pp_host_group)
    dp_group = None
    for s in range(pp_size):
        ranks = [d * pp_size + s for d in range(dp_size)]
        group = dist.new_group(ranks) if dp_size > 1 else None
        if s == pp_rank:
            dp_group = group
    return Groups(
        rank=rank,
        world_size=world,
        pp_size=pp_size,
        dp_size=dp_size,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        dp_group=dp_group,
        **mine,
    )


def host_group():
    """The world's gloo side group (created on first use: every rank must call this at the same point the
    first time, which `build_groups` does); None when torch.distributed is not initialized."""
    global _HOST_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _HOST_GROUP is None or _HOST_GROUP_WORLD is not dist.group.WORLD:
        _set_host_group(dist.new_group(backend="gloo"))
    return _HOST_GROUP


_HOST_GROUP_WORLD = None  # which default group the side group belongs to (tests re-initialize the world)


def _set_host_group(group) -> None:
    global _HOST_GROUP, _HOST_GROUP_WORLD
    _HOST_GROUP, _HOST_GROUP_WORLD = group, dist.group.WORLD
