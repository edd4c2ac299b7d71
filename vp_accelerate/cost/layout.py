"""Which decoder layers each pipeline chunk gets: an even split, an explicit one, or the cost model's
balanced split ("redis": fewer layers on the stages that also run the vocabulary layers).

`plan_layout` is the one place the runtime (`PipelineModel`) and the launch check (`train.preflight`)
get a stage layout from; `for_schedule` gives the simulator the CostModel of a schedule with the same
kind of split. `cost_aware_schedule` (simulator, planner) and `layout_costs` (runtime) give the schedule
builder the pass costs it orders the passes by (schedule/list_schedule.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from vp_accelerate.schedule.build import build_schedule
from vp_accelerate.schedule.ir import Op, Schedule

from .costs import CPU_HARDWARE, CostModel, Hardware, even_layer_split
from .efficiency import GemmModel
from .shape import ModelShape, shape_from_hf_config

# The balanced split's default sequence length when the model allows it (the split hardly depends on it).
BALANCE_SEQ = 2048


def layout_counts(config, schedule: Schedule, layers_per_stage=None, *, seq: int | None = None) -> tuple[int, ...]:
    """Decoder layers per chunk (model order) `plan_layout` gives `schedule` for an HF `config` (object, dict
    or config.json path): `layers_per_stage` when given, else the cost model's balanced split for a method
    with `balanced_layers` (redis, costed at `seq`, default min(2048, max_position_embeddings)), else an even
    split. Raises models.LayoutError when the layers cannot fill the chunks. Needs no torch: the planner
    reads the runtime's split from it."""
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    layers = _get(config, "num_hidden_layers") or _get(config, "n_layer")
    chunks = schedule.num_chunks
    if layers_per_stage is not None:
        counts = [int(n) for n in layers_per_stage]
        if len(counts) != chunks or sum(counts) != layers:
            from vp_accelerate.models.layout import LayoutError  # models loads torch: only for the error

            raise LayoutError(
                f"layers_per_stage {counts} must have {chunks} entries (one per chunk) summing to "
                f"the model's {layers} decoder layers"
            )
    elif schedule.method.balanced_layers:
        if seq is None:
            seq = min(BALANCE_SEQ, _get(config, "max_position_embeddings") or BALANCE_SEQ)
        counts = redis_layer_split(config, chunks, seq=seq)
    elif not 1 <= chunks <= layers:
        from vp_accelerate.models.layout import split_counts

        counts = split_counts(layers, chunks)  # raises its LayoutError
    else:
        counts = even_layer_split(layers, chunks)
    return tuple(counts)


def plan_layout(config, schedule: Schedule, layers_per_stage=None, *, seq: int | None = None):
    """The `models.StageLayout` of `schedule` for an HF `config`: `layout_counts`' split.

    Raises models.LayoutError when the layers cannot fill the chunks. `seq` sets the sequence length
    the balanced split is costed at (default min(2048, max_position_embeddings)).
    """
    # models imports torch and transformers; the simulator, which never builds a layout, does not need them
    from vp_accelerate.models.layout import StageLayout

    counts = layout_counts(config, schedule, layers_per_stage, seq=seq)
    return StageLayout.from_counts(counts, schedule.chunk_rank)


def gpu_order(
    config,
    kind: str,
    method: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    chunks_per_rank: int | None = None,
    layers_per_stage=None,
    activation_checkpointing: str = "none",
    device: str = "cuda",
    evaluation: bool = True,
) -> tuple[Schedule, Schedule | None, tuple[int, ...]]:
    """(training schedule, evaluation schedule, layers per chunk) a rank of this layout runs on a `device`
    type: the passes ordered by `layout_costs` of the `layout_counts` split. The one place the runtime
    (`runtime.rank_parts.rank_schedules`), the dry run's planned figure and the planner's memory figure get
    the order a GPU runs from. `evaluation=False`: no evaluation schedule (None), which the planner skips."""
    common = dict(chunks_per_rank=chunks_per_rank)
    grid = build_schedule(kind, method, num_ranks, num_microbatches, **common)  # the unit-grid order: the layout
    counts = layout_counts(config, grid, layers_per_stage)
    costs = order_costs(config, grid, counts, activation_checkpointing, device=device)
    train = build_schedule(kind, method, num_ranks, num_microbatches, costs=costs, **common)
    evaluate = None
    if evaluation:
        evaluate = build_schedule(kind, method, num_ranks, num_microbatches, forward_only=True, costs=costs, **common)
    return train, evaluate, counts


