"""Training data: load text with `datasets`, tokenize, pack into fixed-length sequences, batch per replica.

Label convention (HF): a batch carries `input_ids` and `labels` equal to `input_ids` (with -100 on
padding). `PipelineModel` shifts them (`vocab.labels.shift_labels`: position t is scored against
`labels[:, t+1]`, the last position against nothing), exactly as `AutoModelForCausalLM(input_ids,
labels=input_ids)` does, so exported models reproduce the training/eval loss.

Reading keeps values as written (`data_read.py`: JSON is parsed row by row, never typed per column), and
every row that does not fit its format is collected with its file and 1-based line: the run stops naming
the first and how many (`--check` lists the first 20), or skips them all with `data.skip_invalid`.
`prepare_data` reads, tokenizes (cached by `datasets` under a key of our own, so `--check` and every rank
of the launch reuse one result) and packs, and says what it found (`SplitStats`); `PreparedData.iterators`
slices it per replica (batches.py: order, resume, evaluation batches).

Sample formats (`data.format`, see `sft.py`): text, chat and prompt_completion rows become token ids
plus a loss mask; labels are -100 where a token carries no loss. With document boundaries (the default
for chat and prompt_completion, `data.document_boundaries`) packed rows also carry `position_ids` that
restart at 0 for every document: the model builds its attention mask from them (HF's packed-sequence
convention), so no token attends across documents, and the first token of a document is no one's target.

Held-out evaluation documents are chosen by a hash of their text (order independent, so the same
documents are held out streaming or not, whatever the file order).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import chat_rows, sft
from .batches import BatchIterator, EvalBatches, Sequences, StreamingBatchIterator, pack_stream
from .data_read import RAW, WHERE, DataError, RowLocator, extension_format, first_record_columns, load_rows
from .tokenizer import expand_files

__all__ = [
    "BatchIterator",
    "DataError",
    "EvalBatches",
    "PreparedData",
    "Sequences",
    "SplitStats",
    "StreamingBatchIterator",
    "build_data",
    "pack",
    "pack_documents",
    "pack_stream",
    "pad_rows",
    "prepare_data",
]

log = logging.getLogger("vp_accelerate.train")


def _warn(message: str, *args) -> None:
    """A warning about the data, from the first process only (every rank prepares the same data)."""
    if os.environ.get("RANK", "0") == "0":
        log.warning(message, *args)


BAD_ROWS_LISTED = 20
"""How many invalid rows `--check` lists (then a count)."""


class BadRowsError(DataError):
    """Rows that do not fit their format: `str()` is one line (the first and how many), `examples` the first
    BAD_ROWS_LISTED reasons, `count` all of them."""

    def __init__(self, key: str, examples: list[str], count: int):
        self.key, self.examples, self.count = key, examples, count
        more = f"{count} invalid rows; the first: " if count > 1 else ""
        super().__init__(
            f"{key}: {more}{examples[0]}. Fix the rows, or set data.skip_invalid: true to skip such "
            f"rows (they are counted){'; --check lists them' if count > 1 else ''}"
        )


def _format_of(files: list[str], fmt: str) -> str:
    """The `datasets` builder for `files`: `fmt` (text/json/parquet) or, for "auto", from the extensions."""
    if fmt != "auto":
        return fmt
    kinds = {extension_format(f) for f in files}
    if None in kinds:
        bad = [f for f in files if extension_format(f) is None]
        raise DataError(
            f"data.file_format: cannot tell the format of {bad[0]!r}; set data.file_format to text, json or parquet"
        )
    if len(kinds) > 1:
        raise DataError(f"data.files: mixes formats {sorted(kinds)}; use one format per list")
    return kinds.pop()


def check_columns(cfg) -> None:
    """Every local training / eval file of text format has `text_field` in its first record; else a DataError
    naming the columns found (checked before launch, not after)."""
    for key, patterns in (("data.files", cfg.files), ("data.eval_files", cfg.eval_files)):
        if not patterns:
            continue
        paths = [p for p in expand_files(patterns) if os.path.getsize(p) > 0]
        if not paths:
            continue
        builder = _format_of(paths, _builder_of(paths, cfg))
        for path in paths:
            columns = first_record_columns(path, builder)
            if columns is None:
                continue
            try:
                fmt, _ = sample_format(cfg, columns)
            except DataError:  # no format's columns: then it is text without its field
                fmt = "text"
            if fmt == "text" and cfg.text_field not in columns:
                raise DataError(
                    f"data.text_field: {cfg.text_field!r} is not a column of {path} (columns found: "
                    f"{columns}); set data.text_field to the column holding the text"
                )


def _nonempty_paths(files: list[str] | None, key: str = "data.files") -> list[str]:
    paths = expand_files(files or [])
    if not paths:
        raise DataError(f"{key}: no files")
    nonempty = [p for p in paths if os.path.getsize(p) > 0]
    if not nonempty:
        raise DataError(f"{key}: the dataset is empty (every file has 0 bytes: {paths[:3]})")
    return nonempty


def load_documents(
    files: list[str] | None,
    hub_id: str | None = None,
    split: str = "train",
    fmt: str = "auto",
    streaming: bool = False,
    name: str | None = None,
    revision: str | None = None,
):
    """A `datasets` Dataset (or IterableDataset when streaming) of raw rows (JSON as written: `data_read.py`).

    A hub dataset takes its configuration `name` and a `revision` (branch, tag or commit) for a pinned corpus.
    """
    from datasets import load_dataset  # datasets fixes its cache dir when imported: see data_read.load_rows

    if hub_id:
        return load_dataset(hub_id, name, split=split, streaming=streaming, revision=revision)
    paths = _nonempty_paths(files)  # 0-byte files hold no rows (and some builders fail on them)
    return load_rows(paths, _format_of(paths, fmt), streaming)


def data_columns(docs, paths: list[str], builder: str) -> list[str]:
    """The columns rows have: the dataset's, or for JSON read as written the first record's keys."""
    if RAW not in (docs.column_names or []):
        return list(docs.column_names or [])
    for path in paths:
        columns = first_record_columns(path, builder)
        if columns is not None:
            return columns
    return []


def is_heldout(text: str, every: int) -> bool:
    """Deterministic, order-independent choice of held-out documents: 1 in `every` by text hash."""
    if every <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return h % every == 0


def _json_record(line: str):
    """(record, reason): one line of a JSON Lines file parsed, or why it is not a record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(record, dict):
        return None, f"a record must be a JSON object, got {type(record).__name__} {sft._short(record)}"
    return record, ""


