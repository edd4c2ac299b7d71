"""Run one configuration of the vocabulary layers on a process group and measure it against float64.

Used by the self-test and the tests. Every rank draws the same random problem from `seed`, runs the
distributed passes on its shard (IF, IF reduce, C0, S, C1, T, C2, IB broadcast, IB for each
microbatch, with the microbatches' S/C1/T interleaved in different orders to exercise the explicit
state), computes the float64 reference of the whole problem itself, and returns its relative errors:
max |ours − ref| / max |ref| over loss, ∂X, and its own rows of ∂W and ∂E (padded rows must stay 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .embedding import embed_backward, embed_partial, ib_broadcast, if_reduce
from .output_layer import OutputLayerOptions, broadcast_x, c1, c2, s_pass, t_pass, token_mean_grad_scale
from .partition import VocabPartition, shard_tensor
from .reference import reference


@dataclass(frozen=True)
class VerifyCase:
    """One random problem and the options to solve it with."""

    vocab_size: int = 1000
    """V (real rows)."""
    hidden: int = 32
    """h."""
    tokens: int = 64
    """N, over all microbatches."""
    microbatches: int = 1
    """Split the tokens into this many microbatches (one loss scale g for the whole step)."""
    opts: OutputLayerOptions = OutputLayerOptions()
    """Algorithm, memory mode, chunking, smoothing, softcap, scale."""
    tied: bool = False
    """Use one tensor as embedding and output weight."""
    bias: bool = False
    """Give the output layer a bias (Phi), sharded with the rows; adds "grad_b" to the errors."""
    dtype: str = "float32"
    """Dtype of x and weights ("float32", "bfloat16" or "float64"); statistics stay fp32."""
    pad_multiple: int = 1
    """Partition padding of each shard."""
    ignored_fraction: float = 0.2
    """Fraction of labels set to ignore_index."""
    root: int = 0
    """Group rank holding the first and last stage: IF reduce dst, C0 src, IB broadcast src."""


def _relative_error(ours: torch.Tensor, ref: torch.Tensor, full_ref: torch.Tensor | None = None) -> float:
    """max |ours − ref| / max |full_ref| (the whole tensor's scale, so a shard with tiny entries is fair)."""
    diff = (ours.to(torch.float64) - ref).abs().max().item() if ref.numel() else 0.0
    scale = (ref if full_ref is None else full_ref).abs().max().item()
    return diff / max(scale, 1e-30)


def make_problem(case: VerifyCase, seed: int) -> dict:
    """The random inputs, identical on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    V, h, N = case.vocab_size, case.hidden, case.tokens
    dtype = getattr(torch, case.dtype)
    x0 = torch.randn(N, h, generator=gen)
    emb = torch.randn(V, h, generator=gen) * 0.5
    weight = None if case.tied else torch.randn(V, h, generator=gen) * (3.0 / h**0.5)
    if case.tied:
        emb = emb * (3.0 / h**0.5) / 0.5  # the tied weight doubles as the output layer: keep logits O(3)
    ids = torch.randint(0, V, (N,), generator=gen)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < case.ignored_fraction] = case.opts.ignore_index
    bias = torch.randn(V, generator=gen) if case.bias else None
    # Round the inputs to the run dtype first so the reference sees exactly what the ranks see.
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return dict(x0=cast(x0), emb=cast(emb), weight=cast(weight), ids=ids, labels=labels, bias=cast(bias))


def verify_case(case: VerifyCase, seed: int, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Relative errors {"loss", "grad_x", "grad_w", "grad_e"} of this rank's part of the run."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    part = VocabPartition(case.vocab_size, p, case.pad_multiple)
    prob = make_problem(case, seed)
    o = case.opts
    ref = reference(
        prob["x0"],
        prob["ids"],
        prob["labels"],
        prob["emb"],
        prob["weight"],
        o.label_smoothing,
        o.softcap,
        o.logit_scale,
        o.ignore_index,
        prob["bias"],
    )

    # NCCL needs the tensors on this rank's GPU; the reference stays on the CPU.
    dev = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )
    e_shard = shard_tensor(prob["emb"], part, rank).to(dev)
    w_shard = e_shard if case.tied else shard_tensor(prob["weight"], part, rank).to(dev)
    e_grad = torch.zeros(e_shard.shape, dtype=torch.float32, device=dev)
    w_grad = e_grad if case.tied else torch.zeros(w_shard.shape, dtype=torch.float32, device=dev)
    b_shard = b_grad = None
    if case.bias:  # padded entries are zero and never visited (their logits are -inf)
        b_shard = shard_tensor(prob["bias"], part, rank).to(dev)
        b_grad = torch.zeros(b_shard.shape, dtype=torch.float32, device=dev)

    n_valid = int((prob["labels"] != o.ignore_index).sum())
    mbs = list(range(case.microbatches))
    ids_mb = prob["ids"].to(dev).chunk(case.microbatches)
    labels_mb = prob["labels"].to(dev).chunk(case.microbatches)
    x0_mb = prob["x0"].to(dev).chunk(case.microbatches)

    states = []
    for k in mbs:  # IF, IF reduce, (stage 0 = last stage here: the identity pipeline), C0, S
        partial = embed_partial(ids_mb[k], e_shard, part, rank)
        if_reduce(partial, case.root, group).wait()
        x = x0_mb[k] + partial if rank == case.root else torch.empty_like(x0_mb[k])
        x = x.contiguous()
        broadcast_x(x, case.root, group)
        g = token_mean_grad_scale(labels_mb[k], n_valid, o.ignore_index)
        states.append(s_pass(x, labels_mb[k], g, w_shard, part, rank, o, b_shard))
    # C1 of all microbatches in flight at once, issued newest first; T and C2 oldest first.
    pendings = [c1(states[k], group, async_op=True) for k in reversed(mbs)]
    for pend in pendings:
        pend.wait()
    for k in mbs:
        t_pass(states[k], w_grad, b_grad)
    if o.spec.grad_x_in_t:
        for pend in [c2(states[k], group, async_op=True) for k in mbs]:
            pend.wait()
    for k in mbs:  # IB: the root broadcasts ∂L/∂emb (= ∂L/∂X here), every rank scatter-adds
        grad = states[k].grad_x.clone() if rank == case.root else torch.empty_like(states[k].grad_x)
        ib_broadcast(grad, case.root, group)
        embed_backward(ids_mb[k], grad, e_grad, part, rank)

    loss = sum(s.loss_sum for s in states).cpu()
    grad_x = torch.cat([s.grad_x for s in states]).cpu()
    w_grad, e_grad = w_grad.cpu(), e_grad.cpu()
    start, _ = part.shard_range(rank)
    n = part.valid_rows(rank)
    padded_ok = bool((w_grad[n:] == 0).all()) and bool((e_grad[n:] == 0).all())
    errors = {}
    if case.bias:
        b_grad = b_grad.cpu()
        errors["grad_b"] = (
            _relative_error(b_grad[:n], ref.grad_b[start : start + n], ref.grad_b)
            if bool((b_grad[n:] == 0).all())
            else float("inf")
        )
    return errors | {
        "loss": _relative_error(loss.reshape(1), ref.loss.reshape(1)),
        "grad_x": _relative_error(grad_x, ref.grad_x),
        "grad_w": _relative_error(w_grad[:n], ref.grad_w[start : start + n], ref.grad_w) if padded_ok else float("inf"),
        "grad_e": _relative_error(e_grad[:n], ref.grad_e[start : start + n], ref.grad_e) if padded_ok else float("inf"),
    }
