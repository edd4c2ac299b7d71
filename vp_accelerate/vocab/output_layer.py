"""The vocabulary-parallel output layer (lm_head + softmax cross-entropy), pass by pass.

Each rank holds the shard W_i = rows [start, start + shard_size) of the lm_head weight. One
microbatch goes through (docs/design.md §3):

    C0  broadcast_x   X from the rank that holds the last transformer stage to every rank
    S   s_pass        local logits and fp32 row statistics (m_i, s_i, target logit t_i);
                      vocab-2 also a_i = softmax_i·f' W_i and c_i = target·f' W_i
    C1  c1            m = max m_i, s = Σ s_i e^{m_i−m}, loss = log s + m − Σ t_i;
                      vocab-2: ∇x = g ⊙ (Σ e^{m_i−m} a_i / s − Σ c_i)   (the only barrier)
                      naive: also ∇x_i and its all-reduce (its 3rd barrier)
    T   t_pass        ∇W_i += Gᵀ X with G = g ⊙ (P − target) ⊙ f'; vocab-1 also ∇x_i = G W_i
    C2  c2            vocab-1 only: ∇x = Σ ∇x_i

All per-microbatch data lives in an `OutputState`, so a schedule can run S and T of different
microbatches in any order. What a chain (C1, C2) leaves in the state has a storage of its own, never a
view of the chain's all-reduce buffer, and the S values a chain consumed are dropped by it: the bytes a
microbatch holds from C1 to T are its own [N] statistics, ∇x and (store mode) its logits. The loss target is HF/torch cross-entropy with label smoothing ε:
loss_n = lse(z_n) − (1−ε) z_{n,y} − ε/V Σ_v z_{n,v} over the V real classes, ignored tokens 0.

Memory: "store" keeps the transformed logits z (N × V_i fp32, the same bytes as the paper's p̂; T
turns them into P with the global m, s and one exp) from S to T; "recompute" keeps only X and the row
statistics and recomputes z in T (one extra X W_iᵀ). `chunk_size` walks the shard in row chunks with
an online max/sum, so transient memory is one N × chunk block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vp_accelerate import modes

from .checks import check_float, check_same_dtype, check_token_ids
from .comm import Pending, global_rank, submit
from .logits import chunk_logit_derivative, chunk_logits, chunk_ranges, target_columns
from .partition import VocabPartition


@dataclass(frozen=True)
class Algorithm:
    """Where an output-layer algorithm computes ∇x, the one thing the three differ in."""

    grad_x_from_s: bool
    """vocab-2: S also accumulates a_i = softmax_i W_i and c_i, so C1 delivers ∇x (one barrier)."""
    grad_x_in_t: bool
    """vocab-1: T computes the shard's ∇x_i and C2 sums them (two barriers)."""
    # neither (naive): C1's third barrier computes and sums ∇x_i from the stored logits


ALGORITHMS = {
    "naive": Algorithm(grad_x_from_s=False, grad_x_in_t=False),
    "vocab-1": Algorithm(grad_x_from_s=False, grad_x_in_t=True),
    "vocab-2": Algorithm(grad_x_from_s=True, grad_x_in_t=False),
}
"""Algorithm name -> what it does; every branch on the algorithm asks this table."""

# (per-token loss [N], 0 at ignored tokens) -> (g = dL/dloss_n [N], the microbatch's loss term, 0-dim).
# After C1 the per-token loss is complete and the same on every rank, so a loss of whole sequences (a
# preference pair's log-probabilities) gets its g locally, with no extra collective (docs/preference.md).
SequenceLossFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
MEMORY_MODES = tuple(modes.MEMORY_MODES)  # the names of vp_accelerate/modes.py's table


