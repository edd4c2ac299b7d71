"""Hostile checkpoints: records whose names lead outside the checkpoint, meta.json with missing keys, wrong types,
absurd sizes or deep nesting, safetensors files with hostile headers, an optimizer file that is a pickle of code.
Each is refused with one CheckpointError naming the file, before anything is sized by it, opened outside the
checkpoint or unpickled; the records are rewritten to match each altered file, as a crafted checkpoint would, so
the hash check alone cannot be what catches them. Each test fails on the code before it (a traceback, a stat and
hash of a file outside, or an allocation sized by meta.json)."""

import json
import os
import pickle
import struct

import pytest
import torch

from helpers.checkpoints import save_one_rank
from vp_accelerate.train.persist import files
from vp_accelerate.train.persist import store as ckpt


def _saved(tmp_path):
    model = {"lm_head.weight": torch.randn(8, 4)}
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p])
    return save_one_rank(tmp_path / "ckpt", 1, (model, opt.state_dict(), {"step": 1}))


def _rewrite_meta(path, change):
    """meta.json changed by `change(meta)` (or replaced by its text), and its record made to match."""
    meta_path = os.path.join(path, ckpt.META)
    meta = json.loads(open(meta_path).read())
    out = change(meta)
    open(meta_path, "w").write(out if isinstance(out, str) else json.dumps(meta))
    json.dump(files.record(path, [ckpt.META]), open(os.path.join(path, ckpt.META_RECORD), "w"))


def _rewrite_rank_file(path, name, data: bytes, record=None):
    """A rank file replaced by `data`, files.json made to match (or replaced by `record`)."""
    rdir = os.path.join(path, "rank_00000")
    open(os.path.join(rdir, name), "wb").write(data)
    entries = json.loads(open(os.path.join(rdir, files.MANIFEST)).read())
    entries.update(files.record(rdir, [name]))
    json.dump(record if record is not None else entries, open(os.path.join(rdir, files.MANIFEST), "w"))


@pytest.mark.parametrize("name", ["../../outside.txt", "/etc/hostname", "model/../../outside.txt"])
def test_a_meta_record_naming_a_file_outside_is_refused(tmp_path, name):
    path = _saved(tmp_path)
    (tmp_path / "outside.txt").write_text("secret")
    _rewrite_meta(path, lambda m: m["files"].update({name: {"size": 6, "xxh3_128": "0" * 32}}))
    with pytest.raises(ckpt.CheckpointError, match="which is not a file inside") as e:
        ckpt.check_model_files(path, ckpt.read_meta(path))
    assert "6 bytes" not in str(e.value) and "secret" not in str(e.value)


@pytest.mark.parametrize("name", ["../../outside.txt", "/etc/hostname", "sub/model.safetensors"])
def test_a_rank_record_naming_a_file_outside_is_refused(tmp_path, name):
    path = _saved(tmp_path)
    rdir = os.path.join(path, "rank_00000")
    entries = json.loads(open(os.path.join(rdir, files.MANIFEST)).read())
    entries[name] = {"size": 6, "xxh3_128": "0" * 32}
    json.dump(entries, open(os.path.join(rdir, files.MANIFEST), "w"))
    with pytest.raises(ckpt.CheckpointError, match="files.json names .*not a file"):
        ckpt.check_rank_files(path, 0)


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda m: m.pop("step"), "`step` is 'None', not a step number"),
        (lambda m: m.update(step="3"), "`step` is '3', not a step number"),
        (lambda m: m.update(fingerprint=[1]), "`fingerprint` is"),
        (lambda m: m.update(ranks="all"), "`ranks` is 'all', not a list"),
        (lambda m: m.update(ranks=[{"rank": 0, "pp_rank": -1, "dp_rank": 0}]), "not a list of {rank, pp_rank"),
        (lambda m: m.update(ranks=[{"rank": 0, "pp_rank": 0, "dp_rank": 0}] * 2), "naming a rank twice"),
        (lambda m: m.update(vocab_size=10**12), "`vocab_size` is '1000000000000', not a vocabulary size"),
        (lambda m: m.update(vocab_size=1.5), "`vocab_size` is '1.5'"),
        (lambda m: m.update(files={"model/config.json": {"size": "big"}}), "records 'model/config.json' as"),
        (lambda m: "[" * 100_000 + "]" * 100_000, "nested deeper than the parser's limit"),
        (lambda m: " " * (65 << 20), "not the few kilobytes"),
    ],
)
def test_a_malformed_meta_json_is_one_line(tmp_path, change, says):
    path = _saved(tmp_path)
    _rewrite_meta(path, change)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.read_meta(path)
    assert says in str(e.value) and os.path.join(path, "meta.json") in str(e.value), str(e.value)


def _safetensors_bytes(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


HOSTILE_HEADERS = {
    "length 2^62": struct.pack("<Q", 1 << 62) + b"{}",
    "garbled JSON": _safetensors_bytes(b'{"w": {"dtype": "F32", "shape": [2'),
    "offsets past the end": _safetensors_bytes(
        json.dumps(
            {"lm_head.weight": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 42]}}
        ).encode(),
        b"\0" * 16,
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_a_hostile_safetensors_header_is_one_line(tmp_path, case):
    path = _saved(tmp_path)
    _rewrite_rank_file(path, "model.safetensors", HOSTILE_HEADERS[case])
    weights = os.path.join(path, "rank_00000", "model.safetensors")
    for read in (lambda: ckpt.load_weights(path, 0), lambda: files.open_safetensors(weights)):
        with pytest.raises(ckpt.CheckpointError, match=f"{weights} cannot be read"):
            read()


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo ran > /dev/null",))


def test_an_optimizer_file_that_is_a_pickle_of_code_is_refused(tmp_path, capsys):
    path = _saved(tmp_path)
    _rewrite_rank_file(path, "optimizer.pt", pickle.dumps({"state": _Payload()}))
    for mmap in (False, True):
        with pytest.raises(ckpt.CheckpointError) as e:
            files.load_torch(os.path.join(path, "rank_00000", "optimizer.pt"), mmap=mmap)
        message = str(e.value)
        assert "optimizer.pt" in message and "weights_only=False" not in message, message
        assert "\n" not in message


def _model_dir(tmp_path, index=None, weights: bytes | None = None):
    from vp_accelerate.train.recipe.presets import preset_config

    d = tmp_path / "model"
    preset_config("llama-tiny").save_pretrained(d)
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return str(d)


@pytest.mark.parametrize(
    "index, weights, says",
    [
        ({"w": "../outside.safetensors"}, None, "which is not a file in"),
        ({"w": "/etc/hostname"}, None, "which is not a file in"),
        ({"w": 3}, None, "weight_map is not an object"),
        (None, HOSTILE_HEADERS["length 2^62"], "is not a readable safetensors file"),
        (None, HOSTILE_HEADERS["offsets past the end"], "is not a readable safetensors file"),
    ],
)
def test_a_model_dir_with_a_hostile_index_or_header_is_one_line_at_check(tmp_path, index, weights, says):
    from vp_accelerate.train.cli.preflight import check_weight_files
    from vp_accelerate.train.recipe import RecipeError

    (tmp_path / "outside.safetensors").write_bytes(b"x")
    with pytest.raises(RecipeError, match=says):
        check_weight_files(_model_dir(tmp_path, index, weights))


def test_the_weight_reader_refuses_an_index_naming_a_file_outside(tmp_path):
    from vp_accelerate.models.weights import SafetensorsSource

    with pytest.raises(ValueError, match="which is not a file in"):
        SafetensorsSource(_model_dir(tmp_path, {"w": "../outside.safetensors"}))
