"""The planner's memory model against the dry run, per rank, on other families' shapes than Llama's.

For each family shape (a published model's config.json with its real widths, heads, vocabulary and tying, cut to
a few layers) and each layout, runs `vp-accelerate dryrun CONFIG --json` (the real runtime under fake tensors, bf16
mixed precision, SDPA attention where the family has it) and prints per rank the dry run's peak, the planner's
figure for the same layout (`planned`: `sim/plan.py` `schedule_memory`, no reserve) and the deviation
(planned / peak - 1); then the worst |deviation| and every rank off by more than `--limit` percent.

    python scripts/bench_planner_memory.py                          # every shape x every layout
    python scripts/bench_planner_memory.py --shapes qwen3-0.6b gpt2-medium --layouts 1f1b/vocab-2
    python scripts/bench_planner_memory.py --json out.json

Sliding windows are switched off in every shape (their pricing is separate work). Each dry run takes seconds to
a minute on one core (`--jobs 2` runs two ranks at once).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Published configs (the sizes of the hub's config.json), depth cut to `LAYERS`; no sliding window.
SHAPES: dict[str, dict] = {
    "qwen2-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_position_embeddings=32768,
        rope_theta=1e6,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        max_position_embeddings=40960,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_position_embeddings=40960,
    ),
    "gemma-7b": dict(
        model_type="gemma",
        hidden_size=3072,
        intermediate_size=24576,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=256,
        vocab_size=256000,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=8192,
    ),
    "gemma-2-9b": dict(
        model_type="gemma2",
        hidden_size=3584,
        intermediate_size=14336,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=256000,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
        sliding_window=None,
        max_position_embeddings=8192,
    ),
    "phi-3-mini": dict(
        model_type="phi3",
        hidden_size=3072,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        tie_word_embeddings=False,
        sliding_window=None,
        max_position_embeddings=4096,
    ),
    "pythia-1.4b": dict(
        model_type="gpt_neox",
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=16,
        vocab_size=50304,
        tie_word_embeddings=False,
        use_parallel_residual=True,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    ),
    "gpt2-medium": dict(
        model_type="gpt2",
        n_embd=1024,
        n_head=16,
        vocab_size=50257,
        n_positions=1024,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
}

LAYERS = 8
"""Decoder layers of every shape (2 a rank at pp 4; V-Half's 8 chunks get 1 each)."""

# name -> dryrun flags (world size = pp, no data parallelism)
LAYOUTS: dict[str, list[str]] = {
    "1f1b/vocab-2": ["--schedule", "1f1b", "--method", "vocab-2", "--pp", "4", "--microbatches", "8"],
    "1f1b/baseline": ["--schedule", "1f1b", "--method", "baseline", "--pp", "4", "--microbatches", "8"],
    "1f1b/vocab-2 selective": ["--schedule", "1f1b", "--method", "vocab-2", "--pp", "4", "--microbatches", "8"]
    + ["--checkpointing", "selective"],
    "vhalf/vocab-1": ["--schedule", "vhalf", "--method", "vocab-1", "--pp", "4", "--microbatches", "8"],
}


def config_json(name: str, layers: int, seq: int, folder: Path) -> Path:
    """`name`'s shape at `layers` layers as a config.json in `folder` (a directory per shape)."""
    cfg = dict(SHAPES[name])
    cfg["n_layer" if cfg["model_type"] == "gpt2" else "num_hidden_layers"] = layers
    pos = "n_positions" if cfg["model_type"] == "gpt2" else "max_position_embeddings"
    cfg[pos] = max(cfg.get(pos, 0), seq)
    if cfg["model_type"] == "gemma2":  # its default alternates sliding layers: every layer full here
        cfg["layer_types"] = ["full_attention"] * layers
    d = folder / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json"


def dry_run(path: Path, flags: list[str], seq: int, jobs: int) -> dict:
    """`vp-accelerate dryrun --json` of one layout (world size = its pp, global batch = its microbatches)."""
    pp = flags[flags.index("--pp") + 1]
    m = flags[flags.index("--microbatches") + 1]
    cmd = [sys.executable, "-m", "vp_accelerate", "dryrun", str(path), "--world-size", pp, "--seq", str(seq)]
    cmd += ["--global-batch", m, "--gpu", "h200", "--jobs", str(jobs), "--json", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode not in (0, 2) or not out.stdout.strip():  # 2: a rank over the card, still reported
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def replanned(path: Path, flags: list[str], seq: int) -> list[int]:
    """The planner's per-rank figure for one layout, as `dryrun` computes its `planned` column
    (`dryrun.world.planned_bytes`), without running the dry run: for re-pricing saved peaks (`--replan`)."""
    from transformers import AutoConfig

    from vp_accelerate.cost.shape import default_attention
    from vp_accelerate.dryrun.world import planned_bytes
    from vp_accelerate.runtime.config import PipelineConfig
    from vp_accelerate.sim.plan import PlanRequest

    opt = dict(zip(flags[::2], flags[1::2]))
    pp, m = int(opt["--pp"]), int(opt["--microbatches"])
    cfg = PipelineConfig(
        schedule=opt["--schedule"],
        method=opt["--method"],
        pp_size=pp,
        microbatches=m,
        activation_checkpointing=opt.get("--checkpointing", "none"),
        mixed_precision="bf16",
        attn_implementation=default_attention(json.loads(path.read_text())),
    )
    config = json.loads(path.read_text())
    AutoConfig.for_model(**config)  # checked as the dry run reads it
    return planned_bytes(config, PlanRequest(gpus=pp, memory_gb=141.0, seq=seq, global_batch=m), cfg)


def deviations(result: dict) -> list[tuple[int, int, int, float]]:
    """(rank, peak, planned, planned / peak - 1 in %) per rank."""
    return [
        (r["rank"], r["peak_bytes"], r["planned_bytes"], 100.0 * (r["planned_bytes"] / r["peak_bytes"] - 1))
        for r in result["ranks"]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of every shape")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=float, default=5.0, help="flag ranks off by more than this many percent")
    ap.add_argument("--json", help="also write every cell's rows here")
    ap.add_argument(
        "--replan",
        help="a --json file of an earlier sweep: re-price its dry-run peaks with this "
        "checkout's planner (no dry run; the peaks come from the runtime, which the planner does not change)",
    )
    args = ap.parse_args(argv)
    saved = {}
    if args.replan:
        saved = {(c["shape"], c["layout"]): c for c in json.loads(Path(args.replan).read_text())}
        args.shapes = [s for s in args.shapes if any(k[0] == s for k in saved)]
    cells, misses, worst = [], [], (0.0, None)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            path = config_json(name, args.layers, args.seq, Path(tmp))
            for layout in args.layouts:
                if args.replan:
                    if (name, layout) not in saved:
                        continue
                    old = saved[name, layout]
                    now = replanned(path, LAYOUTS[layout], args.seq)
                    res = dict(
                        seconds=old["seconds"],
                        ranks=[dict(rank=r[0], peak_bytes=r[1], planned_bytes=p) for r, p in zip(old["ranks"], now)],
                    )
                else:
                    res = dry_run(path, LAYOUTS[layout], args.seq, args.jobs)
                rows = deviations(res)
                cells.append(dict(shape=name, layout=layout, seconds=res["seconds"], ranks=rows))
                print(f"{name:12s} {layout:24s} ({res['seconds']:.0f} s)", flush=True)
                for rank, peak, planned, dev in rows:
                    flag = "  <-- off" if abs(dev) > args.limit else ""
                    print(
                        f"   rank {rank}: peak {peak / 1e9:7.3f} GB  planned {planned / 1e9:7.3f} GB  {dev:+6.1f}%{flag}"
                    )
                    if abs(dev) > args.limit:
                        misses.append((name, layout, rank, dev))
                    if abs(dev) > abs(worst[0]):
                        worst = (dev, (name, layout, rank))
                cell_worst = max((r[3] for r in rows), key=abs)
                print(f"   worst {cell_worst:+.1f}%", flush=True)
    print(f"\nworst |deviation|: {worst[0]:+.1f}% ({worst[1]}); {len(misses)} ranks off by more than {args.limit}%")
    for name, layout, rank, dev in misses:
        print(f"  {name} {layout} rank {rank}: {dev:+.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
