"""Preference pairs (`data.format: preference`): rows of `prompt` / `chosen` / `rejected` in TRL's shapes, as
two padded sequences each, kept together.

TRL's shapes: standard (`prompt`, `chosen`, `rejected` strings: the completion follows the prompt, EOS after
it with data.add_eos) and conversational (`prompt` a list of turns, `chosen` / `rejected` lists holding the
assistant's turn(s), rendered with the chat template as chat rows are); without a `prompt` column, `chosen`
and `rejected` are whole conversations sharing their first turns (TRL's implicit prompt: loss on the last
assistant turn). Each row is tokenized as TRL's DPOTrainer does it: prompt + completion as one text with the
tokenizer's special tokens (a BOS where its settings add one; conversations carry their template's), the
completion starting where the prompt tokenized alone stops matching either row; only the completion's tokens
carry loss. A row longer than data.seq_len is cut to it (TRL's truncation_mode keep_start, counted and warned);
a pair whose prompt alone fills data.seq_len is dropped (counted and warned: no completion token is left).
Pairs whose chosen equals rejected are warned with their rows (their loss has no gradient).

`PairSequences` holds row 2k = pair k's chosen, row 2k + 1 its rejected; its length and its batches count
pairs (train.global_batch is pairs per step, as TRL's batch sizes), and a batch carries each row's reference
log-probability (`ref_logps`, set by the trainer before training: runtime/preference.py uses them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vp_accelerate.runtime.preference_config import LOSSES, loss_types, needs_reference

from ..recipe.schema import DataSection
from . import chat_rows, formats
from .batches import ReplicaShare, Sequences
from .pack import warn
from .read import RAW, WHERE, DataError, RowLocator
from .sources import builder_for, load_documents, nonempty_paths
from .stats import BAD_ROWS_LISTED, SplitStats
from .tokenize import is_heldout, json_record


@dataclass
class PairSequences(Sequences):
    """Sequences of preference pairs: rows 2k (chosen) and 2k + 1 (rejected); indexed by pair."""

    ref_logps: np.ndarray | None = None
    """[2 x pairs] float64 log π_ref of each row, once the trainer has computed (or loaded) them."""
    held_out: bool = False
    """Evaluation pairs held out of the training data (data.eval_holdout), not an evaluation source of their own."""
    starts: np.ndarray | None = None
    """[2 x pairs] each row's first completion position, when the chosen rows' labels cover the prompt too
    (`pair_style` "orpo"); the batch's `completion_start`."""

    def __len__(self) -> int:
        return len(self.ids) // 2

    @staticmethod
    def _rows(pairs) -> np.ndarray:
        pairs = np.asarray(pairs, dtype=np.int64)
        return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)

    def real_tokens(self, rows: np.ndarray | None = None) -> int:
        return super().real_tokens(None if rows is None else self._rows(rows))

    def batch(self, rows: np.ndarray) -> dict:
        out = super().batch(self._rows(rows))
        if self.ref_logps is not None:
            out["ref_logps"] = torch.from_numpy(self.ref_logps[self._rows(rows)])
        if self.starts is not None:
            out["completion_start"] = torch.from_numpy(self.starts[self._rows(rows)])
        return out


def conversational(cfg: DataSection) -> bool:
    """Whether the data's first pair is conversational (lists of turns; it then needs the chat template)."""
    try:
        if cfg.hub_id:
            docs = load_documents(None, cfg.hub_id, cfg.hub_split, "auto", True, cfg.hub_name, cfg.hub_revision)
        else:
            paths = nonempty_paths(cfg.files)
            docs = load_documents(paths[:1], None, "train", builder_for(paths, cfg), True, None, None)
        first = record_of(next(iter(docs), None) or {})[0] or {}
    except Exception:  # unreadable or out of reach: the data check names it; strings need no template
        return False
    columns = (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field)
    if cfg.format == "unpaired_preference":
        columns = (cfg.prompt_field, cfg.completion_field)
    return any(isinstance(first.get(f), list) for f in columns)


def turns_of(value, name: str) -> list:
    """`value` as a non-empty list of turns (a conversational field), or a FormatError naming `name`."""
    if not isinstance(value, list) or not value:
        raise formats.FormatError(f"{name!r} must be a non-empty list of turns, got {formats.short(value)}")
    return value


def chat_ids(tokenizer, template, messages: list, generation_prompt: bool = False) -> list[int]:
    """A conversation's ids as TRL tokenizes it: apply_chat_template(tokenize=True), whose special tokens are the
    template's own (it adds none)."""
    out = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
    )
    return list(out["input_ids"])


