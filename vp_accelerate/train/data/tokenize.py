"""Rows into token ids: the `datasets.map` function that tokenizes a split, its cache key, and the rows'
problems (invalid rows, dropped message keys) counted into `SplitStats`.

Invalid rows are kept (empty) and flagged, so every one of them is found and named; `prepare.py` then stops on
them or skips them (data.skip_invalid). Blank lines of a JSON Lines file are no rows. Token ids >= the model's
vocabulary stop at once, naming the row (a tokenizer/model mismatch, not a bad row).

Held-out evaluation documents are chosen by a hash of their text (order independent, so the same documents are
held out streaming or not, whatever the file order).
"""

from __future__ import annotations

import hashlib
import inspect
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..recipe.schema import DataSection
from . import chat_rows, formats, long_text
from .identity import files_identity
from .read import RAW, WHERE, DataError, RowLocator
from .stats import BAD_ROWS_LISTED, SplitStats, arrow_column


def is_heldout(text: str, every: int) -> bool:
    """Deterministic, order-independent choice of held-out documents: 1 in `every` by text hash."""
    if every <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return h % every == 0


def json_record(line: str) -> tuple[dict | None, str]:
    """(record, reason): one line of a JSON Lines file parsed, or why it is not a record."""
    try:
        record = json.loads(line.lstrip("\ufeff"))  # a UTF-8 byte-order mark opens some editors' files: read it
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    except RecursionError:  # json's parser recurses per level: 100k nested brackets exhaust the stack
        return None, "not valid JSON (nested deeper than the parser's limit)"
    if not isinstance(record, dict):
        return None, f"a record must be a JSON object, got {type(record).__name__} {formats.short(record)}"
    return record, ""


