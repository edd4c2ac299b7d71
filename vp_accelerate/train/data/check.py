"""`--check`'s data report: every row of every file tokenized with the run's tokenizer and template, packed as the
run will pack it (the same cached result the launch then reads), and what that found.

    data.files [...]: 3,800 rows, 3,800 valid; 512,334 tokens, the longest row 611
    data.seq_len 256: 12 rows truncated (6,120 tokens cut), 3 dropped (every loss token past data.seq_len; keeping
        them needs data.seq_len >= 301); 2,113 packed sequences, 21.4% padding, 81,233 tokens carry loss
    train.global_batch 16: 132 steps per epoch; train.steps 120 = 0.91 epochs
    evaluation: data.eval_files [...]: 200 rows, 111 sequences, 7 batches per evaluation (eval.batches: all)

`show_example` prints one packed row with the tokens that carry loss marked (as axolotl's preprocess debug
does), its documents apart.
"""

from __future__ import annotations

import os

from ..recipe import Recipe, finish_steps
from ..recipe.schema import DataSection
from .formats import sample_format
from .preference import pair_style
from .prepare import (
    EVAL_OFF,
    PreparedData,
    empty_turns_line,
    holdout_every,
    no_eval_message,
    pairs_eval_off,
    pairs_returned,
    prepare_data,
)
from .read import DataError, first_record_columns
from .sources import builder_for, expand_files
from .stats import SplitStats


def _rows_line(s: SplitStats, held_out: int) -> str:
    skipped = f" ({s.bad:,} invalid, skipped: data.skip_invalid)" if s.bad else ""
    held = f", {held_out:,} held out for evaluation" if held_out else ""
    return (
        f"{s.source}: {s.rows:,} rows{skipped}, {s.documents:,} for training{held}; {s.tokens:,} tokens, the "
        f"longest row {s.longest:,}"
    )


def _rows(n: int) -> str:
    return f"{n:,} row{'' if n == 1 else 's'}"


def _packing_line(s: SplitStats, seq_len: int) -> str:
    parts = []
    if s.truncated:
        parts.append(f"{_rows(s.truncated)} truncated ({s.cut_tokens:,} tokens cut)")
    elif s.cut_tokens:
        parts.append(f"{s.cut_tokens:,} tokens of the incomplete last sequence left out")
    if s.dropped:
        parts.append(
            f"{s.dropped:,} dropped (every loss token past data.seq_len; keeping them needs data.seq_len >= "
            f"{s.dropped_need:,})"
        )
    parts.append(
        f"{s.sequences:,} packed sequences, {s.padding * 100:.1f}% padding, {s.loss_tokens:,} tokens carry loss"
    )
    return f"data.seq_len {seq_len}: " + "; ".join(parts)


def _pairs(n: int, unit: str = "pair") -> str:
    return f"{n:,} {unit}{'' if n == 1 else 's'}"


def _pair_lines(s: SplitStats, held_out: int, seq_len: int, unit: str = "pair") -> list[str]:
    """What reading preference pairs (KTO: labelled rows, `unit` "row") found, in the unit train.global_batch
    counts."""
    skipped = f" ({s.bad:,} invalid, skipped: data.skip_invalid)" if s.bad else ""
    held = f", {held_out:,} held out for evaluation" if held_out else ""
    lines = [
        f"{s.source}: {_rows(s.rows)}{skipped}, {_pairs(s.documents, unit)} for training{held}; {s.tokens:,} "
        f"tokens, the longest row {s.longest:,}"
    ]
    parts = []
    if s.truncated:
        parts.append(f"{_pairs(s.truncated, unit)} cut to it (keep_start, as TRL; {s.cut_tokens:,} tokens cut)")
    if s.dropped:
        parts.append(
            f"{_pairs(s.dropped, unit)} dropped (the prompt fills data.seq_len; keeping them needs data.seq_len >= "
            f"{s.dropped_need:,})"
        )
    per = "2 a pair" if unit == "pair" else "1 a row, not packed"
    parts.append(
        f"{s.sequences:,} sequences ({per}), {s.padding * 100:.1f}% padding, {s.loss_tokens:,} tokens carry loss"
    )
    lines.append(f"data.seq_len {seq_len}: " + "; ".join(parts))
    if s.same:
        more = f" (and {s.same - len(s.same_examples):,} more)" if s.same > len(s.same_examples) else ""
        lines.append(
            f"warning: {_pairs(s.same)} with chosen == rejected (no preference, so no gradient): "
            f"{'; '.join(s.same_examples)}{more}"
        )
    return lines


def _empty_turns_line(s: SplitStats) -> str | None:
    return empty_turns_line(s) if s.empty_turns else None


