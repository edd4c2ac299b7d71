"""DPO in the trainer: preference rows in TRL's shapes become pairs of sequences with loss on the completions
only, kept together through batching (and the reference log-probabilities with them); bad rows and recipe
mistakes are named; a 2-rank run on a few repeated pairs learns (loss from log 2 down, rewards logged for
training and evaluation, the reference saved for a resume)."""

import json
import math

import numpy as np
import pytest
import torch

from helpers.launch import run_env, train_ranks
from helpers.tiny import TINY_MODEL, WORDS, recipe_file, word_tokenizer
from vp_accelerate.train.data import DataError, chat_rows, formats, prepare_data
from vp_accelerate.train.data.preference import PairSequences, encode_pair
from vp_accelerate.train.recipe import DataSection, RecipeError, recipe_from_dict
from vp_accelerate.train.tokens.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(f"bpe:{tok_dir}")


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _encode(tok, row, **cfg):
    template = formats.chat_template_of(tok)[0]
    return encode_pair(tok, template, chat_rows.template_keys(template), row, DataSection(format="preference", **cfg))


def _targets(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_standard_pair_has_loss_on_each_completion_and_eos(tok):
    c_ids, c_mask, r_ids, r_mask = _encode(tok, {"prompt": "hello world", "chosen": " paris", "rejected": " gamma"})
    eos = tok.eos_token_id
    assert c_ids[-1] == eos and r_ids[-1] == eos
    assert _targets(tok, c_ids[:-1], c_mask[:-1]).strip() == "paris"
    assert _targets(tok, r_ids[:-1], r_mask[:-1]).strip() == "gamma"
    prompt = tok("hello world", add_special_tokens=False)["input_ids"]
    assert c_ids[: len(prompt)] == prompt == r_ids[: len(prompt)] and not any(c_mask[: len(prompt)])


def test_conversational_pair_masks_the_prompts_own_answers(tok):
    prompt = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "capital france"},
    ]
    row = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "paris"}],
        "rejected": [{"role": "assistant", "content": "delta"}],
    }
    c_ids, c_mask, r_ids, r_mask = _encode(tok, row)
    assert "paris" in _targets(tok, c_ids, c_mask) and "world" not in _targets(tok, c_ids, c_mask)
    assert "delta" in _targets(tok, r_ids, r_mask) and "world" not in _targets(tok, r_ids, r_mask)
    # TRL's implicit prompt: whole conversations sharing their first turns give the same pair
    implicit = {"chosen": prompt + row["chosen"], "rejected": prompt + row["rejected"]}
    assert _encode(tok, implicit) == (c_ids, c_mask, r_ids, r_mask)


def test_pairs_stay_together_with_their_reference_logps(tok, tmp_path):
    rows = [{"prompt": f"hello {w}", "chosen": f" {w} paris", "rejected": " gamma"} for w in WORDS]
    cfg = DataSection(files=[_write(tmp_path / "p.jsonl", rows)], format="preference", seq_len=16, eval_holdout=0)
    data = prepare_data(cfg, tok, len(tok))
    seqs = data.train
    assert isinstance(seqs, PairSequences) and len(seqs) == len(WORDS) and len(seqs.ids) == 2 * len(WORDS)
    seqs.ref_logps = np.arange(2 * len(seqs), dtype=np.float64)
    b = seqs.batch(np.array([3, 1]))
    assert b["input_ids"].shape == (4, 16)
    assert b["ref_logps"].tolist() == [6.0, 7.0, 2.0, 3.0]  # chosen, rejected of pair 3, then of pair 1
    assert "gamma" in tok.decode([t for t in b["labels"][1].tolist() if t >= 0])
    assert WORDS[3] in tok.decode([t for t in b["labels"][0].tolist() if t >= 0])


