"""Where the ranks of a pp x dp layout sit on nodes, and what each group's links cost.

The runtime numbers ranks as global rank = dp_rank x pp + pp_rank (runtime/groups.py): each pipeline
replica is a block of pp consecutive ranks, and a launcher fills node after node with consecutive
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

    def pipeline_crosses(self, pp: int, dp: int) -> bool:
        """Some pipeline replica's pp ranks sit on more than one node."""
        return any(self.spans_nodes(range(d * pp, (d + 1) * pp)) for d in range(dp))

    def dp_crosses(self, pp: int, dp: int) -> bool:
        """Some data-parallel group (one pipeline rank of every replica) sits on more than one node."""
        return dp > 1 and any(self.spans_nodes(range(s, pp * dp, pp)) for s in range(pp))

    def pipeline_hardware(self, hw: Hardware, pp: int, dp: int) -> Hardware:
        """`hw` with the pipeline's point-to-point and collective bandwidth at the inter-node rate when the
        pipeline crosses nodes (and the slower of the two)."""
        if not self.pipeline_crosses(pp, dp):
            return hw
        return replace(
            hw,
            p2p_bandwidth=min(hw.p2p_bandwidth, self.internode_bandwidth),
            collective_bandwidth=min(hw.collective_bandwidth, self.internode_bandwidth),
        )

    def dp_bandwidth(self, hw: Hardware, pp: int, dp: int) -> float:
        """Bus bytes/s of the data-parallel gradient collectives."""
        if self.dp_crosses(pp, dp):
            return min(hw.collective_bandwidth, self.internode_bandwidth)
        return hw.collective_bandwidth
