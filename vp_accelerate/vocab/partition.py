"""How the vocabulary rows are split over the ranks of the vocabulary group.

Token id t lives on rank t // shard_size at row t % shard_size: the padded id space is the real one
with padding appended at the end (Megatron's layout), so unsharding a weight is a concat plus a
truncation to `vocab_size` rows. Padded rows hold no token; the output layer never computes logits for
them, which is the same as giving them -inf logits (they never receive probability mass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabPartition:
    """Even split of `vocab_size` rows over `world_size` ranks, each shard padded to `pad_multiple`."""

    vocab_size: int
    """Number of real tokens V (rows of the embedding / lm_head)."""
    world_size: int
    """Number of ranks p sharing the vocabulary (the pipeline group)."""
    pad_multiple: int = 1
    """Round each shard's row count up to a multiple of this (e.g. 64 for tensor-core friendly shapes)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {self.pad_multiple}")
        if self.vocab_size < self.world_size:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) < world_size ({self.world_size}): every rank needs at "
                f"least one vocabulary row; use fewer ranks in the vocabulary group or a larger vocabulary"
            )

    @property
    def shard_size(self) -> int:
        """Rows per rank, padding included (the same on every rank)."""
        rows = -(-self.vocab_size // self.world_size)
        return -(-rows // self.pad_multiple) * self.pad_multiple

    @property
    def padded_size(self) -> int:
        """Rows of the full padded weight: shard_size * world_size >= vocab_size."""
        return self.shard_size * self.world_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Padded token ids [start, end) held by `rank`."""
        self._check_rank(rank)
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def valid_rows(self, rank: int) -> int:
        """Leading rows of `rank`'s shard that are real tokens; the rest is padding (may be 0 with padding)."""
        start, end = self.shard_range(rank)
        return max(0, min(end, self.vocab_size) - start)


def shard_tensor(full: torch.Tensor, partition: VocabPartition, rank: int) -> torch.Tensor:
    """Rank `rank`'s `[shard_size, ...]` slice of a `[vocab_size (or padded_size), ...]` tensor, a copy.

    Padded rows are zero, so a sharded weight can be unsharded with `torch.cat(shards)[:vocab_size]`.
    """
    if full.shape[0] not in (partition.vocab_size, partition.padded_size):
        raise ValueError(
            f"expected {partition.vocab_size} (or padded {partition.padded_size}) rows, "
            f"got a tensor of shape {tuple(full.shape)}"
        )
    start, _ = partition.shard_range(rank)
    n = partition.valid_rows(rank)
    out = full.new_zeros((partition.shard_size, *full.shape[1:]))
    out[:n] = full[start : start + n]
    return out
