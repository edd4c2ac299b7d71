"""A pipeline's weights in and out: per-rank state dicts, the gathered HF model, the peft adapter folder.

Plain functions over a `PipelineModel` (its modules, layout, groups and adapter); `PipelineModel`'s
methods of the same names call them. Gathers run over the pipeline's gloo side group, so a GPU run
never stages the model through device memory; only data-parallel replica 0 writes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vp_accelerate.models import gather_state_dict
from vp_accelerate.models.export import export_hf as export_gathered_or_streamed
from vp_accelerate.models.lora import is_lora_name, merge_lora, save_adapter
from vp_accelerate.models.stream_export import export_streaming


def rank_state_dict(pipe) -> dict[str, torch.Tensor]:
    """This rank's parameters by HF-style name (shards of vocabulary matrices keep their shard shape)."""
    return {n: p.detach() for n, p in pipe.named_parameters()}


@torch.no_grad()
def load_rank_state_dict(pipe, sd: dict[str, torch.Tensor]) -> None:
    """Load what `rank_state_dict` wrote on this rank; a layout or vocabulary mismatch names itself."""
    own = dict(pipe.named_parameters())
    missing, unexpected = set(own) - set(sd), set(sd) - set(own)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match this rank's layout: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; it was saved with another pipeline layout or model"
        )
    for n, p in own.items():
        if sd[n].shape != p.shape:
            raise ValueError(
                f"checkpoint tensor {n} has shape {tuple(sd[n].shape)}, this rank expects "
                f"{tuple(p.shape)}: it was saved with another layout or vocabulary size"
            )
        p.copy_(sd[n])


def gather_hf_state_dict(pipe) -> dict[str, torch.Tensor] | None:
    """The whole model's HF state dict on pipeline rank 0 (None elsewhere); a collective. With LoRA the
    adapters stay separate (`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`)."""
    # host copies over gloo; with tensor parallelism every TP rank's slices too (vocabulary-rank order)
    return gather_state_dict(pipe.mods, group=pipe.groups.replica_host_group, dst=0)


def export_hf(pipe, out_dir, tokenizer=None, dtype: torch.dtype | None = None) -> None:
    """Write one HF model directory (a collective), streamed or gathered as `models/export.export_hf` decides:
    streamed, each pipeline rank of replica 0 writes its own tensors and the vocabulary matrices are gathered
    one at a time (`models/stream_export.py`), in `dtype` (None: the parameters'); LoRA adapters (see
    `export_adapter` for a peft adapter folder) and families that save under other names are gathered to
    pipeline rank 0, merged there and saved by `save_pretrained`."""
    g = pipe.groups

    def stream(dtype):
        return export_streaming(
            pipe.mods,
            pipe.hf_config,
            out_dir,
            group=g.pp_host_group if g.tp_size == 1 else g.replica_host_group,  # the replica's pp x tp ranks
            pp_rank=g.pp_rank,
            pp_size=g.pp_size,
            write=g.dp_rank == 0,
            dtype=dtype,
            tokenizer=tokenizer,
            tp_rank=g.tp_rank,
        )

    def gather():
        sd = gather_hf_state_dict(pipe)
        transposed = _all_lora_transposed(pipe)  # a collective: every rank, before any returns
        if sd is None or g.dp_rank != 0:
            return None
        return merge_lora(sd, pipe.adapter.scaling, transposed)  # no adapter: the names as they are

    export_gathered_or_streamed(
        pipe.mods.config,
        out_dir,
        stream=stream,
        gather=gather,
        merged=pipe.adapter.enabled,  # tensor-parallel slices: joined by either (stream_export's TPLayout)
        dtype=dtype,
        tokenizer=tokenizer,
    )


def _all_lora_transposed(pipe) -> list[str]:
    """Every pipeline rank's adapted Conv1D (fan_in_fan_out) module names; a collective."""
    group = pipe.groups.pp_host_group
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, pipe.lora_transposed, group=group)
    return sorted(n for names in parts for n in names)


def export_adapter(pipe, out_dir, base_model_name_or_path: str | None = None, tokenizer=None) -> None:
    """Write a peft adapter folder (`PeftModel.from_pretrained(base_model, out_dir)` loads it; with
    `base_model_name_or_path` and `tokenizer`, `AutoPeftModelForCausalLM.from_pretrained(out_dir)` too) on
    rank 0; a collective over the pipeline ranks. Trained vocabulary rows go in as peft saves them:
    `trainable_token_indices` rows, or (adapter.train_vocab) the whole matrices as `modules_to_save`."""
    if not pipe.adapter.enabled:
        raise ValueError("export_adapter: this model has no adapter (adapter.type is null); use export_hf")
    g = pipe.groups
    # trained rows in every rank's shard, or (tensor parallelism) adapters in TP slices: gather all, slices joined
    if pipe.adapter.trainable_tokens or pipe.adapter.train_vocab or g.tp_size > 1:
        sd, transposed = gather_hf_state_dict(pipe), _all_lora_transposed(pipe)
        if sd is not None and g.dp_rank == 0:
            save_adapter(
                sd, pipe.mods.config, pipe.adapter, transposed, out_dir, base_model_name_or_path, tokenizer=tokenizer
            )
        return
    local = {n: p.detach().cpu() for n, p in pipe.named_parameters() if is_lora_name(n)}
    gathered = [None] * dist.get_world_size(g.pp_host_group) if g.pp_rank == 0 else None
    dist.gather_object((local, pipe.lora_transposed), gathered, group=g.pp_host_group, group_dst=0)
    if g.pp_rank == 0 and g.dp_rank == 0:
        state = {n: t for part, _ in gathered for n, t in part.items()}
        transposed = [n for _, names in gathered for n in names]
        save_adapter(
            state, pipe.mods.config, pipe.adapter, transposed, out_dir, base_model_name_or_path, tokenizer=tokenizer
        )
