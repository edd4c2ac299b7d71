"""Do README-style scripts exit 0 on every rank, also on a loaded machine? Count the ranks that do not.

    python scripts/exit_stress.py                  # 20 runs, no extra load
    python scripts/exit_stress.py --n 40 --load 4  # 40 runs beside 4 busy loops (niced)
    python scripts/exit_stress.py --lock-refusal --n 40 --load 4  # launches refused by the output-dir lock

Each run starts 2 interpreters with torchrun's variables (no launcher, so nothing stops a rank or hides its
exit code), each running a short script as the README's Python API shows: Accelerator, PipelineModel
(tiny Llama, vocab-2, the schedule cycling through 1f1b / vhalf / interleaved), 3 optimizer steps, an
evaluation and `export_hf`, no `close()`. A rank that exits non-zero is printed with its last stderr lines
("terminate called without an active exception" is the abort at exit this looks for). Exit code 1 when
any rank exited non-zero.

`--lock-refusal`: each run is instead a `vp-accelerate launch` of a 2-rank training recipe whose output dir
this script holds locked, so every launch stops at its start with one line and exit 2. Counted as failing:
a launcher exit other than 2, or any rank's "terminate called" abort in its output.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vp_accelerate.distributed import free_port  # noqa: E402 - after the path

SCRIPT = textwrap.dedent("""
    import sys, torch
    from accelerate import Accelerator
    from transformers import LlamaConfig
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    accelerator = Accelerator(cpu=True)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4)
    pipe = PipelineModel(config, PipelineConfig(schedule=sys.argv[1], method="vocab-2", microbatches=4))
    opt = pipe.make_optimizer(lr=3e-4)
    for step in range(3):
        ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(step))
        res = pipe.train_step(ids, labels=ids)
        pipe.clip_grad_norm_(1.0)
        pipe.step(opt); pipe.zero_grad()
    print(pipe.eval_step(ids, labels=ids), flush=True)
    pipe.export_hf(sys.argv[2])
""")


def start_run(script: str, schedule: str, out: str) -> list[subprocess.Popen]:
    """One 2-rank run: two interpreters with torchrun's variables."""
    port, procs = free_port(), []
    for rank in range(2):
        env = {
            **os.environ,
            **dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2"),
            **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, script, schedule, out],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def lock_refusal_setup(work: str) -> list[str]:
    """The demo corpus and tokenizer, a recipe writing into `work/out`, that dir's lock held by this process;
    returns the launch command."""
    from vp_accelerate.train.run import run_lock

    py = dict(check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ROOT})
    subprocess.run(
        [sys.executable, f"{ROOT}/scripts/make_demo_corpus.py", "--out", f"{work}/corpus", "--size-mb", "0.3"], **py
    )
    tok = [f"{ROOT}/scripts/train_tokenizer.py", "--vocab-size", "512", "--out", f"{work}/tok"]
    subprocess.run([sys.executable, *tok, f"{work}/corpus/train.jsonl"], **py)
    with open(f"{ROOT}/recipes/quickstart.yaml") as f:
        recipe = f.read()
    for old, new in (
        ("bpe:outputs/demo_tokenizer", f"bpe:{work}/tok"),
        ("outputs/demo_corpus", f"{work}/corpus"),
        ("outputs/quickstart", f"{work}/out"),
    ):
        recipe = recipe.replace(old, new)
    with open(f"{work}/r.yaml", "w") as f:
        f.write(recipe)
    run_lock.acquire(f"{work}/out")
    launch = [os.path.join(os.path.dirname(sys.executable), "vp-accelerate"), "launch", "--config_file"]
    return [*launch, f"{ROOT}/configs/accelerate_cpu_2proc.yaml", "train", f"{work}/r.yaml"]


def lock_refusals(args, work: str, codes: collections.Counter) -> int:
    """`--lock-refusal`: launches that must each exit 2 with no abort; returns how many did not."""
    command, failed = lock_refusal_setup(work), 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for run in range(args.n):
        p = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        codes[p.returncode] += 1
        out = p.stdout + p.stderr
        if p.returncode != 2 or "terminate called" in out:
            failed += 1
            tail = " / ".join(out.strip().splitlines()[-4:])
            print(f"launch {run} exited {p.returncode}: {tail}", flush=True)
    return failed


def readme_runs(args, work: str, codes: collections.Counter) -> int:
    """The README-style scripts; returns how many rank exits were non-zero."""
    script, failed, running = os.path.join(work, "readme_script.py"), 0, []
    with open(script, "w") as f:
        f.write(SCRIPT)
    for i in range(args.n + 1):
        if i < args.n:
            schedule = ("1f1b", "vhalf", "interleaved")[i % 3]
            running.append((i, schedule, start_run(script, schedule, os.path.join(work, f"out{i}"))))
        while running and (len(running) >= args.parallel or i == args.n):
            run, schedule, procs = running.pop(0)
            for rank, p in enumerate(procs):
                _, err = p.communicate(timeout=900)
                codes[p.returncode] += 1
                if p.returncode != 0:
                    failed += 1
                    tail = " / ".join(line for line in err.strip().splitlines()[-4:])
                    print(f"run {run} ({schedule}) rank {rank} exited {p.returncode}: {tail}", flush=True)
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="runs")
    ap.add_argument("--load", type=int, default=0, help="busy loops (niced) beside the runs")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time")
    ap.add_argument("--lock-refusal", action="store_true", help="vp-accelerate launches refused by the lock")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="exit-stress-")
    busy = [subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", "while 1: pass"]) for _ in range(args.load)]
    load_before, codes, start = os.getloadavg()[0], collections.Counter(), time.monotonic()
    try:
        failed = lock_refusals(args, work, codes) if args.lock_refusal else readme_runs(args, work, codes)
    finally:
        for p in busy:
            p.kill()
    what = "launches failing (not exit 2, or an abort)" if args.lock_refusal else "non-zero rank exits"
    print(
        f"{args.n} runs x 2 ranks, {args.load} busy loops: {failed} {what} (exit codes {dict(codes)}); "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; {time.monotonic() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
