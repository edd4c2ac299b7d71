"""`vp-accelerate simulate` and `vp-accelerate plot-schedule`."""

from __future__ import annotations

import argparse
import json
import sys

from vp_accelerate import modes
from vp_accelerate.cost import (
    Hardware,
    MeasuredCosts,
    ModelShape,
    cost_aware_schedule,
    for_schedule,
    shape_from_hf_config,
)
from vp_accelerate.exit_codes import USER_ERROR
from vp_accelerate.schedule import ScheduleError, build_schedule, validate
from vp_accelerate.schedule.registry import METHODS, SCHEDULES, argparse_type, normalise_method, normalise_schedule
from vp_accelerate.schedule.replay import BUFFERED
from vp_accelerate.schedule.streams import NCCL, NCCL_SERIALIZED

from .simulate import simulate

# --p2p: the replay's communication rules (schedule/replay.py)
P2P_RULES = {"nccl": NCCL, "nccl-serialized": NCCL_SERIALIZED, "buffered": BUFFERED}


def _parser(prog: str, with_out: bool) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Simulate one training step of a pipeline schedule.")
    m = ap.add_argument_group("model (an HF config.json, or the four shape flags)")
    m.add_argument("--config", help="path of an HF config.json")
    m.add_argument("--hidden", type=int)
    m.add_argument("--layers", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--ffn", type=int, help="MLP size (default 4*hidden)")
    m.add_argument("--gated-mlp", action="store_true", help="three MLP matrices (SwiGLU) instead of two")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the config's)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--schedule", type=argparse_type(normalise_schedule), choices=tuple(SCHEDULES), default="1f1b")
    ap.add_argument("--method", type=argparse_type(normalise_method), choices=tuple(METHODS), default="vocab-2")
    ap.add_argument("--chunks-per-rank", type=int, help="interleaved only (default 2)")
    ap.add_argument("--forward-only", action="store_true", help="evaluation step")
    ap.add_argument(
        "--activation-checkpointing",
        choices=tuple(modes.CHECKPOINTING),
        default="none",
        help="decoder layers recomputed in backward, as pipeline.activation_checkpointing",
    )
    ap.add_argument("--peak-tflops", type=float, default=312.0, help="per device, for MFU (A100 bf16: 312)")
    ap.add_argument(
        "--efficiency", type=float, default=Hardware.efficiency, help="fraction of peak the matmuls sustain"
    )
    ap.add_argument("--bandwidth-gbs", type=float, default=100.0, help="p2p and collective bandwidth, GB/s")
    ap.add_argument(
        "--logit-bytes",
        type=float,
        default=Hardware.logit_bytes,
        help="HBM bytes per logit per pass of the softmax cross-entropy (Megatron-LM's fp32 one: 26)",
    )
    ap.add_argument(
        "--comm-sm-fraction",
        type=float,
        default=Hardware.comm_sm_fraction,
        help="fraction of the SMs a rank's pending collectives hold, slowing the compute they overlap "
        "(the paper's setup: 0.12; default: none)",
    )
    ap.add_argument(
        "--blocking-collectives",
        action="store_true",
        help="every rank waits for each collective chain; default: chains overlap compute, as the "
        "runtime's communication worker (gloo) / stream (NCCL) runs them",
    )
    ap.add_argument(
        "--p2p",
        choices=tuple(P2P_RULES),
        default="nccl",
        help="point-to-point rules of the replay: nccl (default: a send completes once the peer's receive "
        "is posted, each communicator's operations in issue order, as on GPUs), nccl-serialized (also "
        "every communicator of a rank in one order, CUDA_DEVICE_MAX_CONNECTIONS=1), buffered (a send "
        "never waits)",
    )
    ap.add_argument(
        "--measured",
        help="JSON of measured per-pass times (cost.MeasuredCosts; "
        "scripts/measure_costs.py writes them): the step is ordered and timed by them",
    )
    ap.add_argument(
        "--order",
        choices=("cost", "grid"),
        default="cost",
        help="cost (default): each rank's order built from the pass costs, as the runtime builds it; "
        "grid: the schedule block's unit-grid order",
    )
    if with_out:
        ap.add_argument("--out", required=True, help="PNG path")
    else:
        ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def _shape(args) -> ModelShape:
    if args.config:
        return shape_from_hf_config(
            args.config,
            seq=args.seq,
            vocab=args.vocab,
            microbatch_size=args.microbatch_size,
            dtype_bytes=args.dtype_bytes,
        )
    missing = [f"--{k}" for k in ("hidden", "layers", "heads", "vocab") if getattr(args, k) is None]
    if missing:
        raise SystemExit(f"give --config, or {' '.join(missing)}")
    return ModelShape(
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        ffn=args.ffn or 4 * args.hidden,
        vocab=args.vocab,
        seq=args.seq,
        microbatch_size=args.microbatch_size,
        dtype_bytes=args.dtype_bytes,
        mlp_matrices=3 if args.gated_mlp else 2,
    )


def _run(args):
    shape = _shape(args)
    bw = args.bandwidth_gbs * 1e9
    if not 0 <= args.comm_sm_fraction < 1:
        raise ValueError(f"--comm-sm-fraction must be in [0, 1), got {args.comm_sm_fraction}")
    hw = Hardware(
        peak_flops=args.peak_tflops * 1e12,
        efficiency=args.efficiency,
        p2p_bandwidth=bw,
        collective_bandwidth=bw,
        logit_bytes=args.logit_bytes,
        comm_sm_fraction=args.comm_sm_fraction,
    )
    measured = (lambda model: MeasuredCosts.from_json(args.measured, model)) if args.measured else None
    if args.order == "grid":
        sched = build_schedule(
            args.schedule, args.method, args.pp, args.microbatches, args.chunks_per_rank, forward_only=args.forward_only
        )
        model = for_schedule(shape, sched, hw, activation_checkpointing=args.activation_checkpointing)
    else:
        sched, model = cost_aware_schedule(
            shape,
            args.schedule,
            args.method,
            args.pp,
            args.microbatches,
            chunks_per_rank=args.chunks_per_rank,
            forward_only=args.forward_only,
            hw=hw,
            activation_checkpointing=args.activation_checkpointing,
            costs=measured,
        )
    validate(sched)
    costs = measured(model) if measured else model
    return (
        sched,
        model,
        simulate(sched, costs, blocking_collectives=args.blocking_collectives, rules=P2P_RULES[args.p2p]),
    )


def _parse_and_run(prog: str, with_out: bool, argv):
    """Parse a command's flags and simulate; (args, schedule, model, result), or None after printing why
    the schedule or model cannot exist."""
    args = _parser(prog, with_out=with_out).parse_args(argv)
    try:
        return (args, *_run(args))
    except (ScheduleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def simulate_main(argv=None) -> int:
    ran = _parse_and_run("vp-accelerate simulate", False, argv)
    if ran is None:
        return USER_ERROR
    args, sched, model, res = ran
    out = {
        "schedule": args.schedule,
        "method": args.method,
        "pp": args.pp,
        "microbatches": args.microbatches,
        "vocab": model.shape.vocab,
        "seq": model.shape.seq,
        "chunk_layers": list(model.chunk_layers),
        "step_time": res.step_time,
        "mfu": res.mfu,
        "bubble_rate": res.bubble_rate,
        "ranks": [
            {
                "rank": r,
                "busy": res.busy[r],
                "peak_activation_microbatches": res.peak_activation_microbatches[r],
                "peak_stash_microbatches": res.peak_stash_microbatches[r],
                "peak_activation_bytes": res.peak_activation_bytes[r],
                "static_bytes": res.static_bytes[r],
                "peak_memory_bytes": res.peak_memory_bytes[r],
            }
            for r in range(sched.num_ranks)
        ],
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{sched.describe()}  layers per chunk {list(model.chunk_layers)}")
    print(f"step time {res.step_time * 1e3:.1f} ms   MFU {res.mfu * 100:.2f}%   bubble {res.bubble_rate * 100:.1f}%")
    print("rank  busy(ms)  act(mb)  stash(mb)  peak mem (GB)")
    for r in out["ranks"]:
        print(
            f"{r['rank']:4d}  {r['busy'] * 1e3:8.1f}  {r['peak_activation_microbatches']:7.2f}  "
            f"{r['peak_stash_microbatches']:9d}  {r['peak_memory_bytes'] / 1e9:13.2f}"
        )
    return 0


def plot_schedule_main(argv=None) -> int:
    ran = _parse_and_run("vp-accelerate plot-schedule", True, argv)
    if ran is None:
        return USER_ERROR
    args, sched, _, res = ran
    from .plot import plot_timeline  # matplotlib: only this command draws

    title = (
        f"{sched.describe()}  V={_shape(args).vocab}  step {res.step_time * 1e3:.0f} ms  "
        f"MFU {res.mfu * 100:.1f}%  bubble {res.bubble_rate * 100:.1f}%"
    )
    plot_timeline(res.timeline, args.out, title=title, label_microbatches=args.microbatches <= 48)
    print(args.out)
    return 0