def _keys_line(s: SplitStats) -> str | None:
    if not s.dropped_keys:
        return None
    keys = ", ".join(f"{k} ({_rows(n)})" for k, n in sorted(s.dropped_keys.items()))
    return (
        f"{s.source}: message keys the chat template does not read, dropped from those rows: {keys}; a template "
        f"that renders them (tokenizer.chat_template) would keep them"
    )


def steps_per_epoch(prepared: PreparedData, global_batch: int) -> int:
    """Optimizer steps of one pass over the training sequences (the incomplete last global batch is dropped)."""
    prepared.check_sizes(global_batch, 0)
    return len(prepared.train) // global_batch


def data_report(recipe: Recipe, tokenizer, vocab_size: int) -> tuple[list[str], PreparedData, Recipe]:
    """(report lines, the prepared data, the recipe with the run's length settled) for `--check`. Raises DataError (BadRowsError lists the invalid rows)
    for what would stop the run: invalid rows, every conversation dropped, too few sequences for one step, no
    evaluation sequence when evaluation is on."""
    d, t, e = recipe.data, recipe.train, recipe.eval
    prepared = prepare_data(d, tokenizer, vocab_size, style=pair_style(recipe.preference.loss_type))
    prepared.check_sizes(t.global_batch, e.batches)
    lines = []
    if prepared.train is None:
        lines.append(
            f"data.streaming: the training stream is read as the run goes ({prepared.fmt}); its rows are checked then"
        )
    else:
        s = prepared.stats["train"]
        held = prepared.stats["eval"].documents if holdout_every(prepared.cfg) else 0
        if prepared.fmt in ("preference", "unpaired_preference"):  # whole pairs / rows, never packed
            lines += _pair_lines(s, held, d.seq_len, "pair" if prepared.fmt == "preference" else "row")
        else:
            lines += [_rows_line(s, held), _packing_line(s, d.seq_len)]
        if (keys := _keys_line(s)) is not None:
            lines.append(keys)
        if (empty := _empty_turns_line(s)) is not None:
            lines.append(empty)
        per_epoch = steps_per_epoch(prepared, t.global_batch)
        if t.epochs is not None:
            recipe = finish_steps(recipe, per_epoch)
            t = recipe.train
            lines.append(
                f"train.global_batch {t.global_batch}: {per_epoch:,} steps per epoch; train.epochs "
                f"{t.epochs:g} = {t.steps:,} steps"
                + (
                    f", lr.warmup_ratio {recipe.lr.warmup_ratio:g} = {recipe.lr.warmup_steps:,} warm-up steps"
                    if recipe.lr.warmup_ratio is not None
                    else ""
                )
            )
        else:
            lines.append(
                f"train.global_batch {t.global_batch}: {per_epoch:,} steps per epoch; train.steps {t.steps:,} "
                f"= {t.steps / per_epoch:.2f} epochs"
            )
    if e.batches == 0:
        lines.append("evaluation off (eval.batches: 0)")
        return lines, prepared, recipe
    ev = prepared.eval
    if ev is None:
        lines.append("evaluation: held-out documents of the stream, read at the start of the run")
        return lines, prepared, recipe
    if prepared.returned:  # held-out pairs that fill no global batch train instead
        lines.append(pairs_returned(prepared.returned, t.global_batch, prepared.unit))
        return lines, prepared, recipe
    if len(ev) == 0 and prepared.eval_off():
        lines.append(EVAL_OFF % d.eval_holdout)
        return lines, prepared, recipe
    if len(ev) == 0:
        raise DataError(no_eval_message(d))
    s = prepared.stats["eval"]
    if prepared.fmt == "preference":  # whole global batches of pairs, as the run's PairEvalBatches
        if prepared.pairs_short(t.global_batch):  # an explicit source was refused by check_sizes
            lines.append(pairs_eval_off(len(ev), t.global_batch))
            return lines, prepared, recipe
        batches = len(ev) // t.global_batch
        used = batches if e.batches is None else min(batches, e.batches)
        which = "eval.batches: all" if e.batches is None else f"eval.batches: {e.batches}"
        lines.append(
            f"evaluation: {s.source}: {_pairs(len(ev))} ({s.loss_tokens:,} tokens carry loss), {used:,} "
            f"batch{'' if used == 1 else 'es'} of train.global_batch ({t.global_batch} pairs) per evaluation ({which})"
        )
        if s.truncated or s.dropped or s.same:
            lines += ["evaluation " + line for line in _pair_lines(s, 0, d.seq_len)[1:]]
        return lines, prepared, recipe
    if prepared.pairs_short(t.global_batch):  # KTO's rows: whole global batches, as the run's
        lines.append(pairs_eval_off(len(ev), t.global_batch, "row"))
        return lines, prepared, recipe
    whole = prepared.fmt == "unpaired_preference"
    batches = len(ev) // t.global_batch if whole else -(-len(ev) // t.global_batch)
    used = batches if e.batches is None else min(batches, e.batches)
    which = "eval.batches: all" if e.batches is None else f"eval.batches: {e.batches}"
    lines.append(
        f"evaluation: {s.source}: {s.documents:,} rows, {len(ev):,} sequences ({s.loss_tokens:,} tokens carry "
        f"loss), {used:,} batches of train.global_batch per evaluation ({which})"
    )
    if s.dropped or s.truncated:
        lines += (
            ["evaluation " + line for line in _pair_lines(s, 0, d.seq_len, "row")[1:]]
            if whole
            else ["evaluation " + _packing_line(s, d.seq_len)]
        )
    return lines, prepared, recipe


