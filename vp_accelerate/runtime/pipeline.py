"""`PipelineModel`: the public API — wrap an HF causal LM, call `train_step` once per optimizer step.

    pipe = PipelineModel(config_or_checkpoint_dir, PipelineConfig(schedule="1f1b", method="vocab-2",
                                                                  microbatches=8))
    opt = pipe.make_optimizer(lr=3e-4)           # AdamW; with dp_size > 1 its state sharded (zero: 1)
    res = pipe.train_step(input_ids, labels)     # forward + backward of every microbatch
    pipe.clip_grad_norm_(1.0); pipe.step(opt); pipe.zero_grad()

`pipe.step(opt)` is `opt.step()` except after a step the fp16 loss scaler skipped (gradient overflow,
`res.skipped`); with any other `mixed_precision` calling `opt.step()` directly is the same.
`dtype` (the parameters') follows `mixed_precision` (float32 master weights for bf16/fp16, bfloat16 for
pure-bf16); with "no" it is the caller's, float32 by default.

Every rank of the pipeline calls the same methods with the same batch (its data-parallel replica's
batch); each rank holds and updates only its own stage chunks and vocabulary shards.
Labels follow HF's convention (`labels` aligned with `input_ids`; the shift happens here), and the
loss is the token mean over the whole step's valid tokens, as `model(input_ids, labels=labels)`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vp_accelerate.cost import shape_from_hf_config
from vp_accelerate.distributed import enable_fault_stacks, init_from_env, local_device
from vp_accelerate.models import check_supported, resolve_config
from vp_accelerate.models.lora import lora_modules, mask_row_grads
from vp_accelerate.models.tensor_parallel import check_config as check_tp_config
from vp_accelerate.runtime import clock, grad_sync, model_io, p2p, precision, shutdown, tensor_parallel, watchdog
from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.runtime.describe import ChunkLayers, RankLayout
from vp_accelerate.runtime.executor import Executor, Microbatch
from vp_accelerate.runtime.groups import build_groups, grid_rank, warm_up
from vp_accelerate.runtime.microbatches import make_microbatches
from vp_accelerate.runtime.preference import REWARD_SUMS, LogpRecorder, PairLoss, Preference, reward_metrics
from vp_accelerate.runtime.rank_parts import build_rank_parts
from vp_accelerate.runtime.step_run import bubble_rate, finish_loss, nonfinite_microbatches, run_schedule
from vp_accelerate.runtime.zero import ZeroOptimizer
from vp_accelerate.schedule.ir import COMPUTE_OPS
from vp_accelerate.vocab import comm


@dataclass
class StepResult:
    loss: float
    """Token-mean loss of the step (the same on every rank)."""
    num_tokens: int
    """Valid (label != -100) tokens in the step, over all data-parallel replicas."""
    step_time_s: float
    """Time of the step's work on this rank (schedule, gradient reductions, the loss read), from the step's
    clock: the device's (CUDA events) on a GPU, the host's on CPU (runtime/clock.py)."""
    bubble_rate: float
    """Mean over pipeline ranks of 1 - (time in compute passes) / (step time), from the same clock."""
    peak_activation_bytes: int
    """This rank's peak of activation bytes held for backward plus stashed vocabulary state."""
    nonfinite_microbatches: tuple[tuple[int, int], ...] = ()
    """(dp replica, microbatch) pairs whose loss was NaN/inf, the same on every rank; empty when all finite."""
    skipped: bool = False
    """fp16 only: the gradients overflowed at this loss scale; do not step the optimizer (`pipe.step` does
    not), the scale was lowered for the next step. The same on every rank."""
    loss_scale: float = 1.0
    """The fp16 loss scale this step ran with (1 otherwise)."""
    rewards: dict[str, float] | None = None
    """Preference steps: TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
    logps/rejected (means over the step's pairs), logits/chosen, logits/rejected (the completions' mean logit per
    token); the same on every rank; None for a token-loss step."""
    tokens_per_s: float = 0.0
    """num_tokens / step_time_s: the pipeline's throughput on this step (the trainer's perf/tokens_per_s
    also counts the optimizer step)."""


