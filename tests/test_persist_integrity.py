"""Checkpoint file integrity, in one process: every damaged file named with the fix, a re-save that a
kill at any point leaves loadable, pruning only of folders the code wrote, a full disk as one line, one writer
per output dir, and no code run from a checkpoint at export.

Cost of the per-file hash on a 1 GB shard (xxh3-128 through mmap, on this 2-core shared box, file in page cache):
0.30-0.65 s per GiB (busy box), once per file per load, against 0.3 s for safetensors to load it; the
size check before it costs a stat.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from helpers.checkpoints import killed, save_one_rank, state
from vp_accelerate.train.persist import files
from vp_accelerate.train.persist import space as ckpt_space
from vp_accelerate.train.persist import store as ckpt
from vp_accelerate.train.run import run_lock


def save(root, step, crash=None, keep=2):
    return save_one_rank(root, step, state(step), crash, keep)


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


DAMAGE = {
    "truncated weights": ("rank_00000/model.safetensors", _truncate, "bytes, .* were saved"),
    "flipped byte in the weights": ("rank_00000/model.safetensors", _flip_a_byte, "does not hold the bytes"),
    "truncated optimizer": ("rank_00000/optimizer.pt", _truncate, "bytes, .* were saved"),
    "empty trainer state": ("rank_00000/trainer_state.pt", lambda p: open(p, "w").close(), "is empty"),
    "missing optimizer": ("rank_00000/optimizer.pt", os.remove, "is missing"),
    "bad meta.json": ("meta.json", lambda p: open(p, "w").write("{not json"), "bytes, .* were saved"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_file_is_named_with_the_fix(tmp_path, case):
    rel, damage, what = DAMAGE[case]
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    damage(os.path.join(path, rel))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.read_meta(path)
        ckpt.load_rank(path, 0)
    message = str(e.value)
    assert os.path.join(path, rel) in message and re.search(what, message), message
    assert "--resume 1" in message and "step_00000001" in message  # the fix: the complete one beside it


def _rewrite_meta(path, change) -> None:
    """meta.json changed by `change(meta)`, its record rewritten as a save writes it (only the change differs)."""
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    change(meta)
    open(os.path.join(path, "meta.json"), "w").write(json.dumps(meta))
    open(os.path.join(path, ckpt.META_RECORD), "w").write(json.dumps(files.record(path, ["meta.json"])))


FORMATS = {
    "no version": (lambda meta: meta.pop("format"), "has no format version"),
    "a later version": (lambda meta: meta.update(format=2), "has format version '2'"),
    "not a number": (lambda meta: meta.update(format="1"), "has format version '1'"),
}


@pytest.mark.parametrize("case", sorted(FORMATS))
def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(tmp_path, case, capsys):
    """Every loader reads meta.json through `read_meta`: resume, init_from, export and resharding refuse it."""
    from vp_accelerate.train.cli.commands import export_main

    change, says = FORMATS[case]
    path = save(tmp_path, 3)
    assert json.loads(open(os.path.join(path, "meta.json")).read())["format"] == ckpt.FORMAT
    _rewrite_meta(path, change)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.read_meta(path)
    message = str(e.value)
    assert says in message and "reads checkpoint format 1 only" in message and "\n" not in message, message
    assert export_main([path, str(tmp_path / "hf")]) == 2
    assert says in capsys.readouterr().err


def test_a_pre_release_checkpoint_is_refused_by_its_version(tmp_path):
    """Saved before versions (and before its files were recorded): the version is what is said, not a missing
    record."""
    path = save(tmp_path, 3)
    os.remove(os.path.join(path, "rank_00000", "files.json"))
    os.remove(os.path.join(path, ckpt.META_RECORD))
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    del meta["files"], meta["format"]
    open(os.path.join(path, "meta.json"), "w").write(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="has no format version; this vp-accelerate reads"):
        ckpt.read_meta(path)


@pytest.mark.parametrize("gone", ["rank_00000/files.json", "meta.record.json"])
def test_a_missing_record_of_a_recording_checkpoint_is_damage(tmp_path, gone):
    """A missing record is damage."""
    path = save(tmp_path, 3)
    os.remove(os.path.join(path, gone))
    with pytest.raises(ckpt.CheckpointError, match=re.escape(os.path.join(path, gone)) + " is missing"):
        ckpt.read_meta(path), ckpt.load_rank(path, 0)


def _resave_killed_at(root, stage):
    save(root, 5, crash=f"kill:{stage}")


@pytest.mark.parametrize("stage", ["weights", "rank0_files", "aside", "rename", "latest"])
def test_a_resave_killed_at_any_point_leaves_latest_loadable(tmp_path, stage):
    save(tmp_path, 4)
    save(tmp_path, 5)  # `latest` names step 5; a resumed run saves step 5 again
    killed(_resave_killed_at, str(tmp_path), stage)
    path = ckpt.read_latest(str(tmp_path))
    assert os.path.basename(path).startswith("step_00000005")
    _, _, trainer = ckpt.load_rank(path, 0)  # every file whole: sizes and hashes as saved
    assert trainer["step"] == 5
    save(tmp_path, 5)  # the next save cleans up
    assert ckpt.read_latest(str(tmp_path)).endswith("step_00000005")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000004", "step_00000005"]


def test_pruning_touches_only_folders_it_wrote(tmp_path):
    mine = ["step_00000002", "step_12345678.bak", "step_final", "step_00000003"]
    for name in mine:
        os.makedirs(tmp_path / name)
        (tmp_path / name / "notes.txt").write_text("the user's")
    for step in (5, 6, 7):
        save(tmp_path, step, keep=2)
    assert sorted(os.listdir(tmp_path)) == sorted(["latest", "step_00000006", "step_00000007", *mine])


def test_a_full_disk_is_one_line_naming_the_path_and_bytes(tmp_path, monkeypatch):
    save(tmp_path, 1)
    monkeypatch.setattr(ckpt_space, "free_bytes", lambda path: 1000)
    with pytest.raises(ckpt.CheckpointError) as e:
        save(tmp_path, 2)
    message = str(e.value)
    assert "disk full" in message and str(tmp_path) in message and "1000 are free" in message, message
    assert "step_00000001 is untouched" in message and "\n" not in message
    assert ckpt.read_latest(str(tmp_path)).endswith("step_00000001") and not (tmp_path / "step_00000002.tmp").exists()


def test_a_write_failing_on_a_full_disk_is_the_same_line(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def full(*a, **k):  # what torch.save's C++ writer says when the disk fills under it
        monkeypatch.setattr(ckpt_space, "free_bytes", lambda path: 0)
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match=r"disk full: rank 0 needs about \d+ bytes"):
        save(tmp_path, 2)
    assert ckpt.read_latest(str(tmp_path)).endswith("step_00000001")


HOLD = "import sys, time; from vp_accelerate.train.run import run_lock; run_lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)"


def test_one_writer_per_output_dir_and_a_dead_holder_frees_it(tmp_path):
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RecipeError) as e:
            run_lock.acquire(str(tmp_path))
        assert f"pid {first.pid}" in str(e.value) and "another run is writing into" in str(e.value)
    finally:
        first.send_signal(signal.SIGKILL)  # kill -9: no clean-up; the kernel drops the lock
        first.wait()
    try:
        run_lock.acquire(str(tmp_path))
        held = json.loads((tmp_path / run_lock.LOCK_FILE).read_text())
        assert held["pid"] == os.getpid()
    finally:
        run_lock.release(str(tmp_path))


def test_the_train_command_refuses_a_second_run_with_exit_2(tmp_path, capsys):
    from vp_accelerate.train.cli.commands import _run

    first = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        from vp_accelerate.train.recipe import load_recipe

        recipe_file = tmp_path / "r.yaml"
        (tmp_path / "d.txt").write_text("some text\n")
        recipe_file.write_text(
            f"data:\n  files: [{tmp_path / 'd.txt'}]\nlogging:\n  output_dir: {tmp_path / 'out'}\n  wandb_mode: disabled\n"
        )
        recipe = load_recipe(str(recipe_file))

        class Args:
            resume = stop_at = None
            override = []
            recipe, overrides = str(tmp_path / "r.yaml"), []

        assert _run(recipe, Args()) == 2
        assert f"pid {first.pid}" in capsys.readouterr().err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


PAYLOAD = """
import os
open(os.environ["VP_PAYLOAD_MARK"], "w").write("ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


def test_export_never_takes_trust_remote_code_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    from vp_accelerate.train.cli.commands import export_main

    mark = tmp_path / "payload_ran"
    monkeypatch.setenv("VP_PAYLOAD_MARK", str(mark))

    def model_files(d):
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}, f)
        with open(os.path.join(d, "configuration_evil.py"), "w") as f:
            f.write(PAYLOAD)

    model, opt, trainer = state(1)
    ckpt.save_checkpoint(
        ckpt.SaveSpec(str(tmp_path / "shared"), 1, 0, write_model_files=model_files),
        ckpt.RankState(
            model,
            opt,
            trainer,
            {
                "fingerprint": {},
                "ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0}],
                "vocab_size": 16,
                "recipe": {"model": {"trust_remote_code": True}},  # the checkpoint asks; only the caller may
            },
        ),
        lambda: None,
    )
    assert export_main([str(tmp_path / "shared"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code" in err and "own Python code" in err
    assert not mark.exists(), "the checkpoint's code ran"


def _two_ranks_one_disk_full(root):
    import torch.distributed as dist

    from vp_accelerate.train.run.tracking import gather

    rank = dist.get_rank()
    if rank == 1:  # only rank 1's disk is full (another node's, or a quota)
        ckpt_space.free_bytes = lambda path: 100
    try:
        ckpt.save_checkpoint(
            ckpt.SaveSpec(root, 1, rank),
            ckpt.RankState({"w": torch.zeros(256)}, {}, {"step": 1}, {"fingerprint": {}}),
            dist.barrier,
            agree=gather,
        )
    except ckpt.CheckpointError as e:
        return str(e)
    return None


def test_a_full_disk_on_one_rank_stops_every_rank_with_the_same_line(tmp_path):
    from vp_accelerate.distributed import spawn

    said = spawn(_two_ranks_one_disk_full, 2, str(tmp_path), timeout_s=120)
    assert said[0] == said[1] and said[0].startswith("disk full: rank 1 needs about"), said
    assert "100 are free" in said[0] and not os.path.exists(tmp_path / "step_00000001")
    assert not os.path.exists(tmp_path / "step_00000001.tmp")  # the space the partial folder held is given back
