"""An HF model directory written the way a large model needs: every pipeline rank writes its own tensors, one
tensor in host memory at a time, and the vocabulary matrices are put together one at a time.

Layout of the directory (a valid sharded HF checkpoint; `from_pretrained` reads the index):

    model-00001-of-0000P.safetensors   pipeline rank 0's decoder layers and norms, and the vocabulary
    ...                                matrices assigned to it (the i-th sharded name to rank i mod P)
    model.safetensors.index.json       weight_map: every tensor name -> its file
    config.json, generation_config.json, tokenizer files (pipeline rank 0)

`write_safetensors` writes the safetensors format itself (an 8-byte header length, the JSON header, then
the raw bytes) so that a file is written tensor by tensor: each tensor is produced (read, moved to the
host, cast), written and dropped before the next one. A vocabulary matrix is the concatenation of every
rank's row shard (Megatron's layout: padding at the end, cut off here); its owner gathers the shards
straight into one preallocated matrix. So the host memory an export adds on a rank is at most one of its
own tensors plus the largest vocabulary matrix, instead of the whole model on rank 0
(`models/export.py`'s gather, which remains for LoRA merges and small models).

The same plan serves the live export (a collective over one replica's pipeline ranks, replica 0 writing)
and the offline export of a checkpoint (one process reading one rank file at a time: `export_rank_files`).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from transformers import GenerationConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange

from vp_accelerate.safetensors_file import DTYPES, dtype_of, open_safetensors

from .generation import generation_config_for, with_tokenizer_ids
from .meta import meta_model

INDEX = "model.safetensors.index.json"

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

Entry = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]
"""(name, shape, dtype, a function producing the tensor when its turn comes)."""


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_safetensors(
    path: str | os.PathLike | None, entries: Sequence[Entry], metadata: dict | None = None, *, sink=None
) -> int:
    """Write a safetensors file one tensor at a time; returns the bytes of tensor data written.

    Each entry's tensor is produced only when it is written and dropped right after, so the memory this
    adds is one tensor (plus its host copy / cast), whatever the file's size. `sink`: an open binary file
    object to write to instead of `path` (the caller fsyncs it); else `path` is written through `<path>.tmp`,
    fsynced and renamed."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, shape, dtype, _ in entries:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
    if sink is not None:
        _write_body(sink, raw, entries)
        return offset
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        _write_body(f, raw, entries)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return offset


def _write_body(f, raw: bytes, entries: Sequence[Entry]) -> None:
    """The header length, the header, then each entry's bytes as it is produced."""
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for name, shape, dtype, produce in entries:
        t = produce().detach().to(device="cpu", dtype=dtype).contiguous()
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: produced shape {tuple(t.shape)}, planned {tuple(shape)}")
        if t.numel():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        del t


def vocab_owner(sharded: Sequence[str], pp_size: int) -> dict[str, int]:
    """Which pipeline rank assembles and writes each vocabulary matrix: the i-th (sorted) name to rank i mod P."""
    return {name: i % pp_size for i, name in enumerate(sorted(sharded))}


