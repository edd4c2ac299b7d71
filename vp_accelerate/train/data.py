"""Training data: load text with `datasets`, tokenize, pack into fixed-length sequences, batch per replica.

Label convention (HF): a batch carries `input_ids` and `labels` equal to `input_ids` (with -100 on
padding). `PipelineModel` shifts them (`vocab.labels.shift_labels`: position t is scored against
`labels[:, t+1]`, the last position against nothing), exactly as `AutoModelForCausalLM(input_ids,
labels=input_ids)` does, so exported models reproduce the training/eval loss.

Order and slicing: sequence order is a pure function of (seed, epoch). Step k takes the global batch
`order[k*G:(k+1)*G]`; data-parallel replica r takes rows `[r*B:(r+1)*B]` of it (B = G / dp_size).
Every pipeline rank of a replica gets the same rows (all ranks need the tokens under Vocabulary
Parallelism). The iterator's `state_dict()` ({"epoch", "step"}) makes resuming exact.

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
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from . import sft
from .tokenizer import expand_files

log = logging.getLogger("vp_accelerate.train")

_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """A data problem, with the file or sample it concerns."""


def _format_of(files: list[str], fmt: str) -> str:
    """The `datasets` builder for `files`: `fmt` (text/json/parquet) or, for "auto", from the extensions."""
    if fmt != "auto":
        return fmt
    kinds = {_FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds:
        bad = [f for f in files if os.path.splitext(f)[1].lower() not in _FORMATS]
        raise DataError(f"data.file_format: cannot tell the format of {bad[0]!r}; set data.file_format to "
                        f"text, json or parquet")
    if len(kinds) > 1:
        raise DataError(f"data.files: mixes formats {sorted(kinds)}; use one format per list")
    return kinds.pop()


def first_record_columns(path: str, fmt: str) -> list[str] | None:
    """The columns of a local file's first record (None when it has none to read), without loading the file."""
    import json

    if fmt == "text":
        return ["text"]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: the first record is not JSON ({e}); data.format is json for .json/.jsonl")
                return sorted(record) if isinstance(record, dict) else []
    return None


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
                raise DataError(f"data.text_field: {cfg.text_field!r} is not a column of {path} (columns found: "
                                f"{columns}); set data.text_field to the column holding the text")


def load_documents(files: list[str] | None, hub_id: str | None = None, split: str = "train", fmt: str = "auto",
                   streaming: bool = False, name: str | None = None, revision: str | None = None):
    """A `datasets` Dataset (or IterableDataset when streaming) of raw documents.

    A hub dataset takes its configuration `name` and a `revision` (branch, tag or commit) for a pinned corpus.
    """
    from datasets import load_dataset

    if hub_id:
        return load_dataset(hub_id, name, split=split, streaming=streaming, revision=revision)
    paths = expand_files(files or [])
    if not paths:
        raise DataError("data.files: no files")
    nonempty = [p for p in paths if os.path.getsize(p) > 0]  # datasets' JSON builder fails on 0-byte files
    if not nonempty:
        raise DataError(f"data.files: the dataset is empty (every file has 0 bytes: {paths[:3]})")
    paths = nonempty
    return load_dataset(_format_of(paths, fmt), data_files=paths, split="train", streaming=streaming)


def is_heldout(text: str, every: int) -> bool:
    """Deterministic, order-independent choice of held-out documents: 1 in `every` by text hash."""
    if every <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return h % every == 0