def make_tokenize_fn(
    tokenizer,
    text_field: str,
    add_eos: bool,
    vocab_size: int,
    source: str,
    holdout_every: int,
    fmt: str = "text",
    cfg=None,
    locate=None,
):
    """A batched `datasets.map` function: row -> token ids (+ loss mask for SFT formats), held-out flag, the
    reason a row is invalid ("" when valid, else "FILE, line N: why") and the message keys the chat template
    does not read (comma-separated; dropped from the row).

    Invalid rows are kept (empty) and flagged, so every one of them is found and named; `prepare_data` then
    stops on them or skips them (data.skip_invalid). Blank lines of a JSON Lines file are no rows. Token ids
    >= the model's vocabulary stop at once, naming the row (a tokenizer/model mismatch, not a bad row).
    """
    eos = tokenizer.eos_token_id
    train_on_inputs = bool(getattr(cfg, "train_on_inputs", False))
    fields = _fields(cfg, text_field)
    template, default = sft.chat_template_of(tokenizer) if fmt == "chat" else (None, False)
    keys = chat_rows.template_keys(template) if fmt == "chat" else frozenset()
    template_name = "the ChatML default template" if default else "the tokenizer's chat template"
    where = locate or (lambda index: f"{source}, row {index + 1}")

    def encode(row: dict) -> tuple[str, list, list | None, list[str]]:
        if fmt == "text":
            text = row[fields["text"]]
            if not isinstance(text, str):
                raise sft.FormatError(f"column {fields['text']!r} must be a string, got {sft._short(text)}")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return text, ids + [eos] if add_eos else ids, None, []
        if fmt == "chat":
            messages, dropped = chat_rows.normalize(row[fields["messages"]], keys, template_name)
            return (*sft.encode_chat(tokenizer, template, messages, train_on_inputs), dropped)
        return (
            *sft.encode_prompt_completion(
                tokenizer, row[fields["prompt"]], row[fields["completion"]], add_eos, train_on_inputs
            ),
            [],
        )

    needed = {
        "text": [fields["text"]],
        "chat": [fields["messages"]],
        "prompt_completion": [fields["prompt"], fields["completion"]],
    }[fmt]

    def fn(batch, indices):
        raw, places = batch.get(RAW), batch.get(WHERE)
        missing = [c for c in needed if c not in batch]
        if raw is None and missing:
            col = "data.text_field: column" if fmt == "text" else f"data.format {fmt}: column"
            raise DataError(f"{col} {missing[0]!r} not in {source} (columns: {sorted(batch)})")
        out = {"input_ids": [], "heldout": [], "invalid": [], "keys": []}
        if fmt != "text":
            out["loss_mask"] = []
        for k, index in enumerate(indices):
            if raw is not None:
                if not raw[k].strip():
                    continue  # a blank line
                row, reason = _json_record(raw[k])
            else:
                row, reason = {c: batch[c][k] for c in needed}, ""
            text, ids, mask, dropped = "", [], [], []
            if not reason:
                absent = [c for c in needed if row.get(c) is None]
                if absent:
                    reason = f"has no {absent[0]!r} (a {fmt} row needs {', '.join(map(repr, needed))})"
            if not reason:
                try:
                    text, ids, mask, dropped = encode(row)
                except sft.FormatError as e:
                    reason = str(e)
            place = (lambda: places[k]) if places is not None else (lambda: where(index))
            if ids and max(ids) >= vocab_size:
                raise DataError(
                    f"tokenizer.resize_vocab: {place()} ({text[:40]!r}...) has token id {max(ids)} >= the "
                    f"model's vocab size {vocab_size}; set tokenizer.resize_vocab: true or use the "
                    f"model's own tokenizer"
                )
            out["input_ids"].append(ids)
            if fmt != "text":
                out["loss_mask"].append(mask if not reason else [])
            out["heldout"].append(
                not reason
                and is_heldout(text if fmt == "text" else sft.row_text_for_hash(fmt, row, fields), holdout_every)
            )
            out["invalid"].append(f"{place()}: {reason}" if reason else "")
            out["keys"].append(",".join(dropped))
        return out

    return fn


