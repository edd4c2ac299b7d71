"""One rank's device memory as the planner prices it, term by term (`rank_memory`), and the headroom it
reserves beyond what the caching allocator's tensors hold (`reserve_bytes`).

The planner (sim/plan.py) ranks and screens layouts on `RankMemory.total`; a dry run of the runtime can
call `rank_memory` per rank and compare term by term.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import CostModel
from .data_parallel import SHARDED_BYTES
from .shape import ModelShape

CONTEXT_BYTES = 1.0e9
"""The CUDA context and the kernels' modules loaded on the device: outside PyTorch's allocator (PyTorch's
"CUDA memory management" notes: memory the allocator does not report includes the context), measured at
0.5-1 GB on H100 with CUDA 12; the planner reserves the upper figure."""

COMMUNICATOR_BYTES = 0.7e9
"""NCCL's device buffers per communicator a rank uses, NVLS off. Public measurements: 544 MB per 2-rank and
688 MB per 3-4-rank communicator on A100 NVLink after one all-reduce (NVIDIA/nccl issue 964), 1.6 GB for one
communicator in another report (issue 864); NCCL's maintainer: the memory grows with the channels, i.e. with
the link bandwidth NCCL aims for (more on H100 than A100), and each communicator holds its own unless made by
ncclCommSplit with shared resources (issue 986), which torch's new_group does not ask for. The planner takes
0.7 GB (the A100 figure rounded up; a GPU lease measures it, scripts/gpu_check.py). NVLS (NVLink SHARP, H100
and later, communicators of more than 2 ranks in a node) adds its own buffers (vLLM issue 9699's log: 288 MiB
per rank of a communicator); `vp-accelerate launch` sets NCCL_NVLS_ENABLE=0, as NVIDIA's NeMo launcher and
JAX-Toolbox do for memory (NeMo-Framework-Launcher PR 127, JAX-Toolbox PR 383), so it is not counted."""

FRAGMENTATION = 0.05
"""Fraction of the allocator's bytes lost to fragmentation (blocks rounded up, split blocks that cannot
be reused for a larger request): reserved minus allocated in PyTorch's memory stats. No public figure for a
pipeline step was found; 5% stands until a GPU lease measures it (scripts/gpu_check.py's memory part, with
and without expandable segments). `vp-accelerate launch` sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
NVIDIA's first fix for fragmentation-induced out-of-memory (NeMo Megatron-Bridge's memory-tuning guide: "zero
performance cost", in most of its launch templates)."""


