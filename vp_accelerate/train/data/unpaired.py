"""Unpaired preference rows (`data.format: unpaired_preference`, KTO): `prompt`, `completion` and a boolean
`label` (desirable or not; `data.label_field`), tokenized as TRL 1.16's KTOTrainer does, with the mismatched
(KL) rows it builds.

Tokens (TRL's `_prepare_dataset`): standard rows (strings) get EOS appended to the completion as text (with
data.add_eos, unless it already ends with it); the prompt is tokenized alone and prompt + completion whole,
with the tokenizer's special tokens; the completion starts where the two stop matching. Conversational rows
(lists of turns) are rendered with the chat template: the prompt's turns with the generation prompt, then
prompt + completion. Only the completion's tokens carry loss. A row whose prompt alone fills data.seq_len is
dropped (TRL filters it), a longer one cut to data.seq_len keeping its start (TRL's collator).

KL rows: TRL estimates KTO's KL term z from mismatched pairs, rotating the completions by one within each
group of `per_device_train_batch_size` consecutive rows ((x1, yn), (x2, y1), ..., (xn, yn-1)), and needs
sequential sampling so that such a group is one device batch. Here the group is a microbatch
(`group(rows)`: train.global_batch / (dp x microbatches) rows), and the training order shuffles whole groups
(`BatchIterator` reads `chunk`), so each microbatch holds its own KL rows as in TRL, in any order. Their
reference log-probabilities are computed once with the rows' (train/run/reference_logps.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..recipe.schema import DataSection
from . import chat_rows, formats
from .batches import Sequences
from .pack import warn
from .preference import chat_ids, record_of, turns_of
from .read import WHERE, DataError, RowLocator
from .sources import builder_for, load_documents, nonempty_paths
from .stats import BAD_ROWS_LISTED, SplitStats
from .tokenize import is_heldout


def _padded(rows: list[tuple[list, list]], seq_len: int, pad_id: int):
    """(ids, labels, mask, lengths) of (prompt ids, completion ids) rows, cut to seq_len (keep_start), padded."""
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), -100, dtype=np.int64)
    mask = np.zeros((n, seq_len), dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for i, (prompt, completion) in enumerate(rows):
        row = (prompt + completion)[:seq_len]
        ids[i, : len(row)] = row
        labels[i, len(prompt) : len(row)] = row[len(prompt) :]
        mask[i, : len(row)] = 1
        lengths[i] = len(row)
    return ids, labels, mask, lengths


@dataclass
class UnpairedSequences(Sequences):
    """KTO's rows (one padded sequence each, loss on the completion), their desirable flags, and once grouped
    (`group`) the KL row of each: its prompt with the previous completion of its microbatch."""

    prompts: list = field(default_factory=list)
    """Each row's prompt ids."""
    completions: list = field(default_factory=list)
    """Each row's completion ids."""
    desirable: np.ndarray | None = None
    """[rows] bool: TRL's `label`."""
    chunk: int = 1
    """Rows per microbatch whose KL rows were built together (`BatchIterator` keeps them together)."""
    kl: Sequences | None = None
    """The KL rows (`group`), row i mismatched with row i's prompt."""
    ref_logps: np.ndarray | None = None
    """[rows] float64 log π_ref of each row, once the trainer has computed them."""
    ref_kl_logps: np.ndarray | None = None
    """[rows] float64 log π_ref of each KL row."""
    held_out: bool = False
    """Evaluation rows held out of the training data (data.eval_holdout)."""

    def group(self, rows: int) -> None:
        """Build the KL rows for microbatches of `rows` rows: within each run of `rows` consecutive rows, row i's
        prompt with row i − 1's completion (the first with the last), as TRL's batched map does; rows past the
        last whole group are never batched (their KL rows are their own prompt and completion, unused)."""
        self.chunk = max(1, rows)
        seq_len = self.ids.shape[1]
        pairs = []
        for start in range(0, len(self.prompts), self.chunk):
            group = list(range(start, min(start + self.chunk, len(self.prompts))))
            for k, i in enumerate(group):
                pairs.append((self.prompts[i], self.completions[group[k - 1]]))
        ids, labels, mask, lengths = _padded(pairs, seq_len, self.pad_id)
        self.kl = Sequences(ids, mask=mask, labels=labels, lengths=lengths, pad_id=self.pad_id)
        self.ref_logps = self.ref_kl_logps = None

    def batch(self, rows: np.ndarray) -> dict:
        out = super().batch(rows)
        out["desirable"] = torch.from_numpy(self.desirable[rows])
        if self.kl is not None:
            kl = self.kl.batch(rows)
            out.update({f"kl_{k}": v for k, v in kl.items()})
        if self.ref_logps is not None:
            out["ref_logps"] = torch.from_numpy(self.ref_logps[rows])
            out["ref_kl_logps"] = torch.from_numpy(self.ref_kl_logps[rows])
        return out


