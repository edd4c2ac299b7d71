"""`vp-accelerate plan`: the best layouts of a model on a cluster, from the simulator (sim/plan.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from vp_accelerate import exit_codes
from vp_accelerate.cost import GPU_PRESETS, Hardware
from vp_accelerate.cost.data_parallel import ZERO_LEVELS
from vp_accelerate.cost.memory import LORA_TARGETS
from vp_accelerate.model_config import read_config_json
from vp_accelerate.schedule.registry import METHODS
from vp_accelerate.sim.cluster import INTERNODE_BANDWIDTH
from vp_accelerate.sim.plan import (
    CHECKPOINTING,
    TIGHT,
    TP_SIZES,
    PlanRequest,
    as_dict,
    assumptions,
    best,
    search,
    tight,
    why,
)

COLUMNS = """columns:
  schedule/method   pipeline schedule and where the vocabulary layers live (vocab-1/-2: sharded over the
                    pipeline ranks; baseline: embedding on the first stage, output layer on the last;
                    redis: baseline with fewer decoder layers on the end stages); "data parallel" is pp=1
                    ("data parallel/method" with tp > 1)
  pp, tp, dp        pipeline ranks x tensor-parallel ranks per stage x data-parallel replicas (= --gpus);
                    tp (inside a node, sequence parallelism on) splits each stage's layers; the vocabulary
                    is sharded over pp x tp (vocab-1/-2), or the end stages' over their tp ranks (baseline,
                    redis)
  mbs, m            sequences per microbatch, microbatches per replica per step
  memory            VP output layer's S->T state: store (logits shard) or recompute (redo X W^T in T)
  zero              1: ZeRO-1, Adam's m and v sharded over dp as the runtime does (10 + 8/dp bytes per
                    parameter instead of 18); 0: none
  ckpt              activation checkpointing: none, selective (every other layer) or full
  x-node            the pipeline spans nodes (its links priced at --internode-gbs)
  tokens/s          global batch x seq / predicted step time (the ranking)
  MFU               model FLOPs (the paper's count, 3 x (2bshV + L(8bsh^2 + 4bs^2h + 2k bsh FFN))) / (step
                    time x GPUs x peak)
  bubble            idle fraction of rank time in the simulated step (pipeline fill/drain, waits)
  peak GB per rank  weights + gradients + optimizer state + peak activations + reserve of each pipeline rank
                    (each of its TP ranks)
"""


def model_config(source: str):
    """A model's config from a preset name, a local model directory or a config.json path (no download)."""
    from ..recipe.presets import PRESETS, preset_config  # transformers: `plan --help` and a config.json plan do without

    path = Path(os.path.expanduser(source))
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return read_config_json(path)  # its sizes checked: one line, not a planner grown out of memory
    if source in PRESETS:
        return preset_config(source)
    preset_config(source)  # raises: unknown preset, with a did-you-mean
    raise AssertionError("unreachable")


@dataclasses.dataclass
class ModelArg:
    """What a command's MODEL argument gives: the model's config, and when MODEL is a training recipe the run's
    own settings, which the command's flags override."""

    config: object
    """The HF config (a dict read from config.json, or a PretrainedConfig)."""
    seq: int | None = None
    """The recipe's data.seq_len."""
    global_batch: int | None = None
    """The recipe's train.global_batch."""
    recipe: object | None = None
    """The loaded Recipe (its pipeline and adapter sections), or None."""


def is_recipe(source: str) -> bool:
    return source.endswith((".yaml", ".yml")) and Path(os.path.expanduser(source)).is_file()


def model_arg(source: str) -> ModelArg:
    """MODEL as `plan` and `dryrun` take it: a preset, a model directory, a config.json, or a training recipe
    (its model.source with model.config applied and the vocabulary rows its tokenizer gets, as the run reads
    them; the model's weights are not read)."""
    if not is_recipe(source):
        return ModelArg(model_config(source))
    from ..recipe import load_recipe
    from ..recipe.model_check import config_source
    from ..recipe.presets import recipe_model_config, uses_pretrained_weights
    from .preflight import vocab_decision

    recipe = load_recipe(os.path.expanduser(source))
    m = recipe.model
    config = recipe_model_config(config_source(m.source), m.config, m.trust_remote_code, uses_pretrained_weights(m))
    vocab = vocab_decision(recipe, config, full=False)  # the rows the run gives the tokenizer (a swap, a resize)
    if vocab is not None:
        config.vocab_size = vocab.rows_after
    return ModelArg(config, recipe.data.seq_len, recipe.train.global_batch, recipe)