@dataclass(frozen=True)
class OutputLayerOptions:
    """How the output layer computes; the same on every rank of the vocabulary group."""

    algorithm: str = "vocab-2"
    """"naive" (3 barriers in C1), "vocab-1" (C1 + C2, ∇x in T) or "vocab-2" (C1 only, ∇x from S)."""
    memory: str = "store"
    """"store": keep the logits from S to T; "recompute": keep only X and row statistics, redo X W_iᵀ in T."""
    chunk_size: int | None = None
    """Rows of the shard per chunk inside S and T (bounds transient memory); None = the whole shard."""
    label_smoothing: float = 0.0
    """ε of torch/HF cross-entropy: (1−ε)·NLL + ε·mean over the real classes of −log p."""
    softcap: float | None = None
    """Final-logit softcapping cap (Gemma-2: z = cap·tanh(z/cap)), applied after logit_scale; None = off."""
    logit_scale: float = 1.0
    """Multiplier of the raw logits (Cohere-style logit_scale)."""
    ignore_index: int = -100
    """Label value of tokens that carry no loss."""
    check_inputs: bool = True
    """Check label ids are in range in S (costs a host sync on GPU; turn off once the data is known good)."""

    @property
    def spec(self) -> Algorithm:
        """The table entry of `algorithm`."""
        return ALGORITHMS[self.algorithm]

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {tuple(ALGORITHMS)}, got {self.algorithm!r}")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive row count or None, got {self.chunk_size}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")


