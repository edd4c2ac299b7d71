"""The multi-node launch path. On one machine: `accelerate launch` as two machines of 2 processes each on
127.0.0.1 (PP2 x DP2, one pipeline per machine, data parallelism across them) trains to the same losses as
one machine of 4 processes (forked as one launcher would start them, tests/helpers/launch.py). For the 2-node x 8-GPU cluster: the accelerate config names a recipe that
exists, `train --check --world-size 16` accepts its layout (pp 8 inside a node x dp 2 across nodes) and
refuses a wrong one, and the SLURM script starts one launcher per node with that node's machine rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
import yaml

from helpers.launch import ACCELERATE, run_env, train_ranks
from vp_accelerate.train.cli import preflight
from vp_accelerate.train.cli.preflight import check_plan
from vp_accelerate.train.recipe import load_recipe
from vp_accelerate.train.recipe.convert import RecipeError

ROOT = Path(__file__).resolve().parents[1]


def _recipe(tmp_path, *overrides):
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"a document {i}"}) + "\n" for i in range(20)))
    return load_recipe(
        str(ROOT / "recipes" / "gpu_llama3_8b_vocab2_1f1b.yaml"),
        [f"data.files=[{corpus}]", f"data.eval_files=[{corpus}]", *overrides],
    )


def test_multinode_config_names_an_existing_recipe_and_16_processes():
    text = (ROOT / "configs" / "accelerate_multinode.yaml").read_text()
    config = yaml.safe_load(text)
    assert (config["num_machines"], config["num_processes"]) == (2, 16)
    named = set(re.findall(r"recipes/[\w.-]+\.yaml", text))
    assert named and all((ROOT / r).is_file() for r in named), named


def test_check_world_size_16_accepts_pp8_x_dp2_and_names_the_problem_otherwise(tmp_path, monkeypatch):
    notes = check_plan(_recipe(tmp_path, "pipeline.dp_size=2"), 16)
    assert any("on 8 ranks" in n for n in notes), notes

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the layout was checked")

    monkeypatch.setattr(preflight, "vocab_decision", no_tokenizer)  # a wrong layout fails before it loads
    with pytest.raises(RecipeError, match="pp_size=8 x dp_size=4 = 32, but 16 processes"):
        check_plan(_recipe(tmp_path), 16)  # the recipe's own dp_size 4 is a 32-GPU layout


# ---- two machines on one box --------------------------------------------------------------------------
LAUNCH_TIMEOUT_S = 540  # one launch takes ~35 s on an idle 2-core box; this leaves room for a loaded one
PORT_TAKEN = re.compile(r"utilizing it|already in use|EADDRINUSE", re.I)


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
    """A 4-layer h32 Llama with a 300-token BPE, PP2 x DP2, 4 steps with a checkpoint and an eval."""
    from helpers.tiny import tiny_run

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa мир 世界 λόγος".split()
    return tiny_run(
        tmp_path_factory.mktemp("multinode"),
        words,
        lines=400,
        data={"seq_len": 16},
        pipeline={"schedule": "1f1b", "method": "vocab-2", "microbatches": 2, "dp_size": 2},
        optimizer={"lr": 3e-3},
        train={"steps": 4, "global_batch": 8, "seed": 0},
        eval={"every": 0, "batches": 2},
        checkpoint={"every": 2, "keep": 1},
        logging={"log_every": 1},
    )


def _launch_all(d: Path, name: str, launchers: list[list[str]]) -> tuple[Path, list[str]]:
    """Start every launcher at once (a machine's launcher waits for the others at the rendezvous) and wait
    for all; returns the run's output_dir and each launcher's log. A port another process took between
    choosing it and binding it is retried on a fresh port (the only retry); a launch that runs past
    LAUNCH_TIMEOUT_S is killed and fails."""
    from vp_accelerate.distributed import free_port

    env = {**os.environ, **run_env(d / "ds_cache", WANDB_MODE="disabled")}
    for attempt in range(3):
        port, out_dir = str(free_port()), d / f"{name}_{attempt}"
        logs = [d / f"{name}_{attempt}_machine{m}.log" for m in range(len(launchers))]
        procs = []
        for args, log in zip(launchers, logs):
            cmd = [
                ACCELERATE,
                "launch",
                *(a.replace("{port}", port) for a in args),
                "-m",
                "vp_accelerate",
                "train",
                str(d / "recipe.yaml"),
                "--set",
                f"logging.output_dir={out_dir}",
            ]
            with open(log, "w") as f:  # a file, not a pipe: a chatty launcher never blocks on a full pipe
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(d), start_new_session=True
                    )
                )
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:  # whatever is still running (a hung launch, or the peer of a failed one)
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        texts = [log.read_text() for log in logs]
        if codes is not None and any(codes) and any(PORT_TAKEN.search(t) for t in texts):
            continue
        report = "\n".join(f"--- machine {m} ---\n{t[-4000:]}" for m, t in enumerate(texts))
        assert codes is not None, f"{name}: not finished after {LAUNCH_TIMEOUT_S} s\n{report}"
        assert codes == [0] * len(procs), f"{name}: exit codes {codes}\n{report}"
        return out_dir, texts
    raise AssertionError(f"{name}: three free ports were taken before the launcher bound them")


def _losses(out_dir: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    train = [r["train/loss"] for r in sorted((r for r in rows if "train/loss" in r), key=lambda r: r["step"])]
    return train, next(r["eval/loss"] for r in rows if "eval/loss" in r)


def _ranks_in(log: str) -> set[int]:
    return {int(r) for r in re.findall(r"^\[[\d:]+ rank (\d+)\]", log, re.M)}


@pytest.mark.slow  # ~35 s: two real launchers; the rank layout and SLURM script checks stay in the suite
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 120)
def test_two_machines_on_loopback_train_like_one_machine(tiny_recipe):
    """`--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1`, 2 processes each: machine 0 runs
    ranks 0-1 (pipeline replica 0), machine 1 ranks 2-3 (replica 1), so the data-parallel all-reduce is the
    traffic between machines; the train and eval losses are those of 4 processes on one machine."""
    d = tiny_recipe
    two_cfg = str(ROOT / "configs" / "accelerate_cpu_2machines.yaml")
    # the one-machine reference: 4 ranks forked as one launcher would start them (the launcher under test
    # is the two-machine one below)
    single_dir = d / "single"
    single = train_ranks(
        [str(d / "recipe.yaml"), "--set", f"logging.output_dir={single_dir}"],
        d,
        run_env(d / "ds_cache", WANDB_MODE="disabled"),
        nprocs=4,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    multi_dir, logs = _launch_all(
        d,
        "multi",
        [
            [
                "--config_file",
                two_cfg,
                "--machine_rank",
                str(m),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                "{port}",
            ]
            for m in (0, 1)
        ],
    )
    assert _ranks_in(logs[0]) == {0, 1} and _ranks_in(logs[1]) == {2, 3}, logs
    assert "MULTI_CPU, world size 4 (pp 2 x dp 2)" in logs[0]
    assert "rank 2 (pp 0/2, dp 1/2)" in logs[0] and "rank 3 (pp 1/2, dp 1/2)" in logs[0]
    single, multi = _losses(single_dir), _losses(multi_dir)
    assert len(single[0]) == len(multi[0]) == 4
    assert multi[0] == pytest.approx(single[0], rel=1e-6, abs=0) and multi[1] == pytest.approx(single[1], rel=1e-6)
    assert (multi_dir / "hf" / "config.json").is_file()  # the final export, written once across machines


# ---- SLURM ----------------------------------------------------------------------------------------------
FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: runs the command once per node at once, as srun does, with that node's SLURM_NODEID
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do PATH="$FAKE_BIN:$PATH" SLURM_NODEID=$i "$@" & done
wait
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "gpu-[07-08]" ] && printf 'gpu-07\\ngpu-08\\n'
"""
FAKE_ACCELERATE = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD/machine$SLURM_NODEID"
printf '%s\\n' "$PET_SIGNALS_TO_HANDLE" "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > "$RECORD/signals$SLURM_NODEID"
printf '%s %s\\n' "$NCCL_SOCKET_IFNAME" "$GLOO_SOCKET_IFNAME" > "$RECORD/ifname$SLURM_NODEID"
"""


def fake_slurm(tmp_path) -> dict[str, str]:
    """The environment of a 2-node job of 8 GPUs a node (nodelist gpu-[07-08]) under stand-ins for srun, scontrol
    and accelerate (which records its arguments, signals and socket interfaces in `tmp_path`); no *_SOCKET_IFNAME
    of this machine's."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("accelerate", FAKE_ACCELERATE)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    return {
        **{k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")},
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
        "FAKE_BIN": str(fake_bin),
        "RECORD": str(tmp_path),
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-[07-08]",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(ROOT),
    }


def test_slurm_script_starts_one_launcher_per_node_with_its_machine_rank(tmp_path):
    """scripts/slurm_train.sbatch under stand-ins for srun and scontrol (and an accelerate that records its
    arguments): node i launches with --machine_rank i, 16 processes in all, the first node of the nodelist
    as the main process, the multi-node config, and the recipe with the arguments given after it."""
    env = fake_slurm(tmp_path)
    recipe = "recipes/gpu_llama3_8b_vocab2_1f1b.yaml"
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm_train.sbatch"), recipe, "--set", "pipeline.dp_size=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 nodes x 8 processes, main process on gpu-07:24242" in run.stdout
    for m in (0, 1):
        launch, *args = (tmp_path / f"machine{m}").read_text().split("\n")[:-1]
        assert launch == "launch"
        opts = dict(zip(args[:-6:2], args[1:-6:2]))
        assert opts == {
            "--config_file": "configs/accelerate_multinode.yaml",
            "--num_machines": "2",
            "--num_processes": "16",
            "--machine_rank": str(m),
            "--main_process_ip": "gpu-07",
            "--main_process_port": "24242",
            "--rdzv_backend": "static",
        }, args
        assert args[-6:] == ["-m", "vp_accelerate", "train", recipe, "--set", "pipeline.dp_size=2"]
        assert (ROOT / opts["--config_file"]).is_file() and (ROOT / recipe).is_file()
        # what torch elastic's agent handles (and passes on to the ranks) as accelerate builds torchrun's parser
        # from this environment: SIGUSR1 of --signal=USR1@180 too, and time to save. Before: torch's default list
        # (the script set TORCHELASTIC_SIGNALS_TO_HANDLE, which torch overwrites), so SIGUSR1 killed the launcher
        signals, timeout = (tmp_path / f"signals{m}").read_text().split("\n")[:2]
        with mock.patch.dict(os.environ, {"PET_SIGNALS_TO_HANDLE": signals}):
            from torch.distributed.run import get_args_parser

            handled = get_args_parser().parse_args(["train.py"]).signals_to_handle.split(",")
        assert {"SIGTERM", "SIGUSR1"} <= set(handled) and int(timeout) >= 600, (handled, timeout)


def test_slurm_script_sets_the_socket_interfaces_and_names_a_missing_one(tmp_path):
    """Each node exports NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (SOCKET_IFNAME, here the loopback every
    machine has); an interface a node lacks stops that node before its launcher, naming it."""
    env = fake_slurm(tmp_path)
    cmd = ["bash", str(ROOT / "scripts" / "slurm_train.sbatch"), "recipes/gpu_llama3_8b_vocab2_1f1b.yaml"]
    run = subprocess.run(cmd, env={**env, "SOCKET_IFNAME": "lo"}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    for m in (0, 1):
        assert (tmp_path / f"ifname{m}").read_text().split() == ["lo", "lo"]
    assert "node 0: NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo" in run.stdout
    record = tmp_path / "bad"
    record.mkdir()
    bad = {**env, "SOCKET_IFNAME": "nosuch0", "RECORD": str(record)}
    run = subprocess.run(cmd, env=bad, capture_output=True, text=True, timeout=60)
    # each node's task exits 2 (the stand-in srun does not pass exit codes on; the real one fails the job)
    assert "node 0 (" in run.stderr and "has no network interface nosuch0 (SOCKET_IFNAME)" in run.stderr
    assert not list(record.iterdir())  # no launcher started
