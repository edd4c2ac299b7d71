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

Under tensor parallelism (`TPLayout`) a stage's TP rank 0 writes the stage's file: a tensor every TP rank holds
whole from its own copy, a TP-sliced one (`tp_sliced`: a split linear, a LoRA factor, the baseline's end-stage
vocabulary rows) joined when its turn comes from the stage's TP ranks' slices (received one tensor at a time,
live; read from their rank files, offline), so the bound stays one joined tensor and its slices. The
vocabulary matrices sharded over pp x tp come from all the replica's ranks, in vocabulary-rank order.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
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
from .tensor_parallel import join_packed

INDEX = "model.safetensors.index.json"

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

Entry = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]
"""(name, shape, dtype, a function producing the tensor when its turn comes)."""


@dataclass(frozen=True)
class TPLayout:
    """How a replica's tensors are split over tensor parallelism (a RankModules', or a checkpoint's meta.json)."""

    size: int = 1
    """TP ranks per pipeline stage (1: none)."""
    sliced: dict = field(default_factory=dict)
    """HF name -> the dim its TP slices are cut along."""
    packed: dict = field(default_factory=dict)
    """HF name -> the parts' whole sizes of a fused projection sliced one part at a time."""
    vocab: frozenset = frozenset()
    """TP row slices of a padded vocabulary matrix (the baseline's end layers): cut to vocab_size once joined."""

    def joined_shape(self, name: str, shape, vocab_size: int) -> tuple[int, ...]:
        """The whole tensor's shape from one slice's."""
        dim, out = self.sliced[name], list(shape)
        out[dim] *= self.size
        if name in self.vocab:
            out[0] = vocab_size
        return tuple(out)

    def join(self, name: str, pieces: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
        """The whole tensor from its TP ranks' slices (in TP-rank order)."""
        if name in self.packed:
            return join_packed(pieces, self.packed[name])
        whole = torch.cat(pieces, self.sliced[name])
        return whole[:vocab_size] if name in self.vocab else whole


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
    tp_rank: int = 0,
) -> Path | None:
    """Collective over one replica's pipeline ranks (`group`, a gloo group in pipeline-rank order; under tensor
    parallelism the replica's pp x tp ranks in vocabulary-rank order): each stage writes its own tensors to its
    shard file (its TP rank 0, the TP slices joined one tensor at a time), the vocabulary matrices are gathered
    one at a time to their owner, and pipeline rank 0 writes the index and the config. `write=False`: a replica
    that only takes part (nothing is written; every replica calls it so the collectives match). `dtype`: the
    files' dtype (None: the parameters'). Returns the directory on the ranks that wrote."""
    cfg = config if config is not None else mods.config
    if cfg.vocab_size != mods.vocab_size:
        raise ValueError(f"config has vocab_size={cfg.vocab_size} but the model was built with {mods.vocab_size}")
    out = Path(out_dir)
    local = {n: t for n, t in mods.state_dict().items() if not mods.is_duplicate(n)}
    tp = TPLayout(mods.tp_size, mods.tp_sliced, mods.tp_packed, mods.tp_vocab_names)
    me, size = pp_rank * tp.size + tp_rank, pp_size * tp.size  # this rank in `group`, the group's ranks
    writer = write and tp_rank == 0  # a stage's TP rank 0 writes the stage's file
    sharded = sorted(mods.sharded_names)
    owner = vocab_owner(sharded, pp_size)
    if dtype is None:
        dtype = next((t.dtype for t in local.values() if t.is_floating_point()), torch.float32)
    if write and me == 0:
        out.mkdir(parents=True, exist_ok=True)
    if write:
        dist.barrier(group=group)  # the directory exists before any rank writes into it
    entries: list[Entry] = []
    slices: list[torch.Tensor] = []  # a TP rank > 0: its slices, sent to its TP rank 0 as the file is written
    for name, t in local.items():
        if name in owner:
            continue
        want = dtype if t.is_floating_point() else t.dtype
        if tp.size > 1 and name in tp.sliced:
            if tp_rank == 0:
                shape = tp.joined_shape(name, t.shape, mods.vocab_size)
                entries.append((name, shape, want, _joined(tp, name, t, want, mods.vocab_size, me, group)))
            else:
                slices.append(t.detach().to(device="cpu", dtype=want).contiguous())
        elif tp_rank == 0:
            entries.append((name, tuple(t.shape), want, lambda t=t: t))
    for name in sharded:  # every rank sends its shard of each matrix in the same order; the owner keeps the whole
        full = _gather_rows(local[name], mods.vocab_size, owner[name] * tp.size, me, size, group, dtype)
        if full is not None:
            entries.append((name, tuple(full.shape), dtype, lambda full=full: full))
    file = shard_file_name(pp_rank, pp_size) if tp_rank == 0 else None
    if writer:
        write_safetensors(out / file, entries)
    elif write:  # in the order the stage's writer joins them
        for t in slices:
            dist.send(t, group=group, group_dst=me - tp_rank)
    slices.clear()
    listing = [(name, _nbytes(shape, dt)) for name, shape, dt, _ in entries]
    entries.clear()
    gathered = [None] * size if me == 0 else None
    dist.gather_object((file, listing), gathered, group=group, group_dst=0)
    if not write:
        return None
    if me == 0:
        files = {f: items for f, items in gathered if f is not None}
        check_names(cfg, (n for items in files.values() for n, _ in items))
        write_index(out, files)
        write_model_files(out, cfg, tokenizer, dtype)
    dist.barrier(group=group)
    return out if writer else None