@dataclass
class OutputState:
    """Everything one microbatch carries between S, C1, T and C2 on one rank."""

    opts: OutputLayerOptions
    partition: VocabPartition
    rank: int
    """This rank's index in the vocabulary group (selects the shard)."""
    x: torch.Tensor
    """[N, h] broadcast final hidden states (kept for ∇W in T, and for the recompute mode)."""
    x_shape: torch.Size
    """Shape of the x the caller passed; grad_x comes back in it."""
    weight: torch.Tensor
    """This rank's shard [shard_size, h] (a reference, not a copy)."""
    bias: torch.Tensor | None
    """This rank's shard [shard_size] of the output bias, or None (most families have none)."""
    labels: torch.Tensor
    """[N] int64 labels."""
    grad_scale: torch.Tensor
    """[N] g in the statistics dtype, zeroed at ignored tokens."""
    local_labels: torch.Tensor
    """[N] label − shard start (meaningful where in_shard)."""
    in_shard: torch.Tensor
    """[N] bool: the label is a real row of this shard (and not ignored)."""
    local_max: torch.Tensor
    """[N] m_i, −inf where the shard has no real rows."""
    local_sum: torch.Tensor | None
    """[N] s_i = Σ_v exp(z_v − m_i) over the shard; freed by C1."""
    local_target: torch.Tensor | None
    """[N] t_i = (1−ε) z_y (if y in shard) + ε/V Σ_v z_v over the shard; freed by C1."""
    logits: list[torch.Tensor] | None = None
    """Store mode: z per chunk, freed by T."""
    local_a: torch.Tensor | None = None
    """vocab-2: [N, h] Σ_v exp(z_v − m_i) f'_v W_v, freed by C1."""
    local_c: torch.Tensor | None = None
    """vocab-2: [N, h] Σ_v target_v f'_v W_v, freed by C1."""
    row_max: torch.Tensor | None = None
    """After C1: [N] global max m."""
    row_sum: torch.Tensor | None = None
    """After C1: [N] global Σ exp(z − m)."""
    loss: torch.Tensor | None = None
    """After C1: [N] per-token loss (0 at ignored tokens), unscaled."""
    loss_sum: torch.Tensor | None = None
    """After C1: 0-dim Σ_n g_n loss_n, equal on every rank."""
    grad_x_local: torch.Tensor | None = None
    """vocab-1 after T: [N, h] this shard's ∇x_i (already scaled by g)."""
    grad_x: torch.Tensor | None = None
    """∂L/∂x in x's shape and dtype: after C1 (naive, vocab-2) or C2 (vocab-1)."""
    loss_fn: SequenceLossFn | None = None
    """A loss of whole sequences (DPO): called in C1 with the per-token loss [N], returns (g [N], loss_sum);
    its g replaces grad_scale before ∇x and T use it. None = the token loss Σ_n g_n loss_n."""
    local_logit_sum: torch.Tensor | None = None
    """[N] Σ of this shard's logits per token, kept for a `loss_fn` that logs mean logits (`wants_mean_logits`,
    TRL's logits/* metrics); summed in C1's first all-reduce, riding along with the target logit."""
    local_exp_logit: torch.Tensor | None = None
    """[N] Σ_v exp(z_v − m_i) z_v of this shard (with `local_logit_sum`): rescaled by exp(m_i − m) and summed in
    C1's second all-reduce beside Σ exp(z − m), it gives each token's entropy (TRL's `entropy` metric)."""
    c1_done: bool = False
    t_done: bool = False

    @property
    def stat_dtype(self) -> torch.dtype:
        return self.local_max.dtype

    def chunks(self) -> list[tuple[int, int]]:
        return chunk_ranges(self.partition.valid_rows(self.rank), self.opts.chunk_size)

    def chunk_z(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """z of chunk `index`: stored (store mode) or recomputed from X (recompute mode)."""
        if self.logits is not None:
            return self.logits[index]
        o = self.opts
        return chunk_logits(self.x, self.weight, lo, hi, o.softcap, o.logit_scale, self.stat_dtype, self.bias)

    def logit_grad(self, z: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """G = g ⊙ (P − target) ⊙ f' of one chunk, [N, hi − lo] in the statistics dtype (needs C1)."""
        o, V = self.opts, self.partition.vocab_size
        # P = exp(z − m − log s): one subtraction and one exp over the chunk, done in place (these
        # elementwise passes cost as much as a matmul at small h).
        grad = z - (self.row_max + torch.log(self.row_sum))[:, None]
        grad.exp_()
        hit, col = target_columns(self.local_labels, self.in_shard, lo, hi)
        grad.scatter_add_(1, col[:, None], (hit.to(grad.dtype) * -(1.0 - o.label_smoothing))[:, None])
        if o.label_smoothing:
            grad -= o.label_smoothing / V
        fprime = chunk_logit_derivative(z, o.softcap, o.logit_scale)
        if torch.is_tensor(fprime):
            grad *= fprime
            grad *= self.grad_scale[:, None]
        else:  # constant f' folds into the per-row scale
            grad *= (self.grad_scale * fprime)[:, None]
        return grad


def token_mean_grad_scale(
    labels: torch.Tensor, num_valid: int | torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """g for a token-mean loss over a step with `num_valid` valid tokens: 1/num_valid, 0 at ignored tokens."""
    valid = (labels != ignore_index).to(torch.float32)
    return valid / max(float(num_valid), 1.0)


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 statistics for fp32/bf16/fp16 inputs; fp64 inputs (references, tests) keep fp64.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_s_inputs(x, labels, grad_scale, weight, partition, rank, opts) -> None:
    check_float(x, "x")
    check_float(weight, "weight")
    check_same_dtype(x, "x", weight, "weight")
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} must be [..., h] and weight {tuple(weight.shape)} [shard_size, h] with the same h"
        )
    if weight.shape[0] != partition.shard_size:
        raise ValueError(
            f"weight has {weight.shape[0]} rows but the partition's shard_size is "
            f"{partition.shard_size} (vocab_size={partition.vocab_size}, world_size="
            f"{partition.world_size}, pad_multiple={partition.pad_multiple}); pass this rank's "
            f"padded shard, e.g. from partition.shard_tensor"
        )
    if not 0 <= rank < partition.world_size:
        raise ValueError(f"rank {rank} outside [0, {partition.world_size})")
    n = x.numel() // x.shape[-1]
    if labels.numel() != n or grad_scale.numel() != n:
        raise ValueError(
            f"x has {n} tokens but labels has {labels.numel()} and grad_scale {grad_scale.numel()}; "
            f"they must match token for token"
        )
    if grad_scale.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"grad_scale must be float32 (or float64), got {grad_scale.dtype}")
    if opts.check_inputs:
        check_token_ids(labels, partition.vocab_size, "labels", opts.ignore_index)
    elif labels.dtype.is_floating_point:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")


