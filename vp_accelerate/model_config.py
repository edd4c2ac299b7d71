"""A model config checked before anything is sized by it: the one validation `plan`, `dryrun`, `train --check`
and the trainer share (and the cost model, which every planner path goes through).

A config.json is a file someone handed us. Read as it is, `num_hidden_layers: 1000000000` makes the planner build
a list per layer until the process is killed, a negative `hidden_size` or `vocab_size` ends in a
ZeroDivisionError, `NaN`, `4.5`, `"256"` or a list in a size field in a TypeError deep in the cost model, and a
file nested 200,000 deep in a RecursionError. `read_config_json` reads a config.json within limits (its size, its
nesting) and `check_model_config` checks the fields the project sizes anything by (their type, their range), so
each of these is one line naming the file, the field and the fix (`ModelConfigError`, a ValueError: the
commands print it and exit 2).

The upper bounds are far above any published model (the largest have ~25k hidden units, ~130 layers, 256k
vocabulary rows) and low enough that nothing the planner or a meta-device model builds from them can exhaust a
machine's memory. This module imports nothing of the project, so every layer can use it.
"""

from __future__ import annotations

import json
import math
import os

MAX_FILE_BYTES = 16 << 20
"""A config.json larger than this is not read (real ones are a few kB; a multimodal one under 100 kB)."""
MAX_DEPTH = 32
"""Nesting a config.json may have (real ones: 4 or 5 levels, e.g. text_config.rope_scaling.<key>)."""


DEFAULT_FIX = "correct {name} in the model's config.json, or name another model"
"""What a message advises; `{name}` is the field."""


class ModelConfigError(ValueError):
    """A model config that cannot be used; the message names the file or source, the field and the fix."""


# (names of one field, in the order configs spell it; the least and the most it may be; what it counts).
# The first name present is checked. `None` in a config means "absent" (GPT-2's n_inner: 4 x n_embd).
INT_FIELDS = (
    (("hidden_size", "n_embd", "d_model"), 1, 1 << 17, "hidden units"),
    (("num_hidden_layers", "n_layer"), 1, 4096, "decoder layers"),
    (("num_attention_heads", "n_head"), 1, 4096, "attention heads"),
    (("num_key_value_heads",), 1, 4096, "key/value heads"),
    (("intermediate_size", "n_inner"), 1, 1 << 20, "MLP units"),
    (("vocab_size",), 1, 1 << 24, "vocabulary rows"),
    (("head_dim",), 1, 4096, "units per attention head"),
    (("max_position_embeddings", "n_positions"), 1, 1 << 24, "positions"),
)
PER_LAYER = ("intermediate_size",)
"""Fields a family may give per decoder layer (Gemma 3n's MLP widths)."""
FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "initializer_range", "rope_theta")
"""Numbers a model computes with: finite and not negative (NaN here is a NaN in every step)."""


def read_config_json(path, fix: str = DEFAULT_FIX) -> dict:
    """The JSON object in `path` (a config.json), checked by `check_model_config`. ModelConfigError when the file
    is too large, not UTF-8, not JSON, nested too deep, not an object, or has a field out of range."""
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise ModelConfigError(
                f"{path} is {size:,} bytes, more than a model config.json holds ({MAX_FILE_BYTES:,} at most); "
                f"point at the model's own config.json"
            )
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path} is not UTF-8 text (byte {e.start}); point at a model's config.json") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:  # json's parser recurses per level
        raise ModelConfigError(
            f"{path} is not valid JSON for a model config (nested deeper than the parser's limit; a config.json "
            f"is a few levels deep)"
        ) from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(data).__name__}, not an object of config fields")
    if _depth(data) > MAX_DEPTH:
        raise ModelConfigError(
            f"{path} is nested more than {MAX_DEPTH} levels deep; a model config.json has a few levels"
        )
    check_model_config(data, str(path), fix)
    return data


