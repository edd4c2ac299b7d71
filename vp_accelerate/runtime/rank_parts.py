"""Build what one rank holds and runs: its schedules, layout, vocabulary shard and modules.

PipelineModel calls `build_rank_parts` once; the executor (`step_run.py`) runs the result. Every rank
computes the same schedules and layout from the same inputs, so no rank needs to tell another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vp_accelerate.cost import gpu_order
from vp_accelerate.models import RankModules, StageLayout, build_rank, resolve_config
from vp_accelerate.models.lora import apply_lora
from vp_accelerate.runtime import precision, tensor_parallel
from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.runtime.groups import Groups, grid_rank
from vp_accelerate.runtime.weight_grad import WeightGradStore, install
from vp_accelerate.schedule.ir import Schedule
from vp_accelerate.vocab.output_layer import OutputLayerOptions
from vp_accelerate.vocab.partition import VocabPartition


@dataclass
class RankParts:
    """One rank's share of the model and the orders it runs them in."""

    hf_config: object
    """The model's HF config (`PretrainedConfig`)."""
    schedule: Schedule
    """The training step's action lists (the cost-aware order of the layout's pass costs)."""
    eval_schedule: Schedule
    """The forward-only (evaluation) step's action lists."""
    layout: StageLayout
    """Which decoder layers each chunk holds and which rank holds it."""
    partition: VocabPartition | None
    """The vocabulary shards (None without vocabulary parallelism)."""
    mods: RankModules
    """This rank's chunks and vocabulary pieces, parameters named as in HF."""
    lora_transposed: list[str]
    """HF names of LoRA-adapted modules whose base is a transposed (Conv1D) linear layer."""
    tied_group: object
    """Baseline with tied weights on two ranks: the group of this replica's first and last stage (their
    gradients add up), else None."""
    out_opts: OutputLayerOptions
    """How the output layer runs (algorithm, memory mode, chunking, the model's logit transforms)."""
    weight_grads: WeightGradStore | None
    """Split-backward schedules (V-Half): where B leaves the weight-gradient work W runs; else None."""


def rank_schedules(hf_config, cfg: PipelineConfig, pp_size: int, device_type: str):
    """(training schedule, evaluation schedule, layout) every rank of `cfg` runs on a `device_type` device
    ("cuda" or "cpu": the pass costs the order is built from differ): `cost.gpu_order`, which the planner's
    memory figure reads too. Every rank computes the same order from the same inputs."""
    train, evaluate, counts = gpu_order(
        hf_config,
        cfg.schedule,
        cfg.method,
        pp_size,
        cfg.microbatches,
        chunks_per_rank=cfg.chunks_per_rank,
        layers_per_stage=cfg.layers_per_stage,
        activation_checkpointing=cfg.activation_checkpointing,
        device=device_type,
    )
    return train, evaluate, StageLayout.from_counts(counts, train.chunk_rank)


def build_rank_parts(
    source,
    cfg: PipelineConfig,
    groups: Groups,
    dtype: torch.dtype,
    seed: int,
    device: torch.device,
    adapter: AdapterConfig,
) -> RankParts:
    """Schedules, layout, vocabulary shard and modules of this rank (`groups.pp_rank`) for `cfg`."""
    g = groups
    hf_config = resolve_config(source)
    schedule, eval_schedule, layout = rank_schedules(hf_config, cfg, g.pp_size, device.type)
    vocab = schedule.method.vocab_parallel
    # the vocabulary over all pp x tp ranks of a replica (vocabulary rank = pp_rank * tp + tp_rank)
    partition = VocabPartition(hf_config.vocab_size, g.vocab_size_ranks, cfg.pad_multiple) if vocab else None
    mods = build_rank(
        source,
        layout,
        g.pp_rank,
        "vocab" if vocab else "baseline",
        partition,
        dtype=dtype,
        seed=seed,
        device=device,
        attn_implementation=cfg.attn_implementation,
        tp=tensor_parallel.spec(cfg, g),
    )
    lora_transposed: list[str] = []
    if adapter.enabled:  # before the B/W split patches the linear layers (LoRA's included)
        lora_transposed = apply_lora(mods, adapter, seed, dtype)
        compute = precision.low_dtype(precision.resolve(cfg.mixed_precision))
        if adapter.frozen_in_compute_dtype and compute is not None:  # 2 bytes per frozen weight, not 4 + 2
            precision.hold_frozen(mods.chunks.values(), compute)
    # without VP the algorithm is unused (the last stage runs the whole output layer): keep the default
    out_opts = OutputLayerOptions(
        algorithm=schedule.method.output_algorithm or OutputLayerOptions.algorithm,
        memory=cfg.memory,
        chunk_size=cfg.chunk_size,
        label_smoothing=cfg.label_smoothing,
        softcap=mods.final_softcap,
        logit_scale=mods.logit_scale,
    )
    for chunk in mods.chunks.values():
        chunk.set_activation_checkpointing(cfg.activation_checkpointing)
    weight_grads = None
    if schedule.split_backward:
        weight_grads = WeightGradStore()
        for chunk in mods.chunks.values():
            install(chunk, weight_grads)
    return RankParts(
        hf_config=hf_config,
        schedule=schedule,
        eval_schedule=eval_schedule,
        layout=layout,
        partition=partition,
        mods=mods,
        lora_transposed=lora_transposed,
        tied_group=tied_group(groups, layout, vocab, bool(mods.tied)),
        out_opts=out_opts,
        weight_grads=weight_grads,
    )


def tied_group(groups: Groups, layout: StageLayout, vocab: bool, tied: bool):
    """Baseline with tied weights: the first and last stage each hold the matrix (under TP, each TP rank its row
    block) and must add their gradients. Every rank creates every pair group (new_group is collective)."""
    first, last = layout.first_rank, layout.last_rank
    if vocab or not tied or first == last:
        return None
    mine = None
    for d in range(groups.dp_size):
        for t in range(groups.tp_size):  # under TP: each TP rank's row block, on the first and the last stage
            pair = [grid_rank(d, s, t, groups.pp_size, groups.tp_size) for s in (first, last)]
            group = dist.new_group(pair)
            if groups.rank in pair:
                mine = group
    return mine