def broadcast_x(x: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Pending:
    """C0: broadcast X in place from group rank `src` (x is the receive buffer on the other ranks)."""
    if not x.is_contiguous():
        raise ValueError("x must be contiguous to be broadcast; pass x.contiguous()")

    def chain() -> torch.Tensor:
        dist.broadcast(x, global_rank(group, src), group=group)
        return x

    return submit(chain, group, x.device, [x], "C0", async_op)


def s_pass(
    x: torch.Tensor,
    labels: torch.Tensor,
    grad_scale: torch.Tensor,
    weight: torch.Tensor,
    partition: VocabPartition,
    rank: int,
    opts: OutputLayerOptions,
    bias: torch.Tensor | None = None,
    loss_fn: SequenceLossFn | None = None,
) -> OutputState:
    """S: this shard's logits and row statistics for one microbatch (local, no communication).

    `bias`: the shard [shard_size] of an output bias (z = X Wᵢᵀ + bᵢ), or None. `loss_fn`: a loss of
    whole sequences whose g is known only after C1 (`SequenceLossFn`); `grad_scale` is then unused.
    """
    _check_s_inputs(x, labels, grad_scale, weight, partition, rank, opts)
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias {tuple(bias.shape)} {bias.dtype} must be the shard's [{weight.shape[0]}] entries in "
            f"the weight's dtype {weight.dtype}"
        )
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    n = x2.shape[0]
    sd = _stat_dtype(x)
    labels1 = labels.reshape(-1).to(device=x.device, dtype=torch.long)
    valid = labels1 != opts.ignore_index
    g = torch.where(valid, grad_scale.reshape(-1).to(device=x.device, dtype=sd), 0.0)
    start, _ = partition.shard_range(rank)
    local_labels = labels1 - start
    in_shard = valid & (local_labels >= 0) & (local_labels < partition.valid_rows(rank))

    eps, V = opts.label_smoothing, partition.vocab_size
    m = torch.full((n,), float("-inf"), dtype=sd, device=x.device)
    s = torch.zeros(n, dtype=sd, device=x.device)
    t = torch.zeros(n, dtype=sd, device=x.device)
    two = opts.spec.grad_x_from_s
    zsum = torch.zeros(n, dtype=sd, device=x.device) if getattr(loss_fn, "wants_mean_logits", False) else None
    ez = None if zsum is None else torch.zeros(n, dtype=sd, device=x.device)  # Σ e^{z−m} z: the entropy's
    a = torch.zeros(n, h, dtype=sd, device=x.device) if two else None
    c = torch.zeros(n, h, dtype=sd, device=x.device) if two else None
    stored: list[torch.Tensor] | None = [] if modes.memory_mode(opts.memory).keeps_logits else None

    for lo, hi in chunk_ranges(partition.valid_rows(rank), opts.chunk_size):
        z = chunk_logits(x2, weight, lo, hi, opts.softcap, opts.logit_scale, sd, bias)
        if stored is not None:
            stored.append(z)
        # Online max/sum across chunks (flash-attention style): rescale what was summed so far.
        m_new = torch.maximum(m, z.amax(dim=1))
        rescale = torch.exp(m - m_new)  # m = −inf on the first chunk gives 0
        e = z - m_new[:, None]
        e.exp_()
        s = s * rescale + e.sum(dim=1)
        if ez is not None:
            ez = ez * rescale + (e * z).sum(dim=1)
        hit, col = target_columns(local_labels, in_shard, lo, hi)
        hitf = hit.to(sd)
        t += (1.0 - eps) * hitf * z.gather(1, col[:, None]).squeeze(1)
        if eps:
            t += (eps / V) * z.sum(dim=1)
        if zsum is not None:
            zsum += z.sum(dim=1)
        if two:
            w_chunk = weight[lo:hi]
            fprime = chunk_logit_derivative(z, opts.softcap, opts.logit_scale)
            if torch.is_tensor(fprime):
                a = a * rescale[:, None] + ((e * fprime).to(x.dtype) @ w_chunk).to(sd)
            else:  # constant f' commutes with the matmul: scale the [N, h] result, not the [N, chunk] input
                a = a * rescale[:, None] + (e.to(x.dtype) @ w_chunk).to(sd) * fprime
            f_y = fprime.gather(1, col[:, None]).squeeze(1) if torch.is_tensor(fprime) else fprime
            c += ((1.0 - eps) * hitf * f_y)[:, None] * w_chunk[col].to(sd)
            if eps:
                if torch.is_tensor(fprime):
                    c += (eps / V) * (fprime.to(x.dtype) @ w_chunk).to(sd)
                else:  # constant f': the smoothing term is the same column sum for every token
                    c += (eps / V) * fprime * w_chunk.to(sd).sum(dim=0)
        m = m_new

    return OutputState(
        opts=opts,
        partition=partition,
        rank=rank,
        x=x2,
        x_shape=x.shape,
        weight=weight,
        bias=bias,
        labels=labels1,
        grad_scale=g,
        local_labels=local_labels,
        in_shard=in_shard,
        local_max=m,
        local_sum=s,
        local_target=t,
        logits=stored,
        local_a=a,
        local_c=c,
        loss_fn=loss_fn,
        local_logit_sum=zsum,
        local_exp_logit=ez,
    )


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it is a part of a bigger storage: what a chain leaves in the state
    outlives the chain (until T or the last chunk's B), and a view would keep its whole buffer alive."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _finish_loss(
    state: OutputState,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    target: torch.Tensor,
    logit_sum=None,
    exp_logit=None,
) -> None:
    state.row_max, state.row_sum = row_max, row_sum
    valid = state.labels != state.opts.ignore_index
    state.loss = torch.where(valid, torch.log(row_sum) + row_max - target, 0.0)
    if logit_sum is not None:  # the whole vocabulary's Σ logits per token, for the loss's metrics
        state.loss_fn.record_mean_logits(logit_sum / state.partition.vocab_size)
        state.local_logit_sum = None
    if exp_logit is not None and hasattr(state.loss_fn, "record_token_stats"):
        # entropy = log S + m − Σ p z; top-1 when the target's logit is the global max (no smoothing here)
        entropy = torch.log(row_sum) + row_max - exp_logit / row_sum
        state.loss_fn.record_token_stats(entropy, target >= row_max)
        state.local_exp_logit = None
    if state.loss_fn is not None:  # g from the sequences' own losses: before ∇x (C1) and T read it
        g, state.loss_sum = state.loss_fn(state.loss)
        state.grad_scale = torch.where(valid, g.reshape(-1).to(state.stat_dtype), 0.0)
    else:
        state.loss_sum = (state.grad_scale * state.loss).sum()


