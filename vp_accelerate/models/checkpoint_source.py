"""A local HF checkpoint read as a (possibly different) model: config overrides, a resized or re-tokenized vocabulary.

`build_rank(CheckpointSource(...), ...)` reads, on each rank, only the tensors that rank holds (its
decoder layers, and of the embedding / lm_head the source rows its shard is made from), whatever the
config overrides or the vocabulary change: nothing loads the whole model first.

Rows that are the mean of all source rows need that mean. `share_vocab_means` computes it collectively
(each rank reads 1/world of the source rows, one all-reduce) and stores it here, so no rank reads the
whole matrix; without it each rank reads the matrix once, block by block, to average it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from . import meta
from .adapter import find_parts
from .row_map import RowMap
from .weights import SafetensorsSource


@dataclass
class CheckpointSource:
    """What to build from a local safetensors checkpoint directory."""

    path: str
    """The checkpoint directory (config.json + model.safetensors or a sharded index)."""
    config: object
    """The config to build: the checkpoint's with overrides applied and `vocab_size` = the new row count."""
    source_vocab: int
    """The checkpoint's own vocab_size (rows of its embedding / lm_head)."""
    row_map: RowMap | None = None
    """How each new vocabulary row is made from the checkpoint's rows; None = keep rows by id (resize)."""
    means: dict[str, torch.Tensor] = field(default_factory=dict)
    """fp32 means of the checkpoint's vocabulary matrices by HF name (see `share_vocab_means`)."""

    def __post_init__(self) -> None:
        if self.row_map is not None and (
            self.row_map.num_rows != self.config.vocab_size or self.row_map.source_rows != self.source_vocab
        ):
            raise ValueError(
                f"row map is {self.row_map.source_rows} -> {self.row_map.num_rows} rows, but the "
                f"checkpoint has {self.source_vocab} and the config {self.config.vocab_size}"
            )

    def rows_map(self) -> RowMap:
        return self.row_map or RowMap.identity(self.config.vocab_size, self.source_vocab)

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        overrides: dict | None = None,
        vocab_size: int | None = None,
        row_map: RowMap | None = None,
        trust_remote_code: bool = False,
    ) -> "CheckpointSource":
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        source_vocab = config.vocab_size
        for key, value in (overrides or {}).items():
            setattr(config, key, value)
        if vocab_size is not None:
            config.vocab_size = vocab_size
        return cls(str(path), config, source_vocab, row_map)


@torch.no_grad()
def share_vocab_means(source: CheckpointSource, rank: int, world_size: int, all_reduce=None) -> None:
    """Fill `source.means` collectively: rank r reads source rows [r*n/w, (r+1)*n/w), one sum all-reduce.

    `all_reduce(tensor)` sums in place over the `world_size` ranks (torch.distributed.all_reduce); every
    rank must call this. Does nothing when no new row is a mean row.
    """
    row_map = source.rows_map()
    if not row_map.needs_mean(0, row_map.num_rows):
        return
    parts = find_parts(meta.meta_model(source.config))  # looked up at call time: the dry run patches it
    names = [f"{parts.names.embed}.weight"] + ([] if parts.tied else [f"{parts.names.lm_head}.weight"])
    reader = SafetensorsSource(source.path)
    n = source.source_vocab
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    h = parts.embed.embedding_dim
    total = torch.zeros(len(names), h, dtype=torch.float64)
    for i, name in enumerate(names):
        for s in range(lo, hi, 4096):
            total[i] += reader.rows(name, s, min(s + 4096, hi)).to(torch.float64).sum(0)
    if all_reduce is not None:
        all_reduce(total)
    elif world_size != 1:
        raise ValueError("share_vocab_means over several ranks needs all_reduce")
    source.means = {name: (total[i] / n).to(torch.float32) for i, name in enumerate(names)}
