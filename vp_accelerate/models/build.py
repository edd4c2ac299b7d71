"""Build what one pipeline rank holds, materializing nothing else.

The whole HF model is first built on the meta device (no memory), its parts are located with
`find_parts`, and only this rank's modules are materialized on CPU and filled from the source:

- a `PretrainedConfig`: fresh init, deterministic given `seed` (see `weights.py`): every rank's
  layers and shards equal the corresponding parts of the same full init, for any layout / p;
- a `PreTrainedModel`: its tensors are copied (a test's HF reference);
- a local checkpoint directory (safetensors, sharded or not): only the tensors this rank needs are
  read, and of the embedding / lm_head only the shard's rows;
- a `CheckpointSource` (a checkpoint dir with config overrides and a resized / re-tokenized
  vocabulary, see `checkpoint_source.py`): the same, each vocabulary row built by its `RowMap`.

`vocab_size` resizes before sharding: rows past the source's vocabulary are the mean of the old
rows (fp32 mean; HF's mean resizing samples around that mean with covariance 1e-9·Σ, i.e. the
same rows up to ~1e-5 of their scale). Padded shard rows are zero.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from vp_accelerate.model_config import read_config_json
from vp_accelerate.vocab.partition import VocabPartition

from .adapter import ModelParts, find_parts
from .checkpoint_source import CheckpointSource
from .layout import LayoutError, StageLayout
from .meta import meta_model
from .rank import PLACEMENTS, RankModules
from .row_map import RowMap
from .stage import FullEmbedding, FullHead, StageChunk, TPEmbedding, TPHead
from .tensor_parallel import TPSpec, layer_plan, shard_layer
from .weights import (
    ConvertedSource,
    SafetensorsSource,
    StateDictSource,
    WeightSource,
    mean_rows,
    seeded_init,
    seeded_vocab_rows,
)


def resolve_config(source):
    """The HF config of a config, a model, or a local checkpoint directory."""
    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, CheckpointSource):
        return source.config
    if isinstance(source, nn.Module) and hasattr(source, "config"):
        return source.config
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        if (Path(source) / "config.json").is_file():  # its sizes checked before transformers reads them
            read_config_json(Path(source) / "config.json")
        return AutoConfig.from_pretrained(source)
    raise TypeError(
        f"source must be a PretrainedConfig, a PreTrainedModel or a local checkpoint directory, got {source!r}"
    )


def _weight_source(source, model: nn.Module) -> WeightSource | None:
    if isinstance(source, CheckpointSource):
        return ConvertedSource(SafetensorsSource(source.path), model)
    if isinstance(source, nn.Module):
        return StateDictSource(source)
    if isinstance(source, (str, Path)):
        # checkpoint names -> the model's names (renamed heads, fused experts), as from_pretrained converts them
        return ConvertedSource(SafetensorsSource(source), model)
    return None  # a config: fresh init


@torch.no_grad()
def _materialize(
    module: nn.Module,
    hf_name,
    source: WeightSource | None,
    model: nn.Module,
    seed: int,
    init_name: str,
    dtype: torch.dtype,
) -> nn.Module:
    """Allocate `module` on CPU and fill it: from the source by HF name, or by seeded init."""
    module.to_empty(device="cpu")
    persistent = module.state_dict(keep_vars=True)
    # Non-persistent buffers are in no checkpoint: the model's own init computes them (then the
    # checkpoint overwrites the parameters).
    non_persistent = {n for n, _ in module.named_buffers()} - set(persistent)
    if source is None or non_persistent:
        seeded_init(model, module, seed, init_name)
    if source is None:
        return module
    missing = [hf_name(k) for k in persistent if not source.has(hf_name(k))]
    if missing:
        raise KeyError(f"checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    # a bar on the first process, on a terminal only (tqdm's disable=None): large checkpoints take a while
    main = os.environ.get("RANK", "0") == "0"
    for k, t in tqdm(
        persistent.items(), desc="loading weights", unit="tensor", leave=False, disable=None if main else True
    ):
        t.copy_(source.get(hf_name(k)).to(dtype if t.is_floating_point() else t.dtype))
    return module


@torch.no_grad()
def vocab_rows(
    parts: ModelParts,
    which: str,
    start: int,
    end: int,
    row_map: RowMap,
    source: WeightSource | None,
    model: nn.Module,
    seed: int,
    dtype: torch.dtype,
    means: dict | None = None,
) -> torch.Tensor:
    """Rows [start, end) of the embedding ("embed") or lm_head ("head") matrix, made by `row_map`.

    Each row is copied from a source row, the mean of several (a re-tokenized vocabulary's composed
    tokens) or the mean of all source rows (resizing); rows >= row_map.num_rows are zero padding. Only
    the source rows that [start, end) needs are read; `means` (HF name -> fp32 mean) avoids reading the
    whole matrix for the overall mean.
    """
    h = parts.embed.embedding_dim
    use_head = which == "head" and not parts.tied
    name = f"{parts.names.lm_head}.weight" if use_head else f"{parts.names.embed}.weight"
    kind = "head" if use_head else "embed"
    old_v = row_map.source_rows

    def read(s: int, e: int) -> torch.Tensor:
        if source is not None:
            return source.rows(name, s, e)
        return seeded_vocab_rows(model, kind, name, s, e, old_v, h, dtype, seed, parts.padding_idx)

    def overall_mean() -> torch.Tensor:
        if means and name in means:
            return means[name]
        return mean_rows(source, name, old_v, h, init=read)

    return row_map.rows(read, start, end, h, dtype, overall_mean)


@torch.no_grad()
def bias_rows(
    parts: ModelParts,
    start: int,
    end: int,
    row_map: RowMap,
    source: WeightSource | None,
    model: nn.Module,
    seed: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Entries [start, end) of the lm_head bias, made by `row_map` like the weight's rows (padding: 0)."""
    name = f"{parts.names.lm_head}.bias"
    old_v = row_map.source_rows

    def read(s: int, e: int) -> torch.Tensor:
        if source is not None:
            return source.rows(name, s, e).to(dtype)[:, None]
        return seeded_vocab_rows(model, "bias", name, s, e, old_v, parts.embed.embedding_dim, dtype, seed)[:, None]

    return row_map.rows(read, start, end, 1, dtype, lambda: read(0, old_v).to(torch.float64).mean(0))[:, 0]