def for_schedule(
    shape: ModelShape,
    schedule: Schedule,
    hw: Hardware | None = None,
    chunk_layers: tuple[int, ...] | None = None,
    activation_checkpointing: str = "none",
) -> CostModel:
    """The CostModel of `schedule`: `chunk_layers` when given, else the balanced split (redis_layer_split)
    for a method with `balanced_layers`, else an even split; `activation_checkpointing` as PipelineConfig's."""
    hw = hw or Hardware()
    if chunk_layers is None:
        if schedule.method.balanced_layers:
            if schedule.num_chunks != schedule.num_ranks:
                raise ValueError("redis balances one chunk per rank (schedule kind 1f1b)")
            # the runtime balances its split from the config, TP or not (`layout_counts`): so does the planner
            chunk_layers = redis_layer_split(dataclasses.replace(shape, tp=1), schedule.num_ranks, hw=hw)
        else:
            chunk_layers = even_layer_split(shape.layers, schedule.num_chunks)
    return CostModel(
        shape,
        schedule.method.name,
        schedule.chunk_rank,
        tuple(chunk_layers),
        hw,
        split_backward=schedule.split_backward,
        activation_checkpointing=activation_checkpointing,
        gemm=GemmModel(sms=hw.sms),
    )


def cost_aware_schedule(
    shape: ModelShape,
    kind: str,
    method: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    chunks_per_rank: int | None = None,
    forward_only: bool = False,
    hw: Hardware | None = None,
    chunk_layers: tuple[int, ...] | None = None,
    activation_checkpointing: str = "none",
    costs=None,
) -> tuple[Schedule, CostModel]:
    """(schedule, cost model): the schedule built from this layout's pass costs (build_schedule's
    `costs`) and the CostModel that times it (`for_schedule`'s arguments). `costs`: a function of the
    CostModel giving other pass costs to order by (e.g. measured ones), else the CostModel itself."""
    # the layout (chunk owners, split backward) does not depend on the microbatch count: a short step gives it
    layout = build_schedule(kind, method, num_ranks, num_ranks, chunks_per_rank, forward_only)
    model = for_schedule(shape, layout, hw, chunk_layers, activation_checkpointing)
    order_by = costs(model) if costs is not None else model
    return build_schedule(
        kind, method, num_ranks, num_microbatches, chunks_per_rank, forward_only, costs=order_by
    ), model


def layout_costs(
    config,
    schedule: Schedule,
    layout,
    activation_checkpointing: str = "none",
    seq: int | None = None,
    device: str = "cuda",
) -> CostModel:
    """`order_costs` of a models.StageLayout's split."""
    counts = tuple(end - start for start, end in layout.chunk_layers)
    return order_costs(config, schedule, counts, activation_checkpointing, seq, device)


