"""Do README-style scripts exit 0 on every rank, also on a loaded machine? Count the ranks that do not.

    python scripts/exit_stress.py                  # 20 runs, no extra load
    python scripts/exit_stress.py --n 40 --load 4  # 40 runs beside 4 busy loops (niced)

Each run starts 2 interpreters with torchrun's variables (no launcher, so nothing stops a rank or hides its
exit code), each running a short script as the README's Python API shows: Accelerator, PipelineModel
(tiny Llama, vocab-2, the schedule cycling through 1f1b / vhalf / interleaved), 3 optimizer steps, an
evaluation and `export_hf`, no `close()`. A rank that exits non-zero is printed with its last stderr lines
("terminate called without an active exception" is the abort at exit this looks for). Exit code 1 when
any rank exited non-zero.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="runs")
    ap.add_argument("--load", type=int, default=0, help="busy loops (niced) beside the runs")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="exit-stress-")
    script = os.path.join(work, "readme_script.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    busy = [subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", "while 1: pass"]) for _ in range(args.load)]
    load_before, codes, failed, start = os.getloadavg()[0], collections.Counter(), 0, time.monotonic()
    try:
        running: list = []
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
    finally:
        for p in busy:
            p.kill()
    print(
        f"{args.n} runs x 2 ranks, {args.load} busy loops: {failed} non-zero rank exits (exit codes {dict(codes)}); "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; {time.monotonic() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
