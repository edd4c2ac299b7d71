"""Model presets: HF configs built offline by name, and resolving a recipe's model source.

Presets give the *shapes* of well-known models (layers, widths, heads, vocabulary), so the pipeline
can be trained and measured at real scale without downloading anything; weights are initialised
randomly. Tiny presets are for CPU tests and the quickstart.
"""

from __future__ import annotations

import copy
import difflib
import os

from huggingface_hub import snapshot_download
from transformers import AutoConfig

from vp_accelerate.model_config import ModelConfigError, check_model_config, read_config_json
from vp_accelerate.models.checkpoint_source import CheckpointSource
from vp_accelerate.models.row_map import RowMap

from .convert import RecipeError


def _shape(
    model_type: str, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int, **extra
):
    """(model_type, config kwargs) of a decoder: the fields every preset sets, plus the family's `extra`."""
    return model_type, dict(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        **extra,
    )


_LLAMA3_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}

# name -> (model_type, config kwargs). Shapes follow the public model cards.
PRESETS: dict[str, tuple[str, dict]] = {
    # Tiny models for CPU runs and tests.
    "llama-tiny": _shape("llama", 128, 352, 4, 4, 2, 4096, 2048, tie_word_embeddings=False),
    "llama-small": _shape("llama", 512, 1408, 8, 8, 4, 32000, 4096, tie_word_embeddings=False),
    "qwen3-tiny": _shape("qwen3", 128, 352, 4, 4, 2, 4096, 2048, head_dim=32, tie_word_embeddings=True),
    "gemma2-tiny": _shape("gemma2", 128, 352, 4, 4, 2, 4096, 2048, head_dim=32, final_logit_softcapping=30.0),
    "gpt2-tiny": ("gpt2", dict(n_embd=128, n_layer=4, n_head=4, n_positions=2048, vocab_size=4096)),
    # Real-scale shapes (random init).
    "llama-3.2-1b": _shape(
        "llama", 2048, 8192, 16, 32, 8, 128256, 8192, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE
    ),
    "llama-3.2-3b": _shape(
        "llama", 3072, 8192, 28, 24, 8, 128256, 8192, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE
    ),
    "llama-3.1-8b": _shape(
        "llama", 4096, 14336, 32, 32, 8, 128256, 8192, tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE
    ),
    "llama-3-70b": _shape(
        "llama", 8192, 28672, 80, 64, 8, 128256, 8192, tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE
    ),
    "llama-3.1-405b": _shape(
        "llama", 16384, 53248, 126, 128, 8, 128256, 131072, tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE
    ),
    "qwen2.5-1.5b": _shape(
        "qwen2", 1536, 8960, 28, 12, 2, 151936, 8192, tie_word_embeddings=True, rope_parameters=_QWEN_ROPE
    ),
    "qwen3-4b": _shape(
        "qwen3", 2560, 9728, 36, 32, 8, 151936, 8192, head_dim=128, tie_word_embeddings=True, rope_parameters=_QWEN_ROPE
    ),
    "gemma-2b": _shape("gemma", 2048, 16384, 18, 8, 1, 256000, 8192, head_dim=256),
    "gemma2-2b": _shape(
        "gemma2",
        2304,
        9216,
        26,
        8,
        4,
        256000,
        8192,
        head_dim=256,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
}


def preset_config(name: str, overrides: dict | None = None):
    """A transformers config for preset `name` with `overrides` applied."""
    if name not in PRESETS:
        hint = difflib.get_close_matches(name, list(PRESETS), n=1)
        more = f"; did you mean {hint[0]}?" if hint else ""
        raise ValueError(f"unknown model preset {name!r}{more} (known: {', '.join(PRESETS)})")
    model_type, kwargs = PRESETS[name]
    # a copy: presets share their rope dicts, and a config may change what it is given
    return AutoConfig.for_model(model_type, **copy.deepcopy({**kwargs, **(overrides or {})}))


def recipe_model_config(
    source: str, overrides: dict | None = None, trust_remote_code: bool = False, pretrained: bool = False
):
    """The model config of a recipe's `model.source` (preset, local dir, or hub id), overrides applied.
    `pretrained`: the run reads the source's weights (`uses_pretrained_weights`), see `with_overrides`.
    The config is checked (model_config.py: sizes, numbers, a config.json's size and nesting) before transformers
    reads it and again with the overrides applied: RecipeError naming the key and the fix."""
    if source in PRESETS:
        check_config_types(preset_config(source), overrides or {})
        _checked(overrides or {}, "model.config", OVERRIDE_FIX)
        config = preset_config(source, overrides)
    else:
        path = os.path.join(os.path.expanduser(source), "config.json")
        if os.path.isfile(path):
            _checked(path, "model.source", MODEL_FIX)
        config = AutoConfig.from_pretrained(os.path.expanduser(source), trust_remote_code=trust_remote_code)
        config = with_overrides(config, overrides, pretrained)
        _checked(overrides or {}, "model.config", OVERRIDE_FIX)
    _checked(config, "model.source", MODEL_FIX, f"the config of {source}")
    return config


MODEL_FIX = "correct {name} in the model's config.json or point model.source at another model"
OVERRIDE_FIX = "set model.config.{name} to a size the model can have"


def _checked(config, key: str, fix: str, source: str | None = None):
    """`check_model_config` (or `read_config_json` for a path) with its error as a RecipeError on `key`."""
    try:
        if isinstance(config, str):
            return read_config_json(config, fix)
        check_model_config(config, source or key, fix)
    except ModelConfigError as e:
        raise RecipeError(f"{key}: {e}" if source or isinstance(config, str) else str(e)) from None


def with_overrides(config, overrides: dict | None, pretrained: bool):
    """`config` with a recipe's `model.config` keys set, each of the type it replaces. Pretrained weights refuse
    a vocab_size: their rows follow the tokenizer, and a config value would be silently replaced by the
    checkpoint's row count."""
    overrides = overrides or {}
    check_config_types(config, overrides)
    if pretrained and "vocab_size" in overrides:
        raise RecipeError(
            "model.config.vocab_size: the rows of pretrained weights follow the tokenizer (tokenizer."
            "resize_vocab / allow_shrink / pad_to_multiple_of), not a config override; remove it"
        )
    for key, value in overrides.items():
        try:
            setattr(config, key, value)
        except (TypeError, ValueError) as e:  # a config property that checks its value
            raise RecipeError(f"model.config.{key}: {e}") from None
    return config


def check_config_types(config, overrides: dict) -> None:
    """model.config overrides have the type of the value they replace (an integer stays an integer)."""
    for key, value in overrides.items():
        old = getattr(config, key, None)
        if old is None or value is None:
            continue
        kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        want = type(old)
        ok = (
            isinstance(value, bool)
            if want is bool
            else isinstance(value, int) and not isinstance(value, bool)
            if want is int
            else isinstance(value, (int, float)) and not isinstance(value, bool)
            if want is float
            else isinstance(value, str)
            if want is str
            else True
        )
        if not ok:
            raise RecipeError(
                f"model.config.{key}: expects {kinds.get(want, want.__name__)} (the model's is {old!r}), got {value!r}"
            )


def padded_vocab(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def local_model_dir(source: str) -> str:
    """A local directory holding `source`'s files: itself, or a hub id's snapshot (config, safetensors, tokenizer).

    The snapshot is downloaded once into the HF cache (call it on one process first), so every rank then
    reads only its own tensors from local files instead of loading the whole model.
    """
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return path
    return snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"])


def uses_pretrained_weights(model_section) -> bool:
    """Whether a run starts from the source's weights (`model_section`: the recipe's model section)."""
    return starts_from_weights(model_section.source, model_section.pretrained_weights)


def starts_from_weights(source: str, pretrained_weights: bool = True) -> bool:
    """The rule itself, for a source and flag as a saved recipe writes them: `pretrained_weights` asks for the
    weights, and only a checkpoint has them (a preset is a config; its model starts from random weights)."""
    return bool(pretrained_weights) and source not in PRESETS


def model_source(model_section, config, plan=None, path: str | None = None):
    """What to hand PipelineModel: a config (random init) or a `CheckpointSource` (pretrained weights).

    `plan`: the run's `VocabPlan` (rows and where each comes from); `path`: the local dir of the weights
    (`local_model_dir`). Nothing is loaded here: each rank reads only its own tensors and rows.
    """
    if not uses_pretrained_weights(model_section):
        if plan is not None:
            config.vocab_size = plan.rows_after
        return config
    source_vocab = config.vocab_size
    config.vocab_size = plan.rows_after if plan is not None else source_vocab
    row_map = plan.row_map if plan is not None else None
    if row_map is None and config.vocab_size != source_vocab:
        row_map = RowMap.identity(config.vocab_size, source_vocab)
    return CheckpointSource(path or os.path.expanduser(model_section.source), config, source_vocab, row_map)
