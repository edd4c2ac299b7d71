"""Bad inputs that ended in tracebacks or passed `--check`: each is now one line naming the file or
key (and line for data) at `train --check`, exit 2, in one process. A BOM is read; an empty assistant turn is
warned with its line. The same cases are tabled in docs/reliability.md (scripts/reliability_cases.py)."""

import json
import os

import pytest
from safetensors.torch import save_file

from helpers import tiny
from helpers.tiny import bpe
from vp_accelerate.train.cli.commands import train_main


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    words = ["alpha", "beta", "gamma", "мир", "世界"]
    with open(d / "train.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": " ".join(words[(i + k) % 5] for k in range(20))}, ensure_ascii=False) + "\n")
    bpe([d / "train.jsonl"], d)
    return d


def recipe_file(tmp_path, tok_dir, **sections):
    base = {
        "data": {"seq_len": 64},
        "pipeline": {"microbatches": 4},
        "train": {"global_batch": 8},
        "eval": {"batches": 0},
        "logging": {"output_dir": str(tmp_path / "out")},
    }
    merged = {key: {**base.get(key, {}), **sections.get(key, {})} for key in {**base, **sections}}
    return tiny.recipe_file(tmp_path / "recipe.yaml", tok_dir / "tok", [tok_dir / "train.jsonl"], **merged)


def check(capsys, path, *sets, resume=None):
    argv = [path, "--check", "--world-size", "2"]
    for s in sets:
        argv += ["--set", s]
    if resume:
        argv += ["--resume", resume]
    code = train_main(argv)
    return code, capsys.readouterr().err


def refused(capsys, path, *sets, resume=None) -> str:
    code, err = check(capsys, path, *sets, resume=resume)
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_non_utf8_byte_in_a_jsonl_names_file_line_and_column(tmp_path, tok_dir, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"text": "ok"}\n' * 2 + b'{"text": "caf\xe9"}\n' + b'{"text": "ok"}\n' * 100)
    line = refused(capsys, recipe_file(tmp_path, tok_dir, data={"files": [str(data)]}))
    assert f"{data}, line 3, column 14: byte 0xe9 is not UTF-8" in line and "save the file as UTF-8" in line


def test_a_recipe_that_is_a_directory_or_not_utf8(tmp_path, capsys):
    assert "is a directory" in refused(capsys, str(tmp_path))
    bad = tmp_path / "r.yaml"
    bad.write_bytes(b"train:\n  steps: 3 # caf\xe9\n")
    assert f"{bad}: not UTF-8 text (byte 0xe9" in refused(capsys, str(bad))


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.config={hidden_size: 64", "--set model.config: '{hidden_size: 64' is not a YAML value"),
        ("model.config=[1, 2]", "--set model.config: expects a mapping"),
        ("model.config.hidden_size=abc", "model.config.hidden_size: expects an integer"),
        ("optimizer.lr=.nan", "optimizer.lr: must be a finite number"),
    ],
)
def test_overrides_malformed_mistyped_or_not_finite(tmp_path, tok_dir, capsys, override, message):
    assert message in refused(capsys, recipe_file(tmp_path, tok_dir), f"{override}")


def _model_dir(tmp_path, config_text=None, shards=("a", "b"), present=("a",)):
    from vp_accelerate.train.recipe.presets import preset_config

    d = tmp_path / "model"
    preset_config("llama-tiny").save_pretrained(d)
    if config_text is not None:
        (d / "config.json").write_text(config_text)
    index = {"weight_map": {f"w{k}": f"model-{k}.safetensors" for k in shards}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    for k in present:
        save_file({}, str(d / f"model-{k}.safetensors"))
    return d


def test_a_model_dir_with_a_broken_config_json(tmp_path, tok_dir, capsys):
    d = _model_dir(tmp_path, config_text='{"model_type": "llama",')
    line = refused(capsys, recipe_file(tmp_path, tok_dir, model={"source": str(d)}))
    assert f"{d / 'config.json'} is not valid JSON" in line


def test_a_missing_safetensors_shard_is_found_at_check(tmp_path, tok_dir, capsys):
    d = _model_dir(tmp_path)
    line = refused(capsys, recipe_file(tmp_path, tok_dir, model={"source": str(d)}))
    assert "missing 1 of the 2 weight files" in line and "model-b.safetensors" in line


def test_checkpoint_dir_that_is_a_file(tmp_path, tok_dir, capsys):
    (tmp_path / "a_file").write_text("x")
    line = refused(capsys, recipe_file(tmp_path, tok_dir, checkpoint={"dir": str(tmp_path / "a_file")}))
    assert "checkpoint.dir" in line and "is a file, not a directory" in line


def test_a_dangling_latest_without_resume(tmp_path, tok_dir, capsys):
    cdir = tmp_path / "out" / "checkpoints"
    cdir.mkdir(parents=True)
    (cdir / "latest").write_text("step_00000003\n")
    line = refused(capsys, recipe_file(tmp_path, tok_dir))
    assert "names 'step_00000003', which is not a complete checkpoint" in line and "delete" in line


@pytest.mark.parametrize("beside", [True, False])
def test_a_directory_in_data_files_is_named(tmp_path, tok_dir, capsys, beside):
    folder = tmp_path / "more_data"
    folder.mkdir()
    files = [str(tok_dir / "train.jsonl"), str(folder)] if beside else [str(folder)]
    line = refused(capsys, recipe_file(tmp_path, tok_dir, data={"files": files}))
    assert f"{folder}' is a directory, not a data file" in line


def test_a_jsonl_with_a_utf8_bom_is_read(tmp_path, tok_dir, capsys):
    data = tmp_path / "bom.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + (tok_dir / "train.jsonl").read_bytes())
    code, err = check(capsys, recipe_file(tmp_path, tok_dir, data={"files": [str(data)]}))
    assert code == 0, err


def test_empty_assistant_turns_are_warned_with_their_lines(tmp_path, tok_dir, capsys):
    data = tmp_path / "chat.jsonl"
    rows = []
    for i in range(120):
        answer = "" if i in (4, 70) else "alpha beta gamma мир 世界 " * 3
        rows.append({"messages": [{"role": "user", "content": "beta gamma"}, {"role": "assistant", "content": answer}]})
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    code, err = check(capsys, recipe_file(tmp_path, tok_dir, data={"files": [str(data)], "format": "chat"}))
    assert code == 0, err
    assert "2 conversation(s) have an assistant turn with empty content" in err
    assert f"{data}, line 5" in err and f"{data}, line 71" in err


def test_override_needs_resume(tmp_path, tok_dir, capsys):
    path = recipe_file(tmp_path, tok_dir)
    code = train_main([path, "--check", "--override", "optimizer"])
    assert code == 2 and "--override applies to --resume only" in capsys.readouterr().err


def test_the_output_dir_is_not_a_file(tmp_path, tok_dir, capsys):
    (tmp_path / "out").write_text("x")
    assert "logging.output_dir" in refused(capsys, recipe_file(tmp_path, tok_dir)) and os.path.isfile(tmp_path / "out")
