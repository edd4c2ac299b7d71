"""Launched training runs for tests, at two costs.

`train_ranks` runs `vp-accelerate train ARGS` (or scripts/fault_worker.py, with a fault) on N local ranks
forked from the fork server of `vp_accelerate.distributed.spawn`, which has torch, transformers and
accelerate imported already: each rank imports only the trainer (about a second) instead of the ~8 s a
launcher and two fresh interpreters take. Each rank sees what `accelerate launch --config_file
configs/accelerate_cpu_2proc.yaml` gives its processes (torchrun-style RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT and accelerate's ACCELERATE_* settings), runs in `cwd`, and
writes its stdout and stderr to files that come back as one text per stream, rank 0 first. Use it where the
subject is the trainer, not the launcher.

`launch` runs a real command (`accelerate launch ...`, `vp-accelerate launch ...`) as a subprocess, and
`env_ranks` starts one interpreter per rank with torchrun-style variables and no launcher: tests whose
subject is the launcher itself, exit codes as it reports them, or how an interpreter exits use them.
`forked_ranks` runs a script on ranks as `env_ranks` does, but forked from the fork server: tests whose
subject is how the ranks stop one another (a rank that raises or is killed) and not how an interpreter
exits use it.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from vp_accelerate.distributed import RankFailed, free_port, process_context, spawn

ROOT = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)
ACCELERATE = os.path.join(BIN, "accelerate")
CPU_2PROC = str(ROOT / "configs" / "accelerate_cpu_2proc.yaml")
FAULT_WORKER = str(ROOT / "scripts" / "fault_worker.py")


@dataclass
class Launched:
    """What a finished run left: its exit status and its output, as `subprocess.run` reports them."""

    returncode: int
    """0 when every rank exited 0; else the first non-zero rank's exit code (1 for a rank that raised)."""
    stdout: str
    """Every rank's stdout, rank 0 first."""
    stderr: str
    """Every rank's stderr, rank 0 first (and, for a rank that raised, its traceback)."""
    codes: list[int | None]
    """Each rank's exit code; None for a rank stopped because a peer failed."""


def run_env(cache_dir: str | os.PathLike, **extra: str) -> dict[str, str]:
    """The environment of a launched test run: offline, one thread, quiet tokenizers, a datasets cache of
    the test's own (so runs of different tests never share one)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
        "HF_DATASETS_CACHE": str(cache_dir),
        **extra,
    }


def launch(cmd: list[str], cwd: str | os.PathLike, env: dict[str, str], timeout_s: float = 600.0):
    """A real launcher command as a subprocess (`subprocess.run`, output captured as text)."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env}, cwd=str(cwd)
    )


def _torchrun_env(env: dict[str, str] | None, rank: int, nprocs: int, port: int) -> dict[str, str]:
    """This process's environment, one thread, `env`, and what torchrun gives rank `rank` of `nprocs`."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **(env or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank),
    }


def _output_to_files(logs: str, rank: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) into `logs`/rank<rank>.out and .err."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, stream in ((1, "out"), (2, "err")):
        with open(os.path.join(logs, f"rank{rank}.{stream}"), "w") as f:
            os.dup2(f.fileno(), fd)  # fd keeps the file open after f closes


def _log(logs: str, rank: int, stream: str) -> str:
    """A rank's stdout or stderr file ("" if it died before it opened one)."""
    path = Path(logs) / f"rank{rank}.{stream}"
    return path.read_text() if path.exists() else ""


def _exit_code(e: SystemExit) -> int:
    """The exit status an interpreter gives `raise SystemExit(e.code)`."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def env_ranks(
    cmd: list[str], nprocs: int, env: dict[str, str] | None = None, timeout_s: float = 300.0
) -> list[tuple[int, str, str]] | None:
    """`cmd` started once per rank as torchrun would (separate interpreters, env rendezvous on a free port,
    no launcher that stops the others when one fails), each rank's (exit code, stdout, stderr); None when
    some rank had not exited within `timeout_s` (every rank is killed then)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            cmd,
            env=_torchrun_env(env, rank, nprocs, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(nprocs)
    ]
    start, outs = time.monotonic(), []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            return None
        outs.append((p.returncode, out, err))
    return outs


