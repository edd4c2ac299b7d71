"""What reading, tokenizing and packing one split found: `SplitStats` (`--check` reports it, the run logs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc

BAD_ROWS_LISTED = 20
"""How many invalid rows are kept as examples (`--check` lists them, then a count)."""


@dataclass
class SplitStats:
    """What reading, tokenizing and packing one split found (`--check` reports it, the run logs it)."""

    source: str
    """The recipe key and files, e.g. "data.files ['train.jsonl']"."""
    rows: int = 0
    """Rows read (records; blank lines are none)."""
    bad: int = 0
    """Rows that do not fit the format (skipped with data.skip_invalid, else an error)."""
    bad_examples: list = field(default_factory=list)
    """The first BAD_ROWS_LISTED of them, "FILE, line N: why"."""
    documents: int = 0
    """Valid rows of this split (after the held-out ones went to evaluation)."""
    tokens: int = 0
    """Tokens of those rows (with EOS / template markers)."""
    longest: int = 0
    """Tokens of the longest row."""
    truncated: int = 0
    """Rows longer than data.seq_len, cut to it (document boundaries and unpacked rows)."""
    dropped: int = 0
    """Rows dropped because every token that carries loss lies past data.seq_len."""
    dropped_need: int = 0
    """The data.seq_len that would keep every dropped row."""
    sequences: int = 0
    """Packed sequences of data.seq_len tokens."""
    padding: float = 0.0
    """Fraction of the sequences' tokens that are padding."""
    loss_tokens: int = 0
    """Tokens of the sequences that are a target of the loss."""
    cut_tokens: int = 0
    """Tokens lost: the incomplete last sequence (classic packing) or the cut tails of truncated rows."""
    dropped_keys: dict = field(default_factory=dict)
    """Message keys the chat template does not read -> rows that had them (dropped from those rows)."""
    empty_turns: int = 0
    """Chat rows with an assistant turn whose content is empty (trained to answer nothing: warned, not refused)."""
    empty_turn_examples: list = field(default_factory=list)
    """The first BAD_ROWS_LISTED of them, "FILE, line N"."""
    same: int = 0
    """Preference pairs whose chosen equals rejected (warned: no preference, so no gradient)."""
    same_examples: list = field(default_factory=list)
    """The first BAD_ROWS_LISTED of them, "FILE, line N"."""


def arrow_column(ds, column: str):
    """A column as arrow (the dataset's view: its select()ed rows, not the whole table under it)."""
    return ds.with_format("arrow")[column]


def _lengths(ds) -> np.ndarray:
    return np.asarray(
        pc.list_value_length(arrow_column(ds, "input_ids")).to_numpy(zero_copy_only=False), dtype=np.int64
    )


def count_split(stats: SplitStats, ds) -> None:
    lengths = _lengths(ds) if len(ds) else np.zeros(0, dtype=np.int64)
    stats.documents, stats.tokens = len(ds), int(lengths.sum())
    stats.longest = int(lengths.max()) if len(lengths) else 0


def what_rows(fmt: str) -> str:
    return {"chat": "conversations", "prompt_completion": "prompt/completion rows"}.get(fmt, "documents")
