"""`vp-accelerate dryrun`: the real runtime of every distinct rank of a layout on this CPU, with fake tensors
and a fake process group (train/dryrun), its memory per rank beside the planner's, and the whole world's
communication replayed under NCCL's rules."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from vp_accelerate import exit_codes
from vp_accelerate.cost import GPU_PRESETS

from .plan import model_arg, run_shape

LAYOUT_FLAGS = ("schedule", "method", "pp", "tp", "microbatches", "memory", "zero", "checkpointing")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vp-accelerate dryrun",
        description="Run every distinct rank of a layout (the one `plan` picks, or the one given) with the "
        "real runtime on this CPU under fake tensors: build, one training step, the optimizer step, a "
        "checkpoint's state_dicts and an eval step; report each rank's memory as the CUDA allocator would "
        "count it, the planner's figure beside it, and whether the world's communication finishes under "
        "NCCL's rules. Exit 2 when a rank does not fit.",
    )
    ap.add_argument(
        "model",
        help="a preset name, a local model directory or an HF config.json (its config only), or a training recipe "
        "(.yaml: its model, data.seq_len, train.global_batch, pipeline layout unless auto, precision, attention "
        "and LoRA adapter; flags override them)",
    )
    ap.add_argument(
        "--world-size", type=int, help="GPUs in all (pp x tp x dp; a recipe with pipeline.pp_size gives it)"
    )
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (for the plan's layout)")
    ap.add_argument("--gpu", choices=tuple(GPU_PRESETS), default="h100", help="device preset (default h100)")
    ap.add_argument("--memory-gb", type=float, help="memory per GPU, GB (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (required unless MODEL is a recipe)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (required unless MODEL is a recipe)")
    ap.add_argument("--lora-rank", type=int, metavar="R", help="a LoRA run of rank R (default: full training)")
    ap.add_argument(
        "--lora-targets", nargs="+", metavar="MODULE", help="with --lora-rank: the adapted modules (peft's default)"
    )
    lay = ap.add_argument_group("layout (default: the plan's; give --schedule, --method, --pp and --microbatches)")
    lay.add_argument("--schedule", help="pipeline schedule (PipelineConfig.schedule)")
    lay.add_argument("--method", help="vocabulary method (PipelineConfig.method)")
    lay.add_argument("--pp", type=int, help="pipeline ranks; dp = world size / (pp x tp)")
    lay.add_argument(
        "--tp", type=int, help="tensor-parallel ranks per stage (default 1; sequence parallelism on, inside a node)"
    )
    lay.add_argument("--microbatches", type=int, help="microbatches per replica per step")
    ap.add_argument(
        "--all-microbatches",
        action="store_true",
        help="run every microbatch of the plan's or the recipe's layout (default: at most 2 x pp of them, where "
        "each rank's peak has set in and the planner reads its figure; an explicit --microbatches always runs)",
    )
    lay.add_argument("--memory", help="output-layer S->T state: store or recompute (default store)")
    lay.add_argument("--zero", type=int, choices=(0, 1), help="ZeRO stage over dp (default 1)")
    lay.add_argument("--checkpointing", help="activation checkpointing: none, selective or full (default none)")
    ap.add_argument(
        "--jobs", type=int, default=1, help="ranks run at once, each in its own process (default 1; up to the cores)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def _request(args):
    from vp_accelerate.cost.memory import LORA_TARGETS
    from vp_accelerate.sim.plan import PlanRequest

    hw, memory = GPU_PRESETS[args.gpu]
    return PlanRequest(
        gpus=args.world_size,
        memory_gb=args.memory_gb if args.memory_gb is not None else memory,
        seq=args.seq,
        global_batch=args.global_batch,
        hardware=hw,
        gpus_per_node=args.gpus_per_node,
        lora_rank=args.lora_rank,
        lora_targets=tuple(args.lora_targets or LORA_TARGETS),
    )


def _recipe_pipeline(recipe):
    """A recipe's own pipeline section (None when it asks for `auto` or has no recipe)."""
    if recipe is None or recipe.pipeline.schedule == "auto":
        return None
    return recipe.pipeline