def make_tokenize_fn(tokenizer, text_field: str, add_eos: bool, vocab_size: int, source: str, holdout_every: int,
                     fmt: str = "text", cfg=None, locate=None):
    """A batched `datasets.map` function: row -> token ids (+ loss mask for SFT formats), held-out flag and,
    with `data.skip_invalid`, the reason a row was invalid ("" when valid).

    Token ids >= the model's vocabulary are an error naming the sample (a tokenizer/model mismatch
    would otherwise index out of range deep inside a pipeline rank). A row that does not fit its format is
    an error naming the file and row, or skipped (counted) with `data.skip_invalid: true`.
    """
    eos = tokenizer.eos_token_id
    skip = bool(getattr(cfg, "skip_invalid", False))
    train_on_inputs = bool(getattr(cfg, "train_on_inputs", False))
    fields = _fields(cfg, text_field)
    template = sft.chat_template_of(tokenizer)[0] if fmt == "chat" else None
    where = locate or (lambda index: f"{source}, row {index + 1}")

    def encode(row: dict) -> tuple[str, list, list | None]:
        if fmt == "text":
            text = row[fields["text"]]
            if not isinstance(text, str):
                raise sft.FormatError(f"column {fields['text']!r} must be a string, got {sft._short(text)}")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return text, ids + [eos] if add_eos else ids, None
        if fmt == "chat":
            return sft.encode_chat(tokenizer, template, row[fields["messages"]], train_on_inputs)
        return sft.encode_prompt_completion(tokenizer, row[fields["prompt"]], row[fields["completion"]], add_eos,
                                            train_on_inputs)

    needed = {"text": [fields["text"]], "chat": [fields["messages"]],
              "prompt_completion": [fields["prompt"], fields["completion"]]}[fmt]

    def fn(batch, indices):
        missing = [c for c in needed if c not in batch]
        if missing:
            col = "data.text_field: column" if fmt == "text" else f"data.format {fmt}: column"
            raise DataError(f"{col} {missing[0]!r} not in {source} (columns: {sorted(batch)})")
        out = {"input_ids": [], "heldout": [], "invalid": []}
        if fmt != "text":
            out["loss_mask"] = []
        for k, index in enumerate(indices):
            row = {c: batch[c][k] for c in needed}
            try:
                if any(row[c] is None for c in needed):
                    absent = [c for c in needed if row[c] is None]
                    raise sft.FormatError(f"has no {absent[0]!r} (a {fmt} row needs {', '.join(map(repr, needed))})")
                text, ids, mask = encode(row)
            except sft.FormatError as e:
                if not skip:
                    raise DataError(f"{where(index)}: {e}. Fix the row, or set data.skip_invalid: true to skip "
                                    f"such rows (they are counted)") from None
                text, ids, mask, reason = "", [], [], f"{where(index)}: {e}"
            else:
                reason = ""
            if ids and max(ids) >= vocab_size:
                raise DataError(f"{source}: document {index} ({text[:40]!r}...) has token id {max(ids)} >= the "
                                f"model's vocab size {vocab_size}; set tokenizer.resize_vocab: true or use the "
                                f"model's own tokenizer")
            out["input_ids"].append(ids)
            if fmt != "text":
                out["loss_mask"].append(mask)
            out["heldout"].append(not reason and is_heldout(text if fmt == "text" else
                                                            sft.row_text_for_hash(fmt, row, fields), holdout_every))
            out["invalid"].append(reason)
        return out

    return fn


def _fields(cfg, text_field: str) -> dict:
    return {"text": text_field, "messages": getattr(cfg, "messages_field", "messages"),
            "prompt": getattr(cfg, "prompt_field", "prompt"), "completion": getattr(cfg, "completion_field", "completion")}


