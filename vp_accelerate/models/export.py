"""Put the ranks' pieces back together as one Hugging Face model directory, and decide how (`export_hf`).

Each rank's `RankModules.state_dict()` names its tensors like the HF model; vocabulary shards carry
the full matrix's name and are concatenated in rank order, then cut to `vocab_size` rows (the
padding rows are dropped). A tied output weight is stored once, under the embedding's name, and
`save_pretrained` writes the HF layout `from_pretrained` expects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .generation import generation_config_for, with_tokenizer_ids
from .meta import meta_model
from .stream_export import streams
from .tensor_parallel import join_packed


def assemble_state_dict(
    rank_state_dicts: Sequence[dict[str, torch.Tensor]],
    vocab_size: int,
    sharded_names: frozenset[str] | set[str] = frozenset(),
    tp_sliced: dict[str, int] | None = None,
    tp_packed: dict[str, list[int]] | None = None,
    tp_vocab: frozenset[str] | set[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """One full HF state dict from per-rank state dicts given in vocabulary-rank order (pipeline-rank order
    without tensor parallelism).

    `sharded_names` (a RankModules' `sharded_names`) are row shards to concatenate and cut to
    `vocab_size` rows; `tp_sliced` (name -> dim) are tensor-parallel slices, joined along their dim in the
    order the ranks hold them (a stage's TP ranks are consecutive); every other name is taken from the first
    rank holding it; `tp_packed` (name -> parts) are fused projections whose slices hold 1/tp of each part;
    `tp_vocab` (a RankModules' `tp_vocab_names`) are TP row slices of a padded vocabulary matrix, cut to
    `vocab_size` rows once joined. Works offline on per-rank checkpoints.
    """
    out: dict[str, torch.Tensor] = {}
    packed = tp_packed or {}
    for name, dim in (tp_sliced or {}).items():
        pieces = [sd[name].detach().cpu() for sd in rank_state_dicts if name in sd]
        out[name] = join_packed(pieces, packed[name]) if name in packed else torch.cat(pieces, dim)
        if name in tp_vocab:  # the baseline's end-stage vocabulary split over TP: the padding rows dropped
            out[name] = out[name][:vocab_size].clone()
    for name in sharded_names:
        shards = [sd[name] for sd in rank_state_dicts if name in sd]
        if len(shards) != len(rank_state_dicts):
            raise ValueError(f"{name} is sharded but only {len(shards)} of {len(rank_state_dicts)} ranks hold a shard")
        full = torch.cat([s.detach().cpu() for s in shards])
        if full.shape[0] < vocab_size:
            raise ValueError(f"{name}: shards hold {full.shape[0]} rows, fewer than vocab_size={vocab_size}")
        out[name] = full[:vocab_size].clone()
    for sd in rank_state_dicts:
        for name, t in sd.items():
            if name not in out:
                out[name] = t.detach().cpu()
    return out


def save_hf(
    state_dict: dict[str, torch.Tensor],
    config,
    out_dir: str | Path,
    *,
    tokenizer=None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """`save_pretrained` a full state dict with its config, without allocating a second copy of the model.

    With a `tokenizer`, it is saved beside the weights, and its bos/eos/pad ids go into config.json and
    generation_config.json (generation also stopping at its chat template's end-of-turn token), so the
    directory is ready for `generate()`; the caller's `config` is not changed.
    """
    if tokenizer is not None:
        config = with_tokenizer_ids(config, tokenizer)
    dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    model = meta_model(config, dtype)
    expected = set(model.state_dict())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    missing = sorted(
        k
        for k in expected - set(state_dict)
        if not (tied and model.get_output_embeddings().weight is model.get_parameter(k))
    )
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"assembled state dict does not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state_dict, strict=False, assign=True)
    if tied:
        model.tie_weights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if tokenizer is not None:
        generation_config_for(tokenizer).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def gather_state_dict(mods, group: dist.ProcessGroup | None = None, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective over the pipeline group: the full HF state dict on group rank `dst`, None elsewhere.

    Group rank order must be vocabulary-rank order (pipeline-rank order without tensor parallelism; it is for
    the groups runtime.groups builds). The full
    model is held on `dst` (CPU), as writing one HF directory needs.
    """
    local = {name: t.detach().cpu() for name, t in mods.state_dict().items() if not mods.is_duplicate(name)}
    me = dist.get_rank(group)
    gathered = [None] * dist.get_world_size(group) if me == dst else None
    dist.gather_object(
        (local, mods.tp_sliced, mods.tp_packed, mods.tp_vocab_names), gathered, group=group, group_dst=dst
    )
    if me != dst:
        return None
    sliced = {n: d for _, part, _, _ in gathered for n, d in part.items()}
    packed = {n: p for _, _, part, _ in gathered for n, p in part.items()}
    vocab = {n for *_, part in gathered for n in part}
    states = [sd for sd, *_ in gathered]
    return assemble_state_dict(states, mods.vocab_size, mods.sharded_names, sliced, packed, vocab)


def export_hf(
    config,
    out_dir: str | Path,
    *,
    stream: Callable[[torch.dtype | None], Path | None],
    gather: Callable[[], dict[str, torch.Tensor] | None],
    merged: bool = False,
    dtype: torch.dtype | None = None,
    tokenizer=None,
    max_shard_size: int | str = "5GB",
) -> Path | None:
    """Write one HF model directory: the one place that decides whether an export streams or gathers, for a
    live pipeline (`runtime/model_io.py`, a collective) and a checkpoint (`train/persist/hf_export.py`)
    alike.

    It streams (`stream(dtype)`: every rank, or every rank file, writes its own tensors, `models/stream_export.py`)
    when nothing is `merged` into the weights (LoRA adapters) and the family saves under its own names
    (`stream_export.streams`); else `gather()` returns the full HF state dict, adapters merged (None on ranks
    that do not write), its floating tensors are cast to `dtype` (None: as they are) and `save_hf` writes it,
    converting the names as `save_pretrained` does. Returns the directory where written, None elsewhere."""
    if not merged and streams(config):
        return stream(dtype)
    state = gather()
    if state is None:
        return None
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    return save_hf(state, config, out_dir, tokenizer=tokenizer, max_shard_size=max_shard_size)
