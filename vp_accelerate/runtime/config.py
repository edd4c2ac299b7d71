"""`PipelineConfig`: how to cut the model and which schedule runs it.

This one dataclass is both the `PipelineModel` argument and the training recipe's `pipeline:` section
(the recipe loader reads the section straight into it, so a field added here is a recipe key at once,
with this docstring as its documentation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from vp_accelerate import modes
from vp_accelerate.schedule.registry import METHODS, SCHEDULES, normalise_method, normalise_schedule

# The recipe loader checks these (case-insensitively, with a "did you mean"); the names are the tables' keys
# (schedule.registry for schedules and methods, vp_accelerate/modes.py for the modes).
ScheduleName = Literal[tuple(SCHEDULES) + ("auto",)]
AUTO = "auto"  # schedule "auto": the trainer asks the planner (sim/plan.py) for the whole layout
MethodName = Literal[tuple(METHODS)]
MemoryName = Literal[tuple(modes.MEMORY_MODES)]
PrecisionName = Literal[tuple(modes.PRECISIONS)]
CheckpointingName = Literal[tuple(modes.CHECKPOINTING)]


@dataclass
class PipelineConfig:
    """How to cut the model and which schedule runs it (the recipe's `pipeline:` section)."""

    schedule: ScheduleName = "1f1b"
    """Pipeline schedule, a key of schedule.registry.SCHEDULES (any case): "1f1b", "vhalf" (zero-bubble
    V shape, B/W split) or "interleaved"; or "auto" (recipes only): the trainer simulates every layout
    (`vp-accelerate plan`) and takes the fastest that fits — schedule, method, microbatches, memory,
    dp_size and pp_size are then the plan's, printed at start."""

    method: MethodName = "vocab-2"
    """Where the vocabulary layers live, a key of schedule.registry.METHODS (any case): "baseline"
    (embedding on the first stage, head + loss on the last), "redis" (baseline with fewer layers on the
    first/last stage), "vocab-1" or "vocab-2" (sharded over all pipeline ranks; vocab-2 has one barrier
    and is the default), "interlaced" (1F1B only: the paper's interlaced baseline, sharded as vocab-1 but
    run synchronously on every rank between the pipeline passes; about 1.5 x pp_size microbatches held)."""

    microbatches: int = 8
    """Microbatches per optimizer step per data-parallel replica; the replica's batch (the first dimension
    given to `train_step`) must divide by it."""

    memory: MemoryName = "store"
    """Output-layer S->T state, a key of modes.MEMORY_MODES: "store" keeps the shard's logits, "recompute"
    keeps X and the softmax statistics and recomputes the logits in T."""

    chunk_size: Optional[int] = None
    """Vocabulary rows per chunk inside the S and T passes (bounds the transient memory); None = whole shard."""

    pp_size: Optional[int] = None
    """Pipeline ranks; None = world size / dp_size."""

    dp_size: int = 1
    """Data-parallel replicas of the pipeline."""

    tp_size: int = 1
    """Tensor-parallel ranks per pipeline stage: each stage's decoder layers are split over tp consecutive
    ranks (Megatron's column / row split of attention and MLP, as the family's `base_model_tp_plan` says;
    keep them inside one node), and the vocabulary over all pp_size x tp_size ranks of a replica (methods
    baseline and redis: the end stages' embedding and output layer split by rows over their TP ranks, as
    Megatron's vocabulary-parallel layers; interlaced is refused). World size = pp_size x tp_size x dp_size.
    1 = no tensor parallelism."""

    sequence_parallel: Optional[bool] = None
    """With tp_size > 1: keep the norms and the residual stream between a stage's layers on 1/tp of the
    sequence per TP rank (all-gather before attention and MLP, reduce-scatter after), so their activations
    are not held tp times. None = on whenever tp_size > 1."""

    zero: int = 1
    """ZeRO stage over data parallelism: 1 shards the optimizer state (AdamW's moments) over the dp_size
    replicas, each parameter's state on one replica, which updates it and broadcasts the result (bytes
    per fp32 parameter 4 + 4 + 8/dp_size instead of 16; the same updates bit for bit); 0 keeps a full copy
    on every replica. Nothing to shard with dp_size 1. Used by `PipelineModel.make_optimizer` (the trainer
    builds its AdamW through it)."""

    chunks_per_rank: Optional[int] = None
    """Model chunks per rank for the interleaved schedule (default 2); 1f1b always has 1 and vhalf 2."""

    label_smoothing: float = 0.0
    """Cross-entropy label smoothing, as torch.nn.functional.cross_entropy."""

    pad_multiple: int = 1
    """Pad each vocabulary shard to a multiple of this many rows (64 suits GPU matmuls)."""

    layers_per_stage: Optional[tuple[int, ...]] = None
    """Explicit decoder layers per chunk in model order; None = an even split (or the cost model's for redis).
    The first and the last chunk may hold none (they still run the vocabulary layers and the final norm)."""

    attn_implementation: Optional[str] = None
    """HF attention kernel ("eager", "sdpa", ...); None = the model's default."""

    mixed_precision: Optional[PrecisionName] = None
    """The run's precision, a key of modes.PRECISIONS (any case). "bf16" or "fp16": compute in that dtype
    with fp32 master weights (the decoder chunks under torch.autocast, the vocabulary matmuls in that
    dtype), while parameters, gradients (accumulated over microbatches), optimizer state and the softmax
    statistics stay fp32; fp16 adds a dynamic loss scale: a step whose gradients overflow is reported as
    skipped (`StepResult.skipped`; step the optimizer with `pipe.step(optimizer)`). "pure-bf16": the
    parameters, their gradients and the AdamW state are bf16 themselves (no fp32 master copy, half the
    static memory; updates below bf16's resolution are lost). "no": everything in the dtype the model is
    built in. None = "no" for PipelineModel; in training, accelerate's `--mixed_precision` (no, bf16, fp16)."""

    activation_checkpointing: CheckpointingName = "none"
    """Recompute decoder-layer activations in backward instead of keeping them (torch.utils.checkpoint,
    non-reentrant), a key of modes.CHECKPOINTING: "full" checkpoints every decoder layer (each keeps only
    its input until backward), "selective" every other layer of each chunk (the 1st, 3rd, ...), halving the
    saving and the extra forward compute."""

    plan_memory_gb: Optional[float] = None
    """With schedule "auto": memory per rank the plan may fill, GB; None = the GPU's total memory (on CPU
    the host's memory divided by the ranks)."""

    plan_tp_sizes: Optional[tuple[int, ...]] = None
    """With schedule "auto": the tensor-parallel sizes the plan may pick. Each must divide the GPUs of a node (the
    launcher's LOCAL_WORLD_SIZE), the heads, the key/value heads, the MLP width and the sequence. None = 1, 2, 4
    and 8, as `vp-accelerate plan` searches; [1] = pipeline x data parallel layouts only."""

    dp_reduce_dtype: Optional[str] = None
    """dtype the data-parallel gradient all-reduce travels in: "bf16" halves its bytes (each bucket is cast
    to bf16, summed, and cast back into the fp32 gradients; the sum is rounded to bf16); None = the
    gradients' own dtype. The buckets of each decoder chunk are issued as soon as its last backward pass
    on the rank ran, overlapped with the rest of the step's backward."""

    watchdog_dead_after_s: Optional[float] = 60.0
    """Exit every rank when a peer fails or stops heartbeating for this long; None disables the watchdog."""

    watchdog_stall_s: Optional[float] = 300.0
    """With the watchdog on: when no pass of a step, nor a collective of the step's end (a data-parallel
    bucket, the loss sum, the clip norm, a ZeRO broadcast), has finished on any rank for this long, print
    every rank's current pass and what it waits for, and end the job; None = never (runtime/watchdog.py).
    Below the process group's own timeout (NCCL's default 600 s, gloo's 1800 s), so that this line, naming
    the pass, comes before the collective's timeout error (a sequence number)."""

    def __post_init__(self):
        # canonical names, so `1F1B` and `Vocab-2` work and an unknown name fails here with the valid ones
        if not (isinstance(self.schedule, str) and self.schedule.strip().lower() == AUTO):
            self.schedule = normalise_schedule(self.schedule)
        else:
            self.schedule = AUTO
        self.method = normalise_method(self.method)
        self.memory = modes.memory_mode(self.memory).name
        self.activation_checkpointing = modes.checkpointing(self.activation_checkpointing).name
        if self.mixed_precision is not None:
            self.mixed_precision = modes.precision(self.mixed_precision).name
        if self.layers_per_stage is not None:  # a list from the API or YAML; the layout wants a tuple
            self.layers_per_stage = tuple(self.layers_per_stage)

    def check(self) -> None:
        """Range checks that need no model or process group. Raises ValueError whose message starts with
        the field name (the recipe prefixes `pipeline.`)."""
        for name in ("microbatches", "dp_size", "tp_size", "pad_multiple"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        for name in ("pp_size", "chunk_size", "chunks_per_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1 or null, got {value}")
        if self.zero not in modes.ZERO_LEVELS:
            raise ValueError(f"zero: must be 0 (off) or 1 (optimizer state sharded over dp_size), got {self.zero}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing: must be in [0, 1), got {self.label_smoothing}")
        split = self.layers_per_stage
        if split is not None and (any(n < 0 for n in split) or any(n < 1 for n in split[1:-1])):
            raise ValueError(
                f"layers_per_stage: every chunk but the first and the last needs at least one layer "
                f"(the end chunks may hold none), got {list(split)}"
            )
        # again here: a field set after construction (`cfg.memory = ...`) is checked before it runs
        for name, lookup in (
            ("memory", modes.memory_mode),
            ("activation_checkpointing", modes.checkpointing),
            ("mixed_precision", modes.precision),
        ):
            if getattr(self, name) is not None:
                lookup(getattr(self, name))  # ModeError (a ValueError) "<name>: unknown value ..."
        if self.dp_reduce_dtype is not None and str(self.dp_reduce_dtype).strip().lower() not in ("bf16", "bfloat16"):
            raise ValueError(f"dp_reduce_dtype: must be bf16 or null, got {self.dp_reduce_dtype!r}")
        if self.watchdog_dead_after_s is not None and self.watchdog_dead_after_s <= 0:
            raise ValueError(f"watchdog_dead_after_s: must be > 0 or null, got {self.watchdog_dead_after_s}")
        if self.watchdog_stall_s is not None and self.watchdog_stall_s <= 0:
            raise ValueError(f"watchdog_stall_s: must be > 0 or null, got {self.watchdog_stall_s}")
