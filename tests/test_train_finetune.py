"""Fine-tuning as TRL users write it: the batch per device (micro_batch_size, gradient_accumulation_steps) and its
derivation at `--check`, other tools' key names pointing at ours, layouts the world size cannot hold, recipe errors
with their file and line, an evaluation holdout that clean small data always passes, keep_best keeping the lowest
eval loss.

Batch sizes, losses and rows are drawn per run, so a hard-coded answer cannot pass by accident.
"""

import json
import os
import random
from types import SimpleNamespace

import pytest
import yaml

from helpers.tiny import WORDS, word_tokenizer
from vp_accelerate.train.cli.commands import train_main
from vp_accelerate.train.recipe import RecipeError, recipe_from_dict

RNG = random.Random()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    return str(path)


def test_micro_batch_size_and_accumulation_derive_the_global_batch(corpus):
    mbs, ga, dp = RNG.randint(1, 5), RNG.randint(1, 6), RNG.choice([1, 2, 4])
    r = recipe_from_dict(
        {
            "data": {"files": [corpus]},
            "train": {"micro_batch_size": mbs, "gradient_accumulation_steps": ga},
            "pipeline": {"dp_size": dp},
        }
    )
    assert (r.train.global_batch, r.pipeline.microbatches) == (mbs * ga * dp, ga)
    r = recipe_from_dict({"data": {"files": [corpus]}, "train": {"micro_batch_size": mbs}})
    assert r.train.global_batch == mbs * 8  # pipeline.microbatches' default
    assert recipe_from_dict({"data": {"files": [corpus]}}).train.global_batch == 16  # neither: the default
    with pytest.raises(RecipeError, match=r"train.micro_batch_size: set train.global_batch \(32\) or"):
        recipe_from_dict({"data": {"files": [corpus]}, "train": {"micro_batch_size": mbs, "global_batch": 32}})
    with pytest.raises(RecipeError, match="train.gradient_accumulation_steps: pipeline.schedule auto chooses"):
        recipe_from_dict(
            {
                "data": {"files": [corpus]},
                "train": {"gradient_accumulation_steps": ga},
                "pipeline": {"schedule": "auto"},
            }
        )
    unit = dp * ga
    bad = unit * RNG.randint(1, 4) + RNG.randint(1, unit - 1) if unit > 1 else None
    if bad is not None:
        with pytest.raises(RecipeError) as e:
            recipe_from_dict(
                {
                    "data": {"files": [corpus]},
                    "train": {"global_batch": bad},
                    "pipeline": {"dp_size": dp, "microbatches": ga},
                }
            )
        lower, upper = bad // unit * unit, (bad // unit + 1) * unit
        assert f"(a multiple of {unit}); use {lower} or {upper}, or set train.micro_batch_size" in str(e.value)


@pytest.mark.parametrize(
    "section, key, ours",
    [
        ("optimizer", "max_grad_norm", "optimizer.grad_clip"),
        ("train", "num_train_epochs", "train.epochs"),
        ("optimizer", "learning_rate", "optimizer.lr"),
        ("train", "warmup_ratio", "lr.warmup_ratio"),
        ("train", "per_device_train_batch_size", "train.micro_batch_size"),
        (None, "learning_rate", "optimizer.lr"),
    ],
)
def test_other_tools_key_names_point_at_ours(corpus, section, key, ours):
    data = {"data": {"files": [corpus]}}
    if section is None:
        data[key] = 1
    else:
        data[section] = {key: 1}
    path = f"{section}.{key}" if section else key
    with pytest.raises(RecipeError, match=rf"^{path}: unknown key; did you mean {ours}\?"):
        recipe_from_dict(data)
    with pytest.raises(RecipeError, match=rf"^{path}: unknown key; did you mean {ours}\?"):
        recipe_from_dict({"data": {"files": [corpus]}}, [f"{path}=1"])