def bad_rows_text(err) -> str:
    """The full list of a BadRowsError, for `--check`."""
    lines = [f"data error: {err.count:,} invalid row{'s' if err.count != 1 else ''} in {err.key}:"]
    lines += [f"  {x}" for x in err.examples]
    if err.count > len(err.examples):
        lines.append(f"  ... and {err.count - len(err.examples):,} more")
    lines.append("Fix the rows, or set data.skip_invalid: true to skip such rows (they are counted).")
    return "\n".join(lines)


def show_example(prepared: PreparedData, tokenizer, color: bool = False, row: int = 0) -> str:
    """One packed training row as text, its documents apart, the tokens that carry loss marked: between
    [[ and ]] (or green with `color`). A token carries loss when it is a target (its label is not -100)."""
    seqs = prepared.train
    if seqs is None or not len(seqs):
        return "no packed training sequence to show (data.streaming reads the data as the run goes)"
    ids = seqs.ids[row]
    labels = seqs.labels[row] if seqs.labels is not None else ids
    mask = seqs.mask[row] if seqs.mask is not None else None
    starts = [0] if seqs.positions is None else [i for i, p in enumerate(seqs.positions[row]) if p == 0]
    first = set(starts)
    real = int(seqs.lengths[row]) if seqs.lengths is not None else len(ids)
    on, off = ("\x1b[42m", "\x1b[0m") if color else ("[[", "]]")
    targets = [int(lab != -100 and t not in first and (mask is None or mask[t])) for t, lab in enumerate(labels)]
    out = [
        f"example: packed training sequence {row} of {len(seqs):,} ({len(ids)} tokens, {sum(targets)} carry loss, "
        f"{len(ids) - real} padding); {on}...{off} = the tokens that carry loss"
    ]
    bounds = [s for s in starts if s < real] + [real]
    what = {"chat": "conversation", "prompt_completion": "row"}.get(prepared.fmt, "document")
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if seqs.positions is not None:
            out.append(f"--- {what} {k + 1}: tokens {a}-{b - 1} ---")
        text, t = [], a
        while t < b:  # runs of tokens with the same flag, decoded together (multi-byte characters stay whole)
            e = t
            while e < b and targets[e] == targets[t]:
                e += 1
            piece = tokenizer.decode([int(i) for i in ids[t:e]])
            text.append(f"{on}{piece}{off}" if targets[t] else piece)
            t = e
        out.append("".join(text))
    if real < len(ids):
        out.append(f"--- padding: tokens {real}-{len(ids) - 1} (token {int(ids[-1])}, no loss) ---")
    return "\n".join(out)


def data_metrics(prepared: PreparedData, global_batch: int) -> dict:
    """What the run trains and evaluates on, as the data/ metrics logged once at its start."""
    out = {}
    for split, s in prepared.stats.items():
        out.update(
            {
                f"data/{split}_rows": s.rows or s.documents,
                f"data/{split}_invalid_rows": s.bad,
                f"data/{split}_tokens": s.tokens,
                f"data/{split}_sequences": s.sequences,
                f"data/{split}_padding_fraction": s.padding,
                f"data/{split}_loss_tokens": s.loss_tokens,
                f"data/{split}_truncated_rows": s.truncated,
                f"data/{split}_dropped_rows": s.dropped,
            }
        )
    if prepared.train is not None:
        out["data/steps_per_epoch"] = len(prepared.train) // global_batch
    return out


def check_columns(cfg: DataSection) -> None:
    """Every local training / eval file of text format has `text_field` in its first record; else a DataError
    naming the columns found (checked before launch, not after)."""
    for key, patterns in (("data.files", cfg.files), ("data.eval_files", cfg.eval_files)):
        if not patterns:
            continue
        paths = [p for p in expand_files(patterns) if os.path.getsize(p) > 0]
        if not paths:
            continue
        builder = builder_for(paths, cfg)
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