def _new_param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=True)


def build_rank(
    source,
    layout: StageLayout,
    rank: int,
    placement: str = "vocab",
    partition=None,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    vocab_size: int | None = None,
    attn_implementation: str | None = None,
    device: torch.device | str = "cpu",
    tp: TPSpec | None = None,
) -> RankModules:
    """Build the modules `layout` puts on `rank`.

    source: a `PretrainedConfig` (fresh seeded init), a `PreTrainedModel` (copy its weights), a
    local HF checkpoint directory (safetensors) or a `CheckpointSource`. placement: "baseline" or "vocab". partition: a
    `vocab.VocabPartition(vocab_size, layout.num_ranks)`; required for "vocab". vocab_size: resize
    the vocabulary first (new rows = mean of old rows). attn_implementation: "eager" / "sdpa" / ...
    (default: the source model's, else transformers' default). Each decoder layer and vocabulary matrix
    is filled on CPU in `dtype` (read or initialised, cast once) and moved to `device` at once, so the
    host holds one of them at a time. tp: tensor parallelism (models/tensor_parallel.py): each decoder layer
    keeps this TP rank's slices, and the vocabulary shard is `partition`'s row block of vocabulary rank
    rank * tp + tp_rank (the partition then spans layout.num_ranks * tp ranks).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not 0 <= rank < layout.num_ranks:
        raise LayoutError(f"rank {rank} is not in the layout's ranks 0..{layout.num_ranks - 1}")
    config = copy.deepcopy(resolve_config(source))
    if isinstance(source, nn.Module) and attn_implementation is None:
        attn_implementation = source.config._attn_implementation
    source_vocab = source.source_vocab if isinstance(source, CheckpointSource) else config.vocab_size
    if vocab_size is not None:
        config.vocab_size = vocab_size
    V = config.vocab_size
    model = meta_model(config, dtype, attn_implementation)
    config = model.config
    parts = find_parts(model)
    if layout.num_layers != parts.num_layers:
        raise LayoutError(
            f"layout covers {layout.num_layers} decoder layers but {type(model).__name__} has {parts.num_layers}"
        )
    if placement == "vocab":
        if partition is None:
            raise ValueError('placement "vocab" needs partition=VocabPartition(vocab_size, num_ranks)')
        tp_size = tp.comm.size if tp is not None else 1
        if partition.vocab_size != V or partition.world_size != layout.num_ranks * tp_size:
            raise ValueError(
                f"partition is for V={partition.vocab_size} over {partition.world_size} ranks, but the "
                f"model has V={V} and the layout {layout.num_ranks} ranks x tp {tp_size}"
            )
    src = _weight_source(source, model)
    if isinstance(source, CheckpointSource) and vocab_size in (None, source.config.vocab_size):
        row_map, means = source.rows_map(), source.means
    else:
        row_map, means = RowMap.identity(V, source_vocab), None

    chunks = {c: _build_chunk(parts, layout, c, src, model, seed, dtype, device, tp) for c in layout.chunks_of(rank)}

    # each piece goes to `device` as soon as it is filled, so the host holds one layer or one vocabulary
    # matrix at a time, not the rank's whole share before one final move
    def rows(which: str, start: int, end: int) -> torch.Tensor:
        return vocab_rows(parts, which, start, end, row_map, src, model, seed, dtype, means).to(device)

    def bias(start: int, end: int) -> nn.Parameter | None:
        if not parts.head_bias:
            return None
        return _new_param(bias_rows(parts, start, end, row_map, src, model, seed, dtype).to(device))

    kw = dict(
        rank=rank,
        layout=layout,
        placement=placement,
        config=config,
        names=parts.names,
        chunks=chunks,
        tied=parts.tied,
        vocab_size=V,
        final_softcap=parts.final_softcap,
        logit_scale=parts.logit_scale,
        padding_idx=parts.padding_idx,
        tp_rank=tp.comm.rank if tp is not None else 0,
        tp_size=tp.comm.size if tp is not None else 1,
    )
    if placement == "vocab":
        start, end = partition.shard_range(rank * kw["tp_size"] + kw["tp_rank"])
        embed_w = _new_param(rows("embed", start, end))
        head_w = embed_w if parts.tied else _new_param(rows("head", start, end))
        rm = RankModules(
            partition=partition, embed_weight=embed_w, head_weight=head_w, head_bias=bias(start, end), **kw
        )
    else:
        embed, head = _end_layers(parts, layout, rank, V, rows, bias, tp)
        rm = RankModules(embed=embed, head=head, **kw)
        if tp is not None and rank == layout.first_rank and tp.sequence_parallel:
            rm.chunks[0].input_sliced = True  # the split embedding's reduce-scatter gives 1/tp of the sequence
    return rm.to(device)


def _end_layers(parts: ModelParts, layout: StageLayout, rank: int, V: int, rows, bias, tp: TPSpec | None):
    """The baseline placement's whole embedding (first stage) and output layer (last stage); under tensor
    parallelism each TP rank's row block of them (`VocabPartition(V, tp)`, zero padding rows at the end)."""
    start, end = 0, V
    if tp is not None:
        split = VocabPartition(V, tp.comm.size)
        (start, end), valid = split.shard_range(tp.comm.rank), split.valid_rows(tp.comm.rank)
    embed = head = None
    if rank == layout.first_rank:
        weight = _new_param(rows("embed", start, end))
        embed = (
            FullEmbedding(weight, parts.padding_idx)
            if tp is None
            else TPEmbedding(weight, parts.padding_idx, tp, start, valid)
        )
    if rank == layout.last_rank:
        tied_here = parts.tied and embed is not None
        weight = embed.weight if tied_here else _new_param(rows("head", start, end))
        args = (weight, parts.logit_scale, parts.final_softcap, bias(start, end))
        head = FullHead(*args) if tp is None else TPHead(*args, tp, start, valid)
    return embed, head


