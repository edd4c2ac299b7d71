"""Checkpoints: atomic writes (a crash mid-write leaves the previous one loadable), round trips, checks."""

import os
import random

import numpy as np
import pytest
import torch

from helpers.checkpoints import save_one_rank, state
from vp_accelerate.distributed import spawn
from vp_accelerate.train.persist import store as ckpt


def save(root, step, crash=None, keep=2):
    return save_one_rank(root, step, state(step), crash, keep)


def test_round_trip_and_latest(tmp_path):
    save(tmp_path, 10)
    path = ckpt.read_latest(str(tmp_path))
    assert path.endswith("step_00000010") and ckpt.resolve(str(tmp_path)) == path
    model, opt, trainer = ckpt.load_rank(path, 0)
    ref_model, ref_opt, ref_trainer = state(10)
    assert all(torch.equal(model[k], ref_model[k]) for k in ref_model)
    assert torch.equal(opt["state"][0]["exp_avg"], ref_opt["state"][0]["exp_avg"])
    assert trainer["data"] == {"epoch": 0, "step": 10} and trainer["scheduler"]["last_epoch"] == 1
    assert ckpt.read_meta(path)["step"] == 10
    assert os.path.isfile(os.path.join(path, "model", "config.json"))


@pytest.mark.parametrize("stage", ["weights", "rank0_files", "rename"])
def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, stage):
    save(tmp_path, 10)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save(tmp_path, 20, crash=stage)
    path = ckpt.read_latest(str(tmp_path))
    assert path.endswith("step_00000010")  # `latest` is updated last
    model, _, trainer = ckpt.load_rank(path, 0)
    assert trainer["step"] == 10 and torch.equal(
        model["model.embed_tokens.weight"], state(10)[0]["model.embed_tokens.weight"]
    )
    save(tmp_path, 20)  # the next save cleans up and succeeds
    assert ckpt.read_latest(str(tmp_path)).endswith("step_00000020")
    assert not os.path.exists(tmp_path / "step_00000020.tmp")


def test_keep_prunes_old_checkpoints(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000003"]


def test_rng_state_round_trip():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    s = ckpt.rng_state()
    a = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    ckpt.set_rng_state(s)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]


def test_mismatches_are_clear_errors(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="world_size: checkpoint has 2, this run has 4"):
        ckpt.check_fingerprint({"world_size": 2, "model": "a"}, {"world_size": 4, "model": "a"}, "ck")
    with pytest.raises(ckpt.CheckpointError, match=r"shapes \['w: saved \(2,\), expected \(3,\)'\]"):
        ckpt.check_shapes({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, "ck", 0)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint at"):
        ckpt.resolve(str(tmp_path))
    save(tmp_path, 1)
    with pytest.raises(ckpt.CheckpointError, match="no shards for rank 3"):
        ckpt.load_rank(ckpt.read_latest(str(tmp_path)), 3)


def _two_rank_save(root):
    import torch.distributed as dist

    r = dist.get_rank()
    w = {"w": torch.full((2,), float(r))}
    ckpt.save_checkpoint(
        ckpt.SaveSpec(root, 5, r), ckpt.RankState(w, {}, {"step": 5}, {"fingerprint": {}}), dist.barrier
    )
    return ckpt.load_rank(ckpt.read_latest(root), r)[0]["w"].tolist()


def test_collective_save_two_ranks(tmp_path):
    assert spawn(_two_rank_save, 2, str(tmp_path), timeout_s=60) == [[0.0, 0.0], [1.0, 1.0]]


def test_checkpoint_package_sits_below_the_run():
    """train/persist/ imports nothing of train/run/ (ARCHITECTURE.md: cli -> run -> persist -> tokens)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "vp_accelerate" / "train" / "persist"
    up = re.compile(
        r"^\s*from\s+(\.\.run\b|vp_accelerate\.train\.run\b)|^\s*import\s+vp_accelerate\.train\.run\b", re.M
    )
    offenders = [p.name for p in sorted(root.glob("*.py")) if up.search(p.read_text())]
    assert not offenders, f"train/persist/ modules importing train/run/: {offenders}"