def _fields(cfg, text_field: str) -> dict:
    return {
        "text": text_field,
        "messages": getattr(cfg, "messages_field", "messages"),
        "prompt": getattr(cfg, "prompt_field", "prompt"),
        "completion": getattr(cfg, "completion_field", "completion"),
    }


def tokenize_fingerprint(docs, tokenizer, *parts) -> str:
    """A stable `datasets` cache key for tokenizing `docs` with `tokenizer` and settings `parts`.

    datasets hashes the map function's closure, which holds the tokenizer and is not stable across
    processes; a key of our own lets every rank reuse the main process's cached result.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tok_id = (
        backend.to_str()
        if backend is not None
        else f"{type(tokenizer).__name__}:{tokenizer.name_or_path}:{len(tokenizer)}"
    )
    h = hashlib.sha256(f"{getattr(docs, '_fingerprint', '')}|{tok_id}|{parts}".encode())
    return h.hexdigest()[:32]


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
    for k, row in enumerate(token_rows):
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


def _token_rows(ds, column: str = "input_ids") -> list:
    """A column of token lists of a (non-streaming) dataset as a list of arrays, without Python lists per token."""
    col = ds.with_format("numpy")[column]
    return list(col)


@dataclass
class Encoded:
    """Tokenized rows of one split: ids and (SFT formats) loss masks, one array per document."""

    rows: list
    masks: list | None


def _encoded(ds) -> Encoded:
    return Encoded(_token_rows(ds), _token_rows(ds, "loss_mask") if "loss_mask" in ds.column_names else None)


def file_format(cfg) -> str:
    """The `datasets` builder asked for: data.file_format, or the legacy file-format values of data.format."""
    if cfg.format in ("json", "parquet"):
        return cfg.format
    return getattr(cfg, "file_format", "auto")


def _builder_of(paths: list[str], cfg) -> str:
    fmt = file_format(cfg)
    if fmt == "auto" and cfg.format == "text" and any(extension_format(f) is None for f in paths):
        return "text"  # `format: text` on files of any extension read them as plain text lines (as it always did)
    return fmt


def sample_format(cfg, columns) -> tuple[str, str]:
    """(text | chat | prompt_completion, how it was decided) for a recipe's data section and the data's columns."""
    declared = cfg.format if cfg.format in sft.SAMPLE_FORMATS else "auto"
    f = _fields(cfg, cfg.text_field)
    try:
        return sft.detect_format(columns, declared, f["text"], f["messages"], f["prompt"], f["completion"])
    except sft.FormatError as e:
        raise DataError(str(e)) from None


def document_boundaries(cfg, fmt: str) -> bool:
    """Whether packed rows keep documents apart: data.document_boundaries, else on for the SFT formats."""
    explicit = getattr(cfg, "document_boundaries", None)
    return fmt != "text" if explicit is None else bool(explicit)


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


def _row_locator(paths: list[str], builder: str, source: str) -> RowLocator:
    """index in the concatenated files -> "FILE, line N" (1-based), computed on first use."""
    return RowLocator(paths, builder, source)


def _arrow_column(ds, column: str):
    """A column as arrow (the dataset's view: its select()ed rows, not the whole table under it)."""
    return ds.with_format("arrow")[column]


def _column_flags(tokenized, column: str) -> np.ndarray:
    """Rows whose string `column` is not empty (arrow compute: no Python string per row)."""
    col = _arrow_column(tokenized, column)
    return np.asarray(pc.greater(pc.utf8_length(col), 0).to_numpy(zero_copy_only=False), dtype=bool)


def _row_problems(tokenized, stats: SplitStats) -> np.ndarray:
    """Count invalid rows and dropped message keys into `stats`; the invalid rows' indices."""
    stats.rows = len(tokenized)
    flags = _column_flags(tokenized, "invalid")
    bad = np.flatnonzero(flags)
    stats.bad = len(bad)
    reasons = _arrow_column(tokenized, "invalid").filter(pa.array(flags))
    stats.bad_examples = reasons.slice(0, BAD_ROWS_LISTED).to_pylist()
    keys = _column_flags(tokenized, "keys")
    for joined in _arrow_column(tokenized, "keys").filter(pa.array(keys)).to_pylist():
        for key in joined.split(","):
            stats.dropped_keys[key] = stats.dropped_keys.get(key, 0) + 1
    return bad


def _without(tokenized, rows: np.ndarray):
    return tokenized.select(np.setdiff1d(np.arange(len(tokenized)), rows)) if len(rows) else tokenized


def tokenize_rows(
    docs,
    cfg,
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
    locate = _row_locator(paths, builder, source) if paths else None
    tok_fn = make_tokenize_fn(tokenizer, cfg.text_field, cfg.add_eos, vocab_size, source, every, fmt, cfg, locate)
    if len(docs) == 0:
        raise DataError(f"{source}: the dataset is empty")
    # "rows-v2": the rows' columns (invalid reasons, dropped keys) differ from older cached results
    key = tokenize_fingerprint(
        docs,
        tokenizer,
        "rows-v2",
        cfg.text_field,
        cfg.add_eos,
        vocab_size,
        every,
        fmt,
        sorted(_fields(cfg, cfg.text_field).items()),
        getattr(cfg, "train_on_inputs", False),
        sft.chat_template_of(tokenizer)[0] if fmt == "chat" else None,
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
    bad = _row_problems(tokenized, stats)
    return tokenized, stats, bad


def _lengths(ds) -> np.ndarray:
    return np.asarray(
        pc.list_value_length(_arrow_column(ds, "input_ids")).to_numpy(zero_copy_only=False), dtype=np.int64
    )


def _split_stats(stats: SplitStats, ds) -> None:
    lengths = _lengths(ds) if len(ds) else np.zeros(0, dtype=np.int64)
    stats.documents, stats.tokens = len(ds), int(lengths.sum())
    stats.longest = int(lengths.max()) if len(lengths) else 0


def _what(fmt: str) -> str:
    return {"chat": "conversations", "prompt_completion": "prompt/completion rows"}.get(fmt, "documents")


@dataclass
class PreparedData:
    """The data of a run, read, tokenized and packed once (`prepare_data`); `iterators` slices it per replica."""

    cfg: object
    """The recipe's data section."""
    fmt: str
    """Sample format: text, chat or prompt_completion."""
    how: str
    """How the format was decided (declared, or detected from which columns)."""
    train: Sequences | None
    """Packed training sequences (None when streaming)."""
    eval: Sequences | None
    """Packed evaluation sequences (None when streaming without data.eval_files: read from the stream)."""
    stats: dict
    """"train" / "eval" -> SplitStats (a streamed split has none)."""
    make_stream: object = None
    """Streaming: (seed, epoch, heldout) -> the tokenized stream."""
    pad_id: int = 0
    """The padding token id."""

    def check_sizes(self, global_batch: int, eval_batches: int | None) -> None:
        """The errors `iterators` would raise, before anything else is built: fewer sequences than one global
        batch, no evaluation sequence while evaluation is on."""
        if self.train is not None and len(self.train) < global_batch:
            raise DataError(
                f"train.global_batch: the training data has {len(self.train)} sequences, fewer than "
                f"train.global_batch={global_batch}; add data or lower data.seq_len / train.global_batch"
            )
        if eval_batches != 0 and self.eval is not None and len(self.eval) == 0:
            raise DataError(no_eval_message(self.cfg))

    def iterators(self, seed: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1, eval_batches: int | None = 0):
        """(training iterator, EvalBatches of this replica). `eval_batches`: None = every evaluation sequence,
        0 = none, N = at most N batches."""
        cfg = self.cfg
        if self.train is not None:
            train = BatchIterator(self.train, seed, global_batch, dp_rank, dp_size)
        else:

            def stream(epoch: int, heldout: bool = False):
                return self.make_stream(seed, epoch, heldout)

            train = StreamingBatchIterator(
                stream, cfg.seq_len, seed, global_batch, dp_rank, dp_size, replay=cfg.stream_resume == "replay"
            )
        if eval_batches == 0:
            return train, EvalBatches(
                Sequences(np.zeros((0, cfg.seq_len), dtype=np.int64)), global_batch, dp_rank, dp_size, limit=0
            )
        seqs = self.eval
        if seqs is None:  # held-out documents of the stream: the first few batches' worth
            n_eval = (eval_batches or STREAM_EVAL_BATCHES) * global_batch
            rows = []
            for seq in pack_stream(self.make_stream(seed, 0, True), cfg.seq_len, []):
                rows.append(seq)
                if len(rows) == n_eval:
                    break
            seqs = Sequences(np.asarray(rows, dtype=np.int64).reshape(-1, cfg.seq_len), pad_id=self.pad_id)
        if len(seqs) == 0:
            raise DataError(no_eval_message(cfg))
        return train, EvalBatches(seqs, global_batch, dp_rank, dp_size, limit=eval_batches)


STREAM_EVAL_BATCHES = 4
"""Evaluation batches read from a stream's held-out documents when eval.batches is null (a stream has no end
to evaluate up to)."""


def no_eval_message(cfg) -> str:
    if cfg.eval_files:
        return (
            f"data.eval_files: {cfg.eval_files} gave no evaluation sequence (no valid row, or every one "
            f"dropped); fix those files, or set eval.batches: 0 for no evaluation"
        )
    return (
        f"data.eval_holdout: {cfg.eval_holdout} of the training rows held out no sequence for evaluation; set "
        f"data.eval_files, raise data.eval_holdout, or set eval.batches: 0 for no evaluation"
    )


def holdout_every(cfg) -> int:
    """Hold out 1 row in this many for evaluation (0: none, data.eval_files or eval_holdout 0)."""
    return 0 if cfg.eval_files or cfg.eval_holdout == 0 else max(2, round(1 / cfg.eval_holdout))


def prepare_data(cfg, tokenizer, vocab_size: int, cache: bool = True) -> PreparedData:
    """Read, tokenize and pack the recipe's data once (every rank the same; the tokenized rows are cached).

    Raises DataError naming the key, file and row and the fix: invalid rows (`BadRowsError`, unless
    data.skip_invalid), every conversation dropped by data.seq_len, too little data for one sequence.
    """
    every = holdout_every(cfg)
    source = f"data.files {cfg.files}" if cfg.files else f"dataset {cfg.hub_id}"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    paths = _nonempty_paths(cfg.files) if not cfg.hub_id else []
    builder = _format_of(paths, _builder_of(paths, cfg)) if paths else "auto"
    docs = load_documents(
        paths or None, cfg.hub_id, cfg.hub_split, builder, cfg.streaming, cfg.hub_name, cfg.hub_revision
    )
    fmt, how = sample_format(cfg, data_columns(docs, paths, builder))
    boundaries = document_boundaries(cfg, fmt)

    if cfg.streaming:
        if fmt != "text" or boundaries:
            raise DataError(
                f"data.streaming: streams are packed without document boundaries and support "
                f"data.format: text only (this data is {fmt}); set data.streaming: false"
            )
        tok_fn = make_tokenize_fn(
            tokenizer,
            cfg.text_field,
            cfg.add_eos,
            vocab_size,
            source,
            every,
            fmt,
            cfg,
            _row_locator(paths, builder, source) if paths else None,
        )
        skip = cfg.skip_invalid

        def make_stream(seed: int, epoch: int, heldout: bool = False):
            stream = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=list(docs.column_names or []))
            stream = stream.filter(lambda ex: _stream_row_ok(ex, skip) and ex["heldout"] == heldout)
            if heldout:
                return stream
            stream = stream.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer)
            stream.set_epoch(epoch)
            return stream

        eval_seqs, stats = None, {}
        if cfg.eval_files:
            eval_seqs, stats["eval"] = _eval_split(cfg, tokenizer, vocab_size, pad_id, fmt, cache)
        return PreparedData(cfg, fmt, how, None, eval_seqs, stats, make_stream, pad_id)

    tokenized, train_stats, bad = tokenize_rows(
        docs, cfg, tokenizer, vocab_size, fmt, source, paths, builder, every, cache
    )
    eval_tok = eval_stats = None
    eval_bad = np.zeros(0, dtype=np.int64)
    if cfg.eval_files:
        eval_tok, eval_stats, eval_bad = _eval_rows(cfg, tokenizer, vocab_size, fmt, cache)
    _stop_or_skip(cfg, [(source, train_stats, bad), ("data.eval_files", eval_stats, eval_bad)])
    tokenized = _without(tokenized, bad)
    if train_stats.rows == train_stats.bad:
        raise DataError(f"{source}: no valid row (all {train_stats.rows} skipped as invalid, data.skip_invalid)")
    flags = np.asarray(_arrow_column(tokenized, "heldout").to_numpy(zero_copy_only=False), dtype=bool)
    train_part = tokenized.select(np.flatnonzero(~flags))
    _split_stats(train_stats, train_part)
    train = _to_sequences(_encoded(train_part), cfg, pad_id, source, fmt, stats=train_stats)
    if eval_tok is not None:
        eval_part = _without(eval_tok, eval_bad)
    else:
        eval_part, eval_stats = (
            tokenized.select(np.flatnonzero(flags)),
            SplitStats(f"{source} (held out: 1 row in {every})" if every else source),
        )
    _split_stats(eval_stats, eval_part)
    eval_seqs = _to_sequences(
        _encoded(eval_part), cfg, pad_id, eval_stats.source, fmt, allow_empty=True, stats=eval_stats
    )
    for stats in (train_stats, eval_stats):
        if stats.dropped_keys:  # said once, at the start (and listed by --check)
            _warn(
                "%s: message keys the chat template does not read were dropped: %s",
                stats.source,
                ", ".join(f"{k} ({n} rows)" for k, n in sorted(stats.dropped_keys.items())),
            )
    return PreparedData(cfg, fmt, how, train, eval_seqs, {"train": train_stats, "eval": eval_stats}, None, pad_id)


def _stream_row_ok(example, skip: bool) -> bool:
    if not example["invalid"]:
        return True
    if skip:
        return False
    raise DataError(f"data.files: {example['invalid']}. Fix the row, or set data.skip_invalid: true to skip such rows")


def _stop_or_skip(cfg, splits) -> None:
    """Invalid rows stop the run (one BadRowsError over every split) unless data.skip_invalid skips them."""
    examples, count, key = [], 0, None
    for source, stats, bad in splits:
        if stats is None or not stats.bad:
            continue
        key = key or ("data.files" if source.startswith("data.files") else source.split(" ")[0])
        examples += stats.bad_examples
        count += stats.bad
        if cfg.skip_invalid:
            _warn(
                "%s: skipped %d invalid row(s) (data.skip_invalid); the first: %s",
                source,
                stats.bad,
                stats.bad_examples[0],
            )
    if count and not cfg.skip_invalid:
        raise BadRowsError(key, examples[:BAD_ROWS_LISTED], count)


def _eval_rows(cfg, tokenizer, vocab_size: int, fmt: str, cache: bool):
    paths = _nonempty_paths(cfg.eval_files, "data.eval_files")
    builder = _format_of(paths, _builder_of(paths, cfg))
    docs = load_rows(paths, builder)
    return tokenize_rows(
        docs, cfg, tokenizer, vocab_size, fmt, f"data.eval_files {cfg.eval_files}", paths, builder, 0, cache
    )


def _eval_split(cfg, tokenizer, vocab_size: int, pad_id: int, fmt: str, cache: bool):
    tokenized, stats, bad = _eval_rows(cfg, tokenizer, vocab_size, fmt, cache)
    _stop_or_skip(cfg, [("data.eval_files", stats, bad)])
    part = _without(tokenized, bad)
    _split_stats(stats, part)
    return _to_sequences(_encoded(part), cfg, pad_id, stats.source, fmt, allow_empty=True, stats=stats), stats


def build_data(
    cfg,
    tokenizer,
    vocab_size: int,
    seed: int,
    global_batch: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    eval_batches: int | None = 0,
):
    """(train iterator, eval batches for this replica) from a recipe's `data` section: `prepare_data` then
    `PreparedData.iterators` (eval_batches: None = the whole evaluation set, 0 = none, N = at most N)."""
    return prepare_data(cfg, tokenizer, vocab_size).iterators(seed, global_batch, dp_rank, dp_size, eval_batches)


def _to_sequences(
    enc: Encoded,
    cfg,
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
                f"data.seq_len: all {dropped} {_what(fmt)} of {source} were dropped: the tokens that carry "
                f"loss lie past data.seq_len={S} in every one (keeping one needs data.seq_len >= "
                f"{info['min_need']}, the longest has {stats.longest or max(map(len, rows))} tokens); "
                f"raise data.seq_len"
            )
        if dropped:
            _warn(
                "%s: %d of %d %s dropped: their loss tokens lie beyond data.seq_len=%d (keeping them all "
                "needs data.seq_len >= %d)",
                source,
                dropped,
                len(rows),
                _what(fmt),
                S,
                info["dropped_need"],
            )
        stats.cut_tokens = sum(max(0, len(r) - S) for r in rows) if fmt != "text" else 0
    elif cfg.packing:
        ids = pack(rows, S)
        labels = None if masks is None else sft.labels_from_mask(ids, pack(masks, S))
        seqs = Sequences(ids, labels=labels, pad_id=pad_id)
        stats.cut_tokens = sum(len(r) for r in rows) - ids.size
    else:
        ids, mask = pad_rows(rows, S, pad_id)
        labels = None if masks is None else sft.labels_from_mask(ids, pad_rows(masks, S, 0)[0])
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
