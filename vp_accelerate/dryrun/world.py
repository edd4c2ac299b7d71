"""A whole layout's dry run: the distinct ranks run once each (`run.run_rank`), the other replicas' programs
derived from them, the world replayed under NCCL's rules (`schedule/world.py`), the planner's figure beside
each rank's measured peak."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.schedule.world import Deadlock, replay_world

from .run import RankMemory, replica_program, run_rank, tp_program


@dataclass
class WorldResult:
    """Per pipeline rank of replica 0 its memory; the world's replay."""

    ranks: list[RankMemory]
    """TP rank 0 of each stage of replica 0 (global ranks s * tp); its stage's other TP ranks and replica d's
    counterparts run the same program on their own groups (derived, not run)."""
    planned_bytes: list[int | None]
    """The planner's per-rank figure for the same layout (None when it has none)."""
    deadlock: Deadlock | None
    """None when the whole world's programs finish under NCCL's rules."""
    ops: int
    """Operations replayed, all ranks together."""
    seconds: float
    """Host time of the whole dry run."""


def planned_bytes(config: dict, req, cfg: PipelineConfig) -> list[int | None]:
    """The planner's memory model of the layout `cfg`, per pipeline rank, as the dry run counts it (tensor
    bytes: no CUDA context, NCCL buffers or fragmentation), on the order a GPU rank runs (the cost-aware
    schedule `runtime.rank_parts.rank_schedules` builds; the planner's search screens with the block's grid
    order, an upper bound on it). The one place the dry run reads the planner's memory model."""
    from transformers import AutoConfig

    from vp_accelerate.runtime.rank_parts import rank_schedules
    from vp_accelerate.sim.plan import schedule_memory

    hf = AutoConfig.for_model(**config) if isinstance(config, dict) else config
    schedule, _, layout = rank_schedules(hf, cfg, cfg.pp_size, "cuda")
    counts = [end - start for start, end in layout.chunk_layers]
    mbs = req.global_batch // (cfg.dp_size * cfg.microbatches)
    zero = cfg.zero if cfg.dp_size > 1 else 0
    lora = dict(lora_rank=req.lora_rank, lora_targets=req.lora_targets) if req.lora_rank is not None else {}
    peaks = schedule_memory(
        config,
        schedule,
        counts,
        req.seq,
        mbs,
        cfg.activation_checkpointing,
        cfg.memory,
        zero,
        cfg.dp_size,
        **lora,
        tp=cfg.tp_size,
        attention=cfg.attn_implementation,
    )
    return [int(x) for x in peaks]


def dry_run_world(
    source, cfg: PipelineConfig, world_size: int, global_batch: int, seq: int, log=None, jobs: int = 1, adapter=None
) -> WorldResult:
    """Run TP rank 0 of every pipeline stage of replica 0 (global ranks s * tp) and replay the world of
    `cfg.dp_size` replicas of pp x tp ranks. `jobs` > 1 runs that many ranks at once, each in a fresh process
    (the ranks share nothing)."""
    t0 = time.perf_counter()
    pp, dp, tp = cfg.pp_size, cfg.dp_size, cfg.tp_size
    args = [(source, cfg, s * tp, world_size, global_batch // dp, seq, adapter) for s in range(pp)]
    results: dict[int, tuple] = {}

    def done(s: int, out) -> None:
        results[s] = out
        if log is not None:
            mem, program = out
            log(f"rank {mem.rank}: {mem.seconds:.1f} s, peak {mem.peak_bytes / 1e9:.2f} GB, {len(program)} operations")

    if jobs > 1:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no fake world leaks between ranks
        with ProcessPoolExecutor(max_workers=min(jobs, pp), mp_context=ctx) as pool:
            futures = {pool.submit(run_rank, *a): a[2] // tp for a in args}
            for f in as_completed(futures):
                done(futures[f], f.result())
    else:
        for a in args:
            done(a[2] // tp, run_rank(*a))
    mems = [results[s][0] for s in range(pp)]
    block = pp * tp
    stage = {s * tp + t: tp_program(results[s][1], tp, t) if t else results[s][1] for s in range(pp) for t in range(tp)}
    world = {d * block + r: replica_program(prog, block, d) for d in range(dp) for r, prog in stage.items()}
    deadlock = replay_world(world)
    return WorldResult(mems, [None] * pp, deadlock, sum(len(p) for p in world.values()), time.perf_counter() - t0)