def _shard_weight(state: OutputState) -> torch.Tensor:
    # exp(m_i − m): this shard's rescale to the global max; 0 for a shard with no real rows (m_i = −inf).
    return torch.exp(state.local_max - state.row_max)


def c1(state: OutputState, group: dist.ProcessGroup | None = None, async_op: bool = True) -> Pending:
    """C1: global softmax statistics and the loss; vocab-2 also ∇x, naive also ∇x (its extra barriers).

    The whole chain runs on the communication engine (comm.py): the max all-reduce (with the sums that
    do not need it riding along), the rescale by exp(m_i − m), then the sums all-reduce — so it
    completes as soon as every rank has issued it, whatever each rank's compute thread does meanwhile.
    `wait()` returns once `state` is final (loss, loss_sum, and grad_x for naive / vocab-2). The
    sub-collectives are listed, in order, by `schedule.ir.chain_collectives`.
    """
    if state.c1_done:
        raise RuntimeError("c1 already ran for this microbatch state")
    spec = state.opts.spec
    inputs = [state.local_max, state.local_sum, state.local_target]
    if spec.grad_x_from_s:
        inputs += [state.local_a, state.local_c]

    zsum = state.local_logit_sum  # rides along with Σ t_i (one more column, no more collectives)
    extra = [] if zsum is None else [zsum[:, None]]
    if zsum is not None:
        inputs.append(zsum)
    ez = state.local_exp_logit  # rides along with Σ s_i (after the max: rescaled as s is)
    if ez is not None:
        inputs.append(ez)

    def chain() -> OutputState:
        mx = state.local_max.clone()
        works = [dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group, async_op=True)]
        if spec.grad_x_from_s:
            # Σ c_i and Σ t_i do not need the max: they ride along with it.
            ct = torch.cat([state.local_c, state.local_target[:, None], *extra], dim=1)
            works.append(dist.all_reduce(ct, group=group, async_op=True))
        elif spec.grad_x_in_t:
            tt = torch.stack([state.local_target, zsum], dim=1) if extra else state.local_target.clone()
            works.append(dist.all_reduce(tt, group=group, async_op=True))
        for w in works:
            w.wait()
        logit_sum = None
        if extra and spec.grad_x_from_s:
            logit_sum, ct = ct[:, -1].clone(), ct[:, :-1]
        elif extra and spec.grad_x_in_t:
            logit_sum, tt = tt[:, 1].clone(), tt[:, 0].contiguous()
        state.row_max = mx
        w = _shard_weight(state)
        ew = [] if ez is None else [(ez * w)[:, None]]
        if spec.grad_x_from_s:
            sa = torch.cat([(state.local_sum * w)[:, None], *ew, state.local_a * w[:, None]], dim=1)
            dist.all_reduce(sa, group=group)
            # its own storage: a view would keep the whole [N, h+1] all-reduce buffer alive until T
            row_sum = sa[:, 0].clone()
            exp_logit = sa[:, 1].clone() if ew else None
            _finish_loss(state, mx, row_sum, ct[:, -1], logit_sum, exp_logit)
            grad = sa[:, 1 + len(ew) :] / row_sum[:, None] - ct[:, :-1]
            del sa, ct  # the [N, h+1] buffers: nothing below reads them
            state.grad_x = _own_storage((state.grad_scale[:, None] * grad).to(state.x.dtype).reshape(state.x_shape))
            state.local_a = state.local_c = None
        elif spec.grad_x_in_t:
            row_sum = torch.cat([(state.local_sum * w)[:, None], *ew], dim=1) if ew else state.local_sum * w
            dist.all_reduce(row_sum, group=group)
            exp_logit = row_sum[:, 1].contiguous() if ew else None
            row_sum = row_sum[:, 0].contiguous() if ew else row_sum
            _finish_loss(state, mx, row_sum, tt, logit_sum, exp_logit)
        else:  # naive: barrier 2 (sum and target), then local ∇x_i and barrier 3
            cols = [state.local_sum * w, state.local_target, *([zsum] if extra else []), *([ez * w] if ew else [])]
            st = torch.stack(cols, dim=1)
            dist.all_reduce(st, group=group)
            logit_sum = st[:, 2].contiguous() if extra else None
            exp_logit = st[:, -1].contiguous() if ew else None
            _finish_loss(state, mx, st[:, 0].contiguous(), st[:, 1].contiguous(), logit_sum, exp_logit)
            gx = torch.zeros(state.x.shape, dtype=state.stat_dtype, device=state.x.device)
            for i, (lo, hi) in enumerate(state.chunks()):
                grad = state.logit_grad(state.chunk_z(i, lo, hi), lo, hi)
                gx += (grad.to(state.x.dtype) @ state.weight[lo:hi]).to(gx.dtype)
            dist.all_reduce(gx, group=group)
            state.grad_x = _own_storage(gx.to(state.x.dtype).reshape(state.x_shape))
        state.local_sum = state.local_target = None  # summed into row_sum and the loss: dead now
        state.c1_done = True
        return state

    if not (
        spec.grad_x_from_s or spec.grad_x_in_t
    ):  # naive: its third barrier needs the logits and the weight shard too
        inputs += [state.x, state.weight] + list(state.logits or [])
    return submit(chain, group, state.local_max.device, inputs, "C1", async_op)