def _joint(prompt_ids: list, chosen_ids: list, rejected_ids: list) -> tuple[list, list, list, list]:
    """TRL's DPOTrainer split: each whole row tokenized at once; the completions start where the prompt tokenized
    alone stops matching either row (a prompt ending in a space gives it to the completion's first token)."""
    n = min(
        formats.common_prefix_length(prompt_ids, chosen_ids), formats.common_prefix_length(prompt_ids, rejected_ids)
    )
    out = []
    for ids in (chosen_ids, rejected_ids):
        out += [ids, [0] * n + [1] * (len(ids) - n)]
    return tuple(out)


def pair_style(loss_type) -> str:
    """How pairs are tokenized: "orpo" for ORPO without a loss needing the reference (ORPOTrainer's rows, the
    chosen rows' prompt tokens labelled too: its NLL counts them), "cpo" when a loss's trainer tokenizes its own
    way (`LossKind.trainer`: CPOTrainer / ORPOTrainer's rows, `cpo_pair`), else "dpo" (DPOTrainer's)."""
    types = [t for t in loss_types(loss_type) if t in LOSSES]
    if "orpo" in types and not needs_reference(types):
        return "orpo"
    return "cpo" if any(LOSSES[t].trainer != "dpo" for t in types) else "dpo"


def _cpo_answer(tokenizer, prompt: str, answer: str) -> tuple[list, list]:
    """CPOTrainer.build_tokenized_answer: prompt + answer tokenized whole without special tokens, the answer
    starting where the prompt alone (without special tokens) ends, one token earlier when the prompt's last
    token merged into the answer's first (each row on its own: chosen and rejected may split differently)."""
    full = list(tokenizer(prompt + answer, add_special_tokens=False)["input_ids"])
    alone = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if len(alone) > len(full):
        raise formats.FormatError("the prompt alone tokenizes longer than prompt + completion (CPOTrainer rejects it)")
    start = len(alone) - (alone != full[: len(alone)])
    return full[:start], full[start:]


def cpo_pair(tokenizer, prompt: str, chosen: str, rejected: str, add_eos: bool) -> tuple[list, list, list, list]:
    """A pair tokenized as TRL 1.16's CPOTrainer / ORPOTrainer `tokenize_row` (text already rendered): each row
    split by `_cpo_answer`, the tokenizer's BOS put before the prompt unless it is there (whenever the tokenizer
    has one, whatever its settings), the EOS id after each completion unless it ends with it (`add_eos`)."""
    out = []
    splits = [_cpo_answer(tokenizer, prompt, c) for c in (chosen, rejected)]
    if sum(a != b for a, b in zip(splits[0][0], splits[1][0])) > 1 or abs(len(splits[0][0]) - len(splits[1][0])) > 1:
        raise formats.FormatError("chosen and rejected split the prompt differently (CPOTrainer rejects the row)")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for head, answer in splits:
        if bos is not None and (not head or head[0] != bos):
            head = [bos] + head
        if add_eos and eos is not None and (not answer or answer[-1] != eos):
            answer = answer + [eos]
        out += [head + answer, [0] * len(head) + [1] * len(answer)]
    return tuple(out)


def _rendered(tokenizer, template, prompt: list, completions: list) -> tuple[str, list[str]]:
    """(prompt text, completion texts) of conversational rows as TRL's `maybe_apply_chat_template` renders them for
    CPOTrainer: the prompt with the generation prompt (or continuing a final assistant turn), cut to the common
    prefix of the whole renderings; each completion the rest of its rendering."""
    last = prompt[-1]["role"] if prompt else "user"
    text = tokenizer.apply_chat_template(
        prompt,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=last != "assistant",
        continue_final_message=last == "assistant",
    )
    whole = [tokenizer.apply_chat_template(prompt + c, chat_template=template, tokenize=False) for c in completions]
    for w in whole:
        n = 0
        while n < min(len(text), len(w)) and text[n] == w[n]:
            n += 1
        text = text[:n]
    return text, [w[len(text) :] for w in whole]