def run_shape(args, model: ModelArg) -> None:
    """Fill --seq, --global-batch and the LoRA flags from a recipe where the command line left them out;
    ValueError naming the flag when neither gives one."""
    for flag, value in (("seq", model.seq), ("global_batch", model.global_batch)):
        if getattr(args, flag) is None:
            if value is None:
                raise ValueError(f"give --{flag.replace('_', '-')} (or a recipe as MODEL)")
            setattr(args, flag, value)
    if args.lora_rank is None and model.recipe is not None and model.recipe.adapter.type == "lora":
        args.lora_rank = model.recipe.adapter.r
        args.lora_targets = args.lora_targets or model.recipe.adapter.target_modules


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vp-accelerate plan",
        description="Simulate every schedule x method x pp x dp x microbatch x memory mode "
        "(pp = 1: plain data parallelism) for a model on a cluster; print the "
        "fastest that fit, under the assumptions the header states.",
        epilog=COLUMNS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "model",
        help="a preset name, a local model directory, an HF config.json, or a training recipe (.yaml: its model, "
        "data.seq_len, train.global_batch and LoRA adapter; flags override them)",
    )
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in all (pp x tp x dp)")
    ap.add_argument(
        "--gpu",
        choices=tuple(GPU_PRESETS),
        help="device preset (SXM): dense bf16 peak 312 / 989 / 989 TFLOP/s, 80 / 80 / 141 GB, NVLink "
        "300 / 450 / 450 GB/s per direction; the flags below override it. Without it: the "
        "paper's A100 as the simulator is calibrated (312 TFLOP/s, 100 GB/s links)",
    )
    ap.add_argument("--memory-gb", type=float, help="memory per GPU, GB (required without --gpu)")
    ap.add_argument("--seq", type=int, help="sequence length (required unless MODEL is a recipe)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (required unless MODEL is a recipe)")
    ap.add_argument("--top", type=int, default=5, help="how many plans to print")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak per device, for MFU (default 312, A100)")
    ap.add_argument(
        "--efficiency",
        type=float,
        default=Hardware.efficiency,
        help="fraction of peak large matmuls sustain (default %(default)s)",
    )
    ap.add_argument("--bandwidth-gbs", type=float, help="p2p and collective bandwidth, GB/s (default 100)")
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs per node: pipelines of up to this many ranks stay inside a node, links that cross nodes "
        "run at --internode-gbs (default: all GPUs in one node)",
    )
    ap.add_argument(
        "--internode-gbs",
        type=float,
        default=INTERNODE_BANDWIDTH / 1e9,
        help="bandwidth per GPU between nodes, GB/s (default %(default)g: one 400 Gb/s NIC per GPU)",
    )
    ap.add_argument(
        "--zero",
        type=int,
        choices=ZERO_LEVELS,
        action="append",
        help="ZeRO stage(s) to try when dp > 1 (default: 0 and 1)",
    )
    ap.add_argument(
        "--checkpointing",
        choices=CHECKPOINTING,
        action="append",
        help="activation-checkpointing mode(s) to try (default: all)",
    )
    ap.add_argument(
        "--method",
        choices=tuple(METHODS),
        action="append",
        help="vocabulary method(s) to try (default: baseline, redis, vocab-1, vocab-2)",
    )
    ap.add_argument(
        "--lora-rank",
        type=int,
        metavar="R",
        help="plan a LoRA run of rank R: the frozen base held in bf16 (2 bytes per parameter), only the adapters "
        "with gradients and optimizer state (default: full training)",
    )
    ap.add_argument(
        "--lora-targets",
        nargs="+",
        metavar="MODULE",
        help="with --lora-rank: the adapted linear modules (default: q_proj v_proj, peft's for Llama; or all-linear)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        action="append",
        metavar="T",
        help="tensor-parallel size(s) to try (default: 1, 2, 4, 8 where they divide --gpus-per-node, the heads, "
        "key/value heads, MLP width and --seq)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def request_from_args(args):
    """The PlanRequest of the command line: the --gpu preset (or the calibrated A100 default), with the
    explicit flags on top. ValueError when no memory size is known."""
    hw, memory = GPU_PRESETS[args.gpu] if args.gpu else (Hardware(), None)
    changes = {"efficiency": args.efficiency}
    if args.peak_tflops is not None:
        changes["peak_flops"] = args.peak_tflops * 1e12
    if args.bandwidth_gbs is not None:
        changes["p2p_bandwidth"] = changes["collective_bandwidth"] = args.bandwidth_gbs * 1e9
    memory = args.memory_gb if args.memory_gb is not None else memory
    if memory is None:
        raise ValueError("give --memory-gb (memory per GPU) or a --gpu preset")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    node = args.gpus_per_node or args.gpus
    for t in args.tp or ():
        if t < 1 or node % t:
            raise ValueError(
                f"--tp {t}: a stage's TP ranks must share a node; give a tp that divides --gpus-per-node "
                f"({node}), e.g. {', '.join(str(x) for x in TP_SIZES if node % x == 0)}"
            )
    return PlanRequest(
        gpus=args.gpus,
        memory_gb=memory,
        seq=args.seq,
        global_batch=args.global_batch,
        hardware=dataclasses.replace(hw, **changes),
        gpus_per_node=args.gpus_per_node,
        internode_bandwidth=args.internode_gbs * 1e9,
        zero=tuple(args.zero or ZERO_LEVELS),
        checkpointing=tuple(args.checkpointing or CHECKPOINTING),
        methods=tuple(args.method or PlanRequest.methods),
        top=max(1, args.top),
        lora_rank=args.lora_rank,
        lora_targets=tuple(args.lora_targets or LORA_TARGETS),
        tensor_parallel=tuple(args.tp or TP_SIZES),
    )


def check_tp(sizes, config, req: PlanRequest) -> None:
    """ValueError (one line) for a --tp the model or the run cannot take (the node's share is checked with the
    request)."""
    from vp_accelerate.cost import shape_from_hf_config
    from vp_accelerate.sim.plan import tp_sizes

    shape = shape_from_hf_config(config, seq=req.seq)
    node = req.gpus_per_node or req.gpus
    allowed = tp_sizes(config, dataclasses.replace(req, tensor_parallel=tuple(range(1, node + 1))), shape)
    for t in sizes or ():
        if t in allowed:
            continue
        counts = {"attention heads": shape.heads, "key/value heads": shape.kv_heads or shape.heads}
        counts.update({"MLP width": shape.ffn, "--seq": req.seq})
        odd = [f"{name} ({n})" for name, n in counts.items() if n % t]
        why = f"it does not divide the model's {', '.join(odd)}" if odd else "the model has no TP plan"
        fit = [str(x) for x in allowed]
        raise ValueError(f"--tp {t}: {why}; give a tp the run can take ({', '.join(fit)})")


def table(plans, top: int, req: PlanRequest | None = None) -> str:
    """The first `top` plans, one line each; a plan above TIGHT of `req`'s memory ends in "tight"."""
    lines = [
        f"{'#':>2}  {'schedule/method':<22} {'pp':>3} {'tp':>3} {'dp':>3} {'mbs':>4} {'m':>4} {'memory':<9} "
        f"{'zero':>4} {'ckpt':<9} {'x-node':<6} {'tokens/s':>10} {'MFU':>6} {'bubble':>7} {'peak GB per rank'}"
    ]
    for i, p in enumerate(plans[:top], 1):
        mem = " ".join(f"{x:.1f}" for x in p.peak_memory_gb)
        lines.append(
            f"{i:>2}  {p.label:<22} {p.pp:>3} {p.tp:>3} {p.dp:>3} {p.microbatch_size:>4} "
            f"{p.microbatches:>4} {p.memory:<9} {p.zero:>4} {p.activation_checkpointing:<9} "
            f"{'yes' if p.pipeline_crosses_nodes else 'no':<6} {p.tokens_per_s:>10.0f} {p.mfu * 100:>5.1f}% "
            f"{p.bubble * 100:>6.1f}% {mem}" + (f"  tight (> {TIGHT:.0%} of memory)" if req and tight(p, req) else "")
        )
    return "\n".join(lines)


def plan_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        model = model_arg(args.model)
        run_shape(args, model)
        config = model.config
        req = request_from_args(args)
        check_tp(args.tp, config, req)
        start = time.perf_counter()
        found = search(config, req)
        seconds = time.perf_counter() - start
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    fitting = found.fitting
    header = assumptions(req, args.gpu)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "gpus": args.gpus,
                    "memory_gb": req.memory_gb,
                    "seq": args.seq,
                    "global_batch": args.global_batch,
                    "assumptions": header,
                    "considered": found.considered,
                    "dominated": found.dominated,
                    "fitting": len(fitting),
                    "why": why(found, req),
                    "seconds": round(seconds, 1),
                    "plans": [{**as_dict(p), "tight": tight(p, req)} for p in fitting[: args.top]],
                }
            )
        )
        return 0 if fitting else 1
    if not fitting:
        need = found.smallest_need_gb()
        reason = f"the smallest needs {need:.1f} GB per GPU" if need is not None else "no layout exists"
        print(
            f"no layout fits in {req.memory_gb:g} GB per GPU ({found.considered} considered; {reason})", file=sys.stderr
        )
        return 1
    print(
        f"{args.model}: {args.gpus} GPUs x {req.memory_gb:g} GB, seq {args.seq}, global batch {args.global_batch}: "
        f"{len(fitting)} of {found.considered} layouts fit ({found.dominated} not timed: a faster variant of "
        f"theirs fits; {seconds:.1f} s)"
    )
    print("\n".join(f"  {line}" for line in header))
    print(table(fitting, args.top, req))
    print(why(found, req))
    return 0


