"""What one benchmark invocation measures: model shape, batch, vocabulary sizes, methods, repetitions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig

from vp_accelerate.schedule.registry import supported_pairs

# Every method the harness knows, in the order tables and plots list them. "peer" is
# torch.distributed.pipelining's Schedule1F1B; the rest, every pair the schedule registry offers, run
# through our runtime.
ALL_METHODS = ("peer",) + tuple(f"{kind}-{method}" for kind, method in supported_pairs())
QUICK_METHODS = ("peer", "1f1b-vocab-2")
DEFAULT_VOCABS = (32768, 65536, 131072, 262144)


@dataclass
class BenchConfig:
    """One benchmark run. Defaults are the full measurement (Llama-style, h=256, 8 layers, seq 256)."""

    hidden: int = 256
    """Hidden size h of the Llama-style model."""
    layers: int = 8
    """Decoder layers; split evenly over the ranks for the peer and the baselines."""
    heads: int = 4
    """Attention heads (head dim = hidden / heads)."""
    intermediate: int | None = None
    """FFN size; None means 4h (docs/design.md's cost table assumes 4h)."""
    seq: int = 256
    """Tokens per sequence."""
    microbatches: int = 8
    """Microbatches per step (the pipeline's m)."""
    microbatch_size: int = 1
    """Sequences per microbatch."""
    vocabs: tuple[int, ...] = DEFAULT_VOCABS
    """Vocabulary sizes V to sweep."""
    methods: tuple[str, ...] = ALL_METHODS
    """Methods to compare; each repetition runs them round-robin so machine drift hits them alike."""
    world_size: int = 2
    """Pipeline ranks (gloo processes, one thread each)."""
    warmup: int = 1
    """Untimed steps per method before measuring (first-step allocations, shape inference)."""
    steps: int = 3
    """Timed steps per method; tokens/s is the median over them."""
    seed: int = 0
    """Seed for weights and the synthetic batch, the same for every method."""
    timeout_s: float = 3600.0
    """Limit for one vocabulary size's spawn (a hung collective fails instead of hanging)."""
    skip_unavailable: bool = True
    """Skip methods whose implementation is not importable (ours before the runtime lands) instead of failing."""
    extra: dict = field(default_factory=dict)
    """Free-form notes copied into the JSON output (e.g. the command line)."""

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.microbatch_size * self.seq

    @property
    def batch_size(self) -> int:
        return self.microbatches * self.microbatch_size


def llama_config(cfg: BenchConfig, vocab: int):
    """The HF LlamaConfig every method builds from (untied embeddings, SDPA attention, fp32)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate or 4 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=max(cfg.seq, 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def synthetic_batch(cfg: BenchConfig, vocab: int, ignore_fraction: float = 0.0):
    """(input_ids, labels), both [microbatches * microbatch_size, seq], labels in HF's convention.

    labels are aligned with input_ids (the model shifts them: position t predicts labels[t + 1]), as
    `model(input_ids, labels=labels)` and our runtime take them; -100 marks ignored tokens. A nonzero
    ignore_fraction makes the valid-token count differ between microbatches, which is what tells a
    token-mean loss from a mean of per-microbatch means.
    """
    g = torch.Generator().manual_seed(cfg.seed + vocab)
    input_ids = torch.randint(0, vocab, (cfg.batch_size, cfg.seq), generator=g)
    labels = input_ids.clone()
    if ignore_fraction > 0:
        labels[torch.rand(labels.shape, generator=g) < ignore_fraction] = -100
    return input_ids, labels