def world_size(args, recipe) -> int:
    """--world-size, or a recipe's pipeline.pp_size x dp_size; ValueError when neither gives it or they differ."""
    p = _recipe_pipeline(recipe)
    given = [f for f in LAYOUT_FLAGS if getattr(args, f) is not None]
    from_recipe = None
    if p is not None and p.pp_size is not None and not given:
        from_recipe = p.pp_size * p.tp_size * p.dp_size
    if args.world_size is None:
        if from_recipe is None:
            raise ValueError("give --world-size (a recipe gives it only with pipeline.pp_size)")
        return from_recipe
    if from_recipe is not None and from_recipe != args.world_size:
        raise ValueError(
            f"--world-size {args.world_size} is not the recipe's pipeline.pp_size x tp_size x dp_size = "
            f"{from_recipe}; "
            f"drop --world-size, or give the layout flags"
        )
    return args.world_size


def adapter(args, recipe):
    """The AdapterConfig of the run: the recipe's LoRA section, --lora-rank / --lora-targets on top; None for
    full training."""
    from vp_accelerate.runtime.adapter_config import AdapterConfig

    base = recipe.adapter if recipe is not None and recipe.adapter.type == "lora" else None
    if args.lora_rank is None:
        return base
    out = base or AdapterConfig(type="lora")
    return dataclasses.replace(out, r=args.lora_rank, target_modules=list(args.lora_targets or []) or None)


def layout(args, config: dict, req, recipe=None):
    """The PipelineConfig to run: the explicit flags, the recipe's pipeline section, or the plan's best
    layout. ValueError on a bad one."""
    from vp_accelerate.cost.shape import default_attention
    from vp_accelerate.runtime.config import PipelineConfig

    given = [f for f in LAYOUT_FLAGS if getattr(args, f) is not None]
    own = _recipe_pipeline(recipe)
    if own is not None and not given:
        cfg = dataclasses.replace(
            own,
            pp_size=own.pp_size or args.world_size // (own.dp_size * own.tp_size),
            mixed_precision=own.mixed_precision or "bf16",  # accelerate's flag otherwise; a GPU run's usual
            attn_implementation=own.attn_implementation or default_attention(config),
        )
        return _checked(cfg, args)
    if given:
        missing = [f for f in ("schedule", "method", "pp", "microbatches") if getattr(args, f) is None]
        if missing:
            raise ValueError(f"an explicit layout needs --{' --'.join(missing)} too (or none of the layout flags)")
        tp = args.tp or 1
        if tp < 1 or args.pp < 1 or args.world_size % (args.pp * tp):
            raise ValueError(f"--pp {args.pp} x --tp {tp} does not divide --world-size {args.world_size}")
        node = args.gpus_per_node or args.world_size
        if node % tp:
            raise ValueError(
                f"--tp {tp}: a stage's TP ranks must share a node; give a tp that divides --gpus-per-node {node}"
            )
        section = dict(
            schedule=args.schedule,
            method=args.method,
            pp_size=args.pp,
            tp_size=tp,
            dp_size=args.world_size // (args.pp * tp),
            microbatches=args.microbatches,
            memory=args.memory or "store",
            zero=1 if args.zero is None else args.zero,
            activation_checkpointing=args.checkpointing or "none",
        )
    else:
        from vp_accelerate.sim.plan import best

        p = best(config, req)
        section = dict(p.pipeline_section(), zero=p.zero)
    # SDPA as a GPU run has it; eager for a family HF gives no SDPA path (Gemma-2: softcapped scores)
    attention = default_attention(config)
    return _checked(PipelineConfig(**section, mixed_precision="bf16", attn_implementation=attention), args)


def _checked(cfg, args):
    cfg.check()
    if cfg.pp_size * cfg.tp_size * cfg.dp_size != args.world_size:
        raise ValueError(
            f"pp {cfg.pp_size} x tp {cfg.tp_size} x dp {cfg.dp_size} is not --world-size {args.world_size}"
        )
    if args.global_batch % (cfg.dp_size * cfg.microbatches):
        raise ValueError(
            f"--global-batch {args.global_batch} does not divide into {cfg.dp_size} replicas x "
            f"{cfg.microbatches} microbatches"
        )
    return cfg


