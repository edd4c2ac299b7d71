"""SFT data: formats detected from columns, loss only where the model answers, bad rows named, packing
with document boundaries (positions restart, documents never split, no cross-document targets)."""

import json

import numpy as np
import pytest
import torch

from helpers.tiny import WORDS, word_tokenizer
from vp_accelerate.train.data import DataError, build_data, pack_documents
from vp_accelerate.train.data import formats as sft
from vp_accelerate.train.recipe import DataSection

# A Llama-3-like template (BOS + headers), and one that is not prefix-stable (the last turn renders
# differently) but marks assistant turns with {% generation %} for HF's assistant mask.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|sep|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% generation %}{{ m['content'] }}"
    "{% if loop.last %} END{% endif %}{% endgeneration %}\n{% else %}U: {{ m['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(word_tokenizer(tmp_path_factory.mktemp("tok"))))


def _chat(rng, turns=2):
    msgs = [{"role": "system", "content": "answer briefly"}] if rng.random() < 0.5 else []
    for _ in range(turns):
        msgs.append({"role": "user", "content": " ".join(rng.choice(WORDS, size=rng.integers(2, 6)))})
        msgs.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, size=rng.integers(1, 5)))})
    return msgs


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _targets(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("template", [None, HEADER_TEMPLATE, GENERATION_TEMPLATE])
def test_chat_loss_covers_exactly_the_assistant_turns(tok, template):
    tpl = template or sft.chat_template_of(tok)[0]
    assert sft.chat_template_of(tok)[1]  # the BPE tokenizer has no template: ChatML is the default
    rng = np.random.default_rng(1)
    for _ in range(10):
        msgs = _chat(rng, turns=int(rng.integers(1, 4)))
        text, ids, mask = sft.encode_chat(tok, tpl, msgs)
        assert ids == tok(text, add_special_tokens=False)["input_ids"]  # exactly what the template renders
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        got = _targets(tok, ids, mask)
        if template is None:
            assert got == "".join(f"{a}<|im_end|>\n" for a in answers)
        elif template is HEADER_TEMPLATE:
            assert got == "".join(f"{a}<|end|>" for a in answers)
        else:  # HF's {% generation %} mask: the content (a token may bring the space before it), + " END" last
            assert "".join(got.replace(" END", "").split()) == "".join("".join(answers).split())
            if len(answers) > 1:  # the last turn renders differently: prefix rendering fails, HF's mask is used
                assert sft.assistant_spans(tok, tpl, sft._clean(msgs)) is None
        _, _, all_mask = sft.encode_chat(tok, tpl, msgs, train_on_inputs=True)
        assert all(all_mask)


def test_prompt_completion_loss_on_completion_and_eos(tok):
    text, ids, mask = sft.encode_prompt_completion(tok, "capital of france? ", "paris", add_eos=True)
    assert _targets(tok, ids, mask) == "paris" + tok.eos_token and mask[0] == 0
    assert all(sft.encode_prompt_completion(tok, "a ", "b", True, train_on_inputs=True)[2])


def test_format_detected_from_columns():
    kw = dict(
        declared="auto",
        text_field="text",
        messages_field="messages",
        prompt_field="prompt",
        completion_field="completion",
    )
    assert sft.detect_format(["messages", "id"], **kw)[0] == "chat"
    assert sft.detect_format(["prompt", "completion"], **kw)[0] == "prompt_completion"
    assert sft.detect_format(["text"], **kw)[0] == "text"
    assert sft.detect_format(["x"], **{**kw, "declared": "chat"})[0] == "chat"
    with pytest.raises(sft.FormatError, match=r"column 'text' not in the data \(columns: \['x'\]\)"):
        sft.detect_format(["x"], **kw)


def test_chat_batches_mask_labels_and_restart_positions(tok, tmp_path):
    rng = np.random.default_rng(2)
    path = _write(tmp_path / "chat.jsonl", [{"messages": _chat(rng)} for _ in range(120)])
    cfg = DataSection(files=[path], seq_len=192, eval_holdout=0.1)
    train, evals = build_data(cfg, tok, len(tok), 0, 8, eval_batches=1)
    b = next(train)
    assert set(b) == {"input_ids", "labels", "position_ids"} and set(evals[0]) == set(b)
    ids, labels, pos = b["input_ids"], b["labels"], b["position_ids"]
    starts = pos == 0
    assert (labels[starts] == -100).all()  # no target across a document boundary
    assert ((labels == -100) | (labels == ids)).all() and (labels != -100).any()
    assert (labels == -100).sum() > (labels != -100).sum()  # prompts and headers carry no loss
    for row_ids, row_pos, row_labels in zip(ids, pos, labels):  # every piece is a whole rendered conversation
        edges = torch.nonzero(row_pos == 0).flatten().tolist() + [len(row_pos)]
        for a, e in zip(edges[:-1], edges[1:]):
            text = tok.decode(row_ids[a:e])
            if (row_labels[a:e] != -100).any():
                assert text.startswith("<|im_start|>") and text.endswith("<|im_end|>\n"), text
    unpacked = next(build_data(DataSection(files=[path], seq_len=64, packing=False), tok, len(tok), 0, 8)[0])
    assert "position_ids" not in unpacked and ((unpacked["labels"] != -100) <= (unpacked["attention_mask"] == 1)).all()


def test_text_keeps_classic_packing_unless_boundaries_are_asked(tok, tmp_path):
    rng = np.random.default_rng(3)
    path = _write(tmp_path / "text.jsonl", [{"text": " ".join(rng.choice(WORDS, size=30))} for _ in range(60)])
    classic = next(build_data(DataSection(files=[path], seq_len=16), tok, len(tok), 0, 4)[0])
    assert "position_ids" not in classic and torch.equal(classic["labels"], classic["input_ids"])
    kept = next(build_data(DataSection(files=[path], seq_len=16, document_boundaries=True), tok, len(tok), 0, 4)[0])
    assert "position_ids" in kept and (kept["labels"][kept["position_ids"] == 0] == -100).all()


def test_pack_documents_places_whole_documents_and_pads():
    ids, labels, pos, dropped = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]], None, 5, 0, split_long=True)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 0, 0, 0, 0]]
    assert pos.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]
    assert labels.tolist() == [[-100, 2, 3, -100, 5], [-100, 7, 8, 9, 10], [-100] * 5] and dropped == 0
    masks = [[0, 1, 1], [0, 0, 0, 0, 0, 0, 1]]  # the second document's only target is cut off
    ids, labels, pos, dropped = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], masks, 5, 0, split_long=False)
    assert ids.tolist() == [[1, 2, 3, 0, 0]] and labels.tolist() == [[-100, 2, 3, -100, -100]] and dropped == 1


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "a", "completion": "b"}, r"has no 'messages'"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}, r"unknown role 'bot'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, r"no assistant turn"),
        ({"messages": "hello"}, r"non-empty list of turns"),
    ],
)
def test_bad_chat_rows_name_file_and_row(tok, tmp_path, row, message):
    rng = np.random.default_rng(4)
    good = [{"messages": _chat(rng)} for _ in range(40)]
    path = _write(tmp_path / "chat.jsonl", good[:7] + [row] + good[7:])
    cfg = DataSection(files=[path], format="chat", seq_len=192, eval_holdout=0.0)
    with pytest.raises(DataError, match=rf"data.files: .*chat.jsonl, line 8: .*{message}.*data.skip_invalid"):
        build_data(cfg, tok, len(tok), 0, 4)
    cfg.skip_invalid = True
    train, _ = build_data(cfg, tok, len(tok), 0, 4)
    clean, _ = build_data(
        DataSection(files=[_write(tmp_path / "clean.jsonl", good)], seq_len=192, eval_holdout=0.0), tok, len(tok), 0, 4
    )
    assert np.array_equal(train.seqs.ids, clean.seqs.ids)  # the bad row is gone, nothing else


