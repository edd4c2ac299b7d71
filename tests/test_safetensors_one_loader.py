"""Every safetensors file is opened through one checked loader (vp_accelerate/safetensors_file.py), so a
hostile file is one line wherever it is read. Before, `export` opened a checkpoint's rank files with a raw
`safe_open` and a header length of 2^62, a garbled header or offsets past the end were SafetensorError
tracebacks; a meta.json whose `recipe.adapter` had an unknown key was a TypeError traceback, and tensors of
another model a ValueError traceback. The records are rewritten to match each altered file, as a crafted
checkpoint would, so the hash check is not what catches them."""

import ast
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from helpers import tiny
from vp_accelerate.train.cli.commands import export_main
from vp_accelerate.train.persist import files as ckpt_files
from vp_accelerate.train.persist import store as ckpt
from vp_accelerate.train.recipe.presets import preset_config

PACKAGE = Path(__file__).resolve().parents[1] / "vp_accelerate"
LOADER = PACKAGE / "safetensors_file.py"
WRITERS = {"save_file", "save"}
"""What safetensors offers that writes a file: allowed anywhere (a write reads nothing handed to us)."""


def test_no_safetensors_file_is_opened_outside_the_checked_loader():
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == LOADER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "safetensors":
                bare += [f"{path.relative_to(PACKAGE)}: {a.name}" for a in node.names if a.name not in WRITERS]
            elif isinstance(node, ast.Import):
                bare += [f"{path.relative_to(PACKAGE)}: import {a.name}" for a in node.names if "safetensors" in a.name]
            elif isinstance(node, ast.Attribute) and node.attr in ("safe_open", "load_file"):
                bare.append(f"{path.relative_to(PACKAGE)}: .{node.attr}")
            elif isinstance(node, ast.Name) and node.id == "safe_open":
                bare.append(f"{path.relative_to(PACKAGE)}: safe_open")
    assert bare == [], "open safetensors files through vp_accelerate/safetensors_file.py: " + ", ".join(bare)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return tiny.word_tokenizer(d)


def _checkpoint(tmp_path, tok, meta_extra=None, state=None) -> str:
    """A one-rank checkpoint of a 1-layer Llama, with model/ (config and tokenizer) as a run writes it."""
    config = preset_config(
        "llama-tiny",
        dict(vocab_size=300, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_key_value_heads=2),
    )

    def model_files(d):
        config.save_pretrained(d)
        for name in os.listdir(tok):
            shutil.copy(os.path.join(tok, name), d)

    if state is None:
        from transformers import AutoModelForCausalLM

        state = {k: v.clone() for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    p = torch.nn.Parameter(torch.zeros(3))
    meta = {"fingerprint": {}, "ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0}], "vocab_size": 300}
    return ckpt.save_checkpoint(
        ckpt.SaveSpec(str(tmp_path / "ckpt"), 1, 0, write_model_files=model_files),
        ckpt.RankState(state, torch.optim.AdamW([p]).state_dict(), {"step": 1}, {**meta, **(meta_extra or {})}),
        lambda: None,
    )


def _export(capsys, path, out) -> str:
    code = export_main([path, str(out)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _safetensors(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


HOSTILE = {
    "length 2^62": (struct.pack("<Q", 1 << 62) + b"{}", "header too large"),
    "garbled JSON": (_safetensors(b'{"w": {"dtype": "F32", "shape": [2'), "invalid JSON in header"),
    "offsets past the end": (
        _safetensors(
            json.dumps({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 42]}}).encode(),
            b"\0" * 16,
        ),
        "not fully covered",
    ),
}


def test_the_checkpoint_exports(tmp_path, tok, capsys):
    path = _checkpoint(tmp_path, tok)
    assert export_main([path, str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_export_of_a_hostile_safetensors_rank_file_is_one_line(tmp_path, tok, capsys, case):
    data, says = HOSTILE[case]
    path = _checkpoint(tmp_path, tok)
    rdir = os.path.join(path, "rank_00000")
    Path(rdir, "model.safetensors").write_bytes(data)
    record = json.loads(Path(rdir, ckpt_files.MANIFEST).read_text())
    record.update(ckpt_files.record(rdir, ["model.safetensors"]))
    Path(rdir, ckpt_files.MANIFEST).write_text(json.dumps(record))
    line = _export(capsys, path, tmp_path / "hf")
    weights = os.path.join(rdir, "model.safetensors")
    assert f"checkpoint file {weights} cannot be read (SafetensorError" in line and says in line, line


def _rewrite_meta(path, change):
    meta_path = os.path.join(path, ckpt.META)
    meta = json.loads(Path(meta_path).read_text())
    change(meta)
    Path(meta_path).write_text(json.dumps(meta))
    Path(path, ckpt.META_RECORD).write_text(json.dumps(ckpt_files.record(path, [ckpt.META])))


@pytest.mark.parametrize(
    "adapter, says",
    [
        ({"type": "lora", "bogus_key": 1}, "recipe.adapter.bogus_key: unknown key"),
        ({"type": "lora", "rr": 4}, "recipe.adapter.rr: unknown key; did you mean r?"),
        ({"type": "lora", "r": "eight"}, "recipe.adapter.r: expected int"),
        ({"type": "lora", "r": 0}, "adapter.r: must be >= 1"),
        ("lora", "recipe.adapter: expected a mapping"),
    ],
)
def test_export_of_a_meta_json_with_a_bad_adapter_section_is_one_line(tmp_path, tok, capsys, adapter, says):
    path = _checkpoint(tmp_path, tok)
    _rewrite_meta(path, lambda m: m.update(recipe={"adapter": adapter}))
    line = _export(capsys, path, tmp_path / "hf")
    assert f"checkpoint file {os.path.join(path, 'meta.json')}: " in line and says in line, line


def test_export_of_tensors_of_another_model_is_one_line(tmp_path, tok, capsys):
    path = _checkpoint(tmp_path, tok, state={"w": torch.zeros(4, 4)})
    line = _export(capsys, path, tmp_path / "hf")
    assert f"{path} cannot be exported: exported tensors do not match LlamaForCausalLM" in line, line