def _label(row: dict, cfg: DataSection) -> bool:
    value = row.get(cfg.label_field)
    if not isinstance(value, bool):
        raise formats.FormatError(
            f"{cfg.label_field!r} must be true or false (desirable or not), got {formats.short(value)}; name the "
            f"column with data.label_field"
        )
    return value


def encode_unpaired(tokenizer, template, keys, row: dict, cfg: DataSection) -> tuple[list, list, bool]:
    """(prompt ids, completion ids, desirable) of one row, tokenized as TRL 1.16's KTOTrainer; FormatError if
    malformed."""
    prompt, completion = row.get(cfg.prompt_field), row.get(cfg.completion_field)
    formats.check_size("unpaired_preference", {cfg.prompt_field: prompt, cfg.completion_field: completion})
    label = _label(row, cfg)
    if completion is None or (isinstance(completion, str) and not completion.strip()):
        raise formats.FormatError(f"{cfg.completion_field!r} is missing or empty: a KTO row judges a completion")
    if isinstance(completion, str):  # standard
        if not isinstance(prompt, str):
            raise formats.FormatError(
                f"{cfg.prompt_field!r} must be a string when {cfg.completion_field!r} is, got {formats.short(prompt)}"
            )
        text = formats.with_eos(tokenizer, completion) if cfg.add_eos else completion
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        whole = list(tokenizer(prompt + text)["input_ids"])
    else:  # conversational: the prompt's turns with the generation prompt, then the whole conversation
        prompt = turns_of(prompt, cfg.prompt_field)
        messages, _ = chat_rows.normalize(
            prompt + turns_of(completion, cfg.completion_field), keys, "the chat template"
        )
        formats.check_messages(messages)
        if not any(m["role"] == "assistant" for m in messages[len(prompt) :]):
            raise formats.FormatError(f"{cfg.completion_field!r} has no assistant turn, so no token would carry loss")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        prompt_ids = chat_ids(tokenizer, template, messages[: len(prompt)], generation_prompt=True)
        whole = chat_ids(tokenizer, template, messages)
    n = formats.common_prefix_length(prompt_ids, whole)
    return prompt_ids[:n], whole[n:], label


def _read(docs, cfg: DataSection, tokenizer, vocab_size: int, locate, every: int, stats: SplitStats):
    """(train rows, held-out rows, invalid reasons) of one split; a row is (prompt ids, completion ids, label)."""
    template, _ = formats.chat_template_of(tokenizer)
    keys = chat_rows.template_keys(template)
    train, held, bad = [], [], []
    for index, raw in enumerate(docs):
        row, reason = record_of(raw)
        if row is None and not reason:
            continue
        stats.rows += 1
        place = raw.get(WHERE) or locate(index)
        try:
            if reason:
                raise formats.FormatError(reason)
            encoded = encode_unpaired(tokenizer, template, keys, row, cfg)
        except formats.FormatError as e:
            bad.append(f"{place}: {e}")
            continue
        if max(encoded[0] + encoded[1]) >= vocab_size:
            raise DataError(
                f"tokenizer.resize_vocab: {place} has a token id >= the model's vocab size {vocab_size}; set "
                f"tokenizer.resize_vocab: true or use the model's own tokenizer"
            )
        if len(encoded[0]) >= cfg.seq_len:  # TRL drops it: no completion token would be left
            stats.dropped += 1
            stats.dropped_need = max(stats.dropped_need, len(encoded[0]) + 1)
            continue
        if len(encoded[0]) + len(encoded[1]) > cfg.seq_len:
            stats.truncated += 1
            stats.cut_tokens += len(encoded[0]) + len(encoded[1]) - cfg.seq_len
        text = f"{row.get(cfg.prompt_field)}\x00{row.get(cfg.completion_field)}"
        (held if is_heldout(text, every) else train).append(encoded)
    stats.bad, stats.bad_examples = len(bad), bad[:BAD_ROWS_LISTED]
    return train, held, bad


def to_sequences(rows: list, seq_len: int, pad_id: int) -> UnpairedSequences:
    """The padded rows of (prompt ids, completion ids, label) triples."""
    ids, labels, mask, lengths = _padded([(p, c) for p, c, _ in rows], seq_len, pad_id)
    return UnpairedSequences(
        ids,
        mask=mask,
        labels=labels,
        lengths=lengths,
        pad_id=pad_id,
        prompts=[p for p, _, _ in rows],
        completions=[c for _, c, _ in rows],
        desirable=np.asarray([d for _, _, d in rows], dtype=bool),
    )


