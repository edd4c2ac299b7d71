"""A fine-tune checked the way a user checks one, in 2-process training runs: SFT a tiny
model on a chat set whose assistant always gives one fixed reply, load the export with AutoModelForCausalLM +
AutoTokenizer, `apply_chat_template(..., add_generation_prompt=True)`, `generate(max_new_tokens=20)`: the
reply comes back and generation stops at the end-of-turn token. The same through peft
(AutoPeftModelForCausalLM, offline) for a LoRA run on that export teaching another reply, for a LoRA run on a
plain-text base without a chat template (ChatML's token rows train and are saved as peft's
trainable_token_indices), and after a tokenizer swap.

The settings learn the replies with a wide margin, so greedy decoding is no coin toss: at every generated
token the chosen logit beats the runner-up by at least 8.0 after SFT, 6.7 through the LoRA adapter and 17.9
after the swap (measured); the test asks for 2.
"""

import json
import os
import random

import pytest
import torch

from helpers.launch import run_env, train_ranks

REPLY = "The answer is always forty-two."
LORA_REPLY = "The answer is forty-two always."  # tokens the base model already predicts, in another order
WORDS = (
    "what is the capital of france how many legs does a spider have tell me a joke about cats why sky blue "
    "name three colors please explain gravity"
).split()
QUESTIONS = ["what is the capital of france?", "tell me a joke", "Completely unrelated words here!"]