def _depth(value) -> int:
    """How deep `value` nests (an object or list of scalars is 1), walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # one level past the limit is enough to refuse
            todo += [(c, level + 1) for c in children]
    return deepest


def _get(config, name: str):
    """(present, value) of field `name` of a dict or a config object."""
    if isinstance(config, dict):
        return name in config, config.get(name)
    try:
        return hasattr(config, name), getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a config property that fails on a bad value is a missing field here
        return False, None


def _first(config, names: tuple[str, ...]):
    """(name, value) of the first of `names` that `config` sets to something other than None."""
    for name in names:
        present, value = _get(config, name)
        if present and value is not None:
            return name, value
    return None, None


def check_model_config(config, source: str = "the model config", fix: str = DEFAULT_FIX) -> None:
    """Raise ModelConfigError when a size field of `config` (a dict read from config.json, or a transformers
    config) is not an integer in its range, a numeric field is not finite, or two fields disagree (more
    key/value heads than heads, more heads than hidden units). `source` names where the config came from;
    `fix` is the advice, `{name}` in it the field's name. A `text_config` inside is checked too."""
    sizes = {}
    for names, low, high, what in INT_FIELDS:
        name, value = _first(config, names)
        if name is None:
            continue
        per_layer = name in PER_LAYER and isinstance(value, list) and 0 < len(value) <= 4096
        if not all(_whole(v, low, high) for v in (value if per_layer else [value])):
            also = " or a list of them, one per layer" if name in PER_LAYER else ""
            raise ModelConfigError(
                f"{source}: {name} is {_show(value)}, not a number of {what} (an integer from {low} to {high:,}"
                f"{also}); {fix.format(name=name)}"
            )
        sizes[names[0]] = value
    for name in FLOAT_FIELDS:
        present, value = _get(config, name)
        if not present or value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ModelConfigError(
                f"{source}: {name} is {_show(value)}, not a finite number >= 0; {fix.format(name=name)}"
            )
    heads, kv = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads is not None and kv is not None and kv > heads:
        raise ModelConfigError(
            f"{source}: num_key_value_heads is {kv}, more than num_attention_heads {heads} (each key/value head "
            f"serves one or more query heads); {fix.format(name='num_key_value_heads')}"
        )
    hidden = sizes.get("hidden_size")
    if heads is not None and hidden is not None and heads > hidden and "head_dim" not in sizes:
        raise ModelConfigError(
            f"{source}: num_attention_heads is {heads}, more than hidden_size {hidden} (a head would have no "
            f"units); {fix.format(name='num_attention_heads')}"
        )
    present, text = _get(config, "text_config")
    if present and text is not None and text is not config:
        if isinstance(config, dict) and not isinstance(text, dict):
            raise ModelConfigError(
                f"{source}: text_config is {_show(text)}, not an object of config fields; {fix.format(name='text_config')}"
            )
        check_model_config(text, f"{source} (text_config)", fix)


def _whole(value, low: int, high: int) -> bool:
    """`value` is an integer (not a bool, not 4.0) from `low` to `high`."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _show(value) -> str:
    """A value as the message shows it: its JSON spelling, cut short, and its type when that is the problem."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (int, bool)) or value is None:
        return json.dumps(value)
    text = json.dumps(value) if isinstance(value, (str, list, dict)) else repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} (a {'string' if isinstance(value, str) else type(value).__name__})"


# Families whose config.json may predate `layer_types` and alternate sliding and full layers: every
# `pattern`-th layer (1-based) is full, with the pattern's field and its default (transformers' config classes).
ALTERNATING = {
    "gemma2": (None, 2),
    "gemma3": ("sliding_window_pattern", 6),
    "gemma3_text": ("sliding_window_pattern", 6),
    "cohere2": ("sliding_window_pattern", 4),
}


def layer_kinds(config, n: int | None = None) -> tuple[str, ...]:
    """Each decoder layer's attention-mask kind ("full_attention", "sliding_attention", or what else a config
    names), as the family's forward chooses it: the config's `layer_types` (transformers fills it in for Gemma-2/3,
    Cohere-2, Qwen-2 and others); for a config.json older than that field, the alternation of ALTERNATING, or none
    when `use_sliding_window` is false (Qwen-2); else one sliding window on every layer when `sliding_window` is set
    (Mistral, Phi-3, Starcoder2). `n`: the layers (default: the config's count)."""
    n = n if n is not None else _first(config, ("num_hidden_layers", "n_layer"))[1] or 0
    types = _get(config, "layer_types")[1]
    if types is not None:
        return tuple(types[:n])
    if _get(config, "sliding_window")[1] is None or _get(config, "use_sliding_window")[1] is False:
        return ("full_attention",) * n
    field, default = ALTERNATING.get(_get(config, "model_type")[1], (None, None))
    if default is not None:
        pattern = (_get(config, field)[1] if field else None) or default
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n))
    return ("sliding_attention",) * n


def masked_layer_share(config, seq: int) -> float:
    """The share of the decoder layers whose attention needs an explicit mask for rows of `seq` tokens without
    padding: the sliding-window layers whose window is shorter than `seq` (models/masks.py gives a window that
    covers the row the causal path)."""
    kinds = layer_kinds(config)
    window = _get(config, "sliding_window")[1]
    if not kinds or window is None or window >= seq:
        return 0.0
    return sum(k == "sliding_attention" for k in kinds) / len(kinds)
