"""`bench --against REF`: the same benchmark on this checkout and on another commit, round-robin in one run.

A loaded machine moves tokens/s by +-15% between runs minutes apart, so two separate runs cannot tell a
5% change from noise. Here REF is checked out in a temporary git worktree (removed afterwards) and each
(round, method) runs as one process per side, alternating: current, REF, current, REF, ... so drift hits
both sides alike. Each side's process runs with its own code first on PYTHONPATH (and as its working
directory), so its spawned ranks import that side's `vp_accelerate`. A method's ratio is the median of
the current side's tokens/s over the REF's; its spread is the lowest and highest ratio of one round's pair.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vp_accelerate import exit_codes
from vp_accelerate.bench.config import BenchConfig
from vp_accelerate.bench.report import vocab_label

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding this checkout's `vp_accelerate` (the current side's PYTHONPATH)."""


class AgainstError(RuntimeError):
    """A user error of --against (not a git checkout, an unknown REF): one line, exit 2."""


@dataclass
class Comparison:
    """One (vocab, method) of a --against run."""

    vocab: int
    method: str
    current_tokens_per_s: list[float]
    """Per round, this checkout's tokens/s (the median of its timed steps)."""
    ref_tokens_per_s: list[float]
    """Per round, REF's tokens/s, run right after the current side's process of that round."""
    ratio: float
    """median(current) / median(REF): above 1 means this checkout is faster."""
    ratio_min: float
    """The lowest of the rounds' current / REF ratios."""
    ratio_max: float
    """The highest of the rounds' current / REF ratios."""
    loss_current: float
    loss_ref: float


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise AgainstError(f"git {' '.join(args)} failed in {root}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


@contextlib.contextmanager
def ref_checkout(ref: str, root: Path = PACKAGE_ROOT):
    """A temporary worktree of `ref` (of the repository holding `root`), removed on exit; yields its path."""
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel"))
    except (AgainstError, FileNotFoundError) as e:
        raise AgainstError(
            f"--against needs vp_accelerate from a git checkout, and {root} is not one ({e}); run it from a clone"
        ) from e
    try:
        commit = _git(top, "rev-parse", "--verify", f"{ref}^{{commit}}")
    except AgainstError as e:
        raise AgainstError(f"--against {ref}: no such commit in {top}; name a commit, tag or branch") from e
    tmp = Path(tempfile.mkdtemp(prefix="vp-bench-against-"))
    path = tmp / "ref"
    try:
        _git(top, "worktree", "add", "--detach", str(path), commit)
        if not (path / "vp_accelerate").is_dir():
            raise AgainstError(f"--against {ref}: commit {commit[:12]} has no vp_accelerate package")
        yield path, commit
    finally:
        subprocess.run(["git", "-C", str(top), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(top), "worktree", "prune"], capture_output=True)


def side_env(root: Path) -> dict[str, str]:
    """The environment of one side's process: its own code first on PYTHONPATH, the other side's dropped."""
    others = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != PACKAGE_ROOT and not (Path(p) / "vp_accelerate").is_dir()
    ]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *others])}


def bench_args(cfg: BenchConfig) -> list[str]:
    """The command-line flags that make another checkout's bench run `cfg`'s measurement (methods aside)."""
    args = ["--vocabs", *map(str, cfg.vocabs), "--hidden", str(cfg.hidden), "--layers", str(cfg.layers)]
    args += ["--heads", str(cfg.heads), "--seq", str(cfg.seq), "--microbatches", str(cfg.microbatches)]
    args += ["--ranks", str(cfg.world_size), "--warmup", str(cfg.warmup), "--steps", str(cfg.steps)]
    args += ["--seed", str(cfg.seed), "--timeout", str(cfg.timeout_s)]
    return args + ([] if cfg.skip_unavailable else ["--strict"])


