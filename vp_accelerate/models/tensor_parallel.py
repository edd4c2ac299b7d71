"""Tensor parallelism inside a pipeline stage, on plain tensors: the family's TP plan applied to HF decoder layers.

transformers' configs carry a tensor-parallel plan per family (`base_model_tp_plan`: `layers.*.self_attn.q_proj:
colwise`, `layers.*.self_attn.o_proj: rowwise`, ...). Each TP rank keeps a slice of every planned linear
layer: a colwise layer its 1/tp of the output rows (whole heads, whole MLP columns), a rowwise layer its 1/tp
of the input columns. Megatron's two conjugate operators make the split exact:

- f, where a region (attention, MLP: the module holding colwise layers) starts: identity forward, all-reduce
  of the input gradient backward (each rank's heads contribute a part of it);
- g, after a rowwise layer: all-reduce of the partial outputs forward, identity backward.

HF's attention reshapes with `(-1, head_dim)`, so it runs on the local heads unchanged; the mask and rotary
tables are the full sequence's. Under sequence parallelism the stage's residual stream and norms hold 1/tp of
the sequence per TP rank: f becomes an all-gather of the sequence (reduce-scatter backward) and g a
reduce-scatter (all-gather backward), so no rank holds a norm's or a residual's activations tp times.
Under mixed precision the norm's output is fp32 (HF's norms return it so) while the region's linears read its
16-bit cast (autocast): f all-gathers that cast, half the bytes, and turns it back into fp32 on arrival, so the
linears get the same values and the backward its fp32 gradient sum as before (bit-identical; `GATHER_CAST`).

Everything is plain tensors and autograd functions around the HF modules (hooks, no module replaced, HF
parameter names kept): the zero-bubble B/W split (which replaces `nn.Linear.forward`), activation checkpointing
and the step's weight casts see ordinary linear layers. (torch's DTensor styles would clash with the B/W
split's forward, and their replicated weights' gradients stay partial sums until reduced.)

Gradients a TP rank holds only a part of: a parameter inside a region that the plan does not slice (Qwen3's
per-head q/k norms, `replicated_with_grad_allreduce`), and under sequence parallelism every unsliced parameter
of a decoder layer (its norms see 1/tp of the tokens). `shard_layer` names them; the runtime sums them over
the TP group after the backward.

The collectives come from the runtime (`TPComm`): this layer does not know process groups.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SLICED = ("colwise", "rowwise")
"""Plan styles whose weights are sliced here."""
REPLICATED = ("replicated_with_grad_allreduce",)
"""Plan styles kept whole on every TP rank, their gradients summed over the group."""
PACKED = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}
"""Styles transformers gives fused projections (Phi-3's qkv_proj and gate_up_proj, and the o / down layers after
them): split here as colwise / rowwise, a fused output one part at a time (`packed_parts`), when the layer is one
of those fused projections; elsewhere (OLMo-2's q/k/v, normalised over all heads) refused."""


class TPError(ValueError):
    """A model or layout that tensor parallelism cannot split (said in one line with the fix)."""


@dataclass(frozen=True)
class TPComm:
    """The TP group's collectives, given by the runtime (runtime/tensor_parallel.py). Each returns a new
    tensor; the input is not modified."""

    size: int
    """Ranks in the TP group."""
    rank: int
    """This rank's position in it."""
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    """Sum over the group."""
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    """Concatenate the group's tensors along dim 1 (the sequence), in rank order."""
    reduce_scatter: Callable[[torch.Tensor], torch.Tensor]
    """Sum over the group, then keep this rank's 1/size of dim 1."""
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Elementwise maximum over the group (the vocabulary-parallel cross-entropy's softmax shift)."""


@dataclass(frozen=True)
class TPSpec:
    """How one stage is split: the group's collectives and whether sequence parallelism is on."""

    comm: TPComm
    sequence_parallel: bool


# ------------------------------------------------------------------------------------------- the plan
def layer_plan(config) -> dict[str, str]:
    """A decoder layer's TP plan, relative to the layer: {"self_attn.q_proj": "colwise", ...}."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    out = {}
    for key, style in plan.items():
        head, _, rest = key.partition(".*.")
        if head == "layers" and rest:
            out[rest] = style
    return out


def check_config(config, tp: int) -> None:
    """Refuse, in one line naming the cause and the fix, a model tensor parallelism over `tp` ranks cannot
    split: no plan, a style this runtime does not slice, heads / KV heads / MLP width not divisible by tp."""
    if tp == 1:
        return
    family = getattr(config, "model_type", type(config).__name__)
    plan = layer_plan(config)
    if not plan:
        raise TPError(
            f"pipeline.tp_size {tp}: {family} declares no tensor-parallel plan (config.base_model_tp_plan); "
            f"use tp_size 1 for it (pipeline and data parallelism still apply)"
        )
    odd = sorted({s for p, s in plan.items() if s not in SLICED + REPLICATED and not _packed_ok(config, p, s)})
    if odd:
        raise TPError(
            f"pipeline.tp_size {tp}: {family}'s tensor-parallel plan uses {', '.join(odd)}, which this runtime "
            f"does not split yet (it splits {', '.join(SLICED + REPLICATED)}); use tp_size 1 for {family}"
        )
    for name, attr in (
        ("attention heads", "num_attention_heads"),
        ("key/value heads", "num_key_value_heads"),
        ("MLP width", "intermediate_size"),
    ):
        n = getattr(config, attr, None)
        if isinstance(n, int) and n % tp:
            raise TPError(
                f"pipeline.tp_size {tp}: {family}'s {n} {name} ({attr}) do not divide over {tp} tensor-parallel "
                f"ranks; use a tp_size that divides {n}"
            )


def packed_parts(config, path: str) -> list[int] | None:
    """The output parts of a fused projection `path` (a layer-relative name), each split over TP on its own:
    [q, k, v] rows of a fused qkv_proj, [gate, up] of a fused gate_up_proj; None for any other layer."""
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    name = path.rpartition(".")[2]
    if name == "qkv_proj" and heads and kv and head_dim:
        return [heads * head_dim, kv * head_dim, kv * head_dim]
    if name == "gate_up_proj" and getattr(config, "intermediate_size", None):
        return [config.intermediate_size, config.intermediate_size]
    return None


def _packed_ok(config, path: str, style: str) -> bool:
    """A fused-projection style on a layer this module knows how to split (see `PACKED`)."""
    if style not in PACKED:
        return False
    if PACKED[style] == "colwise":
        return packed_parts(config, path) is not None
    return path.rpartition(".")[2] in ("o_proj", "down_proj")


def join_packed(pieces: list[torch.Tensor], parts: list[int]) -> torch.Tensor:
    """The whole fused tensor from its TP ranks' slices (in rank order): each part's slices joined, parts in order."""
    tp = len(pieces)
    local = [n // tp for n in parts]
    split = [piece.split(local) for piece in pieces]
    return torch.cat([torch.cat([s[k] for s in split]) for k in range(len(parts))])


def _module(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


# ------------------------------------------------------------------------------------------- the operators
GATHER_CAST = True
"""f's sequence all-gather moves an fp32 input in autocast's 16-bit dtype (`_gathered`); False gathers fp32 (the
tests' reference for the bit-identical result)."""


def _gathered(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """The whole sequence of a region's input. An fp32 input under a 16-bit autocast is gathered as the 16-bit
    cast every linear of the region would make of it, then widened back (exact): the same values reach the
    linears, half the bytes cross the links, and the gradient stays fp32."""
    kind = x.device.type
    if GATHER_CAST and x.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        low = torch.get_autocast_dtype(kind)
        if low.itemsize < 4:
            return comm.all_gather(x.to(low)).to(x.dtype)
    return comm.all_gather(x)


class _EnterRegion(torch.autograd.Function):
    """f: identity forward, gradient summed over TP backward (sequence parallel: all-gather the sequence
    forward, reduce-scatter the gradient backward)."""

    @staticmethod
    def forward(ctx, x, comm: TPComm, sp: bool):
        ctx.comm, ctx.sp = comm, sp
        return _gathered(x, comm) if sp else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (ctx.comm.reduce_scatter(grad) if ctx.sp else ctx.comm.all_reduce(grad)), None, None


class _LeaveRegion(torch.autograd.Function):
    """g: partial outputs summed over TP forward, identity backward (sequence parallel: reduce-scatter the
    sequence forward, all-gather the gradient backward)."""

    @staticmethod
    def forward(ctx, x, comm: TPComm, sp: bool):
        ctx.comm, ctx.sp = comm, sp
        x = x.contiguous()
        return comm.reduce_scatter(x) if sp else comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.comm.all_gather(grad.contiguous()) if ctx.sp else grad), None, None


class _SliceSequence(torch.autograd.Function):
    """A stage's input under sequence parallelism: keep this rank's 1/tp of the sequence forward; backward,
    gather the gradient's slices (every TP rank then holds the whole input gradient, as the stage before
    expects: its TP ranks hold the whole activation)."""

    @staticmethod
    def forward(ctx, x, comm: TPComm):
        ctx.comm = comm
        n = x.shape[1] // comm.size
        return x[:, comm.rank * n : (comm.rank + 1) * n].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad.contiguous()), None


class _GatherSequence(torch.autograd.Function):
    """A stage's output under sequence parallelism: the whole sequence forward (all-gather); backward, this
    rank's slice of the (whole, replicated) gradient."""

    @staticmethod
    def forward(ctx, x, comm: TPComm):
        ctx.comm = comm
        return comm.all_gather(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[1] // ctx.comm.size
        r = ctx.comm.rank
        return grad[:, r * n : (r + 1) * n].contiguous(), None


def slice_sequence(x: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """This rank's part of a stage input's sequence (sequence parallelism), else `x`."""
    return _SliceSequence.apply(x, spec.comm) if spec.sequence_parallel else x


def gather_sequence(x: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """The whole sequence of a stage output (sequence parallelism), else `x`."""
    return _GatherSequence.apply(x, spec.comm) if spec.sequence_parallel else x


def copy_to_region(x: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """Megatron's f on a replicated input (the column-parallel output layer's X): identity forward, the input
    gradient summed over TP backward (each rank's vocabulary columns contribute a part of it)."""
    return _EnterRegion.apply(x, spec.comm, False)


# ------------------------------------------------------------------------------------------- the end-stage vocabulary
# The baseline / redis placement keeps the embedding and the output layer on the end stages; under TP each TP rank
# of such a stage holds rows [start, start + S) of the matrix padded to tp x S (`vocab.VocabPartition(V, tp)`, the
# same rows for the embedding and the head, so a tied weight stays one tensor), as Megatron's vocab-parallel
# embedding and column-parallel output layer do.
def vocab_parallel_embed(
    ids: torch.Tensor, weight: torch.Tensor, start: int, valid: int, padding_idx: int | None, spec: TPSpec
) -> torch.Tensor:
    """E[ids] from this TP rank's rows [start, start + valid) (ids outside them give zeros), summed over TP: an
    all-reduce, or under sequence parallelism a reduce-scatter to this rank's 1/tp of the sequence (the residual
    stream's share there), whose backward all-gathers the gradient before the local scatter-add."""
    local = ids - start
    inside = (local >= 0) & (local < valid)
    pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < valid else None
    out = F.embedding(torch.where(inside, local, 0), weight, pad)
    out = out.masked_fill(~inside.unsqueeze(-1), 0.0)
    return _LeaveRegion.apply(out, spec.comm, spec.sequence_parallel)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from this TP rank's columns of the logits (Megatron's vocab-parallel
    cross-entropy): the row maximum by a max all-reduce, then one sum all-reduce of [Σ exp, target logit, Σ logits];
    backward needs no communication (softmax minus the smoothed one-hot, on the local columns)."""

    @staticmethod
    def forward(ctx, z, labels, start: int, valid: int, vocab_size: int, comm: TPComm, eps: float, ignore: int):
        zr = z[:, :valid]
        n = z.shape[0]
        local_max = zr.max(dim=-1).values if valid else z.new_full((n,), float("-inf"))
        m = comm.all_reduce_max(local_max)
        e = torch.exp(zr - m[:, None])
        local = labels - start
        hit = (labels != ignore) & (local >= 0) & (local < valid)
        col = torch.where(hit, local, 0)
        target = torch.where(hit, zr.gather(1, col[:, None])[:, 0] if valid else z.new_zeros(n), 0.0)
        sums = comm.all_reduce(torch.stack([e.sum(-1), target, zr.sum(-1)], dim=1))
        lse = torch.log(sums[:, 0]) + m
        loss = lse - sums[:, 1]
        if eps:
            loss = (1.0 - eps) * loss + eps * (lse - sums[:, 2] / vocab_size)
        kept = labels != ignore
        loss = torch.where(kept, loss, 0.0)
        ctx.save_for_backward(e / sums[:, :1], hit, col, kept)
        ctx.shape, ctx.eps, ctx.vocab_size = z.shape, eps, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad):
        p, hit, col, kept = ctx.saved_tensors
        g = p.clone()
        if g.shape[1]:
            g.scatter_add_(1, col[:, None], -(1.0 - ctx.eps) * hit.to(g.dtype)[:, None])
        if ctx.eps:
            g -= ctx.eps / ctx.vocab_size
        g *= torch.where(kept, grad, 0.0)[:, None]
        out = g.new_zeros(ctx.shape)
        out[:, : g.shape[1]] = g
        return out, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    start: int,
    valid: int,
    vocab_size: int,
    spec: TPSpec,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """[N] per-token cross-entropy (torch's, `reduction="none"`, with label smoothing) of logits whose columns are
    split over TP: `logits` [..., S] this rank's columns for vocabulary rows [start, start + S), the first `valid`
    real (padding columns take no part); the same values on every TP rank."""
    z = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(
        z, labels.reshape(-1).to(z.device), start, valid, vocab_size, spec.comm, float(label_smoothing), ignore_index
    )


@torch.no_grad()
def vocab_parallel_logit_stats(
    logits: torch.Tensor, labels: torch.Tensor, start: int, valid: int, vocab_size: int, spec: TPSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean logit, entropy, target is the top logit) per token of column-split logits (a preference loss's
    metrics), from one max and one sum all-reduce."""
    comm = spec.comm
    zr = logits.reshape(-1, logits.shape[-1])[:, :valid]
    labels = labels.reshape(-1).to(zr.device)
    m = comm.all_reduce_max(zr.max(dim=-1).values)
    e = torch.exp(zr - m[:, None])
    local = labels - start
    hit = (local >= 0) & (local < valid)
    target = torch.where(hit, zr.gather(1, torch.where(hit, local, 0)[:, None])[:, 0], 0.0)
    sums = comm.all_reduce(torch.stack([e.sum(-1), (e * zr).sum(-1), zr.sum(-1), target, hit.to(zr.dtype)], dim=1))
    lse = torch.log(sums[:, 0]) + m
    entropy = lse - sums[:, 1] / sums[:, 0]
    top1 = (sums[:, 4] > 0) & (sums[:, 3] >= m)
    return sums[:, 2] / vocab_size, entropy, top1


# ------------------------------------------------------------------------------------------- slicing a layer
def _slice(t: torch.Tensor, dim: int, comm: TPComm) -> torch.Tensor:
    n = t.shape[dim] // comm.size
    return t.narrow(dim, comm.rank * n, n).clone()


@dataclass
class LayerSplit:
    """What `shard_layer` did to one decoder layer (names relative to the layer)."""

    sliced: dict[str, int]
    """Parameter name -> the dim its slice was cut along (0: colwise rows, 1: rowwise columns)."""
    partial: list[str]
    """Parameters whose gradient on a TP rank is a partial sum over the group."""
    packed: dict[str, list[int]]
    """Fused projections (sliced along dim 0 one part at a time): name -> the parts' whole sizes, in order. A rank's
    slice is then its 1/tp of each part, concatenated (not one contiguous range of the whole)."""


def _slice_parts(t: torch.Tensor, parts: list[int], comm: TPComm) -> torch.Tensor:
    """This rank's 1/tp of each consecutive part of dim 0, concatenated (a fused projection's q, k, v)."""
    out, start = [], 0
    for n in parts:
        out.append(_slice(t[start : start + n], 0, comm))
        start += n
    return torch.cat(out)


@torch.no_grad()
def shard_layer(layer: nn.Module, plan: dict[str, str], spec: TPSpec, config=None) -> LayerSplit:
    """Slice a materialised decoder layer's planned linear layers to this TP rank's part, in place, and install
    f / g around its regions (see the module docstring)."""
    comm, sp = spec.comm, spec.sequence_parallel
    sliced: set[int] = set()
    dims: dict[str, int] = {}
    packed: dict[str, list[int]] = {}
    regions: dict[str, nn.Module] = {}
    partial: list[str] = []
    for path, style in plan.items():
        mod = _module(layer, path)
        if mod is None:
            continue  # a plan entry of another layer type (e.g. MoE experts on dense layers)
        if style in REPLICATED:
            continue
        if not isinstance(mod, nn.Linear):
            raise TPError(f"tensor parallelism: {path} is a {type(mod).__name__}, not a linear layer; use tp_size 1")
        parts = packed_parts(config, path) if style in PACKED and config is not None else None
        style = PACKED.get(style, style)
        if parts is not None and sum(parts) != mod.weight.shape[0]:
            raise TPError(f"tensor parallelism: {path} has {mod.weight.shape[0]} outputs, not {parts}; use tp_size 1")
        if style == "colwise":
            cut = (lambda t: _slice_parts(t, parts, comm)) if parts else (lambda t: _slice(t, 0, comm))
            mod.weight = nn.Parameter(cut(mod.weight))
            if mod.bias is not None:
                mod.bias = nn.Parameter(cut(mod.bias))
            mod.out_features = mod.weight.shape[0]
            dims[f"{path}.weight"] = 0
            if mod.bias is not None:
                dims[f"{path}.bias"] = 0
            if parts:
                packed[f"{path}.weight"] = list(parts)
                if mod.bias is not None:
                    packed[f"{path}.bias"] = list(parts)
            parent = path.rpartition(".")[0]
            regions.setdefault(parent, _module(layer, parent) if parent else layer)
        else:  # rowwise
            if mod.bias is not None:
                raise TPError(
                    f"tensor parallelism: the row-split layer {path} has a bias, which this runtime does not "
                    f"split yet; use tp_size 1"
                )
            mod.weight = nn.Parameter(_slice(mod.weight, 1, comm))
            mod.in_features = mod.weight.shape[1]
            dims[f"{path}.weight"] = 1
            hook = _leave_hook(comm, sp)
            mod._tp_leave = (hook, mod.register_forward_hook(hook))  # moved onto a LoRA wrapper (`move_leave`)
        sliced.update(id(p) for p in mod.parameters(recurse=False))
    for module in regions.values():
        module.register_forward_pre_hook(_enter_hook(comm, sp), with_kwargs=True)
    region_params = {id(p) for m in regions.values() for p in m.parameters()}
    for name, p in layer.named_parameters():
        if id(p) in sliced:
            continue
        if id(p) in region_params or sp:  # a norm on 1/tp of the tokens, or a per-head weight on local heads
            partial.append(name)
    _local_head_counts(layer, comm.size)
    for module in regions.values():
        _local_config(module, comm.size)
    return LayerSplit(dims, partial, packed)


def _local_config(module: nn.Module, tp: int) -> None:
    """An attention module that reads its head count from its config (Phi-3 finds q's end in its fused qkv output
    by `config.num_attention_heads`) gets a copy of the config with this rank's count."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if config is None or not isinstance(heads, int) or not hasattr(module, "head_dim"):
        return
    local = copy.copy(config)
    local.num_attention_heads = heads // tp
    if isinstance(getattr(config, "num_key_value_heads", None), int):
        local.num_key_value_heads = config.num_key_value_heads // tp
    module.config = local


def _leave_hook(comm: TPComm, sp: bool):
    def hook(module, args, out):
        return _LeaveRegion.apply(out, comm, sp)

    return hook


def move_leave(base: nn.Module, wrapper: nn.Module) -> None:
    """Move a row-split layer's g (the sum of the partial outputs over TP) onto the module that wraps it (peft's
    LoRA layer), so that the base's and the adapter's partial outputs are summed together."""
    hook, handle = base._tp_leave
    handle.remove()
    del base._tp_leave
    wrapper._tp_leave = (hook, wrapper.register_forward_hook(hook))


def _enter_hook(comm: TPComm, sp: bool):
    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": _EnterRegion.apply(kwargs["hidden_states"], comm, sp)}
        elif args:
            args = (_EnterRegion.apply(args[0], comm, sp), *args[1:])
        return args, kwargs

    return hook


def _local_head_counts(layer: nn.Module, tp: int) -> None:
    """Attention modules that store head counts (not only `head_dim`) get this rank's: HF's Llama-style attention
    reshapes with -1 heads, others read `num_heads`."""
    for module in layer.modules():
        for attr in ("num_heads", "num_key_value_heads", "num_attention_heads"):
            n = getattr(module, attr, None)
            if isinstance(n, int) and not isinstance(module, nn.Linear) and n % tp == 0 and hasattr(module, "head_dim"):
                setattr(module, attr, n // tp)