def test_check_reports_pairs_and_shows_one(tok, tmp_path):
    from vp_accelerate.train.data.check import data_report, show_example

    rows = [{"prompt": f"hello {w}", "chosen": f" {w} paris", "rejected": " gamma"} for w in WORDS]
    rows.append({"prompt": "hello " * 20, "chosen": " paris", "rejected": " gamma"})  # too long: dropped
    f = _write(tmp_path / "p.jsonl", rows)
    recipe = recipe_from_dict(
        {"data": {"files": [f], "format": "preference", "seq_len": 16, "eval_holdout": 0}, "train": {"global_batch": 4}}
        | {"pipeline": {"microbatches": 2}, "eval": {"batches": 0}}
    )
    lines, prepared, _ = data_report(recipe, tok, len(tok))
    text = "\n".join(lines)
    assert f"{len(rows)} rows" in text and f"{len(WORDS)} pairs for training" in text, text
    assert "1 pair dropped" in text and f"{2 * len(WORDS)} sequences (2 a pair)" in text, text
    assert "[[" in show_example(prepared, tok)


def test_a_bad_row_is_named_with_its_line(tok, tmp_path):
    rows = [{"prompt": "hello", "chosen": " paris", "rejected": " gamma"}, {"prompt": "hello", "chosen": " paris"}]
    cfg = DataSection(files=[_write(tmp_path / "p.jsonl", rows)], format="preference", seq_len=16)
    with pytest.raises(DataError, match=r"p\.jsonl, line 2: .*'rejected'"):
        prepare_data(cfg, tok, len(tok))


