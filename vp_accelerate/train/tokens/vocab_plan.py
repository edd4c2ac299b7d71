"""The vocabulary decision of a run: how many embedding / lm_head rows, and where each comes from.

Decided once from the recipe, the model's config and the tokenizers, the same way by `--check` and by
every training rank, and printed with its reason:

- a randomly initialised model (a preset, `pretrained_weights: false`) gets the tokenizer's size
  (rounded up to `tokenizer.pad_to_multiple_of`) with `resize_vocab`, nothing to lose;
- pretrained weights with the model's own tokenizer (or `remap: by_id`) keep every row: a vocabulary
  larger than the tokenizer (Qwen's 151,936 rows for 151,665 tokens, a model padded to a multiple of 64)
  stays as it is unless `tokenizer.allow_shrink: true`; a larger tokenizer grows it (new rows = mean);
- pretrained weights with another tokenizer (`remap: auto` when the model's own tokenizer differs, or
  `by_token`) are swapped by token string (`token_map.py`): copied / composed / mean rows.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from huggingface_hub import try_to_load_from_cache

from vp_accelerate.models.row_map import RowMap

from ..data.chat_template import data_format, prepare_chat
from ..recipe.convert import RecipeError
from ..recipe.model_check import hub_offline, missing_hub_source, valid_repo_id
from ..recipe.presets import PRESETS, padded_vocab, uses_pretrained_weights
from .token_map import build_row_map, same_vocabulary
from .tokenizer import QWEN_VARIANTS, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def model_tokenizer_source(model_source: str) -> str | None:
    """The model's own tokenizer: its local dir when that holds tokenizer files, its hub id; None for a preset."""
    if model_source in PRESETS:
        return None
    path = os.path.expanduser(model_source)
    if os.path.isdir(path):
        return path if has_tokenizer(path) else None
    return model_source  # a hub id: its repo has the tokenizer


def tokenizer_source(recipe) -> str:
    """What `tokenizer.source` resolves to: the recipe's, or by default the model's own tokenizer."""
    if recipe.tokenizer.source is not None:
        return recipe.tokenizer.source
    own = model_tokenizer_source(recipe.model.source)
    if own is None:
        where = (
            "is a preset (a config, no tokenizer)"
            if recipe.model.source in PRESETS
            else "has no tokenizer files (tokenizer.json / tokenizer_config.json)"
        )
        raise RecipeError(
            f"tokenizer.source: not set, and model.source {recipe.model.source!r} {where}; name a "
            f"tokenizer, e.g. tokenizer.source: bpe:outputs/demo_tokenizer"
        )
    return own


