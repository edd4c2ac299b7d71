"""Which chat template a run trains with, and the special tokens that template needs.

Decided once, before the vocabulary (the tokens it adds need rows), the same way by `--check` and by every
training rank:

- the tokenizer has a chat template: it is used as it is;
- a tokenizer swap whose new tokenizer has none keeps the model's own template (the model learned its
  format); the markers it writes as special tokens (`<|im_start|>`, `<|eot_id|>`, ...) that the new
  tokenizer lacks are added to it, and the swap copies their rows from the model's;
- chat data and no template at all: ChatML, with `<|im_start|>` and `<|im_end|>` added as special tokens,
  so each marker is one token the model learns (not a run of BPE pieces) and generation can stop on
  `<|im_end|>`. Their rows are new rows: random for a fresh model, the mean of the old rows for pretrained
  weights, built by each rank for its own shard like any resized vocabulary.

The template is set on the tokenizer, so the data is rendered with it and every checkpoint and export saves
it (`chat_template.jinja`): `apply_chat_template` works on the exported model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tokenizers import AddedToken

from vp_accelerate.models.generation import chat_template_text, end_of_turn_id

from ..recipe.model_check import hub_offline
from .formats import CHATML_TEMPLATE, SAMPLE_FORMATS, sample_format
from .preference import conversational
from .read import first_record_columns
from .sources import builder_for, expand_files, load_documents

CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")


@dataclass
class ChatSetup:
    """The chat template decision of a run (`line()` is what `--check` and the log print)."""

    kind: str
    """own (the tokenizer's), model (kept from the model's tokenizer across a swap), chatml (the fallback),
    or none (no template: the data is not chat)."""
    added: list[str] = field(default_factory=list)
    """Special tokens added to the tokenizer for the template, in id order."""
    why: str = ""
    """The reason, in words (for a swap that could not keep the model's template: why not)."""
    end_of_turn: str | None = None
    """The token that closes an assistant turn (generation stops there), when the template has one."""

    def line(self) -> str | None:
        if self.kind == "none":
            return f"chat template: none ({self.why})" if self.why else None
        what = {
            "own": "the tokenizer's own",
            "model": "the model's own, kept across the tokenizer swap",
            "chatml": "ChatML",
        }[self.kind]
        out = f"chat template: {what}" + (f" ({self.why})" if self.why else "")
        if self.added:
            out += f"; {', '.join(self.added)} added as special tokens ({len(self.added)} new vocabulary rows"
            out += ", copied from the model's rows)" if self.kind == "model" else ")"
        if self.end_of_turn:
            out += f"; generation stops at {self.end_of_turn}"
        return out + "; saved with the tokenizer"


def data_format(d) -> str:
    """The run's sample format (text / chat / prompt_completion): declared, else from the first record's columns
    (a hub dataset's first streamed row; "text" when the hub cannot be reached, so declare `data.format: chat`
    for a hub chat set checked offline)."""
    if d.format in SAMPLE_FORMATS:
        return d.format
    if d.format in (
        "preference",
        "unpaired_preference",
    ):  # conversational pairs / rows (lists of turns) are rendered with the chat template
        return "chat" if conversational(d) else "prompt_completion"
    try:
        if d.hub_id:
            try:
                # offline, a hub dataset is read from the datasets cache (memory-mapped), not streamed
                first = next(
                    iter(
                        load_documents(
                            None,
                            d.hub_id,
                            d.hub_split,
                            streaming=not hub_offline(),
                            name=d.hub_name,
                            revision=d.hub_revision,
                        )
                    ),
                    None,
                )
            except Exception:  # the hub out of reach (--check offline): set data.format to decide without it
                return "text"
            columns = sorted(first) if first else []
        else:
            paths = [p for p in expand_files(d.files or []) if os.path.getsize(p) > 0]
            columns = first_record_columns(paths[0], builder_for(paths, d)) if paths else []
        return sample_format(d, columns or [])[0]
    except (OSError, ValueError):  # missing or unreadable data, no format's columns: the data check names it
        return "text"


def _add_tokens(tokenizer, tokens) -> None:
    """Add AddedTokens to `tokenizer`, special ones as special tokens (kept beside the existing ones)."""
    special = [AddedToken(t.content, special=True, normalized=False) for t in tokens if t.special]
    plain = [AddedToken(t.content, special=False, normalized=False) for t in tokens if not t.special]
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special}, replace_extra_special_tokens=False)
    if plain:
        tokenizer.add_tokens(plain)


