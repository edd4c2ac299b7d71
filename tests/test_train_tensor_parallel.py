"""A training run with tensor parallelism end to end (`pipeline.tp_size: 2`, pp 2 x tp 2 on 4 launched ranks): it
trains, saves checkpoints, exports its final HF model with the TP slices joined, `vp-accelerate export` of its last
checkpoint writes the same tensors, and `--resume` into pp 2 without TP (2 ranks) goes on from the checkpoint with
the losses of the uninterrupted run (float32: the layouts sum in another order, 1e-4 relative); with method vocab-2
(the vocabulary over pp x tp) and baseline (the end stages' vocabulary layers split over TP).
Slow (~2 min a method on 2 idle cores: three launches)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers.launch import losses, run_env, train_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["vocab-2", "baseline"])
def tp_recipe(tmp_path_factory, request):
    from helpers.tiny import tiny_run

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return tiny_run(
        tmp_path_factory.mktemp("tp"),
        words,
        lines=300,
        data={"seq_len": 16},
        # baseline: the end stages' embedding and output layer split over TP (rows, a padding row at the end)
        pipeline={"schedule": "1f1b", "method": request.param, "microbatches": 2, "tp_size": 2},
        optimizer={"lr": 3e-3},
        train={"steps": 4, "global_batch": 4, "seed": 0},
        eval={"every": 0},
        checkpoint={"every": 2, "keep": 2},
        logging={"log_every": 1},
    )


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_a_tp_run_trains_exports_and_resumes_without_tp(tp_recipe):
    d = tp_recipe
    env = run_env(d / "ds_cache", WANDB_MODE="disabled")
    run = d / "tp_run"
    out = train_ranks([str(d / "recipe.yaml"), "--set", f"logging.output_dir={run}"], d, env, nprocs=4)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "(pp 2 x tp 2 x dp 1)" in out.stderr + out.stdout
    full = losses(run)
    assert sorted(full) == [1, 2, 3, 4]
    exported = _weights(run / "hf")
    vocab = json.loads((run / "hf" / "config.json").read_text())["vocab_size"]
    assert exported["model.embed_tokens.weight"].shape[0] == vocab  # the padding rows dropped
    # the last checkpoint exported offline: the same tensors (TP slices joined from the rank files)
    from vp_accelerate.cli import main

    assert main(["export", str(run / "checkpoints"), str(d / "offline")]) in (0, None)
    offline = _weights(d / "offline")
    assert set(offline) == set(exported)
    for name, t in exported.items():
        assert torch.equal(offline[name], t), name
    # the step-2 checkpoint resumed by pp 2 without tensor parallelism (a copy: the resumed run saves step 4 too)
    from vp_accelerate.train.persist.store import step_dir_name

    resumed_dir = d / "resumed"
    shutil.copytree(run / "checkpoints" / step_dir_name(2), resumed_dir / "checkpoints" / step_dir_name(2))
    args = [
        str(d / "recipe.yaml"),
        "--set",
        f"logging.output_dir={resumed_dir}",
        "--set",
        "pipeline.tp_size=1",
        "--resume",
        "2",
    ]
    again = train_ranks(args, d, env, nprocs=2)
    assert again.returncode == 0, again.stderr[-4000:]
    resumed = losses(resumed_dir)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-4), (step, resumed, full)