def t_pass(state: OutputState, weight_grad: torch.Tensor | None, bias_grad: torch.Tensor | None = None) -> None:
    """T: accumulate ∇W_i into `weight_grad` (shard shaped, caller owned; None for a frozen shard);
    vocab-1 also computes ∇x_i.

    With an output bias, `bias_grad` (the shard's [shard_size]; None when frozen) accumulates
    ∇b_i = Σ_n G[n, :], the column sums of G; padded entries are never visited and keep a zero gradient.
    """
    if state.bias is None and bias_grad is not None:
        raise ValueError("t_pass got bias_grad but s_pass was given no bias")
    if not state.c1_done:
        raise RuntimeError("t_pass needs the global statistics: wait() on c1's Pending first")
    if state.t_done:
        raise RuntimeError("t_pass already ran for this microbatch state")
    if weight_grad is not None and tuple(weight_grad.shape) != tuple(state.weight.shape):
        raise ValueError(
            f"weight_grad {tuple(weight_grad.shape)} must have the shard's shape {tuple(state.weight.shape)}"
        )
    one = state.opts.spec.grad_x_in_t
    gx = torch.zeros(state.x.shape, dtype=state.stat_dtype, device=state.x.device) if one else None
    for i, (lo, hi) in enumerate(state.chunks() if one or weight_grad is not None or bias_grad is not None else ()):
        grad = state.logit_grad(state.chunk_z(i, lo, hi), lo, hi).to(state.x.dtype)
        if weight_grad is not None:
            weight_grad[lo:hi] += (grad.t() @ state.x).to(weight_grad.dtype)
        if bias_grad is not None:
            bias_grad[lo:hi] += grad.sum(dim=0).to(bias_grad.dtype)
        if one:
            gx += (grad @ state.weight[lo:hi]).to(gx.dtype)
    state.logits = None  # the stored logits are dead after T: free them now
    state.grad_x_local = gx
    state.t_done = True


