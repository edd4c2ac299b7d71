"""The special-token ids an exported model needs for inference, taken from its tokenizer.

A model config's `bos_token_id` / `eos_token_id` / `pad_token_id` come from whatever built it (a preset's
defaults, the source checkpoint's tokenizer) and say nothing about the tokenizer the model was trained
with; `generate()` stops on the generation config's `eos_token_id`. So every export writes the ids of the
tokenizer it ships into both files, and when that tokenizer has a chat template, generation also stops
at the template's end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`): `eos_token_id` is
then a list, as in the generation configs of chat models on the hub.
"""

from __future__ import annotations

import copy

from transformers import GenerationConfig

#: A conversation rendered to find what a template writes after an assistant turn's content.
_PROBE = "Probe reply 7"


def chat_template_text(tokenizer) -> str | None:
    """The tokenizer's chat template (the "default" one of several named templates), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def _special_ids(tokenizer) -> set[int]:
    ids = {i for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None}
    ids |= {
        i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", False)
    }
    return ids


def end_of_turn_id(tokenizer, template: str | None = None) -> int | None:
    """The token the chat template closes an assistant turn with, or None.

    A user turn and an assistant turn are rendered; what follows the assistant's content is the template's
    end-of-turn text, and its first token is the end-of-turn token when it is a special token (a template
    that closes turns with plain text has none to stop on).
    """
    template = template or chat_template_text(tokenizer)
    if not template:
        return None
    messages = [{"role": "user", "content": "Probe question"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception:  # templates may insist on a system turn, alternation, tools...: no end-of-turn found
        return None
    at = text.rfind(_PROBE)
    if at < 0:
        return None
    tail = text[at + len(_PROBE) :]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail.strip() else []
    return ids[0] if ids and ids[0] in _special_ids(tokenizer) else None


def special_token_ids(tokenizer) -> dict:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} of `tokenizer` for the model config (eos: one id)."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def generation_eos(tokenizer) -> int | list[int] | None:
    """What generation stops on: the tokenizer's EOS, plus the chat template's end-of-turn token."""
    stops = [i for i in (tokenizer.eos_token_id, end_of_turn_id(tokenizer)) if i is not None]
    stops = list(dict.fromkeys(stops))
    return stops[0] if len(stops) == 1 else (stops or None)


def with_tokenizer_ids(config, tokenizer):
    """A copy of `config` with the tokenizer's bos/eos/pad ids (the caller's config is not changed)."""
    config = copy.deepcopy(config)
    for key, value in special_token_ids(tokenizer).items():
        setattr(config, key, value)
    return config


def generation_config_for(tokenizer):
    """The `GenerationConfig` an export ships: the tokenizer's ids, stopping at EOS and the end of a chat turn;
    padding with the pad token (EOS when the tokenizer has none, as `generate()` would)."""
    eos = generation_eos(tokenizer)
    first = eos[0] if isinstance(eos, list) else eos
    # built from the ids, not `from_model_config`: generate() would re-derive a config-made one from config.json
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else first,
    )
