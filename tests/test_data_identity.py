"""Data identity by content: a file rewritten with its mtime kept is read again, not taken from the
datasets cache; the identity a checkpoint records tells a changed file from a moved or touched one."""

import json
import os
import shutil

import pytest

from helpers.tiny import bpe
from vp_accelerate.train.data import build_data
from vp_accelerate.train.data.identity import file_identity, identity_differences
from vp_accelerate.train.recipe import DataSection


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "t.txt").write_text("alpha beta gamma delta\nALPHA BETA GAMMA DELTA\n" * 20)
    return bpe([d / "t.txt"], d)


def _write_keeping_mtime(path, text, stat=None):
    with open(path, "w") as f:
        f.write(text)
    if stat is not None:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.txt"])
def test_a_file_rewritten_with_its_mtime_kept_is_read_again(tmp_path, tok, monkeypatch, name):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # a cache of this test's own
    path = tmp_path / name
    rows = ["alpha beta gamma delta " * 3] * 40
    line = (lambda t: json.dumps({"text": t})) if name.endswith(".jsonl") else (lambda t: t)
    _write_keeping_mtime(path, "\n".join(line(t) for t in rows) + "\n")
    cfg = DataSection(files=[str(path)], seq_len=8, eval_holdout=0.0)
    first = next(build_data(cfg, tok, len(tok), seed=0, global_batch=2)[0])["input_ids"]
    stat = os.stat(path)
    upper = [t.upper() for t in rows]  # the same size, other bytes, the mtime put back (as cp -p would)
    _write_keeping_mtime(path, "\n".join(line(t) for t in upper) + "\n", stat)
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns and os.path.getsize(path) == stat.st_size
    second = next(build_data(cfg, tok, len(tok), seed=0, global_batch=2)[0])["input_ids"]
    assert not (first == second).all(), "the old rows were trained from the cache"
    ids = set(tok("ALPHA BETA", add_special_tokens=False)["input_ids"])
    assert ids & set(second.flatten().tolist())


def test_identity_is_by_content(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text('{"text": "one"}\n')
    saved = [file_identity(str(a))]
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(a, moved / "a.jsonl")  # copied elsewhere, new mtime: the same data
    assert identity_differences(saved, [file_identity(str(moved / "a.jsonl"))]) == []
    st = os.stat(a)
    _write_keeping_mtime(a, '{"text": "two"}\n', st)
    (diff,) = identity_differences(saved, [file_identity(str(a))])
    assert str(a) in diff and "changed since the checkpoint" in diff
