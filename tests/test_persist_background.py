"""Checkpoints written in the background (train/persist/writer.py, `store.begin_save` / `complete_save`): the
save returns while its files are written, holds the state of its step whatever training changes meanwhile,
`latest` moves only once every rank's write is verified, and a kill at any point leaves `latest` loadable.

Each test fails on the code before the background writer (no `begin_save`; a write not read back)."""

import os
import threading

import pytest
import torch

from helpers.checkpoints import META, killed, spec, state
from vp_accelerate.train.persist import files, writer
from vp_accelerate.train.persist import store as ckpt


def begin(root, step, st, crash=None, background=True):
    return ckpt.begin_save(spec(root, step, crash), ckpt.RankState(*st, META), lambda: None, background)


def save(root, step, crash=None, background=True):
    return ckpt.complete_save(begin(root, step, state(step), crash, background), barrier=lambda: None)


def test_the_save_returns_while_writing_and_keeps_its_steps_values(tmp_path, monkeypatch):
    save(tmp_path, 1)
    release, real = threading.Event(), writer.fsync_file

    def slow_fsync(path):  # the writer thread's fsyncs wait until the "training step" below is done
        if threading.current_thread() is not threading.main_thread():
            release.wait(30)
        real(path)

    monkeypatch.setattr(writer, "fsync_file", slow_fsync)
    live = state(2)
    want = {n: t.clone() for n, t in live[0].items()}, live[1]["state"][0]["exp_avg"].clone()
    pending = begin(tmp_path, 2, live)
    assert not pending.write.done()  # the write waits on its fsync: the caller trains on meanwhile
    for t in live[0].values():  # a training step changes the live tensors in place
        t.add_(1.0)
    live[1]["state"][0]["exp_avg"].mul_(3.0)
    assert ckpt.read_latest(str(tmp_path)).endswith("step_00000001")  # not complete: `latest` stays
    release.set()
    path = ckpt.complete_save(pending, barrier=lambda: None)
    assert ckpt.read_latest(str(tmp_path)) == path and path.endswith("step_00000002")
    model, opt, trainer = ckpt.load_rank(path, 0)
    assert all(torch.equal(model[n], want[0][n]) for n in want[0]) and trainer["step"] == 2
    assert torch.equal(opt["state"][0]["exp_avg"], want[1])


def test_a_write_that_does_not_read_back_as_written_never_becomes_latest(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real = files.digest
    monkeypatch.setattr(files, "digest", lambda p: "0" * 32 if p.endswith("optimizer.pt") else real(p))
    with pytest.raises(ckpt.CheckpointError, match="read back differ"):
        save(tmp_path, 2)
    assert ckpt.read_latest(str(tmp_path)).endswith("step_00000001")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001"]  # the partial folder is removed


def test_latest_waits_for_every_rank(tmp_path):
    """A peer's failed write (an all-gather's answer) stops this rank too, and `latest` does not move."""
    save(tmp_path, 1)
    pending = begin(tmp_path, 2, state(2))
    peer = "rank 1 cannot write its checkpoint files in x: OSError: boom"
    with pytest.raises(ckpt.CheckpointError, match="rank 1 cannot write"):
        ckpt.complete_save(pending, barrier=lambda: None, agree=lambda mine: [mine, peer])
    assert ckpt.read_latest(str(tmp_path)).endswith("step_00000001")


def _resave_killed_at(root, stage):
    save(root, 5, crash=f"kill:{stage}")


@pytest.mark.parametrize("stage", ["weights", "rank0_files", "aside", "rename", "latest"])
def test_a_background_resave_killed_at_any_point_leaves_latest_loadable(tmp_path, stage):
    save(tmp_path, 4, background=False)
    save(tmp_path, 5)
    killed(_resave_killed_at, str(tmp_path), stage)
    path = ckpt.read_latest(str(tmp_path))
    assert os.path.basename(path).startswith("step_00000005")
    assert ckpt.load_rank(path, 0)[2]["step"] == 5  # every file whole: sizes and hashes as saved
    save(tmp_path, 5)  # the next save cleans up
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000004", "step_00000005"]


def test_a_snapshot_copies_every_tensor_and_keeps_the_rest():
    st = state(3)
    snap = writer.Snapshot()
    model, opt, trainer = snap.copy(st)
    snap.ready()
    for name, t in st[0].items():
        assert torch.equal(model[name], t) and model[name].data_ptr() != t.data_ptr()
    assert opt["param_groups"] == st[1]["param_groups"] and trainer == st[2]


def test_snapshot_buckets_are_aligned_and_reused():
    """The bucketed copy a GPU snapshot makes (here from CPU tensors): every tensor's values, at aligned offsets,
    a tensor larger than a bucket in its own; the next snapshot reuses the same buckets."""
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2).to(torch.bfloat16),
        "big": torch.randn(writer.BUCKET_BYTES // 4 + 1),
    }
    first = writer.Snapshot(bucketed=("cpu",))
    out = first.copy(tensors)
    assert all(torch.equal(out[n], t) and out[n].dtype == t.dtype for n, t in tensors.items())
    assert all(out[n].data_ptr() % 64 == 0 for n in out) and len(first.pinned) == 2
    again = writer.Snapshot(first.pinned, bucketed=("cpu",)).copy(tensors)
    assert again["a"].data_ptr() == out["a"].data_ptr() and again["big"].data_ptr() == out["big"].data_ptr()


def test_the_run_moves_latest_at_the_first_step_after_the_write(tmp_path, monkeypatch):
    """`poll_pending_save` (once per step): nothing while the write goes on, `latest` as soon as it is done."""
    from types import SimpleNamespace

    from vp_accelerate.train.run.run_state import poll_pending_save

    save(tmp_path, 1)
    release, real = threading.Event(), writer.fsync_file

    def slow_fsync(path):
        if threading.current_thread() is not threading.main_thread():
            release.wait(30)
        real(path)

    monkeypatch.setattr(writer, "fsync_file", slow_fsync)
    run = SimpleNamespace(pending_save=begin(tmp_path, 2, state(2)), pipe=SimpleNamespace(rank=0))
    poll_pending_save(run)
    assert run.pending_save is not None and ckpt.read_latest(str(tmp_path)).endswith("step_00000001")
    release.set()
    run.pending_save.write._thread.join(30)
    poll_pending_save(run)
    assert run.pending_save is None and ckpt.read_latest(str(tmp_path)).endswith("step_00000002")
