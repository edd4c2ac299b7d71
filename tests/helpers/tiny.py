"""Tiny configs of every supported family, and the small corpus, BPE and training recipe the tests share
(`corpus`, `bpe`, `word_tokenizer`, `recipe_file`); nothing is downloaded.

Each config turns on the family's special pieces with values that actually change the output at
tiny scale: sliding windows shorter than the test sequences, Gemma-2 softcapping near the logit
magnitude, Granite multipliers away from 1, Qwen2 mixed full / sliding layers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox", "cohere", "granite")


def tiny_config(
    family: str,
    *,
    vocab_size: int = 257,
    hidden_size: int = 32,
    num_layers: int = 4,
    tie: bool | None = None,
    **overrides,
):
    """A small `PretrainedConfig` of `family` (vocabulary not divisible by 2 or 3 by default).

    `tie` sets tie_word_embeddings (None keeps the family default); `overrides` go to the config.
    """
    from transformers import AutoConfig

    kw: dict = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4)
    if family not in ("gpt2", "gpt_neox"):
        kw.update(
            intermediate_size=2 * hidden_size, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
        )
    if family == "gpt2":
        kw.update(n_positions=64, bos_token_id=1, eos_token_id=2)
    if family == "gpt_neox":
        kw.update(intermediate_size=2 * hidden_size, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    if family in ("gemma", "gemma2"):
        kw.update(head_dim=hidden_size // 4)
    if family in ("mistral", "gemma2", "phi3"):
        kw.update(sliding_window=5)
    if family == "gemma2":
        kw.update(final_logit_softcapping=0.5, attn_logit_softcapping=2.0)
    if family == "qwen2":
        kw.update(use_sliding_window=True, sliding_window=5, max_window_layers=num_layers // 2)
    if family == "granite":
        kw.update(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3)
    if family == "cohere":
        kw.update(logit_scale=0.5)
    if tie is not None:
        kw["tie_word_embeddings"] = tie
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def tiny_llama(vocab_size: int, *, tied: bool = False, num_layers: int = 8, hidden_size: int = 32, **overrides):
    """The small Llama the runtime's exactness tests share: GQA (4 heads, 2 key/value heads), FFN 2h,
    `num_layers` layers (8 split into 2 or 4 stages, or 2 chunks on each of 4 ranks)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        **overrides,
    )


WORDS = ["alpha", "beta", "gamma", "delta", "paris", "france", "capital", "hello", "world"]
"""The words of `word_tokenizer`'s text."""


def word_tokenizer(folder, words=WORDS, tail: str = "\n"):
    """A 300-token byte-level BPE trained on 200 seeded lines of `words` (12 a line) in `folder`/t.txt; returns
    the tokenizer's directory (`folder`/tok). `tail` ends the text (a test may add a token it needs)."""
    rng = np.random.default_rng(0)
    (folder / "t.txt").write_text("\n".join(" ".join(rng.choice(words, size=12)) for _ in range(200)) + tail)
    bpe([folder / "t.txt"], folder)
    return folder / "tok"


TINY_MODEL = {
    "source": "llama-tiny",
    "config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
}
"""A recipe's model section for a 4-layer h32 Llama (the `llama-tiny` preset made smaller)."""


def corpus(folder, words=WORDS, *, lines: int = 200, per_line=12, seed=0, name: str = "train.jsonl") -> Path:
    """`lines` lines of `per_line` words (an int, or (lo, hi) for a random count) drawn from `words` with
    `random.Random(seed)` (or `seed` itself when it is a `random.Random`, so a caller's stream goes on) in
    `folder`/`name`: `{"text": ...}` rows for a .jsonl name, plain lines otherwise. Returns the file."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    rows = []
    for _ in range(lines):
        k = rng.randint(*per_line) if isinstance(per_line, tuple) else per_line
        rows.append(" ".join(rng.choices(words, k=k)))
    path = Path(folder) / name
    if name.endswith(".jsonl"):
        rows = [json.dumps({"text": r}) for r in rows]
    path.write_text("".join(r + "\n" for r in rows))
    return path


def bpe(files, folder, size: int = 300, *, name: str = "tok", min_frequency: int = 1, **kw):
    """A byte-level BPE of `size` tokens trained on `files` (paths), saved in `folder`/`name`; returns the
    tokenizer (`train_bpe`'s answer)."""
    from vp_accelerate.train.tokens.tokenizer import train_bpe

    return train_bpe([str(f) for f in files], size, str(Path(folder) / name), min_frequency=min_frequency, **kw)


def recipe(tokenizer, files, /, **sections) -> dict:
    """A small training recipe: the `llama-tiny` preset, the BPE in directory `tokenizer`, `files` as the data,
    wandb off; each keyword updates its section (a dict) of that base (`tokenizer=` too: the first arguments
    are positional only)."""
    data: dict = {
        "model": {"source": "llama-tiny"},
        "tokenizer": {"source": f"bpe:{tokenizer}"},
        "data": {"files": [str(f) for f in files]},
        "logging": {"wandb_mode": "disabled"},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return data


def recipe_file(path, tokenizer, files, /, **sections) -> str:
    """`recipe(tokenizer, files, **sections)` written as YAML to `path`; returns the path as a string."""
    import yaml

    Path(path).write_text(yaml.safe_dump(recipe(tokenizer, files, **sections)))
    return str(path)


def tiny_run(folder, words, *, lines: int, per_line=40, seed=0, **sections) -> Path:
    """The folder of a small launched run: a corpus of `words` (`corpus`), its 300-token BPE (`folder`/tok) and
    `folder`/recipe.yaml with the 4-layer `TINY_MODEL` and `sections` (`recipe`). Returns `folder`."""
    text = corpus(folder, words, lines=lines, per_line=per_line, seed=seed)
    bpe([text], folder)
    recipe_file(Path(folder) / "recipe.yaml", Path(folder) / "tok", [text], model=TINY_MODEL, **sections)
    return Path(folder)


FAULT_WORDS = "alpha beta gamma delta epsilon мир дом 世界 你好 données λόγος".split()
"""The fault tests' corpus words (several scripts, so the BPE has multi-byte tokens)."""


def fault_run(folder, *, lines: int, seed, steps: int, train_seed: int, checkpoint: dict) -> Path:
    """The fault tests' run (`tiny_run`): 2 ranks of 4 microbatches, `steps` steps of 8 rows of 16 tokens, one
    evaluation batch held out, a log line every step."""
    return tiny_run(
        folder,
        FAULT_WORDS,
        lines=lines,
        per_line=30,
        seed=seed,
        data={"seq_len": 16, "eval_holdout": 0.05},
        pipeline={"microbatches": 4},
        train={"steps": steps, "global_batch": 8, "seed": train_seed},
        eval={"every": 0, "batches": 1},
        checkpoint=checkpoint,
        logging={"log_every": 1, "timeline_image": False},
    )
