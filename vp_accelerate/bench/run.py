"""`vp-accelerate bench` / scripts/benchmark.py: spawn the ranks, sweep, and write table, JSON, plots.

python scripts/benchmark.py --quick                       # peer vs 1f1b-vocab-2, one V, < 2 min
python scripts/benchmark.py --json out.json --plots docs/img --markdown out.md
python scripts/benchmark.py --quick --against main       # this checkout / main, round-robin (bench/against.py)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from vp_accelerate.bench.against import against_main
from vp_accelerate.bench.config import ALL_METHODS, DEFAULT_VOCABS, QUICK_METHODS, BenchConfig
from vp_accelerate.bench.methods import get_method
from vp_accelerate.bench.report import Row, build_rows, markdown_table, write_json
from vp_accelerate.bench.worker import bench_rank
from vp_accelerate.distributed import spawn


def runnable_methods(cfg: BenchConfig) -> tuple[list[str], dict[str, str]]:
    """(methods to run, {skipped method: reason}). Raises if a method cannot run and skipping is off."""
    run, skipped = [], {}
    for name in cfg.methods:
        reason = get_method(name).unavailable()
        if reason is None:
            run.append(name)
        elif cfg.skip_unavailable:
            skipped[name] = reason
        else:
            raise RuntimeError(f"method {name} cannot run: {reason}")
    if not run:
        raise RuntimeError(f"no method can run: {skipped}")
    return run, skipped


def run_benchmark(cfg: BenchConfig, on_vocab=None) -> tuple[list[Row], dict[str, str]]:
    """Spawn cfg.world_size gloo ranks (one thread each) per vocabulary size, run, aggregate.

    One spawn per vocabulary size: each size's models are freed with its processes, its rows come
    back (and `on_vocab(rows so far)` is called) as soon as it is done, and cfg.timeout_s bounds
    one size rather than the whole sweep.
    """
    methods, skipped = runnable_methods(cfg)
    rows: list[Row] = []
    for vocab in cfg.vocabs:
        one = replace(cfg, vocabs=(vocab,))
        per_rank = spawn(bench_rank, cfg.world_size, one, methods, timeout_s=cfg.timeout_s, threads=1)
        mem = [m for r_mem, _ in per_rank for m in r_mem]
        steps = [s for _, r_steps in per_rank for s in r_steps]
        rows += build_rows(one, methods, mem, steps)
        if on_vocab is not None:
            on_vocab(rows)
    return rows, skipped


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="vp-accelerate bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="one vocab size (32k), the peer and 1f1b-vocab-2 only, 2 timed steps"
    )
    ap.add_argument("--vocabs", type=int, nargs="+", help=f"vocabulary sizes (default {DEFAULT_VOCABS})")
    ap.add_argument(
        "--methods",
        nargs="+",
        help=f"methods (default all: {' '.join(ALL_METHODS)}); 'module:attr' names a Method object of your own",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2, help="pipeline ranks (gloo processes, one thread each)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, help="timed steps per method (default 3, quick 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds one vocabulary size may take before its ranks are stopped",
    )
    ap.add_argument("--strict", action="store_true", help="fail instead of skipping methods that cannot run")
    ap.add_argument("--json", help="write the result rows to this JSON file")
    ap.add_argument("--markdown", help="write the markdown table to this file (it is printed either way)")
    ap.add_argument("--plots", help="write bench_*.png plots into this directory")
    ap.add_argument(
        "--against",
        metavar="REF",
        help="compare with git commit REF (checked out in a temporary worktree): each method runs as one process "
        "per side, alternating current / REF, and the table gives tokens/s current / REF and its spread",
    )
    ap.add_argument("--rounds", type=int, default=3, help="with --against: processes per method and side")
    return ap.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    quick = a.quick
    return BenchConfig(
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        seq=a.seq,
        microbatches=a.microbatches,
        vocabs=tuple(a.vocabs or ((32768,) if quick else DEFAULT_VOCABS)),
        methods=tuple(a.methods or (QUICK_METHODS if quick else ALL_METHODS)),
        world_size=a.ranks,
        warmup=a.warmup,
        steps=a.steps or (2 if quick else 3),
        seed=a.seed,
        timeout_s=a.timeout,
        skip_unavailable=not a.strict,
    )


def bench_main(argv: list[str] | None = None) -> int:
    """Entry point of `vp-accelerate bench`; returns the exit status."""
    a = parse_args(argv)
    cfg = config_from_args(a)
    if a.against:
        return against_main(cfg, a)
    t0 = time.perf_counter()

    def progress(rows: list[Row]) -> None:
        print(f"[{time.perf_counter() - t0:.0f} s] V={rows[-1].vocab} done", file=sys.stderr, flush=True)
        if a.json:  # partial results survive an interrupted sweep
            write_json(rows, a.json)

    rows, skipped = run_benchmark(cfg, on_vocab=progress)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", file=sys.stderr)
    for vocab in cfg.vocabs:
        # every method starts from the same weights and batch: a differing loss means a method trains
        # something else, and its throughput is not comparable
        losses = {r.method: r.loss for r in rows if r.vocab == vocab}
        if max(losses.values()) - min(losses.values()) > 1e-4:
            print(f"WARNING: losses disagree at V={vocab}: {losses}", file=sys.stderr)
    table = markdown_table(rows)
    print(table)
    print(
        f"\n{len(rows)} rows in {time.perf_counter() - t0:.0f} s "
        f"(h={cfg.hidden}, {cfg.layers} layers, seq {cfg.seq}, {cfg.microbatches} microbatches, "
        f"{cfg.world_size} ranks x 1 thread, median of {cfg.steps} steps)"
    )
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table + "\n")
    if a.json:
        write_json(rows, a.json)
    if a.plots:
        from vp_accelerate.bench.plots import write_plots  # matplotlib: only when plots are asked for

        for path in write_plots(rows, a.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
