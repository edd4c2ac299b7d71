"""Where the ranks of a pp x dp layout sit on nodes, and what each group's links cost.

The runtime numbers ranks as global rank = (dp_rank x pp + pp_rank) x tp + tp_rank (runtime/groups.py): a
stage's TP ranks are tp consecutive ranks (inside a node when tp divides it), each pipeline replica is a block
of pp x tp consecutive ranks, and a launcher fills node after node with consecutive
ranks. So with pp dividing the GPUs per node every pipeline lives inside one node (its point-to-point
transfers and vocabulary collectives on NVLink) and the data-parallel groups cross nodes; with pp
larger than a node the pipeline itself crosses.

A group whose ranks span nodes is priced at the inter-node bandwidth per GPU (one NIC per GPU, as on
DGX / HGX H100: 400 Gb/s InfiniBand = 50 GB/s): a ring is as fast as its slowest hop, and a pipeline's
one transfer time (the replay has a single p2p time) is that of its slowest hop. Both are pessimistic
where only some hops cross: a pipeline of 2 nodes crosses between 2 of its stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vp_accelerate.cost import Hardware

INTERNODE_BANDWIDTH = 50e9
"""Default bytes/s per GPU between nodes: one 400 Gb/s InfiniBand NIC per GPU."""


@dataclass(frozen=True)
class Cluster:
    """GPUs grouped into nodes."""

    gpus: int
    """GPUs in all."""
    gpus_per_node: int | None = None
    """GPUs sharing one node's NVLink; None = all in one node (every link at the device's bandwidth)."""
    internode_bandwidth: float = INTERNODE_BANDWIDTH
    """Bytes/s per GPU between nodes."""

    def __post_init__(self) -> None:
        if self.gpus_per_node is not None and not 1 <= self.gpus_per_node:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def node(self, rank: int) -> int:
        return 0 if self.gpus_per_node is None else rank // self.gpus_per_node

    def spans_nodes(self, ranks) -> bool:
        return len({self.node(r) for r in ranks}) > 1

    def pipeline_crosses(self, pp: int, dp: int, tp: int = 1) -> bool:
        """Some pipeline replica's pp x tp ranks (a block of consecutive ranks) sit on more than one node."""
        return any(self.spans_nodes(range(d * pp * tp, (d + 1) * pp * tp)) for d in range(dp))

    def dp_crosses(self, pp: int, dp: int, tp: int = 1) -> bool:
        """Some data-parallel group (one (pipeline, TP) rank of every replica) sits on more than one node."""
        block = pp * tp
        return dp > 1 and any(self.spans_nodes(range(s, block * dp, block)) for s in range(block))

    def tp_fits(self, tp: int) -> bool:
        """A stage's tp consecutive ranks stay inside a node (tp divides the GPUs per node)."""
        return self.gpus_per_node is None or self.gpus_per_node % tp == 0

    def pipeline_hardware(self, hw: Hardware, pp: int, dp: int, tp: int = 1) -> Hardware:
        """`hw` with the pipeline's point-to-point and collective bandwidth at the inter-node rate when the
        pipeline crosses nodes (and the slower of the two)."""
        if not self.pipeline_crosses(pp, dp, tp):
            return hw
        return replace(
            hw,
            p2p_bandwidth=min(hw.p2p_bandwidth, self.internode_bandwidth),
            collective_bandwidth=min(hw.collective_bandwidth, self.internode_bandwidth),
        )

    def dp_bandwidth(self, hw: Hardware, pp: int, dp: int, tp: int = 1) -> float:
        """Bus bytes/s of the data-parallel gradient collectives."""
        if self.dp_crosses(pp, dp, tp):
            return min(hw.collective_bandwidth, self.internode_bandwidth)
        return hw.collective_bandwidth