def open_tokenizer(recipe, source: str, *, fetch: bool):
    """The tokenizer `source` names (`bpe:<dir>`, a local dir, a Qwen variant, a hub id), the one opener of
    `--check`, `plan`, `dryrun` and the trainer. `fetch`: convert a Qwen variant and get a hub id that is not
    cached (the trainer, one process first; `--check`); else None where that would be needed (a launched rank's
    preflight, `plan`: rank 0 does it at the start). RecipeError naming the key and the fix otherwise."""
    if source in QWEN_VARIANTS:
        path = os.path.join(recipe.tokenizer.cache_dir, source)
        if not fetch and not os.path.isfile(os.path.join(path, "tokenizer.json")):
            return None  # converted on the first run (one rank first); the data check catches bad ids
    elif not os.path.isdir(os.path.expanduser(source[4:] if source.startswith("bpe:") else source)):
        if source.startswith("bpe:"):
            if not fetch:
                return None
        else:
            key = "tokenizer.source" if recipe.tokenizer.source is not None else "model.source"
            if not valid_repo_id(source):
                raise RecipeError(f"{key}: {source!r} is neither a local directory nor a hub id")
            cached = isinstance(try_to_load_from_cache(source, "tokenizer_config.json"), str)
            if not cached and hub_offline():
                raise missing_hub_source(key, source)
            if not cached and not fetch:
                return None  # rank 0 downloads it at the start; a launched rank does not ask the hub
    try:
        return load_tokenizer(source, recipe.tokenizer.cache_dir, recipe.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise RecipeError(f"tokenizer.source: cannot load the tokenizer {source!r}: {str(e).splitlines()[0]}") from None


def model_tokenizer_of(recipe, tokenizer, source: str, load, model_dir: str | None = None):
    """The model's own tokenizer when the run starts from the model's weights (what a swap is decided against and
    composes rows from), else None; preflight and the trainer both ask here. `tokenizer`: the run's, read from
    `source`; `model_dir`: the model's files on disk (a hub id's snapshot), else `model.source` is asked;
    `load(own)`: reads the model's tokenizer where it is another one (None: it cannot be read now)."""
    if not uses_pretrained_weights(recipe.model):
        return None
    own = model_tokenizer_source(model_dir or recipe.model.source)
    if own is None:
        return None
    same = os.path.abspath(os.path.expanduser(own)) == os.path.abspath(os.path.expanduser(source))
    return tokenizer if same else load(own)


@dataclass
class VocabPlan:
    """Rows of the vocabulary matrices before and after, and why."""

    tokenizer_size: int
    """len(tokenizer): token ids are < this."""
    rows_before: int
    """The model's vocab_size (the checkpoint's rows, or the config's for a fresh init)."""
    rows_after: int
    """The vocab_size the run trains with."""
    mode: str
    """fresh / keep / grow / shrink / swap / remap (swap within the model's row count)."""
    reason: str
    """Why, in words, with the key that changes it."""
    row_map: object = None
    """`models.RowMap` (pretrained weights only): where each new row comes from."""
    chat: object = None
    """The chat template decision (`chat_template.ChatSetup`), made before this one: it may add tokens."""

    @property
    def padding(self) -> int:
        """Rows past the tokenizer (no token maps to them)."""
        return self.rows_after - self.tokenizer_size

    def counts(self) -> dict[str, int] | None:
        return self.row_map.counts() if self.row_map is not None else None

    def lines(self) -> list[str]:
        out = [
            f"vocabulary: tokenizer {self.tokenizer_size:,} tokens, rows {self.rows_before:,} -> "
            f"{self.rows_after:,} ({self.padding:,} rows past the tokenizer) [{self.mode}]: {self.reason}"
        ]
        counts = self.counts()
        if counts is not None and self.mode in ("swap", "remap", "grow", "shrink"):
            out.append(
                "vocabulary rows: {copied:,} copied, {composed:,} composed of old pieces, {mean:,} from the "
                "mean of the old rows".format(**counts)
            )
        chat = self.chat.line() if self.chat is not None else None
        return out + ([chat] if chat else [])


def is_swap(recipe, tokenizer, model_tokenizer, pretrained: bool = True) -> bool:
    """Whether the run swaps the model's tokenizer for another, rebuilding rows by token string."""
    t = recipe.tokenizer
    if not pretrained:
        return False
    if t.remap == "by_token":
        if model_tokenizer is None:
            raise RecipeError(
                f"tokenizer.remap: by_token needs the model's own tokenizer, and model.source "
                f"{recipe.model.source!r} has none; use tokenizer.remap: by_id if the ids mean the "
                f"same tokens"
            )
        return True
    return t.remap == "auto" and model_tokenizer is not None and not same_vocabulary(model_tokenizer, tokenizer)


def prepare_tokenizers(recipe, tokenizer, model_tokenizer, pretrained: bool):
    """The chat template decision (`chat_template.ChatSetup`) for the run, applied to the tokenizers: call it
    before `plan_vocab`, which then counts the tokens it added."""
    swap = is_swap(recipe, tokenizer, model_tokenizer, pretrained)
    try:
        return prepare_chat(tokenizer, model_tokenizer, data_format(recipe.data) == "chat", swap)
    except ValueError as e:
        raise RecipeError(str(e)) from None


def plan_vocab(
    recipe, rows_before: int, tokenizer, pretrained: bool, model_tokenizer=None, build_map: bool = True, chat=None
) -> VocabPlan:
    """Decide the run's vocabulary. `model_tokenizer`: the model's own tokenizer when known (for swaps);
    `chat`: the chat template decision (`prepare_tokenizers`), reported with it.

    build_map=False leaves a swap's `row_map` None (the decision and row counts do not need it).
    """
    plan = _plan(recipe, rows_before, tokenizer, pretrained, model_tokenizer, build_map)
    plan.chat = chat
    return plan


def _plan(recipe, rows_before: int, tokenizer, pretrained: bool, model_tokenizer, build_map: bool) -> VocabPlan:
    t = recipe.tokenizer
    n = len(tokenizer)
    padded = padded_vocab(n, t.pad_to_multiple_of)
    if not pretrained:
        if t.resize_vocab:
            return VocabPlan(
                n,
                rows_before,
                padded,
                "fresh",
                f"random init: rows sized to the tokenizer (tokenizer.pad_to_multiple_of={t.pad_to_multiple_of})",
            )
        if n > rows_before:
            raise _too_small(n, rows_before)
        return VocabPlan(
            n, rows_before, rows_before, "fresh", "random init, tokenizer.resize_vocab: false keeps the config's rows"
        )
    if is_swap(recipe, tokenizer, model_tokenizer):
        if t.resize_vocab:
            rows, mode = padded, "swap"
            why = (
                f"a different tokenizer than the model's: rows rebuilt by token string "
                f"(tokenizer.pad_to_multiple_of={t.pad_to_multiple_of})"
            )
        else:
            if n > rows_before:
                raise _too_small(n, rows_before)
            rows, mode = rows_before, "remap"
            why = "a different tokenizer than the model's: rows rebuilt by token string in the model's row count"
        row_map = build_row_map(model_tokenizer, tokenizer, rows, rows_before) if build_map else None
        return VocabPlan(n, rows_before, rows, mode, why, row_map)
    if t.remap == "by_id" and t.source is not None:
        by = "tokenizer.remap: by_id keeps rows by id"
    elif model_tokenizer is not None or t.source is None:
        by = "the model's own tokenizer"
    else:
        by = "model.source has no tokenizer to compare with, so rows are kept by id"
    if padded > rows_before:
        if not t.resize_vocab:
            raise _too_small(n, rows_before)
        return VocabPlan(
            n,
            rows_before,
            padded,
            "grow",
            f"{by}: the tokenizer has more tokens than the model has rows; new rows start from the mean",
            RowMap.identity(padded, rows_before),
        )
    if padded < rows_before and t.allow_shrink:
        return VocabPlan(
            n,
            rows_before,
            padded,
            "shrink",
            f"{by}; tokenizer.allow_shrink: true drops the rows past the tokenizer",
            RowMap.identity(padded, rows_before),
        )
    why = f"{by}; every row is kept" + (
        " (rows past the tokenizer stay; tokenizer.allow_shrink: true drops them)" if padded < rows_before else ""
    )
    return VocabPlan(n, rows_before, rows_before, "keep", why, None)


def _too_small(n: int, rows: int) -> RecipeError:
    return RecipeError(
        f"tokenizer.resize_vocab: the tokenizer has {n} tokens but the model's vocabulary has {rows} "
        f"rows, so ids >= {rows} have no embedding; set tokenizer.resize_vocab: true or use the "
        f"model's own tokenizer"
    )


def trainable_token_rows(recipe, tokenizer, chat, rows: int):
    """(the recipe with adapter.trainable_tokens settled, a note for `--check` and the log, or None).

    Under LoRA the vocabulary is frozen, so the special tokens this run adds to the tokenizer (ChatML's, for a
    base without a chat template) would keep their initial rows and the model would never learn to end its
    turn: their ids join adapter.trainable_tokens (adapter.train_new_tokens). adapter.train_vocab trains every
    row instead, saved whole as peft's modules_to_save: the note says so. Ids past the vocabulary are a RecipeError."""
    a = recipe.adapter
    if not a.enabled:
        return recipe, None
    if a.train_vocab:
        return recipe, (
            "adapter.train_vocab: every vocabulary row trains; adapter/ holds the embedding and output layer "
            "whole, as peft's modules_to_save (for a few rows, e.g. added special tokens, adapter.trainable_tokens "
            "keeps the adapter small)"
        )
    added = [] if chat is None else list(chat.added)
    ids = list(a.trainable_tokens)
    if added and a.train_new_tokens:
        ids += [i for i in tokenizer.convert_tokens_to_ids(added) if i not in ids]
    bad = [i for i in ids if i >= rows]
    if bad:
        raise RecipeError(f"adapter.trainable_tokens: ids {bad} are past the vocabulary of {rows} rows")
    recipe = dataclasses.replace(recipe, adapter=dataclasses.replace(a, trainable_tokens=ids))
    if added and not a.train_new_tokens:
        return recipe, (
            f"warning: {', '.join(added)} were added to the tokenizer but their rows stay frozen under LoRA "
            f"(adapter.train_new_tokens: false): the model cannot learn to end its turn with them"
        )
    if not ids:
        return recipe, None
    names = tokenizer.convert_ids_to_tokens(ids)
    return recipe, (
        f"LoRA also trains the embedding and output rows of {len(ids)} tokens ({', '.join(map(str, names))}; "
        f"adapter.trainable_tokens{' + the added special tokens' if added and a.train_new_tokens else ''}), "
        f"each in its rank's vocabulary shard, saved in adapter/ as peft's trainable_token_indices"
    )
