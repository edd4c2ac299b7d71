"""Training data, once per run: read, tokenize and pack the recipe's data (`prepare_data` -> `PreparedData`),
then slice it per replica (`PreparedData.iterators`).

Label convention (HF): a batch carries `input_ids` and `labels` equal to `input_ids` (with -100 on
padding). `PipelineModel` shifts them (`vocab.labels.shift_labels`: position t is scored against
`labels[:, t+1]`, the last position against nothing), exactly as `AutoModelForCausalLM(input_ids,
labels=input_ids)` does, so exported models reproduce the training/eval loss.

The steps live in their own modules: `sources.py` (files and builders), `read.py` (rows as written),
`formats.py` (which sample format, a row's ids and loss mask), `tokenize.py` (the `datasets.map` step, cached
under a key of our own so `--check` and every rank of the launch reuse one result), `pack.py` (sequences),
`batches.py` (iterators). Every row that does not fit its format is collected with its file and 1-based line:
the run stops naming the first and how many (`--check` lists the first 20), or skips them all with
`data.skip_invalid`.

With document boundaries (the default for chat and prompt_completion, `data.document_boundaries`) packed rows
also carry `position_ids` that restart at 0 for every document: the model builds its attention mask from them
(HF's packed-sequence convention), so no token attends across documents.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..recipe.schema import DataSection
from . import unpaired
from .batches import BatchIterator, EvalBatches, Sequences, StreamingBatchIterator, pack_stream
from .formats import document_boundaries, sample_format, with_data_fields
from .pack import encoded, quiet, to_sequences, warn
from .preference import PairEvalBatches, PairSequences, give_back, prepare_pairs
from .read import DataError, RowLocator, load_rows
from .sources import builder_for, data_columns, eval_split, load_documents, nonempty_paths
from .stats import BAD_ROWS_LISTED, SplitStats, arrow_column, count_split
from .tokenize import RowTokenizer, tokenize_rows, without
from .unpaired import UnpairedSequences, prepare_unpaired


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


@dataclass
class PreparedData:
    """The data of a run, read, tokenized and packed once (`prepare_data`); `iterators` slices it per replica."""

    cfg: DataSection
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
    returned: int = 0
    """Pairs held out by data.eval_holdout that fill no global batch, given back to training (`check_sizes`)."""

    def check_sizes(self, global_batch: int, eval_batches: int | None) -> None:
        """The errors `iterators` would raise, before anything else is built: fewer sequences than one global
        batch, no evaluation sequence while evaluation is on. Pairs held out of the training data that fill no
        global batch (evaluation could not use them) are given back to training first."""
        held = self.eval
        if isinstance(held, (PairSequences, UnpairedSequences)) and held.held_out and 0 < len(held) < global_batch:
            self.returned = len(held)
            back = unpaired.give_back if isinstance(held, UnpairedSequences) else give_back
            self.train, self.eval = back(self.train, held, self.stats)
        if self.train is not None and len(self.train) < global_batch:
            raise DataError(
                f"train.global_batch: the training data has {len(self.train)} sequences, fewer than "
                f"train.global_batch={global_batch}; add data or lower data.seq_len / train.global_batch"
            )
        if eval_batches != 0 and self.eval is not None and len(self.eval) == 0 and not self.eval_off():
            raise DataError(no_eval_message(self.cfg))
        if eval_batches != 0 and self.pairs_short(global_batch) and not self.eval.held_out:
            raise DataError(pairs_short_message(len(self.eval), global_batch, self.unit))

    @property
    def unit(self) -> str:
        """What train.global_batch counts for a preference format: pairs (DPO and co.) or rows (KTO)."""
        return "row" if self.fmt == "unpaired_preference" else "pair"

    def group_rows(self, rows: int) -> None:
        """KTO: build each split's KL rows for microbatches of `rows` rows (`UnpairedSequences.group`)."""
        for seqs in (self.train, self.eval):
            if isinstance(seqs, UnpairedSequences):
                seqs.group(rows)

    def pairs_short(self, global_batch: int) -> bool:
        """Whether the evaluation preference pairs fill no global batch (evaluation counts whole batches of
        pairs): an error for an explicit source, evaluation off (warned) for pairs held out of the training
        data."""
        return isinstance(self.eval, (PairSequences, UnpairedSequences)) and len(self.eval) < global_batch

    def eval_off(self) -> bool:
        """True when `data.eval_holdout` could hold out no evaluation sequence from data too small for one:
        evaluation is then off (with a warning), not an error on clean data. An explicit source (eval_files) or
        `eval_holdout: 0` with evaluation on stays an error."""
        return self.eval is not None and len(self.eval) == 0 and holdout_every(self.cfg) > 0

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
        if isinstance(seqs, (PairSequences, UnpairedSequences)):  # DPO, KTO: whole batches
            if self.pairs_short(global_batch):
                if not seqs.held_out:
                    raise DataError(pairs_short_message(len(seqs), global_batch, self.unit))
                if self.returned:
                    warn(pairs_returned(self.returned, global_batch, self.unit))
                else:
                    warn(pairs_eval_off(len(seqs), global_batch, self.unit))
                return train, PairEvalBatches(seqs, global_batch, dp_rank, dp_size, limit=0)
            return train, PairEvalBatches(seqs, global_batch, dp_rank, dp_size, limit=eval_batches)
        if len(seqs) == 0 and not self.eval_off():
            raise DataError(no_eval_message(cfg))
        if len(seqs) == 0:
            warn(EVAL_OFF, cfg.eval_holdout)
        return train, EvalBatches(seqs, global_batch, dp_rank, dp_size, limit=eval_batches if len(seqs) else 0)


