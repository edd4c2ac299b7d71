"""Measure per-pass times with the real runtime on local gloo ranks, write them as a `MeasuredCosts` JSON,
and compare `vp-accelerate simulate --measured` with the measured step time.

    python scripts/measure_costs.py --out outputs/measured        # 1f1b vocab-2 and baseline, V=32k, p=2

Per schedule x method: a warm-up step, then `--steps` timed steps (each between two barriers). Each
step's pass times, per rank and chunk (mean over its microbatches), become
`<out>/<schedule>_<method>_step<k>.json`; the simulator replays the schedule with them and its step
time is printed next to that step's measured one (on a shared machine step times drift by tens of
percent from step to step, so a step is predicted from its own passes). Communication: per chain, the shortest of its "comm"
records over the ranks (the others include waiting for the last rank to issue it), median over
microbatches; p2p is left at 0 (shared-memory transfers of this size
take microseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _costs(records, p: int) -> dict:
    """MeasuredCosts JSON from one step's timeline (all ranks): median per rank and op ("F:3" per chunk)."""
    passes: list[dict] = [{} for _ in range(p)]
    groups: dict = {}
    comm: dict = {}
    for r in records:
        if r.lane == "comm":  # a chain waits on every rank but the last to issue it: keep the shortest
            key = (r.op, r.mb)
            comm[key] = min(comm.get(key, float("inf")), r.end - r.start)
        elif r.op in ("F", "B", "W", "S", "T", "IF", "IB"):
            key = f"{r.op}:{r.chunk}" if r.op in ("F", "B", "W") else r.op
            groups.setdefault((r.rank, key), []).append(r.end - r.start)
    for (rank, key), times in groups.items():
        passes[rank][key] = statistics.fmean(times)  # the mean keeps the rank's total pass time
        op = key.split(":")[0]
        passes[rank].setdefault(op, statistics.fmean(times))
    per_op: dict = {}
    for (op, _), seconds in comm.items():
        per_op.setdefault(op, []).append(seconds)
    # host time to post transfers (a run of adjacent ones shares one record span) and hand chains over
    posts = [r for r in records if r.lane == "compute" and r.op in ISSUED]
    batch = {}
    for r in posts:
        batch[(r.rank, r.start)] = batch.get((r.rank, r.start), 0) + 1
    issue: dict = {}
    for r in posts:
        issue.setdefault(r.op, []).append((r.end - r.start) / batch[(r.rank, r.start)])
    return {
        "passes": passes,
        "p2p": 0.0,
        "collectives": {k: statistics.median(v) for k, v in per_op.items()},
        "issue": {k: statistics.median(v) for k, v in issue.items()},
    }


ISSUED = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD", "C0", "C1", "C2", "IF_REDUCE", "IB_BCAST")


def _worker(configs, shape: dict, microbatches: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=shape["seq"],
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (microbatches, shape["seq"]), generator=gen)
    out = {}
    for schedule, method in configs:
        pipe = PipelineModel(
            cfg,
            PipelineConfig(
                schedule=schedule,
                method=method,
                microbatches=microbatches,
                attn_implementation="sdpa",
                watchdog_dead_after_s=None,
            ),
        )
        steps_out = []
        for i in range(steps + 1):
            pipe.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(ids, ids)
            dist.barrier()
            if i:  # the first step warms up
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, pipe.last_stats["timeline"])
                steps_out.append((time.perf_counter() - t0, [r for recs in gathered for r in recs]))
        out[(schedule, method)] = (pipe.schedule, steps_out)  # the order it ran (built from the cost model)
        pipe.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/measured", help="directory for the JSON files")
    ap.add_argument("--configs", nargs="+", default=["1f1b:vocab-2", "1f1b:baseline"], help="schedule:method")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)

    from vp_accelerate.cost import MeasuredCosts
    from vp_accelerate.distributed import spawn
    from vp_accelerate.sim.simulate import simulate

    shape = dict(vocab=args.vocab, hidden=args.hidden, ffn=4 * args.hidden, layers=args.layers, heads=4, seq=args.seq)
    configs = [tuple(c.split(":")) for c in args.configs]
    res = spawn(_worker, args.ranks, configs, shape, args.microbatches, args.steps, timeout_s=900)[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| schedule / method | step | measured s | simulated from that step's passes | error |")
    print("|---|---|---|---|---|")
    for (schedule, method), (sched, steps) in res.items():
        for k, (measured, records) in enumerate(steps):
            costs = _costs(records, args.ranks)
            path = out / f"{schedule}_{method}_step{k}.json"
            path.write_text(json.dumps(costs, indent=1))
            predicted = simulate(sched, MeasuredCosts.from_json(path)).step_time
            print(
                f"| {schedule} / {method} | {k} | {measured:.3f} | {predicted:.3f} | "
                f"{100 * (predicted / measured - 1):+.1f}% |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
