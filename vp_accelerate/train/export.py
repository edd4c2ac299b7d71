"""Turn a pipeline checkpoint (per-rank shards) into one HF model directory, in a single process.

The first data-parallel replica's ranks hold every tensor once; vocabulary shards are concatenated in
pipeline-rank order and cut to `vocab_size` rows, tensors duplicated across ranks (the baseline's tied
embedding copy) are taken once. The config and tokenizer saved in the checkpoint go beside the
weights, so `AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)` work.

A LoRA run's checkpoint holds the frozen base weights and the adapters: export merges them (W + alpha/r·BA)
into a plain HF model, or with `adapter_only` writes a peft adapter folder (`PeftModel.from_pretrained`).
"""

from __future__ import annotations

import os
import shutil

from . import checkpoint as ckpt


def _adapter_of(meta: dict):
    """The run's AdapterConfig when it trained LoRA adapters, else None."""
    from vp_accelerate.runtime.adapter_config import AdapterConfig

    section = (meta.get("recipe") or {}).get("adapter") or {}
    adapter = AdapterConfig(**section) if section else AdapterConfig()
    return adapter if adapter.enabled else None


def export_checkpoint(path: str, out_dir: str, max_shard_size: str = "5GB", adapter_only: bool = False) -> str:
    """Write the HF model dir for checkpoint `path` (a step dir, or a checkpoint root with `latest`), or
    its LoRA adapter folder (`adapter_only`)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from vp_accelerate.models.export import assemble_state_dict, save_hf

    path = ckpt.resolve(path)
    meta = ckpt.read_meta(path)
    replica0 = sorted((r for r in meta["ranks"] if r["dp_rank"] == 0), key=lambda r: r["pp_rank"])
    if not replica0:
        raise ckpt.CheckpointError(f"{path}: meta.json lists no ranks of data-parallel replica 0")
    shards = []
    for r in replica0:
        sd = load_file(os.path.join(path, ckpt.rank_dir_name(r["rank"]), "model.safetensors"))
        shards.append({k: v for k, v in sd.items() if k not in set(r.get("duplicates", ()))})
    state = assemble_state_dict(shards, meta["vocab_size"], frozenset(meta.get("sharded_names", ())))
    model_dir = os.path.join(path, "model")
    config = AutoConfig.from_pretrained(model_dir)
    adapter = _adapter_of(meta)
    if adapter_only:
        if adapter is None or adapter.train_vocab:
            raise ckpt.CheckpointError(f"{path}: no LoRA adapter to export alone (adapter.type is null, or "
                                       f"adapter.train_vocab trained the vocabulary too); export the full model")
        from vp_accelerate.models.lora import save_adapter

        save_adapter(state, config, adapter, meta.get("lora_transposed", []), out_dir)
        return out_dir
    if adapter is not None:
        from vp_accelerate.models.lora import merge_lora

        state = merge_lora(state, adapter.scaling, meta.get("lora_transposed", []))
    save_hf(state, config, out_dir, max_shard_size=max_shard_size)
    for name in os.listdir(model_dir):  # tokenizer files (config.json was just written by save_hf)
        if name != "config.json":
            shutil.copy2(os.path.join(model_dir, name), os.path.join(out_dir, name))
    return out_dir
