"""Soak test: a long quickstart run on 2 ranks; is resident memory and step time flat over time?

    python scripts/soak.py                        # 1,000 steps of recipes/quickstart.yaml into outputs/soak
    python scripts/soak.py --steps 2000 --every 50
    python scripts/soak.py --analyze outputs/soak  # only re-read outputs/soak/metrics.jsonl

It runs the real trainer under `accelerate launch` (2 gloo processes, eval, checkpoints and wandb
offline as the quickstart does), with `logging.log_every = --every`. At every log each rank reports its
current RSS (VmRSS from /proc/self/status) and its mean step time over the last `--every` steps
(`memory/rank{r}_rss_mib`, `perf/rank{r}_step_time_s` in metrics.jsonl). The script fits a least-squares
line to both, per rank, and writes `soak.csv` and `soak.md` beside the metrics.

The first `--warmup` samples are left out of the fit: the allocator, datasets caches and the first
checkpoint grow memory once at the start, which is not a leak. Exit code 1 when a fitted RSS slope
exceeds `--max-rss-mib-per-1k` or a step-time slope exceeds `--max-time-pct-per-1k` percent of the
mean step time per 1,000 steps.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def ensure_data() -> None:
    """The quickstart's corpus and tokenizer (outputs/), made as scripts/quickstart.sh makes them."""
    if not os.path.isfile(os.path.join(ROOT, "outputs/demo_corpus/train.jsonl")):
        subprocess.run(
            [sys.executable, "scripts/make_demo_corpus.py", "--out", "outputs/demo_corpus"], cwd=ROOT, check=True
        )
    if not os.path.isfile(os.path.join(ROOT, "outputs/demo_tokenizer/tokenizer.json")):
        subprocess.run(
            [
                sys.executable,
                "scripts/train_tokenizer.py",
                "--vocab-size",
                "4096",
                "--out",
                "outputs/demo_tokenizer",
                "outputs/demo_corpus/train.jsonl",
            ],
            cwd=ROOT,
            check=True,
        )