def c2(state: OutputState, group: dist.ProcessGroup | None = None, async_op: bool = True) -> Pending:
    """C2 (vocab-1 only): all-reduce the shards' ∇x_i into `state.grad_x` (on the communication engine)."""
    if not state.opts.spec.grad_x_in_t:
        raise ValueError(f"c2 exists only for vocab-1; {state.opts.algorithm} has grad_x after c1")
    if not state.t_done:
        raise RuntimeError("c2 needs ∇x_i from t_pass: run t_pass first")
    gx = state.grad_x_local

    def chain() -> OutputState:
        dist.all_reduce(gx, group=group)
        state.grad_x = _own_storage(gx.to(state.x.dtype).reshape(state.x_shape))
        state.grad_x_local = None
        return state

    return submit(chain, group, gx.device, [gx], "C2", async_op)


def run_output_layer(
    x: torch.Tensor,
    labels: torch.Tensor,
    grad_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_grad: torch.Tensor,
    partition: VocabPartition,
    rank: int,
    opts: OutputLayerOptions,
    group: dist.ProcessGroup | None = None,
    bias: torch.Tensor | None = None,
    bias_grad: torch.Tensor | None = None,
    loss_fn: SequenceLossFn | None = None,
) -> OutputState:
    """S, C1, T (, C2) back to back for one microbatch whose X every rank already holds."""
    state = s_pass(x, labels, grad_scale, weight, partition, rank, opts, bias, loss_fn)
    c1(state, group, async_op=False)
    t_pass(state, weight_grad, bias_grad)
    if opts.spec.grad_x_in_t:
        c2(state, group, async_op=False)
    return state
