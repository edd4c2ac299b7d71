"""`--check` reads every row of every data file with the run's tokenizer and template: the report, every bad row
by file and 1-based line, what would stop the launch (every conversation dropped, no evaluation sequence, a hub
model that is not there offline, LoRA targets the model lacks) and `--show-example`.

Rows, bad-row positions and lengths are random per run, so a hard-coded message cannot pass by accident.
"""

import json
import random

import pytest
import yaml

from helpers.tiny import word_tokenizer
from vp_accelerate.train.cli.commands import train_main

RNG = random.Random()
WORDS = ["alpha", "beta", "gamma", "delta", "paris", "france", "capital", "hello", "world", "seventy", "four"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("tok"), WORDS, tail=" 74.\n")


def chat(rng, turns=1):
    msgs = []
    for _ in range(turns):
        msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))})
        msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))})
    return msgs


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def recipe(tmp_path, tok_dir, files, **sections):
    data = {
        "model": {"source": "llama-tiny"},
        "tokenizer": {"source": str(tok_dir)},
        "data": {"files": files, "seq_len": 64},
        "pipeline": {"microbatches": 2},
        "train": {"global_batch": 4},
        "eval": {"batches": 0},
        "logging": {"wandb_mode": "disabled", "output_dir": str(tmp_path / "out")},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path = tmp_path / f"r{RNG.randrange(10**6)}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run_check(capsys, path, *extra):
    code = train_main([path, "--check", "--world-size", "2", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


BAD_ROWS = [  # (row, what the report says about it)
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
        "turn 1 has unknown role 'bot'",
    ),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": "hello"}, "non-empty list of turns"),
    ({"prompt": "a"}, "has no 'messages'"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                {"role": "assistant", "content": "a"},
            ]
        },
        "content part of type 'image_url'",
    ),
]


def test_every_bad_row_is_listed_by_file_and_line(tmp_path, tok_dir, capsys):
    """Bad rows of each kind at random lines of two files (blank lines and a malformed line among them): --check
    names each by its file and 1-based line and exits 2; more than 20 are listed as the first 20 and a count."""
    rng = random.Random(RNG.random())
    expected = []
    files = []
    for name in ("a.jsonl", "b.jsonl"):
        lines = [json.dumps({"messages": chat(rng)}) for _ in range(30)]
        # anywhere after the first row, which data.format: auto reads to tell the format
        for row, what in rng.sample(BAD_ROWS, 3):
            lines.insert(rng.randrange(1, len(lines) + 1), json.dumps(row))
        lines.insert(rng.randrange(1, len(lines) + 1), '{"messages": [{"role": "user", "content": "x"}')  # cut short
        for _ in range(3):
            lines.insert(rng.randrange(1, len(lines) + 1), "")
        path = write_lines(tmp_path / name, lines)
        files.append(path)
        for n, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                expected.append((f"{path}, line {n}: not valid JSON", None))
                continue
            what = next((w for r, w in BAD_ROWS if r == row), None)
            if what is not None:
                expected.append((f"{path}, line {n}: ", what))
    code, _, err = run_check(capsys, recipe(tmp_path, tok_dir, files))
    assert code == 2, err
    assert f"data error: {len(expected)} invalid rows in data.files:" in err
    listed = [line.strip() for line in err.splitlines() if line.startswith("  ")]
    assert len(listed) == len(expected)
    for line, (where, what) in zip(listed, expected):
        assert line.startswith(where) and (what is None or what in line), (line, where, what)
    assert "set data.skip_invalid: true" in err

    many = [json.dumps({"messages": [{"role": "user", "content": "q"}]})] * (20 + rng.randrange(1, 9))
    good = [json.dumps({"messages": chat(rng)}) for _ in range(40)]
    path = write_lines(tmp_path / "many.jsonl", good + many)
    code, _, err = run_check(capsys, recipe(tmp_path, tok_dir, [path]))
    assert code == 2 and f"data error: {len(many)} invalid rows" in err
    assert sum(line.startswith("  ") and "line" in line for line in err.splitlines()) == 20
    assert f"... and {len(many) - 20} more" in err
    assert f"many.jsonl, line {len(good) + 1}: the conversation has no assistant turn" in err