def _build_chunk(
    parts: ModelParts,
    layout: StageLayout,
    c: int,
    src: WeightSource | None,
    model: nn.Module,
    seed: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp: TPSpec | None = None,
) -> StageChunk:
    start, end = layout.chunk_layers[c]
    plan = layer_plan(model.config) if tp is not None else {}
    sliced: dict[str, int] = {}
    packed: dict[str, list[int]] = {}
    partial: list[str] = []
    names = parts.names
    first, last = c == 0, c == layout.num_chunks - 1  # chunk 0 may hold no layer: chunk 1 then starts at 0 too
    layers = []
    for i in range(start, end):
        layer = parts.layers[i]
        prefix = f"{names.layers}.{i}"
        layer = _materialize(layer, lambda k, p=prefix: f"{p}.{k}", src, model, seed, prefix, dtype)
        if tp is not None:  # the whole layer read (or initialised), then this TP rank's slices kept
            split = shard_layer(layer, plan, tp, model.config)
            partial += [f"layers.{i}.{n}" for n in split.partial]
            sliced.update({f"layers.{i}.{n}": d for n, d in split.sliced.items()})
            packed.update({f"layers.{i}.{n}": parts for n, parts in split.packed.items()})
        layers.append(layer.to(device))
    norm = pos = None
    if last:
        norm = _materialize(parts.norm, lambda k: f"{names.norm}.{k}", src, model, seed, names.norm, dtype)
    if first and parts.pos_embed is not None:
        pos = _materialize(
            parts.pos_embed, lambda k: f"{names.pos_embed}.{k}", src, model, seed, names.pos_embed, dtype
        )
    rotary = None
    if parts.rotary_emb is not None:
        # Rebuilt on CPU from the config: its buffers (inv_freq) are not in checkpoints.
        rotary = type(parts.rotary_emb)(config=model.config)
    chunk = StageChunk(
        model.config,
        names,
        c,
        (start, end),
        layers,
        parts.layer_types,
        rotary,
        norm=norm,
        pos_embed=pos,
        embed_dropout=parts.embed_dropout if first else None,
        embed_scale=parts.embed_scale if first else None,
        embed_scale_in_dtype=parts.embed_scale_in_dtype,
        rotary_per_layer_type=parts.rotary_per_layer_type,
    )
    if tp is not None:
        chunk.tp, chunk.tp_sliced, chunk.tp_partial, chunk.tp_packed = tp, sliced, tuple(partial), packed
    return chunk
