"""Bad input gets a clear error naming its cause and its fix, before any process group where possible.

Recipe-level checks go through `vp-accelerate train --check --world-size N` (what every rank runs under
`accelerate launch` before the process group starts); data, runtime and checkpoint checks are called
directly. Random names and sizes are fresh per run, so a hard-coded message cannot pass by accident.
The same cases are tabled in docs/reliability.md.
"""

import json
import random
import string
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from helpers import tiny
from helpers.tiny import bpe, corpus
from vp_accelerate.train.cli.commands import train_main

RNG = random.Random()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A ~300-token byte-level BPE and a small corpus (2 s)."""
    d = tmp_path_factory.mktemp("tok")
    bpe([corpus(d, ["alpha", "beta", "мир", "世界", "λόγος"], per_line=20, seed=RNG.random())], d)
    return d


def recipe_file(tmp_path, tok_dir, **sections):
    base = {
        "data": {"seq_len": 64},
        "pipeline": {"microbatches": 4},
        "train": {"global_batch": 8},
        "eval": {"batches": 0},
    }
    merged = {key: {**base.get(key, {}), **sections.get(key, {})} for key in {**base, **sections}}
    path = tmp_path / f"r{RNG.randrange(10**6)}.yaml"
    return tiny.recipe_file(path, tok_dir / "tok", [tok_dir / "train.jsonl"], **merged)


def check(capsys, path, world_size=2, *sets):
    argv = [path, "--check", "--world-size", str(world_size)]
    for s in sets:
        argv += ["--set", s]
    code = train_main(argv)
    return code, capsys.readouterr().err


def test_a_valid_plan_passes_and_says_what_was_checked(tmp_path, tok_dir, capsys):
    code, err = check(capsys, recipe_file(tmp_path, tok_dir))
    assert code == 0, err
    assert "checked: 1f1b x vocab-2 on 2 ranks, 4 microbatches, layers per chunk [2, 2]" in err


def test_mistyped_key_names_the_key_and_the_fix(tmp_path, tok_dir, capsys):
    name = "microbatches"
    i = RNG.randrange(1, len(name) - 1)
    typo = name[:i] + name[i + 1 :]  # one letter dropped
    path = recipe_file(tmp_path, tok_dir)
    data = yaml.safe_load(open(path))
    data["pipeline"][typo] = 4
    open(path, "w").write(yaml.safe_dump(data))
    code, err = check(capsys, path)
    assert code == 2 and f"pipeline.{typo}: unknown key; did you mean microbatches?" in err


def test_unknown_section_lists_the_known_keys(tmp_path, tok_dir, capsys):
    path = recipe_file(tmp_path, tok_dir)
    data = yaml.safe_load(open(path))
    junk = "".join(RNG.choices(string.ascii_lowercase, k=12))
    data[junk] = {}
    open(path, "w").write(yaml.safe_dump(data))
    code, err = check(capsys, path)
    assert code == 2 and f"{junk}: unknown key; known keys: model, tokenizer, data" in err


@pytest.mark.parametrize(
    "world, sets, message",
    [
        (
            2,
            ["pipeline.microbatches=1", "train.global_batch=8"],
            "pipeline.microbatches: num_microbatches (1) must be >= num_ranks (2)",
        ),
        (4, ["pipeline.microbatches=2"], "pipeline.microbatches: num_microbatches (2) must be >= num_ranks (4)"),
        (8, ["pipeline.microbatches=8"], "pipeline: cannot split 4 decoder layers into 8 chunks"),
        (
            2,
            ["pipeline.schedule=interleaved", "pipeline.chunks_per_rank=3"],
            "pipeline: cannot split 4 decoder layers into 6 chunks",
        ),
        (4, ["pipeline.schedule=vhalf"], "pipeline: cannot split 4 decoder layers into 8 chunks"),
        (
            2,
            ["pipeline.schedule=vhalf", "pipeline.chunks_per_rank=3"],
            "pipeline.chunks_per_rank: vhalf holds exactly 2",
        ),
        (
            2,
            ["pipeline.layers_per_stage=[1,2]"],
            "pipeline.layers_per_stage: layers_per_stage [1, 2] must have 2 "
            "entries (one per chunk) summing to the model's 4 decoder layers",
        ),
        (3, ["pipeline.pp_size=2"], "pipeline.pp_size: pp_size=2 x dp_size=1 = 2, but 3 processes are launched"),
        (3, ["pipeline.dp_size=2"], "pipeline.dp_size: 3 processes cannot form 2 equal replicas"),
        (
            2,
            ["data.seq_len=2049"],
            "data.seq_len: 2049 tokens exceed the model's max_position_embeddings=2048; lower "
            "data.seq_len to at most 2048",
        ),
        (2, ["model.source=gpt2-tiny", "data.seq_len=4096"], "max_position_embeddings=2048"),
        (
            2,
            ["tokenizer.resize_vocab=false", "model.config.vocab_size={short}"],
            "tokenizer.resize_vocab: the tokenizer has {n} tokens but the model's vocabulary has {short} rows, so ids >= "
            "{short} have no embedding; set tokenizer.resize_vocab: true",
        ),
        (
            512,
            ["pipeline.microbatches=512", "train.global_batch=512", "model.config.num_hidden_layers=512"],
            "tokenizer: a vocabulary of {n} tokens cannot be sharded over 512 pipeline ranks",
        ),
        (2, ["model.source=llama-tyni"], "model.source: 'llama-tyni' is not a preset (did you mean llama-tiny?)"),
    ],
)
def test_impossible_plans_fail_before_launch(tmp_path, tok_dir, capsys, world, sets, message):
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(str(tok_dir / "tok")))
    fill = {"n": n, "short": n - RNG.randrange(1, 50)}
    sets, message = [x.format(**fill) for x in sets], message.format(**fill)
    code, err = check(capsys, recipe_file(tmp_path, tok_dir), world, *sets)
    assert code == 2, err
    assert message in err, err


def test_world_size_unknown_is_said(tmp_path, tok_dir, capsys):
    code = train_main([recipe_file(tmp_path, tok_dir), "--check"])
    err = capsys.readouterr().err
    assert code == 0 and "world size unknown" in err


def test_custom_model_code_needs_trust_remote_code(tmp_path, tok_dir, capsys):
    model = tmp_path / "custom_model"
    model.mkdir()
    kind = "custom" + "".join(RNG.choices(string.ascii_lowercase, k=6))
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": kind,
                "auto_map": {"AutoConfig": "modeling.Cfg", "AutoModelForCausalLM": "modeling.Model"},
                "num_hidden_layers": 4,
            }
        )
    )
    (model / "modeling.py").write_text("raise SystemExit('remote code ran')\n")
    code, err = check(capsys, recipe_file(tmp_path, tok_dir, model={"source": str(model)}))
    assert code == 2
    assert f"model.trust_remote_code: {model} needs its own modelling code (model_type '{kind}'" in err
    assert "unless the recipe sets model.trust_remote_code: true" in err


# ------------------------------------------------------------------------------------------- data
def data_cfg(tmp_path, texts, **kw):
    from vp_accelerate.train.recipe import DataSection

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return DataSection(files=[str(path)], seq_len=kw.pop("seq_len", 8), eval_holdout=0.0, **kw)


def test_token_id_outside_the_model_vocab_names_the_document(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import DataError, build_data

    tok = AutoTokenizer.from_pretrained(str(tok_dir / "tok"))
    texts = ["a"] * 50
    bad = RNG.randrange(50)
    texts[bad] = "λόγος 世界"  # multi-byte text: byte-level ids far above the single-letter ones
    limit = max(tok("a", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) + 1
    assert max(tok(texts[bad], add_special_tokens=False)["input_ids"]) >= limit
    with pytest.raises(
        DataError,
        match=rf"tokenizer.resize_vocab: .*d.jsonl, line {bad + 1} \('λόγος 世界'...\) has "
        rf"token id \d+ >= the model's vocab size {limit}; set tokenizer.resize_vocab: "
        rf"true",
    ):
        build_data(data_cfg(tmp_path, texts), tok, limit, 0, 2)


@pytest.mark.parametrize(
    "texts, message",
    [
        ([], "the dataset is empty"),
        (["alpha"], r"only \d tokens, not one sequence of data.seq_len=8"),
    ],
)
def test_empty_or_too_small_dataset(tmp_path, tok_dir, texts, message):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import DataError, build_data

    tok = AutoTokenizer.from_pretrained(str(tok_dir / "tok"))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with pytest.raises(DataError, match=message):
        build_data(data_cfg(tmp_path, texts), tok, len(tok), 0, 2)


def test_fewer_sequences_than_a_batch(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import DataError, build_data

    tok = AutoTokenizer.from_pretrained(str(tok_dir / "tok"))
    with pytest.raises(
        DataError,
        match="the training data has 1 sequences, fewer than train.global_batch=16; add "
        "data or lower data.seq_len / train.global_batch",
    ):
        build_data(data_cfg(tmp_path, [" ".join(["alpha", "мир"] * 4)]), tok, len(tok), 0, 16)


def test_batch_rows_are_named_for_errors():
    from vp_accelerate.train.data import BatchIterator, Sequences

    seqs = Sequences(np.arange(40 * 4).reshape(40, 4))
    seed = RNG.randrange(100)
    it = BatchIterator(seqs, seed, 8)
    next(it)
    batch = next(it)
    rows = np.random.default_rng([seed, 0]).permutation(40)[8:16]
    assert (batch["input_ids"][:, 0].numpy() // 4 == rows).all()
    assert it.describe_rows(2, 4) == f"packed training sequences {rows[2:4].tolist()} (epoch 0, order of seed {seed})"


# ------------------------------------------------------------------------------------------- runtime
def fake_config(vocab=64, max_pos=32):
    return SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_pos)


@pytest.mark.parametrize("what", ["id", "label", "seq"])
def test_runtime_batch_checks_name_sample_and_position(what):
    from vp_accelerate.runtime.microbatches import check_batch

    b, s = 4, 16
    ids = torch.randint(0, 64, (b, s))
    labels = ids.clone()
    row, col = RNG.randrange(b), RNG.randrange(s)
    if what == "id":
        ids[row, col] = 64 + RNG.randrange(5)
        match = rf"token id {int(ids[row, col])} at sample {row}, position {col} is outside the vocabulary \[0, 64\)"
    elif what == "label":
        labels[row, col] = -RNG.randrange(1, 99)
        match = rf"label {int(labels[row, col])} at sample {row}, position {col} is outside \[0, 64\) and is not"
    else:
        ids = labels = torch.zeros(b, 33, dtype=torch.long)
        match = "sequence length 33 exceeds the model's max_position_embeddings=32"
    with pytest.raises(ValueError, match=match):
        check_batch(ids, labels, None, 2, fake_config())


def test_vocab_smaller_than_ranks_in_the_runtime():
    from vp_accelerate.vocab.partition import VocabPartition

    with pytest.raises(
        ValueError,
        match=r"vocab_size \(3\) < world_size \(4\): every rank needs at least one "
        r"vocabulary row",
    ):
        VocabPartition(3, 4)


# ------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_of_another_layout_lists_every_difference():
    from vp_accelerate.train.persist.store import CheckpointError, check_fingerprint

    saved = {"model": "abc", "world_size": 2, "method": "vocab-2", "seed": 0}
    now = {**saved, "world_size": 4, "model": "def"}
    with pytest.raises(CheckpointError) as e:
        check_fingerprint(saved, now, "ck")
    assert "model: checkpoint has 'abc', this run has 'def'" in str(e.value)
    assert "world_size: checkpoint has 2, this run has 4" in str(e.value)
    assert "method" not in str(e.value)


def test_checkpoint_shapes_of_another_vocab_are_refused():
    from vp_accelerate.train.persist.store import CheckpointError, check_shapes

    v = RNG.randrange(10, 100)
    with pytest.raises(CheckpointError, match=rf"lm_head.weight: saved \({v}, 8\), expected \({v + 1}, 8\)"):
        check_shapes({"lm_head.weight": torch.zeros(v, 8)}, {"lm_head.weight": torch.zeros(v + 1, 8)}, "ck", 1)
