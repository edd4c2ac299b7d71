"""Training data: load text with `datasets`, tokenize, pack into fixed-length sequences, batch per replica.

Label convention (HF): a batch carries `input_ids` and `labels` equal to `input_ids` (with -100 on
padding). The *trainer* turns them into next-token labels with `next_token_labels` — `labels[:, t]`
becomes `labels[:, t+1]` and the last position gets -100 — because the pipeline's loss scores
position t against the label given at t (no shift inside the runtime). This is exactly what
`AutoModelForCausalLM(input_ids, labels=input_ids)` computes, so exported models reproduce the
training/eval loss.

Order and slicing: sequence order is a pure function of (seed, epoch). Step k takes the global batch
`order[k*G:(k+1)*G]`; data-parallel replica r takes rows `[r*B:(r+1)*B]` of it (B = G / dp_size).
Every pipeline rank of a replica gets the same rows (all ranks need the tokens under Vocabulary
Parallelism). The iterator's `state_dict()` ({"epoch", "step"}) makes resuming exact.

Held-out evaluation documents are chosen by a hash of their text (order independent, so the same
documents are held out streaming or not, whatever the file order).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .tokenizer import expand_files

_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """A data problem, with the file or sample it concerns."""


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF-convention labels [B, S] -> next-token labels: shift left by one, -100 in the last column."""
    out = torch.full_like(labels, -100)
    out[:, :-1] = labels[:, 1:]
    return out


