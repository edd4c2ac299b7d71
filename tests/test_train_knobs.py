"""The trainer's knobs: train.epochs and lr.warmup_ratio, the logged loss as the mean over the logging window,
cumulative token counters without padding, the epoch, keep_best and early stopping, sample generations.

The loop's bookkeeping runs on a stand-in pipeline (losses chosen per step) so every logged number is checked
exactly; keep_best, early stopping and the samples run in one 2-process training run, the samples compared
with HF `generate` on the exported model.
"""

import json
import math
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.launch import run_env, train_ranks
from helpers.tiny import TINY_MODEL, bpe, corpus, recipe_file
from vp_accelerate.train.recipe import RecipeError, finish_steps, recipe_from_dict

RNG = random.Random()


def base(tmp_path, **sections):
    data = {"data": {"files": [str(tmp_path / "d.jsonl")]}, "tokenizer": {"source": "org/tokenizer"}}
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return data


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"train": {"steps": 10, "epochs": 2}}, "train.epochs: set train.steps (10) or train.epochs (2), not both"),
        ({"train": {"epochs": 0}}, "train.epochs: must be > 0"),
        ({"train": {"epochs": 1}, "data": {"streaming": True}}, "train.epochs: a stream's length is not known"),
        (
            {"lr": {"warmup_ratio": 0.1, "warmup_steps": 5}},
            "lr.warmup_ratio: set lr.warmup_steps (5) or lr.warmup_ratio",
        ),
        ({"lr": {"warmup_ratio": 1.5}}, "lr.warmup_ratio: must be in [0, 1)"),
        ({"eval": {"patience": 2}}, "eval.patience: early stopping needs evaluations during the run"),
        ({"eval": {"every": 5, "patience": 0}}, "eval.patience: must be >= 1"),
        (
            {"checkpoint": {"keep_best": True, "every": 10}, "eval": {"every": 4}},
            "checkpoint.keep_best: every checkpoint needs an eval loss: set eval.every > 0 and checkpoint.every a multiple",
        ),
        ({"checkpoint": {"keep_best": True, "enabled": False}}, "checkpoint.keep_best: needs checkpoints"),
        ({"eval": {"prompts": ["hi"], "batches": 0}}, "eval.prompts: completions are made at evaluations"),
    ],
)
def test_knob_errors_name_the_key(tmp_path, sections, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        recipe_from_dict(base(tmp_path, **sections))


def test_epochs_and_warmup_ratio_become_steps(tmp_path):
    r = recipe_from_dict(base(tmp_path))
    assert r.train.steps == 100 and r.eval.batches is None  # the defaults: 100 steps, the whole eval set
    per_epoch, epochs, ratio = RNG.randrange(5, 50), RNG.choice([0.5, 1, 2.5, 3]), RNG.choice([0.03, 0.1, 0.25])
    r = recipe_from_dict(base(tmp_path, train={"epochs": epochs}, lr={"warmup_ratio": ratio}))
    assert r.train.steps is None
    r = finish_steps(r, per_epoch)
    assert r.train.steps == math.ceil(epochs * per_epoch) and r.lr.warmup_steps == round(ratio * r.train.steps)
    r = recipe_from_dict(base(tmp_path, train={"steps": 40}, lr={"warmup_ratio": 0.25}))
    assert r.lr.warmup_steps == 10


# ----------------------------------------------------------------------------------- the loop's bookkeeping
class FakePipe:
    """PipelineModel's surface the loop uses, with the loss of every step chosen by the test."""

    def __init__(self, losses):
        self.losses, self.cfg = list(losses), SimpleNamespace(microbatches=2)
        self.loss_scaler, self.world_size, self.flops_per_token, self.watchdog, self.dp_rank = None, 1, 1.0, None, 0

    def train_step(self, ids, labels, mask=None, pos=None, preference=None):
        return SimpleNamespace(
            loss=self.losses.pop(0),
            num_tokens=int((labels[:, 1:] != -100).sum()),
            skipped=False,
            step_time_s=0.01,
            tokens_per_s=100.0 * int((labels[:, 1:] != -100).sum()),
            bubble_rate=0.0,
            nonfinite_microbatches=(),
            loss_scale=1.0,
            rewards=None,
        )

    def clip_grad_norm_(self, _):
        return 1.0

    def step(self, _):
        return True

    def zero_grad(self):
        pass

    def stats(self):
        return {}

    def named_parameters(self):
        return []


def test_logged_loss_is_the_window_mean_and_counters_add_up(tmp_path):
    from vp_accelerate.train.data import BatchIterator, pack_documents
    from vp_accelerate.train.data.batches import Sequences
    from vp_accelerate.train.run.loop import LoopState, Run, log_step, train_step_once

    rng = np.random.default_rng(RNG.randrange(1000))
    docs = [rng.integers(1, 50, size=rng.integers(3, 12)).tolist() for _ in range(80)]
    masks = [[0] * (len(d) // 2) + [1] * (len(d) - len(d) // 2) for d in docs]
    info = {}
    ids, labels, pos, _ = pack_documents(docs, masks, 16, 0, split_long=False, stats=info)
    seqs = Sequences(ids, labels=labels, positions=pos, lengths=info["lengths"])
    every, steps, g = RNG.choice([2, 3]), 9, 4
    losses = [float(x) for x in rng.uniform(1, 5, size=steps)]
    losses[4] = float("nan")  # a skipped NaN step stays out of the mean
    logged = []
    recipe = recipe_from_dict(
        base(
            tmp_path,
            logging={"log_every": every},
            pipeline={"microbatches": 2},
            train={"on_nonfinite": "skip", "global_batch": g},
        )
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    run = Run(
        recipe=recipe,
        accelerator=SimpleNamespace(is_main_process=True, device=torch.device("cpu")),
        pipe=FakePipe(losses),
        tokenizer=None,
        train_it=BatchIterator(seqs, 0, g),
        eval_batches=[],
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        layout=None,
        vocab=None,
        fingerprint={},
        recipe_dict={},
        end_step=steps,
        tracker=SimpleNamespace(log=lambda m, step: logged.append((step, m))),
    )
    state, order = LoopState(), run.train_it._order
    tokens = loss_tokens = 0
    window = []
    for step in range(1, steps + 1):
        rows = order[(step - 1) * g : step * g]
        tokens += int(info["lengths"][rows].sum())
        loss_tokens += int((labels[rows, 1:] != -100).sum())
        window.append(losses[step - 1])
        out = train_step_once(run, state, step)
        log_step(run, state, out)
        if logged and logged[-1][0] == step:
            m = logged[-1][1]
            finite = [x for x in window if math.isfinite(x)]
            window = []
            assert m["train/loss"] == pytest.approx(sum(finite) / len(finite), rel=1e-12), step
            assert m["train/tokens"] == tokens and m["train/loss_tokens"] == loss_tokens
            assert m["train/step_loss_tokens"] == int((labels[rows, 1:] != -100).sum())
            assert m["train/epoch"] == pytest.approx(step / run.train_it.steps_per_epoch)
    assert [s for s, _ in logged] == [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
    assert tokens < steps * g * 16  # padding is not counted


# ----------------------------------------------------------------------------------- one 2-rank run
@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    d = tmp_path_factory.mktemp("knobs")
    rng = random.Random(RNG.random())
    words = "alpha beta gamma delta paris france capital hello world".split()
    text = corpus(d, words, lines=400, per_line=(8, 30), seed=rng)
    held = corpus(d, words, lines=20, per_line=20, seed=rng, name="eval.jsonl")
    bpe([text], d)
    prompts = [" ".join(rng.choices(words, k=3)) for _ in range(2)]
    recipe_file(
        d / "r.yaml",
        d / "tok",
        [text],
        model=TINY_MODEL,
        data={"eval_files": [str(held)], "seq_len": 32},
        pipeline={"microbatches": 2},
        optimizer={"lr": 1e-2},
        lr={"warmup_ratio": 0.2},
        train={"epochs": 3, "global_batch": 4},
        # min_delta far above any change: the second evaluation ends the run (the best is the lower of the two)
        eval={"every": 2, "patience": 1, "min_delta": 100.0, "prompts": prompts, "max_new_tokens": 6},
        checkpoint={"every": 2, "keep": 1, "keep_best": True},
        logging={"output_dir": str(d / "out"), "log_every": 1},
    )
    # 2 ranks forked as the launcher starts them (tests/helpers/launch.py); `vp-accelerate launch` itself
    # runs in tests/test_train_e2e.py and tests/test_train_launch_errors.py
    out = train_ranks([str(d / "r.yaml")], d, run_env(d / "ds_cache"), timeout_s=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in open(d / "out" / "metrics.jsonl")]
    return d, prompts, out, rows


def test_early_stopping_keeps_and_exports_the_best(launched):
    from transformers import AutoModelForCausalLM

    from vp_accelerate.train.cli.commands import export_main
    from vp_accelerate.train.persist import store as ckpt

    d, _, out, rows = launched
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    assert sorted(evals) == [2, 4] and max(r["step"] for r in rows) == 4  # stopped at the second evaluation
    assert "stopped early after step 4 of" in out.stderr and "(eval.patience): best eval loss" in out.stderr
    cdir = d / "out" / "checkpoints"
    # patience counts gains over min_delta, but the best is the lowest loss, whichever gain it made
    best_step = min(evals, key=evals.get)
    kept = sorted({f"step_{best_step:08d}", "step_00000004"})
    # keep 1 + the best, and the run's lock on its checkpoint folder (one writer per folder: run_lock.py)
    assert sorted(os.listdir(cdir)) == [".vp-accelerate.lock", "best", "latest", *kept]
    assert ckpt.read_best(str(cdir)) == str(cdir / f"step_{best_step:08d}")
    assert export_main([str(cdir / f"step_{best_step:08d}"), str(d / "best_export")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(d / "out" / "hf")).state_dict()
    best = AutoModelForCausalLM.from_pretrained(str(d / "best_export")).state_dict()
    assert all(torch.equal(hf[k], best[k]) for k in best)  # hf/ is the best checkpoint, not the last
    data = next(r for r in rows if r["step"] == 0)
    steps_per_epoch = data["data/steps_per_epoch"]
    assert data["data/train_sequences"] // 4 == steps_per_epoch and data["data/eval_sequences"] > 0
    assert f"train.epochs 3 = {3 * steps_per_epoch} steps" not in out.stderr  # (said by --check, not the launch)
    meta = ckpt.read_meta(str(cdir / "step_00000004"))
    assert meta["recipe"]["train"]["steps"] == 3 * steps_per_epoch
    assert meta["recipe"]["lr"]["warmup_steps"] == round(0.2 * 3 * steps_per_epoch)


def test_samples_are_what_hf_generate_answers(launched):
    """The completions logged at the best evaluation are those of its weights, i.e. of the exported best model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, prompts, _, rows = launched
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    best_step = min(evals, key=evals.get)
    logged = next(r["eval/samples"] for r in rows if r["step"] == best_step and "eval/samples" in r)
    assert [s["prompt"] for s in logged] == prompts
    model = AutoModelForCausalLM.from_pretrained(str(d / "out" / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(d / "out" / "hf"))
    for sample in logged:
        ids = torch.tensor([tok(sample["prompt"], add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        # equality is the check (a short-trained model may stop at once, which both then say alike)
        assert sample["completion"] == tok.decode(new[0, ids.shape[1] :], skip_special_tokens=True)


def _lora_samples_on_ranks(ckpt: str, tok_dir: str, prompts: list, out_dir: str):
    import zlib

    from transformers import AutoTokenizer

    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.adapter_config import AdapterConfig
    from vp_accelerate.train.run.samples import complete

    pipe = PipelineModel(
        ckpt,
        PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2),
        seed=3,
        adapter=AdapterConfig(type="lora", r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():  # trained-looking adapters (B starts at zero), the same whatever the layout
        for name, p in pipe.named_parameters():
            if ".lora_B." in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    texts = complete(pipe, tok, prompts, "text", 8)
    pipe.export_hf(out_dir, tok)  # the runtime's own merge and export: the reference's weights
    pipe.close()
    return texts


def test_lora_samples_match_generate_on_the_merged_export(tmp_path):
    """Samples of a LoRA pipeline on 2 ranks (the gathered model with the adapters merged) are what HF
    `generate` answers with the runtime's merged export."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.tiny import tiny_llama
    from vp_accelerate.distributed import spawn

    rng = random.Random(RNG.random())
    words = "alpha beta gamma delta paris france capital hello world".split()
    tok = bpe([corpus(tmp_path, words, lines=100, seed=rng, name="t.txt")], tmp_path, 280)
    torch.manual_seed(rng.randrange(1000))
    AutoModelForCausalLM.from_config(tiny_llama(len(tok), num_layers=4)).save_pretrained(str(tmp_path / "m"))
    prompts = [" ".join(rng.choices(words, k=3)) for _ in range(2)]
    texts = spawn(
        _lora_samples_on_ranks,
        2,
        str(tmp_path / "m"),
        str(tmp_path / "tok"),
        prompts,
        str(tmp_path / "merged"),
        timeout_s=240,
    )
    assert texts[1] is None  # rank 0 generates
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    for prompt, text in zip(prompts, texts[0]):
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        # a random model may answer with a special token first (an empty text): equality is the check
        assert text == tok.decode(new[0, ids.shape[1] :], skip_special_tokens=True)
