"""A checkpoint's files resolve inside the checkpoint: a symbolic link (a rank file's, a model/ file's, a rank
folder's, `latest`'s) that leads outside it is refused in one line before anything is read or stat'ed through
it, so a shared checkpoint cannot make a load read a file elsewhere or reveal its size. Before, every such link
was followed, and a size mismatch said the outside file's size. Links that stay inside, and a checkpoint
reached through a linked folder, still load."""

import os

import pytest
import torch

from helpers.checkpoints import save_one_rank
from vp_accelerate.train.persist import files
from vp_accelerate.train.persist import store as ckpt

SECRET_SIZE = 12_345


def _saved(tmp_path):
    model = {"lm_head.weight": torch.randn(8, 4)}
    p = torch.nn.Parameter(torch.zeros(3))
    path = save_one_rank(tmp_path / "ckpt", 1, (model, torch.optim.AdamW([p]).state_dict(), {"step": 1}))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.bin").write_bytes(b"s" * SECRET_SIZE)
    return path, str(tmp_path / "outside" / "secret.bin")


def _load(path):
    """What a resume reads: meta.json, then every file of rank 0."""
    ckpt.read_meta(path)
    ckpt.check_rank_files(path, 0)
    return ckpt.load_rank(path, 0)


def _refused(read, path_in_message) -> str:
    with pytest.raises(ckpt.CheckpointError) as e:
        read()
    message = str(e.value)
    assert "\n" not in message and path_in_message in message, message
    assert "symbolic link" in message and f"{SECRET_SIZE}" not in message and "12,345" not in message, message
    return message


@pytest.mark.parametrize("name", ["optimizer.pt", "model.safetensors", "files.json"])
def test_a_rank_file_linked_outside_is_refused_without_its_size(tmp_path, name):
    path, secret = _saved(tmp_path)
    link = os.path.join(path, "rank_00000", name)
    os.remove(link)
    os.symlink(secret, link)
    said = _refused(lambda: _load(path), link)
    assert "leads outside the checkpoint" in said
    # each reader on its own refuses it too (a reshard opens rank files without read_meta first)
    for read in (
        lambda: files.check_file(link, {"size": 1, "xxh3_128": "0" * 32}),
        lambda: files.load_torch(link),
        lambda: files.open_safetensors(link),
    ):
        _refused(read, link)


def test_a_model_file_linked_outside_is_refused(tmp_path):
    path, secret = _saved(tmp_path)
    link = os.path.join(path, "model", "tokenizer.json")  # not in meta.json's record: transformers opens it by name
    os.symlink(secret, link)
    _refused(lambda: ckpt.read_meta(path), link)


def test_a_rank_folder_linked_outside_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    rank = os.path.join(path, "rank_00000")
    os.rename(rank, tmp_path / "outside" / "rank_00000")
    os.symlink(tmp_path / "outside" / "rank_00000", rank)
    _refused(lambda: _load(path), rank)
    _refused(lambda: files.load_torch(os.path.join(rank, "optimizer.pt")), os.path.join(rank, "optimizer.pt"))


def test_a_latest_pointer_that_is_a_link_is_refused_unread(tmp_path):
    path, _ = _saved(tmp_path)
    secret = tmp_path / "outside" / "line.txt"
    secret.write_text("a secret first line\n")
    latest = os.path.join(os.path.dirname(path), ckpt.LATEST)
    os.remove(latest)
    os.symlink(secret, latest)
    with pytest.raises(ckpt.CheckpointError, match="is a symbolic link, not the pointer file") as e:
        ckpt.read_latest(os.path.dirname(path))
    assert "secret" not in str(e.value)


def test_links_that_stay_inside_and_a_linked_checkpoint_folder_load(tmp_path):
    path, _ = _saved(tmp_path)
    rdir = os.path.join(path, "rank_00000")
    os.rename(os.path.join(rdir, "trainer_state.pt"), os.path.join(path, "trainer_state.pt"))
    os.symlink(os.path.join("..", "trainer_state.pt"), os.path.join(rdir, "trainer_state.pt"))
    assert _load(path)[2] == {"step": 1}
    os.symlink(tmp_path / "ckpt", tmp_path / "linked")  # e.g. checkpoints kept on another disk
    linked = os.path.join(tmp_path, "linked", os.path.basename(path))
    assert _load(linked)[2] == {"step": 1}
    assert ckpt.resolve(str(tmp_path / "linked")) == linked