def _missing(tokenizer, tokens) -> list:
    vocab = tokenizer.get_vocab()
    return [t for t in tokens if t.content not in vocab]


def _markers_of(model_tokenizer, template: str) -> list:
    """The model tokenizer's added tokens that the template writes literally, in id order."""
    added = getattr(model_tokenizer, "added_tokens_decoder", None) or {}
    return [t for _, t in sorted(added.items()) if t.content and t.content in template]


def _renders(tokenizer, template: str) -> str | None:
    """None when `template` renders a conversation with `tokenizer`, else the error."""
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            chat_template=template,
            tokenize=False,
        )
        return None
    except Exception as e:  # jinja errors, raise_exception() of the template
        return f"{type(e).__name__}: {e}"


def _finish(tokenizer, setup: ChatSetup) -> ChatSetup:
    eot = end_of_turn_id(tokenizer)
    setup.end_of_turn = tokenizer.convert_ids_to_tokens(eot) if eot is not None else None
    return setup


def prepare_chat(tokenizer, model_tokenizer=None, chat_data: bool = False, swap: bool = False) -> ChatSetup:
    """Settle the chat template of a run on `tokenizer` (set as its chat_template; tokens added as needed).

    `model_tokenizer`: the model's own tokenizer (None for a fresh model or a source without one); `swap`:
    the run swaps it for `tokenizer`. When tokens are added without a swap, the model's tokenizer gets them
    too, so the vocabulary decision keeps rows by id and the new tokens get new rows.
    """
    if chat_template_text(tokenizer):
        replaced = (
            swap
            and model_tokenizer is not None
            and chat_template_text(model_tokenizer)
            and chat_template_text(model_tokenizer) != chat_template_text(tokenizer)
        )
        why = "the new tokenizer's template replaces the model's" if replaced else ""
        return _finish(tokenizer, ChatSetup("own", why=why)) if chat_data or swap else ChatSetup("none")
    why_not = ""
    if swap:
        theirs = chat_template_text(model_tokenizer) if model_tokenizer is not None else None
        if theirs is None:
            why_not = "neither the new tokenizer nor the model's has a chat template"
        elif (error := _renders(model_tokenizer, theirs)) is not None:
            why_not = f"the new tokenizer has none, and the model's does not render: {error}"
        else:
            missing = _missing(tokenizer, _markers_of(model_tokenizer, theirs))
            _add_tokens(tokenizer, missing)
            tokenizer.chat_template = theirs
            if (error := _renders(tokenizer, theirs)) is not None:
                raise ValueError(
                    f"tokenizer.source: the model's chat template, kept across the swap, does not "
                    f"render with the new tokenizer ({error}); give the new tokenizer a chat "
                    f"template of its own"
                )
            return _finish(tokenizer, ChatSetup("model", [t.content for t in missing], "the new tokenizer has none"))
    if not chat_data:
        return ChatSetup("none", why=f"{why_not}; the data is not chat" if why_not else "")
    markers = [AddedToken(m, special=True, normalized=False) for m in CHATML_MARKERS]
    missing = _missing(tokenizer, markers)
    _add_tokens(tokenizer, missing)
    if not swap and model_tokenizer is not None and model_tokenizer is not tokenizer:
        _add_tokens(model_tokenizer, _missing(model_tokenizer, missing))  # same vocabulary: same new ids
    tokenizer.chat_template = CHATML_TEMPLATE
    why = why_not or "the tokenizer has none"
    if markers and not missing:
        why += f"; {' and '.join(CHATML_MARKERS)} are already tokens of it"
    return _finish(tokenizer, ChatSetup("chatml", [t.content for t in missing], why))
