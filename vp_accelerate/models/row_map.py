"""How the rows of a resized or re-tokenized vocabulary matrix are made from the source's rows.

A `RowMap` says, for every row of the new embedding / lm_head, which rows of the source matrix it
comes from: one row (copied exactly), several rows (their mean: a new token composed of old pieces),
or none (the mean of all source rows). `rows(read, start, end)` builds rows [start, end) reading only
the source rows those need, in contiguous runs, so a rank holding a shard reads its shard's sources
and not the whole matrix (the overall mean is read once, or handed in precomputed).

The identity map with a different size is plain resizing: rows < the source's size are copied, the
rows past it are the mean (HF's mean resizing without its 1e-9-covariance noise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

#: Row kinds.
MEAN, COPY, COMPOSED = 0, 1, 2
KIND_NAMES = {COPY: "copied", COMPOSED: "composed", MEAN: "mean"}


@dataclass(frozen=True)
class RowMap:
    """Source rows of every new row, as a CSR list (row i's sources are idx[ptr[i]:ptr[i+1]])."""

    num_rows: int
    """Rows of the new matrix (the new vocab_size)."""
    source_rows: int
    """Rows of the source matrix (the checkpoint's vocab_size)."""
    ptr: np.ndarray
    """[num_rows + 1] offsets into `idx`."""
    idx: np.ndarray
    """Concatenated source row ids."""
    kind: np.ndarray
    """[num_rows] MEAN / COPY / COMPOSED per new row."""

    @classmethod
    def identity(cls, num_rows: int, source_rows: int) -> "RowMap":
        """Keep rows by id; rows past the source's are the mean (plain resizing)."""
        n = min(num_rows, source_rows)
        ptr = np.concatenate([np.arange(n + 1), np.full(num_rows - n, n)]).astype(np.int64)
        kind = np.concatenate([np.full(n, COPY), np.full(num_rows - n, MEAN)]).astype(np.int8)
        return cls(num_rows, source_rows, ptr, np.arange(n, dtype=np.int64), kind)

    @classmethod
    def from_lists(cls, sources: list[list[int]], source_rows: int, kinds: list[int]) -> "RowMap":
        """A map from per-row source lists and kinds (COPY rows have one source, MEAN rows none)."""
        lengths = np.fromiter((len(s) for s in sources), dtype=np.int64, count=len(sources))
        ptr = np.zeros(len(sources) + 1, dtype=np.int64)
        np.cumsum(lengths, out=ptr[1:])
        idx = np.fromiter((i for s in sources for i in s), dtype=np.int64, count=int(ptr[-1]))
        if len(idx) and (idx.min() < 0 or idx.max() >= source_rows):
            raise ValueError(f"source row ids must be in [0, {source_rows})")
        return cls(len(sources), source_rows, ptr, idx, np.asarray(kinds, dtype=np.int8))

    def counts(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        """{"copied", "composed", "mean"}: how many new rows in [start, end) are made each way."""
        kind = self.kind[start:end]
        return {name: int((kind == k).sum()) for k, name in KIND_NAMES.items()}

    def sources_of(self, start: int, end: int) -> np.ndarray:
        """Sorted unique source rows that new rows [start, end) need (without the overall mean)."""
        end = min(end, self.num_rows)
        if start >= end:
            return np.zeros(0, dtype=np.int64)
        return np.unique(self.idx[self.ptr[start] : self.ptr[end]])

    def needs_mean(self, start: int, end: int) -> bool:
        return bool((self.kind[start : min(end, self.num_rows)] == MEAN).any())

    @torch.no_grad()
    def rows(
        self,
        read: Callable[[int, int], torch.Tensor],
        start: int,
        end: int,
        hidden: int,
        dtype: torch.dtype,
        mean: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """New rows [start, end) (rows >= num_rows are zero padding) in `dtype`.

        `read(s, e)` returns source rows [s, e); `mean()` the fp32 mean of all source rows (called
        only when a row here needs it). Composed rows average in fp32 (fp64 when `dtype` is).
        """
        out = torch.zeros(end - start, hidden, dtype=dtype)
        hi = min(end, self.num_rows)
        if start >= hi:
            return out
        need = self.sources_of(start, hi)
        work = torch.promote_types(dtype, torch.float32)  # fp32 for bf16 training, fp64 stays fp64
        got = torch.empty(len(need), hidden, dtype=work)
        if len(need):
            # contiguous runs: one read per run (a kept-by-id shard is a single read)
            breaks = np.flatnonzero(np.diff(need) != 1) + 1
            for run in np.split(np.arange(len(need)), breaks):
                s, e = int(need[run[0]]), int(need[run[-1]]) + 1
                got[run[0] : run[-1] + 1] = read(s, e).to(work)
        kind, ptr, idx = self.kind[start:hi], self.ptr, self.idx
        copy_rows = np.flatnonzero(kind == COPY)
        if len(copy_rows):  # exact copies of the source's values (the work dtype holds them exactly)
            pos = np.searchsorted(need, idx[ptr[start + copy_rows]])
            out[torch.from_numpy(copy_rows)] = got[torch.from_numpy(pos)].to(dtype)
        for i in np.flatnonzero(kind == COMPOSED):
            pos = np.searchsorted(need, idx[ptr[start + i] : ptr[start + i + 1]])
            out[i] = got[torch.from_numpy(pos)].mean(0).to(dtype)
        mean_rows = np.flatnonzero(kind == MEAN)
        if len(mean_rows):
            out[torch.from_numpy(mean_rows)] = mean().to(dtype)
        return out
