"""Run one rank's action list from the schedule IR for one optimizer step.

The executor owns the per-step state: each (microbatch, chunk)'s input and output activations from F
to B, each microbatch's output-layer state from S to T, pending receives and collectives. It does not
decide anything about order — the schedule did; it only executes, waits lazily, frees early, and
records what it measured.

Laziness where it pays: receives are posted when the IR says and waited on by the pass that consumes
them; every vocabulary collective chain (C0, C1, C2, IF reduce, IB broadcast) is handed to the
communication engine (vocab/comm.py: a worker thread on gloo, a CUDA stream on NCCL) and waited on by
the pass that needs its result, so a chain progresses while this rank computes other passes and no
rank's compute thread sits on another rank's critical path.

Timeline: passes, WAIT (time a pass spent waiting for its inputs) and the issue of each collective are
records of the compute lane; each chain as the worker ran it is a record of the "comm" lane.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vp_accelerate.runtime import p2p, precision
from vp_accelerate.runtime.groups import Groups
from vp_accelerate.runtime.memory import ActivationMeter
from vp_accelerate.runtime.weight_grad import WeightGradStore
from vp_accelerate.schedule.deps import consumed
from vp_accelerate.schedule.ir import Action, Op, Schedule, TimedAction, p2p_batches
from vp_accelerate.vocab import embedding as vemb
from vp_accelerate.vocab import output_layer as vout


@dataclass
class Microbatch:
    """Everything a pass needs to know about one microbatch, known before the step starts."""

    input_ids: torch.Tensor
    """[b, s] token ids."""
    labels: torch.Tensor
    """[b, s] next-token labels (already shifted; -100 where ignored)."""
    grad_scale: torch.Tensor
    """[b*s] fp32 per-token dL/dloss_n: 1/N_valid of the whole step for valid tokens, 0 otherwise."""
    position_ids: torch.Tensor
    """[b, s] positions; a restart at 0 begins a new packed document (attention stays inside documents)."""
    attention_mask: torch.Tensor | None = None
    """[b, s] 1 for real tokens, 0 for padding, or None for all real."""
    loss_fn: vout.SequenceLossFn | None = None
    """A loss of whole sequences (DPO, runtime/preference.py) that sets g from the per-token loss after C1
    (the baseline: after its cross-entropy); None = the token loss with `grad_scale`."""


@dataclass
class StepOutput:
    loss_sum: torch.Tensor
    """Σ over this rank's microbatches of Σ_n g_n·loss_n (only meaningful where the loss is known)."""
    records: list[TimedAction] = field(default_factory=list)
    peak_activation_bytes: int = 0
    peak_activation_microbatches: float = 0.0
    """Peak of (mb, chunk) activations held from F to B (or W), each weighing its chunk's share of this
    rank's layers — the simulator's unit, so the two can be compared."""
    peak_stash_microbatches: int = 0
    """Peak number of microbatches whose output-layer S->T state is held."""
    weight_copy_bytes: int = 0
    """Bytes of the low-precision weight copies the step held (mixed precision: one per weight, shared by
    every microbatch; not part of the activation peak). Set by PipelineModel from the executor's meter."""
    microbatch_losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Microbatch -> its Σ_n g_n·loss_n where this rank knows it (to name one that went NaN/inf)."""


class Executor:
    """Executes a schedule's actions for one rank over its stage chunks and vocabulary shards."""

    def __init__(
        self,
        schedule: Schedule,
        rank_modules,
        groups: Groups,
        partition,
        out_opts,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        device: torch.device,
        weight_grads: WeightGradStore | None,
        chunk_weight: dict[int, float] | None = None,
        compute_dtype: torch.dtype | None = None,
        param_dtype: torch.dtype | None = None,
    ):
        self.schedule = schedule
        self.mods = rank_modules
        self.g = groups
        self.partition = partition
        # ids and labels were checked on the host before the step (PipelineModel._microbatches): the IF and
        # S passes skip the check, which on a GPU is a device->host sync per pass
        self.out_opts = replace(out_opts, check_inputs=False)
        self.act_shape = act_shape
        self.act_dtype = act_dtype  # what stages exchange (p2p, C0, IB): the compute dtype under mixed precision
        self.param_dtype = param_dtype or act_dtype  # what a chunk's residual stream runs in (the parameters')
        self.device = device
        self.weight_grads = weight_grads
        self.chunk_weight = chunk_weight or {}
        self.compute_dtype = compute_dtype  # mixed precision (runtime/precision.py); None = the parameters' dtype
        self._low_weights: dict[int, torch.Tensor] = {}  # per step: weights cast once for all microbatches
        self._frozen: dict[int, list] = {}  # chunk -> its frozen matmul weights' per-step copies (swapped in for F)
        self.last_chunk = len(schedule.chunk_rank) - 1
        self.method = schedule.method
        self.vocab = self.method.vocab_parallel
        self.after_pass = None  # called with each compute action once it ran (grad_sync.DPReducer.after_pass)

    # ---- helpers -------------------------------------------------------------------------------
    def _owner(self, chunk: int) -> int:
        """Global rank holding `chunk`."""
        return self.g.global_rank(self.schedule.chunk_rank[chunk])

    def _empty_act(self) -> torch.Tensor:
        return torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)

    def _grad_buffer(self, param: torch.nn.Parameter) -> torch.Tensor:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    # ---- the step --------------------------------------------------------------------------------
    def run(self, mbs: list[Microbatch]) -> StepOutput:
        self.mbs = mbs
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, chunk) -> chunk input (leaf)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, chunk) -> chunk output (graph)
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # (mb, chunk) -> ∂L/∂output
        self.recvs: dict[tuple[Op, int, int], tuple] = {}  # pending receive buffers + their batch
        self.sends: list = []  # batches with sends, waited at the end
        self.partials: dict[int, torch.Tensor] = {}  # IF partial / reduced embedding out
        self.x: dict[int, torch.Tensor] = {}  # C0 result
        self.states: dict[int, object] = {}  # S -> T output-layer state
        self.pending: dict[tuple[Op, int], object] = {}  # async C1/C2 handles
        self.emb_grads: dict[int, torch.Tensor] = {}  # IB gradient of the embedding output
        self.losses: dict[int, torch.Tensor] = {}  # baseline: last chunk's scaled loss
        self.inflight: list = []  # async collectives nobody here consumes
        self.grad_x: dict[int, torch.Tensor] = {}  # ∂L/∂X for the last chunk's B
        # parameters are not activations: autograd saves views of them (F.linear keeps weight.t()), so
        # their storages are excluded by address rather than by type
        self.meter = ActivationMeter(exclude={p.untyped_storage().data_ptr() for _, p in self.mods.named_parameters()})
        self.issued: list[tuple[str, int, object]] = []  # every chain: (op, mb, its timer)
        self.live_mb, self.peak_mb = 0.0, 0.0  # weighted (mb, chunk) activations in flight
        self.live_stash, self.peak_stash = 0, 0  # S->T states held
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # a sum of m small terms
        records: list[TimedAction] = []
        actions = self.schedule.actions[self.g.pp_rank]
        t0 = time.perf_counter()
        for item in p2p_batches(actions):
            if isinstance(item, tuple):  # one p2p batch of the IR, posted as one batch_isend_irecv
                start = time.perf_counter() - t0
                self._p2p(item)
                end = time.perf_counter() - t0
                records += [TimedAction(self.g.rank, b.op.value, b.mb, b.chunk, start, end) for b in item]
                continue
            a = item
            start = time.perf_counter() - t0
            if self._await_inputs(a):  # time spent waiting for data is a WAIT, not part of the pass
                now = time.perf_counter() - t0
                records.append(TimedAction(self.g.rank, "WAIT", a.mb, a.chunk, start, now))
                start = now
            getattr(self, f"_do_{a.op.value}")(a)
            if self.after_pass is not None:  # e.g. the data-parallel reduce of gradients this pass made final
                self.after_pass(a)
            records.append(TimedAction(self.g.rank, a.op.value, a.mb, a.chunk, start, time.perf_counter() - t0))
        for batch in self.sends:
            batch.wait()
        for kind, mb in list(self.pending):  # e.g. vocab-1's C2 on ranks that never needed ∂X
            self._wait(kind, mb)
        for pending in self.inflight:
            pending.wait()
        records += self._comm_records(t0)
        # each microbatch's Σ g·loss: vocabulary methods know it on every rank, the baseline on the last stage
        losses = {mb: st.loss_sum.detach() for mb, st in self.states.items()}
        losses.update({mb: loss.detach() for mb, loss in self.losses.items()})
        for loss in losses.values():
            loss_sum += loss
        return StepOutput(
            loss_sum=loss_sum,
            records=records,
            peak_activation_bytes=self.meter.peak,
            peak_activation_microbatches=self.peak_mb,
            peak_stash_microbatches=self.peak_stash,
            microbatch_losses=losses,
        )

    def _issue(self, op: Op, mb: int, pending):
        """Record collective `op`'s chain for the timeline (host-timed on the communication worker)."""
        if pending.timer is not None:
            self.issued.append((op, mb, pending.timer))
        return pending

    def _comm_records(self, t0: float) -> list[TimedAction]:
        """The chains as they ran on the communication worker (none on CUDA: a stream is not host-timed)."""
        out = []
        for op, mb, timer in self.issued:
            start, end = timer.span()
            out.append(TimedAction(self.g.rank, op.value, mb, 0, start - t0, end - t0, lane="comm"))
        return out

    # ---- point to point ----------------------------------------------------------------------
    def _p2p(self, acts: tuple[Action, ...]) -> None:
        ops, recv_keys = [], []
        for a in acts:
            peer = self.g.global_rank(a.peer)
            if a.op is Op.SEND_ACT:
                ops.append(dist.P2POp(dist.isend, self._output_for_consumer(a.mb, a.chunk), peer, self.g.pp_group))
            elif a.op is Op.SEND_GRAD:
                grad = self.inputs.pop((a.mb, a.chunk)).grad  # the input itself is no longer needed
                ops.append(dist.P2POp(dist.isend, grad, peer, self.g.pp_group))
            else:
                buf = self._empty_act()
                recv_keys.append(((a.op, a.mb, a.chunk), buf))
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.g.pp_group))
        # the batch completes as a whole: NCCL returns one Work for it, gloo one per op, so its Works are
        # never paired with its ops — a receive's data is there once its batch is
        batch = p2p.post(ops, ", ".join(str(a) for a in acts))
        for key, buf in recv_keys:
            self.recvs[key] = (buf, batch)
        if len(recv_keys) < len(ops):
            self.sends.append(batch)

    def _take_recv(self, op: Op, mb: int, chunk: int) -> torch.Tensor:
        buf, batch = self.recvs.pop((op, mb, chunk))
        if batch is not None:
            batch.wait()
        return buf

    def _wait_recv(self, key: tuple[Op, int, int]) -> bool:
        """Complete a posted receive now (its whole batch: `Batch.wait` is idempotent)."""
        buf, batch = self.recvs.get(key, (None, None))
        if batch is None:
            return False
        batch.wait()
        self.recvs[key] = (buf, None)
        return True

    def _await_inputs(self, a: Action) -> bool:
        """Wait for the communication `a` reads (`schedule.deps.consumed`, the rule the validator and the
        NCCL replay use too: its receive, the collective whose result it takes) before the pass starts,
        so measured pass times exclude waiting. True if anything was still pending."""
        waited = False
        for op, mb, chunk in consumed(self.schedule, self.g.pp_rank, a):
            if op in (Op.RECV_ACT, Op.RECV_GRAD):
                waited |= self._wait_recv((op, mb, chunk))
            elif op in (Op.C1, Op.C2):
                if (op, mb) in self.pending:
                    self._wait(op, mb)
                    waited = True
            else:  # IF_REDUCE (chunk 0's owner), C0, IB_BCAST: a handle the pass will take
                handle = {Op.IF_REDUCE: self.partials, Op.C0: self.x, Op.IB_BCAST: self.emb_grads}[op].get(mb)
                if handle is not None:
                    handle.wait()
                    waited = True
        return waited

    # ---- transformer chunk passes ------------------------------------------------------------
    def _chunk_input(self, a: Action) -> torch.Tensor:
        mb = self.mbs[a.mb]
        if a.chunk == 0:
            if self.vocab:
                return self.partials.pop(a.mb).wait()  # the reduced embedding output (IF_REDUCE)
            return self.mods.embed_tokens(mb.input_ids)  # baseline: the full embedding lives here
        if self.schedule.chunk_rank[a.chunk - 1] == self.g.pp_rank:
            return self._output_for_consumer(a.mb, a.chunk - 1)  # local handoff (V shape turn)
        return self._take_recv(Op.RECV_ACT, a.mb, a.chunk)

    def _do_F(self, a: Action) -> None:
        mb = self.mbs[a.mb]
        pack, unpack = self.meter.hooks((a.mb, a.chunk))
        chunk = self.mods.chunks[a.chunk]
        chunk.on_checkpoint_input = pack  # a checkpointed layer's input is all it keeps: count it
        try:
            self._forward(a, mb, pack, unpack)
        finally:
            chunk.on_checkpoint_input = None

    def _forward(self, a: Action, mb: Microbatch, pack, unpack) -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            x = self._chunk_input(a)
            if not (a.chunk == 0 and not self.vocab):
                x = x.detach().requires_grad_(torch.is_grad_enabled())
            if not self.schedule.forward_only:
                self.inputs[(a.mb, a.chunk)] = x
                self.live_mb += self.chunk_weight.get(a.chunk, 1.0)
                self.peak_mb = max(self.peak_mb, self.live_mb)
            # The chunk starts from the parameters' dtype (a received activation arrives in the exchange
            # dtype), and from a non-leaf: autocast would cache a cast of a leaf for the whole step.
            x_in = x.to(self.param_dtype) if x.dtype != self.param_dtype else x.view_as(x)
            with precision.autocast(self.device, self.compute_dtype), precision.swapped(self._frozen_copies(a.chunk)):
                out = self.mods.chunks[a.chunk](x_in, mb.position_ids, mb.attention_mask)
                # what goes to the next chunk travels in the exchange dtype (the receive buffers'); the last
                # chunk's output stays here (the baseline loss, or C0, which casts it itself)
                out = out.to(self.act_dtype if a.chunk != self.last_chunk else self.param_dtype)
                if a.chunk == self.last_chunk and not self.vocab:
                    self.losses[a.mb] = self._baseline_loss(out, mb)
                    if self.schedule.forward_only:
                        return
        self.outputs[(a.mb, a.chunk)] = out

    def _frozen_copies(self, chunk: int) -> list:
        """(module, name, low-precision copy) of the chunk's frozen matmul weights (and the full lm_head's on
        the last chunk), cast once per step and shared by every microbatch; [] without mixed precision."""
        if self.compute_dtype is None:
            return []
        if chunk not in self._frozen:
            mods = [self.mods.chunks[chunk]]
            if chunk == self.last_chunk and self.mods.head is not None:
                mods.append(self.mods.head)
            self._frozen[chunk] = [
                (owner, name, self._low_weight(w))
                for m in mods
                for owner, name, w in precision.frozen_matmul_weights(m)
            ]
        return self._frozen[chunk]

    def _output_for_consumer(self, mb: int, chunk: int) -> torch.Tensor:
        """A chunk's output for the next chunk / C0. Training keeps the graph until B; evaluation drops it."""
        out = self.outputs.pop((mb, chunk)) if self.schedule.forward_only else self.outputs[(mb, chunk)]
        return out.detach().contiguous()

    def _baseline_loss(self, hidden: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Full lm_head + cross-entropy on the last stage, scaled by g so that Σ_mb is the step's mean."""
        logits = self.mods.head_logits(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # softmax in >= fp32
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            mb.labels.reshape(-1),
            ignore_index=-100,
            reduction="none",
            label_smoothing=self.out_opts.label_smoothing,
        )
        if mb.loss_fn is not None:  # a sequence loss: its g from the detached CE, its value as the loss
            g, value = mb.loss_fn(per_token.detach())
            surrogate = (per_token * g.to(per_token.dtype)).sum()
            return surrogate - surrogate.detach() + value.to(per_token.dtype)
        return (per_token * mb.grad_scale.to(per_token.dtype)).sum()

    def _do_B(self, a: Action) -> None:
        key = (a.mb, a.chunk)
        out = self.outputs.pop(key)
        if a.chunk == self.last_chunk:
            if self.vocab:
                grad = self._vocab_grad_x(a.mb)
            else:
                out, grad = self.losses[a.mb], None
        elif self.schedule.chunk_rank[a.chunk + 1] == self.g.pp_rank:
            grad = self.grads.pop((a.mb, a.chunk + 1))  # local handoff from the next chunk's B
        else:
            grad = self._take_recv(Op.RECV_GRAD, a.mb, a.chunk)
        if self.weight_grads is not None and self.schedule.split_backward:
            self.weight_grads.key = key
        try:
            torch.autograd.backward(out, grad)
        finally:
            if self.weight_grads is not None:
                self.weight_grads.key = None
        x = self.inputs[key]
        if a.chunk == 0:
            if self.vocab:
                self.emb_grads[a.mb] = x.grad
        elif self.schedule.chunk_rank[a.chunk - 1] == self.g.pp_rank:
            self.grads[(a.mb, a.chunk)] = x.grad
        if not self.schedule.split_backward:
            self._release(key)

    def _do_W(self, a: Action) -> None:
        key = (a.mb, a.chunk)
        if self.weight_grads is not None:
            self.weight_grads.flush(key)
        self._release(key)

    def _release(self, key: tuple[int, int]) -> None:
        self.meter.release(key)
        self.live_mb -= self.chunk_weight.get(key[1], 1.0)
        # an input whose gradient goes to another rank is dropped by its SEND_GRAD instead
        if key[1] == 0 or self.schedule.chunk_rank[key[1] - 1] == self.g.pp_rank:
            self.inputs.pop(key, None)

    # ---- input embedding passes (vocabulary parallel) ----------------------------------------
    def _do_IF(self, a: Action) -> None:
        mb = self.mbs[a.mb]
        with torch.no_grad():
            self.partials[a.mb] = vemb.embed_partial(
                mb.input_ids, self.mods.embed_weight, self.partition, self.g.pp_rank, check_inputs=False
            )  # checked on the host

    def _do_IF_REDUCE(self, a: Action) -> None:
        # vocabulary collectives name their root by its rank in the group, i.e. its pipeline rank
        # asynchronous: F of chunk 0 waits for it, other ranks only at the end of the step
        pending = self._issue(
            a.op,
            a.mb,
            vemb.if_reduce(self.partials.pop(a.mb), self.schedule.chunk_rank[0], self.g.vocab_group, async_op=True),
        )
        if self.g.rank == self._owner(0):
            self.partials[a.mb] = pending
        else:
            self.inflight.append(pending)

    def _do_IB_BCAST(self, a: Action) -> None:
        src = self.schedule.chunk_rank[0]
        # in the exchange dtype (half the bytes under mixed precision); IB accumulates it into the fp32 grad
        grad = self.emb_grads.pop(a.mb).to(self.act_dtype).contiguous() if self.g.pp_rank == src else self._empty_act()
        self.emb_grads[a.mb] = self._issue(
            a.op,
            a.mb,
            vemb.ib_broadcast(  # IB waits
                grad, src, self.g.vocab_group, async_op=True
            ),
        )

    def _do_IB(self, a: Action) -> None:
        mb = self.mbs[a.mb]
        grad = self.emb_grads.pop(a.mb).wait()
        if not self.mods.embed_weight.requires_grad:  # frozen vocabulary (LoRA): nothing to accumulate
            return
        if self.mods.padding_idx is not None:  # as HF's lookup: the padding row gets no gradient
            grad = grad * (mb.input_ids != self.mods.padding_idx).unsqueeze(-1).to(grad.dtype)
        vemb.embed_backward(
            mb.input_ids, grad, self._grad_buffer(self.mods.embed_weight), self.partition, self.g.pp_rank
        )

    # ---- output layer passes (vocabulary parallel) --------------------------------------------
    def _do_C0(self, a: Action) -> None:
        src = self.schedule.chunk_rank[self.last_chunk]
        if self.g.pp_rank == src:  # in the exchange dtype: exact under mixed precision, S multiplies in it anyway
            x = self._output_for_consumer(a.mb, self.last_chunk).to(self.act_dtype)
        else:
            x = self._empty_act()
        self.x[a.mb] = self._issue(a.op, a.mb, vout.broadcast_x(x, src, self.g.vocab_group, async_op=True))  # S waits

    def _do_S(self, a: Action) -> None:
        mb = self.mbs[a.mb]
        x = self.x.pop(a.mb).wait()
        weight, bias = self.mods.head_weight, self.mods.head_bias
        if self.compute_dtype is not None:  # low-precision matmuls; the statistics stay fp32 inside s_pass
            x, weight = x.to(self.compute_dtype), self._low_weight(weight)
            bias = None if bias is None else self._low_weight(bias)
        with torch.no_grad():
            st = vout.s_pass(
                x.reshape(-1, x.shape[-1]),
                mb.labels.reshape(-1),
                mb.grad_scale,
                weight,
                self.partition,
                self.g.pp_rank,
                self.out_opts,
                bias=bias,
                loss_fn=mb.loss_fn,
            )
        self.states[a.mb] = st
        # the shard (a Parameter, or its per-step low-precision copy shared by every microbatch) is not stash
        self.meter.add(
            ("S", a.mb),
            _tensor_bytes((v for k, v in vars(st).items() if k not in ("weight", "bias")), self.meter.exclude),
        )
        self.live_stash += 1
        self.peak_stash = max(self.peak_stash, self.live_stash)

    def _low_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in the compute dtype, cast once per step (weights change only between steps) and shared
        by every microbatch: a vocabulary shard, or a frozen matmul weight. The meter counts it once."""
        key = id(weight)
        if key not in self._low_weights:
            self._low_weights[key] = weight.detach().to(self.compute_dtype)
            self.meter.add_weight_copy(self._low_weights[key])
        return self._low_weights[key]

    def _do_C1(self, a: Action) -> None:
        self.pending[(Op.C1, a.mb)] = self._issue(
            a.op, a.mb, vout.c1(self.states[a.mb], self.g.vocab_group, async_op=True)
        )

    def _wait(self, kind: Op, mb: int) -> None:
        """Complete an async C1/C2; keep ∂L/∂X where the last chunk's B will need it."""
        p = self.pending.pop((kind, mb), None)
        if p is None:
            return
        p.wait()
        done = self.method.grad_barrier  # the collective that completes ∂L/∂X
        if kind == done and self.g.rank == self._owner(self.last_chunk):
            self.grad_x[mb] = self.states[mb].grad_x
        if kind is Op.C2:
            self._drop_state(mb)

    def _do_T(self, a: Action) -> None:
        self._wait(Op.C1, a.mb)
        with torch.no_grad():
            head, bias = self.mods.head_weight, self.mods.head_bias
            vout.t_pass(
                self.states[a.mb],
                self._grad_buffer(head) if head.requires_grad else None,
                self._grad_buffer(bias) if bias is not None and bias.requires_grad else None,
            )
        self.meter.release(("S", a.mb))
        self.live_stash -= 1
        if not self.method.input_grad_in_t:  # otherwise C2 still all-reduces ∂X
            self._drop_state(a.mb)

    def _do_C2(self, a: Action) -> None:
        self.pending[(Op.C2, a.mb)] = self._issue(
            a.op, a.mb, vout.c2(self.states[a.mb], self.g.vocab_group, async_op=True)
        )

    def _vocab_grad_x(self, mb: int) -> torch.Tensor:
        self._wait(Op.C1, mb)
        self._wait(Op.C2, mb)
        return self.grad_x.pop(mb).reshape(self.act_shape).to(self.param_dtype)  # the last chunk's output dtype

    def _drop_state(self, mb: int) -> None:
        """Free the big S->T tensors but keep the loss, which is read at the end of the step."""
        st = self.states[mb]
        self.states[mb] = _LossOnly(st.loss_sum)


@dataclass
class _LossOnly:
    loss_sum: torch.Tensor


def _tensor_bytes(values, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct tensor storages among `values` (the S->T state kept alive), leaving out the
    storages in `exclude` (the parameters: the state refers to the weight shard, it does not copy it)."""
    seen: dict[int, int] = {}
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    for v in flat:
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device.type != "meta":
            s = v.untyped_storage()
            if s.data_ptr() not in exclude:
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
