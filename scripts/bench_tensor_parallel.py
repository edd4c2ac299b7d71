"""Side by side on 4 local gloo ranks: pp 4 against pp 2 x tp 2 (with and without sequence parallelism), one model.

    python scripts/bench_tensor_parallel.py [--rounds 3] [--steps 4] [--hidden 256] [--layers 8] [--vocab 32000]

Each round builds every layout in turn (round-robin, so drifting load hits all alike), runs one warm-up step and
times `--steps` training steps; the report gives each layout's median tokens/s over the rounds, its spread
(min..max), the ratio to pp 4, and each rank's parameter bytes (what TP divides). On CPU, TP is communication-
bound (two all-reduces or all-gather + reduce-scatter per layer and microbatch over gloo): the ratio says what
the collectives cost here, not what NVLink gives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = {
    "pp4": dict(pp_size=4, tp_size=1),
    "pp2 x tp2 (sp)": dict(pp_size=2, tp_size=2),
    "pp2 x tp2 (no sp)": dict(pp_size=2, tp_size=2, sequence_parallel=False),
}


def _ranks(args) -> dict:
    import torch
    from transformers import LlamaConfig

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    ids = torch.randint(0, args.vocab, (args.microbatches, args.seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    params: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, layout in LAYOUTS.items():
            pipe = PipelineModel(
                config, PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=args.microbatches, **layout)
            )
            pipe.train_step(ids, ids)  # warm-up
            pipe.zero_grad()
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                pipe.train_step(ids, ids)
                pipe.zero_grad()
            torch.distributed.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
            params[name] = pipe.param_bytes()
            pipe.close()
    return {"times": times, "params": params}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    from vp_accelerate.distributed import spawn

    load = os.getloadavg()[0]
    results = spawn(_ranks, 4, args, timeout_s=1800)
    tokens = args.microbatches * args.seq
    base = statistics.median(results[0]["times"]["pp4"])
    print(
        f"4 gloo ranks, Llama h={args.hidden} x {args.layers} layers, V={args.vocab}, seq {args.seq}, "
        f"{args.microbatches} microbatches of 1, fp32; {args.rounds} rounds x {args.steps} steps; "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"{'layout':<20} {'tokens/s':>9} {'spread':>17} {'vs pp4':>7}  param bytes per rank")
    for name in LAYOUTS:
        per = results[0]["times"][name]
        med = statistics.median(per)
        ranks = ", ".join(f"{r['params'][name] / 2**20:.1f}" for r in results)
        spread = f"{tokens / max(per):.0f}..{tokens / min(per):.0f}"
        print(f"{name:<20} {tokens / med:>9.0f} {spread:>17} {base / med:>6.2f}x  {ranks} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
