"""The one list of precision, output-layer memory and activation-checkpointing modes, and what each implies.

Every other module asks these tables instead of testing names: `runtime/config.py` (the recipe's
`pipeline:` section and PipelineModel's argument takes its allowed values from them), `runtime/precision.py`
(the dtypes and the loss scaler of a precision), `vocab/output_layer.py` (what S keeps for T),
`models/stage.py` (which layers a chunk checkpoints) and `cost/costs.py` (what the cost model counts).

This module imports nothing of the project and not torch (dtypes are named as torch attributes,
"float32", "bfloat16"), so every layer may read it and `--help` stays fast.

Names are matched case-insensitively (`BF16`); `precision` / `memory_mode` / `checkpointing` return the
entry, and an unknown name raises ModeError (a ValueError) that starts with the PipelineConfig field it is
for and lists the valid names with a "did you mean" (`mixed_precision: unknown value 'fp8'; choose one of ...`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .lookup import lookup


class ModeError(ValueError):
    """An unknown mode name; the message lists the valid ones."""


@dataclass(frozen=True)
class Precision:
    """One value of `pipeline.mixed_precision`: the dtypes of parameters and compute, and loss scaling."""

    name: str
    """Table key: the value of `pipeline.mixed_precision` (and of accelerate's `--mixed_precision` when
    `accelerate` is True)."""
    param_dtype: str | None
    """torch dtype (attribute name) of the parameters, their gradients and the AdamW state; None = the dtype
    the model is built in (`PipelineModel(dtype=...)`, float32 when unset; the trainer builds float32)."""
    compute_dtype: str | None
    """torch dtype the decoder chunks (torch.autocast) and the vocabulary matmuls run in, with the fp32
    parameters as master weights (one low-precision copy of each weight per step); None = the parameters'
    own dtype, no autocast and no weight copies."""
    loss_scaling: bool
    """A dynamic loss scale multiplies the loss before backward (fp16's narrow exponent would flush small
    gradients to zero); a step whose gradients overflow is skipped and the scale halves."""
    accelerate: bool
    """accelerate's `--mixed_precision` has this value, so `pipeline.mixed_precision: null` can take it from
    the launcher."""
    description: str
    """One line for docs and errors."""

    @property
    def master_weights(self) -> bool:
        """Compute in a lower dtype than the (fp32) parameters."""
        return self.compute_dtype is not None


@dataclass(frozen=True)
class MemoryMode:
    """One value of `pipeline.memory`: what the vocabulary-parallel output layer keeps from S to T."""

    name: str
    """Table key: the value of `pipeline.memory` (and of `OutputLayerOptions.memory`)."""
    keeps_logits: bool
    """S keeps the shard's transformed logits (N x V_i fp32 per microbatch in flight) for T; False: S keeps
    only X and three softmax statistics per token, and T recomputes X W_iᵀ (one more matmul)."""
    description: str
    """One line for docs and errors."""


@dataclass(frozen=True)
class Checkpointing:
    """One value of `pipeline.activation_checkpointing`: which decoder layers recompute in backward."""

    name: str
    """Table key: the value of `pipeline.activation_checkpointing`."""
    every: int
    """Every `every`-th decoder layer of a chunk (local indices 0, every, 2 x every, ...) keeps only its input
    until backward and reruns its forward there (torch.utils.checkpoint, non-reentrant); 0 = no layer."""
    description: str
    """One line for docs and errors."""

    def layers(self, n: int) -> range:
        """Local indices of the checkpointed layers of a chunk of `n` decoder layers."""
        return range(0, n, self.every) if self.every else range(0)


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("no", None, None, False, True, "the parameters' dtype throughout (fp32 unless built otherwise)"),
        Precision(
            "bf16", "float32", "bfloat16", False, True, "bf16 compute, fp32 master weights, gradients and AdamW state"
        ),
        Precision(
            "fp16",
            "float32",
            "float16",
            True,
            True,
            "fp16 compute with a dynamic loss scale, fp32 master weights, gradients and AdamW state",
        ),
        Precision(
            "pure-bf16",
            "bfloat16",
            None,
            False,
            False,
            "bf16 parameters, gradients and AdamW state, no fp32 master copy (half the static memory)",
        ),
    )
}

MEMORY_MODES: dict[str, MemoryMode] = {
    m.name: m
    for m in (
        MemoryMode("store", True, "S keeps the shard's logits for T"),
        MemoryMode("recompute", False, "S keeps X and the row statistics; T recomputes the logits"),
    )
}

CHECKPOINTING: dict[str, Checkpointing] = {
    c.name: c
    for c in (
        Checkpointing("none", 0, "every decoder layer keeps its activations for backward"),
        Checkpointing("full", 1, "every decoder layer keeps only its input and recomputes in backward"),
        Checkpointing("selective", 2, "every other decoder layer of a chunk (1st, 3rd, ...) recomputes"),
    )
}


ZERO_LEVELS = (0, 1)
"""ZeRO stages there are (pipeline.zero, the planner's --zero): 0 (every data-parallel replica keeps the whole
optimizer state) and 1 (Adam's moments sharded over the replicas: runtime/zero.py)."""


def precision(name: str) -> Precision:
    """The precision called `name` (any case); ModeError if there is none."""
    return lookup(PRECISIONS, name, ModeError, f"mixed_precision: unknown value {name!r}")


def memory_mode(name: str) -> MemoryMode:
    """The output-layer memory mode called `name` (any case); ModeError if there is none."""
    return lookup(MEMORY_MODES, name, ModeError, f"memory: unknown value {name!r}")


def checkpointing(name: str) -> Checkpointing:
    """The activation-checkpointing mode called `name` (any case); ModeError if there is none."""
    return lookup(CHECKPOINTING, name, ModeError, f"activation_checkpointing: unknown value {name!r}")