def tokenize_fingerprint(docs, tokenizer, *parts) -> str:
    """A stable `datasets` cache key for tokenizing `docs` with `tokenizer` and settings `parts`.

    datasets hashes the map function's closure, which holds the tokenizer and is not stable across
    processes; a key of our own lets every rank reuse the main process's cached result.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tok_id = backend.to_str() if backend is not None else f"{type(tokenizer).__name__}:{tokenizer.name_or_path}:{len(tokenizer)}"
    h = hashlib.sha256(f"{getattr(docs, '_fingerprint', '')}|{tok_id}|{parts}".encode())
    return h.hexdigest()[:32]


def pack(token_rows, seq_len: int) -> np.ndarray:
    """Concatenate token rows and cut [N, seq_len] sequences (the tail shorter than seq_len is dropped)."""
    flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in token_rows]) if len(token_rows) else \
        np.zeros(0, dtype=np.int64)
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


def pack_documents(token_rows, loss_masks, seq_len: int, pad_id: int,
                   split_long: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Pack whole documents into rows of seq_len, keeping their boundaries.

    Returns (ids, labels, position_ids, dropped): documents are placed in order, a new row starts when the
    next one does not fit, and the rest of a row is padding (its own "document": labels -100, positions
    from 0, so it attends only to itself). Positions restart at 0 for every document and a document's
    first token gets label -100 (nothing before it in its document predicts it). A document longer than
    seq_len is cut into seq_len pieces (`split_long`, text) or truncated (SFT: a cut conversation's tail
    would lack its prompt); `dropped` counts documents whose loss tokens were all cut away.
    """
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    dropped = 0
    for k, row in enumerate(token_rows):
        row = np.asarray(row, dtype=np.int64)
        mask = np.ones(len(row), dtype=bool) if loss_masks is None else np.asarray(loss_masks[k], dtype=bool)
        if len(row) > seq_len and not split_long:
            row, mask = row[:seq_len], mask[:seq_len]
        if loss_masks is not None and not mask[1:].any():
            dropped += 1
            continue
        for start in range(0, len(row), seq_len):
            if len(row[start:start + seq_len]):
                pieces.append((row[start:start + seq_len], mask[start:start + seq_len]))
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
            ids[i, at:at + n] = doc
            labels[i, at:at + n] = np.where(mask, doc, -100)
            labels[i, at] = -100
            pos[i, at:at + n] = np.arange(n)
            at += n
        pos[i, at:] = np.arange(seq_len - at)
    return ids, labels, pos, dropped


@dataclass
class Sequences:
    """Fixed-length training sequences in memory: ids [N, S] and optionally an attention mask (unpacked),
    HF-convention labels (SFT formats; else labels = ids) and position ids (packing with document boundaries)."""

    ids: np.ndarray
    mask: np.ndarray | None = None
    labels: np.ndarray | None = None
    positions: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rows: np.ndarray) -> dict:
        ids = torch.from_numpy(self.ids[rows])
        labels = torch.from_numpy(self.labels[rows]) if self.labels is not None else ids.clone()
        out = {"input_ids": ids, "labels": labels}
        if self.mask is not None:
            mask = torch.from_numpy(self.mask[rows])
            out["attention_mask"] = mask
            out["labels"][mask == 0] = -100
        if self.positions is not None:
            out["position_ids"] = torch.from_numpy(self.positions[rows])
        return out


class BatchIterator:
    """Deterministic, resumable iterator of one replica's batches over in-memory sequences."""

    def __init__(self, seqs: Sequences, seed: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        if len(seqs) < global_batch:
            raise DataError(f"the training data has {len(seqs)} sequences, fewer than train.global_batch="
                            f"{global_batch}; add data or lower data.seq_len / train.global_batch")
        self.seqs, self.seed, self.global_batch = seqs, seed, global_batch
        self.per_replica = global_batch // dp_size
        self.dp_rank = dp_rank
        self.steps_per_epoch = len(seqs) // global_batch  # the incomplete last global batch is dropped
        self.epoch, self.step = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs))

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = self.step * self.global_batch + self.dp_rank * self.per_replica
        self.step += 1
        self.last_rows = self._order[start: start + self.per_replica]  # to name a bad sample in errors
        return self.seqs.batch(self.last_rows)

    def describe_rows(self, first: int, end: int) -> str:
        """Where rows [first, end) of the last batch come from (for error messages)."""
        rows = self.last_rows[first:end].tolist()
        return f"packed training sequences {rows} (epoch {self.epoch}, order of seed {self.seed})"

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._order = self._permutation(self.epoch)


