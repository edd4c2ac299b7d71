"""Model presets: HF configs built offline by name, and resolving a recipe's model source.

Presets give the *shapes* of well-known models (layers, widths, heads, vocabulary), so the pipeline
can be trained and measured at real scale without downloading anything; weights are initialised
randomly. Tiny presets are for CPU tests and the quickstart.
"""

from __future__ import annotations

import difflib
import os

from huggingface_hub import snapshot_download
from transformers import AutoConfig

from vp_accelerate.models.checkpoint_source import CheckpointSource
from vp_accelerate.models.row_map import RowMap

# name -> (model_type, config kwargs). Shapes follow the public model cards.
PRESETS: dict[str, tuple[str, dict]] = {
    # Tiny models for CPU runs and tests.
    "llama-tiny": (
        "llama",
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            vocab_size=4096,
            tie_word_embeddings=False,
        ),
    ),
    "llama-small": (
        "llama",
        dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            vocab_size=32000,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-tiny": (
        "qwen3",
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=2048,
            vocab_size=4096,
            tie_word_embeddings=True,
        ),
    ),
    "gemma2-tiny": (
        "gemma2",
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=2048,
            vocab_size=4096,
            final_logit_softcapping=30.0,
        ),
    ),
    "gpt2-tiny": ("gpt2", dict(n_embd=128, n_layer=4, n_head=4, n_positions=2048, vocab_size=4096)),
    # Real-scale shapes (random init).
    "llama-3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
    ),
    "llama-3.2-3b": (
        "llama",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "qwen3-4b": (
        "qwen3",
        dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "gemma-2b": (
        "gemma",
        dict(
            hidden_size=2048,
            intermediate_size=16384,
            num_hidden_layers=18,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
        ),
    ),
    "gemma2-2b": (
        "gemma2",
        dict(
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        ),
    ),
}


def is_local_dir(source: str) -> bool:
    return os.path.isdir(os.path.expanduser(source))


def preset_config(name: str, overrides: dict | None = None):
    """A transformers config for preset `name` with `overrides` applied."""
    if name not in PRESETS:
        hint = difflib.get_close_matches(name, list(PRESETS), n=1)
        more = f"; did you mean {hint[0]}?" if hint else ""
        raise ValueError(f"unknown model preset {name!r}{more} (known: {', '.join(PRESETS)})")
    model_type, kwargs = PRESETS[name]
    return AutoConfig.for_model(model_type, **{**kwargs, **(overrides or {})})


def recipe_model_config(source: str, overrides: dict | None = None, trust_remote_code: bool = False):
    """The model config of a recipe's `model.source` (preset, local dir, or hub id), overrides applied."""
    if source in PRESETS:
        return preset_config(source, overrides)
    config = AutoConfig.from_pretrained(os.path.expanduser(source), trust_remote_code=trust_remote_code)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


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


def model_source(model_section, config, plan=None, path: str | None = None):
    """What to hand PipelineModel: a config (random init) or a `CheckpointSource` (pretrained weights).

    `plan`: the run's `VocabPlan` (rows and where each comes from); `path`: the local dir of the weights
    (`local_model_dir`). Nothing is loaded here: each rank reads only its own tensors and rows.
    """
    pretrained = model_section.pretrained_weights and model_section.source not in PRESETS
    if not pretrained:
        if plan is not None:
            config.vocab_size = plan.rows_after
        return config
    source_vocab = config.vocab_size
    config.vocab_size = plan.rows_after if plan is not None else source_vocab
    row_map = plan.row_map if plan is not None else None
    if row_map is None and config.vocab_size != source_vocab:
        row_map = RowMap.identity(config.vocab_size, source_vocab)
    return CheckpointSource(path or os.path.expanduser(model_section.source), config, source_vocab, row_map)
