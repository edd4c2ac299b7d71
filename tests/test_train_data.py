"""Data: packing, deterministic order, data-parallel slicing, resumable position, clear errors."""

import json

import numpy as np
import pytest
import torch

from helpers.tiny import bpe, recipe_file
from vp_accelerate.train.data import BatchIterator, DataError, Sequences, build_data, is_heldout, pack, pad_rows
from vp_accelerate.train.recipe import DataSection


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "мир", "世界", "données", "λόγος"]
    docs = [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(300)]
    with open(d / "train.jsonl", "w") as f:
        for t in docs:
            f.write(json.dumps({"body": t}, ensure_ascii=False) + "\n")
    (d / "train.txt").write_text("\n".join(docs) + "\n")
    (d / "empty.jsonl").write_text("")
    tok = bpe([d / "train.txt"], d)
    return d, tok


def cfg(d, **kw):
    base = dict(files=[str(d / "train.jsonl")], text_field="body", seq_len=16, eval_holdout=0.1)
    base.update(kw)
    return DataSection(**base)


def test_pack_and_pad():
    seqs = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4)
    assert seqs.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    ids, mask = pad_rows([[1, 2, 3, 4, 5], [6]], 3, pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [6, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    b = Sequences(ids, mask).batch(np.array([1]))
    assert b["labels"].tolist() == [[6, -100, -100]] and b["input_ids"].tolist() == [[6, 0, 0]]


def test_packed_batches_and_hf_labels(corpus):
    d, tok = corpus
    train, evals = build_data(cfg(d), tok, len(tok), seed=0, global_batch=8, eval_batches=2)
    b = next(train)
    assert b["input_ids"].shape == (8, 16) and b["input_ids"].dtype == torch.long
    assert torch.equal(b["labels"], b["input_ids"]) and "attention_mask" not in b  # HF convention, unshifted
    assert (b["input_ids"] == tok.eos_token_id).any()  # documents are separated by EOS
    assert len(evals) == 2 and evals[0]["input_ids"].shape == (8, 16)


def test_order_is_deterministic_per_seed(corpus):
    d, tok = corpus
    a = [next(build_data(cfg(d), tok, len(tok), 0, 8)[0])["input_ids"] for _ in range(2)]
    assert torch.equal(a[0], a[1])
    other = next(build_data(cfg(d), tok, len(tok), 1, 8)[0])["input_ids"]
    assert not torch.equal(a[0], other)


def test_dp_replicas_take_disjoint_slices_of_the_global_batch(corpus):
    d, tok = corpus
    full = build_data(cfg(d), tok, len(tok), 0, 8, dp_rank=0, dp_size=1)[0]
    halves = [build_data(cfg(d), tok, len(tok), 0, 8, dp_rank=r, dp_size=2)[0] for r in range(2)]
    for _ in range(3):
        g = next(full)["input_ids"]
        parts = [next(h)["input_ids"] for h in halves]
        assert parts[0].shape == (4, 16) and torch.equal(torch.cat(parts), g)


def test_resume_position_is_exact_across_epochs(corpus):
    d, tok = corpus
    train = build_data(cfg(d), tok, len(tok), 0, 8)[0]
    n = train.steps_per_epoch + 3  # cross an epoch boundary
    for _ in range(n):
        next(train)
    state = train.state_dict()
    expected = [next(train)["input_ids"] for _ in range(3)]
    fresh = build_data(cfg(d), tok, len(tok), 0, 8)[0]
    fresh.load_state_dict(state)
    assert state["epoch"] == 1
    assert all(torch.equal(next(fresh)["input_ids"], e) for e in expected)


def test_streaming_matches_its_own_resume_and_slices(corpus):
    d, tok = corpus
    c = cfg(d, streaming=True, shuffle_buffer=50)
    train, evals = build_data(c, tok, len(tok), 0, 8, eval_batches=1)
    batches = [next(train)["input_ids"] for _ in range(4)]
    assert batches[0].shape == (8, 16) and len(evals) == 1
    again = build_data(c, tok, len(tok), 0, 8)[0]
    again.load_state_dict({"epoch": 0, "step": 2})
    assert torch.equal(next(again)["input_ids"], batches[2])
    half = build_data(c, tok, len(tok), 0, 8, dp_rank=1, dp_size=2)[0]
    assert torch.equal(next(half)["input_ids"], batches[0][4:])


def test_heldout_documents_are_not_trained_on(corpus):
    d, tok = corpus
    texts = [json.loads(line)["body"] for line in open(d / "train.jsonl")]
    held = [t for t in texts if is_heldout(t, 10)]
    assert 0 < len(held) < len(texts) // 4
    no_holdout = build_data(cfg(d, eval_holdout=0.0), tok, len(tok), 0, 8)[0]
    with_holdout = build_data(cfg(d), tok, len(tok), 0, 8)[0]
    assert len(with_holdout.seqs) < len(no_holdout.seqs)


def test_unpacked_mode_pads_and_masks(corpus):
    d, tok = corpus
    b = next(build_data(cfg(d, packing=False, seq_len=64), tok, len(tok), 0, 8)[0])
    assert "attention_mask" in b and (b["attention_mask"] == 0).any()
    assert torch.equal(b["labels"] == -100, b["attention_mask"] == 0)


def test_txt_files_and_text_field(corpus):
    d, tok = corpus
    b = next(build_data(cfg(d, files=[str(d / "train.txt")], text_field="text"), tok, len(tok), 0, 8)[0])
    assert b["input_ids"].shape == (8, 16)
    with pytest.raises(DataError, match="column 'text' not in"):
        build_data(cfg(d, text_field="text"), tok, len(tok), 0, 8)


def test_errors_are_clear(corpus):
    d, tok = corpus
    with pytest.raises(
        DataError,
        match=r"tokenizer.resize_vocab: .*train.jsonl, line \d+ .* has token id \d+ >= the "
        r"model's vocab size 100",
    ):
        build_data(cfg(d), tok, 100, 0, 8)
    with pytest.raises(DataError, match="empty"):
        build_data(cfg(d, files=[str(d / "empty.jsonl")]), tok, len(tok), 0, 8)
    with pytest.raises(DataError, match="fewer than train.global_batch"):
        build_data(cfg(d), tok, len(tok), 0, 100000)
    with pytest.raises(DataError, match="mixes formats"):
        build_data(cfg(d, files=[str(d / "train.jsonl"), str(d / "train.txt")]), tok, len(tok), 0, 8)
    (d / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="cannot tell the format of"):
        build_data(cfg(d, files=[str(d / "x.csv")]), tok, len(tok), 0, 8)


def test_batch_iterator_small():
    seqs = Sequences(np.arange(40).reshape(10, 4))
    it = BatchIterator(seqs, seed=3, global_batch=4)
    assert it.steps_per_epoch == 2
    seen = torch.cat([next(it)["input_ids"] for _ in range(2)])
    assert len(set(seen[:, 0].tolist())) == 8  # no sequence twice within an epoch


def test_streaming_resumes_from_the_streams_own_state(corpus, monkeypatch):
    """A saved stream position is loaded, not replayed: with a one-document shuffle buffer (nothing in it is lost)
    the resumed batches are the uninterrupted ones, reading fewer documents than the run up to there did; with a
    real buffer no sequence trained on before the save comes back."""
    import datasets

    d, tok = corpus
    read = []
    real_iter = datasets.IterableDataset.__iter__
    monkeypatch.setattr(
        datasets.IterableDataset, "__iter__", lambda self: (read.append(1) or x for x in real_iter(self))
    )
    for buffer in (1, 50):
        c = cfg(d, streaming=True, shuffle_buffer=buffer, eval_holdout=0.0)
        train = build_data(c, tok, len(tok), 0, 8)[0]
        read.clear()
        before = [next(train)["input_ids"] for _ in range(3)]
        state = train.state_dict()
        assert state["step"] == 3 and "stream" in state
        after = [next(train)["input_ids"] for _ in range(3)]
        read_uninterrupted = len(read)
        resumed = build_data(c, tok, len(tok), 0, 8)[0]
        read.clear()
        resumed.load_state_dict(state)
        got = [next(resumed)["input_ids"] for _ in range(3)]
        if buffer == 1:
            assert all(torch.equal(a, b) for a, b in zip(got, after))
            assert len(read) <= read_uninterrupted - 3, (len(read), read_uninterrupted)
        else:
            seen = {tuple(r.tolist()) for b in before for r in b}
            assert not seen & {tuple(r.tolist()) for b in got for r in b}
    monkeypatch.undo()
    replay = build_data(cfg(d, streaming=True, shuffle_buffer=50, stream_resume="replay"), tok, len(tok), 0, 8)[0]
    first = [next(replay)["input_ids"] for _ in range(4)]
    assert "stream" not in replay.state_dict()
    again = build_data(cfg(d, streaming=True, shuffle_buffer=50, stream_resume="replay"), tok, len(tok), 0, 8)[0]
    again.load_state_dict({"epoch": 0, "step": 2})
    assert torch.equal(next(again)["input_ids"], first[2])


def test_the_text_field_is_checked_at_check_time(tmp_path, corpus, capsys):
    """Text data without its `text_field` fails `--check` with exit 2, naming data.text_field and the columns
    found, in any of the files (a chat file is detected as chat and passes)."""
    from vp_accelerate.train.cli.commands import train_main

    d, _ = corpus
    (tmp_path / "chat.jsonl").write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
            )
            + "\n"
            for i in range(64)
        )
    )
    recipe = recipe_file(
        tmp_path / "r.yaml", d / "tok", [tmp_path / "chat.jsonl"], data={"seq_len": 32}, eval={"batches": 0}
    )
    assert train_main([str(recipe), "--check"]) == 0
    assert "data format chat" in capsys.readouterr().err
    assert (
        train_main([str(recipe), "--check", "--set", f"data.files=[{d / 'train.jsonl'}]", "--set", "data.format=text"])
        == 2
    )
    err = capsys.readouterr().err
    assert "data.text_field: 'text' is not a column of" in err and "columns found: ['body']" in err
    (tmp_path / "more.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    assert (
        train_main(
            [
                str(recipe),
                "--check",
                "--set",
                f"data.files=[{d / 'train.jsonl'},{tmp_path / 'more.jsonl'}]",
                "--set",
                "data.text_field=body",
            ]
        )
        == 2
    )
    assert "data.text_field: 'body' is not a column of" in capsys.readouterr().err
    assert (
        train_main(
            [str(recipe), "--check", "--set", f"data.files=[{d / 'train.jsonl'}]", "--set", "data.text_field=body"]
        )
        == 0
    )


def test_hub_datasets_take_name_and_revision(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or "ds")
    from vp_accelerate.train.data import load_documents

    assert load_documents(None, "org/corpus", "validation", streaming=True, name="en", revision="v1.2") == "ds"
    assert calls == [(("org/corpus", "en"), {"split": "validation", "streaming": True, "revision": "v1.2"})]