def _joined(tp: TPLayout, name: str, mine: torch.Tensor, dtype, vocab_size: int, me: int, group):
    """A function producing the whole tensor `name` on a stage's TP rank 0 (group rank `me`): its own slice and
    the other TP ranks' (group ranks me + 1 ...), received when the file reaches it."""

    def produce() -> torch.Tensor:
        pieces = [mine.detach().to(device="cpu", dtype=dtype).contiguous()]
        for r in range(1, tp.size):
            pieces.append(torch.empty_like(pieces[0]))
            dist.recv(pieces[-1], group=group, group_src=me + r)
        return tp.join(name, pieces, vocab_size)

    return produce


def _gather_rows(shard: torch.Tensor, vocab_size: int, dst: int, rank: int, size: int, group, dtype):
    """The full matrix of equal row shards (cut to `vocab_size` rows) on group rank `dst`, None elsewhere.
    Each shard is received straight into its rows of one preallocated matrix (point to point: gloo's gather
    stages every input in a second buffer of the whole matrix)."""
    mine = shard.detach().to(device="cpu", dtype=dtype).contiguous()
    if rank != dst:
        dist.send(mine, group=group, group_dst=dst)
        return None
    rows = mine.shape[0]
    full = torch.empty((rows * size, *mine.shape[1:]), dtype=dtype)
    for r in range(size):
        if r == rank:
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
    tp: TPLayout | None = None,
) -> Path:
    """An HF directory from a checkpoint's per-rank safetensors files of one replica, in pipeline-rank order
    (under tensor parallelism `tp`: vocabulary-rank order, a stage's TP ranks consecutive), each with the names
    to leave out (a tied copy another rank counts). One process, one rank file open at a time and one tensor
    read at a time (`open_safetensors`; a TP-sliced tensor from its stage's files, slice by slice); a vocabulary
    matrix is read shard by shard into one matrix. The output has one file per pipeline stage, as the live
    export."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tp = tp or TPLayout()
    if len(rank_files) % tp.size:
        raise ValueError(f"{len(rank_files)} rank files do not make stages of {tp.size} tensor-parallel ranks")
    pp_size = len(rank_files) // tp.size
    sharded = sorted(sharded_names)
    owner = vocab_owner(sharded, pp_size)
    if dtype is None:
        path = rank_files[0][0]
        with open_safetensors(path) as f:
            dtype = next((dtype_of(f, n, path) for n in f.keys()), torch.float32)
    files: dict[str, list[tuple[str, int]]] = {}
    for r in range(pp_size):
        path, skip = rank_files[r * tp.size]
        stage = [p for p, _ in rank_files[r * tp.size : (r + 1) * tp.size]]
        entries: list[Entry] = []
        with open_safetensors(path) as f:
            for name in f.keys():
                if name in skip or name in owner:
                    continue
                src = dtype_of(f, name, path)
                want = dtype if src.is_floating_point else src
                shape = tuple(f.get_slice(name).get_shape())
                if tp.size > 1 and name in tp.sliced:  # joined from the stage's TP rank files, slice by slice
                    shape = tp.joined_shape(name, shape, vocab_size)
                    entries.append((name, shape, want, _stage_join(tp, name, stage, vocab_size)))
                else:
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


def _stage_join(tp: TPLayout, name: str, stage: list[str], vocab_size: int) -> Callable[[], torch.Tensor]:
    """A function producing the whole tensor `name` from a stage's TP rank files, read one slice at a time."""

    def produce() -> torch.Tensor:
        pieces = []
        for path in stage:
            with open_safetensors(path) as f:
                pieces.append(f.get_tensor(name))
        return tp.join(name, pieces, vocab_size)

    return produce


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
