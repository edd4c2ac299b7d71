"""KTO in the trainer (`data.format: unpaired_preference`): rows of prompt, completion and a boolean label become
TRL 1.16's KTOTrainer tokens and KL rows (its own `_prepare_dataset` and collator are the reference), and a step
on 2 ranks under vocabulary parallelism — z per microbatch from `PipelineModel.kl_estimate`, the loss from
runtime/preference.py — gives the loss, every gradient and the KL estimates of TRL's own `_compute_loss` run once
per gradient-accumulation micro-step on the single-process HF model, in float64, to 1e-9. The recipe side: the
shipped recipe and its demo data check, the loss names what data format it needs."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import WORDS, tiny_llama, word_tokenizer
from vp_accelerate.distributed import spawn
from vp_accelerate.train.data import prepare_data
from vp_accelerate.train.recipe import DataSection, RecipeError, recipe_from_dict
from vp_accelerate.train.tokens.tokenizer import load_tokenizer

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import KTOTrainer  # noqa: E402
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference  # noqa: E402

from helpers.grads import gathered_grads as _gathered_grads  # noqa: E402

SEQ = 14
BETA = 0.3
MICRO = 2  # microbatches (TRL's gradient-accumulation steps)
ROWS = 4  # rows per microbatch (TRL's per_device_train_batch_size)
WEIGHTS = dict(desirable_weight=1.3, undesirable_weight=0.8)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(f"bpe:{word_tokenizer(tmp_path_factory.mktemp('tok'))}")


def _rows(seed: int, n: int = MICRO * ROWS) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))
        completion = " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))
        rows.append({"prompt": prompt, "completion": completion, "label": i % 3 != 1})
    # a prompt that fills SEQ: dropped (TRL filters it before building the KL rows)
    rows.insert(3, {"prompt": " ".join(["alpha"] * 20), "completion": " beta", "label": True})
    return rows


def _ours(tok, tmp_path, rows):
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataSection(files=[str(path)], format="unpaired_preference", seq_len=SEQ, eval_holdout=0)
    data = prepare_data(cfg, tok, len(tok))
    data.group_rows(ROWS)
    return data.train.batch(np.arange(MICRO * ROWS))


def _trl_batches(tok, rows):
    """TRL's own tokens: `_prepare_dataset` (EOS, tokenization, the dropped row, KL completions rotated within
    each group of per_device_train_batch_size rows) and its collator, one batch per micro-step."""
    me = SimpleNamespace(calculate_KL=True, _tokenizer=tok, **WEIGHTS)
    args = SimpleNamespace(dataset_num_proc=None, max_length=SEQ, per_device_train_batch_size=ROWS)
    ds = KTOTrainer._prepare_dataset(me, Dataset.from_list(rows), tok, args, "train")
    collate = DataCollatorForUnpairedPreference(pad_token_id=tok.pad_token_id, max_length=SEQ)
    return [collate([ds[i] for i in range(k * ROWS, (k + 1) * ROWS)]) for k in range(MICRO)]


def _trimmed(ids, mask, width):
    return [row[:n].tolist() for row, n in zip(ids[:, :width], mask.sum(1))]


def test_rows_and_kl_rows_are_trls_tokens(tok, tmp_path):
    rows = _rows(0)
    ours = _ours(tok, tmp_path, rows)
    for k, theirs in enumerate(_trl_batches(tok, rows)):
        part = slice(k * ROWS, (k + 1) * ROWS)
        for prefix in ("", "kl_"):
            trl_prefix = "KL_" if prefix else ""
            ids, mask = ours[f"{prefix}input_ids"][part], ours[f"{prefix}attention_mask"][part]
            t_ids, t_mask = theirs[f"{trl_prefix}input_ids"], theirs[f"{trl_prefix}attention_mask"]
            assert _trimmed(ids, mask, SEQ) == _trimmed(t_ids, t_mask, SEQ), (k, prefix)
            labels = ours[f"{prefix}labels"][part]
            completion = theirs[f"{trl_prefix}completion_mask"].bool()
            assert _trimmed((labels != -100).long(), mask, SEQ) == _trimmed(completion.long(), t_mask, SEQ)
        assert ours["desirable"][part].tolist() == theirs["label"].tolist()


def _token_logps(model, ids, labels) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].to(torch.float64)
    target = labels[:, 1:]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    return lp * (target != -100)


def _trl_step(model, batches, refs, ref_kls):
    """TRL's KTOTrainer._compute_loss per micro-step (a stand-in for the fused head returns the model's per-token
    log-probabilities), averaged over the micro-steps as gradient accumulation does; its logged `kl` values."""
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    acc = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    me = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=acc,
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        _metrics=metrics,
        _total_train_tokens=0,
        _tp_size=1,
        loss_type="kto",
        beta=BETA,
        calculate_KL=True,
        **WEIGHTS,
    )
    me._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(me, m, b)
    total = 0.0
    for b, ref, ref_kl in zip(batches, refs, ref_kls):
        labels = b["input_ids"].masked_fill(b["completion_mask"] == 0, -100)
        kl_labels = b["KL_input_ids"].masked_fill(b["KL_completion_mask"] == 0, -100)
        per_token = _token_logps(model, b["input_ids"], labels)
        with torch.no_grad():
            kl_token = _token_logps(model, b["KL_input_ids"], kl_labels)
        table = {id(b["input_ids"]): per_token, id(b["KL_input_ids"]): kl_token}
        with torch.no_grad():  # each position's mean logit over the vocabulary (TRL's logits/*) and entropy
            logits = model(input_ids=b["input_ids"]).logits[:, :-1].to(torch.float64)
            logp = torch.log_softmax(logits, dim=-1)
        stats = {
            id(b["input_ids"]): (logits.mean(dim=-1), -(logp.exp() * logp).sum(dim=-1)),
            id(b["KL_input_ids"]): (torch.zeros_like(kl_token), torch.zeros_like(kl_token)),
        }

        def head(input_ids, labels=None, **_):
            lp = table[id(input_ids)]
            mean, entropy = stats[id(input_ids)]
            return SimpleNamespace(log_probs=lp, entropy=entropy, mean_logits=mean, is_top1=mean.bool())

        batch = {**b, "ref_logps": ref, "ref_KL_logps": ref_kl}
        total = total + KTOTrainer._compute_loss(me, head, batch, False) / len(batches)
    return total, metrics["train"]


def _on_ranks(ckpt, batch, noise, kl_noise):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.preference import Preference

    cfg = PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=MICRO, attn_implementation="eager")
    pipe = PipelineModel(ckpt, cfg, dtype=torch.float64)
    mask = batch["attention_mask"]
    ref = pipe.sequence_logps(batch["input_ids"], batch["labels"], mask) + noise
    ref_kl = pipe.sequence_logps(batch["kl_input_ids"], batch["kl_labels"], batch["kl_attention_mask"]) + kl_noise
    z = pipe.kl_estimate(batch["kl_input_ids"], batch["kl_labels"], ref_kl, batch["kl_attention_mask"])
    pref = Preference(ref, beta=BETA, loss_type="kto", desirable=batch["desirable"], kl=z, **WEIGHTS)
    res = pipe.train_step(batch["input_ids"], batch["labels"], mask, preference=pref)
    out = (res.loss, z, res.rewards, _gathered_grads(pipe), ref, ref_kl)
    pipe.close()
    return out


def test_a_kto_step_on_2_ranks_is_trls_loss_and_gradients(tok, tmp_path):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    rows = _rows(seed)
    batch = _ours(tok, tmp_path, rows)
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(tiny_llama(len(tok), tied=False, attn_implementation="eager")).save_pretrained(
        ckpt
    )
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(MICRO * ROWS, generator=g, dtype=torch.float64)
    kl_noise = -torch.rand(MICRO * ROWS, generator=g, dtype=torch.float64) * 0.5  # z > 0: the clamp is not hit
    kl_noise[:ROWS] += 1.0  # the first microbatch's z clamps at 0
    per_rank = spawn(_on_ranks, 2, ckpt, batch, noise, kl_noise, timeout_s=300)
    loss, z, rewards, grads, ref, ref_kl = per_rank[0]
    assert per_rank[1][0] == pytest.approx(loss, rel=1e-12) and per_rank[1][1] == z

    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    parts = [slice(k * ROWS, (k + 1) * ROWS) for k in range(MICRO)]
    trl_loss, logged = _trl_step(model, _trl_batches(tok, rows), [ref[p] for p in parts], [ref_kl[p] for p in parts])
    trl_kl = logged["kl"]
    trl_loss.backward()
    assert z[0] == 0.0 and z[1] > 0, (z, seed)
    assert list(z) == pytest.approx(trl_kl, rel=1e-9, abs=1e-12), seed
    assert loss == pytest.approx(trl_loss.item(), rel=1e-9, abs=1e-12), seed
    for n, p in model.named_parameters():
        err = (grads[n] - p.grad).abs().max().item() / p.grad.abs().max().item()
        assert err < 1e-9, (n, err, seed)
    # KTOTrainer's names and values: each micro-step's per-class means (desirable = "chosen"), averaged over the
    # micro-steps as its log does (the microbatches hold 3 and 2 desirable rows: not the step's means); no accuracy
    assert "rewards/accuracies" not in rewards and "rewards/margins" in rewards
    names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
    for name in names + ["logits/chosen", "logits/rejected", "entropy"]:
        want = sum(logged[name]) / len(logged[name])
        assert rewards[name] == pytest.approx(want, rel=1e-9, abs=1e-12), (name, rewards, dict(logged), seed)


def test_the_recipe_needs_the_unpaired_format_for_kto(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": " b", "label": True}) + "\n")
    base = {"model": {"source": "llama-tiny"}, "data": {"files": [str(path)], "format": "preference"}}
    with pytest.raises(RecipeError, match="data.format: unpaired_preference"):
        recipe_from_dict({**base, "preference": {"loss_type": "kto"}})
    unpaired = {**base, "data": {**base["data"], "format": "unpaired_preference"}}
    with pytest.raises(RecipeError, match="set preference.loss_type: kto"):
        recipe_from_dict({**unpaired, "preference": {"loss_type": "sigmoid"}})
    r = recipe_from_dict({**unpaired, "preference": {"loss_type": "kto", "undesirable_weight": 1.5}})
    assert r.preference.undesirable_weight == 1.5 and r.data.label_field == "label"


def test_a_row_without_a_boolean_label_is_named(tok, tmp_path):
    from vp_accelerate.train.data import DataError

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": " b", "good": "yes"}) + "\n")
    cfg = DataSection(files=[str(path)], format="unpaired_preference", seq_len=SEQ, label_field="good")
    with pytest.raises(DataError, match=r"bad.jsonl, line 1: 'good' must be true or false"):
        prepare_data(cfg, tok, len(tok))


def test_the_shipped_recipe_checks_on_conversational_rows(tok, tmp_path):
    """recipes/kto.yaml on conversational KTO rows (the demo's shape) with --check's data report: rows read with the
    chat template, evaluation in whole global batches; the KL rows are built for its microbatches."""
    from vp_accelerate.train.data.check import data_report
    from vp_accelerate.train.recipe import load_recipe

    rows = []
    for i, w in enumerate(WORDS * 2):
        answer = "paris" if i % 2 == 0 else WORDS[(i + 3) % len(WORDS)]
        prompt = [{"role": "user", "content": f"hello {w}"}]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}], "label": i % 2 == 0})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"data.files=[{path}]", f"data.eval_files=[{path}]", "data.seq_len=128", f"logging.output_dir={tmp_path}"]
    recipe = load_recipe("recipes/kto.yaml", sets + ["model.source=llama-tiny"])
    assert recipe.data.format == "unpaired_preference" and recipe.preference.loss_type == "kto"
    lines, prepared, _ = data_report(recipe, tok, len(tok))
    text = "\n".join(lines)
    assert f"{len(rows)} rows" in text and "2 batches of train.global_batch" in text, text
    prepared.group_rows(recipe.train.global_batch // recipe.pipeline.microbatches)
    b = prepared.train.batch(np.arange(8))
    assert b["kl_input_ids"].shape == b["input_ids"].shape and b["desirable"].sum() == 4
    assert not torch.equal(b["kl_input_ids"], b["input_ids"])  # prompts with another row's answer


def test_held_out_rows_that_fill_no_batch_train_instead(tok, tmp_path):
    """KTO's rows held out by data.eval_holdout that fill no global batch are given back to training, as DPO's
    pairs are, and --check and the launch say so in rows (before: held out, unused, and evaluation off)."""
    from vp_accelerate.train.data.check import data_report
    from vp_accelerate.train.data.prepare import holdout_every
    from vp_accelerate.train.data.unpaired import prepare_unpaired

    rows = [{"prompt": f"hello {w}", "completion": f" {w} paris", "label": i % 2 == 0} for i, w in enumerate(WORDS)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"files": [str(path)], "format": "unpaired_preference", "seq_len": SEQ, "eval_holdout": 0.25}
    recipe = recipe_from_dict(
        {
            "data": data,
            "train": {"global_batch": 8},
            "pipeline": {"microbatches": 2},
            "preference": {"loss_type": "kto"},
        }
    )
    train, held, _, _ = prepare_unpaired(recipe.data, tok, len(tok), holdout_every(recipe.data))
    assert 0 < len(held) < 8 and len(train) + len(held) == len(rows)
    lines, prepared, _ = data_report(recipe, tok, len(tok))
    assert len(prepared.train) == len(rows) and len(prepared.eval) == 0 and prepared.returned == len(held)
    assert "fill no global batch of 8 rows, so" in lines[-1], lines
    launch = prepare_data(recipe.data, tok, len(tok))
    launch.check_sizes(8, None)
    _, evals = launch.iterators(0, 8, eval_batches=None)
    assert len(launch.train) == len(rows) and len(evals) == 0
    assert launch.train.desirable.tolist() == prepared.train.desirable.tolist()
    assert sorted(launch.train.prompts) == sorted(train.prompts + held.prompts)
    assert launch.stats["train"].documents == len(rows) and launch.stats["eval"].documents == 0


def test_demo_unpaired_rows_alternate_own_and_other_answers(tmp_path):
    pytest.importorskip("babel")
    pytest.importorskip("faker")
    from scripts.make_demo_chat import main

    assert main(["--unpaired", "--conversations", "40", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert {tuple(r) for r in rows} == {("prompt", "completion", "label")}
    assert abs(sum(r["label"] for r in rows) - len(rows) / 2) <= 1


def test_a_kto_run_learns_and_logs_ktotrainers_metrics(tmp_path, tok):
    """The trainer on 2 ranks: reference pass over the rows and the KL rows (saved), z per microbatch, the loss
    from 0.5 (σ(0) at the reference, z = 0) down on repeated rows; KTOTrainer's names logged, train and eval."""
    from helpers.launch import run_env, train_ranks
    from helpers.tiny import TINY_MODEL, recipe_file

    rng = random.Random(1)
    rows = [
        {
            "prompt": " ".join(rng.choices(WORDS, k=3)),
            "completion": " " + " ".join(rng.choices(WORDS, k=2)),
            "label": i % 2 == 0,
        }
        for i in range(8)
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe_file(
        tmp_path / "r.yaml",
        tok.name_or_path,
        [path],
        model=TINY_MODEL,
        data={"eval_files": [str(path)], "format": "unpaired_preference", "seq_len": 16},
        preference={"beta": 0.5, "loss_type": "kto"},
        pipeline={"schedule": "1f1b", "method": "vocab-1", "microbatches": 2},
        optimizer={"lr": 3e-3, "weight_decay": 0.0},
        train={"steps": 12, "global_batch": 8},
        eval={"every": 12, "batches": 1},
        checkpoint={"every": 0, "export_hf": False},
        logging={"output_dir": str(tmp_path / "run"), "timeline_image": False},
    )
    out = train_ranks([str(tmp_path / "r.yaml")], tmp_path, run_env(tmp_path / "ds_cache"), timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in logged if "train/loss" in r]
    # the policy is the reference at step 1 (fp32 on the CPU: the same rows in other batches differ by ~1e-7)
    assert train[0]["train/loss"] == pytest.approx(0.5, abs=1e-4) and train[0]["kl"] == pytest.approx(0, abs=1e-4)
    assert train[-1]["train/loss"] < 0.45 and train[-1]["rewards/margins"] > 0
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"} <= set(train[-1])
    assert "rewards/accuracies" not in train[-1]
    final = [r for r in logged if "eval/loss" in r][-1]
    assert final["eval/loss"] < 0.5 and "eval/kl" in final
    saved = torch.load(tmp_path / "run" / "ref_logps.pt", weights_only=True)
    assert set(saved) == {"train", "train_kl", "eval", "eval_kl", "train_kl_group", "eval_kl_group"}
    assert int(saved["train_kl_group"]) == 4  # a resume with other microbatches is refused (KL rows differ)


def _dp_ranks(ckpt, batch, ref_kl):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    cfg = PipelineConfig(schedule="1f1b", method="vocab-1", microbatches=MICRO, dp_size=2, attn_implementation="eager")
    pipe = PipelineModel(ckpt, cfg, dtype=torch.float64)
    per = len(ref_kl) // 2
    part = slice(pipe.dp_rank * per, (pipe.dp_rank + 1) * per)
    z = pipe.kl_estimate(batch["kl_input_ids"][part], batch["kl_labels"][part], ref_kl[part])
    pipe.close()
    return z


@pytest.mark.slow
def test_the_kl_estimate_is_averaged_over_replicas(tok, tmp_path):
    """Two data-parallel replicas: each microbatch's z is the mean of the replicas' estimates, as TRL gathers every
    device's before the clamp."""
    batch = _ours(tok, tmp_path, _rows(3))
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(tiny_llama(len(tok), tied=False, attn_implementation="eager")).save_pretrained(
        ckpt
    )
    ref_kl = torch.linspace(-3.0, 1.0, MICRO * ROWS, dtype=torch.float64)
    z = spawn(_dp_ranks, 2, ckpt, batch, ref_kl, timeout_s=300)
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    with torch.no_grad():
        own = _token_logps(model, batch["kl_input_ids"], batch["kl_labels"]).sum(1) - ref_kl
    per = ROWS // 2  # rows of a replica's microbatch
    expected = [
        max(0.0, (own[k * per : (k + 1) * per].mean() + own[4 + k * per : 4 + (k + 1) * per].mean()).item() / 2)
        for k in range(MICRO)
    ]
    assert z[0] == z[1] and list(z[0]) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_a_resume_with_other_kl_rows_is_refused(tok, tmp_path):
    from vp_accelerate.train.run import reference_logps

    batch_rows = _rows(0)
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in batch_rows))
    recipe = recipe_from_dict(
        {
            "data": {"files": [str(path)], "format": "unpaired_preference", "seq_len": SEQ},
            "preference": {"loss_type": "kto"},
        }
    )
    recipe.logging.output_dir = str(tmp_path / "run")
    data = prepare_data(
        DataSection(files=[str(path)], format="unpaired_preference", seq_len=SEQ, eval_holdout=0), tok, len(tok)
    )
    data.group_rows(2)
    n = len(data.train.ids)
    (tmp_path / "run").mkdir()
    ref = torch.zeros(n, dtype=torch.float64)
    torch.save({"train": ref, "train_kl": ref, "train_kl_group": torch.tensor(4)}, tmp_path / "run" / "ref_logps.pt")
    run = SimpleNamespace(data=SimpleNamespace(train=data.train, eval=None), recipe=recipe, pipe=None)
    with pytest.raises(RecipeError, match="built for microbatches of 4 rows, this run's have 2"):
        reference_logps.attach(run, resuming=True)
    data.group_rows(4)
    reference_logps.attach(run, resuming=True)
    assert data.train.ref_kl_logps.tolist() == [0.0] * n
