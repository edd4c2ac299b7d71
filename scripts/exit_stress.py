"""Do README-style scripts exit 0 on every rank, also on a loaded machine? Count the ranks that do not.

    python scripts/exit_stress.py                  # 20 runs, no extra load
    python scripts/exit_stress.py --n 40 --load 4  # 40 runs beside 4 busy loops (niced)
    python scripts/exit_stress.py --lock-refusal --n 40 --load 4  # launches refused by the output-dir lock
    python scripts/exit_stress.py --families --n 200 --load 2 --nice 0 --parallel 2 \
        --trees /path/to/old /path/to/new --tail none allreduce --cores /tmp/cores  # the family check's form

Each run starts 2 interpreters with torchrun's variables (no launcher, so nothing stops a rank or hides its
exit code), each running a short script as the README's Python API shows: Accelerator, PipelineModel
(tiny Llama, vocab-2, the schedule cycling through 1f1b / vhalf / interleaved), 3 optimizer steps, an
evaluation and `export_hf`, no `close()`. A rank that exits non-zero is printed with its last stderr lines
("terminate called without an active exception" is the abort at exit this looks for). Exit code 1 when
any rank exited non-zero.

`--lock-refusal`: each run is instead a `vp-accelerate launch` of a 2-rank training recipe whose output dir
this script holds locked, so every launch stops at its start with one line and exit 2. Counted as failing:
a launcher exit other than 2, or any rank's "terminate called" abort in its output.

`--families`: each run is `torchrun --nproc_per_node 2` of a script that loads `PipelineModel(dir)` from a
tiny save_pretrained directory (FAMILIES, built here as scripts/model_coverage.py builds them), runs
`eval_step` in float64, prints the loss and ends without `close()` (`--tail allreduce`: one more all-reduce
first), alternating over the source trees of `--trees` (each run's PYTHONPATH) and the endings. Counted as
failing: a launcher exit other than 0, an abort, or a missing loss. `--cores DIR` sets the kernel's core
pattern to DIR (when writable) and prints gdb's `thread apply all bt` of the first aborted ranks' cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402 - after the path

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


FAMILY_SCRIPT = textwrap.dedent("""
    import sys, torch
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    pipe = PipelineModel(sys.argv[1], PipelineConfig(microbatches=2, attn_implementation="eager"), dtype=torch.float64)
    vocab = pipe.hf_config.vocab_size
    ids = torch.randint(3, vocab, (4, 10), generator=torch.Generator().manual_seed(0))
    loss = pipe.eval_step(ids, labels=ids)
    print("loss", loss, flush=True)
    if sys.argv[2] == "allreduce":  # the script's own last collective, as a script averaging a metric ends
        torch.distributed.all_reduce(torch.tensor([loss], dtype=torch.float64))
    # no pipe.close()
""")

#: The families of the checks that saw the abort (31 of docs/models.md's passing ones, phi and qwen2 among them).
FAMILIES = (
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe phi phi3 gemma gemma2 gemma3_text gpt2 gpt_neox gptj "
    "codegen cohere cohere2 starcoder2 olmo olmo2 olmo3 granite glm glm4 helium smollm3 deepseek_v3 exaone4 "
    "ministral apertus"
).split()


def family_dirs(work: str, families: list[str]) -> dict[str, str]:
    """A tiny save_pretrained directory per family (as scripts/model_coverage.py builds them)."""
    from transformers import AutoModelForCausalLM

    from vp_accelerate.bench.coverage import _quiet, tiny_family_config

    _quiet()
    dirs = {}
    for i, family in enumerate(families):
        torch.manual_seed(i)
        dirs[family] = os.path.join(work, family)
        AutoModelForCausalLM.from_config(tiny_family_config(family)).save_pretrained(dirs[family])
    return dirs


def set_core_limit() -> None:
    """In a launched run's process (inherited by its ranks): core dumps of any size."""
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def start_torchrun(script: str, ckpt: str, tree: str, cores: bool, tail: str = "none") -> subprocess.Popen:
    """`torchrun --nproc_per_node 2 script ckpt` with `tree` first on the path (the code under test)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONFAULTHANDLER", None)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), script, ckpt, tail]
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.path.dirname(script),
        preexec_fn=set_core_limit if cores else None,
    )


def native_stacks(out: str, core_dir: str) -> str:
    """gdb's `thread apply all bt` of the cores of the ranks the output names as killed by a signal."""
    stacks = []
    for pid in sorted(set(re.findall(r"exitcode\s*:\s*-\d+ \(pid: (\d+)\)", out))):
        core = os.path.join(core_dir, f"core.{pid}")
        for _ in range(60):  # the kernel may still be writing it
            if os.path.exists(core):
                break
            time.sleep(1)
        if not os.path.exists(core):
            stacks.append(f"(no core for pid {pid} in {core_dir})")
            continue
        gdb = ["gdb", "-batch", "-ex", "info threads", "-ex", "thread apply all bt", sys.executable, core]
        p = subprocess.run(gdb, capture_output=True, text=True, timeout=600)
        stacks.append(f"== core {core}\n{p.stdout}")
        os.remove(core)
    return "\n".join(stacks)