def encode_pair(
    tokenizer, template, keys, row: dict, cfg: DataSection, style: str = "dpo"
) -> tuple[list, list, list, list]:
    """(chosen ids, chosen loss mask, rejected ids, rejected loss mask) of one row, tokenized as TRL's DPOTrainer
    (the tokenizer's special tokens for strings, the template's for turns), or as CPOTrainer / ORPOTrainer with
    `style` "cpo" (`cpo_pair`: turns rendered to text first); FormatError if malformed."""
    prompt = row.get(cfg.prompt_field)
    chosen, rejected = row.get(cfg.chosen_field), row.get(cfg.rejected_field)
    formats.check_size("preference", {cfg.prompt_field: prompt, cfg.chosen_field: chosen, cfg.rejected_field: rejected})
    for name, value in ((cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
        if value is None:
            raise formats.FormatError(f"a preference row needs {cfg.chosen_field!r} and {cfg.rejected_field!r}")
        if isinstance(value, str) and not value.strip():
            raise formats.FormatError(f"{name!r} is empty: a pair compares two completions; fill it or drop the row")
    if isinstance(chosen, str) or isinstance(rejected, str):  # standard: strings after a string prompt
        if not isinstance(prompt, str):
            raise formats.FormatError(
                f"{cfg.prompt_field!r} must be a string when {cfg.chosen_field!r} / {cfg.rejected_field!r} are "
                f"strings, got {formats.short(prompt)}"
            )
        for name, value in ((cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
            if not isinstance(value, str):
                raise formats.FormatError(f"{name!r} must be a string, got {formats.short(value)}")
        if style != "dpo":
            return cpo_pair(tokenizer, prompt, chosen, rejected, cfg.add_eos)
        ends = [formats.with_eos(tokenizer, c) if cfg.add_eos else c for c in (chosen, rejected)]
        rows = [tokenizer(prompt + c)["input_ids"] for c in ends]
        return _joint(list(tokenizer(prompt)["input_ids"]), list(rows[0]), list(rows[1]))
    # conversational: the prompt's turns, then each completion's; loss on the completion's tokens
    if prompt is None:  # implicit prompt: the turns the two conversations share
        chosen, rejected = turns_of(chosen, cfg.chosen_field), turns_of(rejected, cfg.rejected_field)
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    prompt = turns_of(prompt, cfg.prompt_field)
    rows, completions = [], []
    for name, completion in ((cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
        messages, _ = chat_rows.normalize(prompt + turns_of(completion, name), keys, "the chat template")
        formats.check_messages(messages)
        if not any(m["role"] == "assistant" for m in messages[len(prompt) :]):
            raise formats.FormatError(f"{name!r} has no assistant turn, so no token would carry loss")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        completions.append(messages[len(prompt) :])
        rows.append(chat_ids(tokenizer, template, messages))
    if style != "dpo":
        text, ends = _rendered(tokenizer, template, messages[: len(prompt)], completions)
        return cpo_pair(tokenizer, text, ends[0], ends[1], cfg.add_eos)
    prompt_ids = chat_ids(tokenizer, template, messages[: len(prompt)], generation_prompt=True)
    return _joint(prompt_ids, rows[0], rows[1])


def _pairs_to_sequences(pairs: list, seq_len: int, pad_id: int, style: str = "dpo") -> PairSequences:
    """Pairs as padded rows; `style` "orpo": the chosen rows' prompt tokens are labelled too (ORPOTrainer's NLL
    counts them) and `starts` says where each completion begins."""
    n = 2 * len(pairs)
    starts = np.zeros(n, dtype=np.int64) if style == "orpo" else None
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), -100, dtype=np.int64)
    mask = np.zeros((n, seq_len), dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for k, (c_ids, c_mask, r_ids, r_mask) in enumerate(pairs):
        for r, (row, m) in enumerate(((c_ids, c_mask), (r_ids, r_mask))):
            i = 2 * k + r
            ids[i, : len(row)] = row
            labels[i, : len(row)] = np.where(np.asarray(m, dtype=bool), row, -100)
            mask[i, : len(row)] = 1
            lengths[i] = len(row)
            if starts is not None:
                starts[i] = list(m).index(1)
                if r == 0:
                    labels[i, : len(row)] = row
    return PairSequences(ids, mask=mask, labels=labels, lengths=lengths, pad_id=pad_id, starts=starts)


def record_of(row: dict) -> tuple[dict | None, str]:
    """A row as its record: JSON read as written (`read.py`) is parsed here, other builders' rows are records."""
    if RAW in row:
        if not row[RAW].strip():
            return None, ""  # a blank line: no row
        return json_record(row[RAW])
    return row, ""


def _read_pairs(
    docs, cfg: DataSection, tokenizer, vocab_size: int, locate, every: int, stats: SplitStats, style: str = "dpo"
):
    """(train pairs, held-out pairs, invalid reasons) of one split, counted into `stats` (`locate`: row index
    -> its place, "FILE, line N"; `style`: `encode_pair`'s)."""
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
            pair = encode_pair(tokenizer, template, keys, row, cfg, style)
        except formats.FormatError as e:
            bad.append(f"{place}: {e}")
            continue
        if max(max(pair[0]), max(pair[2])) >= vocab_size:
            raise DataError(
                f"tokenizer.resize_vocab: {place} has a token id >= the model's vocab size {vocab_size}; set "
                f"tokenizer.resize_vocab: true or use the model's own tokenizer"
            )
        if row.get(cfg.chosen_field) == row.get(cfg.rejected_field):
            stats.same += 1
            if len(stats.same_examples) < BAD_ROWS_LISTED:
                stats.same_examples.append(place)
        longest = max(len(pair[0]), len(pair[2]))
        if longest > cfg.seq_len:
            if 1 not in pair[1][: cfg.seq_len] or 1 not in pair[3][: cfg.seq_len]:  # the prompt fills seq_len
                stats.dropped += 1
                stats.dropped_need = max(stats.dropped_need, pair[1].index(1) + 1, pair[3].index(1) + 1)
                continue
            stats.truncated += 1  # TRL's truncation_mode keep_start: each row cut to max_length
            stats.cut_tokens += max(len(pair[0]) - cfg.seq_len, 0) + max(len(pair[2]) - cfg.seq_len, 0)
            pair = tuple(part[: cfg.seq_len] for part in pair)
        text = f"{row.get(cfg.prompt_field)}\x00{row.get(cfg.chosen_field)}\x00{row.get(cfg.rejected_field)}"
        (held if is_heldout(text, every) else train).append(pair)
    stats.bad, stats.bad_examples = len(bad), bad[:BAD_ROWS_LISTED]
    return train, held, bad


def _count(stats: SplitStats, pairs: list, seqs: PairSequences) -> None:
    """Pairs kept and the sequences they became (`--check`'s numbers and the data/ metrics)."""
    stats.documents = len(pairs)
    stats.tokens = int(seqs.lengths.sum())
    stats.longest = int(seqs.lengths.max()) if len(pairs) else 0
    stats.sequences = len(seqs.ids)
    stats.padding = 1.0 - stats.tokens / max(seqs.ids.size, 1)
    stats.loss_tokens = int(seqs.target_counts().sum()) if len(pairs) else 0


def give_back(train: PairSequences, held: PairSequences, stats: dict) -> tuple[PairSequences, PairSequences]:
    """(training pairs with the held-out ones appended, no held-out pair): held-out pairs that evaluation
    would not use train instead; `stats` ("train" / "eval" SplitStats) counted again."""

    def join(a, b):
        return None if a is None else np.concatenate([a, b])

    seqs = PairSequences(
        np.concatenate([train.ids, held.ids]),
        mask=join(train.mask, held.mask),
        labels=join(train.labels, held.labels),
        lengths=join(train.lengths, held.lengths),
        pad_id=train.pad_id,
        starts=join(train.starts, held.starts),
    )
    empty = PairSequences(held.ids[:0], mask=held.mask[:0], labels=held.labels[:0], lengths=held.lengths[:0])
    empty.pad_id, empty.held_out = held.pad_id, True
    empty.starts = None if held.starts is None else held.starts[:0]
    for key in ("truncated", "cut_tokens", "dropped", "same"):
        setattr(stats["train"], key, getattr(stats["train"], key) + getattr(stats["eval"], key))
    _count(stats["train"], range(len(seqs)), seqs)
    _count(stats["eval"], [], empty)
    return seqs, empty


def prepare_pairs(
    cfg: DataSection, tokenizer, vocab_size: int, every: int, test: str | None = None, style: str = "dpo"
):
    """(train PairSequences, eval PairSequences, pad id, {"train", "eval"} -> SplitStats) of a preference data
    section (no cache: preference sets are small, and every rank reads them the same); `test`: the split of
    data.hub_id that holds the evaluation pairs (`sources.eval_split`), if any; `style`: "dpo" or "cpo"
    (`pair_style` of the recipe's losses)."""
    if cfg.streaming:
        raise DataError("data.streaming: preference pairs are read whole; set data.streaming: false")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    source = f"data.files {cfg.files}" if cfg.files else f"dataset {cfg.hub_id}"
    paths = nonempty_paths(cfg.files) if not cfg.hub_id else []
    builder = builder_for(paths, cfg) if paths else "auto"
    docs = load_documents(paths or None, cfg.hub_id, cfg.hub_split, builder, False, cfg.hub_name, cfg.hub_revision)
    locate = RowLocator(paths, builder, source) if paths else (lambda i: f"{source}, row {i + 1}")
    stats = {"train": SplitStats(source)}
    train, held, bad = _read_pairs(docs, cfg, tokenizer, vocab_size, locate, every, stats["train"], style)
    stats["eval"] = SplitStats(f"{source} (held out: 1 pair in {every})" if every else source)
    if test:
        eval_docs = load_documents(None, cfg.hub_id, test, "auto", False, cfg.hub_name, cfg.hub_revision)
        stats["eval"] = SplitStats(f"dataset {cfg.hub_id} split {test!r}")
        held, _, eval_bad = _read_pairs(
            eval_docs,
            cfg,
            tokenizer,
            vocab_size,
            lambda i: f"{stats['eval'].source}, row {i + 1}",
            0,
            stats["eval"],
            style,
        )
        bad = bad + eval_bad
    if cfg.eval_files:
        eval_paths = nonempty_paths(cfg.eval_files, "data.eval_files")
        eval_builder = builder_for(eval_paths, cfg)
        eval_docs = load_documents(eval_paths, None, "train", eval_builder, False, None, None)
        eval_locate = RowLocator(eval_paths, eval_builder, "data.eval_files")
        stats["eval"] = SplitStats(f"data.eval_files {cfg.eval_files}")
        held, _, eval_bad = _read_pairs(eval_docs, cfg, tokenizer, vocab_size, eval_locate, 0, stats["eval"], style)
        bad = bad + eval_bad
    if bad and not cfg.skip_invalid:
        more = f"{len(bad)} invalid rows; the first: " if len(bad) > 1 else ""
        raise DataError(f"data.files: {more}{bad[0]}. Fix the rows, or set data.skip_invalid: true to skip them")
    if bad:
        warn("%s: skipped %d invalid preference row(s) (data.skip_invalid); the first: %s", source, len(bad), bad[0])
    dropped = stats["train"].dropped + stats["eval"].dropped
    if dropped:
        need = max(stats["train"].dropped_need, stats["eval"].dropped_need)
        warn(
            "%s: dropped %d pair(s) whose prompt fills data.seq_len=%d, leaving no completion token (%d keeps them)",
            source,
            dropped,
            cfg.seq_len,
            need,
        )
    truncated = stats["train"].truncated + stats["eval"].truncated
    if truncated:
        warn(
            "%s: %d pair(s) longer than data.seq_len=%d cut to it (keep_start, as TRL)", source, truncated, cfg.seq_len
        )
    same = stats["train"].same + stats["eval"].same
    if same:
        first = (stats["train"].same_examples + stats["eval"].same_examples)[:3]
        warn("%s: %d pair(s) have chosen == rejected (no preference, no gradient): %s", source, same, "; ".join(first))
    if not train:
        raise DataError(f"{source}: no preference pair fits (invalid or longer than data.seq_len={cfg.seq_len})")
    out = []
    for name, pairs in (("train", train), ("eval", held)):
        seqs = _pairs_to_sequences(pairs, cfg.seq_len, pad_id, style)
        seqs.held_out = name == "eval" and every > 0
        _count(stats[name], pairs, seqs)
        out.append(seqs)
    return out[0], out[1], pad_id, stats


class PairEvalBatches:
    """One replica's evaluation batches of preference pairs: whole global batches only (a padding pair would
    add its log 2 to the mean), each with its pairs' reference log-probabilities; equal weights."""

    def __init__(self, seqs: PairSequences, global_batch: int, dp_rank: int = 0, dp_size: int = 1, limit=None):
        self.seqs, self.global_batch, self.share = seqs, global_batch, ReplicaShare(global_batch, dp_rank, dp_size)
        n = len(seqs) // global_batch
        self.count = n if limit is None else min(n, limit)
        self.loss_tokens = [global_batch] * self.count  # pairs: every batch weighs the same
        self.sequences = self.count * global_batch

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = self.share.start(i)
        return self.seqs.batch(np.arange(start, start + self.share.per_replica))

    def __iter__(self):
        return (self[i] for i in range(self.count))
