"""Shared pieces of the kill-and-resume fault scripts: a tiny run, launching it, killing it, comparing.

A run here is the real trainer under `accelerate launch` on 2 gloo processes (through
scripts/fault_worker.py, which can inject faults), small enough to take ~20 s on a loaded 2-core box:
a tiny Llama, fp32, CPU, wandb off, a checkpoint every `every` steps and metrics every step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
WORKER = os.path.join(ROOT, "scripts", "fault_worker.py")


@dataclass
class RunSpec:
    """The run every fault script trains (and its uninterrupted twin)."""

    work: str
    """Directory for corpus, tokenizer, recipe and the runs."""
    steps: int = 12
    """Optimizer steps of the whole run."""
    every: int = 3
    """Checkpoint every this many steps."""
    seed: int = 0
    """Model init / data order seed."""


def run_parser(doc: str, default_work: str) -> argparse.ArgumentParser:
    """The options every fault script takes (the RunSpec fields); scripts add their own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--work", default=default_work)
    ap.add_argument("--steps", type=int, default=RunSpec.steps)
    ap.add_argument("--every", type=int, default=RunSpec.every)
    ap.add_argument("--seed", type=int, default=RunSpec.seed)
    return ap


def spec_from(args: argparse.Namespace) -> RunSpec:
    return RunSpec(args.work, args.steps, args.every, args.seed)


def prepare(spec: RunSpec) -> str:
    """Write a corpus, a 512-token BPE and the recipe into spec.work; returns the recipe path."""
    import yaml

    from vp_accelerate.train.tokens.tokenizer import train_bpe

    os.makedirs(spec.work, exist_ok=True)
    corpus = os.path.join(spec.work, "train.jsonl")
    rng = random.Random(spec.seed)
    words = "alpha beta gamma delta epsilon мир дом 世界 你好 données λόγος".split()
    with open(corpus, "w") as f:
        for _ in range(1500):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=40))}) + "\n")
    train_bpe([corpus], 512, os.path.join(spec.work, "tok"), min_frequency=1)
    recipe = {
        "model": {
            "source": "llama-tiny",
            "config": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
        },
        "tokenizer": {"source": f"bpe:{os.path.join(spec.work, 'tok')}"},
        "data": {"files": [corpus], "seq_len": 32, "eval_holdout": 0.05},
        "pipeline": {"microbatches": 4},
        "optimizer": {"lr": 3e-3},
        "lr": {"warmup_steps": 2},
        "train": {"steps": spec.steps, "global_batch": 8, "seed": spec.seed},
        "eval": {"every": 0, "batches": 1},
        "checkpoint": {"every": spec.every, "keep": 100},
        "logging": {"wandb_mode": "disabled", "log_every": 1, "timeline_image": False},
    }
    path = os.path.join(spec.work, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return path


def start(spec: RunSpec, name: str, fault: dict | None = None, resume: bool = False) -> subprocess.Popen:
    """Start a run in its own process group (so a kill reaches the launcher and both ranks)."""
    out = os.path.join(spec.work, name)
    if not resume:  # a fresh run of this script: an earlier one's checkpoints would be refused (not mixed in)
        shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": os.path.join(spec.work, "ds_cache"),
        "VP_FAULT": json.dumps(fault or {}),
    }
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        os.path.join(ROOT, "configs", "accelerate_cpu_2proc.yaml"),
        WORKER,
        os.path.join(spec.work, "recipe.yaml"),
        "--set",
        f"logging.output_dir={out}",
        "--set",
        f"checkpoint.dir={os.path.join(out, 'ckpt')}",
    ] + (["--resume"] if resume else [])
    log = open(os.path.join(out, "resume.log" if resume else "run.log"), "w")
    return subprocess.Popen(cmd, env=env, cwd=spec.work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, what: str, timeout_s: float = 600) -> None:
    code = proc.wait(timeout=timeout_s)
    if code != 0:
        raise SystemExit(f"{what} exited {code}; see its run.log / resume.log")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torch's elastic agent may put the ranks in their own process groups,
    so killing the launcher's group alone can leave ranks running and writing checkpoints)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the ranks first (as a crash would take them), then the launcher and its group."""
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kill_when(proc: subprocess.Popen, condition, timeout_s: float = 600, poll_s: float = 0.005) -> float:
    """SIGKILL the run's whole process group as soon as `condition()` is true; returns when (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (exit {proc.returncode}) before the kill condition was met")
        if time.monotonic() > deadline:
            kill_all(proc)
            raise SystemExit("the kill condition was never met")
        time.sleep(poll_s)
    kill_all(proc)
    return time.monotonic()


def metrics(spec: RunSpec, name: str) -> dict[int, dict]:
    """step -> logged training metrics of a run (the last row wins when a resumed run re-logs a step)."""
    path = os.path.join(spec.work, name, "metrics.jsonl")
    rows = {}
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line cut by the kill
                    continue
                if "train/loss" in r:
                    rows[r["step"]] = r
    return rows


def final_weights(spec: RunSpec, name: str) -> dict[int, dict]:
    """rank -> model state of the latest checkpoint of a run (safetensors)."""
    from vp_accelerate.train.persist import store as ckpt

    path = ckpt.read_latest(os.path.join(spec.work, name, "ckpt"))
    return {rank: ckpt.load_rank(path, rank)[0] for rank in (0, 1)}


def max_weight_diff(a: dict[int, dict], b: dict[int, dict]) -> float:
    diff = 0.0
    for rank in a:
        assert a[rank].keys() == b[rank].keys()
        for k in a[rank]:
            diff = max(diff, float((a[rank][k].double() - b[rank][k].double()).abs().max()))
    return diff


def compare_losses(ref: dict[int, dict], got: dict[int, dict], steps) -> list[str]:
    """Per-step differences of loss / grad norm / LR between two runs (empty when identical)."""
    bad = []
    for s in steps:
        if s not in got:
            bad.append(f"step {s}: missing from the resumed run")
            continue
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            if ref[s][key] != got[s][key]:
                bad.append(f"step {s}: {key} {got[s][key]!r} != uninterrupted {ref[s][key]!r}")
    return bad
