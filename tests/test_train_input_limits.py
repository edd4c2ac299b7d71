"""Hostile recipes, data rows and run folders: each is one line naming the cause and the fix, exit 2, with no
traceback, no unbounded memory and nothing written outside the run's folder. Each test fails on the code before
it: a YAML alias bomb expanded to gigabytes, a 100k-deep JSON row or recipe was a RecursionError, a symlinked lock
file had its target truncated, a lock record that is not an object was an AttributeError, an empty
`logging.output_dir` wrote into the current directory, and a 10 MB row took 2 GB in one tokenizer call."""

import fcntl
import json
import os

import pytest
from transformers import PreTrainedTokenizerFast

from helpers.tiny import recipe_file, word_tokenizer
from vp_accelerate.train.cli.commands import train_main
from vp_accelerate.train.data import long_text
from vp_accelerate.train.data.tokenize import json_record
from vp_accelerate.train.recipe import RecipeError
from vp_accelerate.train.run import run_lock

BOMB = "\n".join(
    [f"a0: &a0 [{', '.join(['lol'] * 9)}]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    + ["model:", "  config: *a8"]
)


def _refused(capsys, argv) -> str:
    code = train_main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "text, says",
    [(BOMB, "expand to more than 100,000 values"), ("a:" + " [" * 50_000, "nested deeper than a YAML reader")],
)
def test_a_yaml_alias_bomb_or_a_deep_recipe_is_one_line(tmp_path, capsys, text, says):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    assert says in _refused(capsys, [str(path), "--check"])


def test_an_empty_output_dir_is_refused(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("model: {source: llama-tiny}\n")
    line = _refused(capsys, [str(path), "--check", "--set", "logging.output_dir="])
    assert "logging.output_dir: is empty" in line


def test_a_deeply_nested_json_row_is_an_invalid_row():
    record, reason = json_record("[" * 100_000)
    assert record is None and reason == "not valid JSON (nested deeper than the parser's limit)"


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / run_lock.LOCK_FILE)
    with pytest.raises(RecipeError, match="is a symbolic link"):
        run_lock.acquire(str(run))
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("record", [b"[1, 2]", b'{"since": "yesterday", "pid": {"x": 1}}', b"\xff\xfe", b"1e999"])
def test_a_malformed_lock_record_gives_the_usual_line(tmp_path, record):
    path = tmp_path / run_lock.LOCK_FILE
    path.write_bytes(record)
    fd = os.open(path, os.O_RDWR)  # another holder: flock conflicts between open file descriptions
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(RecipeError, match="another run is writing into"):
            run_lock.acquire(str(tmp_path))
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(str(word_tokenizer(tmp_path_factory.mktemp("tok"))))


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer: "▁" for spaces, one prepended where an input does not start with one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"])
    tok.train_from_iterator(["alpha beta gamma delta"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class _Marking:
    """A tokenizer that opens every input with a marker token (a piece encoded alone would have one too many)."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, s, **kw):
        return {"input_ids": [0] + self.tok(s, **kw)["input_ids"]}


@pytest.mark.parametrize("kind", ["words", "no spaces", "metaspace", "marking"])
def test_a_long_text_is_encoded_in_pieces_to_the_same_ids(bpe, monkeypatch, kind):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 3000)
    tok = {"metaspace": _metaspace_tokenizer(), "marking": _Marking(bpe)}.get(kind, bpe)
    text = "xy" * 20_000 if kind == "no spaces" else " ".join(["alpha beta\n gamma  delta 12345 paris,"] * 800)
    calls = []

    def counting(s, **kw):
        calls.append(len(s))
        return tok(s, **kw)

    assert long_text.encode_text(counting, text) == tok(text, add_special_tokens=False)["input_ids"]
    assert max(calls) <= 3000  # a marking tokenizer too: each piece is encoded behind its context, marker dropped


def test_the_text_format_encodes_a_long_row_in_pieces(tmp_path, capsys, monkeypatch):
    """`train --check` over a data file with one 60k-character row: no tokenizer call sees more than a piece."""
    tok = word_tokenizer(tmp_path)
    rows = [{"text": " ".join(["alpha beta gamma"] * 20)}] * 50 + [{"text": " ".join(["paris france"] * 5000)}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe_file(
        tmp_path / "r.yaml",
        tok,
        [tmp_path / "d.jsonl"],
        data={"seq_len": 64},
        pipeline={"microbatches": 2},
        train={"global_batch": 2},
        eval={"batches": 0},
        logging={"output_dir": str(tmp_path / "out")},
    )
    monkeypatch.setattr(long_text, "PIECE_CHARS", 3000)
    seen = []
    real = long_text._ids
    monkeypatch.setattr(long_text, "_ids", lambda t, s: seen.append(len(s)) or real(t, s))
    assert train_main([str(tmp_path / "r.yaml"), "--check", "--world-size", "2"]) == 0, capsys.readouterr().err
    assert seen and max(seen) <= 3000


@pytest.mark.parametrize("line, says", [("[" * 100_000, "nested too deep"), ('{"txt": "a"}', "no string field 'text'")])
def test_a_bad_line_in_tokenizer_training_data_is_one_line(tmp_path, capsys, line, says):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tokenizer", "scripts/train_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "d.jsonl").write_text('{"text": "alpha beta"}\n' * 20 + line + "\n")
    assert script.main([str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "tok"), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl, line 21: " in err and says in err
