"""Long rows in bounded memory, in every format and for SentencePiece-style tokenizers. A text is encoded in
verified pieces, each behind its context, so a tokenizer that marks the start of every input (a Llama-style
`Prepend("▁")` normalizer, a Metaspace pre-tokenizer) is split too and gives exactly one call's ids (before: no
cut verified and the whole row went in one call: ~9 GB for a 50 MB row). A text no cut splits, and a row of a
format tokenized whole (chat, prompt / completion, DPO pairs, KTO rows), may hand the tokenizer at most
`long_text.MAX_ONE_CALL_CHARS` characters: past that the row is invalid, named in one line, before any tokenizer
call (before: one 10 MB value took 2.55 GB at `--check` for DPO and KTO, 3.48 GB for chat). The bounds are
shrunk here so a few hundred kB show them; a probe counts the characters of every tokenizer call.
(scripts/bench_long_rows.py measures the real peak RSS per format.)"""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from helpers.tiny import recipe_file, word_tokenizer
from vp_accelerate.train.cli.commands import train_main
from vp_accelerate.train.data import formats, long_text

WORDS = ["alpha", "beta", "gamma", "delta", "мир", "世界", "paris", "france"]
LINES = [" ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12)) for i in range(300)]


def _sentencepiece(kind: str):
    """A SentencePiece-style tokenizer: `llama` (normalizer Prepend("▁") + Replace(" ", "▁"), BPE with byte
    fallback, no pre-tokenizer: Llama 2's tokenizer.json), `unigram` or `bpe` under a Metaspace pre-tokenizer
    that prepends "▁" to every input (`bpe` without splitting at spaces)."""
    specials = ["<unk>", "<s>", "</s>"]
    if kind == "llama":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)])
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=specials, unk_token="<unk>")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials)
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(LINES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


class _Global:
    """A tokenizer whose every token depends on the whole input (its length): no cut can be verified."""

    def __call__(self, s, **kw):
        return {"input_ids": [len(s) % 97] * (len(s) // 4)}


@pytest.mark.parametrize("kind", ["llama", "unigram", "bpe"])
def test_a_sentencepiece_style_tokenizer_encodes_a_long_text_in_pieces(monkeypatch, kind):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 3000)
    tok = _sentencepiece(kind)
    text = "\n".join(LINES * 2)  # 42k characters
    calls = []

    def counting(s, **kw):
        calls.append(len(s))
        return tok(s, **kw)

    for special in (False, True):
        calls.clear()
        assert long_text.encode_text(counting, text, special) == tok(text, add_special_tokens=special)["input_ids"]
        assert max(calls) <= 3000, kind


def test_a_text_no_cut_splits_is_an_invalid_row_past_the_one_call_bound(monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 3000)
    monkeypatch.setattr(long_text, "MAX_ONE_CALL_CHARS", 10_000)
    assert len(long_text.encode_text(_Global(), "a" * 9_000)) == 2250  # within the bound: one call, as before
    with pytest.raises(formats.FormatError, match=r"the text is 40,000 characters and no cut near character 3,000"):
        formats.encode_text(_Global(), "a" * 40_000, add_eos=False)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("tok"))


LONG = " ".join(["paris france"] * 5_000)  # 64,999 characters
FORMATS = {
    "chat": (
        {},
        lambda long: {"messages": [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": long}]},
        "'messages' holds 65,0",
    ),
    "prompt_completion": ({}, lambda long: {"prompt": "alpha beta ", "completion": long}, "'completion' holds 64,999"),
    "preference": (
        {},
        lambda long: {"prompt": "alpha ", "chosen": long, "rejected": "gamma delta"},
        "'chosen' holds 64,999",
    ),
    "unpaired_preference": (
        {"preference": {"loss_type": "kto"}},
        lambda long: {"prompt": "alpha ", "completion": long, "label": True},
        "'completion' holds 64,999",
    ),
}


def _short_row(fmt: str, i: int) -> dict:
    words = " ".join(WORDS[(i + k) % 4] for k in range(8))
    return {
        "chat": {"messages": [{"role": "user", "content": words}, {"role": "assistant", "content": words}]},
        "prompt_completion": {"prompt": words + " ", "completion": words},
        "preference": {"prompt": words + " ", "chosen": "alpha beta", "rejected": "gamma delta"},
        "unpaired_preference": {"prompt": words + " ", "completion": "alpha beta", "label": i % 2 == 0},
    }[fmt]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_row_too_long_for_one_call_is_one_invalid_row_in_every_format(tmp_path, tok_dir, capsys, monkeypatch, fmt):
    sections, long_row, says = FORMATS[fmt]
    monkeypatch.setattr(long_text, "MAX_ONE_CALL_CHARS", 50_000)
    rows = [_short_row(fmt, i) for i in range(40)] + [long_row(LONG)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = recipe_file(
        tmp_path / "r.yaml",
        tok_dir,
        [tmp_path / "d.jsonl"],
        data={"seq_len": 64, "format": fmt, "eval_holdout": 0},
        pipeline={"microbatches": 2},
        train={"global_batch": 2},
        eval={"batches": 0},
        logging={"output_dir": str(tmp_path / "out")},
        **sections,
    )
    longest = [0]
    real_call, real_template = PreTrainedTokenizerBase.__call__, PreTrainedTokenizerBase.apply_chat_template

    def call(self, text=None, *a, **kw):
        longest[0] = max(longest[0], formats.text_chars(text))
        return real_call(self, text, *a, **kw)

    def template(self, conversation, *a, **kw):
        longest[0] = max(longest[0], formats.text_chars(conversation))
        return real_template(self, conversation, *a, **kw)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", call)
    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", template)
    assert train_main([path, "--check", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl, line 41: " in err and says in err and "more than the 50,000 a" in err, err
    assert "Traceback" not in err and 0 < longest[0] < 50_000  # the long row reached no tokenizer call
