"""Benchmark the output layer: a plain HF-style lm_head + F.cross_entropy over the full vocabulary V vs
one rank's vocabulary-parallel share of it (S + C1 + T (+ C2) over a V/p shard), for p = 1, 2, 4, 8.

Measured, not asserted. Every configuration runs in a fresh subprocess so its peak memory is its own:
    CUDA: torch.cuda.max_memory_allocated() over the first (warm-up) repetition, minus what was
          allocated before it (inputs and weights);
    CPU:  the growth of the process's peak resident set size (resource.getrusage ru_maxrss) over the
          first repetition, i.e. the transient memory of one forward+backward on top of the inputs.
"held S→T" is what one microbatch's state keeps between C1 and T besides X (stored logits, row
statistics): the per-microbatch cost of having it in flight in a schedule, which "recompute" removes.
Time is the median of `--reps` repetitions after that warm-up. The collectives run on a 1-rank gloo
group (they cost nothing there), so the shard time is pure compute; scaling efficiency =
full time / (p × shard time), 100% meaning the p shards together cost what the full layer costs.

    python scripts/bench_output_layer.py            # N=4096, h=1024, V in {32k, 128k}
    python scripts/bench_output_layer.py --quick    # N=1024, h=256, V in {8k, 32k}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ALGORITHMS = ("naive", "vocab-1", "vocab-2")
MODES = ("store", "recompute", "chunked")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_one(cfg: dict) -> dict:
    """Time and peak memory of one configuration, in this process."""
    import torch
    import torch.nn.functional as F

    from vp_accelerate.distributed import init_from_env
    from vp_accelerate.vocab.output_layer import OutputLayerOptions, c1, c2, s_pass, t_pass, token_mean_grad_scale
    from vp_accelerate.vocab.partition import VocabPartition

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, cfg["dtype"])
    n, h, rows = cfg["tokens"], cfg["hidden"], cfg["rows"]
    x = torch.randn(n, h, device=dev, dtype=dtype)
    weight = torch.randn(rows, h, device=dev, dtype=dtype) * h**-0.5
    labels = torch.randint(0, rows, (n,), device=dev)

    held = {"bytes": 0}
    if cfg["algorithm"] == "baseline":

        def step():
            xr = x.detach().requires_grad_(True)
            wr = weight.detach().requires_grad_(True)
            logits = xr @ wr.t()  # HF: lm_head, then the loss upcasts the logits to fp32
            loss = F.cross_entropy(logits.float(), labels)
            loss.backward()
            return loss
    else:
        init_from_env(backend="nccl" if cuda else "gloo")  # a 1-rank group: C1/C2 cost nothing
        part = VocabPartition(rows, 1)  # one rank's shard of V/p rows
        chunk = cfg["chunk_size"] if cfg["memory"] == "chunked" else None
        opts = OutputLayerOptions(
            algorithm=cfg["algorithm"],
            memory="store" if cfg["memory"] == "store" else "recompute",
            chunk_size=chunk,
            check_inputs=False,
        )
        g = token_mean_grad_scale(labels, n)

        def step():
            weight_grad = torch.zeros(weight.shape, dtype=torch.float32, device=dev)
            state = s_pass(x, labels, g, weight, part, 0, opts)
            c1(state, async_op=False)
            # What a microbatch keeps alive between C1 and T on top of X (what a schedule pays per
            # microbatch in flight): stored logits and row statistics.
            kept = (state.logits or []) + [
                state.local_max,
                state.local_sum,
                state.row_max,
                state.row_sum,
                state.grad_scale,
                state.local_labels,
            ]
            # (C1 drops the shard's partial statistics once reduced: those are None here)
            held["bytes"] = sum(t.untyped_storage().nbytes() for t in kept if t is not None)
            t_pass(state, weight_grad)
            if opts.spec.grad_x_in_t:
                c2(state, async_op=False)
            return state.loss_sum

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # Warm-up repetition doubles as the memory measurement.
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _peak_rss_bytes()
    step()
    sync()
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()) - before
    times = []
    for _ in range(cfg["reps"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"time_s": statistics.median(times), "peak_bytes": max(peak, 0), "held_bytes": held["bytes"]}


def _spawn_config(cfg: dict) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"config {cfg} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: N=1024, h=256, V in {8k, 32k}")
    ap.add_argument("--tokens", type=int, default=None, help="N (default 4096, quick 1024)")
    ap.add_argument("--hidden", type=int, default=None, help="h (default 1024, quick 256)")
    ap.add_argument("--vocab", type=int, nargs="+", default=None, help="V values (default 32768 131072)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="p values")
    ap.add_argument(
        "--chunk-size", type=int, default=None, help="rows per chunk in 'chunked' (default 2048, quick 512)"
    )
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per config (0 = torch's default); 1 is the least noisy on a busy machine",
    )
    ap.add_argument(
        "--algorithms",
        nargs="+",
        default=list(ALGORITHMS),
        choices=ALGORITHMS,
        help="algorithms to time (default all); fewer make full sizes affordable on a CPU",
    )
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="memory modes (default all)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every row as JSON to PATH")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker))))
        return 0

    n = args.tokens or (1024 if args.quick else 4096)
    h = args.hidden or (256 if args.quick else 1024)
    vocabs = args.vocab or ([8192, 32768] if args.quick else [32768, 131072])
    chunk = args.chunk_size or (512 if args.quick else 2048)
    import torch

    where = (
        f"CUDA ({torch.cuda.get_device_name()})"
        if torch.cuda.is_available()
        else f"CPU, {args.threads or torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f} at start"
    )
    mem_how = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "peak RSS growth (ru_maxrss)"
    print(
        f"Output layer fwd+bwd, N={n} h={h} {args.dtype}, {where}; median of {args.reps}; "
        f"peak memory = {mem_how} over one repetition; chunked = recompute with {chunk}-row chunks\n"
    )
    print("| V | p | algorithm | memory | time ms | peak MiB | held S→T MiB | scaling eff. |")
    print("|---|---|---|---|---|---|---|---|")
    base = dict(tokens=n, hidden=h, dtype=args.dtype, reps=args.reps, chunk_size=chunk, threads=args.threads)
    rows_out = []
    for V in vocabs:
        full = _spawn_config({**base, "rows": V, "algorithm": "baseline", "memory": "-"})
        rows_out.append({"vocab": V, "p": None, "algorithm": "baseline", "memory": None, **full})
        print(
            f"| {V} | - | HF lm_head + cross_entropy | - | {full['time_s'] * 1e3:.1f} | "
            f"{full['peak_bytes'] / 2**20:.0f} | - | - |",
            flush=True,
        )
        for p in args.ranks:
            rows = -(-V // p)
            for algo in args.algorithms:
                for mode in args.modes:
                    r = _spawn_config({**base, "rows": rows, "algorithm": algo, "memory": mode})
                    eff = full["time_s"] / (p * r["time_s"])
                    rows_out.append({"vocab": V, "p": p, "algorithm": algo, "memory": mode, **r, "efficiency": eff})
                    print(
                        f"| {V} | {p} | {algo} | {mode} | {r['time_s'] * 1e3:.1f} | "
                        f"{r['peak_bytes'] / 2**20:.0f} | {r['held_bytes'] / 2**20:.1f} | {eff * 100:.0f}% |",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"tokens": n, "hidden": h, "dtype": args.dtype, "reps": args.reps, "where": where, "rows": rows_out},
                f,
                indent=1,
            )
    if not torch.cuda.is_available():
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end (other jobs on the machine add noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
