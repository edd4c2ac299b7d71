"""Where a rank's weights come from: a live model, a local safetensors checkpoint, or a seeded init.

Every source answers by HF state-dict name (the model's own parameter names) and can read a block of
vocabulary rows without the rest, so a rank never holds more of the embedding / lm_head than its
shard (plus one init block). A checkpoint's names can differ from the model's: transformers renames
and converts them on load (GPT-NeoX stores its output head as `embed_out`, mixture-of-experts
checkpoints store one tensor per expert that the model holds fused); `ConvertedSource` applies the
same conversions, per tensor asked for.

Seeded init (no checkpoint): each module is initialized by the model's own `_init_weights`
under a generator seeded from (seed, HF module name), so a decoder layer gets the same values
whichever rank builds it and under any layout. Vocabulary matrices are initialized in fixed
blocks of `INIT_BLOCK_ROWS` rows, each block seeded from (seed, name, block index): the rows of
a shard are the same rows of the "full init" (world size 1) for every partition, and building a
shard costs at most two partial blocks beyond its own rows.
"""

from __future__ import annotations

import copy
import json
import os
import zlib
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from vp_accelerate.safetensors_file import open_safetensors

#: Rows per independently seeded block of a vocabulary matrix at fresh init (independent of p).
INIT_BLOCK_ROWS = 4096


def derived_seed(seed: int, *parts: object) -> int:
    """A stable 63-bit seed from a base seed and names (crc32, not Python's per-process hash())."""
    h = zlib.crc32(repr((seed,) + parts).encode())
    return (seed * 1_000_003 + h) % (2**63 - 1)


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def clear_init_flags(module: nn.Module) -> None:
    """Drop transformers' `_is_hf_initialized` marks, which would make `_init_weights` skip a tensor."""
    for m in module.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    for t in list(module.parameters()) + list(module.buffers()):
        t.__dict__.pop("_is_hf_initialized", None)


@torch.no_grad()
def seeded_init(model: nn.Module, module: nn.Module, seed: int, name: str) -> None:
    """Initialize `module` (materialized, on CPU) with `model._init_weights`, children first as HF does."""
    clear_init_flags(module)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed(seed, name))
        for m in _post_order(module):
            model._init_weights(m)