def dryrun_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        model = model_arg(args.model)
        run_shape(args, model)
        args.world_size = world_size(args, model.recipe)
        config = model.config
        lora = adapter(args, model.recipe)
        if lora is not None:
            args.lora_rank, args.lora_targets = lora.r, lora.target_modules
        req = _request(args)
        cfg = layout(args, config, req, model.recipe)
        from transformers import AutoConfig

        hf = AutoConfig.for_model(**config) if isinstance(config, dict) else config
        check_tensor_parallel(cfg, hf, args.seq, lora)
        cfg, args.global_batch, steady_note = steady_microbatches(cfg, args.global_batch, args)
        req = dataclasses.replace(req, global_batch=args.global_batch)  # the planner's figure at the same size
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    from vp_accelerate.cost.memory import reserve_bytes
    from vp_accelerate.dryrun import FakeWorldMissing

    try:
        from vp_accelerate.dryrun.world import dry_run_world, planned_bytes
    except FakeWorldMissing as e:  # one line, exit 2 (a torch without the private module it needs)
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    from vp_accelerate.schedule.registry import METHODS

    tp = cfg.tp_size
    log = None if args.json else (lambda line: print(line, flush=True))
    if log:
        ran = ", ".join(str(s * tp) for s in range(cfg.pp_size))
        others = []
        if tp > 1:
            others.append(f"each stage's TP ranks 1..{tp - 1} run TP rank 0's program on their own groups")
        if cfg.dp_size > 1:
            others.append(f"replicas 1..{cfg.dp_size - 1} run the same programs on their own groups")
        log(
            f"{args.model}: {cfg.schedule}/{cfg.method} pp={cfg.pp_size} tp={tp} dp={cfg.dp_size} "
            f"m={cfg.microbatches} memory={cfg.memory} zero={cfg.zero} ckpt={cfg.activation_checkpointing}, bf16 "
            f"mixed precision, seq {args.seq}, global batch {args.global_batch}; running global ranks {ran}"
            + (f" ({'; '.join(others)}: derived, not run)" if others else "")
        )
        if steady_note:
            log(steady_note)
    result = dry_run_world(hf, cfg, args.world_size, args.global_batch, args.seq, log=log, jobs=args.jobs, adapter=lora)
    result.planned_bytes = planned_bytes(config, req, cfg)
    limit = req.memory_gb * 1e9
    vocab_parallel = METHODS[cfg.method].vocab_parallel
    # what the card must also hold beside the tensors: the CUDA context, NCCL buffers, fragmentation (cost/memory.py)
    from vp_accelerate.cost.memory import tied_ranks
    from vp_accelerate.schedule import build_schedule

    chunk_rank = build_schedule(cfg.schedule, cfg.method, cfg.pp_size, cfg.pp_size, cfg.chunks_per_rank).chunk_rank
    tied = tied_ranks(bool(getattr(hf, "tie_word_embeddings", False)), vocab_parallel, chunk_rank)
    reserve = {
        m.rank: int(reserve_bytes(m.peak_bytes, cfg.pp_size, cfg.dp_size, vocab_parallel, m.rank in tied, tp))
        for m in result.ranks
    }
    rows = []
    for mem, planned in zip(result.ranks, result.planned_bytes):
        d = dataclasses.asdict(mem)
        d["planned_bytes"] = planned
        d["reserve_bytes"] = reserve[mem.rank]
        block = cfg.pp_size * tp
        d["replicas"] = [dd * block + mem.rank + t for dd in range(cfg.dp_size) for t in range(tp)]
        rows.append(d)
    over = [m for m in result.ranks if m.peak_bytes + reserve[m.rank] > limit]
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "world_size": args.world_size,
                    "layout": dataclasses.asdict(cfg),
                    "global_batch": args.global_batch,
                    "steady_state": steady_note,
                    "memory_bytes": int(limit),
                    "ranks": rows,
                    # the ranks run; every other rank's program is derived from one of theirs (`replicas`: the
                    # TP ranks of its stage and its counterparts in the other replicas)
                    "ran": [m.rank for m in result.ranks],
                    "deadlock": result.deadlock is not None,
                    "deadlock_detail": result.deadlock.describe() if result.deadlock else None,
                    "operations": result.ops,
                    "seconds": round(result.seconds, 1),
                }
            )
        )
    else:
        print(_table(rows))
        print(
            f"communication: {result.ops} operations of {args.world_size} ranks replayed under NCCL's rules "
            f"(CUDA_DEVICE_MAX_CONNECTIONS=1): {'DEADLOCK' if result.deadlock else 'finishes'}; "
            f"{result.seconds:.0f} s"
        )
        if result.deadlock:
            print(result.deadlock.describe())
    if over:
        worst = max(over, key=lambda m: m.peak_bytes + reserve[m.rank])
        term, nbytes = worst.largest_term()
        need = worst.peak_bytes + reserve[worst.rank]
        print(
            f"error: rank {worst.rank} needs {need / 1e9:.2f} GB ({worst.peak_bytes / 1e9:.2f} GB of tensors + "
            f"{reserve[worst.rank] / 1e9:.2f} GB reserve: CUDA context, NCCL buffers, fragmentation), above "
            f"{limit / 1e9:g} GB per GPU; its largest term is {term} ({nbytes / 1e9:.2f} GB): choose a layout with "
            f"more pipeline ranks, ZeRO-1 or activation checkpointing",
            file=sys.stderr,
        )
        return exit_codes.USER_ERROR
    return 1 if result.deadlock else 0