def prepare_unpaired(cfg: DataSection, tokenizer, vocab_size: int, every: int, test: str | None = None):
    """(train UnpairedSequences, eval UnpairedSequences, pad id, {"train", "eval"} -> SplitStats), as
    `preference.prepare_pairs` for pairs."""
    if cfg.streaming:
        raise DataError("data.streaming: unpaired preference rows are read whole; set data.streaming: false")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    source = f"data.files {cfg.files}" if cfg.files else f"dataset {cfg.hub_id}"
    paths = nonempty_paths(cfg.files) if not cfg.hub_id else []
    builder = builder_for(paths, cfg) if paths else "auto"
    docs = load_documents(paths or None, cfg.hub_id, cfg.hub_split, builder, False, cfg.hub_name, cfg.hub_revision)
    locate = RowLocator(paths, builder, source) if paths else (lambda i: f"{source}, row {i + 1}")
    stats = {"train": SplitStats(source), "eval": SplitStats(f"{source} (held out: 1 row in {every})")}
    train, held, bad = _read(docs, cfg, tokenizer, vocab_size, locate, every, stats["train"])
    if test or cfg.eval_files:
        if test:
            eval_docs = load_documents(None, cfg.hub_id, test, "auto", False, cfg.hub_name, cfg.hub_revision)
            stats["eval"] = SplitStats(f"dataset {cfg.hub_id} split {test!r}")
            where = lambda i: f"{stats['eval'].source}, row {i + 1}"  # noqa: E731
        else:
            eval_paths = nonempty_paths(cfg.eval_files, "data.eval_files")
            eval_builder = builder_for(eval_paths, cfg)
            eval_docs = load_documents(eval_paths, None, "train", eval_builder, False, None, None)
            stats["eval"] = SplitStats(f"data.eval_files {cfg.eval_files}")
            where = RowLocator(eval_paths, eval_builder, "data.eval_files")
        held, _, eval_bad = _read(eval_docs, cfg, tokenizer, vocab_size, where, 0, stats["eval"])
        bad = bad + eval_bad
    if bad and not cfg.skip_invalid:
        more = f"{len(bad)} invalid rows; the first: " if len(bad) > 1 else ""
        raise DataError(f"data.files: {more}{bad[0]}. Fix the rows, or set data.skip_invalid: true to skip them")
    if bad:
        warn("%s: skipped %d invalid unpaired row(s) (data.skip_invalid); the first: %s", source, len(bad), bad[0])
    dropped = stats["train"].dropped + stats["eval"].dropped
    if dropped:
        warn("%s: dropped %d row(s) whose prompt fills data.seq_len=%d (as TRL)", source, dropped, cfg.seq_len)
    if not train:
        raise DataError(f"{source}: no unpaired row fits (invalid or longer than data.seq_len={cfg.seq_len})")
    out = []
    for name, rows in (("train", train), ("eval", held)):
        seqs = to_sequences(rows, cfg.seq_len, pad_id)
        seqs.held_out = name == "eval" and not (test or cfg.eval_files) and every > 0
        _count(stats[name], seqs)
        out.append(seqs)
    return out[0], out[1], pad_id, stats


def _count(s: SplitStats, seqs: UnpairedSequences) -> None:
    """Rows kept (`--check`'s numbers and the data/ metrics)."""
    rows = len(seqs.prompts)
    s.documents = s.sequences = rows
    s.tokens = int(seqs.lengths.sum())
    s.longest = int(seqs.lengths.max()) if rows else 0
    s.padding = 1.0 - s.tokens / max(seqs.ids.size, 1)
    s.loss_tokens = int(seqs.target_counts().sum()) if rows else 0


def give_back(
    train: UnpairedSequences, held: UnpairedSequences, stats: dict
) -> tuple[UnpairedSequences, UnpairedSequences]:
    """(training rows with the held-out ones appended, no held-out row): held-out rows that evaluation would not
    use train instead (`preference.give_back` for pairs); `stats` counted again."""
    rows = [
        (p, c, bool(d))
        for seqs in (train, held)
        for p, c, d in zip(seqs.prompts, seqs.completions, seqs.desirable, strict=True)
    ]
    seq_len = train.ids.shape[1]
    joined, empty = to_sequences(rows, seq_len, train.pad_id), to_sequences([], seq_len, held.pad_id)
    empty.held_out = True
    for key in ("truncated", "cut_tokens", "dropped"):
        setattr(stats["train"], key, getattr(stats["train"], key) + getattr(stats["eval"], key))
        setattr(stats["eval"], key, 0)
    _count(stats["train"], joined)
    _count(stats["eval"], empty)
    return joined, empty
