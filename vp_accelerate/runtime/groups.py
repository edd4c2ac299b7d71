"""Process groups for PP x TP x DP: which ranks form a pipeline, a tensor-parallel group, a vocabulary
group, a data-parallel group.

Rank layout: global rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank. A stage's tensor-parallel
ranks are tp consecutive ranks (inside one node: TP's collectives run in every layer), each pipeline replica
is a contiguous block of pp * tp ranks (neighbouring stages share NVLink when they fit a node). With
tp_size 1 this is today's dp_rank * pp_size + pp_rank. Groups:
- the pipeline group of a (dp, tp) coordinate: the p2p between stages, each TP rank to its counterpart;
- the tensor-parallel group of a (dp, pp) coordinate: the collectives inside a stage's layers;
- the vocabulary group of a replica: its pp * tp ranks, ordered by vocabulary rank pp_rank * tp + tp_rank
  (the vocabulary is sharded over all of them, as the VP paper's Megatron code does);
- the data-parallel group of a (pp, tp) coordinate: the gradient sums and ZeRO's broadcasts.
Every rank must create every group in the same order (torch.distributed.new_group is collective), which
`build_groups` does.

Device groups and host groups: the pipeline, vocabulary and data-parallel groups use the default
backend (NCCL on GPUs), which only takes tensors on the rank's device. Host-side bookkeeping (object
gathers for logs and export, flags, timings) goes over gloo side groups created next to them
(`host_group`, `pp_host_group`), so it never stages host data through the GPU. The rule every caller
follows: a tensor on a device group lives on the rank's device; a host group gets CPU tensors and
Python objects.

Communicators up front (`warm_up`): NCCL connects a group's communicator at the group's first operation
unless the world was created with `device_id` (`distributed.init_kwargs`), and creating one while
another communicator's kernels run on the device can deadlock (the creation waits for the device, the
running kernel for a peer that is itself blocked in the creation). `warm_up` runs one tiny operation on
every device group of the rank, in one fixed order on every rank, with the device synchronised after
each, before step 1; `schedule.streams` models the lazy creation and shows why it is needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_HOST_GROUP = None  # the world's gloo side group, shared by every Groups of this process
HOST_BACKEND = "gloo"
"""Backend of the host side groups; the dry run (runtime/dryrun) sets "fake", whose world has no gloo."""


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
    """Position in this replica's pipeline."""
    dp_rank: int
    """Which replica this rank belongs to."""
    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline (its tensor-parallel coordinate in its replica), indexed by pp_rank
    (torch p2p and src/dst take global ranks)."""
    pp_group: object
    """Point-to-point traffic between stages of this pipeline (one per replica and TP coordinate)."""
    vocab_group: object
    """Vocabulary collectives (C0, C1, C2, IF reduce, IB broadcast) of this replica: its pp * tp ranks, group
    rank = `vocab_rank`. A group of its own, so collectives never interleave with point-to-point traffic on one
    communicator."""
    dp_group: object
    """Gradient all-reduce between the replicas of this pipeline rank (None when dp_size == 1)."""
    host_group: object = None
    """gloo group of every rank: host-side bookkeeping (object gathers, flags) of the whole world."""
    pp_host_group: object = None
    """gloo group of this replica's pipeline ranks (group rank = pp_rank): host-side bookkeeping of one
    pipeline, e.g. gathering the model for export without staging it through GPU memory."""
    dp_host_group: object = None
    """gloo group of this pipeline rank's replicas (None when dp_size == 1): host-side sums over the
    replicas, such as the step's valid-token count."""

    tp_size: int = 1
    """Tensor-parallel ranks per stage (the stage's decoder layers are split over them)."""
    tp_rank: int = 0
    """Position in this stage's tensor-parallel group."""
    tp_group: object = None
    """The tensor-parallel collectives inside a stage's layers (None when tp_size == 1)."""
    replica_host_group: object = None
    """gloo group of this replica's pp * tp ranks in vocabulary-rank order (group rank = `vocab_rank`): host-side
    gathers of the whole replica (the model for export under tensor parallelism); the pp_host_group when
    tp_size == 1."""

    def global_rank(self, pp_rank: int) -> int:
        return self.pp_ranks[pp_rank]

    @property
    def vocab_rank(self) -> int:
        """This rank's vocabulary shard index and its rank in `vocab_group`: pp_rank * tp_size + tp_rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def vocab_size_ranks(self) -> int:
        """Ranks the vocabulary is sharded over: pp_size * tp_size."""
        return self.pp_size * self.tp_size

    def vocab_root(self, pp_rank: int) -> int:
        """The rank in `vocab_group` that speaks for stage `pp_rank` (its TP rank 0): the root of the
        vocabulary collectives that start or end at that stage (every TP rank of a stage holds the same
        activations)."""
        return pp_rank * self.tp_size


def grid_rank(dp_rank: int, pp_rank: int, tp_rank: int, pp_size: int, tp_size: int) -> int:
    """Global rank of a (dp, pp, tp) coordinate: (dp_rank * pp_size + pp_rank) * tp_size + tp_rank."""
    return (dp_rank * pp_size + pp_rank) * tp_size + tp_rank


def build_groups(pp_size: int | None = None, dp_size: int = 1, tp_size: int = 1) -> Groups:
    """Create the groups for the current world (torch.distributed must be initialized)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp_size is None:
        if world % (dp_size * tp_size):
            raise ValueError(
                f"world size {world} is not divisible by dp_size={dp_size} x tp_size={tp_size}; "
                f"launch a multiple of {dp_size * tp_size} processes or change pipeline.dp_size / tp_size"
            )
        pp_size = world // (dp_size * tp_size)
    if pp_size * dp_size * tp_size != world:
        raise ValueError(
            f"pp_size={pp_size} x tp_size={tp_size} x dp_size={dp_size} = {pp_size * tp_size * dp_size} but "
            f"{world} processes were launched; make pp_size x tp_size x dp_size equal the number of processes"
        )
    tp_rank, pp_rank, dp_rank = rank % tp_size, (rank // tp_size) % pp_size, rank // (tp_size * pp_size)

    def at(d: int, s: int, t: int) -> int:
        return grid_rank(d, s, t, pp_size, tp_size)

    mine = {"host_group": connect_host_group()}
    for d in range(dp_size):
        for t in range(tp_size):
            ranks = [at(d, s, t) for s in range(pp_size)]
            pp_group = dist.new_group(ranks)
            pp_host_group = dist.new_group(ranks, backend=HOST_BACKEND)
            if (d, t) == (dp_rank, tp_rank):
                mine.update(pp_ranks=tuple(ranks), pp_group=pp_group, pp_host_group=pp_host_group)
        # the replica's pp * tp ranks, in vocabulary-rank order (pp_rank * tp + tp_rank = their global order)
        replica = [at(d, s, t) for s in range(pp_size) for t in range(tp_size)]
        vocab_group = dist.new_group(replica)
        replica_host = dist.new_group(replica, backend=HOST_BACKEND) if tp_size > 1 else None
        if d == dp_rank:
            mine["vocab_group"] = vocab_group
            mine["replica_host_group"] = replica_host if tp_size > 1 else mine["pp_host_group"]
    tp_group = None
    if tp_size > 1:
        for d in range(dp_size):
            for s in range(pp_size):
                group = dist.new_group([at(d, s, t) for t in range(tp_size)])
                if (d, s) == (dp_rank, pp_rank):
                    tp_group = group
    dp_group = dp_host_group = None
    for s in range(pp_size):
        for t in range(tp_size):
            ranks = [at(d, s, t) for d in range(dp_size)]
            group = dist.new_group(ranks) if dp_size > 1 else None
            host = dist.new_group(ranks, backend=HOST_BACKEND) if dp_size > 1 else None
            if (s, t) == (pp_rank, tp_rank):
                dp_group, dp_host_group = group, host
    return Groups(
        rank=rank,
        world_size=world,
        pp_size=pp_size,
        dp_size=dp_size,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        dp_group=dp_group,
        dp_host_group=dp_host_group,
        tp_size=tp_size,
        tp_rank=tp_rank,
        tp_group=tp_group,
        **mine,
    )


def connect_host_group():
    """The world's gloo side group (`host_group`), created and checked with one tiny sum, so a host network
    that does not connect (two nodes, the wrong interface) fails here with the interface named, not in the
    middle of the first step."""
    try:
        group = host_group()
        if group is not None:
            dist.all_reduce(torch.ones(1), group=group)
        return group
    except RuntimeError as e:
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        where = f"GLOO_SOCKET_IFNAME={ifname}" if ifname else "GLOO_SOCKET_IFNAME unset (gloo picked an interface)"
        raise RuntimeError(
            f"the gloo host group does not connect ({where}): set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) "
            f"to an interface every node reaches the others on (`ip -br addr`); gloo said: {e}"
        ) from e


WARM_UP_LARGE_BYTES = 32 * 2**20
"""Bytes of the warm-up's large all-reduce on each communicator (above NCCL's small-message protocols,
the size of a gradient bucket)."""


def warm_up(g: Groups, device: torch.device, tied_group=None) -> None:
    """Connect every communicator this rank will use before the first step, in one fixed order on every
    rank: on the pipeline, vocabulary, data-parallel and tied groups (each rank on the ones it belongs to)
    a one-element all-reduce, a broadcast from the group's first rank and one all-reduce of
    `WARM_UP_LARGE_BYTES` (a large message takes NCCL's other protocols and buffers, which a one-element
    one never touches), then one p2p round with both pipeline neighbours (send to and receive
    from rank +-1 around the ring, which covers every stage edge of every layout, as
    torch.distributed.pipelining's `_init_p2p_neighbors`), synchronising the device after each, so no
    communicator is created while another one's operation is in flight."""
    from vp_accelerate.runtime import p2p  # p2p imports vocab.comm; groups stays importable without it

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for group in (g.pp_group, g.vocab_group, g.tp_group, g.dp_group, tied_group):
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
            sync()
            dist.broadcast(torch.zeros(1, device=device), group_src=0, group=group)
            sync()
            # gloo has no protocols to warm: 1 MiB there keeps every CPU launch (and test) cheap
            large = WARM_UP_LARGE_BYTES if device.type == "cuda" else 2**20
            dist.all_reduce(torch.zeros(large // 4, device=device), group=group)
            sync()
    if g.pp_size > 1:
        nxt, prv = g.global_rank((g.pp_rank + 1) % g.pp_size), g.global_rank((g.pp_rank - 1) % g.pp_size)
        ops = [
            dist.P2POp(dist.isend, torch.zeros(1, device=device), nxt, g.pp_group),
            dist.P2POp(dist.isend, torch.zeros(1, device=device), prv, g.pp_group),
            dist.P2POp(dist.irecv, torch.empty(1, device=device), prv, g.pp_group),
            dist.P2POp(dist.irecv, torch.empty(1, device=device), nxt, g.pp_group),
        ]
        p2p.post(ops, "warm-up: one p2p round with both pipeline neighbours").wait()
        sync()


def host_group():
    """The world's gloo side group (created on first use: every rank must call this at the same point the
    first time, which `build_groups` does); None when torch.distributed is not initialized."""
    global _HOST_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _HOST_GROUP is None or _HOST_GROUP_WORLD is not dist.group.WORLD:
        _set_host_group(dist.new_group(backend=HOST_BACKEND))
    return _HOST_GROUP


_HOST_GROUP_WORLD = None  # which default group the side group belongs to (tests re-initialize the world)


def _set_host_group(group) -> None:
    global _HOST_GROUP, _HOST_GROUP_WORLD
    _HOST_GROUP, _HOST_GROUP_WORLD = group, dist.group.WORLD