def _memory_gb(world_size: int) -> float:
    """Memory one rank may fill: the GPU's, or on CPU the host's shared by the ranks."""
    import torch  # only the training process asks (resolve_auto); `vp-accelerate plan` runs without torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / world_size


def _lora_request(adapter) -> dict:
    """PlanRequest's LoRA fields for a recipe's adapter section: its rank and targets (null: peft's default)."""
    if adapter.type != "lora":
        return {}
    return {"lora_rank": adapter.r, "lora_targets": tuple(adapter.target_modules or LORA_TARGETS)}


def _auto_tp_sizes(p, adapter) -> tuple[int, ...]:
    """The TP sizes `auto` may pick: the recipe's plan_tp_sizes or the planner's; only 1 for a LoRA adapter with
    dropout (each TP rank would draw its own mask: runtime/tensor_parallel.py refuses it)."""
    if adapter.type == "lora" and adapter.dropout:
        return (1,)
    return tuple(p.plan_tp_sizes) if p.plan_tp_sizes else TP_SIZES


def _local_world_size(world_size: int) -> int | None:
    """GPUs per node for the plan: the launcher's processes on this node (LOCAL_WORLD_SIZE, set by torchrun and
    accelerate launch) when it is a whole part of the world, else None (one node: `--check --world-size N`)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    n = int(local) if local.isdigit() else 0
    return n if 0 < n < world_size and world_size % n == 0 else None


def resolve_auto(recipe, world_size: int | None):
    """(recipe, plan): with `pipeline.schedule: auto` the recipe with the best plan's layout filled in,
    else (recipe, None). Every rank computes the same plan from the same inputs. Raises RecipeError."""
    # presets and recipe load transformers and the models; commands.py imports this module before --help is read
    from ..recipe import RecipeError, check
    from ..recipe.model_check import config_source
    from ..recipe.presets import recipe_model_config, uses_pretrained_weights

    p = recipe.pipeline
    if p.schedule != "auto":
        return recipe, None
    if world_size is None:
        raise RecipeError(
            "pipeline.schedule: auto needs the number of processes (run under a launcher, or pass "
            "--world-size N with --check)"
        )
    m = recipe.model
    config = recipe_model_config(config_source(m.source), m.config, m.trust_remote_code, uses_pretrained_weights(m))
    memory = p.plan_memory_gb or _memory_gb(world_size)
    peak = recipe.logging.peak_tflops * 1e12 or Hardware.peak_flops  # only MFU's scale; the ranking is the same
    req = PlanRequest(
        gpus=world_size,
        memory_gb=memory,
        seq=recipe.data.seq_len,
        global_batch=recipe.train.global_batch,
        hardware=Hardware(peak_flops=peak),
        zero=(p.zero,),  # what the runtime will run: `vp-accelerate plan`'s request with the recipe's stage
        tensor_parallel=_auto_tp_sizes(p, recipe.adapter),
        gpus_per_node=_local_world_size(world_size),
        **_lora_request(recipe.adapter),
    )
    try:
        plan = best(config.to_dict() if hasattr(config, "to_dict") else config, req)
    except ValueError as e:
        raise RecipeError(f"pipeline.schedule: auto: {e}") from None
    pipeline = dataclasses.replace(p, **plan.pipeline_section())
    return check(dataclasses.replace(recipe, pipeline=pipeline)), plan
