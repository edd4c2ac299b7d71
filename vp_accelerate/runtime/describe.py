"""What each rank holds, as data: `PipelineModel.describe()` returns a `RankLayout`.

Its `str()` is the one line a person reads (`rank 0 (pp 0/2, dp 0/1): chunk 0: layers 0-1; vocab rows
0-2047 of 4096 (embedding + lm_head); 1.2 MiB of parameters`); programs read the fields instead
(the trainer's checkpoint fingerprint uses `placement()`). `PipelineLayout` holds every rank's
`RankLayout`, gathered by the caller (describe() itself is not a collective).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def layer_span(start: int, end: int) -> str:
    """Decoder layers [start, end) as a person reads them: "layers 4-7" (inclusive), or "no layers" for a
    chunk the balanced split left empty. (models.layout has the same for RankModules' repr; this module
    imports nothing heavy: the recipe check reads it before torch loads.)"""
    return f"layers {start}-{end - 1}" if end > start else "no layers"


@dataclass(frozen=True)
class ChunkLayers:
    """One model chunk on a rank and its decoder layers."""

    chunk: int
    """Chunk index in model order (0 holds the first decoder layers)."""

    start: int
    """First decoder layer of the chunk."""

    end: int
    """One past its last decoder layer."""


@dataclass(frozen=True)
class RankLayout:
    """Which chunks, decoder layers and vocabulary layers one rank holds, and their parameter size."""

    rank: int
    """Global rank."""

    pp_rank: int
    """Position in the pipeline."""

    pp_size: int
    """Pipeline ranks."""

    dp_rank: int
    """Data-parallel replica."""

    dp_size: int
    """Data-parallel replicas."""

    chunks: tuple[ChunkLayers, ...]
    """This rank's model chunks in the order it holds them."""

    vocab_size: int
    """Rows of the model's vocabulary (without shard padding)."""

    vocab_rows: tuple[int, int] | None
    """Vocabulary parallelism: the [start, end) rows of the vocabulary this rank's embedding and output
    shards hold (padding rows excluded); None when the vocabulary layers are not sharded."""

    tied: bool
    """The output layer uses the embedding matrix (one matrix, or one shard of it, for both)."""

    full_embedding: bool
    """Without vocabulary parallelism: this rank holds the whole input embedding (the first stage)."""

    full_head: bool
    """Without vocabulary parallelism: this rank holds the final norm, the whole output layer and the loss."""

    param_count: int
    """Parameter elements on this rank (tied or duplicated parameters counted once per holder)."""

    param_bytes: int
    """Bytes of those parameters at their dtype."""

    tp_rank: int = 0
    """Position in the stage's tensor-parallel group (0 without tensor parallelism)."""

    tp_size: int = 1
    """Tensor-parallel ranks of the stage: its decoder layers hold 1/tp_size slices of the split linears."""

    def _vocab_text(self) -> str:
        if self.vocab_rows is not None:
            start, end = self.vocab_rows
            return (
                f"vocab rows {start}-{end - 1} of {self.vocab_size}"
                f" (embedding{' + tied' if self.tied else ' + lm_head'})"
            )
        split = f" (1/{self.tp_size} of its rows)" if self.tp_size > 1 else ""  # the TP-split end layers
        parts = ([f"full embedding{split}"] if self.full_embedding else []) + (
            [f"norm + full lm_head{split} + loss"] if self.full_head else []
        )
        return ", ".join(parts) or "no vocabulary layers"

    def text(self, params: bool = True) -> str:
        """The line a person reads; `params=False` leaves out the size (it depends on the dtype)."""
        chunks = ", ".join(f"chunk {c.chunk}: {layer_span(c.start, c.end)}" for c in self.chunks)
        tp = f", tp {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        line = (
            f"rank {self.rank} (pp {self.pp_rank}/{self.pp_size}{tp}, dp {self.dp_rank}/{self.dp_size}): "
            f"{chunks}{' (1/' + str(self.tp_size) + ' of each split layer)' if self.tp_size > 1 else ''}; "
            f"{self._vocab_text()}"
        )
        return f"{line}; {self.param_bytes / 2**20:.1f} MiB of parameters" if params else line

    def __str__(self) -> str:
        return self.text()

    def placement(self) -> dict:
        """Where things are, without sizes: what a checkpoint of this rank must have been saved with."""
        out = asdict(self)
        del out["param_count"], out["param_bytes"]
        if self.tp_size == 1:  # as before tensor parallelism: older checkpoints' fingerprints still compare
            del out["tp_rank"], out["tp_size"]
        # lists, not tuples: a fingerprint read back from JSON must compare equal
        out["chunks"] = [asdict(c) for c in self.chunks]
        out["vocab_rows"] = list(self.vocab_rows) if self.vocab_rows is not None else None
        return out


@dataclass(frozen=True)
class PipelineLayout:
    """Every rank's `RankLayout`, in rank order (gather `describe()` from each rank to build it)."""

    ranks: tuple[RankLayout, ...]
    """One entry per global rank."""

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.ranks)

    def placement(self) -> list[dict]:
        """Every rank's `RankLayout.placement()`: the layout part of a checkpoint fingerprint."""
        return [r.placement() for r in self.ranks]

    @property
    def param_count(self) -> int:
        """Parameter elements over all ranks (duplicates such as a tied matrix on two stages count twice)."""
        return sum(r.param_count for r in self.ranks)
