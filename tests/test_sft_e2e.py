"""SFT end to end under a real 2-process `accelerate launch`: the demo chat set, chat format detected,
LoRA adapters; the checkpoint exports merged (reproducing the run's eval loss on the packed chat batches
through plain HF) and as a peft adapter folder (the same logits through PeftModel); the run's own adapter
folder loads offline through AutoPeftModelForCausalLM."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")


@pytest.mark.slow
def test_chat_lora_run_exports_merged_and_adapter(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    pytest.importorskip("babel")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.tiny import TINY_MODEL, bpe, recipe_file
    from vp_accelerate.demo.chat import make_demo_chat
    from vp_accelerate.train.cli.commands import export_main
    from vp_accelerate.train.data import build_data
    from vp_accelerate.train.recipe import load_recipe

    make_demo_chat(str(tmp_path / "chat"), conversations=400, seed=1)
    text = tmp_path / "tok.txt"
    with open(text, "w") as f:
        for line in open(tmp_path / "chat" / "train.jsonl"):
            f.write(" ".join(m["content"] for m in json.loads(line)["messages"]) + "\n")
    bpe([text], tmp_path, 512)
    path = tmp_path / "recipe.yaml"
    recipe_file(
        path,
        tmp_path / "tok",
        [tmp_path / "chat" / "train.jsonl"],
        model={"config": {**TINY_MODEL["config"], "hidden_size": 64, "intermediate_size": 128}},
        data={"eval_files": [str(tmp_path / "chat" / "eval.jsonl")], "seq_len": 128},
        pipeline={"schedule": "vhalf", "method": "vocab-1", "microbatches": 4},
        adapter={"type": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        optimizer={"lr": 1e-2},
        train={"steps": 4, "global_batch": 8},
        eval={"batches": 2},
        checkpoint={"dir": str(tmp_path / "ckpt")},
        logging={"output_dir": str(tmp_path / "run"), "log_every": 1},
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "ds_cache"),
    }
    out = subprocess.run(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            os.path.join(ROOT, "configs", "accelerate_cpu_2proc.yaml"),
            "-m",
            "vp_accelerate",
            "train",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    final_eval = [r["eval/loss"] for r in rows if "eval/loss" in r][-1]
    assert all(0 < r["train/step_loss_tokens"] < 8 * 128 / 2 for r in rows if "train/step_loss_tokens" in r)

    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    rec = load_recipe(str(path))
    _, evals = build_data(rec.data, tok, merged.config.vocab_size, rec.train.seed, 8, eval_batches=2)
    total = count = 0.0
    with torch.no_grad():
        for b in evals:  # the packed chat batches, positions restarting per conversation
            logits = merged(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            targets = b["labels"][:, 1:].reshape(-1)
            total += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="sum"
            ).item()
            count += int((targets != -100).sum())
    assert total / count == pytest.approx(final_eval, rel=1e-5)  # the token mean over the whole evaluation set

    # the adapter folder on the run's frozen base weights (the checkpoint's base_layer tensors, renamed)
    from safetensors.torch import load_file

    from vp_accelerate.models.export import assemble_state_dict, save_hf
    from vp_accelerate.models.lora import merge_lora
    from vp_accelerate.train.persist import store as ckpt

    step = ckpt.resolve(str(tmp_path / "ckpt"))
    meta = ckpt.read_meta(step)
    shards = [
        load_file(os.path.join(step, ckpt.rank_dir_name(r["rank"]), "model.safetensors"))
        for r in sorted(meta["ranks"], key=lambda r: r["pp_rank"])
    ]
    state = assemble_state_dict(shards, meta["vocab_size"], frozenset(meta["sharded_names"]))
    save_hf(merge_lora(state, 0.0), merged.config, tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float64)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    ids = evals[0]["input_ids"][:2]
    with torch.no_grad():  # merged weights were rounded to float32 once: float32 tolerance
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    # the run wrote its adapter folder beside the merged hf/ and said so; its fresh base exists nowhere else, so
    # it sits in adapter/base, and the folder loads offline as it is, tokenizer included
    from peft import AutoPeftModelForCausalLM

    log = out.stdout + out.stderr
    assert "LoRA r=4 alpha=8 on q_proj, v_proj, down_proj: " in log and " trainable of " in log
    assert "(LoRA merged into the weights; the adapter alone is in " in log
    folder = tmp_path / "run" / "adapter"
    # named relative to the folder, never a path of this machine: a copy loads elsewhere, from inside it
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    folder = shutil.copytree(folder, tmp_path / "elsewhere" / "adapter")
    monkeypatch.chdir(folder)
    auto = AutoPeftModelForCausalLM.from_pretrained(".", dtype=torch.float64)
    assert len(AutoTokenizer.from_pretrained(".")) == auto.get_input_embeddings().weight.shape[0]
    with torch.no_grad():
        torch.testing.assert_close(auto(input_ids=ids).logits, loaded(input_ids=ids).logits, rtol=1e-12, atol=1e-12)
