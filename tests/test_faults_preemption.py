"""Stop signals under a real launcher, one writer per checkpoint folder, and the end of a run a signal reaches
(2-process training on gloo, CPU; tests/test_faults_training.py has the trainer's own signal handling).

- SIGUSR1 (what `sbatch --signal=USR1@180` sends ahead of the time limit) to every process of a real
  `vp-accelerate launch` job, and to its launcher alone: the launcher passes it to its ranks, they save the
  step, the job exits 75 with a complete checkpoint, and `--resume` gives the losses of an uninterrupted run;
- a second run whose checkpoint.dir is the first run's checkpoints folder (by its path or through a symlink)
  is refused with one line while the first runs;
- a signal in the last step still exports the model, `--resume` of a finished run whose export is missing (or
  was cut short) writes it, and a run without evaluation says so instead of "final eval loss nan".
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from helpers.launch import BIN, CPU_2PROC, FAULT_WORKER, ROOT, losses, run_env, train_ranks
from helpers.tiny import fault_run

RNG = random.Random()  # fresh each run: the seed and the step the signal lands in vary
FAULT_SITE = os.path.join(os.path.dirname(__file__), "helpers", "fault_site")
STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("preempt")
    seed, train_seed = RNG.random(), RNG.randrange(1000)
    return fault_run(d, lines=400, seed=seed, steps=STEPS, train_seed=train_seed, checkpoint={"every": 100, "keep": 10})


def _args(d, name, *sets, extra=()) -> list[str]:
    sets = (f"logging.output_dir={d / name}", *sets)
    return [str(d / "recipe.yaml"), *[a for s in sets for a in ("--set", s)], *extra]


def train_forked(d, name, *sets, fault=None, extra=()):
    return train_ranks(_args(d, name, *sets, extra=extra), d, run_env(d / "ds_cache"), fault=fault)


@pytest.fixture(scope="module")
def uninterrupted(finished):
    """The losses of an uninterrupted run: `finished`'s (evaluation off changes no training step: the recipe
    evaluates only after the last step, eval.every 0), so the suite trains the same 4 steps once, not twice."""
    return finished[2]


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return out
    for child in children:
        out += [int(child), *_descendants(int(child))]
    return out


def _wait_for(path, proc, timeout_s=240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.1)


# a real launcher each (~40 s on the loaded 2-core box): the whole-job case is marked slow
@pytest.mark.parametrize("to", [pytest.param("job", marks=pytest.mark.slow), "launcher"])
def test_sigusr1_under_vp_accelerate_launch_saves_exits_75_and_resumes_exactly(setup, uninterrupted, to):
    """A real `vp-accelerate launch` job whose ranks wait inside step 2 until a SIGUSR1 reaches them; SIGUSR1 to
    every process of the job (SLURM's `--signal=USR1@180`) or to the launcher alone: the job exits 75, the
    checkpoint of the step is complete (no `.tmp` left), and --resume logs the uninterrupted run's losses
    exactly. Before: the launcher (torch elastic takes its signals from --signals-to-handle, not the
    TORCHELASTIC_SIGNALS_TO_HANDLE it set) died of the signal at once: exit -10, ranks orphaned or killed."""
    from vp_accelerate.train.persist import store as ckpt

    name, step = f"usr1_{to}", RNG.randrange(2, STEPS)
    mark = setup / f"{name}.held"
    fault = {"hold": {"step": step, "until": "SIGUSR1", "mark": str(mark)}}
    env = {
        **os.environ,
        **run_env(setup / "ds_cache"),
        "VP_FAULT": json.dumps(fault),
        "PYTHONPATH": os.pathsep.join([FAULT_SITE, str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [os.path.join(BIN, "vp-accelerate"), "launch", "--config_file", CPU_2PROC, "train", *_args(setup, name)]
    proc = subprocess.Popen(cmd, cwd=setup, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = []
    try:
        _wait_for(mark, proc)  # rank 0 is inside the step (rank 1 waits on it), every rank's handlers set
        ranks = _descendants(proc.pid)
        for pid in [proc.pid, *(ranks if to == "job" else [])]:
            os.kill(pid, signal.SIGUSR1)
        log = proc.communicate(timeout=180)[0]
    finally:
        for pid in ranks if proc.poll() is not None else []:  # the old launcher's orphans
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, log[-3000:]
    assert log.count(f"stopped by SIGUSR1 at step {step}; resume with --resume") == 2, log[-3000:]
    cdir = setup / name / "checkpoints"
    assert sorted(n for n in os.listdir(cdir) if n.startswith("step_")) == [f"step_{step:08d}"], os.listdir(cdir)
    latest = ckpt.read_latest(str(cdir))
    for rank in (0, 1):
        ckpt.load_rank(latest, rank)  # every file's size and hash as saved
    again = train_forked(setup, name, extra=["--resume"])
    assert again.codes == [0, 0], (again.stdout + again.stderr)[-3000:]
    assert losses(setup / name) == uninterrupted  # each step once, bit for bit


@pytest.mark.slow
def test_plain_accelerate_launch_forwards_sigusr1_only_when_asked(setup):
    """What docs/reliability.md says of plain `accelerate launch`: with PET_SIGNALS_TO_HANDLE naming SIGUSR1
    its launcher passes SIGUSR1 on, the ranks save and exit 75, the launcher exits 128 + 10 = 138."""
    from vp_accelerate.train.persist import store as ckpt

    name = "usr1_accelerate"
    mark = setup / f"{name}.held"
    fault = {"hold": {"step": 2, "until": "SIGUSR1", "mark": str(mark)}}
    env = {
        **os.environ,
        **run_env(setup / "ds_cache"),
        "VP_FAULT": json.dumps(fault),
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    }
    cmd = [os.path.join(BIN, "accelerate"), "launch", "--config_file", CPU_2PROC, FAULT_WORKER, *_args(setup, name)]
    proc = subprocess.Popen(cmd, cwd=setup, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(mark, proc)
        os.kill(proc.pid, signal.SIGUSR1)
        log = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGUSR1, log[-3000:]
    assert log.count("stopped by SIGUSR1 at step 2; resume with --resume") == 2, log[-3000:]
    assert ckpt.read_latest(str(setup / name / "checkpoints")).endswith("step_00000002")


def test_a_second_run_into_the_first_runs_checkpoint_folder_is_refused(setup, tmp_path):
    """While a run trains (held inside step 2, step 1 saved), a second run with checkpoint.dir = that run's
    checkpoints folder and --resume, by its path or through a symlink, stops with exit 2 and one line naming
    the first run's pid. Before: only an output dir, or a checkpoint.dir outside it, was locked; the second run
    resumed and both wrote into one folder, `latest` flipping between their steps."""
    name = "lock_first"
    mark = setup / f"{name}.held"
    cmd = [sys.executable, FAULT_WORKER, *_args(setup, name, "checkpoint.every=1", "checkpoint.background=false")]
    env = {
        **os.environ,
        **run_env(setup / "ds_cache"),
        "VP_FAULT": json.dumps({"hold": {"step": 2, "mark": str(mark)}}),
    }
    first = subprocess.Popen(cmd, cwd=setup, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cdir = setup / name / "checkpoints"
    os.symlink(cdir, tmp_path / "link")
    try:
        _wait_for(mark, first)
        for given in (cdir, tmp_path / "link"):
            sets = (f"logging.output_dir={tmp_path / 'second'}", f"checkpoint.dir={given}")
            second = train_ranks([*_args(setup, name, *sets), "--resume"], setup, run_env(setup / "ds_cache"), 1, None)
            lines = second.stderr.strip().splitlines()
            assert second.codes == [2] and len(lines) == 1, second.stdout + second.stderr
            assert f"checkpoint.dir: another run is writing into {cdir} (host " in lines[0], lines
            assert f"pid {first.pid}," in lines[0], lines
        first.send_signal(signal.SIGTERM)
        log = first.communicate(timeout=120)[0]
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 75, log[-3000:]
    assert sorted(n for n in os.listdir(cdir) if n.startswith("step_")) == ["step_00000001", "step_00000002"]


def _files(folder) -> dict[str, bytes]:
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder))}


@pytest.mark.parametrize("during", ["step", "save"])
def test_a_signal_in_the_last_step_still_exports(setup, during):
    """SIGTERM to one rank inside the last step, or inside its checkpoint write: there is nothing left to
    resume, so the run ends as usual: its checkpoint, the export in hf/, exit 0 on every rank, and a line
    saying the signal came. Before: exit 75 and no export, which --resume then did not write either."""
    name = f"last_{during}"
    fault = {"signal": {"step": STEPS, "during": during, **({"rank": 1} if during == "step" else {})}}
    out = train_forked(setup, name, fault=fault)
    log = out.stdout + out.stderr
    assert out.codes == [0, 0], log[-3000:]
    assert "SIGTERM arrived in this run's last step or after it: the run ended as usual (its checkpoint and the "
    "final export written)" in log, log[-3000:]
    assert "done: final eval loss" in log and "stopped by SIGTERM" not in log, log[-3000:]
    assert (setup / name / "hf" / "config.json").is_file()
    assert (setup / name / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"


@pytest.fixture(scope="module")
def finished(setup):
    """A finished run without evaluation: its name, its output and its losses (read before any test resumes it)."""
    out = train_forked(setup, "finished", "eval.batches=0")
    assert out.codes == [0, 0], (out.stdout + out.stderr)[-3000:]
    return "finished", out.stdout + out.stderr, losses(setup / "finished")


def test_a_run_without_evaluation_says_so(finished):
    """Not "final eval loss nan", a value no evaluation made: that evaluation was off. Before: the nan."""
    log = finished[1]
    assert f"done: evaluation was off (eval.batches: 0) after step {STEPS}; the model is in" in log, log[-3000:]
    assert "loss nan" not in log, log[-3000:]


def test_resume_of_a_finished_run_writes_its_missing_export(setup, finished):
    """A finished run's export cut short (hf/ renamed to hf.tmp, a file gone, as a kill inside the export
    leaves it): --resume trains nothing and writes the export again, the same bytes; a second --resume leaves
    it. Before: "done: final eval loss nan after step 4" and no hf/."""
    name = finished[0]
    hf = setup / name / "hf"
    whole = _files(hf)
    os.rename(hf, f"{hf}.tmp")
    os.remove(f"{hf}.tmp/config.json")
    again = train_forked(setup, name, "eval.batches=0", extra=["--resume"])
    log = again.stdout + again.stderr
    assert again.codes == [0, 0], log[-3000:]
    assert f"the run had finished at step {STEPS} but its export is missing: writing it" in log, log[-3000:]
    assert f"done: the run had already finished at step {STEPS}, nothing left to train; the model is in {hf}" in log
    assert "loss nan" not in log, log[-3000:]
    assert _files(hf) == whole and not os.path.exists(f"{hf}.tmp")
    third = train_forked(setup, name, "eval.batches=0", extra=["--resume"])
    assert third.codes == [0, 0] and "export is missing" not in third.stdout + third.stderr
    assert _files(hf) == whole
    steps = sorted(losses(setup / name))
    assert steps == list(range(1, STEPS + 1)), steps  # nothing trained twice