@dataclass(frozen=True)
class RankMemory:
    """Device bytes of one pipeline rank at its peak."""

    parameters: float
    """The fp32 parameters (the master copy) and the step's 16-bit weight copy under mixed precision."""
    gradients: float
    """fp32 gradients (CostModel.grad_bytes per parameter)."""
    optimizer: float
    """Adam's m and v (sharded over the dp replicas under ZeRO-1) and any further optimizer bytes."""
    activation_peak: float
    """The most activations (and VP output-layer states, and the transfer buffers) held at once in a step."""
    save_extra: float
    """What saving a checkpoint adds on the device: 0, since model and ZeRO state stream to the host one
    tensor at a time (runtime/zero.py `ZeroOptimizer.state_dict`), and a save runs between steps, when no
    activation is held."""
    reserve: float
    """Outside the tensors: the CUDA context, NCCL buffers per communicator, allocator fragmentation."""

    @property
    def static(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        """The rank's peak: static state, the larger of the step's activations and the save's extra, reserve."""
        return self.static + max(self.activation_peak, self.save_extra) + self.reserve

    def largest_term(self) -> str:
        """The name of the largest term (for a one-line error when a layout does not fit)."""
        terms = {k: getattr(self, k) for k in ("parameters", "gradients", "optimizer", "activation_peak", "reserve")}
        return max(terms, key=terms.get)


def communicators(pp: int, dp: int, vocab_parallel: bool, tied: bool = False, tp: int = 1) -> int:
    """NCCL communicators a rank holds, each connected before the first step (`runtime.groups.warm_up`): the
    world's, the pipeline's (its p2p too, pp > 1), the vocabulary group's (VP), the tensor-parallel group's
    (tp > 1), the data-parallel group's (dp > 1) and the tied-embedding pair's (`tied`: the first and last
    stage of a baseline with tied weights). The host-side groups are gloo: host memory, not counted."""
    return 1 + (pp > 1) + (vocab_parallel and pp * tp > 1) + (tp > 1) + (dp > 1) + bool(tied)


def tied_ranks(tied_weights: bool, vocab_parallel: bool, chunk_rank) -> set[int]:
    """The pipeline ranks in a tied-embedding pair group (`runtime.rank_parts.tied_group`): the first and the
    last stage of a baseline whose model ties its input and output embeddings, when they differ."""
    first, last = chunk_rank[0], chunk_rank[-1]
    return {first, last} if tied_weights and not vocab_parallel and first != last else set()


def reserve_bytes(allocated: float, pp: int, dp: int, vocab_parallel: bool, tied: bool = False, tp: int = 1) -> float:
    """Headroom beyond `allocated` tensor bytes: CONTEXT_BYTES + COMMUNICATOR_BYTES per communicator +
    FRAGMENTATION of the allocated bytes."""
    comms = communicators(pp, dp, vocab_parallel, tied, tp)
    return CONTEXT_BYTES + COMMUNICATOR_BYTES * comms + FRAGMENTATION * allocated


def allocated_of(total: float, pp: int, dp: int, vocab_parallel: bool, tied: bool = False, tp: int = 1) -> float:
    """The tensor bytes of a `rank_memory` total (its reserve taken off): what an allocator counter sees."""
    comms = communicators(pp, dp, vocab_parallel, tied, tp)
    return (total - CONTEXT_BYTES - COMMUNICATOR_BYTES * comms) / (1 + FRAGMENTATION)


def rank_memory(model: CostModel, rank: int, activation_peak: float, dp: int = 1) -> RankMemory:
    """The memory of `rank` under `model` (its optimizer_shards = the ZeRO-1 dp size, or 1), given the
    activation peak read off the rank's order of passes (sim.simulate.order_peak_memory minus the static
    bytes, or a simulation's peak_activation_bytes). Terms in bytes: parameters (16-bit weight copy + fp32
    master), gradients, optimizer (Adam's m and v, sharded under ZeRO-1), activation_peak, save_extra,
    reserve (context, NCCL, fragmentation); `total` is their peak sum."""
    n = model.rank_params(rank)
    whole = model.optimizer_bytes - min(SHARDED_BYTES, model.optimizer_bytes)  # the fp32 master copy (CostModel)
    parameters = n * whole + model.copied_params(rank) * model.shape.dtype_bytes
    gradients = n * model.grad_bytes
    optimizer = model.sharded_params(rank) * min(SHARDED_BYTES, model.optimizer_bytes)  # ZeRO-1: the fullest share
    allocated = parameters + gradients + optimizer + activation_peak
    reserve = reserve_bytes(allocated, model.num_ranks, dp, model.vocab_parallel, _tied(model, rank), model.shape.tp)
    return RankMemory(parameters, gradients, optimizer, activation_peak, 0.0, reserve)


def _tied(model: CostModel, rank: int) -> bool:
    return rank in tied_ranks(model.shape.tied, model.vocab_parallel, model.chunk_rank)


LORA_TARGETS = ("q_proj", "v_proj")
"""peft's default LoRA targets for the Llama family (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`),
what the runtime adapts when adapter.target_modules is null."""


def _linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of a Llama-style decoder layer's linear modules, by their HF names."""
    h, q, kv, f = shape.hidden, shape.q_width(), shape.kv_width(), shape.ffn
    out = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "up_proj": (h, f)}
    out["down_proj"] = (f, h)
    if shape.mlp_matrices == 3:
        out["gate_proj"] = (h, f)
    return out


