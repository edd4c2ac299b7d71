"""Which decoder layers form each pipeline chunk, and which rank holds each chunk.

A chunk is a contiguous range of decoder layers; chunks are numbered in model order, so chunk 0
starts the model (it receives the embedding output) and the last chunk ends it (its output, after
the final norm, is X for the output layer). The first and the last chunk may hold no decoder layer
(the balanced "redis" split empties the last stage when the output layer alone is a stage's worth):
chunk 0 then only applies the input pieces, the last chunk only the final norm. Every schedule in the project describes placement with
the same `chunk_rank` tuple (see `schedule.ir.Schedule.chunk_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class LayoutError(ValueError):
    """A layout that cannot exist (more chunks than layers, counts that do not add up, ...)."""


@dataclass(frozen=True)
class StageLayout:
    """Decoder-layer ranges per chunk (model order) and the rank holding each chunk."""

    chunk_layers: tuple[tuple[int, int], ...]
    """`chunk_layers[c] = (start, end)`: chunk c runs decoder layers start..end-1."""
    chunk_rank: tuple[int, ...]
    """`chunk_rank[c]`: the pipeline rank that holds and runs chunk c."""

    def __post_init__(self) -> None:
        if len(self.chunk_layers) != len(self.chunk_rank):
            raise LayoutError(f"{len(self.chunk_layers)} layer ranges but {len(self.chunk_rank)} chunk owners")
        if not self.chunk_layers:
            raise LayoutError("a layout needs at least one chunk")
        expect = 0
        for c, (start, end) in enumerate(self.chunk_layers):
            if start != expect:
                raise LayoutError(
                    f"chunk {c} starts at layer {start} but the previous chunk ended at {expect}: "
                    "chunks must cover the layers contiguously in model order"
                )
            if end < start or (end == start and 0 < c < len(self.chunk_layers) - 1):
                raise LayoutError(
                    f"chunk {c} has no layers ({start}..{end}); only the first and the last chunk may "
                    "hold none (they also run the vocabulary layers), every other chunk needs one"
                )
            expect = end
        if expect == 0:
            raise LayoutError("the chunks hold no decoder layer at all")
        ranks = set(self.chunk_rank)
        if min(ranks) < 0 or ranks != set(range(max(ranks) + 1)):
            raise LayoutError(f"chunk owners {self.chunk_rank} must use every rank 0..p-1 at least once")

    @property
    def num_layers(self) -> int:
        return self.chunk_layers[-1][1]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_layers)

    @property
    def num_ranks(self) -> int:
        return max(self.chunk_rank) + 1

    @property
    def first_rank(self) -> int:
        """Rank holding chunk 0 (receives the embedding output)."""
        return self.chunk_rank[0]

    @property
    def last_rank(self) -> int:
        """Rank holding the last chunk (produces X)."""
        return self.chunk_rank[-1]

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks `rank` holds, in model order."""
        return tuple(c for c, r in enumerate(self.chunk_rank) if r == rank)

    def layers_of(self, rank: int) -> tuple[int, ...]:
        """Every decoder layer index `rank` holds."""
        return tuple(i for c in self.chunks_of(rank) for i in range(*self.chunk_layers[c]))

    # ---- constructors -------------------------------------------------------------------------

    @staticmethod
    def one_per_rank(num_layers: int, num_ranks: int, layer_counts: Sequence[int] | None = None) -> "StageLayout":
        """1F1B placement: chunk i on rank i. `layer_counts` gives uneven splits (redis)."""
        return StageLayout.from_counts(_counts(num_layers, num_ranks, layer_counts), tuple(range(num_ranks)))

    @staticmethod
    def v_shape(num_layers: int, num_ranks: int, layer_counts: Sequence[int] | None = None) -> "StageLayout":
        """V-Half placement: 2p chunks, rank i holds chunks i and 2p-1-i (rank 0 holds first and last)."""
        p = num_ranks
        owners = tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))
        return StageLayout.from_counts(_counts(num_layers, 2 * p, layer_counts), owners)

    @staticmethod
    def interleaved(
        num_layers: int, num_ranks: int, chunks_per_rank: int, layer_counts: Sequence[int] | None = None
    ) -> "StageLayout":
        """Interleaved 1F1B: v*p chunks assigned round-robin, chunk c on rank c mod p."""
        if chunks_per_rank < 1:
            raise LayoutError(f"chunks_per_rank must be >= 1, got {chunks_per_rank}")
        n = num_ranks * chunks_per_rank
        return StageLayout.from_counts(_counts(num_layers, n, layer_counts), tuple(c % num_ranks for c in range(n)))

    @staticmethod
    def from_counts(layer_counts: Sequence[int], chunk_rank: Sequence[int]) -> "StageLayout":
        """Explicit layer count per chunk (model order) and owner per chunk."""
        if len(layer_counts) != len(chunk_rank):
            raise LayoutError(f"{len(layer_counts)} layer counts for {len(chunk_rank)} chunks")
        ends = (0, len(layer_counts) - 1)
        bad = [(c, n) for c, n in enumerate(layer_counts) if n < 0 or (n == 0 and c not in ends)]
        if bad:
            raise LayoutError(
                f"every chunk but the first and the last needs at least one decoder layer (the end "
                f"chunks may hold none: they also run the vocabulary layers); chunk(s) {bad} "
                "(chunk, count) do not"
            )
        ranges, start = [], 0
        for n in layer_counts:
            ranges.append((start, start + int(n)))
            start += int(n)
        return StageLayout(tuple(ranges), tuple(int(r) for r in chunk_rank))


def layer_span(start: int, end: int) -> str:
    """Decoder layers [start, end) as a person reads them: "layers 4-7" (inclusive), or "no layers" for a
    chunk the balanced split left empty (not "layers 4-3")."""
    return f"layers {start}-{end - 1}" if end > start else "no layers"


def split_counts(num_layers: int, num_chunks: int) -> list[int]:
    """Even split of layers over chunks; the first `num_layers % num_chunks` chunks get one more."""
    if num_chunks < 1:
        raise LayoutError(f"need at least one chunk, got {num_chunks} (is num_ranks >= 1?)")
    if num_chunks > num_layers:
        raise LayoutError(
            f"cannot split {num_layers} decoder layers into {num_chunks} chunks: "
            "each chunk needs at least one layer (use fewer ranks or chunks per rank)"
        )
    base, extra = divmod(num_layers, num_chunks)
    return [base + (1 if c < extra else 0) for c in range(num_chunks)]


def _counts(num_layers: int, num_chunks: int, layer_counts: Sequence[int] | None) -> list[int]:
    """Even split or a checked explicit split."""
    if layer_counts is None:
        return split_counts(num_layers, num_chunks)
    counts = [int(n) for n in layer_counts]
    if len(counts) != num_chunks:
        raise LayoutError(f"got {len(counts)} layer counts but this layout has {num_chunks} chunks")
    if sum(counts) != num_layers:
        raise LayoutError(f"layer counts {counts} sum to {sum(counts)}, but the model has {num_layers} decoder layers")
    return counts
