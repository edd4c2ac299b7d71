"""One training step and what follows it: log, evaluate, save. `trainer.train` calls these in order.

Every function here runs on every rank with the same arguments; the decisions (skip a step, log,
evaluate, save) depend only on the step number and on values that are the same on every rank, so the
collectives inside them (gathers, evaluation, checkpoint barriers) are reached by all ranks together.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from vp_accelerate.runtime import PipelineLayout
from vp_accelerate.runtime.pipeline import PipelineModel, StepResult
from vp_accelerate.runtime.preference import Preference, metric_style

from ..data import DataError, PreparedData
from ..data.batches import BatchIterator, EvalBatches, StreamingBatchIterator
from ..recipe import Recipe
from ..tokens.vocab_plan import VocabPlan
from .nonfinite import NonFiniteError, step_problem
from .run_state import save_run
from .samples import log_samples
from .tracking import Tracker, gather, rank_metrics, rank_stats

log = logging.getLogger("vp_accelerate.train")

NEW_COUNTERS = {"tokens": 0, "loss_tokens": 0, "loss_sum": 0.0, "loss_steps": 0}
NEW_BEST = {"loss": float("inf"), "step": 0, "stale": 0}


@dataclass
class Run:
    """Everything a training run holds, built once by `trainer.setup` (each rank has its own)."""

    recipe: Recipe
    """The validated recipe."""
    accelerator: Accelerator
    """accelerate's Accelerator (processes, device, tracker)."""
    pipe: PipelineModel
    """This rank's PipelineModel."""
    tokenizer: PreTrainedTokenizerBase
    """The run's tokenizer (saved with every checkpoint)."""
    train_it: BatchIterator | StreamingBatchIterator
    """Iterator over this replica's training batches, with state_dict() for resume."""
    eval_batches: EvalBatches
    """The fixed evaluation batches of this replica."""
    optimizer: torch.optim.Optimizer
    """AdamW over this rank's parameters."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """The LR schedule (a function of the step number)."""
    layout: PipelineLayout
    """Every rank's `RankLayout`."""
    vocab: VocabPlan
    """The vocabulary decision (vocab_plan.VocabPlan: tokenizer size, rows before/after, how rows map)."""
    fingerprint: dict
    """What a checkpoint must match to be resumed by this run."""
    recipe_dict: dict
    """The recipe as a plain dict (wandb config, checkpoint meta)."""
    start_step: int = 0
    """Steps already done (from a resumed checkpoint)."""
    end_step: int = 0
    """The step after which this process stops (train.steps, or --stop-at)."""
    tracker: Tracker | None = None
    """wandb + metrics.jsonl; created after a resume has succeeded."""
    counters: dict = field(default_factory=lambda: dict(NEW_COUNTERS))
    """Cumulative counts (saved in checkpoints, so a resumed run goes on counting): `tokens` trained on (no
    padding), `loss_tokens` (tokens that carried loss), and the logging window's `loss_sum` / `loss_steps`."""
    best: dict = field(default_factory=lambda: dict(NEW_BEST))
    """The best eval loss so far, its step, and `stale`: evaluations since (early stopping, keep_best)."""
    stopped_early: bool = False
    """Early stopping (eval.patience) ended the run at end_step."""
    data: PreparedData | None = None
    """The prepared data (`data.PreparedData`: sizes for the run's data/ metrics)."""
    setup_s: dict = field(default_factory=dict)
    """Seconds `setup` spent on each part (model and tokenizer, data, pipeline, ...), said with the first step."""
    pending_save: object = None
    """The checkpoint being written in the background (`persist.store.PendingSave`), until the next save or
    the end of the run completes it (`run_state.complete_pending_save`)."""

    @property
    def tokens_per_step(self) -> int:
        pairs = 2 if self.recipe.data.format == "preference" else 1  # DPO: global_batch counts pairs of sequences
        return pairs * self.recipe.train.global_batch * self.recipe.data.seq_len