def test_bad_rows_in_the_second_file_and_prompt_completion(tok, tmp_path):
    first = _write(tmp_path / "a.jsonl", [{"prompt": "p ", "completion": "c"}] * 5)
    second = _write(tmp_path / "b.jsonl", [{"prompt": "p ", "completion": "c"}] * 2 + [{"prompt": "p"}])
    cfg = DataSection(files=[first, second], seq_len=8, eval_holdout=0.0)
    with pytest.raises(DataError, match=r"b.jsonl, line 3: has no 'completion'"):
        build_data(cfg, tok, len(tok), 0, 2)
    empty = _write(tmp_path / "c.jsonl", [{"prompt": "p ", "completion": ""}] * 3)
    with pytest.raises(DataError, match=r"3 invalid rows; the first: .*c.jsonl, line 1: 'completion' is empty"):
        build_data(DataSection(files=[empty], seq_len=8, eval_holdout=0.0), tok, len(tok), 0, 2)


def test_streaming_refuses_sft_formats(tok, tmp_path):
    path = _write(tmp_path / "chat.jsonl", [{"messages": _chat(np.random.default_rng(5))}] * 20)
    with pytest.raises(DataError, match="data.streaming"):
        build_data(DataSection(files=[path], seq_len=16, streaming=True), tok, len(tok), 0, 2)


def test_check_states_the_format_and_the_template(tok, tmp_path, capsys):
    import yaml

    from vp_accelerate.train.cli.commands import train_main

    tok_dir = tmp_path / "tok"
    tok.save_pretrained(str(tok_dir))
    rng = np.random.default_rng(6)
    chat = _write(tmp_path / "chat.jsonl", [{"messages": _chat(rng)} for _ in range(12)])
    pc = _write(tmp_path / "pc.jsonl", [{"prompt": "a ", "completion": "b"}] * 64)
    for files, expected in (
        (
            [chat],
            "data format chat (detected from column 'messages'); chat template: ChatML "
            "default (the tokenizer has none); loss on assistant turns only; packed "
            "keeping document boundaries",
        ),
        (
            [pc],
            "data format prompt_completion (detected from columns 'prompt' and 'completion'); loss on completions only",
        ),
    ):
        path = tmp_path / "r.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "model": {"source": "llama-tiny"},
                    "tokenizer": {"source": str(tok_dir)},
                    "data": {"files": files, "seq_len": 64},
                    "pipeline": {"microbatches": 2},
                    "train": {"global_batch": 2},
                    "eval": {"batches": 0},
                }
            )
        )
        assert train_main([str(path), "--check", "--world-size", "2"]) == 0
        assert expected in capsys.readouterr().err


def test_demo_chat_set_is_valid_and_deterministic(tmp_path):
    pytest.importorskip("babel")
    from vp_accelerate.demo.chat import make_demo_chat

    counts = make_demo_chat(str(tmp_path / "a"), conversations=200, seed=3)
    make_demo_chat(str(tmp_path / "b"), conversations=200, seed=3)
    assert counts == {"train": 190, "eval": 10}
    text = (tmp_path / "a" / "train.jsonl").read_text()
    assert text == (tmp_path / "b" / "train.jsonl").read_text()
    for line in text.splitlines():
        messages = json.loads(line)["messages"]
        sft.check_messages(messages)  # known roles, an assistant turn, string contents
        assert all(m["content"] for m in messages)