def pack_stream(stream, seq_len: int, buf: list[int]):
    """Fixed-length sequences of a stream of tokenized examples; `buf` holds the tokens not yet cut into one."""
    for example in stream:
        buf.extend(example["input_ids"])
        while len(buf) >= seq_len:
            seq = buf[:seq_len]
            del buf[:seq_len]
            yield seq


class StreamingBatchIterator:
    """Resumable iterator over a streamed corpus: shuffle buffer -> tokenize -> pack -> batches.

    The stream's order is deterministic for (seed, epoch). `state_dict()` holds the stream's own position
    (`IterableDataset.state_dict()`, datasets >= 2.18) and the tokens packed but not yet batched, so
    `load_state_dict` continues from there without re-reading the stream. As datasets documents, the
    shuffle buffer's content is not in that state: on resume the buffer is refilled from the stream, and
    the documents it held at the save are skipped. `replay=True` (or a state without the stream's
    position) instead replays the stream up to the saved step: exact, at the cost of re-reading.
    """

    def __init__(self, make_stream, seq_len: int, seed: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, replay: bool = False):
        self.make_stream, self.seq_len, self.seed = make_stream, seq_len, seed
        self.global_batch, self.per_replica, self.dp_rank = global_batch, global_batch // dp_size, dp_rank
        self.replay = replay
        self.epoch, self.step = 0, 0
        self._start(0)

    def _start(self, epoch: int, stream_state: dict | None = None, buf: list[int] | None = None) -> None:
        self._stream = self.make_stream(epoch)
        if stream_state is not None:
            self._stream.load_state_dict(stream_state)
        self._buf = list(buf or [])
        self._batches = self._global_batches()

    def _global_batches(self):
        rows: list[list[int]] = []
        for seq in pack_stream(self._stream, self.seq_len, self._buf):
            rows.append(seq)
            if len(rows) == self.global_batch:
                # between examples: the stream's position and the tokens in _buf are a consistent state
                self._position = {"stream": self._stream_state(), "buf": list(self._buf)}
                yield rows
                rows = []

    def _stream_state(self):
        get = getattr(self._stream, "state_dict", None)
        return get() if get is not None and not self.replay else None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = next(self._batches, None)
        if rows is None:
            if self.step == 0:
                raise DataError(f"the streamed training data has fewer than train.global_batch="
                                f"{self.global_batch} sequences of {self.seq_len} tokens")
            self.epoch, self.step = self.epoch + 1, 0
            self._start(self.epoch)
            rows = next(self._batches)
        self.step += 1
        mine = rows[self.dp_rank * self.per_replica: (self.dp_rank + 1) * self.per_replica]
        ids = torch.tensor(mine, dtype=torch.long)
        self.last_position = (self.epoch, self.step)
        return {"input_ids": ids, "labels": ids.clone()}

    def describe_rows(self, first: int, end: int) -> str:
        """Where rows [first, end) of the last batch come from (for error messages)."""
        epoch, step = self.last_position
        start = (step - 1) * self.global_batch + self.dp_rank * self.per_replica
        return f"streamed sequences {start + first}..{start + end - 1} of epoch {epoch}"

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "step": self.step}
        position = getattr(self, "_position", None) if self.step else None
        if position is not None and position["stream"] is not None:
            state.update(stream=position["stream"], buf=torch.tensor(position["buf"], dtype=torch.long))
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = int(state["epoch"]), 0
        if state.get("stream") is not None and not self.replay:
            self._start(self.epoch, state["stream"], torch.as_tensor(state["buf"]).tolist())
            self.step = int(state["step"])
            return
        self._start(self.epoch)
        for _ in range(int(state["step"])):
            next(self._batches)
            self.step += 1


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
    if fmt == "auto" and cfg.format == "text" and any(os.path.splitext(f)[1].lower() not in _FORMATS for f in paths):
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


