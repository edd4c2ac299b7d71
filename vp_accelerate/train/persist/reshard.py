"""Checkpoints that reshard: a run resumes a checkpoint saved with another pipeline size, data-parallel size,
schedule, method or ZeRO setting, with the same weights, AdamW moments, step, LR position, data position and
loss scale.

What makes a checkpoint reshardable is that every tensor in it has a global meaning (the format is the
per-rank files of store.py; this module adds nothing to them but the optimizer state's keys):

- a rank's `model.safetensors` holds HF-named tensors; a name in meta.json's `sharded_names` is rows
  `[v * S, (v + 1) * S)` of the full matrix padded at the end (S its shard's rows, v the rank's vocabulary
  rank pp_rank * tp_size + tp_rank, `vocab/partition.py`), a name in `tp_sliced` (name -> dim) the rank's
  1/tp_size slice along that dim (tensor parallelism: `[tp_rank * n, (tp_rank + 1) * n)`), any other name the
  whole tensor;
- a rank's `optimizer.pt` holds the optimizer state keyed by those names (`named_optimizer_state`: a plain
  AdamW's index-keyed state is renamed on save; ZeRO-1's is by name already, each parameter on one replica),
  each moment shaped as its parameter on that rank.

A resuming rank therefore builds each of its tensors, for a vocabulary shard its rows of the padded matrix,
for a TP slice its part along the slice's dim, from the overlapping parts of the saved ranks' tensors (`region`),
reading only those (safetensors
slices; the optimizer files memory-mapped). Padding rows are zero, as a fresh shard's. Model weights are
written by data-parallel replica 0 only; replicas store an empty model file (their weights are the same).

This is our own format rather than torch.distributed.checkpoint: DCP's resharding needs the shards as
DTensors of one global shape, and a vocabulary shard's global shape here includes padding that depends on
the pipeline size (V rounded up to P x pad_multiple), so the same matrix would have a different global shape
in every layout; the row-range reading below trims the padding instead. The files stay what `export` and
`model.init_from` already read.

Every checkpoint of this format (`store.FORMAT`, checked by `store.read_meta` before anything here reads it) is
keyed by name, so it resumes into any layout.
"""

from __future__ import annotations

import os

import torch

from vp_accelerate.runtime.zero import FORMAT as ZERO_FORMAT
from vp_accelerate.runtime.zero import ZeroOptimizer

from . import store as ckpt

BY_NAME = "by-name"
"""`optimizer.pt`'s "format" when its state is keyed by parameter name (a plain optimizer's, renamed)."""

LAYOUT_KEYS = ("world_size", "dp_size", "schedule", "method", "chunks_per_rank", "pad_multiple", "layout", "zero")
"""Fingerprint keys a resume may change (the checkpoint is then resharded); every other key must match."""


