"""`vp-accelerate selftest`: check every output-layer algorithm and memory mode against float64.

Spawns `--nproc` local gloo ranks (or, when started by `accelerate launch` / `torchrun`, joins the
launcher's group), runs naive / vocab-1 / vocab-2 × store / recompute / chunked on one random problem
(two microbatches, some ignored labels, V not necessarily divisible by p, input embedding through
IF/IB) and prints the maximum relative errors of the loss, ∂X, ∂W and ∂E over all ranks.
Exit status 0 when every error is within tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
import torch.distributed as dist

from ..distributed import init_from_env, spawn
from ..exit_codes import USER_ERROR
from .output_layer import ALGORITHMS, OutputLayerOptions
from .partition import VocabPartition
from .verify import VerifyCase, verify_case

MODES = ("store", "recompute", "chunked")
QUANTITIES = ("loss", "grad_x", "grad_w", "grad_e")
HEADERS = {"loss": "loss", "grad_x": "∂X", "grad_w": "∂W", "grad_e": "∂E"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vp-accelerate selftest", description="Check the vocabulary-parallel layers against a float64 reference."
    )
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn (ignored under a launcher)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary size V")
    p.add_argument("--hidden", type=int, default=64, help="hidden size h")
    p.add_argument("--tokens", type=int, default=128, help="tokens N (split into 2 microbatches)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max relative error allowed (fp32 compute vs float64)")
    return p


def _options(algorithm: str, mode: str, shard_size: int) -> OutputLayerOptions:
    if mode == "chunked":  # recompute with ~4 chunks per shard: the lowest-memory configuration
        return OutputLayerOptions(algorithm=algorithm, memory="recompute", chunk_size=max(1, shard_size // 4))
    return OutputLayerOptions(algorithm=algorithm, memory=mode)


def run_checks(vocab: int, hidden: int, tokens: int, seed: int, group=None) -> dict:
    """{algorithm: {mode: {quantity: max relative error over the group's ranks}}}; call on every rank."""
    p = dist.get_world_size(group)
    shard = VocabPartition(vocab, p).shard_size
    out: dict = {}
    for algo in ALGORITHMS:
        for mode in MODES:
            case = VerifyCase(
                vocab_size=vocab,
                hidden=hidden,
                tokens=tokens,
                microbatches=2,
                opts=_options(algo, mode, shard),
                ignored_fraction=0.1,
                root=p - 1,
            )
            errs = verify_case(case, seed, group)
            t = torch.tensor([errs[q] for q in QUANTITIES], dtype=torch.float64)
            if dist.get_backend(group) == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            out.setdefault(algo, {})[mode] = dict(zip(QUANTITIES, t.cpu().tolist()))
    return out


def _spawned(vocab: int, hidden: int, tokens: int, seed: int) -> dict:
    return run_checks(vocab, hidden, tokens, seed)


def report(errors: dict, tolerance: float, world_size: int, args, seed: int) -> tuple[bool, str]:
    """(passed, text): the JSON object or the markdown table."""
    max_rel = {a: {m: max(e.values()) for m, e in modes.items()} for a, modes in errors.items()}
    passed = all(v <= tolerance for modes in max_rel.values() for v in modes.values())
    if args.json:
        return passed, json.dumps(
            {
                "passed": passed,
                "max_rel_error": max_rel,
                "errors": errors,
                "tolerance": tolerance,
                "world_size": world_size,
                "vocab": args.vocab,
                "hidden": args.hidden,
                "tokens": args.tokens,
                "seed": seed,
            }
        )
    lines = [
        f"vp-accelerate selftest: {world_size} rank(s), V={args.vocab} h={args.hidden} N={args.tokens} "
        f"(2 microbatches, 10% ignored labels), seed {seed}, tolerance {tolerance:g}",
        "",
        "| algorithm | memory | " + " | ".join(HEADERS[q] for q in QUANTITIES) + " | ok |",
        "|---|---|" + "---|" * (len(QUANTITIES) + 1),
    ]
    for algo, modes in errors.items():
        for mode, e in modes.items():
            ok = "yes" if max_rel[algo][mode] <= tolerance else "NO"
            lines.append(f"| {algo} | {mode} | " + " | ".join(f"{e[q]:.2e}" for q in QUANTITIES) + f" | {ok} |")
    lines += ["", "PASSED" if passed else "FAILED: some relative error exceeds the tolerance"]
    return passed, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if launched or dist.is_initialized():
        rank, world = init_from_env()
        seed_t = torch.tensor([args.seed if args.seed is not None else random.randrange(2**31)])
        if dist.get_backend() == "nccl":
            seed_t = seed_t.cuda()
        dist.broadcast(seed_t, 0)  # every rank must draw the same problem
        seed = int(seed_t.item())
        if world < 1 or args.vocab < world:
            raise SystemExit(f"--vocab {args.vocab} must be >= the world size {world}")
        errors = run_checks(args.vocab, args.hidden, args.tokens, seed)
    else:
        rank, world = 0, args.nproc
        if world < 1:
            print(f"--nproc must be >= 1, got {world}", file=sys.stderr)
            return USER_ERROR
        if args.vocab < world:
            print(
                f"--vocab {args.vocab} must be >= --nproc {world}: every rank needs a vocabulary row", file=sys.stderr
            )
            return USER_ERROR
        seed = args.seed if args.seed is not None else random.randrange(2**31)
        errors = spawn(_spawned, world, args.vocab, args.hidden, args.tokens, seed, timeout_s=300)[0]
    passed, text = report(errors, args.tolerance, world, args, seed)
    if rank == 0:
        print(text, flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
