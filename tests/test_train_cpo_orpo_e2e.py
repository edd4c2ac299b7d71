"""SimPO, CPO's sigmoid (its default), hinge and ipo losses, AlphaPO and ORPO end to end: a 2-rank run of the trainer logs at step 1 the loss and every metric that TRL 1.16's
own `CPOTrainer.train()` / `ORPOTrainer.train()` log for the same model, tokenizer and pairs (prompts ending in a
space, a chosen that already ends in EOS), one batch of all pairs (so TRL's shuffling cannot matter).

Before: SimPO / ORPO were tokenized as DPOTrainer does, ORPO's NLL counted the completion only, and logits/*,
nll_loss, log_odds_* were DPOTrainer's or absent: the step-1 loss and metrics differed.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.launch import run_env, train_ranks
from helpers.tiny import recipe_file, tiny_llama, word_tokenizer
from vp_accelerate.train.tokens.tokenizer import load_tokenizer

trl = pytest.importorskip("trl")

PAIRS = 8
SEQ = 32
BETA = 0.25
ALPHA = 0.5  # CPO's cpo_alpha = the weight of `sft`
CPO = {  # name: (CPOConfig's arguments, the recipe's preference section)
    "simpo": (
        dict(loss_type="simpo", cpo_alpha=ALPHA, simpo_gamma=0.4, label_smoothing=0.1),
        {"loss_type": ["simpo", "sft"], "loss_weights": [1.0, ALPHA], "simpo_gamma": 0.4, "label_smoothing": 0.1},
    ),
    "cpo_sigmoid": (  # CPOConfig's defaults: loss_type sigmoid, cpo_alpha 1.0
        dict(label_smoothing=0.1),
        {"loss_type": ["cpo_sigmoid", "sft"], "loss_weights": [1.0, 1.0], "label_smoothing": 0.1},
    ),
    "cpo_hinge": (dict(loss_type="hinge", cpo_alpha=0.0), {"loss_type": "cpo_hinge"}),
    "cpo_ipo": (
        dict(loss_type="ipo", cpo_alpha=ALPHA),
        {"loss_type": ["cpo_ipo", "sft"], "loss_weights": [1.0, ALPHA]},
    ),
    "alphapo": (
        dict(loss_type="alphapo", alpha=0.25, simpo_gamma=0.4),
        {"loss_type": "simpo", "alpha": 0.25, "simpo_gamma": 0.4},
    ),
}


def _rows(eos: str):
    words = ["alpha", "beta", "gamma", "delta", "paris", "hello", "world", "capital"]
    rows = []
    for k in range(PAIRS):
        prompt = f"{words[k]} {words[(k + 3) % 8]} " if k % 2 else f"{words[k]} {words[(k + 1) % 8]}:"
        chosen = f"{words[(k + 2) % 8]} {words[(k + 5) % 8]}" + (eos if k == 3 else "")
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": f" {words[(k + 4) % 8]}"})
    return rows


def _trl_log(trainer_name, model_dir, tok, rows):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    common = dict(
        output_dir=None,
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=PAIRS,
        max_steps=1,
        logging_steps=1,
        max_length=SEQ,
        beta=BETA,
        dataset_num_proc=None,
        save_strategy="no",
    )
    if trainer_name == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model, ORPOConfig(**common), train_dataset=Dataset.from_list(rows), processing_class=tok)
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**common, **CPO[trainer_name][0])
        trainer = CPOTrainer(model, args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    return next(r for r in trainer.state.log_history if "loss" in r)


@pytest.mark.slow
@pytest.mark.parametrize("trainer_name", ["orpo", *CPO])
def test_a_run_logs_what_cpo_and_orpo_trainers_log_at_step_1(tmp_path, trainer_name):
    tok_dir = word_tokenizer(tmp_path)
    tok = load_tokenizer(f"bpe:{tok_dir}")
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_llama(len(tok), tied=False)).save_pretrained(model_dir)
    rows = _rows(tok.eos_token)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preference = {"beta": BETA, **({"loss_type": ["sft", "orpo"]} if trainer_name == "orpo" else CPO[trainer_name][1])}
    recipe_file(
        tmp_path / "r.yaml",
        tok_dir,
        [str(data)],
        model={"source": str(model_dir)},
        data={"format": "preference", "seq_len": SEQ, "eval_holdout": 0},
        preference=preference,
        pipeline={"schedule": "1f1b", "method": "vocab-1", "microbatches": 2},
        train={"steps": 1, "global_batch": PAIRS},
        eval={"batches": 0},
        checkpoint={"every": 0, "export_hf": False},
        logging={"output_dir": str(tmp_path / "run"), "timeline_image": False},
    )
    out = train_ranks([str(tmp_path / "r.yaml")], tmp_path, run_env(tmp_path / "ds_cache"), timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    ours = next(json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "train/loss" in line)
    theirs = _trl_log(trainer_name, str(model_dir), tok, rows)
    assert ours["train/loss"] == pytest.approx(theirs["loss"], rel=2e-5), (ours, theirs)
    assert ours["train/grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4), (ours, theirs)
    names = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"]
    names += ["logps/rejected", "logits/chosen", "logits/rejected", "nll_loss"]
    names += ["log_odds_ratio", "log_odds_chosen"] if trainer_name == "orpo" else []
    for name in names:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-5), (name, ours, theirs)