def write_model_files(out_dir: Path, config, tokenizer, dtype: torch.dtype) -> None:
    """config.json (with the tokenizer's special-token ids and the export dtype), generation_config.json and
    the tokenizer."""
    config = with_tokenizer_ids(config, tokenizer) if tokenizer is not None else copy.deepcopy(config)
    config.dtype = dtype  # what from_pretrained(dtype="auto") loads
    config.save_pretrained(out_dir)
    if tokenizer is not None:
        generation_config_for(tokenizer).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def write_index(out_dir: Path, files: dict[str, list[tuple[str, int]]]) -> None:
    """The index of the files' tensors: {file: [(name, bytes)]}."""
    weight_map = {name: file for file, items in files.items() for name, _ in items}
    total = sum(n for items in files.values() for _, n in items)
    with open(out_dir / INDEX, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def _nbytes(shape, dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def streams(config) -> bool:
    """Whether a streamed export writes what `save_pretrained` writes: the family saves its tensors under the
    model's own names (no weight conversion). Families with one (GPT-NeoX's `embed_out`, MoE experts saved one
    by one) are exported through the gathered state dict and `save_pretrained`, which applies it."""
    model = meta_model(config, torch.float32)
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    return not [c for c in conversions if not isinstance(c, PrefixChange)]  # as save_pretrained reverts them


def check_names(config, names: Iterable[str]) -> None:
    """The names must be exactly the HF model's state dict (a tied output weight may be left out)."""
    model = meta_model(config, torch.float32)
    expected = set(model.state_dict())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head = next(
        k for k, p in model.named_parameters(remove_duplicate=False) if p is model.get_output_embeddings().weight
    )
    names = set(names)
    missing = sorted(k for k in expected - names if not (tied and k in (head, "lm_head.weight")))
    unexpected = sorted(names - expected)
    if missing or unexpected:
        raise ValueError(
            f"exported tensors do not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


# ----------------------------------------------------------------------------------------- live, collective
def export_streaming(
    mods,
    config,
    out_dir: str | Path,
    *,
    group,
    pp_rank: int,
    pp_size: int,
    write: bool = True,
    dtype: torch.dtype | None = None,
    tokenizer=None,
) -> Path | None:
    """Collective over one replica's pipeline ranks (`group`, a gloo group in pipeline-rank order): each rank
    writes its own tensors to its shard file, the vocabulary matrices are gathered one at a time to their
    owner, and pipeline rank 0 writes the index and the config. `write=False`: a replica that only takes part
    (nothing is written; every replica calls it so the collectives match). `dtype`: the files' dtype (None: the
    parameters'). Returns the directory on the ranks that wrote."""
    cfg = config if config is not None else mods.config
    if cfg.vocab_size != mods.vocab_size:
        raise ValueError(f"config has vocab_size={cfg.vocab_size} but the model was built with {mods.vocab_size}")
    out = Path(out_dir)
    local = {n: t for n, t in mods.state_dict().items() if not mods.is_duplicate(n)}
    sharded = sorted(mods.sharded_names)
    owner = vocab_owner(sharded, pp_size)
    if dtype is None:
        dtype = next((t.dtype for t in local.values() if t.is_floating_point()), torch.float32)
    if write and pp_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if write:
        dist.barrier(group=group)  # the directory exists before any rank writes into it
    entries: list[Entry] = []
    for name, t in local.items():
        if name in owner:
            continue
        want = dtype if t.is_floating_point() else t.dtype
        entries.append((name, tuple(t.shape), want, lambda t=t: t))
    for name in sharded:  # every rank sends its shard of each matrix in the same order; the owner keeps the whole
        full = _gather_rows(local[name], mods.vocab_size, owner[name], pp_rank, pp_size, group, dtype)
        if full is not None:
            entries.append((name, tuple(full.shape), dtype, lambda full=full: full))
    file = shard_file_name(pp_rank, pp_size)
    if write:
        write_safetensors(out / file, entries)
    listing = [(name, _nbytes(shape, dt)) for name, shape, dt, _ in entries]
    entries.clear()
    gathered = [None] * pp_size if pp_rank == 0 else None
    dist.gather_object((file, listing), gathered, group=group, group_dst=0)
    if not write:
        return None
    if pp_rank == 0:
        files = dict(gathered)
        check_names(cfg, (n for items in files.values() for n, _ in items))
        write_index(out, files)
        write_model_files(out, cfg, tokenizer, dtype)
    dist.barrier(group=group)
    return out


def _gather_rows(shard: torch.Tensor, vocab_size: int, dst: int, pp_rank: int, pp_size: int, group, dtype):
    """The full matrix of equal row shards (cut to `vocab_size` rows) on pipeline rank `dst`, None elsewhere.
    Each shard is received straight into its rows of one preallocated matrix (point to point: gloo's gather
    stages every input in a second buffer of the whole matrix)."""
    mine = shard.detach().to(device="cpu", dtype=dtype).contiguous()
    if pp_rank != dst:
        dist.send(mine, group=group, group_dst=dst)
        return None
    rows = mine.shape[0]
    full = torch.empty((rows * pp_size, *mine.shape[1:]), dtype=dtype)
    for r in range(pp_size):
        if r == pp_rank:
            full[r * rows : (r + 1) * rows] = mine
        else:
            dist.recv(full[r * rows : (r + 1) * rows], group=group, group_src=r)
    del mine
    return full[:vocab_size]


# ----------------------------------------------------------------------------------------- offline
def export_rank_files(
    rank_files: Sequence[tuple[str, frozenset[str] | set[str]]],
    vocab_size: int,
    sharded_names: Iterable[str],
    config,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    tokenizer=None,
) -> Path:
    """An HF directory from a checkpoint's per-rank safetensors files of one replica, in pipeline-rank order,
    each with the names to leave out (a tied copy another rank counts). One process, one rank file open at a
    time and one tensor read at a time (`open_safetensors`); a vocabulary matrix is read shard by shard into one
    matrix. The output has one file per rank, as the live export."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pp_size = len(rank_files)
    sharded = sorted(sharded_names)
    owner = vocab_owner(sharded, pp_size)
    if dtype is None:
        path = rank_files[0][0]
        with open_safetensors(path) as f:
            dtype = next((dtype_of(f, n, path) for n in f.keys()), torch.float32)
    files: dict[str, list[tuple[str, int]]] = {}
    for r, (path, skip) in enumerate(rank_files):
        entries: list[Entry] = []
        with open_safetensors(path) as f:
            for name in f.keys():
                if name in skip or name in owner:
                    continue
                src = dtype_of(f, name, path)
                want = dtype if src.is_floating_point else src
                shape = tuple(f.get_slice(name).get_shape())
                entries.append((name, shape, want, lambda f=f, name=name: f.get_tensor(name)))
            for name in (n for n in sharded if owner[n] == r):
                shape = _full_shape(rank_files, name, vocab_size)
                entries.append((name, shape, dtype, lambda name=name: _read_rows(rank_files, name, vocab_size, dtype)))
            file = shard_file_name(r, pp_size)
            write_safetensors(out / file, entries)
        files[file] = [(name, _nbytes(shape, dt)) for name, shape, dt, _ in entries]
    check_names(config, (n for items in files.values() for n, _ in items))
    write_index(out, files)
    write_model_files(out, config, tokenizer, dtype)
    return out


def _full_shape(rank_files, name: str, vocab_size: int) -> tuple[int, ...]:
    with open_safetensors(rank_files[0][0]) as f:
        shape = f.get_slice(name).get_shape()
    return (vocab_size, *shape[1:])


def _read_rows(rank_files, name: str, vocab_size: int, dtype) -> torch.Tensor:
    """The full matrix `name` from every rank's row shard, cut to `vocab_size` rows, read shard by shard."""
    full = torch.empty(_full_shape(rank_files, name, vocab_size), dtype=dtype)
    start = 0
    for path, _ in rank_files:
        if start >= vocab_size:
            break
        with open_safetensors(path) as f:
            sl = f.get_slice(name)
            take = min(sl.get_shape()[0], vocab_size - start)
            full[start : start + take] = sl[:take]
            start += take
    if start != vocab_size:
        raise ValueError(f"{name}: the shards hold {start} rows, fewer than vocab_size={vocab_size}")
    return full