def _recipe_file(tmp_path, tok_dir, files, **sections):
    data = {
        "model": {"source": "llama-tiny"},
        "tokenizer": {"source": str(tok_dir)},
        "data": {"files": files, "seq_len": 32},
        "eval": {"batches": 0},
        "logging": {"wandb_mode": "disabled", "output_dir": str(tmp_path / "out")},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path = tmp_path / f"r{RNG.randrange(10**6)}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_check_prints_the_batch_layout_and_the_layouts_a_world_size_holds(tmp_path, tok_dir, capsys):
    rows = tmp_path / "d.jsonl"
    rows.write_text("".join(json.dumps({"text": " ".join(RNG.choices(WORDS, k=30))}) + "\n" for _ in range(300)))
    mbs, ga = RNG.randint(1, 3), RNG.randint(2, 4)
    path = _recipe_file(
        tmp_path, tok_dir, [str(rows)], train={"micro_batch_size": mbs, "gradient_accumulation_steps": ga}
    )
    code = train_main(
        [path, "--check", "--world-size", "8", "--set", "pipeline.pp_size=2", "--set", "pipeline.dp_size=4"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert (
        f"batch: global_batch {mbs * ga * 4} = {mbs} sequences per microbatch (train.micro_batch_size) x {ga} "
        f"microbatches (train.gradient_accumulation_steps) x dp_size 4; 2 pipeline ranks x 4 replicas = 8 processes"
    ) in out.err
    assert json.loads(out.out)["train"]["global_batch"] == mbs * ga * 4

    code = train_main([path, "--check", "--world-size", "8"])  # 8 pipeline ranks: more than ga microbatches
    err = capsys.readouterr().err
    line = next(i for i, text in enumerate(open(path).read().splitlines(), 1) if "gradient_accumulation_steps" in text)
    assert code == 2 and f"train.gradient_accumulation_steps: num_microbatches ({ga}) must be >= num_ranks (8)" in err
    assert f"({path}, line {line})" in err

    code = train_main(
        [path, "--check", "--world-size", "6", "--set", "pipeline.pp_size=4", "--set", "pipeline.dp_size=2"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "pipeline.pp_size: pp_size=4 x dp_size=2 = 8, but 6 processes are launched; 6 processes hold " in err
    assert "pp_size=6 dp_size=1, pp_size=3 dp_size=2, pp_size=2 dp_size=3, pp_size=1 dp_size=6 (--set " in err


def test_recipe_errors_name_the_file_and_line(tmp_path, tok_dir, capsys):
    path = _recipe_file(tmp_path, tok_dir, [str(tmp_path / "nothing.jsonl")], optimizer={"lr": 0.1})
    lines = open(path).read().splitlines()
    code = train_main([path, "--check"])
    err = capsys.readouterr().err
    files_line = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("files:"))
    assert code == 2 and "recipe error: data.files: no file matches" in err and f"({path}, line {files_line})" in err
    with open(path, "a") as f:
        f.write("train:\n  seed: 1\n  learning_rate: 0.1\n")
    code = train_main([path, "--check"])
    err = capsys.readouterr().err
    assert code == 2 and "train.learning_rate: unknown key; did you mean optimizer.lr?" in err
    assert f"({path}, line {len(lines) + 3})" in err


def test_a_small_clean_file_keeps_an_evaluation_sequence_or_turns_evaluation_off(tmp_path, tok_dir):
    """300 short text rows: eval_holdout 0.02 holds out a few rows, fewer tokens than one packed sequence (the
    old code failed with 'held out no sequence'); the last rows are held out too. 3 rows: evaluation off."""
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import prepare_data
    from vp_accelerate.train.recipe import DataSection

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rng = random.Random(RNG.random())
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=3))}) + "\n" for _ in range(300)))
    cfg = DataSection(files=[str(path)], seq_len=64)
    prepared = prepare_data(cfg, tok, 400, cache=False)
    prepared.check_sizes(4, None)
    _, batches = prepared.iterators(0, 4, eval_batches=None)
    assert len(prepared.eval) >= 1 and len(batches) >= 1 and not prepared.eval_off()

    # four fixed rows (none held out by the hash) making exactly one sequence: half of them make none
    texts = ["alpha beta gamma", "paris france", "hello world capital", "delta delta"]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    total = sum(len(tok(t)["input_ids"]) + 1 for t in texts)  # + EOS
    prepared = prepare_data(DataSection(files=[str(path)], seq_len=total), tok, 400, cache=False)
    assert len(prepared.train) == 1
    assert len(prepared.eval) == 0 and prepared.eval_off()
    prepared.check_sizes(1, None)  # no error: evaluation is off, with a warning
    _, batches = prepared.iterators(0, 1, eval_batches=None)
    assert len(batches) == 0