EVAL_OFF = (
    "data.eval_holdout: %g of the rows packs into no evaluation sequence, even with up to half of them held out: "
    "evaluation is off for this run (set data.eval_files, or eval.batches: 0 to say so)"
)
"""The warning when the data is too small to hold out an evaluation sequence."""


def pairs_eval_off(pairs: int, global_batch: int, unit: str = "pair") -> str:
    """The warning when the pairs (KTO: rows) held out of the training data fill no global batch."""
    return (
        f"data.eval_holdout: the {pairs} held-out preference {unit}{'' if pairs == 1 else 's'} fill no global "
        f"batch of {global_batch} {unit}s: evaluation is off for this run (set data.eval_files, raise "
        f"data.eval_holdout, or set eval.batches: 0 to say so)"
    )


def pairs_returned(pairs: int, global_batch: int, unit: str = "pair") -> str:
    """The warning when the pairs (KTO: rows) held out of the training data fill no global batch and train
    instead."""
    return (
        f"data.eval_holdout: the {pairs} held-out preference {unit}{'' if pairs == 1 else 's'} fill no global "
        f"batch of {global_batch} {unit}s, so {'it trains' if pairs == 1 else 'they train'} instead (none is held out) and "
        f"evaluation is off for this run (set data.eval_files, raise data.eval_holdout, or set eval.batches: 0 "
        f"to say so)"
    )


def pairs_short_message(pairs: int, global_batch: int, unit: str = "pair") -> str:
    return (
        f"train.global_batch: the evaluation data has {pairs} preference {unit}{'' if pairs == 1 else 's'}, "
        f"fewer than one global batch ({global_batch}); add {unit}s (data.eval_files) or set eval.batches: 0"
    )


STREAM_EVAL_BATCHES = 4
"""Evaluation batches read from a stream's held-out documents when eval.batches is null (a stream has no end
to evaluate up to)."""


def no_eval_message(cfg: DataSection) -> str:
    if cfg.eval_files:
        return (
            f"data.eval_files: {cfg.eval_files} gave no evaluation sequence (no valid row, or every one "
            f"dropped); fix those files, or set eval.batches: 0 for no evaluation"
        )
    return (
        f"data.eval_holdout: {cfg.eval_holdout} of the training rows held out no sequence for evaluation; set "
        f"data.eval_files, raise data.eval_holdout, or set eval.batches: 0 for no evaluation"
    )


def holdout_every(cfg: DataSection) -> int:
    """Hold out 1 row in this many for evaluation (0: none, data.eval_files or eval_holdout 0)."""
    return 0 if cfg.eval_files or cfg.eval_holdout == 0 else max(2, round(1 / cfg.eval_holdout))