def _script_rank(script: str, argv: list[str], env: dict, logs: str) -> None:
    """One rank of `forked_ranks`: `python SCRIPT ARGV` in this forked process, output into files."""
    os.environ.clear()  # the caller's environment, not the fork server's of when it started
    os.environ.update(env)
    _output_to_files(logs, env["RANK"])
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback on stderr, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def forked_ranks(
    script: str, argv: list[str], nprocs: int, env: dict[str, str] | None = None, timeout_s: float = 300.0
) -> list[tuple[int, str, str]] | None:
    """`python SCRIPT ARGV` on `nprocs` ranks as `env_ranks` runs them (torchrun-style variables, env
    rendezvous, no launcher, nothing that stops the other ranks when one fails), each rank's (exit code,
    stdout, stderr), or None when some rank had not exited within `timeout_s` (every rank is killed then).

    The ranks are forked from the preloaded fork server, so each skips the ~8 s of importing torch and
    transformers. A rank ends as a multiprocessing child does: its non-daemon threads are joined, as at
    interpreter exit, but then it leaves with os._exit, without atexit hooks or interpreter teardown.
    Where how an interpreter exits is the subject, use `env_ranks`."""
    ctx, port = process_context(), free_port()
    with tempfile.TemporaryDirectory(prefix="vp_ranks_") as logs:
        procs = [
            ctx.Process(target=_script_rank, args=(script, list(argv), _torchrun_env(env, r, nprocs, port), logs))
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
                p.join()
            return None
        return [(p.exitcode, *(_log(logs, r, s) for s in ("out", "err"))) for r, p in enumerate(procs)]


def accelerate_train(args: list[str], config: str = CPU_2PROC) -> list[str]:
    """`accelerate launch --config_file CONFIG -m vp_accelerate train ARGS`."""
    return [ACCELERATE, "launch", "--config_file", config, "-m", "vp_accelerate", "train", *args]


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _rank_main(argv: list[str], cwd: str, env: dict, logs: str, fault: dict | None, mixed_precision: str | None) -> int:
    """One rank of `train_ranks`: the environment accelerate's launcher would give it (none for a plain
    process: `mixed_precision` None), output into files, then the command's own main, its return value (or
    SystemExit's code) the rank's exit code."""
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    os.environ.update(env)
    if mixed_precision is None:
        for name in LAUNCHER_VARS:
            del os.environ[name]
    else:
        os.environ.update(
            LOCAL_WORLD_SIZE=world,
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            ROLE_RANK=rank,
            ROLE_WORLD_SIZE=world,
            ACCELERATE_MIXED_PRECISION=mixed_precision,
            ACCELERATE_DYNAMO_BACKEND="NO",
            PYTHONUNBUFFERED="1",
        )
    os.chdir(cwd)
    _output_to_files(logs, rank)
    try:
        if fault is not None:
            import importlib.util

            spec = importlib.util.spec_from_file_location("fault_worker", FAULT_WORKER)
            worker = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(worker)
            worker.install(fault)
            from vp_accelerate.train.cli.commands import train_main

            code = train_main(argv)
        else:
            from vp_accelerate.cli import main

            code = main(["train", *argv])
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()  # into this rank's stderr file, as an interpreter would before exiting 1
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return int(code or 0)


def train_ranks(
    args: list[str],
    cwd: str | os.PathLike,
    env: dict[str, str] | None = None,
    nprocs: int = 2,
    fault: dict | None = None,
    mixed_precision: str | None = "no",
    timeout_s: float = 300.0,
) -> Launched:
    """`vp-accelerate train ARGS` on `nprocs` ranks forked from the preloaded fork server, as
    `accelerate launch --config_file configs/accelerate_cpu_2proc.yaml --num_processes NPROCS` would run it
    (`mixed_precision`: its --mixed_precision; None: one plain `python -m vp_accelerate train` process, no
    launcher variables). With `fault`, scripts/fault_worker.py's injection (its VP_FAULT, as a dict) is
    installed first. `env` is added to this process's environment for the ranks."""
    if mixed_precision is None and nprocs != 1:
        raise ValueError("a plain process (mixed_precision None) is one process")
    with tempfile.TemporaryDirectory(prefix="vp_ranks_") as logs:
        try:
            codes: list[int | None] = list(
                spawn(
                    _rank_main,
                    nprocs,
                    list(args),
                    str(cwd),
                    dict(env or {}),
                    logs,
                    fault,
                    mixed_precision,
                    timeout_s=timeout_s,
                )
            )
            failure = ""
        except RankFailed as e:  # a rank raised or died: report it as a launcher would, exit code 1
            failure = str(e)
            codes = [None] * nprocs
            for line in failure.splitlines():
                if line.startswith("rank ") and " failed: " in line:
                    codes[int(line.split()[1])] = 1
        texts = {stream: "".join(_log(logs, r, stream) for r in range(nprocs)) for stream in ("out", "err")}
    code = next((c for c in codes if c), 0)
    return Launched(code, texts["out"], texts["err"] + failure, codes)


def fault_json(fault: dict | None) -> str:
    """scripts/fault_worker.py's VP_FAULT for a real launch."""
    return json.dumps(fault or {})


def losses(out_dir) -> dict[int, float]:
    """step -> train/loss of a run's metrics.jsonl (`logging.output_dir`)."""
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