def _format_of(files: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = {_FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds:
        bad = [f for f in files if os.path.splitext(f)[1].lower() not in _FORMATS]
        raise DataError(f"data.format: cannot tell the format of {bad[0]!r}; set data.format to text, json or parquet")
    if len(kinds) > 1:
        raise DataError(f"data.files: mixes formats {sorted(kinds)}; use one format per list")
    return kinds.pop()


def load_documents(files: list[str] | None, hub_id: str | None = None, split: str = "train", fmt: str = "auto",
                   streaming: bool = False):
    """A `datasets` Dataset (or IterableDataset when streaming) of raw documents."""
    from datasets import load_dataset

    if hub_id:
        return load_dataset(hub_id, split=split, streaming=streaming)
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


def make_tokenize_fn(tokenizer, text_field: str, add_eos: bool, vocab_size: int, source: str, holdout_every: int):
    """A batched `datasets.map` function: text -> token ids (+EOS), with a held-out flag.

    Token ids >= the model's vocabulary are an error naming the sample (a tokenizer/model mismatch
    would otherwise index out of range deep inside a pipeline rank).
    """
    eos = tokenizer.eos_token_id

    def fn(batch, indices):
        if text_field not in batch:
            raise DataError(f"data.text_field: column {text_field!r} not in {source} (columns: {sorted(batch)})")
        texts = batch[text_field]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        heldout = []
        for text, row, index in zip(texts, ids, indices):
            if add_eos:
                row.append(eos)
            if row and max(row) >= vocab_size:
                raise DataError(f"{source}: document {index} ({text[:40]!r}...) has token id {max(row)} >= the "
                                f"model's vocab size {vocab_size}; set tokenizer.resize_vocab: true or use the "
                                f"model's own tokenizer")
            heldout.append(is_heldout(text, holdout_every))
        return {"input_ids": ids, "heldout": heldout}

    return fn


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


@dataclass
class Sequences:
    """Fixed-length training sequences in memory: ids [N, S] and, unpacked, an attention mask."""

    ids: np.ndarray
    mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rows: np.ndarray) -> dict:
        ids = torch.from_numpy(self.ids[rows])
        out = {"input_ids": ids, "labels": ids.clone()}
        if self.mask is not None:
            mask = torch.from_numpy(self.mask[rows])
            out["attention_mask"] = mask
            out["labels"][mask == 0] = -100
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


class StreamingBatchIterator:
    """Resumable iterator over a streamed corpus: shuffle buffer -> tokenize -> pack -> batches.

    The stream's order is deterministic for (seed, epoch); `load_state_dict` replays the stream up to
    the saved position (exact, at the cost of re-reading what was already trained on).
    """

    def __init__(self, make_stream, seq_len: int, seed: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1):
        self.make_stream, self.seq_len, self.seed = make_stream, seq_len, seed
        self.global_batch, self.per_replica, self.dp_rank = global_batch, global_batch // dp_size, dp_rank
        self.epoch, self.step = 0, 0
        self._batches = self._global_batches(0)

    def _sequences(self, epoch: int):
        buf: list[int] = []
        for example in self.make_stream(epoch):
            buf.extend(example["input_ids"])
            while len(buf) >= self.seq_len:
                yield buf[: self.seq_len]
                del buf[: self.seq_len]

    def _global_batches(self, epoch: int):
        rows: list[list[int]] = []
        for seq in self._sequences(epoch):
            rows.append(seq)
            if len(rows) == self.global_batch:
                yield rows
                rows = []

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = next(self._batches, None)
        if rows is None:
            if self.step == 0:
                raise DataError(f"the streamed training data has fewer than train.global_batch="
                                f"{self.global_batch} sequences of {self.seq_len} tokens")
            self.epoch, self.step = self.epoch + 1, 0
            self._batches = self._global_batches(self.epoch)
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
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = int(state["epoch"]), 0
        self._batches = self._global_batches(self.epoch)
        for _ in range(int(state["step"])):
            next(self._batches)
            self.step += 1


def _token_rows(ds) -> list:
    """The input_ids column of a (non-streaming) dataset as a list of arrays, without Python lists per token."""
    col = ds.with_format("numpy")["input_ids"]
    return list(col)


def build_data(cfg, tokenizer, vocab_size: int, seed: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
               eval_batches: int = 0):
    """(train iterator, eval batches for this replica) from a recipe's `data` section.

    Eval batches are a fixed list, the same at every evaluation: `eval_batches` batches of the replica's
    batch size, taken in order from the held-out sequences (wrapping around when there are few).
    """
    holdout_every = 0 if cfg.eval_files or cfg.eval_holdout == 0 else max(2, round(1 / cfg.eval_holdout))
    source = f"data.files {cfg.files}" if cfg.files else f"dataset {cfg.hub_id}"
    tok_fn = make_tokenize_fn(tokenizer, cfg.text_field, cfg.add_eos, vocab_size, source, holdout_every)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    docs = load_documents(cfg.files, cfg.hub_id, cfg.hub_split, cfg.format, cfg.streaming)
    per_replica = global_batch // dp_size
    n_eval = eval_batches * global_batch

    if cfg.streaming:
        def make_stream(epoch: int, heldout: bool = False):
            stream = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=list(docs.column_names or []))
            stream = stream.filter(lambda ex: ex["heldout"] == heldout)
            if heldout:
                return stream
            stream = stream.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer)
            stream.set_epoch(epoch)
            return stream

        train = StreamingBatchIterator(make_stream, cfg.seq_len, seed, global_batch, dp_rank, dp_size)
        eval_rows = []
        if n_eval:
            if cfg.eval_files:
                eval_rows = _eval_rows_from_files(cfg, tok_fn, n_eval)
            else:
                for seq in StreamingBatchIterator(lambda e: make_stream(e, True), cfg.seq_len, seed, 1)._sequences(0):
                    eval_rows.append(seq)
                    if len(eval_rows) == n_eval:
                        break
        eval_seqs = Sequences(np.asarray(eval_rows, dtype=np.int64).reshape(-1, cfg.seq_len))
    else:
        if len(docs) == 0:
            raise DataError(f"{source}: the dataset is empty")
        key = tokenize_fingerprint(docs, tokenizer, cfg.text_field, cfg.add_eos, vocab_size, holdout_every)
        tokenized = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=docs.column_names,
                             num_proc=cfg.num_proc, desc="tokenizing", new_fingerprint=key)
        flags = np.asarray(tokenized["heldout"], dtype=bool)
        train_rows = _token_rows(tokenized.select(np.flatnonzero(~flags)))
        train = BatchIterator(_to_sequences(train_rows, cfg, pad_id, source), seed, global_batch, dp_rank, dp_size)
        if cfg.eval_files:
            eval_seqs = Sequences(np.asarray(_eval_rows_from_files(cfg, tok_fn, n_eval), dtype=np.int64)
                                  .reshape(-1, cfg.seq_len)) if cfg.packing else \
                _eval_sequences_unpacked(cfg, tok_fn, pad_id)
        else:
            eval_seqs = _to_sequences(_token_rows(tokenized.select(np.flatnonzero(flags))), cfg, pad_id,
                                      source, allow_empty=True)

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


def _to_sequences(rows, cfg, pad_id: int, source: str, allow_empty: bool = False) -> Sequences:
    if cfg.packing:
        seqs = Sequences(pack(rows, cfg.seq_len))
    else:
        seqs = Sequences(*pad_rows(rows, cfg.seq_len, pad_id))
    if len(seqs) == 0 and not allow_empty:
        total = sum(len(r) for r in rows)
        raise DataError(f"{source}: only {total} tokens, not one sequence of data.seq_len={cfg.seq_len}")
    return seqs


def _eval_rows_from_files(cfg, tok_fn, n_eval: int) -> list:
    docs = load_documents(cfg.eval_files, None, "train", cfg.format, streaming=False)
    tokenized = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=docs.column_names,
                         keep_in_memory=True)  # small; not worth a cache file per rank
    packed = pack(_token_rows(tokenized), cfg.seq_len)
    return list(packed[:n_eval]) if n_eval else list(packed)


def _eval_sequences_unpacked(cfg, tok_fn, pad_id: int) -> Sequences:
    docs = load_documents(cfg.eval_files, None, "train", cfg.format, streaming=False)
    tokenized = docs.map(tok_fn, batched=True, with_indices=True, remove_columns=docs.column_names,
                         keep_in_memory=True)
    return Sequences(*pad_rows(_token_rows(tokenized), cfg.seq_len, pad_id))
