"""One metrics.jsonl per run, and which checkpoint `--resume latest|STEP|PATH` names."""

import json

import pytest

from vp_accelerate.train.persist import store as ckpt
from vp_accelerate.train.run.tracking import start_metrics


def rows(path):
    return [json.loads(line)["step"] for line in open(path)]


def test_a_new_run_moves_the_old_metrics_aside_and_a_resumed_one_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert start_metrics(str(path), None) is None  # nothing there yet
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(1, 8)))
    assert start_metrics(str(path), 5) is None  # resumed after step 5: the interrupted run's 6 and 7 go
    assert rows(path) == [1, 2, 3, 4, 5]
    assert start_metrics(str(path), None) == str(tmp_path / "metrics.1.jsonl")
    assert not path.exists() and rows(tmp_path / "metrics.1.jsonl") == [1, 2, 3, 4, 5]
    path.write_text(json.dumps({"step": 1}) + "\n")
    assert start_metrics(str(path), None) == str(tmp_path / "metrics.2.jsonl")


def test_resume_names_latest_a_step_or_a_path(tmp_path):
    root = tmp_path / "checkpoints"
    assert ckpt.resume_path(str(root), "latest") is None
    for step in (2, 4):
        (root / ckpt.step_dir_name(step)).mkdir(parents=True)
        (root / ckpt.step_dir_name(step) / ckpt.META).write_text("{}")
    (root / "latest").write_text(ckpt.step_dir_name(4) + "\n")
    assert ckpt.resume_path(str(root), "latest") == str(root / "step_00000004")
    assert ckpt.resume_path(str(root), "2") == str(root / "step_00000002")
    assert ckpt.resume_path(str(tmp_path / "elsewhere"), str(root / "step_00000002")) == str(root / "step_00000002")
    assert ckpt.resume_path(None, str(root)) == str(root / "step_00000004")
    with pytest.raises(
        ckpt.CheckpointError,
        match="--resume 3: no complete checkpoint .*checkpoints there: step_00000002, step_00000004",
    ):
        ckpt.resume_path(str(root), "3")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint at"):
        ckpt.resume_path(str(root), str(tmp_path / "nope"))