def run(args) -> int:
    """Launch the training run; its output goes to <out>/train.log."""
    ensure_data()
    os.makedirs(args.out, exist_ok=True)
    metrics = os.path.join(args.out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # a previous soak's rows are not this one's
    shutil.rmtree(os.path.join(args.out, "checkpoints"), ignore_errors=True)  # a new run refuses an earlier run's
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [
        accelerate,
        "launch",
        "--config_file",
        os.path.join(ROOT, "configs/accelerate_cpu_2proc.yaml"),
        "-m",
        "vp_accelerate",
        "train",
        args.recipe,
        "--set",
        f"train.steps={args.steps}",
        "--set",
        f"logging.log_every={args.every}",
        "--set",
        f"logging.output_dir={args.out}",
        "--set",
        f"checkpoint.dir={args.out}/checkpoints",
        "--set",
        "logging.timeline_image=false",
        *sum((["--set", s] for s in args.set), []),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "WANDB_SILENT": "true",
    }
    t0 = time.monotonic()
    with open(os.path.join(args.out, "train.log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"training exited {code} after {time.monotonic() - t0:.0f} s (log: {args.out}/train.log)")
    return code


def analyze(out: str, warmup: int) -> dict:
    """Per-rank samples and fitted slopes from <out>/metrics.jsonl; writes soak.csv and soak.md."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if "train/loss" in r and "memory/rank0_rss_mib" in r]
    ranks = sorted(int(k[len("memory/rank") : -len("_rss_mib")]) for k in rows[0] if k.endswith("_rss_mib"))
    with open(os.path.join(out, "soak.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "rank", "rss_mib", "step_time_s", "train_loss"])
        for r in rows:
            for k in ranks:
                w.writerow(
                    [
                        r["step"],
                        k,
                        f"{r[f'memory/rank{k}_rss_mib']:.2f}",
                        f"{r[f'perf/rank{k}_step_time_s']:.5f}",
                        f"{r['train/loss']:.4f}",
                    ]
                )
    fit = rows[warmup:]
    result = {"steps": rows[-1]["step"], "samples": len(rows), "fitted_samples": len(fit), "ranks": {}}
    for k in ranks:
        xs = [r["step"] for r in fit]
        rss = [r[f"memory/rank{k}_rss_mib"] for r in fit]
        st = [r[f"perf/rank{k}_step_time_s"] for r in fit]
        mean_t = sum(st) / len(st)
        result["ranks"][k] = {
            "rss_first_mib": rows[0][f"memory/rank{k}_rss_mib"],
            "rss_last_mib": rss[-1],
            "rss_min_mib": min(rss),
            "rss_max_mib": max(rss),
            "rss_slope_mib_per_1k": 1000 * slope(xs, rss),
            "step_time_mean_s": mean_t,
            "step_time_slope_s_per_1k": 1000 * slope(xs, st),
            "step_time_slope_pct_per_1k": 100 * 1000 * slope(xs, st) / mean_t,
        }
    with open(os.path.join(out, "soak.md"), "w") as f:
        f.write(
            f"Soak: {result['steps']} steps, {len(rows)} samples (every "
            f"{rows[1]['step'] - rows[0]['step'] if len(rows) > 1 else '?'} steps); least-squares fit over "
            f"samples {warmup + 1}..{len(rows)} (steps {fit[0]['step']}..{fit[-1]['step']}).\n\n"
        )
        f.write(
            "| rank | RSS first / last (MiB) | RSS min / max after warm-up | RSS slope (MiB / 1k steps) | "
            "mean step time (s) | step-time slope (s / 1k steps) | (% of mean / 1k steps) |\n"
        )
        f.write("|---|---|---|---|---|---|---|\n")
        for k, v in result["ranks"].items():
            f.write(
                f"| {k} | {v['rss_first_mib']:.1f} / {v['rss_last_mib']:.1f} | {v['rss_min_mib']:.1f} / "
                f"{v['rss_max_mib']:.1f} | {v['rss_slope_mib_per_1k']:+.2f} | {v['step_time_mean_s']:.3f} | "
                f"{v['step_time_slope_s_per_1k']:+.4f} | {v['step_time_slope_pct_per_1k']:+.1f}% |\n"
            )
        f.write("\n| step | " + " | ".join(f"rank {k} RSS MiB | rank {k} step s" for k in ranks) + " | loss |\n")
        f.write("|---|" + "---|---|" * len(ranks) + "---|\n")
        for r in rows:
            cells = " | ".join(
                f"{r[f'memory/rank{k}_rss_mib']:.1f} | {r[f'perf/rank{k}_step_time_s']:.3f}" for k in ranks
            )
            f.write(f"| {r['step']} | {cells} | {r['train/loss']:.3f} |\n")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="sample (log) every N steps")
    ap.add_argument("--out", default="outputs/soak")
    ap.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="more recipe overrides")
    ap.add_argument("--warmup", type=int, default=2, help="samples left out of the fit")
    ap.add_argument("--max-rss-mib-per-1k", type=float, default=5.0)
    ap.add_argument(
        "--max-time-pct-per-1k",
        type=float,
        default=25.0,
        help="generous: the step time on a shared machine moves with its load",
    )
    ap.add_argument("--analyze", metavar="DIR", help="only analyze DIR/metrics.jsonl of an earlier soak")
    args = ap.parse_args(argv)
    out = args.analyze or args.out
    if not args.analyze:
        code = run(args)
        if code != 0:
            return code
    result = analyze(out, args.warmup)
    print(open(os.path.join(out, "soak.md")).read().split("\n\n| step")[0])
    print(json.dumps(result, indent=1))
    bad = [
        k
        for k, v in result["ranks"].items()
        if v["rss_slope_mib_per_1k"] > args.max_rss_mib_per_1k
        or v["step_time_slope_pct_per_1k"] > args.max_time_pct_per_1k
    ]
    if bad:
        print(f"NOT FLAT on rank(s) {bad}", file=sys.stderr)
        return 1
    print("flat: RSS and step time within the limits on every rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