@dataclass
class LoopState:
    """What the loop carries from one step to the next."""

    window_time: float = 0.0
    """This rank's step time summed since the last log (logged as the per-rank mean)."""
    window_steps: int = 0
    """Steps in that window."""
    skipped_in_a_row: int = 0
    """Consecutive steps skipped for NaN/inf (train.on_nonfinite: skip)."""
    skipped_total: int = 0
    """All skipped steps of this process."""
    scaler_skips: int = 0
    """fp16 steps dropped by the loss scaler (routine, not counted as non-finite problems)."""
    eval_loss: float = float("nan")
    """The latest evaluation loss."""
    evals: dict = field(default_factory=dict)
    """step -> evaluation loss."""


@dataclass
class StepOutcome:
    """What one optimizer step measured."""

    step: int
    """Steps done after this one (1-based)."""
    result: StepResult
    """The PipelineModel's StepResult (loss, tokens, pipeline step time, bubble rate)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """The LR this step used."""
    step_time_s: float
    """Wall time of the whole step on this rank (pipeline, clipping, optimizer)."""
    tokens_per_s: float
    """Global tokens of the step / step_time_s."""

    @property
    def loss(self) -> float:
        return self.result.loss


def _rows_of(train_it, batch_rows: int, microbatches: int) -> Callable[[int], str] | None:
    """microbatch -> "which data rows", where the iterator can say it (for error messages)."""
    if not hasattr(train_it, "describe_rows"):
        return None
    per_mb = batch_rows // microbatches
    return lambda mb: train_it.describe_rows(mb * per_mb, (mb + 1) * per_mb)


def preference_of(section, batch: dict, kl: tuple[float, ...] | float = 0.0) -> Preference:
    """The runtime's `Preference` for a batch of pairs (or KTO's rows, with their desirable flags and each
    microbatch's KL estimate `kl`) from the recipe's `preference` section."""
    return Preference.of(section, batch["ref_logps"], batch.get("desirable"), kl, batch.get("completion_start"))


def kto_kl(pipe, section, batch: dict) -> tuple[float, ...] | float:
    """KTO's z per microbatch (`PipelineModel.kl_estimate` on the batch's KL rows), 0 for a loss without the KL
    term (apo_zero_unpaired, as TRL's calculate_KL) or a batch of pairs."""
    if "kl_input_ids" not in batch or "kto" not in section.types:
        return 0.0
    return pipe.kl_estimate(
        batch["kl_input_ids"], batch["kl_labels"], batch["ref_kl_logps"], batch.get("kl_attention_mask")
    )


def _forward_backward(run: Run, batch: dict, step: int):
    pipe = run.pipe
    pref = run.recipe.preference
    try:
        kl = kto_kl(pipe, pref, batch)  # KTO: one forward-only pass over the KL rows first
        preference = (  # DPO pairs and KTO rows carry their reference log-probabilities
            preference_of(pref, batch, kl) if "ref_logps" in batch else None
        )
        res = pipe.train_step(
            batch["input_ids"], batch["labels"], batch.get("attention_mask"), batch.get("position_ids"), preference
        )
        if "desirable" in batch and res.rewards is not None:  # KTOTrainer's `kl`: the mean of its micro-steps'
            res.rewards["kl"] = sum(kl) / len(kl) if isinstance(kl, tuple) else float(kl)
        return res
    except ValueError as e:  # bad ids/labels/shape: checked before any communication, on every rank
        rows = run.train_it.describe_rows(0, len(batch["input_ids"])) if hasattr(run.train_it, "describe_rows") else ""
        if pipe.watchdog is not None:  # data-parallel peers with other rows may already be waiting on us
            pipe.watchdog.report_failure(e)
        raise DataError(f"step {step}, batch of {rows}: {e}") from e


def _skip_or_stop(run: Run, state: LoopState, problem: str) -> None:
    """A NaN/inf step: raise NonFiniteError, or count it as skipped (train.on_nonfinite)."""
    t = run.recipe.train
    state.skipped_in_a_row += 1
    state.skipped_total += 1
    if t.on_nonfinite == "stop" or state.skipped_in_a_row > t.max_skipped_steps:
        why = (
            "train.on_nonfinite: stop"
            if t.on_nonfinite == "stop"
            else f"more than train.max_skipped_steps={t.max_skipped_steps} skipped steps in a row"
        )
        raise NonFiniteError(
            f"{problem}. Stopping ({why}); the latest checkpoint is untouched. Lower "
            f"optimizer.lr, check that data, or set train.on_nonfinite: skip."
        )
    if run.accelerator.is_main_process:
        log.warning("%s; skipping the update (train.on_nonfinite: skip)", problem)


def train_step_once(run: Run, state: LoopState, step: int) -> StepOutcome:
    """Optimizer step number `step` (1-based): forward + backward of the next batch, clip, update.

    A NaN/inf step is skipped or stops the run (train.on_nonfinite); the LR schedule moves on either way,
    so step k keeps its LR and its data.
    """
    pipe, clip = run.pipe, run.recipe.optimizer.grad_clip
    batch = next(run.train_it)
    t0 = time.perf_counter()
    res = _forward_backward(run, batch, step)
    grad_norm = pipe.clip_grad_norm_(clip if clip is not None else float("inf"))
    lr = run.scheduler.get_last_lr()[0]
    # an fp16 loss-scale overflow is routine: the scaler already lowered the scale, only the update is dropped
    problem = (
        None
        if res.skipped
        else step_problem(
            step, res, grad_norm, pipe, _rows_of(run.train_it, len(batch["input_ids"]), pipe.cfg.microbatches)
        )
    )
    if res.skipped:
        state.scaler_skips += 1
    elif problem is not None:
        _skip_or_stop(run, state, problem)
    else:
        state.skipped_in_a_row = 0
        pipe.step(run.optimizer)
    run.scheduler.step()  # LR is a function of the step number, skipped or not
    pipe.zero_grad()
    step_time = time.perf_counter() - t0
    state.window_time += step_time
    state.window_steps += 1
    c = run.counters
    c["tokens"] += int(getattr(run.train_it, "last_tokens", 0))  # the global batch's real (non-padding) tokens
    c["loss_tokens"] += int(res.num_tokens)  # the global batch's targets
    if math.isfinite(res.loss):  # a skipped NaN/inf step is not part of the logged mean
        c["loss_sum"], c["loss_steps"] = c["loss_sum"] + res.loss, c["loss_steps"] + 1
    return StepOutcome(
        step=step,
        result=res,
        grad_norm=grad_norm,
        lr=lr,
        step_time_s=step_time,
        tokens_per_s=run.tokens_per_step / step_time,
    )


def log_step(run: Run, state: LoopState, out: StepOutcome) -> None:
    """Every logging.log_every steps (and the last): the step's metrics and every rank's memory numbers."""
    if out.step % run.recipe.logging.log_every and out.step != run.end_step:
        return
    res, c = out.result, run.counters
    # the mean of the steps' losses since the last log (HF Trainer's convention), not only this step's
    loss = c["loss_sum"] / c["loss_steps"] if c["loss_steps"] else res.loss
    c["loss_sum"], c["loss_steps"] = 0.0, 0
    metrics = {
        "train/loss": loss,
        "train/lr": out.lr,
        "train/grad_norm": out.grad_norm,
        "train/epoch": run.train_it.epoch_progress,
        "train/tokens": c["tokens"],
        "train/loss_tokens": c["loss_tokens"],
        "train/step_loss_tokens": res.num_tokens,
        "perf/tokens_per_s": out.tokens_per_s,
        "perf/step_time_s": out.step_time_s,
        "perf/pipeline_step_time_s": res.step_time_s,
        "perf/pipeline_tokens_per_s": res.tokens_per_s,  # the step's clock: the device's on a GPU
        "perf/bubble_rate": res.bubble_rate,
        "train/skipped_steps": state.skipped_total,
    }
    if res.rewards is not None:  # DPO: TRL's names (this step's pairs)
        metrics.update(res.rewards)
        if metric_style(run.recipe.preference.types) == "dpo":
            metrics["num_tokens"] = c["tokens"]  # DPOTrainer / KTOTrainer's: the real tokens trained on so far
    if run.pipe.loss_scaler is not None:
        metrics.update({"train/loss_scale": res.loss_scale, "train/loss_scale_skips": state.scaler_skips})
    peak = run.recipe.logging.peak_tflops * 1e12 * run.pipe.world_size
    if peak > 0:
        metrics["perf/mfu"] = run.pipe.flops_per_token * out.tokens_per_s / peak
    mean_time = state.window_time / state.window_steps
    metrics.update(rank_metrics(gather(rank_stats(run.pipe, run.accelerator.device, mean_time))))  # a collective
    state.window_time, state.window_steps = 0.0, 0
    run.tracker.log(metrics, out.step)


def evaluate(pipe, batches, preference=None, rewards: dict | None = None) -> float:
    """The token mean of the loss over the evaluation batches (`data.EvalBatches`): each batch's loss (already
    over every replica's rows) weighted by its target tokens, so it is the loss of the whole evaluation set as
    one, whatever the batch boundaries. NaN without batches (or without a target token).

    Preference pairs (batches with `ref_logps`; `preference`: the recipe's section): the mean DPO loss over the
    pairs, and their mean reward metrics into `rewards`."""
    weights = getattr(batches, "loss_tokens", None) or [1] * len(batches)
    total = count = 0.0
    sums: dict[str, float] = {}
    for b, w in zip(batches, weights):
        pref = None
        if "ref_logps" in b:
            kl = kto_kl(pipe, preference, b)
            pref = preference_of(preference, b, kl)
        loss = pipe.eval_step(b["input_ids"], b["labels"], b.get("attention_mask"), b.get("position_ids"), pref)
        if w:
            total, count = total + loss * w, count + w
            extra = {"kl": sum(kl) / len(kl) if isinstance(kl, tuple) else float(kl)} if "desirable" in b else {}
            for k, v in {**(pipe.last_eval_rewards or {}), **extra}.items() if pref is not None else ():
                sums[k] = sums.get(k, 0.0) + v * w
    if rewards is not None and count:
        rewards.update({k: v / count for k, v in sums.items()})
    return total / count if count else float("nan")


def maybe_eval(run: Run, state: LoopState, step: int, say: Callable[[str], None] = print) -> None:
    """Every eval.every steps (and the last): evaluate, log eval/loss and eval/ppl, `say` it on the main rank;
    track the best eval loss, and stop the run early after eval.patience evaluations without a new best."""
    e = run.recipe.eval
    if e.batches == 0 or not ((e.every and step % e.every == 0) or step == run.end_step):
        return
    rewards: dict[str, float] = {}
    loss = evaluate(run.pipe, run.eval_batches, run.recipe.preference, rewards)
    state.eval_loss = state.evals[step] = loss
    if e.prompts:
        log_samples(run, step)  # a collective: every rank takes part in gathering the model
    if math.isnan(loss):
        return
    ppl = math.exp(min(loss, 50.0))
    best = run.best
    # patience counts evaluations without a gain of more than min_delta over the best (transformers'
    # EarlyStoppingCallback threshold); the best (keep_best's checkpoint) is the lowest loss, whatever the gain
    best["stale"] = 0 if loss < best["loss"] - e.min_delta else best["stale"] + 1
    if loss < best["loss"]:
        best.update(loss=loss, step=step)
    run.tracker.log(
        {"eval/loss": loss, "eval/ppl": ppl, "eval/best_loss": best["loss"]}
        | {f"eval/{k}": v for k, v in rewards.items()},  # DPO: eval/rewards/chosen, ...
        step,
    )
    if run.accelerator.is_main_process:
        say(
            f"step {step}: eval loss {loss:.4f}, ppl {ppl:.2f}"
            + ("" if best["step"] == step else f" (best {best['loss']:.4f} at step {best['step']})")
        )
    if e.patience is not None and best["stale"] >= e.patience and step < run.end_step:
        # the same values on every rank (the eval loss is all-reduced): all stop at this step together
        run.stopped_early, run.end_step = True, step
        if run.accelerator.is_main_process:
            say(
                f"step {step}: stopping early: no eval loss below {best['loss']:.4f} (step {best['step']}) in "
                f"{e.patience} evaluations (eval.patience)"
            )


def maybe_save(run: Run, step: int) -> bool:
    """Every checkpoint.every steps (and the last): a checkpoint of every rank's state, if checkpoint.dir is set.
    Whether it saved."""
    c = run.recipe.checkpoint
    if c.dir and ((c.every and step % c.every == 0) or step == run.end_step):
        save_run(run, step)
        return True
    return False
