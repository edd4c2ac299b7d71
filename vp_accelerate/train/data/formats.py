"""Supervised fine-tuning formats: turn one data row into token ids and a per-token loss mask.

Three sample formats (`data.format`):
  text               a `text_field` column; every token carries loss (pre-training style).
  chat               a `messages` column: a list of {"role", "content"} turns rendered with the tokenizer's
                     chat template (or a ChatML default when it has none); loss on assistant turns only.
  prompt_completion  `prompt` and `completion` columns; loss on the completion (+ EOS) only.
Text and prompt/completion rows are tokenized as TRL's SFTTrainer does: the whole row at once with the
tokenizer's own special tokens (a BOS where its settings add one), EOS appended as text; the completion
starts where the prompt tokenized alone stops matching the row. Chat rows carry the special tokens their
template writes (TRL's apply_chat_template adds none of its own).
With `train_on_inputs: true` every token of a row carries loss instead.

Assistant spans are found by prefix rendering: the template renders the conversation up to turn i with
a generation prompt, then up to and including turn i; the characters between the two renderings are
the assistant's turn (its content and its end-of-turn marker). The whole conversation is tokenized once
and a token carries loss when its characters overlap such a span, so the ids are exactly what the
template + tokenizer produce. Templates that rewrite earlier turns (the prefix property fails) fall back
to `return_assistant_tokens_mask` when the template marks `{% generation %}` blocks.

The mask says which *tokens are targets*: under HF's label convention the token at t is predicted from
position t-1, so `labels = where(mask, ids, -100)`.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

from ..recipe.schema import DataSection
from . import long_text
from .read import DataError

SAMPLE_FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")

# ChatML (as used by Qwen and others), for tokenizers that ship no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class FormatError(ValueError):
    """One row does not fit its format; the caller adds the file and row."""


def detect_format(
    columns, declared: str, text_field: str, messages_field: str, prompt_field: str, completion_field: str
) -> tuple[str, str]:
    """(format, how it was decided) from the declared `data.format` and the data's columns."""
    cols = set(columns or ())
    if declared in SAMPLE_FORMATS:
        return declared, "set by data.format"
    if messages_field in cols:
        sharegpt = " (ShareGPT turns)" if messages_field == SHAREGPT_FIELD else ""
        return "chat", f"detected from column {messages_field!r}{sharegpt}"
    if SHAREGPT_FIELD in cols and messages_field == "messages":
        return "chat", f"detected from column {SHAREGPT_FIELD!r} (ShareGPT turns)"
    if prompt_field in cols and completion_field in cols:
        return "prompt_completion", f"detected from columns {prompt_field!r} and {completion_field!r}"
    if text_field in cols:
        return "text", f"detected from column {text_field!r}"
    raise FormatError(
        f"data.format: column {text_field!r} not in the data (columns: {sorted(cols)}), nor "
        f"{messages_field!r} (chat) or {prompt_field!r} + {completion_field!r} (prompt_completion); "
        f"set data.text_field, data.format or the data.*_field names"
    )


SHAREGPT_FIELD = "conversations"
"""ShareGPT's column of turns, read as chat when the data has no `messages` column."""


def with_data_fields(cfg: DataSection, columns) -> DataSection:
    """The data section with `messages_field` pointed at ShareGPT's `conversations` column when the data has it
    and no `messages` column (and the recipe kept the default name)."""
    cols = set(columns or ())
    if cfg.messages_field == "messages" and "messages" not in cols and SHAREGPT_FIELD in cols:
        return dataclasses.replace(cfg, messages_field=SHAREGPT_FIELD)
    return cfg