def test_recipe_refuses_label_smoothing_with_preference(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(RecipeError, match="pipeline.label_smoothing"):  # recipe_from_dict checks the recipe
        recipe_from_dict({"data": {"files": [f], "format": "preference"}, "pipeline": {"label_smoothing": 0.1}})


def test_dpo_run_learns_repeated_pairs_and_logs_rewards(tok_dir, tmp_path):
    _dpo_run(tok_dir, tmp_path, {"beta": 0.5})


@pytest.mark.slow
def test_a_reference_free_run_skips_the_reference_pass(tok_dir, tmp_path):
    """ORPO ([sft, orpo]) through the trainer: no reference pass (no ref_logps.pt), and it learns the pairs."""
    _dpo_run(tok_dir, tmp_path, {"beta": 0.5, "loss_type": ["sft", "orpo"]})


def _dpo_run(tok_dir, tmp_path, preference):
    reference = preference.get("loss_type", "sigmoid") == "sigmoid"
    rng = np.random.default_rng(1)
    rows = [
        {
            "prompt": " ".join(rng.choice(WORDS, size=3)),
            "chosen": " " + " ".join(rng.choice(WORDS, size=2)),
            "rejected": " " + " ".join(rng.choice(WORDS, size=3)),
        }
        for _ in range(8)
    ]
    recipe_file(
        tmp_path / "r.yaml",
        tok_dir,
        [_write(tmp_path / "train.jsonl", rows)],
        model=TINY_MODEL,
        data={"eval_files": [_write(tmp_path / "eval.jsonl", rows[:4])], "format": "preference", "seq_len": 16},
        preference=preference,
        pipeline={"schedule": "1f1b", "method": "vocab-1", "microbatches": 2},
        optimizer={"lr": 3e-3, "weight_decay": 0.0},
        train={"steps": 12, "global_batch": 4},
        eval={"every": 12, "batches": 1},
        checkpoint={"every": 0, "export_hf": False},
        logging={"output_dir": str(tmp_path / "run"), "timeline_image": False},
    )
    out = train_ranks([str(tmp_path / "r.yaml")], tmp_path, run_env(tmp_path / "ds_cache"), timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if "train/loss" in r]
    if not reference:  # ORPOTrainer's metrics, not DPOTrainer's
        assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(train[0]) and "num_tokens" not in train[0]
        assert not (tmp_path / "run" / "ref_logps.pt").exists()
        assert train[-1]["train/loss"] < train[0]["train/loss"] and train[-1]["rewards/accuracies"] > 0.5
        return
    assert train[0]["train/loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy is the reference at step 1
    assert train[0]["num_tokens"] == train[0]["train/tokens"] and 0 < train[0]["entropy"]  # DPOTrainer's too
    assert 0 <= train[0]["mean_token_accuracy"] <= 1
    assert train[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-9)
    assert train[-1]["train/loss"] < 0.6 and train[-1]["rewards/accuracies"] > 0.5
    final = [r for r in rows if "eval/loss" in r][-1]
    assert final["eval/loss"] < math.log(2) and final["eval/rewards/margins"] > 0
    assert (tmp_path / "run" / "ref_logps.pt").exists()


def test_a_resumed_full_fine_tune_reads_its_reference(tmp_path):
    """The reference of a resumed full fine-tune is the one its start computed (the weights have moved since);
    without the file the run stops, naming it."""
    from types import SimpleNamespace

    import torch

    from vp_accelerate.train.run import reference_logps

    seqs = PairSequences(np.zeros((4, 8), dtype=np.int64), labels=np.zeros((4, 8), dtype=np.int64))
    recipe = recipe_from_dict({"data": {"files": [_write(tmp_path / "p.jsonl", [{}])], "format": "preference"}})
    recipe.logging.output_dir = str(tmp_path / "run")
    run = SimpleNamespace(data=SimpleNamespace(train=seqs, eval=None), recipe=recipe, pipe=None)
    with pytest.raises(RecipeError, match="ref_logps.pt is missing"):
        reference_logps.attach(run, resuming=True)
    (tmp_path / "run").mkdir()
    torch.save({"train": torch.arange(4, dtype=torch.float64)}, tmp_path / "run" / "ref_logps.pt")
    reference_logps.attach(run, resuming=True)  # no pipeline pass: read back
    assert seqs.ref_logps.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_demo_pairs_are_deterministic_and_reject_another_answer(tmp_path):
    pytest.importorskip("babel")
    pytest.importorskip("faker")
    from vp_accelerate.demo.chat import make_demo_preference

    counts = make_demo_preference(str(tmp_path / "a"), conversations=60, seed=2)
    make_demo_preference(str(tmp_path / "b"), conversations=60, seed=2)
    assert counts == {"train": 57, "eval": 3}
    text = (tmp_path / "a" / "train.jsonl").read_text()
    assert text == (tmp_path / "b" / "train.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert all(r["prompt"][-1]["role"] == "user" and r["chosen"][0]["role"] == "assistant" for r in rows)
    assert sum(r["chosen"] != r["rejected"] for r in rows) >= 0.9 * len(rows)  # two conversations may answer alike


def test_check_and_launch_agree_on_evaluation_pairs(tok, tmp_path):
    """--check says what the launch does, in pairs: held-out pairs short of a global batch go back to training
    and evaluation is off, in both (the report said 1 batch, the launch stopped; then the pairs were held out and
    unused); an evaluation file short of one is refused by both."""
    from vp_accelerate.train.data.check import data_report
    from vp_accelerate.train.data.preference import prepare_pairs
    from vp_accelerate.train.data.prepare import holdout_every

    rows = [{"prompt": f"hello {w}", "chosen": f" {w} paris", "rejected": " gamma"} for w in WORDS[:6]] * 2
    f = _write(tmp_path / "p.jsonl", rows)
    base = {"train": {"global_batch": 4}, "pipeline": {"microbatches": 2}}
    recipe = recipe_from_dict(
        {"data": {"files": [f], "format": "preference", "seq_len": 16, "eval_holdout": 0.25}} | base
    )
    held = len(prepare_pairs(recipe.data, tok, len(tok), holdout_every(recipe.data))[1])  # what it holds out
    assert 0 < held < 4
    lines, prepared, _ = data_report(recipe, tok, len(tok))
    assert len(prepared.train) == 12 and len(prepared.eval) == 0 and prepared.returned == held
    assert "12 pairs for training;" in lines[0] and "held out" not in lines[0], lines
    noun = "pair" if held == 1 else "pairs"
    assert f"the {held} held-out preference {noun} fill no global batch of 4 pairs, so" in lines[-1], lines
    assert "train instead (none is held out) and evaluation is off" in lines[-1].replace("it trains", "train")
    launch = prepare_data(recipe.data, tok, len(tok))
    launch.check_sizes(4, None)  # the launch: the same pairs train, no error, no evaluation batch
    train, evals = launch.iterators(0, 4, eval_batches=None)
    assert len(launch.train) == 12 and len(evals) == 0
    assert launch.train.ids.tolist() == prepared.train.ids.tolist()
    one = _write(tmp_path / "e.jsonl", rows[:1])
    recipe = recipe_from_dict(
        {"data": {"files": [f], "eval_files": [one], "format": "preference", "seq_len": 16}} | base
    )
    with pytest.raises(DataError, match="evaluation data has 1 preference pair, fewer than one global batch"):
        data_report(recipe, tok, len(tok))
    with pytest.raises(DataError, match="evaluation data has 1 preference pair, fewer than one global batch"):
        prepare_data(recipe.data, tok, len(tok)).iterators(0, 4, eval_batches=None)
    recipe = recipe_from_dict({"data": {"files": [f], "eval_files": [f], "format": "preference", "seq_len": 16}} | base)
    lines, _, _ = data_report(recipe, tok, len(tok))
    assert "12 pairs" in lines[-1] and "3 batches of train.global_batch (4 pairs)" in lines[-1], lines


def test_a_dataset_dicts_test_split_is_the_evaluation_data(tok, tmp_path):
    """A save_to_disk DatasetDict and a hub-style folder (data/train-*, data/test-*): their test split is the
    evaluation data (nothing held out of train), for pairs and for SFT rows."""
    from datasets import Dataset, DatasetDict

    rows = [{"prompt": f"hello {w}", "chosen": f" {w} paris", "rejected": " gamma"} for w in WORDS]
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:4])}).save_to_disk(tmp_path / "dd")
    (tmp_path / "hub" / "data").mkdir(parents=True)
    Dataset.from_list(rows).to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    Dataset.from_list(rows[:4]).to_parquet(str(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet"))
    for folder in ("dd", "hub"):
        data = prepare_data(DataSection(hub_id=str(tmp_path / folder), format="preference", seq_len=16), tok, len(tok))
        assert len(data.train) == len(rows) and len(data.eval) == 4 and not data.eval.held_out, folder
        assert "split 'test'" in data.stats["eval"].source
    texts = [{"text": f"hello {w} paris"} for w in WORDS]
    DatasetDict({"train": Dataset.from_list(texts), "test": Dataset.from_list(texts[:3])}).save_to_disk(tmp_path / "t")
    data = prepare_data(DataSection(hub_id=str(tmp_path / "t"), seq_len=8, packing=False), tok, len(tok), cache=False)
    assert len(data.train) == len(texts) and len(data.eval) == 3 and "split 'test'" in data.stats["eval"].source


@pytest.mark.parametrize(
    "section, key, ours",
    [
        ("train", "beta", "preference.beta"),
        ("train", "loss_type", "preference.loss_type"),
        ("data", "max_prompt_length", "data.seq_len"),
        ("data", "max_length", "data.seq_len"),
        ("preference", "rpo_alpha", "preference.loss_type"),
        ("preference", "precompute_ref_log_probs", "data.format"),
        ("train", "bf16", "pipeline.mixed_precision"),
        ("adapter", "lora_target_modules", "adapter.target_modules"),
    ],
)
def test_dpo_configs_names_point_at_our_keys(section, key, ours):
    with pytest.raises(RecipeError, match=rf"{section}\.{key}: unknown key; did you mean {ours}\?"):
        recipe_from_dict({section: {key: 1}})


def test_the_recipe_preference_section_reaches_the_runtime_loss(tmp_path):
    """preference.loss_type lists, loss_weights, label_smoothing and simpo_gamma reach the runtime's Preference
    (new keys: the recipe knew sigmoid / ipo / hinge alone)."""
    from vp_accelerate.train.run.loop import preference_of

    f = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    data = {"files": [f], "format": "preference"}
    section = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1, 0.5], "label_smoothing": 0.1, "simpo_gamma": 1}
    recipe = recipe_from_dict({"data": data, "preference": section})
    ref = torch.zeros(4, dtype=torch.float64)
    pref = preference_of(recipe.preference, {"ref_logps": ref})
    assert (pref.types, pref.weights, pref.label_smoothing, pref.simpo_gamma) == (
        ("sigmoid", "sft"),
        (1.0, 0.5),
        0.1,
        1.0,
    )
    pref.check(4, 2)
    with pytest.raises(RecipeError, match="preference.loss_weights: 1 weights for 2 loss types"):
        recipe_from_dict({"data": data, "preference": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1]}})
    with pytest.raises(RecipeError, match="preference.label_smoothing: robust needs it in"):
        recipe_from_dict({"data": data, "preference": {"loss_type": "robust", "label_smoothing": 0.5}})