def test_keep_best_keeps_the_lowest_eval_loss_and_min_delta_only_counts_patience(monkeypatch):
    """Losses that each beat the best, but by less than min_delta: the best follows them (the old code kept the
    first), while patience still counts them as evaluations without a gain."""
    from vp_accelerate.train.run import loop

    first = RNG.uniform(2.0, 3.0)
    delta = RNG.uniform(0.1, 0.2)
    losses = [first, first - delta / 3, first - 2 * delta / 3, first - 2 * delta]
    run = SimpleNamespace(
        recipe=SimpleNamespace(
            eval=SimpleNamespace(batches=None, every=1, prompts=[], min_delta=delta, patience=None), preference=None
        ),
        end_step=len(losses),
        best=dict(loop.NEW_BEST),
        tracker=SimpleNamespace(log=lambda *a: None),
        accelerator=SimpleNamespace(is_main_process=False),
        pipe=None,
        eval_batches=None,
    )
    seen = iter(losses)
    monkeypatch.setattr(loop, "evaluate", lambda pipe, batches, preference=None, rewards=None: next(seen))
    state = loop.LoopState()
    stale = []
    for step in range(1, len(losses) + 1):
        loop.maybe_eval(run, state, step)
        stale.append(run.best["stale"])
        assert run.best["loss"] == min(losses[:step]) and run.best["step"] == step
    assert stale == [0, 1, 2, 0]


def _prepared(tok_dir, cfg):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import prepare_data

    return prepare_data(cfg, AutoTokenizer.from_pretrained(str(tok_dir)), 400, cache=False)


def _rows_and_masks(prepared):
    """(ids, targets) of every packed document, in order (document boundaries keep them apart)."""
    seqs = prepared.train
    out = []
    for i in range(len(seqs)):
        ids, labels, pos = seqs.ids[i], seqs.labels[i], seqs.positions[i]
        starts = [k for k in range(len(pos)) if pos[k] == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            if (labels[a:b] != -100).any():
                out.append((ids[a:b].tolist(), labels[a:b].tolist()))
    return out


def _chat_rows(rng, n):
    rows = []
    for _ in range(n):
        turns = [{"role": "system", "content": "be brief"}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 2)):
            turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 5)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))})
        rows.append(turns)
    return rows


def test_sharegpt_rows_are_chat_and_an_unknown_format_names_its_file(tmp_path, tok_dir, capsys):
    from vp_accelerate.train.data import DataError
    from vp_accelerate.train.recipe import DataSection

    rng = random.Random(RNG.random())
    convs = _chat_rows(rng, 40)
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    (tmp_path / "s.jsonl").write_text(
        "".join(
            json.dumps({"conversations": [{"from": speaker[t["role"]], "value": t["content"]} for t in c]}) + "\n"
            for c in convs
        )
    )
    want = _prepared(tok_dir, DataSection(files=[str(tmp_path / "m.jsonl")], seq_len=256, eval_holdout=0.0))
    got = _prepared(tok_dir, DataSection(files=[str(tmp_path / "s.jsonl")], seq_len=256, eval_holdout=0.0))
    assert got.fmt == "chat" and "'conversations' (ShareGPT turns)" in got.how
    assert _rows_and_masks(got) == _rows_and_masks(want) and len(_rows_and_masks(got)) == 40

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [{"from": "bot", "value": "x"}, {"from": "gpt", "value": "y"}]}) + "\n")
    with pytest.raises(DataError, match=rf"{bad}, line 1: turn 0 has unknown ShareGPT speaker 'bot'"):
        _prepared(tok_dir, DataSection(files=[str(bad)], seq_len=256, eval_holdout=0.0))

    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    code = train_main([_recipe_file(tmp_path, tok_dir, [str(odd)]), "--check"])
    err = capsys.readouterr().err
    assert code == 2 and "data.format: column 'text' not in the data" in err and f"(in {odd})" in err