def run_side(root: Path, cfg: BenchConfig, method: str, workdir: Path, label: str) -> list[dict]:
    """One process of one side: `method` over cfg's vocabularies; its result rows as JSON dicts."""
    out = workdir / f"{label}.json"
    cmd = [sys.executable, "-m", "vp_accelerate.bench.run", *bench_args(cfg), "--methods", method, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=root, env=side_env(root), capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"the {label} run of {method} failed (exit {proc.returncode}) in {root}:\n{tail}")
    return json.loads(out.read_text())


def compare(cfg: BenchConfig, ref_root: Path, rounds: int, progress=None) -> list[Comparison]:
    """Run every method of cfg `rounds` times per side, alternating current / REF per (round, method)."""
    runs: dict[tuple[str, int, str], list[float]] = {}
    losses: dict[tuple[str, int, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="vp-bench-runs-") as work:
        for r in range(rounds):
            for method in cfg.methods:
                for side, root in (("current", PACKAGE_ROOT), ("ref", ref_root)):
                    for row in run_side(root, cfg, method, Path(work), f"{side}-{method}-{r}"):
                        runs.setdefault((side, row["vocab"], row["method"]), []).append(row["tokens_per_s"])
                        losses[(side, row["vocab"], row["method"])] = row["loss"]
                    if progress is not None:
                        progress(f"round {r + 1}/{rounds}: {method} ({side}) done")
    result = []
    for vocab in cfg.vocabs:
        for method in cfg.methods:
            cur, ref = runs.get(("current", vocab, method)), runs.get(("ref", vocab, method))
            if not cur or not ref:  # skipped on a side (unavailable there)
                continue
            pairs = [c / f for c, f in zip(cur, ref)]
            result.append(
                Comparison(
                    vocab=vocab,
                    method=method,
                    current_tokens_per_s=cur,
                    ref_tokens_per_s=ref,
                    ratio=statistics.median(cur) / statistics.median(ref),
                    ratio_min=min(pairs),
                    ratio_max=max(pairs),
                    loss_current=losses[("current", vocab, method)],
                    loss_ref=losses[("ref", vocab, method)],
                )
            )
    return result


def comparison_table(rows: list[Comparison], ref: str) -> str:
    head = f"| V | method | tokens/s current | tokens/s {ref} | current / {ref} | per-round spread | loss equal |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in rows:
        same = "yes" if abs(c.loss_current - c.loss_ref) <= 1e-4 else f"no ({c.loss_current:.4f} / {c.loss_ref:.4f})"
        lines.append(
            f"| {vocab_label(c.vocab)} | {c.method} | {statistics.median(c.current_tokens_per_s):,.0f} | "
            f"{statistics.median(c.ref_tokens_per_s):,.0f} | {c.ratio:.3f}x | "
            f"{c.ratio_min:.3f}x - {c.ratio_max:.3f}x | {same} |"
        )
    return "\n".join(lines)


def against_main(cfg: BenchConfig, a: argparse.Namespace) -> int:
    """`bench --against REF`: print the comparison table (and write --json / --markdown); the exit status."""
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        with ref_checkout(a.against) as (ref_root, commit):
            print(f"REF {a.against} = {commit[:12]}, checked out in {ref_root}", file=sys.stderr, flush=True)

            def progress(msg: str) -> None:
                print(f"[{time.perf_counter() - t0:.0f} s] {msg}", file=sys.stderr, flush=True)

            rows = compare(cfg, ref_root, a.rounds, progress)
    except AgainstError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    table = comparison_table(rows, a.against)
    print(table)
    print(
        f"\n{a.rounds} rounds x {len(cfg.methods)} methods x 2 sides in {time.perf_counter() - t0:.0f} s "
        f"(h={cfg.hidden}, {cfg.layers} layers, seq {cfg.seq}, {cfg.microbatches} microbatches, "
        f"{cfg.world_size} ranks, median of {cfg.steps} steps per process; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)"
    )
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(c) for c in rows], indent=1))
    return 0