def _row_locator(paths: list[str], builder: str, source: str):
    """index in the concatenated files -> "FILE, row R" (1-based; the line of a .jsonl), computed on first use."""
    counts: list[int] = []

    def locate(index: int) -> str:
        from datasets import load_dataset

        if len(paths) == 1:
            return f"{paths[0]}, row {index + 1}"
        if not counts:
            counts.extend(len(load_dataset(builder, data_files=[p], split="train")) for p in paths)
        for path, n in zip(paths, counts):
            if index < n:
                return f"{path}, row {index + 1}"
            index -= n
        return f"{source}, row {index + 1}"

    return locate


def _skipped(tokenized, what: str):
    """Drop rows flagged invalid (data.skip_invalid), logging how many and the first reason."""
    reasons = tokenized["invalid"]
    bad = [i for i, r in enumerate(reasons) if r]
    if bad:
        log.warning("%s: skipped %d invalid row(s) (data.skip_invalid); first: %s", what, len(bad), reasons[bad[0]])
        keep = np.setdiff1d(np.arange(len(reasons)), bad)
        tokenized = tokenized.select(keep)
    return tokenized, len(bad)


def build_data(cfg, tokenizer, vocab_size: int, seed: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
               eval_batches: int = 0):
    """(train iterator, eval batches for this replica) from a recipe's `data` section.

    Eval batches are a fixed list, the same at every evaluation: `eval_batches` batches of the replica's
    batch size, taken in order from the held-out sequences (wrapping around when there are few).
    """
    holdout_every = 0 if cfg.eval_files or cfg.eval_holdout == 0 else max(2, round(1 / cfg.eval_holdout))
    source = f"data.files {cfg.files}" if cfg.files else f"dataset {cfg.hub_id}"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    paths = expand_files(cfg.files or []) if not cfg.hub_id else []
    builder = _builder_of(paths, cfg) if paths else "auto"
    docs = load_documents(cfg.files, cfg.hub_id, cfg.hub_split, builder, cfg.streaming, cfg.hub_name,
                          cfg.hub_revision)
    fmt, _ = sample_format(cfg, docs.column_names)

    def fn_for(files: list[str], where: str, every: int):
        locate = _row_locator(files, _format_of(files, _builder_of(files, cfg)), where) if files else None
        return make_tokenize_fn(tokenizer, cfg.text_field, cfg.add_eos, vocab_size, where, every, fmt, cfg, locate)

    tok_fn = fn_for(paths, source, holdout_every)
    boundaries = document_boundaries(cfg, fmt)
    per_replica = global_batch // dp_size
    n_eval = eval_batches * global_batch

    if cfg.streaming:
        if fmt != "text" or boundaries:
            raise DataError(f"data.streaming: streams are packed without document boundaries and support "
                            f"data.format: text only (this data is {fmt}); set data.streaming: false")

        def make_stream(epoch: int, heldout: bool = False):
            stream = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=list(docs.column_names or []))
            stream = stream.filter(lambda ex: ex["heldout"] == heldout and not ex["invalid"])
            if heldout:
                return stream
            stream = stream.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer)
            stream.set_epoch(epoch)
            return stream

        train = StreamingBatchIterator(make_stream, cfg.seq_len, seed, global_batch, dp_rank, dp_size,
                                       replay=cfg.stream_resume == "replay")
        eval_rows = []
        if n_eval:
            if cfg.eval_files:
                eval_rows = list(_eval_sequences(cfg, fn_for, pad_id, fmt).ids[:n_eval])
            else:
                for seq in pack_stream(make_stream(0, True), cfg.seq_len, []):
                    eval_rows.append(seq)
                    if len(eval_rows) == n_eval:
                        break
        eval_seqs = Sequences(np.asarray(eval_rows, dtype=np.int64).reshape(-1, cfg.seq_len))
    else:
        if len(docs) == 0:
            raise DataError(f"{source}: the dataset is empty")
        key = tokenize_fingerprint(docs, tokenizer, cfg.text_field, cfg.add_eos, vocab_size, holdout_every, fmt,
                                   sorted(_fields(cfg, cfg.text_field).items()),
                                   getattr(cfg, "train_on_inputs", False), getattr(cfg, "skip_invalid", False),
                                   sft.chat_template_of(tokenizer)[0] if fmt == "chat" else None)
        tokenized = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=docs.column_names,
                             num_proc=cfg.num_proc, desc="tokenizing", new_fingerprint=key)
        tokenized, _ = _skipped(tokenized, source)
        flags = np.asarray(tokenized["heldout"], dtype=bool)
        train = BatchIterator(_to_sequences(_encoded(tokenized.select(np.flatnonzero(~flags))), cfg, pad_id, source,
                                            fmt), seed, global_batch, dp_rank, dp_size)
        if cfg.eval_files:
            eval_seqs = _eval_sequences(cfg, fn_for, pad_id, fmt)
        else:
            eval_seqs = _to_sequences(_encoded(tokenized.select(np.flatnonzero(flags))), cfg, pad_id, source, fmt,
                                      allow_empty=True)

    evals = []
    if n_eval:
        if len(eval_seqs) == 0:
            raise DataError(f"{source}: no held-out sequences for evaluation; set data.eval_files, raise "
                            f"data.eval_holdout, or set eval.batches to 0")
        for i in range(eval_batches):
            start = i * global_batch + dp_rank * per_replica
            rows = np.arange(start, start + per_replica) % len(eval_seqs)
            evals.append(eval_seqs.batch(rows))
    return train, evals


