"""A LoRA run that resized a hub model's vocabulary writes an adapter folder that `AutoPeftModelForCausalLM` loads
from any working directory: it names the hub id (no relative path, which peft resolves against the working
directory) and carries the run's embedding and output layer (peft's modules_to_save), which peft puts over the
hub model it first grows to the folder's tokenizer. Before, the folder named `base`, a resized base written beside
it, and loaded only from inside the folder. Loaded from another directory (offline, the hub model in a hub cache),
its logits are the merged export's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.tiny import tiny_config, word_tokenizer

peft = pytest.importorskip("peft", reason="LoRA needs the lora extra (pip install peft)")

LOAD = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
ids = torch.tensor([json.loads(sys.argv[3])])
with torch.no_grad():
    a = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()(input_ids=ids).logits
    b = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()(input_ids=ids).logits
print(json.dumps({"diff": (a - b).abs().max().item(), "scale": b.abs().max().item(), "rows": a.shape[-1]}))
"""


@pytest.mark.parametrize("tie", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_resized_vocabulary_adapter_loads_from_any_directory(tmp_path, tie):
    from peft import LoraConfig, inject_adapter_in_model

    from vp_accelerate.models.export import save_hf
    from vp_accelerate.train.persist.hf_export import write_exports

    tok = AutoTokenizer.from_pretrained(str(word_tokenizer(tmp_path)))
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "0123abc"
    torch.manual_seed(0)
    hub = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok), num_layers=2, tie=tie))
    save_hf(hub.state_dict(), hub.config, str(snapshot), tokenizer=tok)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0123abc")  # the cache's pointer to the snapshot
    # the run: two tokens added, the vocabulary grown to the tokenizer, adapters trained (random B here)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<|call|>"]})
    hub.resize_token_embeddings(len(tok))
    with torch.no_grad():
        hub.get_input_embeddings().weight[-2:] = torch.randn(2, hub.config.hidden_size)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), hub)
    with torch.no_grad():
        for n, p in hub.named_parameters():
            if "lora_B" in n:
                p.normal_()
    recipe = {
        "model": {"source": str(snapshot), "pretrained_weights": True},
        "adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    }
    write_exports(hub.state_dict(), hub.config, tok, recipe, [], str(tmp_path / "hf"), str(tmp_path / "adapter"))

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/tiny" and not (tmp_path / "adapter" / "base").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": os.getcwd()}
    ids = json.dumps(tok("hello world <|tool|> paris <|call|>")["input_ids"])
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(tmp_path / "adapter"), str(tmp_path / "hf"), ids],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == len(tok) and got["diff"] <= 1e-5 * got["scale"], got
