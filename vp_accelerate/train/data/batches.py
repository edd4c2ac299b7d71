"""Batches of packed sequences: the training iterators (in memory, streamed) and the evaluation batches.

Order and slicing: sequence order is a pure function of (seed, epoch). Step k takes the global batch
`order[k*G:(k+1)*G]`; data-parallel replica r takes rows `[r*B:(r+1)*B]` of it (B = G / dp_size).
Every pipeline rank of a replica gets the same rows (all ranks need the tokens under Vocabulary
Parallelism). The iterator's `state_dict()` ({"epoch", "step"}) makes resuming exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .read import DataError


@dataclass
class Sequences:
    """Fixed-length training sequences in memory: ids [N, S] and optionally an attention mask (unpacked),
    HF-convention labels (SFT formats; else labels = ids) and position ids (packing with document boundaries)."""

    ids: np.ndarray
    mask: np.ndarray | None = None
    labels: np.ndarray | None = None
    positions: np.ndarray | None = None
    lengths: np.ndarray | None = None
    """Tokens of each row that are not padding (None: every token is real)."""
    pad_id: int = 0
    """The token id padding uses."""

    def __len__(self) -> int:
        return len(self.ids)

    def real_tokens(self, rows: np.ndarray | None = None) -> int:
        """Tokens of `rows` (all rows when None) that are not padding."""
        if self.lengths is None:
            return (len(self.ids) if rows is None else len(rows)) * self.ids.shape[1]
        return int(self.lengths.sum() if rows is None else self.lengths[rows].sum())

    def target_counts(self) -> np.ndarray:
        """Per row, the tokens that are some position's target (HF shift: labels[:, 1:] other than -100)."""
        labels = self.ids if self.labels is None else self.labels
        valid = labels[:, 1:] != -100
        if self.mask is not None:
            valid &= self.mask[:, 1:] != 0
        return valid.sum(axis=1)

    def padding_row(self) -> dict:
        """One all-padding row (no token carries loss), to fill the last evaluation batch."""
        s = self.ids.shape[1]
        out = {"input_ids": torch.full((1, s), self.pad_id, dtype=torch.long), "labels": torch.full((1, s), -100)}
        if self.mask is not None:
            # attended (not masked: a fully masked row makes attention NaN), yet no token carries loss
            out["attention_mask"] = torch.ones(1, s, dtype=torch.long)
        if self.positions is not None:
            out["position_ids"] = torch.arange(s).unsqueeze(0)
        return out

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


@dataclass(frozen=True)
class ReplicaShare:
    """The rows of each global batch a data-parallel replica reads: rows [r*B, (r+1)*B) of it (B = G / dp_size)."""

    global_batch: int
    """G: rows of one global batch, over every replica."""
    dp_rank: int = 0
    """r: this replica."""
    dp_size: int = 1
    """Replicas."""

    @property
    def per_replica(self) -> int:
        """B: the rows of a global batch each replica reads."""
        return self.global_batch // self.dp_size

    def start(self, batch: int) -> int:
        """The first row this replica reads of global batch `batch`, counted over the batches (batch * G + r * B)."""
        return batch * self.global_batch + self.dp_rank * self.per_replica


class BatchIterator:
    """Deterministic, resumable iterator of one replica's batches over in-memory sequences."""

    def __init__(self, seqs: Sequences, seed: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        if len(seqs) < global_batch:
            raise DataError(
                f"the training data has {len(seqs)} sequences, fewer than train.global_batch="
                f"{global_batch}; add data or lower data.seq_len / train.global_batch"
            )
        self.seqs, self.seed, self.global_batch = seqs, seed, global_batch
        self.share = ReplicaShare(global_batch, dp_rank, dp_size)
        self.steps_per_epoch = len(seqs) // global_batch  # the incomplete last global batch is dropped
        self.epoch, self.step = 0, 0
        self._order = self._permutation(0)
        self.last_tokens = 0

    @property
    def epoch_progress(self) -> float:
        """Epochs done after the last batch (fractional)."""
        return self.epoch + self.step / self.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        # KTO's rows come in groups that must stay one microbatch (their KL rows: data/unpaired.py); else 1
        keep = getattr(self.seqs, "chunk", 1)
        groups = np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs) // keep)
        return (groups[:, None] * keep + np.arange(keep)).reshape(-1)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        first, start = self.step * self.global_batch, self.share.start(self.step)
        self.step += 1
        self.last_rows = self._order[start : start + self.share.per_replica]  # to name a bad sample in errors
        # every replica's rows are known here: the step's global count of real (non-padding) tokens
        self.last_tokens = self.seqs.real_tokens(self._order[first : first + self.global_batch])
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

    def __init__(
        self,
        make_stream,
        seq_len: int,
        seed: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        replay: bool = False,
    ):
        self.make_stream, self.seq_len, self.seed = make_stream, seq_len, seed
        self.global_batch, self.share = global_batch, ReplicaShare(global_batch, dp_rank, dp_size)
        self.replay = replay
        self.epoch, self.step = 0, 0
        self.last_tokens = global_batch * seq_len  # packed streams have no padding
        self._start(0)

    @property
    def epoch_progress(self) -> float:
        """The epoch of the last batch (its length is not known while streaming)."""
        return float(self.epoch)

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
                raise DataError(
                    f"the streamed training data has fewer than train.global_batch="
                    f"{self.global_batch} sequences of {self.seq_len} tokens"
                )
            self.epoch, self.step = self.epoch + 1, 0
            self._start(self.epoch)
            rows = next(self._batches)
        self.step += 1
        start = self.share.start(0)
        mine = rows[start : start + self.share.per_replica]
        ids = torch.tensor(mine, dtype=torch.long)
        self.last_position = (self.epoch, self.step)
        return {"input_ids": ids, "labels": ids.clone()}

    def describe_rows(self, first: int, end: int) -> str:
        """Where rows [first, end) of the last batch come from (for error messages)."""
        epoch, step = self.last_position
        start = self.share.start(step - 1)
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


class EvalBatches:
    """One replica's evaluation batches over held-out sequences, built when iterated (the same every time).

    Batch i holds global rows [i*G, (i+1)*G) (replica r its slice of them); the last one is filled with
    all-padding rows, so every held-out sequence is evaluated once and nothing twice. `loss_tokens[i]` is
    batch i's count of target tokens over all replicas: the weights that make the mean of the batches'
    losses the token mean over the whole evaluation set.
    """

    def __init__(
        self, seqs: Sequences, global_batch: int, dp_rank: int = 0, dp_size: int = 1, limit: int | None = None
    ):
        self.seqs, self.global_batch, self.share = seqs, global_batch, ReplicaShare(global_batch, dp_rank, dp_size)
        n = -(-len(seqs) // global_batch)
        self.count = n if limit is None else min(n, limit)
        targets = seqs.target_counts() if len(seqs) else np.zeros(0, dtype=np.int64)
        self.loss_tokens = [int(targets[i * global_batch : (i + 1) * global_batch].sum()) for i in range(self.count)]
        self.sequences = min(len(seqs), self.count * global_batch)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = self.share.start(i)
        rows = np.arange(start, min(start + self.share.per_replica, len(self.seqs)))
        batch = self.seqs.batch(rows) if len(rows) else None
        missing = self.share.per_replica - len(rows)
        if missing:
            pad = self.seqs.padding_row()
            fill = {k: v.expand(missing, -1).clone() for k, v in pad.items()}
            batch = fill if batch is None else {k: torch.cat([batch[k], fill[k].to(batch[k].dtype)]) for k in batch}
        return batch

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(self.count))
