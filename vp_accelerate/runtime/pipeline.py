"""`PipelineModel`: the public API — wrap an HF causal LM, call `train_step` once per optimizer step.

    pipe = PipelineModel(config_or_checkpoint_dir, PipelineConfig(schedule="1f1b", method="vocab-2",
                                                                  microbatches=8))
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
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

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vp_accelerate.cost import layout_costs, plan_layout, shape_from_hf_config
from vp_accelerate.distributed import init_from_env, local_device
from vp_accelerate.models import StageLayout, build_rank, check_supported, resolve_config
from vp_accelerate.runtime import grad_sync, model_io, p2p, precision, shutdown, watchdog
from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.runtime.describe import ChunkLayers, RankLayout
from vp_accelerate.runtime.executor import Executor, Microbatch
from vp_accelerate.runtime.groups import build_groups
from vp_accelerate.runtime.microbatches import make_microbatches
from vp_accelerate.runtime.weight_grad import WeightGradStore, install
from vp_accelerate.schedule import build_schedule
from vp_accelerate.schedule.ir import COMPUTE_OPS, TimedAction
from vp_accelerate.vocab import comm
from vp_accelerate.vocab.output_layer import OutputLayerOptions
from vp_accelerate.vocab.partition import VocabPartition


@dataclass
class StepResult:
    loss: float
    """Token-mean loss of the step (the same on every rank)."""
    num_tokens: int
    """Valid (label != -100) tokens in the step, over all data-parallel replicas."""
    step_time_s: float
    """Wall time of the step on this rank."""
    bubble_rate: float
    """Mean over pipeline ranks of 1 - (time in compute passes) / (step time)."""
    peak_activation_bytes: int
    """This rank's peak of activation bytes held for backward plus stashed vocabulary state."""
    nonfinite_microbatches: tuple[tuple[int, int], ...] = ()
    """(dp replica, microbatch) pairs whose loss was NaN/inf, the same on every rank; empty when all finite."""
    skipped: bool = False
    """fp16 only: the gradients overflowed at this loss scale; do not step the optimizer (`pipe.step` does
    not), the scale was lowered for the next step. The same on every rank."""
    loss_scale: float = 1.0
    """The fp16 loss scale this step ran with (1 otherwise)."""


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
        init_from_env()
        self.groups = g = build_groups(cfg.pp_size, cfg.dp_size)
        shutdown.register()  # workers, watchdog and groups end cleanly at exit, close() or not
        p2p.install()  # VP_STRICT_P2P: NCCL's p2p semantics emulated on gloo
        # cuda:LOCAL_RANK (made current), also when accelerate made the group; the CPU without CUDA
        self.device = torch.device(device) if device is not None else local_device()
        self._skip_next_optimizer_step = False  # set by each train_step (fp16 overflow); read by step()
        self.hf_config = resolve_config(source)
        self.schedule = build_schedule(
            cfg.schedule, cfg.method, g.pp_size, cfg.microbatches, chunks_per_rank=cfg.chunks_per_rank
        )
        self.eval_schedule = build_schedule(
            cfg.schedule,
            cfg.method,
            g.pp_size,
            cfg.microbatches,
            chunks_per_rank=cfg.chunks_per_rank,
            forward_only=True,
        )
        self.method = self.schedule.method
        self.vocab = self.method.vocab_parallel
        self.layout = self._layout()
        # each rank's order from the cost model's pass times (schedule/list_schedule.py); the unit-grid
        # schedule above only gave the layout. Every rank computes the same order from the same inputs.
        costs = layout_costs(
            self.hf_config, self.schedule, self.layout, cfg.activation_checkpointing, device=self.device.type
        )
        self.schedule = build_schedule(
            cfg.schedule, cfg.method, g.pp_size, cfg.microbatches, chunks_per_rank=cfg.chunks_per_rank, costs=costs
        )
        self.eval_schedule = build_schedule(
            cfg.schedule,
            cfg.method,
            g.pp_size,
            cfg.microbatches,
            chunks_per_rank=cfg.chunks_per_rank,
            forward_only=True,
            costs=costs,
        )
        self.partition = VocabPartition(self.hf_config.vocab_size, g.pp_size, cfg.pad_multiple) if self.vocab else None
        self.mods = build_rank(
            source,
            self.layout,
            g.pp_rank,
            "vocab" if self.vocab else "baseline",
            self.partition,
            dtype=self.dtype,
            seed=seed,
            device=self.device,
            attn_implementation=cfg.attn_implementation,
        )
        self.lora_transposed: list[str] = []
        if self.adapter.enabled:  # before the B/W split patches the linear layers (LoRA's included)
            from vp_accelerate.models.lora import apply_lora

            self.lora_transposed = apply_lora(self.mods, self.adapter, seed, self.dtype)
        self._tied_group = self._make_tied_group()
        self.watchdog = (
            watchdog.start(cfg.watchdog_dead_after_s)
            if cfg.watchdog_dead_after_s is not None and g.world_size > 1
            else None
        )
        # without VP the algorithm is unused (the last stage runs the whole output layer): keep the default
        algorithm = self.method.output_algorithm or OutputLayerOptions.algorithm
        self.out_opts = OutputLayerOptions(
            algorithm=algorithm,
            memory=cfg.memory,
            chunk_size=cfg.chunk_size,
            label_smoothing=cfg.label_smoothing,
            softcap=self.mods.final_softcap,
            logit_scale=self.mods.logit_scale,
        )
        for chunk in self.mods.chunks.values():
            chunk.set_activation_checkpointing(cfg.activation_checkpointing)
        self.weight_grads = None
        if self.schedule.split_backward:
            self.weight_grads = WeightGradStore()
            for chunk in self.mods.chunks.values():
                install(chunk, self.weight_grads)
        self.last_stats: dict = {}

    # ---- construction helpers --------------------------------------------------------------------
    def _layout(self) -> StageLayout:
        return plan_layout(self.hf_config, self.schedule, self.cfg.layers_per_stage)

    def _make_tied_group(self):
        """Baseline with tied weights: the first and last stage each hold the matrix and must add their
        gradients. Every rank creates every replica's pair group (new_group is collective)."""
        first, last = self.layout.first_rank, self.layout.last_rank
        if self.vocab or not self.mods.tied or first == last:
            return None
        mine = None
        for d in range(self.groups.dp_size):
            pair = [d * self.groups.pp_size + first, d * self.groups.pp_size + last]
            group = dist.new_group(pair)
            if self.rank in pair:
                mine = group
        return mine

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
            start, end = self.partition.shard_range(self.pp_rank)
            rows = (start, min(end, self.partition.vocab_size))
        first, last = self.pp_rank == self.layout.first_rank, self.pp_rank == self.layout.last_rank
        return RankLayout(
            rank=self.rank,
            pp_rank=self.pp_rank,
            pp_size=self.groups.pp_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
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
        return make_microbatches(
            input_ids,
            labels,
            attention_mask,
            position_ids,
            microbatches=self.cfg.microbatches,
            hf_config=self.hf_config,
            dtype=self.dtype,
            device=self.device,
            dp_group=self.groups.dp_group,
            loss_scale=loss_scale,
        )

    def _executor(self, schedule, mb_rows: int, seq: int) -> Executor:
        mine = self.layout.chunks_of(self.pp_rank)
        layers = {c: self.layout.chunk_layers[c][1] - self.layout.chunk_layers[c][0] for c in mine}
        total = sum(layers.values())  # 0 on a stage the balanced split emptied (its chunk runs only the norm)
        weight = {c: n / total if total else 0.0 for c, n in layers.items()}
        return Executor(
            schedule,
            self.mods,
            self.groups,
            self.partition,
            self.out_opts,
            act_shape=(mb_rows, seq, self.hf_config.hidden_size),
            # stages exchange activations / gradients in the compute dtype under mixed precision
            act_dtype=self.compute_dtype or self.dtype,
            param_dtype=self.dtype,
            device=self.device,
            weight_grads=self.weight_grads,
            chunk_weight=weight,
            compute_dtype=self.compute_dtype,
        )

    def _finish_loss(self, loss_sum: torch.Tensor) -> float:
        """Make the step's loss known on every rank of every replica."""
        loss = loss_sum.detach().to(torch.float64).reshape(1).clone()  # on the device: pp/dp groups are NCCL on GPUs
        if not self.vocab:  # only the last stage computed it
            if self.pp_rank != self.layout.last_rank:
                loss.zero_()
            dist.all_reduce(loss, group=self.groups.pp_group)
        if self.groups.dp_group is not None:  # g used the global token count: replicas' parts add up
            dist.all_reduce(loss, group=self.groups.dp_group)
        return float(loss.item())

    def _bubble_rate(self, records: list[TimedAction], step_time: float) -> float:
        busy = sum(r.end - r.start for r in records if r.op in COMPUTE_OPS)
        rate = torch.tensor([1.0 - busy / step_time if step_time > 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(rate, group=self.groups.pp_host_group)  # a host number: the gloo side group
        return float(rate.item()) / self.groups.pp_size

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> StepResult:
        """Forward and backward of every microbatch; gradients accumulate into the parameters' .grad.

        `position_ids` [batch, seq] (default 0..s-1 per row): packed documents restart at 0, and as in HF
        (when no attention_mask is given) each token then attends only inside its own document.
        """
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        mbs, n_tokens = self._microbatches(input_ids, labels, attention_mask, position_ids, loss_scale=scale)
        self._last_seq = input_ids.shape[1]
        t0 = time.perf_counter()
        out = self._run(self.schedule, mbs, input_ids.shape[1])
        self._sync_grads()
        skipped = False
        if self.loss_scaler is not None:  # every rank of the pipeline decides together (replicas agree already)
            skipped = precision.unscale_and_check(self.parameters(), scale, self.device, self.groups.pp_group)
            self.loss_scaler.update(skipped)
        self._skip_next_optimizer_step = skipped
        step_time = time.perf_counter() - t0
        loss = self._finish_loss(out.loss_sum) / scale
        bad = self._nonfinite_microbatches(out.microbatch_losses) if not math.isfinite(loss) else ()
        peak = out.peak_activation_bytes
        self.last_stats = {
            "timeline": out.records,
            "peak_activation_bytes": peak,
            "step_time_s": step_time,
            "peak_activation_microbatches": out.peak_activation_microbatches,
            "peak_stash_microbatches": out.peak_stash_microbatches,
            "weight_copy_bytes": out.weight_copy_bytes,
            "pass_time_s": sum(r.end - r.start for r in out.records if r.op in COMPUTE_OPS),
        }
        if self.device.type == "cuda":
            self.last_stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return StepResult(
            loss=loss,
            num_tokens=n_tokens,
            step_time_s=step_time,
            bubble_rate=self._bubble_rate(out.records, step_time),
            peak_activation_bytes=peak,
            nonfinite_microbatches=bad,
            skipped=skipped,
            loss_scale=scale,
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
    ) -> float:
        """Token-mean loss of a batch with the forward-only schedule (no gradients, no T/B/W passes).

        Runs the modules in eval mode (no dropout), as HF's model.eval(); train_step applies the model's dropout.
        """
        mbs, _ = self._microbatches(input_ids, labels, attention_mask, position_ids)
        training = self.mods.container.training
        self.mods.eval()
        try:
            out = self._run(self.eval_schedule, mbs, input_ids.shape[1])
        finally:
            self.mods.train(training)
        return self._finish_loss(out.loss_sum)

    def _nonfinite_microbatches(self, losses: dict[int, torch.Tensor]) -> tuple[tuple[int, int], ...]:
        """Which (replica, microbatch) had a NaN/inf loss. Called on every rank when the step's loss is not
        finite (it is the same everywhere); baseline losses live on the last stage only, hence the reduce."""
        m = self.cfg.microbatches
        flags = torch.zeros(self.dp_size * m, dtype=torch.float64)
        for mb, value in losses.items():
            if not torch.isfinite(value).all():
                flags[self.dp_rank * m + mb] = 1.0
        dist.all_reduce(flags, group=self.groups.host_group)  # host flags of the whole world: gloo
        return tuple((int(i) // m, int(i) % m) for i in flags.nonzero().flatten().tolist())

    def _run(self, schedule, mbs: list[Microbatch], seq: int):
        try:
            ex = self._executor(schedule, mbs[0].input_ids.shape[0], seq)
            with precision.step_weight_casts(self.device, self.compute_dtype):  # one cast per weight per step
                out = ex.run(mbs)
            out.weight_copy_bytes = ex.meter.weight_copy_bytes
            return out
        except BaseException as e:
            if self.watchdog is not None:
                self.watchdog.report_failure(e)  # peers blocked on us exit now, naming this rank
            raise

    def close(self) -> None:
        """Stop the process's watchdog at a normal end of training (peers may then exit in any order),
        and the communication workers (vocabulary chains; strict p2p batches)."""
        comm.close_worker(self.groups.vocab_group)
        comm.close_worker(self.groups.pp_group)
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def _sync_grads(self) -> None:
        """Tied baseline weights on two ranks add their gradients; DP replicas add theirs."""
        tied = (
            None
            if self._tied_group is None
            else (self.mods.embed.weight if self.mods.embed is not None else self.mods.head.weight)
        )
        grad_sync.sync_grads(tied, self._tied_group, self.trainable_parameters(), self.groups.dp_group)

    # ---- optimizer-side helpers ----------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global L2 norm over the whole pipeline (each parameter counted once)."""
        return grad_sync.clip_grad_norm(
            self.named_parameters(), self.mods.is_duplicate, max_norm, self.device, self.groups.pp_group
        )

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

    def export_hf(self, out_dir, tokenizer=None) -> None:
        """Gather every rank's part into one HF model directory written by rank 0 (a collective); LoRA
        adapters merged. With `tokenizer`, its special-token ids go into the config and it is saved too."""
        model_io.export_hf(self, out_dir, tokenizer)

    def export_adapter(self, out_dir, base_model_name_or_path: str | None = None, tokenizer=None) -> None:
        """Write a peft adapter folder on rank 0 (a collective); see `model_io.export_adapter`."""
        model_io.export_adapter(self, out_dir, base_model_name_or_path, tokenizer)

    def trainable_parameters(self):
        """The parameters that train (all of them without an adapter; LoRA's, plus the vocabulary if asked)."""
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token as the paper counts them for MFU (docs/design.md §8; cost.shape's formula),
        at the sequence length of the last step."""
        shape = shape_from_hf_config(self.hf_config, seq=getattr(self, "_last_seq", 2048))
        return shape.model_flops() / shape.tokens