def _to_sequences(enc: Encoded, cfg, pad_id: int, source: str, fmt: str = "text",
                  allow_empty: bool = False) -> Sequences:
    rows, masks = enc.rows, enc.masks
    if cfg.packing and document_boundaries(cfg, fmt):
        ids, labels, pos, dropped = pack_documents(rows, masks, cfg.seq_len, pad_id, split_long=fmt == "text")
        if dropped:
            log.warning(
                "%s: %d document(s) dropped: their loss tokens lie beyond data.seq_len=%d", source, dropped,
                cfg.seq_len)
        seqs = Sequences(ids, labels=labels, positions=pos)
    elif cfg.packing:
        ids = pack(rows, cfg.seq_len)
        labels = None if masks is None else sft.labels_from_mask(ids, pack(masks, cfg.seq_len))
        seqs = Sequences(ids, labels=labels)
    else:
        ids, mask = pad_rows(rows, cfg.seq_len, pad_id)
        labels = None if masks is None else sft.labels_from_mask(ids, pad_rows(masks, cfg.seq_len, 0)[0])
        seqs = Sequences(ids, mask, labels=labels)
    if len(seqs) == 0 and not allow_empty:
        total = sum(len(r) for r in rows)
        raise DataError(f"{source}: only {total} tokens, not one sequence of data.seq_len={cfg.seq_len}")
    return seqs


def _eval_sequences(cfg, fn_for, pad_id: int, fmt: str) -> Sequences:
    """Sequences of data.eval_files, encoded, packed or padded like the training data."""
    paths = expand_files(cfg.eval_files)
    tok_fn = fn_for(paths, f"data.eval_files {cfg.eval_files}", 0)
    docs = load_documents(cfg.eval_files, None, "train", _builder_of(paths, cfg), streaming=False)
    tokenized = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=docs.column_names,
                         keep_in_memory=True)  # small; not worth a cache file per rank
    tokenized, _ = _skipped(tokenized, "data.eval_files")
    return _to_sequences(_encoded(tokenized), cfg, pad_id, f"data.eval_files {cfg.eval_files}", fmt, allow_empty=True)
