"""Tokenized rows into fixed-length sequences: classic packing, padding, or whole documents with their
boundaries (position ids restart per document; `to_sequences` picks by the recipe and fills `SplitStats`)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from ..recipe.schema import DataSection
from .batches import Sequences
from .formats import document_boundaries, labels_from_mask
from .read import DataError
from .stats import SplitStats, what_rows

log = logging.getLogger("vp_accelerate.train")


def warn(message: str, *args) -> None:
    """A warning about the data, from the first process only (every rank prepares the same data)."""
    if os.environ.get("RANK", "0") == "0":
        log.warning(message, *args)


@contextlib.contextmanager
def quiet():
    """No data warnings inside (a trial packing whose result is thrown away)."""
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def pack(token_rows, seq_len: int) -> np.ndarray:
    """Concatenate token rows and cut [N, seq_len] sequences (the tail shorter than seq_len is dropped)."""
    flat = (
        np.concatenate([np.asarray(r, dtype=np.int64) for r in token_rows])
        if len(token_rows)
        else np.zeros(0, dtype=np.int64)
    )
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len)


def pad_rows(token_rows, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Truncate/pad each row to seq_len: (ids [N, S], mask [N, S]) — the unpacked mode."""
    ids = np.full((len(token_rows), seq_len), pad_id, dtype=np.int64)
    mask = np.zeros((len(token_rows), seq_len), dtype=np.int64)
    for i, row in enumerate(token_rows):
        row = row[:seq_len]
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def pack_documents(
    token_rows, loss_masks, seq_len: int, pad_id: int, split_long: bool, stats: dict | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Pack whole documents into rows of seq_len, keeping their boundaries.

    Returns (ids, labels, position_ids, dropped): documents are placed in order, a new row starts when the
    next one does not fit, and the rest of a row is padding (its own "document": labels -100, positions
    from 0, so it attends only to itself). Positions restart at 0 for every document and a document's
    first token gets label -100 (nothing before it in its document predicts it). A document longer than
    seq_len is cut into seq_len pieces (`split_long`, text) or truncated (SFT: a cut conversation's tail
    would lack its prompt); `dropped` counts documents whose loss tokens were all cut away.

    `stats` (a dict, filled when given): `truncated` (documents cut to seq_len), `dropped_need` (the seq_len
    that would keep every dropped document: its first target's position + 1), `min_need` (the smallest such
    length) and `lengths` (real tokens per packed row).
    """
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    dropped = truncated = need = 0
    min_need = None
    main = os.environ.get("RANK", "0") == "0"  # a bar on the first process, on a terminal only (disable=None)
    for k, row in enumerate(tqdm(token_rows, desc="packing", unit="doc", leave=False, disable=None if main else True)):
        row = np.asarray(row, dtype=np.int64)
        mask = np.ones(len(row), dtype=bool) if loss_masks is None else np.asarray(loss_masks[k], dtype=bool)
        full_mask = mask
        if len(row) > seq_len and not split_long:
            row, mask = row[:seq_len], mask[:seq_len]
            truncated += 1
        if loss_masks is not None and not mask[1:].any():
            dropped += 1
            targets = np.flatnonzero(full_mask[1:])
            if len(targets):
                first = int(targets[0]) + 2  # positions 0..first target
                need, min_need = max(need, first), first if min_need is None else min(min_need, first)
            continue
        for start in range(0, len(row), seq_len):
            if len(row[start : start + seq_len]):
                pieces.append((row[start : start + seq_len], mask[start : start + seq_len]))
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = seq_len
    for piece in pieces:
        if used + len(piece[0]) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += len(piece[0])
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), -100, dtype=np.int64)
    pos = np.zeros((len(rows), seq_len), dtype=np.int64)
    for i, row in enumerate(rows):
        at = 0
        for doc, mask in row:
            n = len(doc)
            ids[i, at : at + n] = doc
            labels[i, at : at + n] = np.where(mask, doc, -100)
            labels[i, at] = -100
            pos[i, at : at + n] = np.arange(n)
            at += n
        pos[i, at:] = np.arange(seq_len - at)
    if stats is not None:
        stats.update(
            truncated=truncated,
            dropped_need=need,
            min_need=min_need or 0,
            lengths=np.array([sum(len(doc) for doc, _ in row) for row in rows], dtype=np.int64),
        )
    return ids, labels, pos, dropped


def token_column(ds, column: str = "input_ids") -> list:
    """A column of token lists of a (non-streaming) dataset as a list of arrays, without Python lists per token."""
    col = ds.with_format("numpy")[column]
    return list(col)


@dataclass
class Encoded:
    """Tokenized rows of one split: ids and (SFT formats) loss masks, one array per document."""

    rows: list
    masks: list | None


def encoded(ds) -> Encoded:
    return Encoded(token_column(ds), token_column(ds, "loss_mask") if "loss_mask" in ds.column_names else None)


def to_sequences(
    enc: Encoded,
    cfg: DataSection,
    pad_id: int,
    source: str,
    fmt: str = "text",
    allow_empty: bool = False,
    stats: SplitStats | None = None,
) -> Sequences:
    rows, masks = enc.rows, enc.masks
    stats = stats if stats is not None else SplitStats(source)
    S = cfg.seq_len
    if cfg.packing and document_boundaries(cfg, fmt):
        info: dict = {}
        ids, labels, pos, dropped = pack_documents(rows, masks, S, pad_id, split_long=fmt == "text", stats=info)
        stats.truncated, stats.dropped, stats.dropped_need = info["truncated"], dropped, info["dropped_need"]
        lengths = info["lengths"]
        seqs = Sequences(ids, labels=labels, positions=pos, lengths=lengths, pad_id=pad_id)
        if dropped and dropped == len(rows):
            raise DataError(
                f"data.seq_len: all {dropped} {what_rows(fmt)} of {source} were dropped: the tokens that carry "
                f"loss lie past data.seq_len={S} in every one (keeping one needs data.seq_len >= "
                f"{info['min_need']}, the longest has {stats.longest or max(map(len, rows))} tokens); "
                f"raise data.seq_len"
            )
        if dropped:
            warn(
                "%s: %d of %d %s dropped: their loss tokens lie beyond data.seq_len=%d (keeping them all "
                "needs data.seq_len >= %d)",
                source,
                dropped,
                len(rows),
                what_rows(fmt),
                S,
                info["dropped_need"],
            )
        stats.cut_tokens = sum(max(0, len(r) - S) for r in rows) if fmt != "text" else 0
    elif cfg.packing:
        ids = pack(rows, S)
        labels = None if masks is None else labels_from_mask(ids, pack(masks, S))
        seqs = Sequences(ids, labels=labels, pad_id=pad_id)
        stats.cut_tokens = sum(len(r) for r in rows) - ids.size
    else:
        ids, mask = pad_rows(rows, S, pad_id)
        labels = None if masks is None else labels_from_mask(ids, pad_rows(masks, S, 0)[0])
        seqs = Sequences(ids, mask, labels=labels, lengths=mask.sum(axis=1), pad_id=pad_id)
        stats.truncated = sum(len(r) > S for r in rows)
        stats.cut_tokens = sum(max(0, len(r) - S) for r in rows)
    stats.sequences = len(seqs)
    stats.padding = 1.0 - seqs.real_tokens() / max(1, seqs.ids.size) if len(seqs) else 0.0
    stats.loss_tokens = int(seqs.target_counts().sum()) if len(seqs) else 0
    if len(seqs) == 0 and not allow_empty:
        total = sum(len(r) for r in rows)
        raise DataError(
            f"{source}: only {total} tokens, not one sequence of data.seq_len={S}; add data or lower data.seq_len"
        )
    return seqs