def named_optimizer_state(optimizer, named_parameters) -> dict:
    """The optimizer's state_dict keyed by parameter name ({"format", "param_groups", "state"})."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.state_dict()
    names = {p: n for n, p in named_parameters}
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()
    return {
        "format": BY_NAME,
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]],
        "state": {order[i]: s for i, s in sd["state"].items()},
    }


def rank_model_state(pipe) -> dict:
    """The weights this rank saves: data-parallel replicas write no second copy (replica 0's are theirs)."""
    return pipe.state_dict() if pipe.dp_rank == 0 else {}


def rank_optimizer_state(pipe, optimizer) -> dict:
    """The optimizer state this rank saves, keyed by name; replicas of an unsharded optimizer write none of its
    moments (replica 0's are theirs)."""
    state = named_optimizer_state(optimizer, pipe.named_parameters())
    if pipe.dp_rank > 0 and not isinstance(optimizer, ZeroOptimizer):
        state["state"] = {}
    return state


def load_named_optimizer_state(optimizer, named_parameters, state: dict, same_groups: bool = True) -> None:
    """Load `named_optimizer_state`'s form. `same_groups=False` (another layout): every group takes the first
    saved group's hyperparameters (lr and the scheduler's initial_lr are the same in all groups) but keeps its own
    weight_decay."""
    hyper = {k: v for k, v in state["param_groups"][0].items() if k not in ("params", "weight_decay")}
    if not same_groups:
        groups = [{**hyper, "weight_decay": g["weight_decay"], "params": []} for g in optimizer.param_groups]
    else:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    if isinstance(optimizer, ZeroOptimizer):
        names = [[optimizer.names[p] for p in g["params"]] for g in optimizer.param_groups]
        optimizer.load_state_dict(
            {
                "format": ZERO_FORMAT,
                "param_groups": [{**h, "params": n} for h, n in zip(groups, names)],
                "state": state["state"],
            }
        )
        return
    names = {p: n for n, p in named_parameters}
    index = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            index[names[p]] = len(index)
    plain, i = [], 0
    for h, g in zip(groups, optimizer.param_groups):
        plain.append({**h, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    optimizer.load_state_dict(
        {"param_groups": plain, "state": {index[n]: s for n, s in state["state"].items() if n in index}}
    )


# ----------------------------------------------------------------------------------------- the saved pieces
def piece(name: str, shape, pp_rank: int, tp_rank: int, tp_size: int, sharded, tp_sliced) -> tuple[int, int]:
    """(dim, global start along it) of a rank's tensor `name` of `shape` (see the module docstring)."""
    if name in sharded:
        return 0, (pp_rank * tp_size + tp_rank) * shape[0]
    dim = tp_sliced.get(name)
    if dim is not None and tp_size > 1:
        return dim, tp_rank * shape[dim]
    return 0, 0


class SavedTensors:
    """Where each global name's parts lie in a checkpoint: (dim, global start, length, a reader) per rank.

    `kind` "model" reads the ranks' model.safetensors (slices, nothing else read), "optimizer" their
    optimizer.pt (memory-mapped), whose tensors are `name/key` (e.g. `model.norm.weight/exp_avg`)."""

    def __init__(self, path: str, meta: dict, kind: str):
        self.sources: dict[str, list[tuple[int, int, int, object]]] = {}  # name -> [(dim, start, length, reader)]
        self.scalars: dict[str, object] = {}  # name/key -> a non-tensor or 0-d value (AdamW's step)
        sharded = set(meta.get("sharded_names", ()))
        tp_size, tp_sliced = int(meta.get("tp_size", 1)), dict(meta.get("tp_sliced", {}))
        tp_packed = dict(meta.get("tp_packed", {})) if tp_size > 1 else {}
        for r in sorted(meta["ranks"], key=lambda r: (r["dp_rank"], r["pp_rank"], r.get("tp_rank", 0))):
            rdir = os.path.join(path, ckpt.rank_dir_name(r["rank"]))
            if kind == "model":
                f = ckpt.files.open_safetensors(os.path.join(rdir, "model.safetensors"))
                items = [(n, f.get_slice(n).get_shape(), (lambda f=f, n=n: f.get_slice(n))) for n in f.keys()]
            else:
                state = ckpt.files.load_torch(os.path.join(rdir, "optimizer.pt"), mmap=True)
                items = []
                for n, s in state["state"].items():
                    for k, v in s.items():
                        if torch.is_tensor(v) and v.dim() > 0:
                            items.append((f"{n}/{k}", tuple(v.shape), (lambda v=v: v)))
                        else:
                            self.scalars.setdefault(f"{n}/{k}", v)
            for name, shape, reader in items:
                base = name.split("/")[0]
                if base in tp_packed:  # a fused projection: 1/tp of each part, each part a piece of its own
                    self._packed(name, tp_packed[base], r.get("tp_rank", 0), tp_size, reader)
                    continue
                dim, start = piece(base, shape, r["pp_rank"], r.get("tp_rank", 0), tp_size, sharded, tp_sliced)
                self.sources.setdefault(name, []).append((dim, start, shape[dim], reader))

    def _packed(self, name: str, parts: list[int], tp_rank: int, tp_size: int, reader) -> None:
        """Register a fused projection's saved slice as one piece per part, at that part's global rows."""
        offset, local = 0, 0
        for n in parts:
            size = n // tp_size

            def rows(lo=local, size=size):
                return reader()[lo : lo + size]

            self.sources.setdefault(name, []).append((0, offset + tp_rank * size, size, rows))
            offset, local = offset + n, local + size

    def has(self, name: str) -> bool:
        return name in self.sources or name in self.scalars

    def region(self, name: str, dim: int, start: int, shape, valid: int, dtype) -> torch.Tensor:
        """Indices [start, start + shape[dim]) along `dim` of global tensor `name` (from `valid` on: padding,
        zeros), from the overlapping parts of the saved pieces; a piece cut along another dim (a TP slice saved,
        the whole tensor wanted, or the reverse) gives its part of every index it covers."""
        out = torch.zeros(shape, dtype=dtype)
        end = min(start + shape[dim], valid)
        filled = max(0, end - start)
        along = torch.zeros(shape[dim], dtype=torch.bool)  # indices of `dim` filled by pieces cut along it
        across: dict[int, torch.Tensor] = {}  # other dim -> its indices filled by pieces cut along that dim
        for d, s0, n, reader in self.sources.get(name, ()):
            if d == dim:
                lo, hi = max(start, s0), min(end, s0 + n)
                if lo >= hi or bool(along[lo - start : hi - start].all()):
                    continue
                out[_index(dim, lo - start, hi - start)] = reader()[_index(dim, lo - s0, hi - s0)].to(dtype)
                along[lo - start : hi - start] = True
            else:  # cut along another dim, whole along ours: its part of every index of ours
                seen = across.setdefault(d, torch.zeros(shape[d], dtype=torch.bool))
                if bool(seen[s0 : s0 + n].all()):
                    continue
                out[_cross(d, s0, n, dim, 0, filled, len(shape))] = reader()[
                    _cross(d, 0, n, dim, start, filled, len(shape))
                ].to(dtype)
                seen[s0 : s0 + n] = True
        if not (bool(along[:filled].all()) or any(bool(seen.all()) for seen in across.values())):
            raise ckpt.CheckpointError(f"the checkpoint holds no part {start}..{end} (dim {dim}) of {name}")
        return out

    def rows(self, name: str, start: int, shape, valid: int, dtype) -> torch.Tensor:
        """Rows [start, start + shape[0]) of global tensor `name` (rows from `valid` on are padding: zeros)."""
        return self.region(name, 0, start, shape, valid, dtype)


def _index(dim: int, lo: int, hi: int) -> tuple:
    """The index tuple selecting [lo, hi) along `dim`."""
    return (slice(None),) * dim + (slice(lo, hi),)


def _cross(d: int, s0: int, n: int, dim: int, start: int, length: int, ndim: int) -> tuple:
    """[s0, s0 + n) along `d` and [start, start + length) along `dim` (d != dim)."""
    index = [slice(None)] * ndim
    index[d], index[dim] = slice(s0, s0 + n), slice(start, start + length)
    return tuple(index)


def _own_tensor(saved: SavedTensors, pipe, name: str, shape, dtype) -> torch.Tensor:
    """This rank's tensor `name` (a weight, or a moment `name/key`) from the saved pieces: a fused projection under
    TP part by part (its 1/tp of each part), any other by `target_part`."""
    base = name.split("/")[0]
    parts = pipe.mods.tp_packed.get(base)
    if parts is not None:
        g, out, offset = pipe.groups, [], 0
        for n in parts:
            size = n // g.tp_size
            start = offset + g.tp_rank * size
            out.append(saved.region(name, 0, start, (size, *shape[1:]), start + size, dtype))
            offset += n
        return torch.cat(out)
    dim, start, valid = target_part(pipe, base, shape)
    return saved.region(name, dim, start, tuple(shape), valid, dtype)


def target_part(pipe, name: str, shape) -> tuple[int, int, int]:
    """(dim, global start along it, valid length of the global tensor along it) of this rank's tensor `name`."""
    if name in pipe.mods.sharded_names:
        return 0, pipe.mods.vocab_rank * shape[0], pipe.hf_config.vocab_size
    if name in pipe.mods.tp_vocab_names:  # the baseline's end-stage vocabulary, its TP rank's rows (padded)
        return 0, pipe.groups.tp_rank * shape[0], pipe.hf_config.vocab_size
    dim = pipe.mods.tp_sliced.get(name)
    if dim is not None:
        g = pipe.groups
        return dim, g.tp_rank * shape[dim], g.tp_size * shape[dim]
    return 0, 0, shape[0] if len(shape) else 1


@torch.no_grad()
def reshard_model(pipe, path: str, meta: dict) -> None:
    """This rank's weights from checkpoint `path` saved with any layout."""
    saved = SavedTensors(path, meta, "model")
    state = {}
    own = dict(pipe.named_parameters())  # what a checkpoint holds (buffers come from the model's config)
    for name, t in own.items():
        if not saved.has(name):
            raise ckpt.CheckpointError(f"checkpoint {path} holds no tensor {name}: it was saved for another model")
        if t.dim() == 0:
            state[name] = saved.sources[name][0][2]()[:]
            continue
        state[name] = _own_tensor(saved, pipe, name, tuple(t.shape), t.dtype)
    for name, value in state.items():
        own[name].copy_(value.to(own[name].device))


def reshard_optimizer_state(pipe, path: str, meta: dict) -> dict:
    """This rank's optimizer state (`named_optimizer_state`'s form) from checkpoint `path` of any layout."""
    saved = SavedTensors(path, meta, "optimizer")
    first = ckpt.files.load_torch(os.path.join(path, ckpt.rank_dir_name(0), "optimizer.pt"), mmap=True)
    state = {}
    for name, p in pipe.named_parameters():
        if not p.requires_grad:
            continue
        keys = sorted({k.split("/", 1)[1] for k in (*saved.sources, *saved.scalars) if k.split("/", 1)[0] == name})
        if not keys:
            continue  # a parameter the saved run had not stepped yet: fresh state, as there
        s = {}
        for k in keys:
            full = f"{name}/{k}"
            if full in saved.scalars:
                s[k] = saved.scalars[full]
            else:
                s[k] = _own_tensor(saved, pipe, full, tuple(p.shape), p.dtype)
        state[name] = s
    return {"format": BY_NAME, "param_groups": first["param_groups"], "state": state}
