"""Run one rank's action list from the schedule IR for one optimizer step.

The executor is built once per schedule (`Executor.for_rank`) and runs it every step; a step's values
live in a `StepState` (runtime/step_state.py) made by `run` and dropped when it returns. It does not
decide anything about order — the schedule did; it only executes, waits lazily, frees early, and
records what it measured.

Laziness where it pays: receives are posted when the IR says and waited on by the pass that consumes
them; every vocabulary collective chain (C0, C1, C2, IF reduce, IB broadcast) is handed to the
communication engine (vocab/comm.py: a worker thread on gloo, a CUDA stream on NCCL) and waited on by
the pass that needs its result, so a chain progresses while this rank computes other passes and no
rank's compute thread sits on another rank's critical path.

Freeing early: a send-only p2p batch is polled between passes and dropped as soon as it completes
(its Works hold the sent tensors until then); every value leaves the step state when its last reader
took it.

Timeline (runtime/clock.py): passes, WAIT (time a pass spent waiting for its inputs) and the post of
each p2p batch are marks of the compute lane; each collective chain as the engine ran it is a record of
the "comm" lane. The watchdog (runtime/watchdog.py) is told which pass runs and what it waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vp_accelerate.models.stage import TPHead
from vp_accelerate.models.tensor_parallel import vocab_parallel_cross_entropy as tp_cross_entropy
from vp_accelerate.models.tensor_parallel import vocab_parallel_logit_stats as tp_logit_stats
from vp_accelerate.runtime import p2p, precision
from vp_accelerate.runtime.clock import Clock, HostClock
from vp_accelerate.runtime.groups import Groups
from vp_accelerate.runtime.memory import ActivationMeter, storage_bytes
from vp_accelerate.runtime.step_casts import StepCasts
from vp_accelerate.runtime.step_state import Microbatch, PostedReceive, StepState
from vp_accelerate.runtime.watchdog import Progress
from vp_accelerate.runtime.weight_grad import WeightGradStore
from vp_accelerate.schedule.deps import consumed
from vp_accelerate.schedule.ir import Action, Op, Schedule, p2p_batches
from vp_accelerate.vocab import embedding as vemb
from vp_accelerate.vocab import output_layer as vout

__all__ = ["Executor", "Microbatch", "StepOutput"]


@dataclass
class StepOutput:
    loss_sum: torch.Tensor
    """Σ over this rank's microbatches of Σ_n g_n·loss_n (only meaningful where the loss is known)."""
    peak_activation_bytes: int = 0
    peak_activation_microbatches: float = 0.0
    """Peak of (mb, chunk) activations held from F to B (or W), each weighing its chunk's share of this
    rank's layers — the simulator's unit, so the two can be compared."""
    peak_stash_microbatches: int = 0
    """Peak number of microbatches whose output-layer S->T state is held."""
    peak_comm_bytes: int = 0
    """Peak bytes of communication buffers held (posted receives, sends in flight, collective buffers)."""
    peak_held_bytes: int = 0
    """Peak of activations, stash and communication buffers together."""
    weight_copy_bytes: int = 0
    """Bytes of the low-precision weight copies the step held (mixed precision: one per weight, shared by
    every microbatch; not part of the activation peak)."""
    microbatch_losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Microbatch -> its Σ_n g_n·loss_n where this rank knows it (to name one that went NaN/inf)."""


class Executor:
    """Executes a schedule's actions for one rank over its stage chunks and vocabulary shards."""

    def __init__(
        self,
        schedule: Schedule,
        modules,
        groups: Groups,
        partition,
        out_opts,
        hidden_size: int,
        param_dtype: torch.dtype,
        compute_dtype: torch.dtype | None,
        device: torch.device,
        weight_grads: WeightGradStore | None,
        chunk_weight: dict[int, float] | None = None,
    ):
        self.schedule = schedule
        self.modules = modules
        self.groups = groups
        self.partition = partition
        # ids and labels were checked on the host before the step (PipelineModel._microbatches): the IF and
        # S passes skip the check, which on a GPU is a device->host sync per pass
        self.out_opts = replace(out_opts, check_inputs=False)
        # forward-only steps (evaluation) never run T: S keeps no logits for it, whatever `memory` says
        self.s_opts = replace(self.out_opts, memory="recompute") if schedule.forward_only else self.out_opts
        self.hidden_size = hidden_size
        self.param_dtype = param_dtype  # the parameters' (the last chunk's output, the loss)
        self.compute_dtype = compute_dtype  # mixed precision (runtime/precision.py); None = the parameters' dtype
        # what stages exchange (p2p, C0, IB) and the residual stream runs in: the compute dtype under mixed
        # precision
        self.exchange_dtype = compute_dtype or param_dtype
        self.device = device
        self.weight_grads = weight_grads
        self.chunk_weight = chunk_weight or {}
        self.last_chunk = len(schedule.chunk_rank) - 1
        self.method = schedule.method
        self.vocab = self.method.vocab_parallel
        self.actions = schedule.actions[groups.pp_rank]
        self.clock: Clock = HostClock()
        self.progress = Progress()
        self.state: StepState | None = None  # only while `run` runs
        self.after_pass = None  # called with each compute action once it ran (grad_sync.DPReducer.after_pass)
        # sequence parallelism: stages exchange their TP rank's 1/tp of the sequence (each TP rank with its
        # counterpart), as the residual stream holds it
        tp = next((c.tp for c in modules.chunks.values() if c.tp is not None), None)
        self.p2p_sequence_parts = tp.comm.size if tp is not None and tp.sequence_parallel else 1

    @classmethod
    def for_rank(
        cls,
        parts,
        groups: Groups,
        schedule: Schedule,
        param_dtype: torch.dtype,
        compute_dtype: torch.dtype | None,
        device: torch.device,
    ) -> "Executor":
        """The executor of `schedule` over this rank's parts (runtime/rank_parts.py)."""
        layout = parts.layout
        mine = layout.chunks_of(groups.pp_rank)
        layers = {c: layout.chunk_layers[c][1] - layout.chunk_layers[c][0] for c in mine}
        total = sum(layers.values())  # 0 on a stage the balanced split emptied (its chunk runs only the norm)
        return cls(
            schedule,
            parts.mods,
            groups,
            parts.partition,
            parts.out_opts,
            hidden_size=parts.hf_config.hidden_size,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            device=device,
            weight_grads=parts.weight_grads,
            chunk_weight={c: n / total if total else 0.0 for c, n in layers.items()},
        )

    # ---- helpers -------------------------------------------------------------------------------
    def _owner(self, chunk: int) -> int:
        """Global rank holding `chunk`."""
        return self.groups.global_rank(self.schedule.chunk_rank[chunk])

    def _is_local(self, chunk: int) -> bool:
        return self.schedule.chunk_rank[chunk] == self.groups.pp_rank

    def _empty_act(self) -> torch.Tensor:
        return torch.empty(self.state.act_shape, dtype=self.exchange_dtype, device=self.device)

    def _empty_p2p(self) -> torch.Tensor:
        """A receive buffer: the activation, or under sequence parallelism its TP rank's part of the sequence."""
        b, s, h = self.state.act_shape
        return torch.empty((b, s // self.p2p_sequence_parts, h), dtype=self.exchange_dtype, device=self.device)

    @staticmethod
    def _grad_buffer(param: torch.nn.Parameter) -> torch.Tensor:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    # ---- the step --------------------------------------------------------------------------------
    def run(self, mbs: list[Microbatch], clock: Clock | None = None) -> StepOutput:
        """Run this rank's actions over the microbatches; `clock` (started by the caller) gets every mark."""
        if clock is not None:
            self.clock = clock
        # parameters are not activations: autograd saves views of them (F.linear keeps weight.t()), so
        # their storages are excluded by address rather than by type
        meter = ActivationMeter(exclude={p.untyped_storage().data_ptr() for _, p in self.modules.named_parameters()})
        b, s = mbs[0].input_ids.shape
        self.state = StepState(
            mbs,
            (b, s, self.hidden_size),
            meter,
            StepCasts(self.modules, self.compute_dtype, self.last_chunk, meter, self.schedule.split_backward),
        )
        self.progress.begin_step()
        try:
            return self._run_actions()
        finally:
            self.state = None  # the step's tensors go with it
            self.progress.end_step()

    def _run_actions(self) -> StepOutput:
        st, clock, progress = self.state, self.clock, self.progress
        for item in p2p_batches(self.actions):
            self._drop_completed_sends()
            if isinstance(item, tuple):  # one p2p batch of the IR, posted as one batch_isend_irecv
                begin = clock.mark()
                self._post_p2p(item)
                end = clock.mark()
                for a in item:
                    clock.span(a.op.value, a.mb, a.chunk, begin, end)
                continue
            action = item
            progress.enter(str(action))
            begin = clock.mark()
            if self._await_inputs(action):  # time spent waiting for data is a WAIT, not part of the pass
                now = clock.mark()
                clock.span("WAIT", action.mb, action.chunk, begin, now)
                begin = now
                progress.waiting("")  # computing
            getattr(self, f"_do_{action.op.value}")(action)
            if self.schedule.forward_only:
                self._drop_finished_c1()
            if self.after_pass is not None:  # e.g. the data-parallel reduce of gradients this pass made final
                self.after_pass(action)
            end = clock.mark()
            clock.span(action.op.value, action.mb, action.chunk, begin, end)
            progress.finished(end)  # a CUDA event: the watchdog polls when the device got there
        self._finish_communication()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # a sum of m small terms
        for loss in st.losses.values():
            loss_sum += loss
        return StepOutput(
            loss_sum=loss_sum,
            peak_activation_bytes=st.meter.peak,
            peak_activation_microbatches=st.microbatches_in_flight.peak,
            peak_stash_microbatches=int(st.stashes.peak),
            peak_comm_bytes=st.meter.comm_peak,
            peak_held_bytes=st.meter.held_peak,
            weight_copy_bytes=st.meter.weight_copy_bytes,
            microbatch_losses=dict(st.losses),
        )

    def _finish_communication(self) -> None:
        """At the end of the step: every send, every chain still in flight (e.g. vocab-1's C2 on ranks that
        never needed ∂X, IF reduces whose result lives elsewhere)."""
        st = self.state
        self.progress.waiting("the step's last sends and collective chains")
        for batch in st.send_batches:
            batch.wait()
        st.send_batches.clear()
        for kind, mb in list(st.output_chains):
            self._complete_chain(kind, mb)
        for pending in st.unconsumed:
            pending.wait()
        st.unconsumed.clear()

    def _issue(self, op: Op, mb: int, pending):
        """Hand a collective chain to the clock (its span on the communication lane). A synchronous method's
        (the interlaced pipeline's) rank then waits for it, as a tensor-parallel layer waits for its
        collectives: every rank stops at the vocabulary step until its last collective is done."""
        self.clock.chain(op.value, mb, pending.timer)
        if self.method.synchronous:
            pending.wait()  # idempotent: whoever consumes it later gets the same result
        return pending

    # ---- point to point ----------------------------------------------------------------------
    def _post_p2p(self, acts: tuple[Action, ...]) -> None:
        st = self.state
        ops, receives, sent = [], [], []
        for a in acts:
            peer = self.groups.global_rank(a.peer)
            if a.op is Op.SEND_ACT:
                tensor = self._output_for_consumer(a.mb, a.chunk)
            elif a.op is Op.SEND_GRAD:
                tensor = st.chunk_inputs.pop((a.mb, a.chunk)).grad  # the input itself is no longer needed
            else:
                tensor = self._empty_p2p()
                receives.append(((a.op, a.mb, a.chunk), tensor))
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.groups.pp_group))
                continue
            sent.append(tensor)
            ops.append(dist.P2POp(dist.isend, tensor, peer, self.groups.pp_group))
        # the batch completes as a whole: NCCL returns one Work for it, gloo one per op, so its Works are
        # never paired with its ops — a receive's data is there once its batch is
        batch = p2p.post(ops, ", ".join(str(a) for a in acts))
        st.meter.add_comm(("p2p", id(batch)), sent + [buf for _, buf in receives])
        for key, buf in receives:
            st.posted_receives[key] = PostedReceive(buf, batch)
        if not receives:
            st.send_batches.append(batch)

    def _drop_completed_sends(self) -> None:
        """Let go of the send-only batches that completed: their Works hold the sent tensors until waited.

        Only the oldest batches are polled, stopping at the first one still in flight: a rank's batches on
        the pipeline group complete in issue order (one NCCL stream per communicator; one worker per group
        under the emulation), so a later batch is never done before an earlier one, and each batch is polled
        a bounded number of times in all rather than once per pass (plain gloo's send Works report
        completion only once waited on, and rescanning the whole list every pass cost O(sends^2) a step)."""
        queue = self.state.send_batches
        while queue and queue[0].is_completed():
            batch = queue.popleft()
            batch.wait()  # returns at once; releases the Works and with them the tensors
            self.state.meter.release_comm(("p2p", id(batch)))

    def _complete_receive(self, key) -> bool:
        """Complete a posted receive now (its whole batch: `Batch.wait` is idempotent); True if it was
        still posted."""
        st = self.state
        posted = st.posted_receives.pop(key, None)
        if posted is None:
            return False
        self.progress.waiting(f"{key[0]}(mb={key[1]}, chunk={key[2]}): its p2p batch [{posted.batch.label}]")
        posted.batch.wait()
        st.meter.release_comm(("p2p", id(posted.batch)))  # the receive's buffer is the pass's input now
        st.received[key] = posted.buffer
        self._drop_completed_sends()  # an earlier send to that peer has likely completed meanwhile
        return True

    def _take_receive(self, op: Op, mb: int, chunk: int) -> torch.Tensor:
        key = (op, mb, chunk)
        self._complete_receive(key)
        return self.state.received.pop(key)

    def _await_inputs(self, a: Action) -> bool:
        """Wait for the communication `a` reads (`schedule.deps.consumed`, the rule the validator and the
        NCCL replay use too: its receive, the collective whose result it takes) before the pass starts,
        so measured pass times exclude waiting. True if anything was still pending."""
        st = self.state
        waited = False
        for op, mb, chunk in consumed(self.schedule, self.groups.pp_rank, a):
            if op in (Op.RECV_ACT, Op.RECV_GRAD):
                waited |= self._complete_receive((op, mb, chunk))
                continue
            if op in (Op.C1, Op.C2):
                waited |= self._complete_chain(op, mb)
                continue
            # IF_REDUCE (chunk 0's owner), C0, IB_BCAST: a handle the pass will take
            handle = {Op.IF_REDUCE: st.embed_reduces, Op.C0: st.hidden_bcasts, Op.IB_BCAST: st.embed_grad_bcasts}[
                op
            ].get(mb)
            if handle is not None and not handle.done:
                self.progress.waiting(f"{op}(mb={mb}) on the vocabulary group")
                handle.wait()
                waited = True
        return waited

    # ---- transformer chunk passes ------------------------------------------------------------
    def _chunk_input(self, a: Action) -> torch.Tensor:
        st = self.state
        if a.chunk == 0:
            if self.vocab:
                st.meter.release_comm(("IF", a.mb))
                return st.embed_reduces.pop(a.mb).wait()  # the reduced embedding output (IF_REDUCE)
            return self.modules.embed_tokens(st.microbatches[a.mb].input_ids)  # baseline: the full embedding
        if self._is_local(a.chunk - 1):
            return self._output_for_consumer(a.mb, a.chunk - 1)  # local handoff (V shape turn)
        return self._take_receive(Op.RECV_ACT, a.mb, a.chunk)

    def _do_F(self, a: Action) -> None:
        pack, unpack = self.state.meter.hooks((a.mb, a.chunk))
        chunk = self.modules.chunks[a.chunk]
        chunk.on_checkpoint_input = pack  # a checkpointed layer's input is all it keeps: count it
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                self._forward(a)
        finally:
            chunk.on_checkpoint_input = None
        # held by the step whether a layer saved them or not (counted once): a received input until its gradient
        # leaves (one from this rank's previous chunk is that chunk's output) and the output until B
        x = self.state.chunk_inputs.get((a.mb, a.chunk))
        if a.chunk > 0 and x is not None and not self._is_local(a.chunk - 1):
            pack(x)
        out = self.state.chunk_outputs.get((a.mb, a.chunk))
        if a.chunk != self.last_chunk and out is not None:
            pack(out)

    def _forward(self, a: Action) -> None:
        st = self.state
        mb = st.microbatches[a.mb]
        x = self._chunk_input(a)
        if not (a.chunk == 0 and not self.vocab):
            x = x.detach().requires_grad_(torch.is_grad_enabled())
        if not self.schedule.forward_only:
            st.chunk_inputs[(a.mb, a.chunk)] = x
            st.microbatches_in_flight.add(self.chunk_weight.get(a.chunk, 1.0))
        # The residual stream runs in the exchange dtype (the compute dtype under mixed precision, as
        # Megatron and torchtitan run it): a received activation is used as it arrives and every checkpointed
        # layer input is kept at 2 bytes. It starts from a non-leaf: autocast would cache a cast of a leaf
        # for the whole step.
        x_in = x.to(self.exchange_dtype) if x.dtype != self.exchange_dtype else x.view_as(x)
        with precision.autocast(self.device, self.compute_dtype), precision.swapped(st.casts.swaps(a.chunk)):
            out = self.modules.chunks[a.chunk](x_in, mb.position_ids, mb.attention_mask)
            # what goes to the next chunk travels in the exchange dtype (the receive buffers'); the last
            # chunk's output stays here (the baseline loss, or C0, which casts it itself)
            out = out.to(self.exchange_dtype if a.chunk != self.last_chunk else self.param_dtype)
            if a.chunk == self.last_chunk and not self.vocab:
                st.losses[a.mb] = loss = self._baseline_loss(out, mb)
                if self.schedule.forward_only:
                    st.losses[a.mb] = loss.detach()
                    return
        st.chunk_outputs[(a.mb, a.chunk)] = out

    def _output_for_consumer(self, mb: int, chunk: int) -> torch.Tensor:
        """A chunk's output for the next chunk / C0. Training keeps the graph until B; evaluation drops it."""
        st = self.state
        out = st.chunk_outputs.pop((mb, chunk)) if self.schedule.forward_only else st.chunk_outputs[(mb, chunk)]
        return out.detach().contiguous()

    def _baseline_loss(self, hidden: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Full lm_head + cross-entropy on the last stage, scaled by g so that Σ_mb is the step's mean."""
        logits = self.modules.head_logits(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # softmax in >= fp32
        if isinstance(self.modules.head, TPHead):  # this TP rank's vocabulary columns
            per_token = self._split_head_loss(logits, mb)
        else:
            per_token = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                mb.labels.reshape(-1),
                ignore_index=-100,
                reduction="none",
                label_smoothing=self.out_opts.label_smoothing,
            )
            if mb.loss_fn is not None and getattr(mb.loss_fn, "wants_mean_logits", False):  # TRL's logits/*
                mb.loss_fn.record_mean_logits(logits.detach().mean(dim=-1).reshape(-1))
                if hasattr(mb.loss_fn, "record_token_stats"):  # entropy and top-1 (TRL's DPO metrics)
                    z = logits.detach().reshape(-1, logits.shape[-1])
                    logp = torch.log_softmax(z, dim=-1)
                    entropy = -(logp.exp() * logp).sum(dim=-1)
                    top1 = z.argmax(dim=-1) == mb.labels.reshape(-1).to(z.device)
                    mb.loss_fn.record_token_stats(entropy, top1)
        if mb.loss_fn is not None:  # a sequence loss: its g from the detached CE, its value as the loss
            g, value = mb.loss_fn(per_token.detach())
            surrogate = (per_token * g.to(per_token.dtype)).sum()
            return surrogate - surrogate.detach() + value.to(per_token.dtype)
        return (per_token * mb.grad_scale.to(per_token.dtype)).sum()

    def _split_head_loss(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Per-token cross-entropy of the baseline's output layer split over TP (Megatron's vocab-parallel
        cross-entropy over the stage's TP group), and a preference loss's logit metrics from the same columns."""
        head, V = self.modules.head, self.modules.vocab_size
        if mb.loss_fn is not None and getattr(mb.loss_fn, "wants_mean_logits", False):
            mean, entropy, top1 = tp_logit_stats(logits.detach(), mb.labels, head.start, head.valid, V, head.tp)
            mb.loss_fn.record_mean_logits(mean)
            if hasattr(mb.loss_fn, "record_token_stats"):
                mb.loss_fn.record_token_stats(entropy, top1)
        return tp_cross_entropy(logits, mb.labels, head.start, head.valid, V, head.tp, self.out_opts.label_smoothing)

    def _do_B(self, a: Action) -> None:
        st = self.state
        key = (a.mb, a.chunk)
        out = st.chunk_outputs.pop(key)
        if a.chunk == self.last_chunk:
            if self.vocab:
                grad = self._last_chunk_grad(a.mb)
            else:  # the baseline's loss; only its value stays for the end of the step
                out, grad = st.losses[a.mb], None
                st.losses[a.mb] = out.detach()
        elif self._is_local(a.chunk + 1):
            grad = st.local_grads.pop((a.mb, a.chunk + 1))  # local handoff from the next chunk's B
        else:
            grad = self._take_receive(Op.RECV_GRAD, a.mb, a.chunk)
        if self.weight_grads is not None and self.schedule.split_backward:
            self.weight_grads.key = key
        try:
            with precision.swapped(st.casts.swaps(a.chunk)):  # a checkpointed layer recomputes with the copies
                torch.autograd.backward(out, grad)
        finally:
            if self.weight_grads is not None:
                self.weight_grads.key = None
        x = st.chunk_inputs[key]
        if a.chunk == 0:
            if self.vocab:
                st.embed_grads[a.mb] = x.grad
        elif self._is_local(a.chunk - 1):
            st.local_grads[key] = x.grad
        if not self.schedule.split_backward:
            self._release(key)
        else:  # autograd freed what the forward saved; until W the microbatch holds its weight-gradient queue
            st.meter.release(key)
            if self.weight_grads is not None:
                st.meter.add(key, storage_bytes(self.weight_grads.queued(key), st.meter.exclude))

    def _do_W(self, a: Action) -> None:
        key = (a.mb, a.chunk)
        if self.weight_grads is not None:
            self.weight_grads.flush(key)
        self._release(key)

    def _release(self, key: tuple[int, int]) -> None:
        st = self.state
        st.meter.release(key)
        st.microbatches_in_flight.remove(self.chunk_weight.get(key[1], 1.0))
        # an input whose gradient goes to another rank is dropped by its SEND_GRAD instead
        if key[1] == 0 or self._is_local(key[1] - 1):
            st.chunk_inputs.pop(key, None)

    # ---- input embedding passes (vocabulary parallel) ----------------------------------------
    def _do_IF(self, a: Action) -> None:
        st = self.state
        with torch.no_grad():
            st.embed_partials[a.mb] = vemb.embed_partial(
                st.microbatches[a.mb].input_ids,
                self.modules.embed_weight,
                self.partition,
                self.groups.vocab_rank,
                check_inputs=False,  # checked on the host
            )

    def _do_IF_REDUCE(self, a: Action) -> None:
        # vocabulary collectives name their root by its rank in the group (`Groups.vocab_root`); asynchronous:
        # F of chunk 0 waits for it, other ranks only at the end of the step. With tensor parallelism every TP
        # rank of the first stage needs the sum: an all-reduce
        st = self.state
        partial = st.embed_partials.pop(a.mb)
        g = self.groups
        root = None if g.tp_size > 1 else g.vocab_root(self.schedule.chunk_rank[0])
        pending = self._issue(
            a.op, a.mb, vemb.if_reduce(partial, root, g.vocab_group, async_op=True, keep=self._is_local(0))
        )
        if self._is_local(0):
            st.embed_reduces[a.mb] = pending
            st.meter.add_comm(("IF", a.mb), [partial])  # the reduced embedding output, until F takes it
        else:
            st.unconsumed.append(pending)

    def _do_IB_BCAST(self, a: Action) -> None:
        st = self.state
        root = self.groups.vocab_root(self.schedule.chunk_rank[0])
        if self.groups.vocab_rank == root:  # the first stage's TP rank 0 (its TP ranks hold the same gradient)
            # in the exchange dtype (half the bytes under mixed precision); IB accumulates it into the fp32 grad
            grad = st.embed_grads.pop(a.mb).to(self.exchange_dtype).contiguous()
        else:
            st.embed_grads.pop(a.mb, None)
            grad = self._empty_act()
        st.meter.add_comm(("IB", a.mb), [grad])
        st.embed_grad_bcasts[a.mb] = self._issue(
            a.op, a.mb, vemb.ib_broadcast(grad, root, self.groups.vocab_group, async_op=True)
        )  # IB waits

    def _do_IB(self, a: Action) -> None:
        st = self.state
        ids = st.microbatches[a.mb].input_ids
        grad = st.embed_grad_bcasts.pop(a.mb).wait()
        st.meter.release_comm(("IB", a.mb))
        weight = self.modules.embed_weight
        if not weight.requires_grad:  # frozen vocabulary (LoRA): nothing to accumulate
            return
        if self.modules.padding_idx is not None:  # as HF's lookup: the padding row gets no gradient
            grad = grad * (ids != self.modules.padding_idx).unsqueeze(-1).to(grad.dtype)
        vemb.embed_backward(ids, grad, self._grad_buffer(weight), self.partition, self.groups.vocab_rank)

    # ---- output layer passes (vocabulary parallel) --------------------------------------------
    def _do_C0(self, a: Action) -> None:
        st = self.state
        root = self.groups.vocab_root(self.schedule.chunk_rank[self.last_chunk])
        # the last stage's TP rank 0 speaks for it (its TP ranks hold the same X, the whole sequence)
        if (
            self.groups.vocab_rank == root
        ):  # in the exchange dtype: exact under mixed precision, S multiplies in it anyway
            x = self._output_for_consumer(a.mb, self.last_chunk).to(self.exchange_dtype)
        else:
            x = self._empty_act()
        st.meter.add_comm(("C0", a.mb), [x])
        st.hidden_bcasts[a.mb] = self._issue(
            a.op, a.mb, vout.broadcast_x(x, root, self.groups.vocab_group, async_op=True)
        )  # S waits

    def _do_S(self, a: Action) -> None:
        st = self.state
        mb = st.microbatches[a.mb]
        x = st.hidden_bcasts.pop(a.mb).wait()
        st.meter.release_comm(("C0", a.mb))  # X is part of the stash now
        weight, bias = self.modules.head_weight, self.modules.head_bias
        if self.compute_dtype is not None:  # low-precision matmuls; the statistics stay fp32 inside s_pass
            x, weight = x.to(self.compute_dtype), st.casts.weight(weight)
            bias = None if bias is None else st.casts.weight(bias)
        with torch.no_grad():
            state = vout.s_pass(
                x.reshape(-1, x.shape[-1]),
                mb.labels.reshape(-1),
                mb.grad_scale,
                weight,
                self.partition,
                self.groups.vocab_rank,
                self.s_opts,
                bias=bias,
                loss_fn=mb.loss_fn,
            )
        st.output_states[a.mb] = state
        self._meter_stash(a.mb)
        st.stashes.add()

    def _meter_stash(self, mb: int) -> None:
        """Charge microbatch `mb`'s output-layer state to the meter (again, after C1 changed it). The shard
        (a Parameter, or its per-step low-precision copy shared by every microbatch) is not stash."""
        st = self.state
        meter = st.meter
        meter.release(("S", mb))
        state = st.output_states[mb]
        # the step's inputs (labels: the state keeps a view of them) are not the microbatch's to hold
        inputs = st.microbatches[mb]
        excluded = meter.exclude | set(meter.weight_copies) | {inputs.labels.untyped_storage().data_ptr()}
        meter.add(
            ("S", mb), storage_bytes((v for k, v in vars(state).items() if k not in ("weight", "bias")), excluded)
        )

    def _do_C1(self, a: Action) -> None:
        st = self.state
        st.output_chains[(Op.C1, a.mb)] = self._issue(
            a.op, a.mb, vout.c1(st.output_states[a.mb], self.groups.vocab_group, async_op=True)
        )

    def _complete_chain(self, kind: Op, mb: int) -> bool:
        """Complete an async C1/C2 (True if it was in flight); keep ∂L/∂X where the last chunk's B will
        need it, and the loss once C1 made it."""
        st = self.state
        pending = st.output_chains.pop((kind, mb), None)
        if pending is None:
            return False
        self.progress.waiting(f"{kind}(mb={mb}) on the vocabulary group")
        state = pending.wait()
        if kind is Op.C1:
            st.losses[mb] = state.loss_sum.detach()
        if kind is self.method.grad_barrier:
            if self.groups.rank == self._owner(self.last_chunk):
                st.output_grads[mb] = state.grad_x
                st.meter.add_comm(("dX", mb), [state.grad_x])  # until the last chunk's B takes it
            state.grad_x = None  # [N, h]: elsewhere nobody reads it, and here output_grads holds it
        if kind is Op.C1 and mb in st.output_states and not state.t_done:
            self._meter_stash(mb)  # C1 replaced the vocab-2 partials by the [N] statistics
        if kind is Op.C2:
            st.output_states.pop(mb, None)
        return True

    def _drop_finished_c1(self) -> None:
        """Forward-only steps: take the loss of every C1 that has finished and let go of its microbatch's
        output-layer state (no T will read it); without this each state waits for the step's end, m of them at
        once. Polls without waiting (a CUDA event query, or the worker's flag)."""
        st = self.state
        for kind, mb in [k for k, p in st.output_chains.items() if k[0] is Op.C1 and p.ready()]:
            self._complete_chain(kind, mb)
            st.output_states.pop(mb, None)
            st.meter.release(("S", mb))
            st.stashes.remove()

    def _do_T(self, a: Action) -> None:
        st = self.state
        self._complete_chain(Op.C1, a.mb)
        head, bias = self.modules.head_weight, self.modules.head_bias
        state = st.output_states[a.mb]
        with torch.no_grad():
            vout.t_pass(
                state,
                self._grad_buffer(head) if head.requires_grad else None,
                self._grad_buffer(bias) if bias is not None and bias.requires_grad else None,
            )
        st.meter.release(("S", a.mb))
        st.stashes.remove()
        if not self.method.input_grad_in_t:  # otherwise C2 still all-reduces ∂X
            st.output_states.pop(a.mb)

    def _do_C2(self, a: Action) -> None:
        st = self.state
        st.output_chains[(Op.C2, a.mb)] = self._issue(
            a.op, a.mb, vout.c2(st.output_states[a.mb], self.groups.vocab_group, async_op=True)
        )

    def _last_chunk_grad(self, mb: int) -> torch.Tensor:
        """∂L/∂(last chunk's output) from the output layer, in that output's dtype."""
        self._complete_chain(Op.C1, mb)
        self._complete_chain(Op.C2, mb)
        self.state.meter.release_comm(("dX", mb))
        return self.state.output_grads.pop(mb).reshape(self.state.act_shape).to(self.param_dtype)