def family_runs(args, work: str, codes: collections.Counter) -> int:
    """`--families`: torchrun launches of the eval script over the families, round-robin over `--trees`;
    returns how many runs failed (a rank not exit 0, an abort, or no loss printed)."""
    script = os.path.join(work, "family_eval.py")
    with open(script, "w") as f:
        f.write(FAMILY_SCRIPT)
    families = args.family or list(FAMILIES)
    dirs = family_dirs(work, families)
    trees = args.trees or [ROOT]
    core_dir = args.cores
    if core_dir:
        os.makedirs(core_dir, exist_ok=True)
        try:
            with open("/proc/sys/kernel/core_pattern", "w") as f:
                f.write(os.path.join(core_dir, "core.%p"))
        except OSError as e:
            print(f"core_pattern not writable ({e}): no native stacks", flush=True)
    tails = args.tail or ["none"]
    kinds = [(t, tail) for tail in tails for t in trees]  # round-robin over (tree, script ending)
    failed, per_kind, running = 0, {k: collections.Counter() for k in kinds}, []
    jobs = [(i, families[(i // len(kinds)) % len(families)], *kinds[i % len(kinds)]) for i in range(args.n)]
    for k in range(len(jobs) + 1):
        if k < len(jobs):
            i, family, tree, tail = jobs[k]
            p = start_torchrun(script, dirs[family], tree, bool(core_dir), tail)
            running.append((i, family, tree, tail, time.monotonic(), p))
        while running and (len(running) >= args.parallel or k == len(jobs)):
            i, family, tree, tail, t0, p = running.pop(0)
            out, _ = p.communicate(timeout=900)
            codes[p.returncode] += 1
            bad = (
                p.returncode != 0 or "terminate called" in out or out.count("loss") < 2
            )  # the ranks' lines may interleave
            per_kind[tree, tail]["runs"] += 1
            per_kind[tree, tail]["failed"] += bad
            if bad:
                failed += 1
                load = os.getloadavg()[0]
                # the ranks' own lines first (a rank's error, the exit hook's line, C++'s), then the launcher's tail
                said = [ln for ln in out.splitlines() if re.search(r"\[vp-accelerate\]|Error|terminate called", ln)]
                last = " / ".join(said[-6:] + out.strip().splitlines()[-12:])
                print(f"run {i} {family} [{tree}, {tail}] exited {p.returncode} (load {load:.1f}): {last}", flush=True)
                if core_dir and failed <= 3:  # gdb over a core costs as much as a run: the first three
                    print(native_stacks(out, core_dir), flush=True)
            if args.verbose:
                print(f"run {i} {family} [{tree}, {tail}] {p.returncode} {time.monotonic() - t0:.0f} s", flush=True)
            if (i + 1) % 20 == 0:
                load = " ".join(f"{x:.1f}" for x in os.getloadavg())
                done = "; ".join(f"{t} {e}: {c['failed']}/{c['runs']}" for (t, e), c in per_kind.items())
                print(f"after {i + 1} runs: {done} (load {load}, {time.strftime('%H:%M:%S')})", flush=True)
    for (t, e), c in per_kind.items():
        print(f"tree {t}, ending {e}: {c['failed']} of {c['runs']} runs failed", flush=True)
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="runs")
    ap.add_argument("--load", type=int, default=0, help="busy loops (niced) beside the runs")
    ap.add_argument("--nice", type=int, default=5, help="niceness of the busy loops (0: as the runs, as other jobs)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time")
    ap.add_argument("--lock-refusal", action="store_true", help="vp-accelerate launches refused by the lock")
    ap.add_argument("--families", action="store_true", help="torchrun launches of eval_step over the families")
    ap.add_argument("--family", action="append", help="--families: only these (repeatable; default FAMILIES)")
    ap.add_argument("--trees", nargs="+", help="--families: source trees to alternate (PYTHONPATH; default this)")
    ap.add_argument(
        "--tail",
        nargs="+",
        choices=("none", "allreduce"),
        help="--families: how the script ends after printing the loss (alternated; default none: nothing more)",
    )
    ap.add_argument("--cores", help="--families: a folder for core dumps; gdb prints an aborted rank's stacks")
    ap.add_argument("--verbose", action="store_true", help="one line per run")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="exit-stress-")
    busy = [
        subprocess.Popen(["nice", "-n", str(args.nice), sys.executable, "-c", "while 1: pass"])
        for _ in range(args.load)
    ]
    load_before, codes, start = os.getloadavg()[0], collections.Counter(), time.monotonic()
    try:
        if args.families:
            failed = family_runs(args, work, codes)
        elif args.lock_refusal:
            failed = lock_refusals(args, work, codes)
        else:
            failed = readme_runs(args, work, codes)
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