def chat_template_of(tokenizer) -> tuple[str, bool]:
    """(template, is_default): the tokenizer's own chat template, else ChatML."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: HF uses "default"
        own = own.get("default")
    return (own, False) if own else (CHATML_TEMPLATE, True)


def check_messages(messages) -> None:
    """Raise FormatError unless `messages` is a list of {role, content} with a known role and an assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise FormatError(f"'messages' must be a non-empty list of turns, got {short(messages)}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise FormatError(f"turn {k} must be a mapping with 'role' and 'content', got {short(m)}")
        if m["role"] not in ROLES:
            raise FormatError(f"turn {k} has unknown role {m['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise FormatError(f"turn {k} content must be a string, got {short(m['content'])}")
    if not any(m["role"] == "assistant" for m in messages):
        raise FormatError("the conversation has no assistant turn, so no token would carry loss")


def short(x, n: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "..."


def _clean(messages: list) -> list:
    """The turns without None-valued keys (parquet / hub rows fill absent keys of other rows with None, which
    templates mis-render); `chat_rows.normalize` already kept only the keys the template reads."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _render(tokenizer, template: str, messages: list, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def assistant_spans(tokenizer, template: str, messages: list) -> tuple[str, list[tuple[int, int]]] | None:
    """(rendered text, [(start, end) character spans of assistant turns]) or None if the template is not
    prefix-stable (a later turn changes how earlier ones render)."""
    full = _render(tokenizer, template, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, template, messages[:i], True) if i else _generation_prompt_only(tokenizer, template)
        upto = _render(tokenizer, template, messages[: i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            return None
        spans.append((len(before), len(upto)))
    return full, spans


def _generation_prompt_only(tokenizer, template: str) -> str:
    try:
        return _render(tokenizer, template, [], True)
    except Exception:  # some templates index messages[0]; an assistant-first chat then has no prefix
        return ""


def _mask_from_spans(tokenizer, text: str, spans) -> tuple[list[int], list[int]]:
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        mask = [
            int(any(s < e_span and e > s_span for s_span, e_span in spans)) if e > s else 0
            for s, e in enc["offset_mapping"]
        ]
        return ids, mask
    # slow tokenizers have no offsets: encode the pieces between span edges separately
    ids, mask, pos = [], [], 0
    for s_span, e_span in spans:
        for piece, flag in ((text[pos:s_span], 0), (text[s_span:e_span], 1)):
            if piece:
                part = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += part
                mask += [flag] * len(part)
        pos = e_span
    if text[pos:]:
        part = tokenizer(text[pos:], add_special_tokens=False)["input_ids"]
        ids += part
        mask += [0] * len(part)
    return ids, mask


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A template's `{% generation %}` marker, in any whitespace-trim form (TRL's `has_generation_markers`)."""


def encode_chat(tokenizer, template: str, messages, train_on_inputs: bool = False) -> tuple[str, list[int], list[int]]:
    """(rendered text, ids, loss mask) of one conversation. Raises FormatError for a malformed one.

    A template with `{% generation %}` blocks says itself which tokens are the assistant's: its assistant mask
    (`apply_chat_template(..., return_assistant_tokens_mask=True)`, what TRL's SFTTrainer `assistant_only_loss`
    trains on) is the loss mask. Otherwise the assistant turns are found by rendering the conversation turn by
    turn (each turn's span: what it adds after the generation prompt, its closing marker and newline included)."""
    check_messages(messages)
    check_size("chat", {"messages": messages})
    messages = _clean(messages)
    found = None if GENERATION_BLOCK.search(template) else assistant_spans(tokenizer, template, messages)
    if found is not None:
        text, spans = found
        ids, mask = _mask_from_spans(tokenizer, text, spans)
    elif GENERATION_BLOCK.search(template):
        enc = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        text = _render(tokenizer, template, messages, False)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    else:
        raise FormatError(
            "the chat template renders earlier turns differently once later turns are added, so "
            "assistant tokens cannot be located by prefix rendering; use a template with "
            "{% generation %} blocks (tokenizer.chat_template) or data.format: prompt_completion"
        )
    if train_on_inputs:
        mask = [1] * len(ids)
    if not any(mask):
        raise FormatError("no token of the assistant turns survived tokenization (empty assistant content?)")
    return text, ids, mask


def with_eos(tokenizer, text: str) -> str:
    """`text` ending in the tokenizer's EOS (TRL appends it as text, unless the text already ends with it, and
    tokenizes the whole)."""
    eos = tokenizer.eos_token
    return text if not eos or text.endswith(eos) else text + eos


def encode_text(tokenizer, text: str, add_eos: bool) -> list[int]:
    """The ids of a text row as TRL's SFTTrainer makes them: the tokenizer's own special tokens (a BOS where its
    settings add one), EOS appended as text."""
    # a long row is encoded in verified pieces (long_text): one call on a 10 MB row would take ~2 GB
    try:
        return long_text.encode_text(tokenizer, with_eos(tokenizer, text) if add_eos else text, add_special_tokens=True)
    except long_text.Unsplittable as e:
        raise FormatError(f"the text is {len(text):,} characters and {e}; split the row into shorter ones") from None


def text_chars(value) -> int:
    """Characters of every string inside a row's value (a string, a list of turns, content parts), walked
    without recursion."""
    total, todo = 0, [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, (list, tuple)):
            todo += item
    return total


def check_size(fmt: str, values: dict) -> None:
    """FormatError when a row of a format tokenized whole (chat, prompt / completion, preference pairs; `values`:
    its fields by column name) holds more characters than one tokenizer call may take
    (`long_text.MAX_ONE_CALL_CHARS`): such a call keeps ~150-350 bytes per character, so one 10 MB value took
    2.5-3.5 GB. Checked before any tokenizer call; the message names the longest field."""
    sizes = {name: text_chars(v) for name, v in values.items()}
    total = sum(sizes.values())
    if total > long_text.MAX_ONE_CALL_CHARS:
        name = max(sizes, key=sizes.get)
        raise FormatError(
            f"{name!r} holds {sizes[name]:,} characters ({total:,} in the row), more than the "
            f"{long_text.MAX_ONE_CALL_CHARS:,} a {fmt} row may hand the tokenizer at once (~300 bytes of memory per "
            f"character); shorten or split the row, or set data.skip_invalid: true to skip such rows"
        )


def common_prefix_length(ids, other) -> int:
    """Leading tokens two sequences share (where a prompt's own tokenization stops matching the whole row's)."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def encode_prompt_completion(
    tokenizer, prompt, completion, add_eos: bool, train_on_inputs: bool = False, field: str = "completion"
) -> tuple[str, list[int], list[int]]:
    """(text, ids, loss mask) as TRL's SFTTrainer: prompt + completion (+ EOS) tokenized as one text with the
    tokenizer's special tokens, loss from where the prompt tokenized alone stops matching it (a prompt ending in
    a space gives its space to the completion's first token, as it would be generated)."""
    for name, value in (("prompt", prompt), (field, completion)):
        if not isinstance(value, str):
            raise FormatError(f"{name!r} must be a string, got {short(value)}")
    check_size("prompt_completion", {"prompt": prompt, field: completion})
    if not completion:
        raise FormatError(f"{field!r} is empty, so no token would carry loss")
    text = prompt + (with_eos(tokenizer, completion) if add_eos else completion)
    ids = list(tokenizer(text)["input_ids"])
    n = common_prefix_length(tokenizer(prompt)["input_ids"], ids)
    if n == len(ids):
        raise FormatError(f"{field!r} adds no token after the prompt, so no token would carry loss")
    mask = [int(train_on_inputs)] * n + [1] * (len(ids) - n)
    return text, ids, mask


def row_text_for_hash(fmt: str, row: dict, fields: dict) -> str:
    """The text that decides whether a row is held out (stable whatever the tokenizer)."""
    if fmt == "chat":
        return json.dumps(row.get(fields["messages"]), sort_keys=True, ensure_ascii=False, default=str)
    if fmt == "prompt_completion":
        return f"{row.get(fields['prompt'])}\x00{row.get(fields['completion'])}"
    return str(row.get(fields["text"]))


def labels_from_mask(ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """HF-convention labels: the id where the token carries loss, -100 elsewhere."""
    return ids.copy() if mask is None else np.where(mask.astype(bool), ids, -100)


def fields(cfg: DataSection) -> dict:
    """The column each part of a row is read from: text, messages, prompt, completion."""
    return {
        "text": cfg.text_field,
        "messages": cfg.messages_field,
        "prompt": cfg.prompt_field,
        "completion": cfg.completion_field,
    }


def sample_format(cfg: DataSection, columns, where: str | None = None) -> tuple[str, str]:
    """(text | chat | prompt_completion, how it was decided) for a recipe's data section and the data's columns
    (`where`: the file they were read from, named when the format cannot be told)."""
    if cfg.format in ("preference", "unpaired_preference"):  # data/preference.py, unpaired.py: never detected
        return cfg.format, "set by data.format"
    declared = cfg.format if cfg.format in SAMPLE_FORMATS else "auto"
    f = fields(with_data_fields(cfg, columns))
    try:
        return detect_format(columns, declared, f["text"], f["messages"], f["prompt"], f["completion"])
    except FormatError as e:
        raise DataError(f"{e} (in {where})" if where else str(e)) from None


def document_boundaries(cfg: DataSection, fmt: str) -> bool:
    """Whether packed rows keep documents apart: data.document_boundaries, else on for the SFT formats."""
    explicit = cfg.document_boundaries
    return fmt != "text" if explicit is None else bool(explicit)
