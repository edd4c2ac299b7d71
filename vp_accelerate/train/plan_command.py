"""`vp-accelerate plan`: the best layouts of a model on a cluster, from the simulator (sim/plan.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vp_accelerate.cost import Hardware


def model_config(source: str):
    """A model's config from a preset name, a local model directory or a config.json path (no download)."""
    from .presets import PRESETS, preset_config

    path = Path(os.path.expanduser(source))
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    if source in PRESETS:
        return preset_config(source)
    preset_config(source)  # raises: unknown preset, with a did-you-mean
    raise AssertionError("unreachable")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vp-accelerate plan",
                                 description="Simulate every schedule x method x pp x dp x microbatch x memory mode "
                                             "for a model on a cluster; print the fastest that fit.")
    ap.add_argument("model", help="a preset name, a local model directory, or an HF config.json")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in all (pp x dp)")
    ap.add_argument("--memory-gb", type=float, required=True, help="memory per GPU, GB")
    ap.add_argument("--seq", type=int, required=True, help="sequence length")
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--top", type=int, default=5, help="how many plans to print")
    ap.add_argument("--peak-tflops", type=float, default=312.0, help="per device, for MFU (A100 bf16: 312)")
    ap.add_argument("--efficiency", type=float, default=Hardware.efficiency,
                    help="fraction of peak the matmuls sustain")
    ap.add_argument("--bandwidth-gbs", type=float, default=100.0, help="p2p and collective bandwidth, GB/s")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def request_from_args(args):
    from vp_accelerate.sim.plan import PlanRequest

    bw = args.bandwidth_gbs * 1e9
    hw = Hardware(peak_flops=args.peak_tflops * 1e12, efficiency=args.efficiency, p2p_bandwidth=bw,
                  collective_bandwidth=bw)
    return PlanRequest(gpus=args.gpus, memory_gb=args.memory_gb, seq=args.seq, global_batch=args.global_batch,
                       hardware=hw)


def table(plans, top: int) -> str:
    lines = [f"{'#':>2}  {'schedule/method':<22} {'pp':>3} {'dp':>3} {'mbs':>4} {'m':>4} {'memory':<9} "
             f"{'tokens/s':>10} {'MFU':>6} {'bubble':>7} {'peak GB per rank'}"]
    for i, p in enumerate(plans[:top], 1):
        mem = " ".join(f"{x:.1f}" for x in p.peak_memory_gb)
        lines.append(f"{i:>2}  {p.schedule + '/' + p.method:<22} {p.pp:>3} {p.dp:>3} {p.microbatch_size:>4} "
                     f"{p.microbatches:>4} {p.memory:<9} {p.tokens_per_s:>10.0f} {p.mfu * 100:>5.1f}% "
                     f"{p.bubble * 100:>6.1f}% {mem}")
    return "\n".join(lines)


def plan_main(argv: list[str] | None = None) -> int:
    from vp_accelerate.sim.plan import as_dict, plan

    args = _parser().parse_args(argv)
    try:
        config = model_config(args.model)
        req = request_from_args(args)
        plans = plan(config, req)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fitting = [p for p in plans if p.fits]
    if args.json:
        print(json.dumps({"model": args.model, "gpus": args.gpus, "memory_gb": args.memory_gb, "seq": args.seq,
                          "global_batch": args.global_batch, "considered": len(plans), "fitting": len(fitting),
                          "plans": [as_dict(p) for p in fitting[:args.top]]}))
        return 0 if fitting else 1
    if not fitting:
        need = min((max(p.peak_memory_gb) for p in plans), default=None)
        why = f"the smallest needs {need:.1f} GB per GPU" if need is not None else "no layout exists"
        print(f"no layout fits in {args.memory_gb:g} GB per GPU ({len(plans)} considered; {why})", file=sys.stderr)
        return 1
    print(f"{args.model}: {args.gpus} GPUs x {args.memory_gb:g} GB, seq {args.seq}, global batch {args.global_batch}: "
          f"{len(fitting)} of {len(plans)} layouts fit")
    print(table(fitting, args.top))
    return 0


def _memory_gb(world_size: int) -> float:
    """Memory one rank may fill: the GPU's, or on CPU the host's shared by the ranks."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / world_size


def resolve_auto(recipe, world_size: int | None):
    """(recipe, plan): with `pipeline.schedule: auto` the recipe with the best plan's layout filled in,
    else (recipe, None). Every rank computes the same plan from the same inputs. Raises RecipeError."""
    import dataclasses

    from vp_accelerate.sim.plan import PlanRequest, best

    from .presets import recipe_model_config
    from .recipe import RecipeError, check

    p = recipe.pipeline
    if p.schedule != "auto":
        return recipe, None
    if world_size is None:
        raise RecipeError("pipeline.schedule: auto needs the number of processes (run under a launcher, or pass "
                          "--world-size N with --check)")
    m = recipe.model
    config = recipe_model_config(m.source, m.config, m.trust_remote_code)
    memory = p.plan_memory_gb or _memory_gb(world_size)
    peak = recipe.logging.peak_tflops * 1e12 or Hardware.peak_flops  # only MFU's scale; the ranking is the same
    req = PlanRequest(gpus=world_size, memory_gb=memory, seq=recipe.data.seq_len,
                      global_batch=recipe.train.global_batch, hardware=Hardware(peak_flops=peak))
    try:
        plan = best(config.to_dict() if hasattr(config, "to_dict") else config, req)
    except ValueError as e:
        raise RecipeError(f"pipeline.schedule: auto: {e}") from None
    pipeline = dataclasses.replace(p, **plan.pipeline_section())
    return check(dataclasses.replace(recipe, pipeline=pipeline)), plan
