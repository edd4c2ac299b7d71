"""Faults in 2-process training runs (gloo, CPU), injected by scripts/fault_worker.py: the trainer's own
decisions on 2 ranks forked as `accelerate launch` would start them (tests/helpers/launch.py), a rank that
fails mid-step under a real `accelerate launch`.

- a NaN in one microbatch's input embedding: with `train.on_nonfinite: skip` the step is skipped, the
  message names the microbatch and its data rows, training goes on, every checkpoint is finite;
- resuming that run's checkpoint with another model config is refused, listing the difference;
- an inf gradient on one rank with `on_nonfinite: stop`: every rank stops with exit code 3 naming the
  parameter's rank, and no checkpoint of that step exists.

- one rank raises mid-step inside the trainer: every rank exits non-zero, in bounded time, and the peer
  names the failing rank (SIGKILL of one rank: slow; runtime-level versions: tests/test_runtime_faults.py).
Kill during a checkpoint write and kill + resume are scripts/fault_checkpoint_kill.py and
scripts/fault_kill_resume.py (minutes; tests/test_faults_scripts.py, slow).
"""

import json
import os
import random

import pytest
import torch

from helpers.launch import ACCELERATE, CPU_2PROC, FAULT_WORKER, fault_json, run_env, train_ranks
from helpers.launch import launch as run
from helpers.tiny import fault_run

RNG = random.Random()  # fresh each run: which microbatch / step gets poisoned varies


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    seed, train_seed = RNG.random(), RNG.randrange(1000)
    return fault_run(d, lines=600, seed=seed, steps=4, train_seed=train_seed, checkpoint={"every": 1, "keep": 10})


def _args(d, name, sets, extra) -> list[str]:
    return [
        str(d / "recipe.yaml"),
        "--set",
        f"logging.output_dir={d / name}",
        "--set",
        f"checkpoint.dir={d / name / 'ckpt'}",
        *[a for s in sets for a in ("--set", s)],
        *extra,
    ]


def launch(d, name, fault: dict | None, *sets, extra=()):
    """A real `accelerate launch` of scripts/fault_worker.py (the launcher's part is the subject)."""
    cmd = [ACCELERATE, "launch", "--config_file", CPU_2PROC, FAULT_WORKER, *_args(d, name, sets, extra)]
    return run(cmd, d, run_env(d / "ds_cache", VP_FAULT=fault_json(fault)), timeout_s=240)


def train_forked(d, name, fault: dict | None, *sets, extra=()):
    """`launch`'s run on 2 ranks forked from the preloaded fork server, for the faults whose subject is the
    trainer (every rank reaches the same decision and exits by itself), not the launcher."""
    return train_ranks(_args(d, name, sets, extra), d, run_env(d / "ds_cache"), fault=fault or {})


def finite_checkpoints(ckpt_dir):
    from safetensors.torch import load_file

    steps = sorted(p for p in os.listdir(ckpt_dir) if p.startswith("step_") and not p.endswith(".tmp"))
    for step in steps:
        for rank in (0, 1):
            state = load_file(os.path.join(ckpt_dir, step, f"rank_{rank:05d}", "model.safetensors"))
            assert all(torch.isfinite(t).all() for t in state.values()), (step, rank)
    return steps


@pytest.fixture(scope="module")
def skipped_run(setup):
    step, mb = RNG.randrange(2, 4), RNG.randrange(4)
    out = train_forked(
        setup, "skip", {"poison": {"step": step, "microbatch": mb, "value": "nan"}}, "train.on_nonfinite=skip"
    )
    return out, step, mb


def test_nan_in_one_microbatch_is_skipped_and_named(setup, skipped_run):
    out, step, mb = skipped_run
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert (
        f"step {step}: non-finite loss (nan) in microbatch {mb} of 4 (replica 0) = packed training sequences [" in log
    ), log[-3000:]
    assert "skipping the update (train.on_nonfinite: skip)" in log
    rows = [json.loads(line) for line in open(setup / "skip" / "metrics.jsonl")]
    train = {r["step"]: r for r in rows if "train/loss" in r}
    assert train[4]["train/skipped_steps"] == 1 and train[step - 1]["train/skipped_steps"] == 0
    assert all(torch.isfinite(torch.tensor(train[s]["train/loss"])) for s in train if s != step)
    assert finite_checkpoints(setup / "skip" / "ckpt") == [f"step_{s:08d}" for s in range(1, 5)]


def test_resume_with_another_model_is_refused(setup, skipped_run):
    out = train_forked(setup, "skip", None, "model.config.intermediate_size=96", extra=["--resume"])
    log = out.stdout + out.stderr
    assert out.returncode != 0 and out.codes == [3, 3]
    assert "does not match this run" in log and "model: checkpoint has" in log, log[-3000:]
    assert log.count("training stopped: CheckpointError") == 2  # both ranks say it


def test_inf_gradient_stops_every_rank_and_keeps_the_last_checkpoint(setup):
    from vp_accelerate.train.persist import store as ckpt

    step = RNG.randrange(2, 4)
    out = train_forked(
        setup, "stop", {"poison_grad": {"step": step, "rank": 1, "param": 0, "value": "inf"}}, "train.on_nonfinite=stop"
    )
    log = out.stdout + out.stderr
    assert out.returncode != 0 and out.codes == [3, 3]
    assert log.count("training stopped: NonFiniteError") == 2, log[-3000:]  # every rank, the same decision
    assert (
        f"step {step}: non-finite gradient (global norm inf) although the loss of every microbatch was finite" in log
        and "rank 1: " in log
    )
    cdir = str(setup / "stop" / "ckpt")
    assert ckpt.read_latest(cdir).endswith(f"step_{step - 1:08d}")
    assert finite_checkpoints(cdir) == [f"step_{s:08d}" for s in range(1, step)]