@torch.no_grad()
def seeded_vocab_rows(
    model: nn.Module,
    kind: str,
    name: str,
    start: int,
    end: int,
    num_rows: int,
    hidden: int,
    dtype: torch.dtype,
    seed: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Rows [start, end) of a fresh [num_rows, hidden] embedding ("embed") or lm_head ("head") init, or
    entries [start, end) of the lm_head's [num_rows] bias ("bias")."""
    out = torch.empty((end - start, hidden) if kind != "bias" else (end - start,), dtype=dtype)
    B = INIT_BLOCK_ROWS
    for b in range(start // B, -(-end // B)):
        b0, b1 = b * B, min((b + 1) * B, num_rows)
        if kind == "embed":
            pad = padding_idx - b0 if padding_idx is not None and b0 <= padding_idx < b1 else None
            tmp = nn.Embedding(b1 - b0, hidden, padding_idx=pad, _weight=torch.empty(b1 - b0, hidden, dtype=dtype))
        else:
            tmp = nn.Linear(hidden, b1 - b0, bias=kind == "bias", device="meta", dtype=dtype).to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derived_seed(seed, name, b))
            model._init_weights(tmp)
        lo, hi = max(start, b0), min(end, b1)
        out[lo - start : hi - start] = (tmp.bias if kind == "bias" else tmp.weight)[lo - b0 : hi - b0]
    return out


class WeightSource(Protocol):
    """Tensors by HF state-dict name."""

    def has(self, name: str) -> bool: ...
    def get(self, name: str) -> torch.Tensor: ...
    def rows(self, name: str, start: int, end: int) -> torch.Tensor: ...


class StateDictSource:
    """A live model's tensors (e.g. the HF model a test compares against)."""

    def __init__(self, model: nn.Module):
        self.sd = model.state_dict()

    def has(self, name: str) -> bool:
        return name in self.sd

    def get(self, name: str) -> torch.Tensor:
        return self.sd[name].detach()

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.sd[name].detach()[start:end]


class SafetensorsSource:
    """A local HF checkpoint directory (model.safetensors, or sharded with model.safetensors.index.json).

    Reads only the tensors asked for, and only the rows asked for (`open_safetensors(...).get_slice`).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").exists():
            with open_safetensors(self.path / "model.safetensors") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.path} has neither model.safetensors nor model.safetensors.index.json "
                "(only safetensors checkpoints are read)"
            )
        for fname in set(weight_map.values()):  # a file of this folder only, whatever the index says
            if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
                raise ValueError(
                    f"{index} names the weight file {str(fname)[:80]!r}, which is not a file in {self.path}"
                )
        self.weight_map: dict[str, str] = weight_map
        self._open = open_safetensors
        self._handles: dict[str, object] = {}

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = self._open(self.path / fname)
        return self._handles[fname]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._file(name).get_slice(name)[start:end]


@torch.no_grad()
def mean_rows(
    source: WeightSource | None, name: str, num_rows: int, hidden: int, block: int = INIT_BLOCK_ROWS, init=None
) -> torch.Tensor:
    """fp32 mean over rows [0, num_rows) of a vocabulary matrix, read block by block.

    `init(start, end)` produces rows when there is no source (fresh init).
    """
    total = torch.zeros(hidden, dtype=torch.float64)
    for s in range(0, num_rows, block):
        e = min(s + block, num_rows)
        rows = source.rows(name, s, e) if source is not None else init(s, e)
        total += rows.to(torch.float64).sum(0)
    return (total / num_rows).to(torch.float32)


class ConvertedSource:
    """A checkpoint read through transformers' own weight conversions, answering by the model's names.

    `save_pretrained` writes the family's checkpoint names (the conversion reversed), `from_pretrained`
    renames and converts them back (`transformers.conversion_mapping`). This applies the same renamings
    and converters lazily: a renamed tensor (and its vocabulary rows) is read alone; a converted one
    (e.g. experts fused from per-expert tensors) reads just the checkpoint tensors that form it.
    """

    def __init__(self, base: "SafetensorsSource", model: nn.Module):
        self.base, self.model, self._copy = base, model, copy.deepcopy
        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = model.state_dict()
        prefix = model.base_model_prefix
        self.plain: dict[str, str] = {}
        self.groups: dict[str, tuple[object, list[tuple[str, str]]]] = {}
        self._done: dict[str, torch.Tensor] = {}
        for key in sorted(base.weight_map, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if name not in meta and key in meta:
                name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
            if name not in meta:
                continue  # not a tensor of this model (e.g. a head another class would use)
            if pattern is None:
                self.plain[name] = key
                continue
            conv = by_pattern[pattern]
            group = self.groups.setdefault(name, (conv, []))
            group[1].append((key, pattern))
            first = conv.target_patterns[0]
            for other in conv.target_patterns[1:]:  # one-to-many (a fused q|k|v split): every target names the group
                if first in name:
                    self.groups.setdefault(name.replace(first, other, 1), group)

    def has(self, name: str) -> bool:
        return name in self.plain or name in self.groups or name in self._done

    def get(self, name: str) -> torch.Tensor:
        if name in self.plain:
            return self.base.get(self.plain[name])
        if name in self._done:
            return self._done.pop(name)
        proto, members = self.groups[name]
        conv = self._copy(proto)
        first = next(n for n, g in self.groups.items() if g is self.groups[name])  # the name the loader converts under
        for key, pattern in members:
            conv.add_tensor(first, key, pattern, lambda k=key: self.base.get(k))
        out = conv.convert(first, model=self.model, config=self.model.config)
        self._done.update({k: v for k, v in out.items() if k != name})  # one-to-many: the other targets
        return out[name]

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        if name in self.plain:
            return self.base.rows(self.plain[name], start, end)
        return self.get(name)[start:end]