def write_chat(path, reply, n, rng, system=True):
    with open(path, "w") as f:
        for _ in range(n):
            turns = [
                {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 9))) + "?"},
                {"role": "assistant", "content": reply},
            ]
            if system and rng.random() < 0.3:
                turns.insert(0, {"role": "system", "content": "You are a helpful assistant."})
            f.write(json.dumps({"messages": turns}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The two chat sets and two byte-level BPEs without a chat template (the second for the swap)."""
    from vp_accelerate.train.tokens.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("chat_e2e")
    rng = random.Random(0)
    sets = {
        name: {
            split: write_chat(d / f"{name}_{split}.jsonl", reply, n, rng, system=name == "a")
            for split, n in (("train", 400), ("eval", 20))
        }
        for name, reply in (("a", REPLY), ("b", LORA_REPLY))
    }
    for name, size, extra in (("tok", 400, " You are a helpful assistant."), ("tok2", 380, " Other text, 12345.")):
        with open(d / f"{name}.txt", "w") as f:
            for _ in range(300):
                f.write(" ".join(rng.choices(WORDS, k=12)) + " " + REPLY + extra + "\n")
        train_bpe([str(d / f"{name}.txt")], size, str(d / name), min_frequency=1)
    return d, sets


def launch(d, name, recipe):
    import yaml

    recipe = {
        "pipeline": {"schedule": "1f1b", "method": "vocab-2", "microbatches": 2},
        "lr": {"warmup_steps": 2, "decay": "constant"},
        "eval": {"batches": 1},
        "checkpoint": {"every": 0},
        "logging": {"wandb_mode": "disabled", "output_dir": str(d / name), "log_every": 5},
        **recipe,
    }
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    # 2 ranks forked as `accelerate launch` starts them (tests/helpers/launch.py): the launcher is not the subject
    out = train_ranks([str(path)], d, run_env(d / "ds_cache"), timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return d / name, out.stdout + out.stderr


def replies(model, tok, margin=2.0, first_margin=None):
    """(reply text, its last token, tokens generated) for each question, greedy, at most 20 new tokens; each
    token chosen by more than `margin` logits over the runner-up (the first token by `first_margin` if given)."""
    out = []
    for question in QUESTIONS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            gen = model.generate(
                **prompt, max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
        ids = gen.sequences[0, prompt["input_ids"].shape[1] :]
        gaps = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in gen.scores)]
        assert min(gaps[1:], default=margin + 1) > margin and gaps[0] > (first_margin or margin), (question, gaps)
        out.append((tok.decode(ids, skip_special_tokens=True), tok.convert_ids_to_tokens(int(ids[-1])), len(ids)))
    return out


def chat_data(sets, name, seq_len=96):
    return {"files": [sets[name]["train"]], "eval_files": [sets[name]["eval"]], "seq_len": seq_len}


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def sft_run(data):
    """Full SFT of a fresh tiny Llama (ChatML fallback: the tokenizer has no template), checkpoints off."""
    d, sets = data
    return launch(
        d,
        "sft",
        {
            "model": {
                "source": "llama-tiny",
                "config": {
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                },
            },
            "tokenizer": {"source": f"bpe:{d / 'tok'}"},
            "data": chat_data(sets, "a"),
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
            "train": {"steps": 30, "global_batch": 8},
            "checkpoint": {"enabled": False},
        },
    )


def test_an_sft_export_answers_with_its_reply_and_stops_at_the_end_of_turn(sft_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    run_dir, log = sft_run
    assert "<|im_start|>, <|im_end|> added as special tokens (2 new vocabulary rows)" in log
    assert not os.path.exists(run_dir / "checkpoints")  # checkpoints off, the final export all the same
    setup = next(line for line in log.splitlines() if "first step done in" in line)  # where the set-up time went
    assert "set-up took" in setup and "data (read, tokenize, pack)" in setup and "pipeline (build, load" in setup
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"))
    tok = AutoTokenizer.from_pretrained(str(run_dir / "hf"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (
        (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id)
        == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        == (0, 0, 1)
    )
    assert GenerationConfig.from_pretrained(str(run_dir / "hf")).eos_token_id == [tok.eos_token_id, im_end]
    for text, last, n in replies(model, tok):
        assert (text, last) == (REPLY, "<|im_end|>") and n < 20


@pytest.mark.slow
def test_a_lora_adapter_loads_offline_through_peft_and_answers(data, sft_run, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, sets = data
    base_dir = sft_run[0] / "hf"
    run_dir, log = launch(
        d,
        "lora",
        {
            "model": {"source": str(base_dir)},
            "data": chat_data(sets, "b"),
            "adapter": {
                "type": "lora",
                "r": 8,
                "alpha": 16,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            },
            "optimizer": {"lr": 2e-2, "weight_decay": 0.0},
            "train": {"steps": 60, "global_batch": 8},
        },
    )
    from safetensors.torch import load_file

    trainable = sum(t.numel() for t in load_file(str(run_dir / "adapter" / "adapter_model.safetensors")).values())
    total = trainable + sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(base_dir)).parameters())
    assert (
        f"LoRA r=8 alpha=16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: {trainable:,} "
        f"trainable of {total:,} parameters ({100 * trainable / total:.2f}%); the vocabulary is frozen" in log
    )
    assert f"(LoRA merged into the weights; the adapter alone is in {run_dir / 'adapter'})" in log
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    # the model source is a directory of this machine: its copy sits beside the adapter, named relative to it
    assert config["base_model_name_or_path"] == "base"
    monkeypatch.chdir(run_dir / "adapter")
    peft_model = AutoPeftModelForCausalLM.from_pretrained(".")  # HF_HUB_OFFLINE=1 here
    tok = AutoTokenizer.from_pretrained(".")
    for text, last, n in replies(peft_model, tok):
        assert (text, last) == (LORA_REPLY, "<|im_end|>") and n < 20
    for text, _, _ in replies(AutoModelForCausalLM.from_pretrained(str(base_dir)), tok):
        assert text == REPLY  # the base alone still gives its own reply: the adapter made the difference
    merged = replies(
        AutoModelForCausalLM.from_pretrained(str(run_dir / "hf")), AutoTokenizer.from_pretrained(str(run_dir / "hf"))
    )
    assert {r[0] for r in merged} == {LORA_REPLY}


@pytest.mark.slow
def test_after_a_tokenizer_swap_the_export_still_chats(data, sft_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, sets = data
    run_dir, log = launch(
        d,
        "swap",
        {
            "model": {"source": str(sft_run[0] / "hf")},
            "tokenizer": {"source": f"bpe:{d / 'tok2'}"},
            "data": chat_data(sets, "a"),
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
            "train": {"steps": 60, "global_batch": 8},
        },
    )
    assert "[swap]" in log and "chat template: the model's own, kept across the tokenizer swap" in log
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"))
    tok = AutoTokenizer.from_pretrained(str(run_dir / "hf"))
    assert len(tok) == model.config.vocab_size and model.config.eos_token_id == tok.eos_token_id
    for text, last, n in replies(model, tok):
        assert (text, last) == (REPLY, "<|im_end|>") and n < 20


@pytest.fixture(scope="module")
def text_base(data):
    """A tiny Llama pretrained on plain text with the BPE that has no chat template: a base model as downloaded,
    without a template or ChatML's tokens."""
    d, _ = data
    lines = (d / "tok.txt").read_text().splitlines()
    with open(d / "base.jsonl", "w") as f:  # two lines per document: the base has seen "\n" (ChatML uses it)
        for a, b in zip(lines[::2], lines[1::2]):
            f.write(json.dumps({"text": f"{a}\n{b}"}) + "\n")
    return launch(
        d,
        "text_base",
        {
            "model": {"source": "llama-tiny", "config": TINY},
            "tokenizer": {"source": f"bpe:{d / 'tok'}"},
            "data": {"files": [str(d / "base.jsonl")], "format": "text", "seq_len": 64},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
            "train": {"steps": 30, "global_batch": 8},
            "checkpoint": {"enabled": False},
        },
    )


@pytest.mark.slow
def test_lora_on_a_base_without_a_template_learns_to_end_its_turn(data, text_base, monkeypatch):
    """LoRA chat SFT of a base whose tokenizer has no chat template: ChatML's <|im_start|> / <|im_end|> are added
    with fresh rows, which train under LoRA (adapter.train_new_tokens, each rank its shard's rows) and are saved
    in adapter/ as peft's trainable_token_indices: AutoPeftModelForCausalLM, offline, answers and stops at
    <|im_end|>. With those rows frozen (the old behaviour) the end of turn is never learned."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    d, sets = data
    run_dir, log = launch(
        d,
        "lora_no_template",
        {
            "model": {"source": str(text_base[0] / "hf")},
            "data": chat_data(sets, "a"),
            "adapter": {"type": "lora", "r": 8, "alpha": 16, "target_modules": ALL_LINEAR},
            "optimizer": {"lr": 2e-2, "weight_decay": 0.0},
            "train": {"steps": 60, "global_batch": 8},
        },
    )
    assert "<|im_start|>, <|im_end|> added as special tokens (2 new vocabulary rows)" in log
    assert "LoRA also trains the embedding and output rows of 2 tokens (<|im_start|>, <|im_end|>" in log
    tok = AutoTokenizer.from_pretrained(str(run_dir / "adapter"))
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"embed_tokens": ids, "lm_head": ids}
    monkeypatch.chdir(run_dir / "adapter")  # its base, beside it, is named relative to it
    peft_model = AutoPeftModelForCausalLM.from_pretrained(".")  # HF_HUB_OFFLINE=1 here
    # every token by a margin of 2 logits, <|im_end|> included, but the first: after "<|im_start|>assistant\n"
    # the text base's prior is flat, and 60 LoRA steps lift the reply's first word by ~0.75 logits (measured);
    # with the ChatML rows frozen (train_new_tokens: false, the old behaviour) the reply never stops (measured:
    # 20 tokens, the reply repeated)
    for text, last, n in replies(peft_model, tok, first_margin=0.3):
        assert (text, last) == (REPLY, "<|im_end|>") and n < 20