def test_the_report_counts_rows_tokens_truncation_padding_and_steps(tmp_path, tok_dir, capsys):
    from vp_accelerate.train.cli.preflight import check_plan
    from vp_accelerate.train.data import prepare_data
    from vp_accelerate.train.recipe import load_recipe

    rng = random.Random(RNG.random())
    n = rng.randrange(60, 90)
    rows = [{"messages": chat(rng)} for _ in range(n)]
    long = rng.sample(range(n), 3)
    for i in long:  # longer than data.seq_len: truncated, and dropped (the answer lies past the cut)
        rows[i] = {
            "messages": [
                {"role": "user", "content": " ".join(["hello"] * 70)},
                {"role": "assistant", "content": "paris"},
            ]
        }
    path = write_lines(tmp_path / "c.jsonl", [json.dumps(r) for r in rows])
    r = recipe(tmp_path, tok_dir, [path], data={"eval_holdout": 0.0}, train={"steps": 10})
    code, out, err = run_check(capsys, r)
    assert code == 0, err
    found = {}
    check_plan(load_recipe(r), 2, found=found)  # the tokenizer as the run prepares it (chat template tokens)
    prepared = prepare_data(load_recipe(r).data, found["tokenizer"], found["plan"].rows_after)
    s = prepared.stats["train"]
    assert s.rows == n and s.bad == 0 and s.truncated == 3 and s.dropped == 3 and s.dropped_need > 64
    assert f"{path}']: {n} rows, {n} for training; {s.tokens:,} tokens, the longest row {s.longest}" in err
    assert (
        f"data.seq_len 64: 3 rows truncated ({s.cut_tokens:,} tokens cut); 3 dropped (every loss token past "
        f"data.seq_len; keeping them needs data.seq_len >= {s.dropped_need})"
    ) in err
    seqs = prepared.train
    padding = 1 - seqs.lengths.sum() / seqs.ids.size
    assert f"{len(seqs)} packed sequences, {padding * 100:.1f}% padding, {s.loss_tokens:,} tokens carry loss" in err
    per_epoch = len(seqs) // 4
    assert f"train.global_batch 4: {per_epoch} steps per epoch; train.steps 10 = {10 / per_epoch:.2f}" in err
    assert json.loads(out)["data"]["seq_len"] == 64


def test_every_conversation_dropped_and_no_eval_sequence_fail_at_check(tmp_path, tok_dir, capsys):
    rng = random.Random(RNG.random())
    question = " ".join(["hello"] * rng.randrange(70, 90))
    rows = [
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "paris"}]}
        for _ in range(20)
    ]
    path = write_lines(tmp_path / "long.jsonl", [json.dumps(r) for r in rows])
    code, _, err = run_check(capsys, recipe(tmp_path, tok_dir, [path]))
    assert code == 2
    assert "data error: data.seq_len: all 20 conversations of data.files" in err
    assert "the tokens that carry loss lie past data.seq_len=64 in every one (keeping one needs data.seq_len >= " in err
    assert "raise data.seq_len" in err

    short = write_lines(tmp_path / "short.jsonl", [json.dumps({"messages": chat(rng)}) for _ in range(40)])
    code, _, err = run_check(
        capsys, recipe(tmp_path, tok_dir, [short], data={"eval_holdout": 0.0}, eval={"batches": None})
    )
    assert code == 2 and "data error: data.eval_holdout: 0.0 of the training rows held out no sequence" in err
    assert "set data.eval_files, raise data.eval_holdout, or set eval.batches: 0" in err


def test_json_values_stay_as_written_and_content_parts_are_text(tmp_path, tok_dir):
    """One row with OpenAI-style content parts beside plain-string rows: every row keeps its own value ("74." stays
    the string "74.", not the number 74.0) and the parts are the text they hold."""
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import formats as sft
    from vp_accelerate.train.data import prepare_data
    from vp_accelerate.train.recipe import DataSection

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rng = random.Random(RNG.random())
    rows = [{"messages": chat(rng)} for _ in range(30)]
    k = rng.randrange(30)
    rows[k] = {"messages": [{"role": "user", "content": "how many?"}, {"role": "assistant", "content": "74."}]}
    parts = [{"type": "text", "text": "seventy"}, {"type": "text", "text": "four"}]
    rows[(k + 1) % 30] = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "4"}]}
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in rows])
    prepared = prepare_data(
        DataSection(files=[path], seq_len=256, eval_holdout=0.0, document_boundaries=True, packing=False), tok, len(tok)
    )
    ids = prepared.train.ids
    template = sft.chat_template_of(tok)[0]
    for i, row in (
        (k, rows[k]["messages"]),
        ((k + 1) % 30, [{"role": "user", "content": "seventy\nfour"}, {"role": "assistant", "content": "4"}]),
    ):
        _, want, _ = sft.encode_chat(tok, template, row)
        assert ids[i, : len(want)].tolist() == want
    assert "74." in tok.decode(ids[k]) and "74.0" not in tok.decode(ids[k])


TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m.tool_calls %}{% for c in "
    "m.tool_calls %}[call {{ c['function']['name'] }}]{% endfor %}{% endif %}</>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_tool_calls_are_kept_when_the_template_renders_them_and_refused_when_not(tmp_path, tok_dir, capsys):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import BadRowsError, prepare_data
    from vp_accelerate.train.recipe import DataSection

    rng = random.Random(RNG.random())
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "gamma", "arguments": "{}"}}],
    }
    tool_row = {
        "messages": [
            {"role": "user", "content": "hello"},
            call,
            {"role": "tool", "content": "paris", "name": "gamma", "tool_call_id": "1"},
            {"role": "assistant", "content": "france"},
        ]
    }
    rows = [{"messages": chat(rng)} for _ in range(30)]
    at = rng.randrange(30)
    rows.insert(at, tool_row)
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    tok = AutoTokenizer.from_pretrained(str(tok_dir))  # no template: ChatML, which renders no tool calls
    with pytest.raises(
        BadRowsError,
        match=rf"t.jsonl, line {at + 1}: turn 1 has tool_calls, which the ChatML default "
        rf"template does not render",
    ):
        prepare_data(DataSection(files=[path], seq_len=128, eval_holdout=0.0), tok, len(tok))

    tok.chat_template = TOOL_TEMPLATE
    prepared = prepare_data(DataSection(files=[path], seq_len=128, eval_holdout=0.0, packing=False), tok, len(tok))
    ids, labels = prepared.train.ids[at], prepared.train.labels[at]
    assert "<assistant>[call gamma]</>" in tok.decode(ids)
    assert "[call gamma]</>" in tok.decode([i for i, lab in zip(ids, labels) if lab != -100])  # the call is learnt
    assert prepared.stats["train"].dropped_keys == {"tool_call_id": 1}  # `name` is read by the template (c.name)

    tok.save_pretrained(str(tmp_path / "tool_tok"))
    code, _, err = run_check(capsys, recipe(tmp_path, tmp_path / "tool_tok", [path]))
    assert code == 0, err
    assert "message keys the chat template does not read, dropped from those rows: tool_call_id (1 row)" in err


def test_show_example_marks_exactly_the_tokens_that_carry_loss(tmp_path, tok_dir, capsys):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import prepare_data
    from vp_accelerate.train.data.check import show_example
    from vp_accelerate.train.recipe import DataSection

    rng = random.Random(RNG.random())
    path = write_lines(tmp_path / "s.jsonl", [json.dumps({"messages": chat(rng, 2)}) for _ in range(40)])
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    prepared = prepare_data(DataSection(files=[path], seq_len=128, eval_holdout=0.0), tok, len(tok))
    text = show_example(prepared, tok)
    ids, labels = prepared.train.ids[0], prepared.train.labels[0]
    body = text.split("\n", 1)[1]  # after the legend line
    marked = "".join(part.split("]]")[0] for part in body.split("[[")[1:])
    runs, t = [], 0
    while t < len(ids):  # the loss-carrying runs, decoded as the example decodes them
        if labels[t] != -100:
            e = t
            while e < len(ids) and labels[e] != -100:
                e += 1
            runs.append(tok.decode(ids[t:e].tolist()))
            t = e
        t += 1
    assert marked == "".join(runs) and marked
    assert text.count("--- conversation") == int((prepared.train.positions[0][: prepared.train.lengths[0]] == 0).sum())

    code, out, _ = run_check(capsys, recipe(tmp_path, tok_dir, [path]), "--show-example")
    assert code == 0 and "example: packed training sequence 0 of" in out and "[[" in out


def test_model_source_offline_and_lora_targets_fail_at_check(tmp_path, tok_dir, capsys, monkeypatch):
    rng = random.Random(RNG.random())
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"messages": chat(rng)}) for _ in range(40)])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = f"someone/model-{RNG.randrange(10**6)}"
    code, _, err = run_check(capsys, recipe(tmp_path, tok_dir, [path], model={"source": name}))
    assert code == 2
    assert (
        f"recipe error: model.source: {name!r} is not a preset, a local directory, nor a model in the local HF "
        f"cache, and the hub is offline (HF_HUB_OFFLINE=1)"
    ) in err

    pytest.importorskip("peft")
    good = rng.choice(["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    typo = good[:-1]
    code, _, err = run_check(
        capsys, recipe(tmp_path, tok_dir, [path], adapter={"type": "lora", "target_modules": ["gate_proj", typo]})
    )
    assert code == 2
    assert (
        f"adapter.target_modules: {typo!r} matches no module of the model's decoder layers; did you mean {good}? "
        f"(linear modules of a llama decoder layer: self_attn.q_proj, self_attn.k_proj,"
    ) in err
    code, _, err = run_check(
        capsys, recipe(tmp_path, tok_dir, [path], adapter={"type": "lora", "target_modules": ["gate_proj", good]})
    )
    assert code == 0, err
    full = {"up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}.get(good, f"self_attn.{good}")
    assert f"LoRA adapters on {', '.join(sorted(['mlp.gate_proj', full]))} of every decoder layer" in err