def test_check_counts_kto_rows_as_rows_not_packed_sequences_or_pairs(tok, tmp_path):
    """KTO's data (unpaired_preference) is reported in rows, one unpacked sequence each, and a held-out part too
    small for a global batch trains instead, said in rows (before: "packed sequences" and "preference pair(s)")."""
    from vp_accelerate.train.data.check import data_report

    words = [w for w in WORDS[:6] for _ in range(2)]
    rows = [{"prompt": f"hello {w} {i}", "completion": f" {w}", "label": i % 2 == 0} for i, w in enumerate(words)]
    f = _write(tmp_path / "u.jsonl", rows)
    base = {"train": {"global_batch": 4}, "pipeline": {"microbatches": 2}, "preference": {"loss_type": "kto"}}
    recipe = recipe_from_dict(
        {"data": {"files": [f], "format": "unpaired_preference", "seq_len": 16, "eval_holdout": 0.25}} | base
    )
    lines, prepared, _ = data_report(recipe, tok, len(tok))
    text = "\n".join(lines)
    assert "rows for training" in lines[0] and "pair" not in text and "packed sequences" not in text, text
    assert "sequences (1 a row, not packed)" in lines[1], lines
    held = prepared.returned  # held out, too few for a batch: they train instead, and evaluation is off
    noun = "row" if held == 1 else "rows"
    assert held and len(prepared.eval) == 0 and len(prepared.train) == len(rows), lines
    assert f"the {held} held-out preference {noun} fill no global batch of 4 rows, so" in lines[-1], lines


def test_check_says_pairs_per_microbatch_and_that_pairs_are_not_packed(tmp_path):
    """--check's batch line counts pairs for preference data (global_batch is pairs: 2 pairs are 4 sequences)
    and its data note says pairs are never packed (it said "2 sequences per microbatch" and "packed keeping
    document boundaries")."""
    from vp_accelerate.train.cli.preflight import _data_note
    from vp_accelerate.train.recipe.checks import describe_batch

    f = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    recipe = recipe_from_dict(
        {"data": {"files": [f], "format": "preference"}, "train": {"global_batch": 4}, "pipeline": {"microbatches": 2}}
    )
    line = describe_batch(recipe)
    assert line.startswith("batch: global_batch 4 pairs = 2 pairs (4 sequences) per microbatch"), line
    note = _data_note(recipe)
    assert "pairs never packed" in note and "packed keeping" not in note, note
    text = recipe_from_dict({"data": {"files": [f]}, "train": {"global_batch": 4}, "pipeline": {"microbatches": 2}})
    assert "global_batch 4 = 2 sequences per microbatch" in describe_batch(text)