class RowTokenizer:
    """A batched `datasets.map` function: row -> token ids (+ loss mask for SFT formats), held-out flag, the
    reason a row is invalid ("" when valid, else "FILE, line N: why") and the message keys the chat template
    does not read (comma-separated; dropped from the row)."""

    def __init__(
        self,
        tokenizer,
        cfg: DataSection,
        vocab_size: int,
        source: str,
        holdout_every: int,
        fmt: str,
        locate: RowLocator | None = None,
    ):
        self.tokenizer, self.cfg, self.vocab_size, self.source = tokenizer, cfg, vocab_size, source
        self.holdout_every, self.fmt = holdout_every, fmt
        self.fields = formats.fields(cfg)
        self.template, default = formats.chat_template_of(tokenizer) if fmt == "chat" else (None, False)
        self.keys = chat_rows.template_keys(self.template) if fmt == "chat" else frozenset()
        self.template_name = "the ChatML default template" if default else "the tokenizer's chat template"
        self.locate = locate or (lambda index: f"{source}, row {index + 1}")
        self.needed = {
            "text": [self.fields["text"]],
            "chat": [self.fields["messages"]],
            "prompt_completion": [self.fields["prompt"], self.fields["completion"]],
        }[fmt]

    def encode(self, row: dict) -> tuple[str, list, list | None, list[str]]:
        """(text, ids, loss mask or None, dropped message keys) of one valid-looking row; FormatError if not."""
        cfg, f = self.cfg, self.fields
        if self.fmt == "text":
            text = row[f["text"]]
            if not isinstance(text, str):
                raise formats.FormatError(f"column {f['text']!r} must be a string, got {formats.short(text)}")
            if cfg.response_template is not None:  # completion-only loss: a prompt / completion split at it
                return (*self._after_response_template(text), [])
            return text, formats.encode_text(self.tokenizer, text, cfg.add_eos), None, []
        if self.fmt == "chat":
            messages, dropped = chat_rows.normalize(row[f["messages"]], self.keys, self.template_name)
            if cfg.system_prompt is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": cfg.system_prompt}] + messages
            return (*formats.encode_chat(self.tokenizer, self.template, messages, cfg.train_on_inputs), dropped)
        return (
            *formats.encode_prompt_completion(
                self.tokenizer, row[f["prompt"]], row[f["completion"]], cfg.add_eos, cfg.train_on_inputs
            ),
            [],
        )

    def _after_response_template(self, text: str) -> tuple[str, list, list]:
        """(text, ids, loss mask) of a text row whose loss starts after data.response_template: the text up to
        and including it as the prompt, the rest as the completion (tokenized as prompt_completion), EOS after."""
        template = self.cfg.response_template
        at = text.find(template)
        if at < 0:
            raise formats.FormatError(f"the text has no data.response_template {template!r}: {formats.short(text)}")
        cut = at + len(template)
        return formats.encode_prompt_completion(
            self.tokenizer, text[:cut], text[cut:], self.cfg.add_eos, self.cfg.train_on_inputs
        )

    def _row_of(self, batch: dict, k: int) -> tuple[dict | None, str]:
        """Row k of a batch as a record, or why it is none."""
        raw = batch.get(RAW)
        if raw is not None:
            return json_record(raw[k])
        return {c: batch[c][k] for c in self.needed}, ""

    def _check_columns(self, batch: dict) -> None:
        missing = [c for c in self.needed if c not in batch]
        if batch.get(RAW) is None and missing:
            col = "data.text_field: column" if self.fmt == "text" else f"data.format {self.fmt}: column"
            raise DataError(f"{col} {missing[0]!r} not in {self.source} (columns: {sorted(batch)})")

    def _hash_text(self, text: str, row: dict) -> str:
        """The text that decides whether a valid row is held out."""
        return text if self.fmt == "text" else formats.row_text_for_hash(self.fmt, row, self.fields)

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        self._check_columns(batch)
        raw, places = batch.get(RAW), batch.get(WHERE)
        out = {"input_ids": [], "heldout": [], "invalid": [], "keys": [], "empty_turn": []}
        masked = self.fmt != "text" or self.cfg.response_template is not None
        if masked:
            out["loss_mask"] = []
        for k, index in enumerate(indices):
            if raw is not None and not raw[k].strip():
                continue  # a blank line
            row, reason = self._row_of(batch, k)
            text, ids, mask, dropped = "", [], [], []
            if not reason:
                absent = [c for c in self.needed if row.get(c) is None]
                if absent:
                    reason = f"has no {absent[0]!r} (a {self.fmt} row needs {', '.join(map(repr, self.needed))})"
            if not reason:
                try:
                    text, ids, mask, dropped = self.encode(row)
                except formats.FormatError as e:
                    reason = str(e)
            place = places[k] if places is not None else None
            if ids and max(ids) >= self.vocab_size:
                raise DataError(
                    f"tokenizer.resize_vocab: {place or self.locate(index)} ({text[:40]!r}...) has token id "
                    f"{max(ids)} >= the model's vocab size {self.vocab_size}; set tokenizer.resize_vocab: true or "
                    f"use the model's own tokenizer"
                )
            out["input_ids"].append(ids)
            if masked:
                out["loss_mask"].append(mask if not reason else [])
            out["heldout"].append(not reason and is_heldout(self._hash_text(text, row), self.holdout_every))
            out["invalid"].append(f"{place or self.locate(index)}: {reason}" if reason else "")
            out["keys"].append(",".join(dropped))
            empty = not reason and self.fmt == "chat" and _empty_assistant_turn(row[self.fields["messages"]])
            out["empty_turn"].append(place or self.locate(index) if empty else "")
        return out


def _empty_assistant_turn(messages) -> bool:
    """A conversation with an assistant turn of empty content (None, "", blanks): it trains the model to say
    nothing, almost always a data bug."""
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict) and m.get("role") == "assistant":
            content = m.get("content")
            if content is None or (isinstance(content, str) and not content.strip()) or content == []:
                return True
    return False