# slow: a full `accelerate launch` each (~15 s); tests/test_runtime_faults.py stops a failed rank's peers in the suite
@pytest.mark.parametrize(
    "how", [pytest.param("raise", marks=pytest.mark.slow), pytest.param("kill", marks=pytest.mark.slow)]
)
def test_a_rank_failing_mid_step_stops_the_trainer_everywhere(setup, how):
    import time

    rank, step = RNG.randrange(2), RNG.randrange(2, 4)
    t0 = time.monotonic()
    out = launch(setup, f"fail_{how}", {"fail": {"step": step, "rank": rank, "how": how}})
    elapsed = time.monotonic() - t0
    log = out.stdout + out.stderr
    assert out.returncode != 0 and elapsed < 200
    assert "done: final eval loss" not in log  # nobody finished
    if how == "raise":
        assert f"injected failure at step {step}" in log
        # the peer is stopped by the watchdog (naming the rank), gloo's closed connection, or the launcher
        assert (
            f"peer failed — rank {rank}: RuntimeError: injected failure" in log
            or "Connection closed" in log
            or "Connection reset" in log
            or "SIGTERM" in log
        ), log[-3000:]
    else:
        assert "Signal 9" in log or "SIGKILL" in log or "exitcode  : -9" in log, log[-3000:]


@pytest.mark.parametrize("during, every", [("step", 10), ("save", 1)])
def test_a_stop_signal_saves_the_step_and_exits_75_on_every_rank(setup, during, every):
    """A real SIGTERM (preemption) reaching one rank mid-step, or every rank inside a checkpoint write: both ranks
    finish the step, the checkpoint of that step is written once and complete, every rank says so and exits 75;
    --resume goes on from the next step. Before: exit 143 on the signalled rank, nothing saved."""
    from vp_accelerate.train.persist import store as ckpt

    step = RNG.randrange(2, 4)
    fault = {"signal": {"step": step, "during": during, **({"rank": 1} if during == "step" else {})}}
    name = f"preempt_{during}"
    out = train_forked(setup, name, fault, f"checkpoint.every={every}")
    log = out.stdout + out.stderr
    assert out.codes == [75, 75], log[-3000:]
    assert log.count(f"stopped by SIGTERM at step {step}; resume with --resume") == 2, log[-3000:]
    d = setup / name / "ckpt"
    assert ckpt.read_latest(str(d)).endswith(f"step_{step:08d}")
    saved = sorted(p for p in os.listdir(d) if p.startswith("step_"))
    assert saved == [f"step_{s:08d}" for s in range(every, step + 1, every)] or saved == [f"step_{step:08d}"], saved
    again = train_forked(setup, name, None, f"checkpoint.every={every}", extra=["--resume"])
    assert again.codes == [0, 0], (again.stdout + again.stderr)[-3000:]
    rows = [json.loads(line) for line in open(setup / name / "metrics.jsonl")]
    trained = [r["step"] for r in rows if "train/loss" in r]
    assert trained == list(range(1, 5)), trained  # each step once: none lost, none repeated


@pytest.mark.slow
def test_sigterm_to_a_launched_job_saves_and_exits_75(setup):
    """SLURM's preemption as it happens: SIGTERM to every process of a real `vp-accelerate launch` job (the
    launcher and its ranks) while it trains: the ranks finish their step and save, the launcher exits 75."""
    import signal
    import subprocess
    import time

    from helpers.launch import BIN
    from vp_accelerate.train.persist import store as ckpt

    name = "preempt_launch"
    cmd = [os.path.join(BIN, "vp-accelerate"), "launch", "--config_file", CPU_2PROC, "train"]
    cmd += _args(setup, name, ["train.steps=100000", "checkpoint.every=100000"], ())
    env = {**os.environ, **run_env(setup / "ds_cache")}
    proc = subprocess.Popen(cmd, cwd=setup, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = setup / name / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and '"train/loss"' in metrics.read_text()):
        time.sleep(0.2)
    for pid in [proc.pid, *_children(proc.pid)]:  # as `scancel` does: every process of the job
        os.kill(pid, signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, log[-3000:]
    assert log.count("; resume with --resume") >= 2, log[-3000:]
    assert ckpt.read_latest(str(setup / name / "ckpt")) is not None


def _children(pid: int) -> list[int]:
    out = []
    for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
        out += [int(child), *_children(int(child))]
    return out


def test_init_from_and_export_refuse_a_damaged_shard(setup, skipped_run, tmp_path, capsys):
    """4 KiB flipped inside one rank's weights (the file still parses): `model.init_from` stops every rank with
    exit 3 naming the file, and export refuses it, as --resume does. Before: init_from trained and exported the
    garbage silently."""
    import shutil

    from vp_accelerate.train.cli.commands import export_main

    src = setup / "skip" / "ckpt" / "step_00000004"
    copy = tmp_path / "ckpt" / "step_00000004"
    shutil.copytree(src, copy)
    weights = copy / "rank_00001" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 4096 - 8)
        block = f.read(4096)
        f.seek(-4096, os.SEEK_CUR)
        f.write(bytes(b ^ 0x5A for b in block))
    out = train_forked(setup, "init_damaged", None, f"model.init_from={copy}", "train.steps=1")
    log = out.stdout + out.stderr
    assert out.codes == [3, 3], log[-3000:]
    assert log.count(f"{weights} does not hold the bytes that were saved") == 2, log[-3000:]
    assert export_main([str(copy), str(tmp_path / "hf")]) == 2
    assert f"{weights} does not hold the bytes that were saved" in capsys.readouterr().err