def steady_microbatches(cfg, global_batch: int, args) -> tuple:
    """(layout, global batch, note) to run. A plan's or a recipe's layout with more than 2 x pp microbatches runs 2 x
    pp of them, at the same microbatch size: each rank's activation peak has set in by then (the steady state of
    every schedule here) and it is the planner's own basis (`sim.plan.ORDER_MICROBATCHES`), while a rank's dry run
    costs CPU in proportion to its microbatches (405B's plan: 512 a replica, 8x the 64 its peak needs). The note
    says so; `--all-microbatches`, or an explicit `--microbatches`, runs them all."""
    from vp_accelerate.sim.plan import ORDER_MICROBATCHES

    steady = ORDER_MICROBATCHES * cfg.pp_size
    if args.all_microbatches or args.microbatches is not None or cfg.microbatches <= steady:
        return cfg, global_batch, None
    size = global_batch // (cfg.dp_size * cfg.microbatches)
    note = (
        f"running {steady} of the layout's {cfg.microbatches} microbatches a replica (2 x pp, global batch "
        f"{size * cfg.dp_size * steady} of {global_batch}, microbatches of {size}): each rank's peak has set in by "
        f"then, as the planner reads it; --all-microbatches runs every one"
    )
    return dataclasses.replace(cfg, microbatches=steady), size * cfg.dp_size * steady, note


def check_tensor_parallel(cfg, hf_config, seq: int, adapter=None) -> None:
    """What the runtime refuses of a tp_size > 1 layout, before any rank runs (ValueError, one line): a method or
    adapter TP does not run, a model it cannot split, a sequence that does not split under sequence parallelism."""
    if cfg.tp_size == 1:
        return
    from vp_accelerate.models.tensor_parallel import check_config
    from vp_accelerate.runtime.tensor_parallel import check_layout, sequence_parallel

    check_layout(cfg, adapter)
    check_config(hf_config, cfg.tp_size)
    if sequence_parallel(cfg) and seq % cfg.tp_size:
        raise ValueError(
            f"--seq {seq} does not split over tp_size={cfg.tp_size} ranks under sequence parallelism; give a "
            f"sequence length divisible by {cfg.tp_size}"
        )


def _table(rows: list[dict]) -> str:
    gb = lambda x: "-" if x is None else f"{x / 1e9:.2f}"  # noqa: E731
    cols = ("param", "grad", "optim", "act-peak", "save", "peak", "planned")
    lines = [f"{'rank':>4} " + " ".join(f"{c:>9}" for c in cols) + "  (GB)"]
    for r in rows:
        vals = (
            r["param_bytes"],
            r["grad_bytes"],
            r["optimizer_bytes"],
            r["activation_peak_bytes"],
            r["save_bytes"],
            r["peak_bytes"],
            r["planned_bytes"],
        )
        lines.append(f"{r['rank']:>4} " + " ".join(f"{gb(v):>9}" for v in vals))
    return "\n".join(lines)
