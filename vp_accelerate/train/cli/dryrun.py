"""`vp-accelerate dryrun`: the real runtime of every distinct rank of a layout on this CPU, with fake tensors
and a fake process group (train/dryrun), its memory per rank beside the planner's, and the whole world's
communication replayed under NCCL's rules."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from vp_accelerate.cost import GPU_PRESETS

from .plan import model_config

LAYOUT_FLAGS = ("schedule", "method", "pp", "microbatches", "memory", "zero", "checkpointing")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vp-accelerate dryrun",
        description="Run every distinct rank of a layout (the one `plan` picks, or the one given) with the "
        "real runtime on this CPU under fake tensors: build, one training step, the optimizer step, a "
        "checkpoint's state_dicts and an eval step; report each rank's memory as the CUDA allocator would "
        "count it, the planner's figure beside it, and whether the world's communication finishes under "
        "NCCL's rules. Exit 2 when a rank does not fit.",
    )
    ap.add_argument("model", help="a preset name, a local model directory or an HF config.json (its config only)")
    ap.add_argument("--world-size", type=int, required=True, help="GPUs in all (pp x dp)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (for the plan's layout)")
    ap.add_argument("--gpu", choices=tuple(GPU_PRESETS), default="h100", help="device preset (default h100)")
    ap.add_argument("--memory-gb", type=float, help="memory per GPU, GB (default: the preset's)")
    ap.add_argument("--seq", type=int, required=True, help="sequence length")
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    lay = ap.add_argument_group("layout (default: the plan's; give --schedule, --method, --pp and --microbatches)")
    lay.add_argument("--schedule", help="pipeline schedule (PipelineConfig.schedule)")
    lay.add_argument("--method", help="vocabulary method (PipelineConfig.method)")
    lay.add_argument("--pp", type=int, help="pipeline ranks; dp = world size / pp")
    lay.add_argument("--microbatches", type=int, help="microbatches per replica per step")
    lay.add_argument("--memory", help="output-layer S->T state: store or recompute (default store)")
    lay.add_argument("--zero", type=int, choices=(0, 1), help="ZeRO stage over dp (default 1)")
    lay.add_argument("--checkpointing", help="activation checkpointing: none, selective or full (default none)")
    ap.add_argument(
        "--jobs", type=int, default=1, help="ranks run at once, each in its own process (default 1; up to the cores)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def _request(args):
    from vp_accelerate.sim.plan import PlanRequest

    hw, memory = GPU_PRESETS[args.gpu]
    return PlanRequest(
        gpus=args.world_size,
        memory_gb=args.memory_gb if args.memory_gb is not None else memory,
        seq=args.seq,
        global_batch=args.global_batch,
        hardware=hw,
        gpus_per_node=args.gpus_per_node,
    )


def layout(args, config: dict, req):
    """The PipelineConfig to run: the explicit flags, or the plan's best layout. ValueError on a bad one."""
    from vp_accelerate.runtime.config import PipelineConfig

    given = [f for f in LAYOUT_FLAGS if getattr(args, f) is not None]
    if given:
        missing = [f for f in ("schedule", "method", "pp", "microbatches") if getattr(args, f) is None]
        if missing:
            raise ValueError(f"an explicit layout needs --{' --'.join(missing)} too (or none of the layout flags)")
        if args.world_size % args.pp:
            raise ValueError(f"--pp {args.pp} does not divide --world-size {args.world_size}")
        section = dict(
            schedule=args.schedule,
            method=args.method,
            pp_size=args.pp,
            dp_size=args.world_size // args.pp,
            microbatches=args.microbatches,
            memory=args.memory or "store",
            zero=1 if args.zero is None else args.zero,
            activation_checkpointing=args.checkpointing or "none",
        )
    else:
        from vp_accelerate.sim.plan import best

        p = best(config, req)
        section = dict(p.pipeline_section(), zero=p.zero)
    cfg = PipelineConfig(**section, mixed_precision="bf16", attn_implementation="sdpa")
    cfg.check()
    if args.global_batch % (cfg.dp_size * cfg.microbatches):
        raise ValueError(
            f"--global-batch {args.global_batch} does not divide into {cfg.dp_size} replicas x "
            f"{cfg.microbatches} microbatches"
        )
    return cfg


def dryrun_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = model_config(args.model)
        req = _request(args)
        cfg = layout(args, config, req)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from transformers import AutoConfig

    from vp_accelerate.train.dryrun.world import dry_run_world, planned_bytes

    hf = AutoConfig.for_model(**config) if isinstance(config, dict) else config
    log = None if args.json else (lambda line: print(line, flush=True))
    if log:
        log(
            f"{args.model}: {cfg.schedule}/{cfg.method} pp={cfg.pp_size} dp={cfg.dp_size} m={cfg.microbatches} "
            f"memory={cfg.memory} zero={cfg.zero} ckpt={cfg.activation_checkpointing}, bf16 mixed precision, "
            f"seq {args.seq}, global batch {args.global_batch}; running pipeline ranks 0..{cfg.pp_size - 1} "
            f"(replicas 1..{cfg.dp_size - 1} run the same programs on their own groups)"
        )
    result = dry_run_world(hf, cfg, args.world_size, args.global_batch, args.seq, log=log, jobs=args.jobs)
    result.planned_bytes = planned_bytes(config, req, cfg)
    limit = req.memory_gb * 1e9
    rows = []
    for mem, planned in zip(result.ranks, result.planned_bytes):
        d = dataclasses.asdict(mem)
        d["planned_bytes"] = planned
        d["replicas"] = [dd * cfg.pp_size + mem.rank for dd in range(cfg.dp_size)]
        rows.append(d)
    over = [m for m in result.ranks if m.peak_bytes > limit]
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "world_size": args.world_size,
                    "layout": dataclasses.asdict(cfg),
                    "memory_bytes": int(limit),
                    "ranks": rows,
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
        worst = max(over, key=lambda m: m.peak_bytes)
        term, nbytes = worst.largest_term()
        print(
            f"error: rank {worst.rank} needs {worst.peak_bytes / 1e9:.1f} GB, above {limit / 1e9:g} GB per GPU; "
            f"its largest term is {term} ({nbytes / 1e9:.1f} GB): choose a layout with more pipeline ranks, "
            f"ZeRO-1 or activation checkpointing",
            file=sys.stderr,
        )
        return 2
    return 1 if result.deadlock else 0


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