def prepare_data(cfg: DataSection, tokenizer, vocab_size: int, cache: bool = True, style: str = "dpo") -> PreparedData:
    """Read, tokenize and pack the recipe's data once (every rank the same; the tokenized rows are cached);
    `style`: how pairs are tokenized, "dpo" or "cpo" (`preference.pair_style` of the recipe's losses).

    Raises DataError naming the key, file and row and the fix: invalid rows (`BadRowsError`, unless
    data.skip_invalid), every conversation dropped by data.seq_len, too little data for one sequence.
    """
    test = eval_split(cfg.hub_id, cfg.hub_split, cfg.hub_name, cfg.hub_revision) if cfg.hub_id else None
    if test and not cfg.eval_files and not cfg.streaming:  # the dataset's own evaluation split, no hold-out
        cfg = dataclasses.replace(cfg, eval_holdout=0)
    else:
        test = None
    every = holdout_every(cfg)
    if cfg.format == "preference":  # pairs, not packed rows (data/preference.py)
        train, eval_seqs, pad_id, stats = prepare_pairs(cfg, tokenizer, vocab_size, every, test, style)
        return PreparedData(cfg, "preference", "set by data.format", train, eval_seqs, stats, None, pad_id)
    if cfg.format == "unpaired_preference":  # KTO's rows and their KL rows (data/unpaired.py)
        train, eval_seqs, pad_id, stats = prepare_unpaired(cfg, tokenizer, vocab_size, every, test)
        return PreparedData(cfg, "unpaired_preference", "set by data.format", train, eval_seqs, stats, None, pad_id)
    source = f"data.files {cfg.files}" if cfg.files else f"dataset {cfg.hub_id}"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    paths = nonempty_paths(cfg.files) if not cfg.hub_id else []
    builder = builder_for(paths, cfg) if paths else "auto"
    docs = load_documents(
        paths or None, cfg.hub_id, cfg.hub_split, builder, cfg.streaming, cfg.hub_name, cfg.hub_revision
    )
    columns = data_columns(docs, paths, builder)
    cfg = with_data_fields(cfg, columns)  # ShareGPT's `conversations` column
    fmt, how = sample_format(cfg, columns, where=paths[0] if paths else source)
    boundaries = document_boundaries(cfg, fmt)

    if cfg.streaming:
        if fmt != "text" or boundaries:
            raise DataError(
                f"data.streaming: streams are packed without document boundaries and support "
                f"data.format: text only (this data is {fmt}); set data.streaming: false"
            )
        tok_fn = RowTokenizer(
            tokenizer, cfg, vocab_size, source, every, fmt, RowLocator(paths, builder, source) if paths else None
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
    eval_key = "data.eval_files"
    if cfg.eval_files:
        eval_tok, eval_stats, eval_bad = _eval_rows(cfg, tokenizer, vocab_size, fmt, cache)
    elif test:
        eval_key = f"dataset {cfg.hub_id} split {test!r}"
        eval_docs = load_documents(None, cfg.hub_id, test, "auto", False, cfg.hub_name, cfg.hub_revision)
        eval_tok, eval_stats, eval_bad = tokenize_rows(
            eval_docs, cfg, tokenizer, vocab_size, fmt, eval_key, [], "auto", 0, cache
        )
    _stop_or_skip(cfg, [(source, train_stats, bad), (eval_key, eval_stats, eval_bad)])
    tokenized = without(tokenized, bad)
    if train_stats.rows == train_stats.bad:
        raise DataError(f"{source}: no valid row (all {train_stats.rows} skipped as invalid, data.skip_invalid)")
    flags = np.asarray(arrow_column(tokenized, "heldout").to_numpy(zero_copy_only=False), dtype=bool)
    if every:
        flags = _hold_out_enough(tokenized, flags, cfg, pad_id, fmt, source)
    train_part = tokenized.select(np.flatnonzero(~flags))
    count_split(train_stats, train_part)
    train = to_sequences(encoded(train_part), cfg, pad_id, source, fmt, stats=train_stats)
    if eval_tok is not None:
        eval_part = without(eval_tok, eval_bad)
    else:
        eval_part, eval_stats = (
            tokenized.select(np.flatnonzero(flags)),
            SplitStats(f"{source} (held out: 1 row in {every})" if every else source),
        )
    count_split(eval_stats, eval_part)
    eval_seqs = to_sequences(
        encoded(eval_part), cfg, pad_id, eval_stats.source, fmt, allow_empty=True, stats=eval_stats
    )
    for stats in (train_stats, eval_stats):
        if stats.empty_turns:  # trained as they are (an empty answer is a valid row), said with their lines
            warn("%s", empty_turns_line(stats))
        if stats.dropped_keys:  # said once, at the start (and listed by --check)
            warn(
                "%s: message keys the chat template does not read were dropped: %s",
                stats.source,
                ", ".join(f"{k} ({n} rows)" for k, n in sorted(stats.dropped_keys.items())),
            )
    return PreparedData(cfg, fmt, how, train, eval_seqs, {"train": train_stats, "eval": eval_stats}, None, pad_id)


def empty_turns_line(stats: SplitStats) -> str:
    """The warning for chat rows with an empty assistant turn, naming the first ones' lines."""
    more = "" if stats.empty_turns <= len(stats.empty_turn_examples) else ", ..."
    return (
        f"{stats.source}: {stats.empty_turns} conversation(s) have an assistant turn with empty content, which "
        f"trains the model to answer nothing: {'; '.join(stats.empty_turn_examples)}{more}; fill or drop those turns"
    )


def _hold_out_enough(tokenized, flags: np.ndarray, cfg: DataSection, pad_id: int, fmt: str, source: str):
    """The held-out rows, grown so that they pack into at least one evaluation sequence when the data allows:
    `eval_holdout` of a small file (or a few short text rows under classic packing) can make none. The last
    training rows of the file are added, 1, 2, 4, ... of them, up to half the rows; if even that makes no
    sequence, none are added and evaluation is turned off later (a warning, not an error: the data is fine)."""

    def sequences(chosen: np.ndarray) -> int:
        try:  # a trial packing: its warnings would repeat what the real one says
            with quiet():
                part = encoded(tokenized.select(np.flatnonzero(chosen)))
                return len(to_sequences(part, cfg, pad_id, source, fmt, allow_empty=True))
        except DataError:  # every held-out conversation dropped by data.seq_len
            return 0

    if sequences(flags):
        return flags
    rows = np.flatnonzero(~flags)
    k = 1
    while k <= len(rows) // 2:
        trial = flags.copy()
        trial[rows[-k:]] = True
        if sequences(trial):
            warn(
                "data.eval_holdout: %g of %s held out %d row(s), no whole evaluation sequence; holding out the "
                "last %d training row(s) too, so evaluation has a batch (data.eval_files sets its own)",
                cfg.eval_holdout,
                source,
                int(flags.sum()),
                k,
            )
            return trial
        k *= 2
    return flags


def _stream_row_ok(example, skip: bool) -> bool:
    if not example["invalid"]:
        return True
    if skip:
        return False
    raise DataError(f"data.files: {example['invalid']}. Fix the row, or set data.skip_invalid: true to skip such rows")


def _stop_or_skip(cfg: DataSection, splits) -> None:
    """Invalid rows stop the run (one BadRowsError over every split) unless data.skip_invalid skips them."""
    examples, count, key = [], 0, None
    for source, stats, bad in splits:
        if stats is None or not stats.bad:
            continue
        key = key or ("data.files" if source.startswith("data.files") else source.split(" ")[0])
        examples += stats.bad_examples
        count += stats.bad
        if cfg.skip_invalid:
            warn(
                "%s: skipped %d invalid row(s) (data.skip_invalid); the first: %s",
                source,
                stats.bad,
                stats.bad_examples[0],
            )
    if count and not cfg.skip_invalid:
        raise BadRowsError(key, examples[:BAD_ROWS_LISTED], count)


def _eval_rows(cfg: DataSection, tokenizer, vocab_size: int, fmt: str, cache: bool):
    paths = nonempty_paths(cfg.eval_files, "data.eval_files")
    builder = builder_for(paths, cfg)
    docs = load_rows(paths, builder)
    return tokenize_rows(
        docs, cfg, tokenizer, vocab_size, fmt, f"data.eval_files {cfg.eval_files}", paths, builder, 0, cache
    )


def _eval_split(cfg: DataSection, tokenizer, vocab_size: int, pad_id: int, fmt: str, cache: bool):
    tokenized, stats, bad = _eval_rows(cfg, tokenizer, vocab_size, fmt, cache)
    _stop_or_skip(cfg, [("data.eval_files", stats, bad)])
    part = without(tokenized, bad)
    count_split(stats, part)
    return to_sequences(encoded(part), cfg, pad_id, stats.source, fmt, allow_empty=True, stats=stats), stats


def build_data(
    cfg: DataSection,
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
