"""LoRA adapters (through `peft`) on one rank's stage chunks, and the two ways to export them.

`apply_lora` injects peft's LoRA layers into every stage chunk of the rank (`peft.inject_adapter_in_model`:
the same `lora.Linear` modules `get_peft_model` puts in a whole model), freezes everything else, and
initialises each adapter from (seed, its HF module name) — so the initial adapters do not depend on how
the model was cut, and a single-process peft model gets the very same ones from `init_lora_weights`.

Adapter parameters keep peft's names under the HF module path, e.g.
`model.layers.3.self_attn.q_proj.lora_A.default.weight`; the adapted layer's own weight becomes
`...q_proj.base_layer.weight`. Export either merges (`merge_lora`: W + alpha/r · B·A, an ordinary HF
state dict) or writes a peft adapter folder (`save_adapter`) that `PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

ADAPTER_NAME = "default"


def target_modules_for(config, target_modules) -> list[str]:
    """The module names to adapt: the configured ones, else peft's default for the model type."""
    if target_modules:
        return list(target_modules)
    # peft is optional (the `lora` extra): imported where LoRA is used, never by a full fine-tune
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    found = DEFAULTS.get(config.model_type)
    if not found:
        raise ValueError(
            f"adapter.target_modules: peft has no default LoRA targets for model type "
            f"{config.model_type!r}; list the linear layers to adapt (e.g. [q_proj, v_proj])"
        )
    return list(found)


def lora_config(config, adapter, transposed: bool = False):
    """The `peft.LoraConfig` of an `AdapterConfig` (what the adapter folder records)."""
    from peft import LoraConfig  # optional dependency (the `lora` extra)

    return LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=target_modules_for(config, adapter.target_modules),
        fan_in_fan_out=transposed,
        task_type="CAUSAL_LM",
    )


def lora_modules(module: nn.Module, prefix_of=lambda name: name):
    """(HF module name, peft LoRA layer) for every adapted layer under `module`."""
    from peft.tuners.lora import LoraLayer  # optional dependency (the `lora` extra)

    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer):
            yield prefix_of(name), sub


def init_lora_weights(named_layers, seed: int) -> None:
    """peft's default init (A: Kaiming-uniform, B: zero), with A drawn from a generator seeded by
    (seed, HF module name): the same adapters whatever the pipeline layout, and in a plain peft model."""
    with torch.no_grad():
        for name, layer in named_layers:
            a = layer.lora_A[ADAPTER_NAME].weight
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            values = torch.empty(a.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=g)
            a.copy_(values)
            layer.lora_B[ADAPTER_NAME].weight.zero_()


def apply_lora(mods, adapter, seed: int, dtype: torch.dtype) -> list[str]:
    """Inject LoRA into the rank's stage chunks, freeze the rest (the vocabulary too unless
    `adapter.train_vocab`). Returns the HF names of adapted modules whose base is a transposed
    (GPT-2 Conv1D, fan_in_fan_out) linear layer, which merging must know."""
    from peft import inject_adapter_in_model  # optional dependency (the `lora` extra)

    transposed = []
    for chunk in mods.chunks.values():
        has_conv = any(isinstance(m, Conv1D) for m in chunk.modules())
        cfg = lora_config(mods.config, adapter, transposed=has_conv)
        try:
            inject_adapter_in_model(cfg, chunk, adapter_name=ADAPTER_NAME)
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(f"adapter.target_modules: {e}") from None
        chunk.to(dtype)
        named = list(lora_modules(chunk, lambda n, c=chunk: c.hf_name(f"{n}.x").rsplit(".", 1)[0]))
        init_lora_weights(named, seed)
        transposed += [n for n, layer in named if isinstance(layer.get_base_layer(), Conv1D)]
        for name, p in chunk.named_parameters():
            p.requires_grad_(".lora_" in name)
    for p in (
        mods.embed_weight,
        mods.head_weight,
        mods.embed.weight if mods.embed else None,
        mods.head.weight if mods.head else None,
    ):
        if p is not None:
            p.requires_grad_(adapter.train_vocab)
    return transposed


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merge_lora(state: dict[str, torch.Tensor], scaling: float, transposed=()) -> dict[str, torch.Tensor]:
    """A plain HF state dict from one with adapters: W + scaling · B·A (transposed for fan_in_fan_out layers),
    `base_layer.` dropped from the names, the adapter tensors removed."""
    transposed = set(transposed)
    out = {}
    for name, t in state.items():
        if is_lora_name(name):
            continue
        if ".base_layer." not in name:
            out[name] = t
            continue
        module, _, leaf = name.partition(".base_layer.")
        if leaf == "weight":
            a = state[f"{module}.lora_A.{ADAPTER_NAME}.weight"].double()
            b = state[f"{module}.lora_B.{ADAPTER_NAME}.weight"].double()
            delta = scaling * (b @ a)
            t = (t.double() + (delta.t() if module in transposed else delta)).to(t.dtype)
        out[f"{module}.{leaf}"] = t
    return out


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors under the names peft saves (`base_model.model.<module>.lora_A.weight`)."""
    return {
        "base_model.model." + n.replace(f".{ADAPTER_NAME}.", "."): t.contiguous()
        for n, t in state.items()
        if is_lora_name(n)
    }


def save_adapter(
    state: dict[str, torch.Tensor],
    config,
    adapter,
    transposed,
    out_dir,
    base_model_name_or_path: str | None = None,
    tokenizer=None,
) -> Path:
    """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors, and the tokenizer when
    given: `AutoPeftModelForCausalLM` reads it from the folder instead of asking the hub).

    `base_model_name_or_path` is what `AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads the base from
    (a hub id or a directory; without it, only `PeftModel.from_pretrained(base, out_dir)` works)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = lora_config(config, adapter, transposed=bool(transposed))
    cfg.base_model_name_or_path = base_model_name_or_path
    cfg.save_pretrained(str(out))
    save_file(adapter_state_dict(state), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def parameter_counts(named_parameters, is_duplicate=lambda name: False) -> tuple[int, int]:
    """(trainable, total) parameters of one rank, a tied copy (`is_duplicate`) counted once over the ranks."""
    own = [(p.numel(), p.requires_grad) for n, p in named_parameters if not is_duplicate(n)]
    return sum(n for n, trains in own if trains), sum(n for n, _ in own)


def describe_adapter(adapter, config, trainable: int, total: int) -> str:
    """The line a LoRA run starts with: what is adapted and how many parameters train."""
    vocab = "trains (adapter.train_vocab)" if adapter.train_vocab else "is frozen"
    targets = ", ".join(target_modules_for(config, adapter.target_modules))
    share = 100 * trainable / max(total, 1)
    return (
        f"LoRA r={adapter.r} alpha={adapter.alpha:g} on {targets}: {trainable:,} trainable of {total:,} "
        f"parameters ({share:.2f}%); the vocabulary {vocab}"
    )