ROW_SPLIT = frozenset({"o_proj", "down_proj"})
"""The linears a TP plan splits by their input features (rowwise: Llama's `base_model_tp_plan`); the others of
`_linear_shapes` are split by their output features (colwise)."""


def lora_layer_params(shape: ModelShape, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> float:
    """Adapter parameters of one decoder layer on one TP rank: r x (in + out) per adapted linear (A: r x in, B: out x
    r); under tensor parallelism (`shape.tp`) as models/lora.py `split_adapters` shards them: a column-split base
    keeps A whole and 1/tp of B's rows (r x (in + out/tp)), a row-split one 1/tp of A's columns and B whole (r x
    (in/tp + out)). `targets` are HF module names ("all-linear": every one); ValueError for a name the shape has no
    size for."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    linears = _linear_shapes(shape)
    names = tuple(linears) if tuple(targets) == ("all-linear",) else tuple(targets)
    unknown = [t for t in names if t not in linears]
    if unknown:
        raise ValueError(
            f"LoRA targets {unknown}: the planner knows the sizes of {sorted(linears)} (or all-linear); "
            f"name those, or plan without --lora-rank"
        )
    t = shape.tp
    return sum(rank * (i / t + o if n in ROW_SPLIT else i + o / t) for n, (i, o) in ((n, linears[n]) for n in names))


def lora_rank_memory(
    model: CostModel, rank: int, activation_peak: float, lora_rank: int, dp: int = 1, targets=LORA_TARGETS
) -> RankMemory:
    """`rank_memory` of a LoRA run (models/lora.py, adapter.frozen_in_compute_dtype): the frozen decoder weights
    held in the compute dtype (2 bytes each: no fp32 copy, no gradient, no optimizer state); the frozen vocabulary
    shards (embedding, output layer) in fp32 (autocast casts one per call); each adapter parameter as a trained one
    (16-bit copy + fp32 master, fp32 gradient, Adam's m and v, sharded under ZeRO-1)."""
    s = model.shape
    layers = sum(n for c, n in enumerate(model.chunk_layers) if model.chunk_rank[c] == rank)
    frozen = layers * s.rank_layer_params()  # one TP rank's slices
    vocab = model.rank_params(rank) - frozen
    adapters = layers * lora_layer_params(s, lora_rank, targets)
    sharded = min(SHARDED_BYTES, model.optimizer_bytes)
    master = model.optimizer_bytes - sharded  # the fp32 master copy
    # the frozen vocabulary shards stay fp32 (runtime/rank_parts.py holds only the decoder chunks in the compute
    # dtype); no step copy of them is kept: autocast casts one per call (CostModel.transient_bytes, S and T)
    held = s.dtype_bytes + 4 if model.split_backward and model.vocab_parallel else 4  # see CostModel._frozen_vocab
    parameters = frozen * s.dtype_bytes + vocab * held + adapters * (s.dtype_bytes + master)
    gradients = adapters * model.grad_bytes
    optimizer = adapters * sharded / model.optimizer_shards
    allocated = parameters + gradients + optimizer + activation_peak
    reserve = reserve_bytes(allocated, model.num_ranks, dp, model.vocab_parallel, _tied(model, rank), model.shape.tp)
    return RankMemory(parameters, gradients, optimizer, activation_peak, 0.0, reserve)


def run_memory(
    model: CostModel, rank: int, activation_peak: float, dp: int = 1, lora_rank: int | None = None, targets=LORA_TARGETS
) -> RankMemory:
    """The rank's memory for the run: full training (`rank_memory`), or LoRA of rank `lora_rank` on `targets`
    (`lora_rank_memory`)."""
    if lora_rank is None:
        return rank_memory(model, rank, activation_peak, dp)
    return lora_rank_memory(model, rank, activation_peak, lora_rank, dp, targets)
