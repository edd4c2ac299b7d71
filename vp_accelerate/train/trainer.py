"""The training loop: accelerate for processes and tracking, PipelineModel for the model.

accelerate starts the processes (`accelerate launch`), sets the device, seeds, orders the main
process first where files are written, and hosts the wandb tracker. The pipeline engine owns the model:
we do not `accelerator.prepare` it (it is not one module but one rank's stage chunks and vocabulary
shards), and we optimize `pipe.parameters()` with a plain torch AdamW on every rank.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from . import checkpoint as ckpt
from .data import DataError, build_data
from .nonfinite import NonFiniteError, check_weights_before_save, step_problem
from .optim import build_optimizer, build_scheduler
from .presets import model_source, resolve_config
from .recipe import Recipe, recipe_to_dict
from .tokenizer import load_tokenizer
from .tracking import Tracker, gather, plot_measured_timeline, rank_metrics, rank_stats, world_mean

log = logging.getLogger("vp_accelerate.train")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_accelerator(recipe: Recipe):
    """An Accelerator that really is multi-process on CPU.

    Under `accelerate launch --multi_gpu` on a machine without GPUs, only `cpu=True` makes accelerate
    report MULTI_CPU and create the gloo group; without it it says NO while a group exists.
    """
    from accelerate import Accelerator

    log_with = None if recipe.logging.wandb_mode == "disabled" else "wandb"
    if log_with and recipe.logging.wandb_mode == "offline":
        os.environ.setdefault("WANDB_MODE", "offline")
    return Accelerator(cpu=not torch.cuda.is_available(), log_with=log_with,
                       project_dir=recipe.logging.output_dir)


def mixed_precision_for(recipe: Recipe, accelerate_mode: str | None) -> str:
    """The run's compute precision: `pipeline.mixed_precision` if set, else accelerate's `--mixed_precision`
    (ignored, with a note, when the parameters themselves are bf16: there is no fp32 master copy to keep)."""
    from vp_accelerate.runtime.precision import resolve

    if recipe.pipeline.mixed_precision is not None:
        return resolve(recipe.pipeline.mixed_precision)
    mode = str(accelerate_mode or "no").lower()
    if mode not in ("no", "bf16", "fp16"):
        raise ValueError(f"accelerate's --mixed_precision {mode} is not supported by the pipeline engine; launch "
                         f"with --mixed_precision bf16 (or fp16, no), or set pipeline.mixed_precision in the recipe")
    if mode != "no" and recipe.train.precision != "fp32":
        log.info("accelerate's --mixed_precision %s is not used: train.precision is %s (parameters already in the "
                 "low precision); set train.precision: fp32 for %s compute with fp32 master weights",
                 mode, recipe.train.precision, mode)
        return "no"
    return mode


def load_model_and_tokenizers(recipe: Recipe, accelerator):
    """(model dir or None for a preset, tokenizer, the model's own tokenizer or None), one process first.

    A hub model is snapshotted to the local cache (config, safetensors, tokenizer) so every rank reads
    its own tensors from files; Qwen tokenizers are converted once.
    """
    from .presets import PRESETS, local_model_dir
    from .vocab_plan import model_tokenizer_source, tokenizer_source

    m = recipe.model
    with accelerator.main_process_first():
        model_dir = local_model_dir(m.source) if m.source not in PRESETS else None
        source = tokenizer_source(recipe)
        if source == m.source and model_dir is not None:
            source = model_dir
        tokenizer = load_tokenizer(source, recipe.tokenizer.cache_dir, m.trust_remote_code)
        model_tokenizer = None
        own = model_tokenizer_source(model_dir) if model_dir is not None and m.pretrained_weights else None
        if own is not None:
            model_tokenizer = tokenizer if os.path.abspath(own) == os.path.abspath(source) else \
                load_tokenizer(own, recipe.tokenizer.cache_dir, m.trust_remote_code)
    return model_dir, tokenizer, model_tokenizer


def build_pipeline(recipe: Recipe, tokenizer, device, model_dir: str | None = None, model_tokenizer=None,
                   accelerate_mixed_precision: str | None = None):
    """(PipelineModel of the recipe's model, the vocabulary decision `VocabPlan`).

    Pretrained weights are read per rank from `model_dir` (each rank its own tensors and vocabulary rows);
    the mean row that resized / swapped vocabularies need is computed collectively (`share_vocab_means`).
    """
    import torch.distributed as dist

    from vp_accelerate.models.checkpoint_source import CheckpointSource, share_vocab_means
    from vp_accelerate.runtime import PipelineModel

    from .presets import PRESETS
    from .vocab_plan import plan_vocab

    m = recipe.model
    config = resolve_config(model_dir or m.source, m.config, m.trust_remote_code)
    pretrained = m.pretrained_weights and m.source not in PRESETS
    if pretrained and model_dir is not None:
        from transformers import AutoConfig

        config.vocab_size = AutoConfig.from_pretrained(model_dir, trust_remote_code=m.trust_remote_code).vocab_size
    plan = plan_vocab(recipe, config.vocab_size, tokenizer, pretrained, model_tokenizer)
    source = model_source(m, config, plan, model_dir)
    if isinstance(source, CheckpointSource):
        if dist.is_available() and dist.is_initialized():
            def all_reduce(t):
                on = t.to(device)
                dist.all_reduce(on)
                t.copy_(on.cpu())

            share_vocab_means(source, dist.get_rank(), dist.get_world_size(), all_reduce)
        else:
            share_vocab_means(source, 0, 1)
    # the recipe's pipeline section is a runtime.PipelineConfig: passed whole, nothing copied by hand
    # an unset mixed_precision becomes the launcher's, written into the section so the logged recipe says what ran
    recipe.pipeline.mixed_precision = mixed_precision_for(recipe, accelerate_mixed_precision)
    pipe = PipelineModel(source, recipe.pipeline, dtype=DTYPES[recipe.train.precision], seed=recipe.train.seed,
                         device=device, adapter=recipe.adapter)
    return pipe, plan


def fingerprint(recipe: Recipe, pipe, layout_lines: list[str]) -> dict:
    """What must match for a checkpoint to be resumed by this run (layout, model, data order)."""
    p = recipe.pipeline
    return {"model": ckpt.config_fingerprint(pipe.hf_config), "world_size": pipe.world_size,
            "dp_size": pipe.dp_size, "schedule": p.schedule, "method": p.method,
            "chunks_per_rank": p.chunks_per_rank, "pad_multiple": p.pad_multiple, "layout": layout_lines, "precision": recipe.train.precision,
            "global_batch": recipe.train.global_batch, "seq_len": recipe.data.seq_len, "seed": recipe.train.seed,
            **({"adapter": recipe_to_dict(recipe)["adapter"]} if recipe.adapter.enabled else {})}


def _layout_line(line: str) -> str:
    """describe() without the MiB figure (bf16 vs fp32 is in `precision`; the rest is the layout)."""
    return line.rsplit(";", 1)[0] if line.endswith("MiB of parameters") else line


def evaluate(pipe, batches: list[dict]) -> float:
    """Mean token loss over the fixed eval batches, averaged over data-parallel replicas."""
    if not batches:
        return float("nan")
    losses = [pipe.eval_step(b["input_ids"], b["labels"], b.get("attention_mask"), b.get("position_ids"))
              for b in batches]
    return world_mean(sum(losses) / len(losses))


def train(recipe: Recipe, resume: bool = False, stop_at: int | None = None) -> dict:
    """Run a validated recipe on this process's rank. Returns a summary (the same on every rank).

    `stop_at`: end after that step (saving a checkpoint there) without changing the LR schedule, as a
    preempted job would; `resume=True` continues from the latest checkpoint.
    """
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    accelerator = make_accelerator(recipe)
    is_main = accelerator.is_main_process
    set_seed(recipe.train.seed)
    t, d = recipe.train, recipe.data

    model_dir, tokenizer, model_tokenizer = load_model_and_tokenizers(recipe, accelerator)
    pipe, vocab = build_pipeline(recipe, tokenizer, accelerator.device, model_dir, model_tokenizer,
                                 accelerator.mixed_precision)
    lines = gather(pipe.describe())
    if is_main:
        for line in vocab.lines():
            log.info("%s", line)
        log.info("distributed: %s, world size %d (pp %d x dp %d)", accelerator.distributed_type,
                 pipe.world_size, pipe.world_size // pipe.dp_size, pipe.dp_size)
        for line in lines:
            log.info("%s", line)
    layout = [_layout_line(x) for x in lines]

    with accelerator.main_process_first():  # tokenized data lands in the datasets cache once
        train_it, eval_batches = build_data(d, tokenizer, pipe.hf_config.vocab_size, t.seed, t.global_batch,
                                            pipe.dp_rank, pipe.dp_size, recipe.eval.batches)

    optimizer = build_optimizer(pipe.named_parameters(), recipe.optimizer)
    scheduler = build_scheduler(optimizer, recipe.lr, t.steps)
    fp = fingerprint(recipe, pipe, layout)
    start_step = 0
    if resume:
        start_step = _resume(recipe, pipe, optimizer, scheduler, train_it, fp)

    recipe_dict = recipe_to_dict(recipe)
    tracker = Tracker(accelerator, recipe, recipe_dict)
    tokens_per_step = t.global_batch * d.seq_len
    peak = recipe.logging.peak_tflops * 1e12 * pipe.world_size
    clip = recipe.optimizer.grad_clip if recipe.optimizer.grad_clip is not None else float("inf")
    summary = {"start_step": start_step, "losses": {}, "eval": {},
               "vocab": {"tokenizer": vocab.tokenizer_size, "rows_before": vocab.rows_before,
                         "rows_after": vocab.rows_after, "mode": vocab.mode, "rows": vocab.counts()}}
    bar = tqdm(total=t.steps, initial=start_step, disable=not is_main, desc="train", dynamic_ncols=True)
    eval_loss = float("nan")
    window_time, window_steps = 0.0, 0  # this rank's step times since the last log (per-rank mean)
    skipped_in_a_row, skipped_total = 0, 0
    scaler_skips = 0  # fp16 steps dropped by the loss scaler (not counted as non-finite problems)

    end_step = t.steps if stop_at is None else max(start_step, min(stop_at, t.steps))
    for step in range(start_step, end_step):
        batch = next(train_it)
        t0 = time.perf_counter()
        try:
            res = pipe.train_step(batch["input_ids"], batch["labels"], batch.get("attention_mask"),
                                  batch.get("position_ids"))
        except ValueError as e:  # bad ids/labels/shape: checked before any communication, on every rank
            rows = train_it.describe_rows(0, len(batch["input_ids"])) if hasattr(train_it, "describe_rows") else ""
            if pipe.watchdog is not None:  # data-parallel peers with other rows may already be waiting on us
                pipe.watchdog.report_failure(e)
            raise DataError(f"step {step + 1}, batch of {rows}: {e}") from e
        grad_norm = pipe.clip_grad_norm_(clip)
        lr = scheduler.get_last_lr()[0]
        per_mb = len(batch["input_ids"]) // pipe.cfg.microbatches
        rows_of = ((lambda mb: train_it.describe_rows(mb * per_mb, (mb + 1) * per_mb))
                   if hasattr(train_it, "describe_rows") else None)
        # an fp16 loss-scale overflow is routine: the scaler already lowered the scale, only the update is dropped
        problem = None if res.skipped else step_problem(step + 1, res, grad_norm, pipe, rows_of)
        if res.skipped:
            scaler_skips += 1
        elif problem is not None:
            skipped_in_a_row, skipped_total = skipped_in_a_row + 1, skipped_total + 1
            if t.on_nonfinite == "stop" or skipped_in_a_row > t.max_skipped_steps:
                why = ("train.on_nonfinite: stop" if t.on_nonfinite == "stop" else
                       f"more than train.max_skipped_steps={t.max_skipped_steps} skipped steps in a row")
                raise NonFiniteError(f"{problem}. Stopping ({why}); the latest checkpoint is untouched. Lower "
                                     f"optimizer.lr, check that data, or set train.on_nonfinite: skip.")
            if is_main:
                log.warning("%s; skipping the update (train.on_nonfinite: skip)", problem)
        else:
            skipped_in_a_row = 0
            pipe.step(optimizer)
        scheduler.step()  # LR is a function of the step number, skipped or not
        pipe.zero_grad()
        step_time = time.perf_counter() - t0
        window_time, window_steps = window_time + step_time, window_steps + 1
        done = step + 1
        summary["losses"][done] = res.loss
        tok_s = tokens_per_step / step_time
        bar.update(1)
        bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{tok_s:,.0f}")
        if done % recipe.logging.log_every == 0 or done == end_step:
            metrics = {"train/loss": res.loss, "train/lr": lr, "train/grad_norm": grad_norm,
                       "train/tokens": done * tokens_per_step, "train/loss_tokens": res.num_tokens,
                       "perf/tokens_per_s": tok_s, "perf/step_time_s": step_time,
                       "perf/pipeline_step_time_s": res.step_time_s, "perf/bubble_rate": res.bubble_rate,
                       "train/skipped_steps": skipped_total}
            if pipe.loss_scaler is not None:
                metrics.update({"train/loss_scale": res.loss_scale, "train/loss_scale_skips": scaler_skips})
            if peak > 0:
                metrics["perf/mfu"] = pipe.flops_per_token * tok_s / peak
            metrics.update(rank_metrics(gather(rank_stats(pipe, accelerator.device, window_time / window_steps))))
            window_time, window_steps = 0.0, 0
            tracker.log(metrics, done)
        is_last = done == end_step
        if (recipe.eval.every and done % recipe.eval.every == 0) or is_last:
            eval_loss = evaluate(pipe, eval_batches)
            summary["eval"][done] = eval_loss
            if not math.isnan(eval_loss):
                tracker.log({"eval/loss": eval_loss, "eval/ppl": math.exp(min(eval_loss, 50.0))}, done)
                if is_main:
                    bar.write(f"step {done}: eval loss {eval_loss:.4f}, ppl {math.exp(min(eval_loss, 50.0)):.2f}")
        if recipe.checkpoint.dir and ((recipe.checkpoint.every and done % recipe.checkpoint.every == 0) or is_last):
            _save(recipe, pipe, optimizer, scheduler, train_it, fp, tokenizer, done, recipe_dict)
    bar.close()

    if recipe.logging.timeline_image and pipe.stats().get("timeline") is not None and start_step < end_step:
        timelines = [r for rank_records in gather(pipe.stats()["timeline"]) for r in rank_records]
        if is_main:
            title = f"measured step {end_step}: {recipe.pipeline.schedule} {recipe.pipeline.method}"
            path = plot_measured_timeline(timelines, os.path.join(recipe.logging.output_dir, "timeline.png"), title)
            if path:
                tracker.log_image("perf/timeline", path, end_step)
    tracker.finish()
    pipe.close()  # stop the failure watchdog before the ranks exit in whatever order
    summary["final_eval_loss"] = eval_loss
    summary["end_step"] = end_step
    return summary


def _save(recipe, pipe, optimizer, scheduler, train_it, fp, tokenizer, step, recipe_dict) -> None:
    import torch.distributed as dist

    from vp_accelerate.runtime.groups import host_group

    mods = getattr(pipe, "mods", None)
    rank_info = gather({"rank": pipe.rank, "pp_rank": pipe.pp_rank, "dp_rank": pipe.dp_rank,
                        "duplicates": sorted(n for n, _ in pipe.named_parameters()
                                             if mods is not None and mods.is_duplicate(n))})
    meta = {"fingerprint": fp, "recipe": recipe_dict, "ranks": rank_info,
            "vocab_size": pipe.hf_config.vocab_size,
            "sharded_names": sorted(getattr(mods, "sharded_names", ()) or ()),
            "lora_transposed": sorted(n for names in gather(getattr(pipe, "lora_transposed", [])) for n in names)}

    def write_model_files(out_dir: str) -> None:
        pipe.hf_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    model_state, optimizer_state = pipe.state_dict(), optimizer.state_dict()
    check_weights_before_save(step, model_state, optimizer_state)
    trainer_state = {"scheduler": scheduler.state_dict(), "rng": ckpt.rng_state(), "data": train_it.state_dict(),
                     "precision": pipe.precision_state_dict(),
                     "step": step}
    barrier = (lambda: dist.barrier(group=host_group())) if dist.is_initialized() else (lambda: None)
    path = ckpt.save_checkpoint(recipe.checkpoint.dir, step, rank=pipe.rank, model_state=model_state,
                                optimizer_state=optimizer_state, trainer_state=trainer_state, meta=meta,
                                barrier=barrier, write_model_files=write_model_files, keep=recipe.checkpoint.keep)
    if pipe.rank == 0:
        log.info("saved checkpoint %s", path)


def _resume(recipe, pipe, optimizer, scheduler, train_it, fp) -> int:
    """Load the latest checkpoint of `checkpoint.dir` into every piece of state; returns its step."""
    cdir = recipe.checkpoint.dir
    path = ckpt.read_latest(cdir) if cdir and os.path.isdir(cdir) else None
    if path is None:
        if pipe.rank == 0:
            log.warning("--resume: no checkpoint in %s; starting from step 0", cdir)
        return 0
    meta = ckpt.read_meta(path)
    steps = gather(int(meta["step"]))
    if len(set(steps)) > 1:  # `latest` moved between ranks' reads: another run is writing into this dir
        raise ckpt.CheckpointError(f"ranks found different latest checkpoints in {cdir} (steps {steps}); is another "
                                   f"run still writing there? Stop it and resume again")
    ckpt.check_fingerprint(meta["fingerprint"], fp, path)
    model_state, optimizer_state, trainer_state = ckpt.load_rank(path, pipe.rank)
    ckpt.check_shapes(model_state, pipe.state_dict(), path, pipe.rank)
    pipe.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(trainer_state["scheduler"])
    pipe.load_precision_state_dict(trainer_state.get("precision", {}))  # the fp16 loss scale
    train_it.load_state_dict(trainer_state["data"])
    ckpt.set_rng_state(trainer_state["rng"])
    if pipe.rank == 0:
        log.info("resumed from %s (step %d)", path, meta["step"])
    return int(meta["step"])