def _code_version() -> str:
    """A hash of the code that turns rows into cached columns (this module, formats.py, chat_rows.py,
    long_text.py): a change to any of them gives new cache keys, so no cached result of older code is reused (no
    hand-kept version)."""
    source = "".join(inspect.getsource(m) for m in (RowTokenizer, formats, chat_rows, long_text))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def tokenize_fingerprint(docs, tokenizer, *parts, paths: list[str] = ()) -> str:
    """A stable `datasets` cache key for tokenizing `docs` (read from the local files `paths`) with `tokenizer`
    and settings `parts`.

    datasets hashes the map function's closure, which holds the tokenizer and is not stable across
    processes; a key of our own lets every rank reuse the main process's cached result. datasets' fingerprint of
    local files is their path and mtime, so each file's size, mtime_ns and content hash (`identity.py`) are in
    the key too: a file rewritten with its mtime kept is tokenized again.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)  # slow (Python) tokenizers have none
    tok_id = (
        backend.to_str()
        if backend is not None
        else f"{type(tokenizer).__name__}:{tokenizer.name_or_path}:{len(tokenizer)}"
    )
    files = [(d["path"], d["size"], d["mtime_ns"], d["xxh3_128"]) for d in files_identity(list(paths))]
    h = hashlib.sha256(f"{getattr(docs, '_fingerprint', '')}|{tok_id}|{_code_version()}|{parts}|{files}".encode())
    return h.hexdigest()[:32]


def _column_flags(tokenized, column: str) -> np.ndarray:
    """Rows whose string `column` is not empty (arrow compute: no Python string per row)."""
    col = arrow_column(tokenized, column)
    return np.asarray(pc.greater(pc.utf8_length(col), 0).to_numpy(zero_copy_only=False), dtype=bool)


def row_problems(tokenized, stats: SplitStats) -> np.ndarray:
    """Count invalid rows and dropped message keys into `stats`; the invalid rows' indices."""
    stats.rows = len(tokenized)
    flags = _column_flags(tokenized, "invalid")
    bad = np.flatnonzero(flags)
    stats.bad = len(bad)
    reasons = arrow_column(tokenized, "invalid").filter(pa.array(flags))
    stats.bad_examples = reasons.slice(0, BAD_ROWS_LISTED).to_pylist()
    if "empty_turn" in tokenized.column_names:
        empty = _column_flags(tokenized, "empty_turn")
        stats.empty_turns = int(empty.sum())
        places = arrow_column(tokenized, "empty_turn").filter(pa.array(empty))
        stats.empty_turn_examples = places.slice(0, BAD_ROWS_LISTED).to_pylist()
    keys = _column_flags(tokenized, "keys")
    for joined in arrow_column(tokenized, "keys").filter(pa.array(keys)).to_pylist():
        for key in joined.split(","):
            stats.dropped_keys[key] = stats.dropped_keys.get(key, 0) + 1
    return bad


def without(tokenized, rows: np.ndarray):
    """The dataset without `rows` (indices)."""
    return tokenized.select(np.setdiff1d(np.arange(len(tokenized)), rows)) if len(rows) else tokenized


_PACKING_ONLY = frozenset(
    {"seq_len", "packing", "document_boundaries", "shuffle_buffer", "stream_resume", "streaming", "skip_invalid"}
    | {"eval_holdout", "num_proc"}  # the holdout reaches the rows as `every`; num_proc changes no value
)
"""Data settings that do not change the tokenized rows; every other one (a new one too) is in the cache key."""


def tokenize_rows(
    docs,
    cfg: DataSection,
    tokenizer,
    vocab_size: int,
    fmt: str,
    source: str,
    paths: list[str],
    builder: str,
    every: int,
    cache: bool = True,
):
    """(tokenized dataset, SplitStats with the rows' problems, invalid row indices) of one split; `every`: hold
    out 1 row in this many (0: none)."""
    locate = RowLocator(paths, builder, source) if paths else None
    tok_fn = RowTokenizer(tokenizer, cfg, vocab_size, source, every, fmt, locate)
    if len(docs) == 0:
        raise DataError(f"{source}: the dataset is empty")
    key = tokenize_fingerprint(
        docs,
        tokenizer,
        vocab_size,
        every,
        fmt,
        sorted((k, v) for k, v in vars(cfg).items() if k not in _PACKING_ONLY),
        formats.chat_template_of(tokenizer)[0] if fmt == "chat" else None,
        paths=paths,
    )
    tokenized = docs.map(
        tok_fn,
        batched=True,
        with_indices=True,
        remove_columns=docs.column_names,
        num_proc=cfg.num_proc,
        desc="tokenizing",
        new_fingerprint=key,
        keep_in_memory=not cache,
    )
    stats = SplitStats(source)
    bad = row_problems(tokenized, stats)
    return tokenized, stats, bad