class PipelineModel:
    """One rank's part of a pipeline-parallel HF causal LM with vocabulary-parallel ends."""

    def __init__(
        self,
        source,
        config: PipelineConfig | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        adapter: AdapterConfig | None = None,
    ):
        cfg = config or PipelineConfig()
        cfg.check()  # a bad value fails here, before any process group or weights
        if cfg.schedule == "auto":
            raise ValueError(
                "schedule: 'auto' is resolved by the trainer from a recipe; PipelineModel needs a "
                "concrete schedule (see `vp-accelerate plan` for the best one)"
            )
        self.adapter = (adapter or AdapterConfig()).check()
        self.cfg = cfg
        self.precision = precision.resolve(cfg.mixed_precision)
        # fp32 master weights, pure-bf16's bf16, or `dtype`; a contradiction fails here, before any group
        self.dtype = precision.param_dtype(self.precision, dtype)
        self.compute_dtype = precision.low_dtype(self.precision)
        self.loss_scaler = precision.loss_scaler_for(self.precision)
        check_supported(resolve_config(source))  # a family the split cannot run exactly fails here, before any group
        check_tp_config(resolve_config(source), cfg.tp_size)  # heads / MLP not dividing over tp, no TP plan
        tensor_parallel.check_layout(cfg, self.adapter)
        enable_fault_stacks()  # a launched rank killed by a signal (an abort at exit) prints its threads' stacks
        init_from_env()
        self.groups = g = build_groups(cfg.pp_size, cfg.dp_size, cfg.tp_size)
        shutdown.register()  # workers, watchdog and groups end cleanly at exit, close() or not
        p2p.install()  # VP_STRICT_P2P: NCCL's p2p semantics emulated on gloo
        # cuda:LOCAL_RANK (made current), also when accelerate made the group; the CPU without CUDA
        self.device = torch.device(device) if device is not None else local_device()
        self._skip_next_optimizer_step = False  # set by each train_step (fp16 overflow); read by step()
        # schedules, layout, vocabulary shard and modules (runtime/rank_parts.py); the facade names the ones
        # its callers read
        self.parts = parts = build_rank_parts(source, cfg, g, self.dtype, seed, self.device, self.adapter)
        # every communicator connected now, in one order, with nothing else in flight (groups.warm_up)
        warm_up(g, self.device, parts.tied_group)
        self.hf_config, self.layout, self.partition = parts.hf_config, parts.layout, parts.partition
        self.mods, self.lora_transposed = parts.mods, parts.lora_transposed
        self.schedule, self.eval_schedule = parts.schedule, parts.eval_schedule
        self.method = self.schedule.method
        self.vocab = self.method.vocab_parallel
        self.watchdog = (
            watchdog.start(cfg.watchdog_dead_after_s, cfg.watchdog_stall_s)
            if cfg.watchdog_dead_after_s is not None and g.world_size > 1
            else None
        )
        self.last_stats: dict = {}
        self.last_eval_rewards: dict[str, float] | None = None
        self.make_clock = clock.for_device
        """device -> the clock of one step (runtime/clock.py); a test may put a fake in its place."""
        self._executors: dict = {}  # (schedule, dtypes, device) -> its executor, built on first use

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    @property
    def pp_rank(self) -> int:
        return self.groups.pp_rank

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    @property
    def dp_size(self) -> int:
        return self.groups.dp_size

    def describe(self) -> RankLayout:
        """What this rank holds (chunks, decoder layers, vocabulary rows, parameter size); `str()` of it is
        one line for a person. Not a collective: gather it from every rank into a `PipelineLayout`."""
        chunks = tuple(ChunkLayers(c, *self.layout.chunk_layers[c]) for c in self.layout.chunks_of(self.pp_rank))
        rows = None
        if self.vocab:
            start, end = self.partition.shard_range(self.groups.vocab_rank)
            rows = (start, min(end, self.partition.vocab_size))
        first, last = self.pp_rank == self.layout.first_rank, self.pp_rank == self.layout.last_rank
        return RankLayout(
            rank=self.rank,
            pp_rank=self.pp_rank,
            pp_size=self.groups.pp_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            tp_rank=self.groups.tp_rank,
            tp_size=self.groups.tp_size,
            chunks=chunks,
            vocab_size=self.hf_config.vocab_size,
            vocab_rows=rows,
            tied=bool(self.mods.tied),
            full_embedding=not self.vocab and first,
            full_head=not self.vocab and last,
            param_count=sum(p.numel() for p in self.parameters()),
            param_bytes=self.param_bytes(),
        )

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_parameters(self):
        return list(self.mods.named_parameters())

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ---- the step --------------------------------------------------------------------------------
    def _microbatches(
        self, input_ids, labels, attention_mask, position_ids=None, loss_scale: float = 1.0
    ) -> tuple[list[Microbatch], int]:
        tp = self.groups.tp_size
        if tensor_parallel.sequence_parallel(self.cfg) and input_ids.shape[-1] % tp:
            raise ValueError(
                f"sequence length {input_ids.shape[-1]} does not split over tp_size={tp} ranks under sequence "
                f"parallelism: pad the batch to a multiple of {tp} tokens, or set sequence_parallel=False"
            )
        return make_microbatches(
            input_ids,
            labels,
            attention_mask,
            position_ids,
            microbatches=self.cfg.microbatches,
            hf_config=self.hf_config,
            dtype=self.dtype,
            device=self.device,
            dp_group=self.groups.dp_host_group,
            loss_scale=loss_scale,
            mask_uses=len(self.layout.chunks_of(self.pp_rank)),
        )

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        preference: Preference | None = None,
    ) -> StepResult:
        """Forward and backward of every microbatch; gradients accumulate into the parameters' .grad.

        `position_ids` [batch, seq] (default 0..s-1 per row): packed documents restart at 0, and as in HF
        (when no attention_mask is given) each token then attends only inside its own document.
        `preference`: the rows are preference pairs (row 2k chosen, 2k + 1 rejected; KTO: unpaired rows) and
        the loss is TRL's preference loss over them (runtime/preference.py) instead of the token mean.
        """
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        mbs, n_tokens = self._microbatches(input_ids, labels, attention_mask, position_ids, loss_scale=scale)
        pair_losses = self._attach_preference(mbs, preference, input_ids.shape[0], scale, attention_mask)
        self._last_seq = input_ids.shape[1]
        step_clock = self.make_clock(self.device)
        step_clock.start()
        reducer = self._dp_reducer()  # replicas' gradient sums issued during the backward, chunk by chunk
        out = self._run(self.schedule, mbs, step_clock, after_pass=reducer and reducer.after_pass)
        mask_row_grads(self.mods.trained_rows)  # LoRA's trainable token rows: the other rows get no gradient
        self._sync_grads(reducer)
        skipped = False
        if self.loss_scaler is not None:  # every rank of the pipeline decides together (replicas agree already)
            skipped = precision.unscale_and_check(self.parameters(), scale, self.device, self.groups.pp_group)
            self.loss_scaler.update(skipped)
        self._skip_next_optimizer_step = skipped
        # the loss read is the step's one wait for the device (nothing else in the step syncs)
        step_clock.stop()
        loss = self._finish_loss(out.loss_sum) / scale
        times = step_clock.read(self.rank)  # once, after the loss (which synchronised with the device)
        step_time = times.step_time_s
        bad = (
            ()
            if math.isfinite(loss)
            else nonfinite_microbatches(out.microbatch_losses, self.cfg.microbatches, self.groups)
        )
        peak = out.peak_activation_bytes
        self.last_stats = {
            "timeline": times.records,
            "peak_activation_bytes": peak,
            "step_time_s": step_time,
            "peak_activation_microbatches": out.peak_activation_microbatches,
            "peak_stash_microbatches": out.peak_stash_microbatches,
            "peak_comm_bytes": out.peak_comm_bytes,
            "peak_held_bytes": out.peak_held_bytes,
            "weight_copy_bytes": out.weight_copy_bytes,
            "pass_time_s": sum(r.end - r.start for r in times.records if r.op in COMPUTE_OPS),
        }
        if self.device.type == "cuda":
            self.last_stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return StepResult(
            loss=loss,
            num_tokens=n_tokens,
            step_time_s=step_time,
            bubble_rate=bubble_rate(times.records, step_time, self.groups),
            peak_activation_bytes=peak,
            nonfinite_microbatches=bad,
            skipped=skipped,
            loss_scale=scale,
            rewards=self._rewards(pair_losses),
            tokens_per_s=n_tokens / step_time if step_time > 0 else 0.0,
        )

    def step(self, optimizer) -> bool:
        """`optimizer.step()` unless the last train_step was skipped by the fp16 loss scaler (gradient
        overflow); True when it stepped. The same decision on every rank."""
        if self._skip_next_optimizer_step:
            return False
        optimizer.step()
        return True

    def precision_state_dict(self) -> dict:
        """The fp16 loss scaler's state ({} otherwise), to save with a checkpoint."""
        return self.loss_scaler.state_dict() if self.loss_scaler is not None else {}

    def load_precision_state_dict(self, state: dict) -> None:
        if self.loss_scaler is not None and state:
            self.loss_scaler.load_state_dict(state)

    @torch.no_grad()
    def eval_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        preference: Preference | None = None,
    ) -> float:
        """Token-mean loss of a batch with the forward-only schedule (no gradients, no T/B/W passes); with
        `preference`, the preference loss of its pairs (as `train_step`).

        Runs the modules in eval mode (no dropout), as HF's model.eval(); train_step applies the model's dropout.
        """
        mbs, _ = self._microbatches(input_ids, labels, attention_mask, position_ids)
        pair_losses = self._attach_preference(mbs, preference, input_ids.shape[0], 1.0, attention_mask)
        out = self._run_eval(mbs, input_ids.shape[1])
        self.last_eval_rewards = self._rewards(pair_losses)  # a preference batch's rewards (None otherwise)
        return self._finish_loss(out.loss_sum)

    @torch.no_grad()
    def sequence_logps(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        adapter_off: bool = False,
    ) -> torch.Tensor:
        """[batch] float64 log π(row) = Σ over the row's label tokens of log p(label), on the CPU of every
        rank, with the forward-only schedule: the reference log-probabilities of preference training.
        `adapter_off`: of the base model, LoRA adapters disabled for this pass (the reference under LoRA)."""
        mbs, _ = self._microbatches(input_ids, labels, attention_mask, position_ids)
        recorders = [LogpRecorder(mb.input_ids.shape[0]) for mb in mbs]
        for mb, rec in zip(mbs, recorders):
            mb.loss_fn = rec
        with self._adapters_disabled(adapter_off):
            self._run_eval(mbs, input_ids.shape[1])
        known = all(r.logps is not None for r in recorders)  # the baseline: only the last stage's
        logps = (
            torch.cat([r.logps for r in recorders]).to(self.device)
            if known
            else torch.zeros(input_ids.shape[0], dtype=torch.float64, device=self.device)
        )
        if not self.vocab:
            p2p.collective(dist.all_reduce, logps, self.groups.pp_group, "sequence log-prob sum")
        return logps.cpu()

    @torch.no_grad()
    def kl_estimate(
        self,
        kl_input_ids: torch.Tensor,
        kl_labels: torch.Tensor,
        ref_kl_logps: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[float, ...]:
        """KTO's KL estimate z of each microbatch, as TRL 1.16's KTOTrainer computes it per micro-step: the mean over
        the microbatch's mismatched rows (`kl_input_ids`: a prompt with another row's completion) of log π − log
        π_ref, averaged over the data-parallel replicas (TRL gathers every device's), clamped at 0; detached. One
        forward-only pass (`sequence_logps`), and with dp > 1 one all-reduce of `microbatches` numbers."""
        logps = self.sequence_logps(kl_input_ids, kl_labels, attention_mask, position_ids)
        diff = (logps - ref_kl_logps.to(torch.float64)).reshape(self.cfg.microbatches, -1).mean(dim=1)
        if self.groups.dp_group is not None:
            diff = diff.to(self.device)
            p2p.collective(dist.all_reduce, diff, self.groups.dp_group, "KTO KL estimate")
            diff = diff.cpu() / self.dp_size
        return tuple(diff.clamp(min=0).tolist())

    def _run_eval(self, mbs: list[Microbatch], seq: int):
        training = self.mods.container.training
        self.mods.eval()
        try:
            step_clock = self.make_clock(self.device)  # never read: evaluation reports only its loss
            step_clock.start()
            return self._run(self.eval_schedule, mbs, step_clock)
        finally:
            self.mods.train(training)

    @contextlib.contextmanager
    def _adapters_disabled(self, off: bool):
        layers = [layer for c in self.mods.chunks.values() for _, layer in lora_modules(c)] if off else []
        if off and not layers:
            raise ValueError("adapter_off=True needs LoRA adapters; this model has none")
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def _attach_preference(
        self, mbs, preference: Preference | None, batch: int, scale: float, attention_mask=None
    ) -> list[PairLoss]:
        """Give each microbatch the preference loss of its pairs; P counts every replica's pairs."""
        if preference is None:
            return []
        longest = None if attention_mask is None else int(attention_mask.sum(dim=1).max())
        preference.check(batch, self.cfg.microbatches)
        if self.cfg.label_smoothing:
            raise ValueError(
                "label_smoothing: a preference loss compares log-probabilities, which smoothing changes; set it to 0"
            )
        rows = batch // self.cfg.microbatches
        # sft's token mean: this replica's chosen label tokens, summed on the device (no host sync)
        chosen_tokens = sum((mb.labels[0::2] != -100).sum() for mb in mbs)
        out = []
        for k, mb in enumerate(mbs):
            part = slice(k * rows, (k + 1) * rows)
            ref, start = preference.ref_logps, preference.completion_start
            mb.loss_fn = PairLoss(
                labels=mb.labels,
                ref_logps=None if ref is None else ref[part].to(self.device, torch.float64),
                preference=preference,
                pairs=batch // 2 * self.dp_size,
                rows=batch * self.dp_size,
                kl=preference.kl_of(k),
                dp_size=self.dp_size,
                chosen_tokens=chosen_tokens,
                desirable=None if preference.desirable is None else preference.desirable[part].to(self.device),
                loss_scale=scale,
                completion_start=None if start is None else start[part].to(self.device),
                longest=longest,
                microbatches=self.cfg.microbatches,
            )
            out.append(mb.loss_fn)
        return out

    def _rewards(self, pair_losses: list[PairLoss]) -> dict[str, float] | None:
        """The step's reward means on every rank (the baseline knows them on its last stage only)."""
        if not pair_losses:
            return None
        # one row per microbatch: KTOTrainer's metrics are each micro-step's, averaged (the same all-reduces)
        totals = torch.zeros(len(pair_losses), REWARD_SUMS, dtype=torch.float64, device=self.device)
        for k, pl in enumerate(pair_losses):
            if pl.logps is not None:
                totals[k] = pl.rewards()
        if not self.vocab:
            p2p.collective(dist.all_reduce, totals, self.groups.pp_group, "evaluation sums")
        if self.groups.dp_group is not None:
            p2p.collective(dist.all_reduce, totals, self.groups.dp_group, "evaluation sums")
        first = pair_losses[0]
        rows = first.rows if first.desirable is not None else None
        return reward_metrics(totals.cpu(), first.pairs, rows, first.style)

    def _run(self, schedule, mbs: list[Microbatch], step_clock, after_pass=None):
        key = (id(schedule), self.dtype, self.compute_dtype, self.device)
        entry = self._executors.get(key)
        if entry is None or entry[0] is not schedule:  # built once per schedule (a test may swap it)
            ex = Executor.for_rank(self.parts, self.groups, schedule, self.dtype, self.compute_dtype, self.device)
            if self.watchdog is not None:
                ex.progress = self.watchdog.progress
            entry = self._executors[key] = (schedule, ex)
        entry[1].after_pass = after_pass
        return run_schedule(entry[1], mbs, step_clock, self.device, self.compute_dtype, self.watchdog)

    def _finish_loss(self, loss_sum: torch.Tensor) -> float:
        return finish_loss(loss_sum, self.vocab, self.pp_rank == self.layout.last_rank, self.groups)

    def close(self) -> None:
        """Stop the process's watchdog at a normal end of training (peers may then exit in any order),
        and the communication workers (vocabulary chains; strict p2p batches)."""
        comm.close_worker(self.groups.vocab_group)
        comm.close_worker(self.groups.pp_group)
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def _dp_reducer(self) -> grad_sync.DPReducer | None:
        """The step's data-parallel reducer (None without replicas): each decoder chunk's gradients are
        all-reduced right after the rank's last backward pass of that chunk."""
        if self.groups.dp_group is None:
            return None
        final = grad_sync.final_after(self.schedule.actions[self.pp_rank], self.mods.chunks)
        return grad_sync.DPReducer(self.groups.dp_group, final, precision.reduce_dtype(self.cfg.dp_reduce_dtype))

    def _sync_grads(self, reducer: grad_sync.DPReducer | None = None) -> None:
        """Tied baseline weights on two ranks add their gradients; DP replicas add theirs."""
        tied = (
            None
            if self.parts.tied_group is None
            else (self.mods.embed.weight if self.mods.embed is not None else self.mods.head.weight)
        )
        grad_sync.sync_grads(tied, self.parts.tied_group, self.trainable_parameters(), self.groups.dp_group, reducer)
        # tensor parallelism: the norms' (sequence parallel) and per-head norms' gradients are parts of a sum
        partial = [p for p in self.mods.tp_partial_parameters() if p.requires_grad]
        tensor_parallel.sum_partial_grads(partial, self.groups)

    # ---- optimizer-side helpers ----------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global L2 norm over the whole pipeline (each parameter counted once)."""
        g = self.groups
        group = g.pp_group if g.tp_size == 1 else g.vocab_group  # the replica's pp x tp ranks
        return grad_sync.clip_grad_norm(self.named_parameters(), self.mods.is_duplicate, max_norm, self.device, group)

    def stats(self) -> dict:
        """Measurements of the last train step on this rank."""
        return {"param_bytes": self.param_bytes(), **self.last_stats}

    # ---- weights in and out (runtime/model_io.py) ------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by HF-style name (shards of vocabulary matrices keep their shard shape)."""
        return model_io.rank_state_dict(self)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        model_io.load_rank_state_dict(self, sd)

    def gather_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's HF state dict on pipeline rank 0 (None elsewhere); a collective."""
        return model_io.gather_hf_state_dict(self)

    def export_hf(self, out_dir, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """One HF model directory (a collective): each pipeline rank of replica 0 writes its own tensors, the
        vocabulary matrices gathered one at a time; LoRA adapters merged. `dtype`: the files' (None: the
        parameters'). With `tokenizer`, its special-token ids go into the config and it is saved too."""
        model_io.export_hf(self, out_dir, tokenizer, dtype)

    def export_adapter(self, out_dir, base_model_name_or_path: str | None = None, tokenizer=None) -> None:
        """Write a peft adapter folder on rank 0 (a collective); see `model_io.export_adapter`."""
        model_io.export_adapter(self, out_dir, base_model_name_or_path, tokenizer)

    @property
    def zero_sharded(self) -> bool:
        """True when `make_optimizer` shards the optimizer state over data parallelism (`zero: 1`, dp > 1)."""
        return self.cfg.zero == 1 and self.dp_size > 1

    def make_optimizer(self, param_groups=None, optimizer_class=torch.optim.AdamW, **defaults):
        """`optimizer_class(param_groups, **defaults)` over this rank's trainable parameters (default: one
        group of them), or with `zero: 1` and dp_size > 1 the same optimizer with its state sharded over the
        data-parallel replicas (runtime/zero.py; its state_dict is keyed by parameter name)."""
        if param_groups is None:
            param_groups = [{"params": self.trainable_parameters()}]
        if not self.zero_sharded:
            return optimizer_class(param_groups, **defaults)
        g = self.groups
        return ZeroOptimizer(
            param_groups,
            optimizer_class,
            g.dp_group,
            g.dp_rank,
            [grid_rank(d, g.pp_rank, g.tp_rank, g.pp_size, g.tp_size) for d in range(g.dp_size)],  # each replica's
            {p: n for n, p in self.named_parameters()},
            **defaults,
        )

    def trainable_parameters(self):
        """The parameters that train (all of them without an adapter; LoRA's, plus the vocabulary if asked)."""
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token as the paper counts them for MFU (docs/design.md §8; cost.shape's formula),
        at the sequence length of the last step."""
        shape = shape_from_hf_config(self.hf_config, seq=getattr(self, "_last_seq", 2048))
        return shape.model_flops() / shape.tokens