def order_costs(
    config,
    schedule: Schedule,
    counts: tuple[int, ...],
    activation_checkpointing: str = "none",
    seq: int | None = None,
    device: str = "cuda",
) -> CostModel:
    """The CostModel of an HF `config` run as `schedule` with `counts` decoder layers per chunk on a
    `device` type ("cuda": the GPU model; "cpu": CPU_HARDWARE with the plain FLOP model): what the
    runtime orders its schedule by. `seq` defaults to the balanced split's (min(2048, max positions));
    the order hardly depends on it."""
    if seq is None:
        seq = min(BALANCE_SEQ, _get(config, "max_position_embeddings") or BALANCE_SEQ)
    shape = shape_from_hf_config(config, seq=seq)
    cpu = device == "cpu"
    model = for_schedule(
        shape,
        schedule,
        CPU_HARDWARE if cpu else None,
        chunk_layers=tuple(counts),
        activation_checkpointing=activation_checkpointing,
    )
    return dataclasses.replace(model, gemm=None) if cpu else model


def _get(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


@dataclass(frozen=True)
class StageCosts:
    """Fwd+bwd time (any unit) of one transformer layer and of the extras on the first and last stage."""

    layer: float
    """One transformer layer."""
    first: float
    """Input embedding (and whatever else only the first stage runs)."""
    last: float
    """Output layer and loss."""


def redis_layer_split(
    model,
    num_stages: int,
    costs: StageCosts | None = None,
    *,
    seq: int = 2048,
    vocab: int | None = None,
    hw: Hardware | None = None,
    min_layers: int = 1,
    min_end_layers: int = 0,
) -> tuple[int, ...]:
    """Layers per stage that minimise the slowest stage's time (the "redis" baseline): the last stage,
    which also runs the output layer, and the first, which runs the embedding, get fewer layers —
    none when the output layer alone costs a stage's share (as the paper's split does at 256k).

    model: a layer count (then `costs` is required), a ModelShape, or an HF config (object, dict or
    path of config.json; `seq`, default 2048, and `vocab` complete it). Every inner stage keeps at least
    `min_layers` layers, the first and the last at least `min_end_layers` (their chunks still run the
    vocabulary layers and the final norm).
    """
    if isinstance(model, int):
        if costs is None:
            raise ValueError("redis_layer_split(num_layers, ...) needs costs=StageCosts(layer, first, last)")
        num_layers = model
    else:
        shape = model if isinstance(model, ModelShape) else shape_from_hf_config(model, seq=seq, vocab=vocab)
        num_layers = shape.layers
        if costs is None:
            hw = hw or Hardware()
            probe = CostModel(shape, "baseline", (0, 1), (1, 1), hw)
            layer = probe.pass_time(0, Op.F, 0) + probe.pass_time(0, Op.B, 0) - 2 * probe._gather_time()
            last = probe.pass_time(1, Op.F, 1) + probe.pass_time(1, Op.B, 1) - layer
            costs = StageCosts(layer=layer, first=2 * probe._gather_time(), last=last)
    least = [min_layers] * num_stages
    if num_stages > 1:
        least[0] = least[-1] = min(min_layers, min_end_layers)
    else:
        least = [max(1, min_layers)]
    if sum(least) > num_layers:
        raise ValueError(f"{num_layers} layers cannot give {num_stages} stages {min_layers} layer(s) each")
    extra = [costs.first] + [0.0] * (num_stages - 2) + [costs.last] if num_stages > 1 else [costs.first + costs.last]

    def capacity(limit: float) -> list[int]:
        return [max(0, math.floor((limit - e) / costs.layer + 1e-9)) for e in extra]

    candidates = sorted({e + k * costs.layer for e, lo in zip(extra, least) for k in range(lo, num_layers + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # smallest stage-time limit under which the stages can hold every layer
        mid = (lo + hi) // 2
        caps = capacity(candidates[mid])
        if all(c >= n for c, n in zip(caps, least)) and sum(caps) >= num_layers:
            hi = mid
        else:
            lo = mid + 1
    counts = capacity(candidates[lo])
    while sum(counts) > num_layers:  # give back the surplus from the currently slowest stages
        i = max(
            (i for i in range(num_stages) if counts[i] > least[i]),
            key=lambda i: (extra[i] + counts[i] * costs.layer, counts[i]),
        )
        counts[i] -= 1
    return tuple(counts)