def test_system_prompt_goes_first_where_a_conversation_has_none(tmp_path, tok_dir):
    from vp_accelerate.train.recipe import DataSection

    rng = random.Random(RNG.random())
    system = " ".join(rng.choices(WORDS, k=4))
    convs = _chat_rows(rng, 30)
    given = [c if c[0]["role"] == "system" else [{"role": "system", "content": system}] + c for c in convs]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    (tmp_path / "given.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in given))
    want = _prepared(tok_dir, DataSection(files=[str(tmp_path / "given.jsonl")], seq_len=256, eval_holdout=0.0))
    got = _prepared(
        tok_dir, DataSection(files=[str(tmp_path / "raw.jsonl")], seq_len=256, eval_holdout=0.0, system_prompt=system)
    )
    assert _rows_and_masks(got) == _rows_and_masks(want)


def test_response_template_puts_loss_after_it_only(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import DataError
    from vp_accelerate.train.recipe import DataSection

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rng = random.Random(RNG.random())
    answers = [" ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(20)]
    texts = [f"{' '.join(rng.choices(WORDS, k=rng.randint(2, 6)))} ### Answer:{a}" for a in answers]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = DataSection(
        files=[str(path)], seq_len=256, eval_holdout=0.0, response_template=" ### Answer:", document_boundaries=True
    )
    got = _rows_and_masks(_prepared(tok_dir, cfg))
    assert len(got) == 20
    for (ids, labels), text, answer in zip(got, texts, answers):
        assert tok.decode(ids) == text + tok.eos_token
        assert tok.decode([t for t in labels if t != -100]) == answer + tok.eos_token

    path.write_text(json.dumps({"text": "no template here"}) + "\n" + path.read_text())
    with pytest.raises(DataError, match=rf"{path}, line 1: the text has no data.response_template ' ### Answer:'"):
        _prepared(tok_dir, cfg)


def test_a_save_to_disk_folder_is_a_dataset(tmp_path, tok_dir):
    from datasets import Dataset, DatasetDict

    from vp_accelerate.train.data import DataError
    from vp_accelerate.train.recipe import DataSection

    rng = random.Random(RNG.random())
    convs = _chat_rows(rng, 30)
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    want = _prepared(tok_dir, DataSection(files=[str(tmp_path / "m.jsonl")], seq_len=256, eval_holdout=0.0))
    Dataset.from_list([{"messages": c} for c in convs]).save_to_disk(str(tmp_path / "ds"))
    DatasetDict({"train": Dataset.from_list([{"messages": c} for c in convs])}).save_to_disk(str(tmp_path / "dd"))
    for folder in ("ds", "dd"):
        got = _prepared(tok_dir, DataSection(hub_id=str(tmp_path / folder), seq_len=256, eval_holdout=0.0))
        assert got.fmt == "chat" and _rows_and_masks(got) == _rows_and_masks(want)
    with pytest.raises(DataError, match=r"data.hub_split: .*dd holds the splits \['train'\], not 'test'"):
        _prepared(tok_dir, DataSection(hub_id=str(tmp_path / "dd"), hub_split="test", seq_len=256, eval_holdout=0.0))


def test_push_to_hub_uploads_the_export_and_refuses_offline(tmp_path, tok_dir, capsys, monkeypatch):
    """The final export and the adapter go to the hub through HfApi (a local stand-in records the calls); under
    HF_HUB_OFFLINE=1 the recipe is refused before launch, naming the key."""
    from huggingface_hub import HfApi

    from vp_accelerate.train.persist.hub_push import push_export

    repo = f"someone/model-{RNG.randrange(10**6)}"
    rows = tmp_path / "d.jsonl"
    rows.write_text("".join(json.dumps({"text": " ".join(RNG.choices(WORDS, k=30))}) + "\n" for _ in range(50)))
    path = _recipe_file(tmp_path, tok_dir, [str(rows)], checkpoint={"push_to_hub": repo})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert train_main([path, "--check"]) == 2
    err = capsys.readouterr().err
    assert "recipe error: checkpoint.push_to_hub: HF_HUB_OFFLINE=1 is set, so the final export cannot be" in err

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))

    def upload(self, **kw):
        calls.append(("upload", kw["repo_id"], kw.get("path_in_repo"), sorted(os.listdir(kw["folder_path"]))))
        return f"https://hub.example/{kw['repo_id']}/commit/{len(calls)}"

    monkeypatch.setattr(HfApi, "upload_folder", upload)
    hf, adapter = tmp_path / "hf", tmp_path / "adapter"
    for d, names in ((hf, ["config.json", "model.safetensors"]), (adapter, ["adapter_config.json"])):
        d.mkdir()
        for name in names:
            (d / name).write_text("{}")
    with pytest.raises(RecipeError, match="HF_HUB_OFFLINE=1 is set, so nothing is pushed"):
        push_export(repo, str(hf), str(adapter), private=True)
    assert calls == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # (unset, huggingface_hub keeps the value it read at import)
    urls = push_export(repo, str(hf), str(adapter), private=True)
    assert calls == [
        ("create", repo, {"private": True, "exist_ok": True}),
        ("upload", repo, None, ["config.json", "model.safetensors"]),
        ("upload", repo, "adapter", ["adapter_config.json"]),
    ]
    assert urls == [f"https://hub.example/{repo}/commit/2", f"https://hub.example/{repo}/commit/3"]
