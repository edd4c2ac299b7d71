"""`AdapterConfig`: parameter-efficient fine-tuning (LoRA through `peft`) of the decoder layers.

Like `PipelineConfig`, this one dataclass is both a `PipelineModel` argument (`adapter=`) and the training
recipe's `adapter:` section; it imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class AdapterConfig:
    """LoRA adapters on the decoder layers (the recipe's `adapter:` section); `type: null` trains everything."""

    type: Optional[Literal["lora"]] = None
    """"lora": freeze the model and train low-rank adapters (via `peft`) on `target_modules`; null = full
    fine-tuning (every parameter trains)."""

    r: int = 8
    """LoRA rank."""

    alpha: float = 16.0
    """LoRA alpha; the adapter's output is scaled by alpha / r."""

    dropout: float = 0.0
    """Dropout on the adapter's input (peft's lora_dropout)."""

    target_modules: Optional[list[str]] = None
    """Names (suffixes) of the decoder-layer linear modules that get adapters, e.g. [q_proj, v_proj]; null =
    peft's default for the model type (q_proj, v_proj for Llama; c_attn for GPT-2)."""

    train_vocab: bool = False
    """Also train the vocabulary layers (embedding and output shards, full rows; saved in adapter/ whole, as
    peft's `modules_to_save`); False keeps them frozen, so they get no gradient and no optimizer state (but the
    rows of `trainable_tokens`)."""

    trainable_tokens: list[int] = field(default_factory=list)
    """Token ids whose embedding and output rows train under LoRA, as peft's `trainable_token_indices` (each
    rank trains the rows in its own vocabulary shard; the rest stay frozen). They are saved in `adapter/` the
    way peft saves them. The special tokens the run adds to the tokenizer join them (`train_new_tokens`)."""

    train_new_tokens: bool = True
    """Under LoRA, also train the rows of the special tokens this run adds to the tokenizer (ChatML's
    `<|im_start|>` / `<|im_end|>` for a base model without a chat template): frozen, they keep their initial
    rows, and the model never learns to end its turn."""

    frozen_in_compute_dtype: bool = True
    """Under bf16 / fp16 mixed precision, hold the frozen decoder weights (LoRA's base layers) in the compute
    dtype: 2 bytes per frozen parameter instead of an fp32 copy plus a low-precision cast of it each step
    (6). The forward is the same bit for bit (a frozen weight's cast never changes); adapters, biases, norms,
    the vocabulary and the rows that train keep fp32. false keeps the fp32 copies."""

    def check(self) -> "AdapterConfig":
        """Raise ValueError naming the field for an impossible value."""
        if self.type is None:
            return self
        if self.type != "lora":
            raise ValueError(f"adapter.type: unknown adapter {self.type!r}; use lora or null")
        if self.r < 1:
            raise ValueError(f"adapter.r: must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"adapter.alpha: must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"adapter.dropout: must be in [0, 1), got {self.dropout}")
        if any(i < 0 for i in self.trainable_tokens):
            raise ValueError(f"adapter.trainable_tokens: token ids are >= 0, got {self.trainable_tokens}")
        if self.train_vocab and self.trainable_tokens:
            raise ValueError("adapter.trainable_tokens: adapter.train_vocab already trains every row; set one of them")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("adapter.target_modules: an empty list adapts nothing; list module names or use null")
        return self

    @property
    def enabled(self) -> bool:
        return self.type is not None

    @property
    def scaling(self) -> float:
        return self.alpha / self.r
