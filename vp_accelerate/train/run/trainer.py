"""The training run: `setup` builds it from a recipe, `train` loops over steps (the step, logging,
evaluation and checkpoints are the small functions of loop.py; save/resume are in run_state.py).

accelerate starts the processes (`accelerate launch`), sets the device, seeds, orders the main
process first where files are written, and hosts the wandb tracker. The pipeline engine owns the model:
we do not `accelerator.prepare` it (it is not one module but one rank's stage chunks and vocabulary
shards), and we optimize `pipe.parameters()` with a plain torch AdamW on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from vp_accelerate import modes
from vp_accelerate.distributed import init_from_env
from vp_accelerate.models.checkpoint_source import CheckpointSource, share_vocab_means
from vp_accelerate.models.lora import describe_adapter, parameter_counts
from vp_accelerate.runtime import PipelineLayout, PipelineModel, watchdog
from vp_accelerate.runtime.groups import host_group

from ..data import prepare_data
from ..data.check import data_metrics
from ..data.preference import pair_style
from ..recipe import Recipe, finish_steps, recipe_to_dict
from ..recipe.lr_schedule import build_scheduler
from ..recipe.model_check import model_dir
from ..recipe.presets import PRESETS, model_source, recipe_model_config, uses_pretrained_weights
from ..tokens.vocab_plan import (
    model_tokenizer_of,
    open_tokenizer,
    plan_vocab,
    prepare_tokenizers,
    tokenizer_source,
    trainable_token_rows,
)
from . import reference_logps, run_lock
from .final_export import export_final
from .loop import LoopState, Run, evaluate, log_step, maybe_eval, maybe_save, train_step_once
from .nonfinite import NonFiniteError
from .optim import build_optimizer
from .preemption import Preempted, StopSignals, signal_name
from .run_state import (
    complete_pending_save,
    fingerprint,
    init_weights_from,
    poll_pending_save,
    resume_run,
    save_run,
    settle_pending_save,
)
from .tracking import Tracker, gather, plot_measured_timeline
from .user_errors import main_process_first

__all__ = ["build_pipeline", "evaluate", "fingerprint", "make_accelerator", "setup", "train"]

log = logging.getLogger("vp_accelerate.train")


def make_accelerator(recipe: Recipe):
    """An Accelerator that really is multi-process on CPU.

    Under `accelerate launch --multi_gpu` on a machine without GPUs, only `cpu=True` makes accelerate
    report MULTI_CPU and create the gloo group; without it it says NO while a group exists.
    """
    log_with = None if recipe.logging.wandb_mode == "disabled" else "wandb"
    if log_with and recipe.logging.wandb_mode == "offline":
        os.environ.setdefault("WANDB_MODE", "offline")
    if torch.cuda.is_available() and "RANK" in os.environ:
        init_from_env()  # NCCL bound to this GPU (device_id): accelerate would make the group without it
    return Accelerator(cpu=not torch.cuda.is_available(), log_with=log_with, project_dir=recipe.logging.output_dir)


def mixed_precision_for(recipe: Recipe, accelerate_mode: str | None) -> str:
    """The run's precision (a key of modes.PRECISIONS): `pipeline.mixed_precision` if set, else accelerate's
    `--mixed_precision` (no when unset), which must be one of the table's values accelerate has."""
    if recipe.pipeline.mixed_precision is not None:
        return modes.precision(recipe.pipeline.mixed_precision).name
    mode = str(accelerate_mode or "no").lower()
    entry = modes.PRECISIONS.get(mode)
    if entry is None or not entry.accelerate:
        launcher = [p.name for p in modes.PRECISIONS.values() if p.accelerate]
        raise ValueError(
            f"accelerate's --mixed_precision {mode} is not supported by the pipeline engine; launch with "
            f"--mixed_precision {' / '.join(launcher)}, or set pipeline.mixed_precision in the recipe (one of "
            f"{', '.join(modes.PRECISIONS)})"
        )
    return entry.name


def resolved_recipe(recipe: Recipe, accelerate_mode: str | None) -> Recipe:
    """The recipe as the run runs it, a new object (the caller's is left as it is): `pipeline.mixed_precision`
    from accelerate's flag where unset, and `checkpoint.dir` where it defaults to `<output_dir>/checkpoints`.
    The run logs and checkpoints this one, so the logged recipe says what ran."""
    pipeline = dataclasses.replace(recipe.pipeline, mixed_precision=mixed_precision_for(recipe, accelerate_mode))
    checkpoint = dataclasses.replace(recipe.checkpoint, dir=recipe.checkpoint.resolved_dir(recipe.logging.output_dir))
    return dataclasses.replace(recipe, pipeline=pipeline, checkpoint=checkpoint)


def load_model_and_tokenizers(recipe: Recipe, accelerator):
    """(model dir or None for a preset, tokenizer, the model's own tokenizer or None, the chat template
    decision), one process first.

    A hub model is snapshotted to the local cache (config, safetensors, tokenizer) so every rank reads
    its own tensors from files; Qwen tokenizers are converted once. The chat template the run trains with is
    set on the tokenizer, with the special tokens it needs (`chat_template.py`).
    """
    m = recipe.model
    with main_process_first("loading the model and tokenizer"):  # an error there stops every rank
        local = model_dir(m.source, download=True) if m.source not in PRESETS else None
        source = tokenizer_source(recipe)
        if source == m.source and local is not None:
            source = local
        tokenizer = open_tokenizer(recipe, source, fetch=True)
        model_tokenizer = model_tokenizer_of(
            recipe, tokenizer, source, lambda own: open_tokenizer(recipe, own, fetch=True), local
        )
    chat = prepare_tokenizers(recipe, tokenizer, model_tokenizer, uses_pretrained_weights(m))
    return local, tokenizer, model_tokenizer, chat


def plan_model(recipe: Recipe, tokenizer, model_dir: str | None = None, model_tokenizer=None, chat=None):
    """(the model config, the vocabulary decision `VocabPlan`): what the pipeline and the data need to know of the
    model before it is built (the data check compares token ids with `plan.rows_after`)."""
    m = recipe.model
    pretrained = uses_pretrained_weights(m)
    config = recipe_model_config(model_dir or m.source, m.config, m.trust_remote_code, pretrained)
    return config, plan_vocab(recipe, config.vocab_size, tokenizer, pretrained, model_tokenizer, chat=chat)


def build_pipeline(
    recipe: Recipe,
    tokenizer,
    device,
    model_dir: str | None = None,
    model_tokenizer=None,
    chat=None,
    planned=None,
):
    """(PipelineModel of the recipe's model, the vocabulary decision `VocabPlan`); `planned`: `plan_model`'s
    result when the caller has it. `recipe`: `resolved_recipe`'s (an unset mixed_precision runs as "no").

    Pretrained weights are read per rank from `model_dir` (each rank its own tensors and vocabulary rows);
    the mean row that resized / swapped vocabularies need is computed collectively (`share_vocab_means`).
    """
    m = recipe.model
    config, plan = planned or plan_model(recipe, tokenizer, model_dir, model_tokenizer, chat)
    source = model_source(m, config, plan, model_dir)
    if isinstance(source, CheckpointSource):
        if dist.is_available() and dist.is_initialized():

            def all_reduce(t):  # host rows: summed on the gloo side group, not staged through the GPU
                dist.all_reduce(t, group=host_group())

            share_vocab_means(source, dist.get_rank(), dist.get_world_size(), all_reduce)
        else:
            share_vocab_means(source, 0, 1)
    # the recipe's pipeline section is a runtime.PipelineConfig: passed whole, nothing copied by hand; its
    # mixed_precision also sets the parameters' dtype (fp32 master weights, or bf16 for pure-bf16)
    pipe = PipelineModel(
        source,
        recipe.pipeline,
        seed=recipe.train.seed,
        device=device,
        adapter=recipe.adapter,
    )
    return pipe, plan


def _adapter_line(recipe: Recipe, pipe) -> str | None:
    """A LoRA run's trainable / total parameters over the pipeline (replica 0's ranks); a collective."""
    if not recipe.adapter.enabled:
        return None
    mods = getattr(pipe, "mods", None)
    counts = gather(
        (
            pipe.dp_rank,
            *parameter_counts(
                pipe.named_parameters(),
                mods.is_duplicate if mods is not None else lambda n: False,
                mods.trained_rows if mods is not None else None,
            ),
        )
    )
    trainable, total = (sum(c[k] for c in counts if c[0] == 0) for k in (1, 2))
    return describe_adapter(recipe.adapter, pipe.hf_config, trainable, total)


def lock_output(recipe: Recipe, is_main: bool) -> None:
    """One writer per output dir (`run_lock.py`): the main process locks logging.output_dir and checkpoint.dir,
    each by its real path; a held lock stops every rank with one line naming the run that holds it. The
    checkpoint folder is locked even inside the output dir: another run's checkpoint.dir (a resume of it, or a
    symlink to it) may name that folder alone, and two writers there would flip `latest` between their steps."""
    with main_process_first("locking the output dir"):
        if is_main:
            run_lock.acquire(recipe.logging.output_dir, "logging.output_dir")
            if recipe.checkpoint.dir:
                run_lock.acquire(recipe.checkpoint.dir, "checkpoint.dir")


def setup(recipe: Recipe, resume: str | bool | None = None, stop_at: int | None = None, override: tuple = ()) -> Run:
    """Accelerator, tokenizer, pipeline, data, optimizer and tracker of a run (resumed if asked: "latest" or
    True, a step number, or a checkpoint path; else initialised from model.init_from's weights if set).
    `override`: `--resume --override` groups (`resume_check.py`). `recipe` is not changed: `Run.recipe` is the
    resolved one (`resolved_recipe`, train.steps from epochs)."""
    clock = SetupClock()
    accelerator = make_accelerator(recipe)
    set_seed(recipe.train.seed)
    recipe = resolved_recipe(recipe, accelerator.mixed_precision)  # the caller's recipe stays as it was
    lock_output(recipe, accelerator.is_main_process)  # before anything is written there
    which = "latest" if resume is True else (resume or None)
    clock.lap("accelerator")
    model_dir, tokenizer, model_tokenizer, chat = load_model_and_tokenizers(recipe, accelerator)
    planned = plan_model(recipe, tokenizer, model_dir, model_tokenizer, chat)
    clock.lap("model source and tokenizer")
    # LoRA: the rows of the special tokens this run adds train too (adapter.trainable_tokens)
    recipe, rows_note = trainable_token_rows(recipe, tokenizer, chat, planned[1].rows_after)
    with main_process_first("preparing the data"):  # tokenized once into the datasets cache (as --check did)
        data = prepare_data(
            recipe.data, tokenizer, planned[1].rows_after, style=pair_style(recipe.preference.loss_type)
        )
        data.check_sizes(recipe.train.global_batch, recipe.eval.batches)
        data.group_rows(recipe.train.global_batch // (recipe.pipeline.dp_size * recipe.pipeline.microbatches))
    clock.lap("data (read, tokenize, pack)")
    if recipe.train.steps is None:  # train.epochs: the run's length is known now, set on copies of the sections
        recipe = finish_steps(recipe, len(data.train) // recipe.train.global_batch)
    t = recipe.train
    pipe, vocab = build_pipeline(recipe, tokenizer, accelerator.device, model_dir, model_tokenizer, chat, planned)
    clock.lap("pipeline (build, load weights)")
    layout = PipelineLayout(tuple(gather(pipe.describe())))
    adapter_line = _adapter_line(recipe, pipe)  # a collective
    if accelerator.is_main_process:
        for line in vocab.lines() + [line for line in (adapter_line, rows_note) if line]:
            log.info("%s", line)
        g = pipe.groups
        tp = f" x tp {g.tp_size}" if g.tp_size > 1 else ""
        log.info(
            "distributed: %s, world size %d (pp %d%s x dp %d)",
            accelerator.distributed_type,
            pipe.world_size,
            g.pp_size,
            tp,
            g.dp_size,
        )
        for rank in layout.ranks:
            log.info("%s", rank)
    train_it, eval_batches = data.iterators(t.seed, t.global_batch, pipe.dp_rank, pipe.dp_size, recipe.eval.batches)
    optimizer = build_optimizer(pipe, recipe.optimizer, pipe.mods.trained_rows)
    run = Run(
        recipe=recipe,
        accelerator=accelerator,
        pipe=pipe,
        tokenizer=tokenizer,
        train_it=train_it,
        eval_batches=eval_batches,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, recipe.lr, t.steps),
        layout=layout,
        vocab=vocab,
        fingerprint=fingerprint(recipe, pipe, layout),
        recipe_dict=recipe_to_dict(recipe),
        data=data,
    )

    if not which and recipe.model.init_from:
        init_weights_from(run, recipe.model.init_from)
    reference_logps.attach(run, resuming=bool(which))  # DPO: of the start weights, before a resume loads others
    run.start_step = resume_run(run, which, override) if which else 0
    run.end_step = t.steps if stop_at is None else max(run.start_step, min(stop_at, t.steps))
    clock.lap("optimizer, resume")
    run.setup_s = clock.laps
    # after a resume that could fail; one metrics.jsonl per run (a resumed run appends to its own)
    run.tracker = Tracker(accelerator, recipe, run.recipe_dict, resumed_step=run.start_step or None)
    return run


def train(recipe: Recipe, resume: str | bool | None = None, stop_at: int | None = None, run: Run | None = None) -> dict:
    """Run a validated recipe on this process's rank. Returns a summary (the same on every rank).

    `stop_at`: end after that step (saving a checkpoint there) without changing the LR schedule, as a
    preempted job would; `resume` continues a run from a checkpoint ("latest" or True, a step, a path). A
    completed run exports its final model to `<output_dir>/hf` (checkpoint.export_hf). `run`: `setup`'s result
    when the caller built it (the command does, to tell errors at the start from those of training).
    """
    run, state = run or setup(recipe, resume, stop_at), LoopState()
    recipe = run.recipe  # resolved by setup: the run's length, precision and checkpoint dir
    if run.start_step == 0 and run.data is not None:  # what the run trains on, once: data/ metrics at step 0
        run.tracker.log(data_metrics(run.data, recipe.train.global_batch), 0)
    losses = {}
    bar = tqdm(
        total=recipe.train.steps,
        initial=run.start_step,
        disable=not run.accelerator.is_main_process,
        desc="train",
        dynamic_ncols=True,
    )
    # preemption: save, then exit 75; installed until the export is written, so a signal there lets it finish
    stop = StopSignals(tuple(recipe.checkpoint.stop_signals)).install()
    try:
        signum = _steps(run, state, bar, stop, losses)
        complete_pending_save(run)  # the last checkpoint, before the final export reads it
        bar.close()
        finish(run)
        hf_dir = export_final(run)
    finally:
        stop.restore()
    run_lock.release_all()  # the output dir is free for the next run (in this process too)
    signum = signum or stop.received  # in the last step (agreed), or during the export (this rank's)
    if signum and run.pipe.rank == 0:
        log.info(
            "%s arrived in this run's last step or after it: the run ended as usual (its checkpoint%s written)",
            signal_name(signum),
            " and the final export" if hf_dir else "",
        )
    if hf_dir and recipe.checkpoint.keep_best and run.pipe.rank == 0 and run.start_step < run.end_step:
        log.info(
            "checkpoint.keep_best: %s holds the checkpoint of step %d, the best eval loss (%.4f)",
            hf_dir,
            run.best["step"],
            run.best["loss"],
        )
    v = run.vocab
    return {
        "start_step": run.start_step,
        "losses": losses,
        "eval": state.evals,
        "vocab": {
            "tokenizer": v.tokenizer_size,
            "rows_before": v.rows_before,
            "rows_after": v.rows_after,
            "mode": v.mode,
            "rows": v.counts(),
        },
        "final_eval_loss": state.eval_loss,
        "eval_on": recipe.eval.batches != 0,  # null: all held-out batches (loop.maybe_eval)
        "signal": signal_name(signum) if signum else None,
        "end_step": run.end_step,
        "hf_dir": hf_dir,
        "stopped_early": run.stopped_early,
        "best": dict(run.best),
    }


def _steps(run: Run, state: LoopState, bar, stop: StopSignals, losses: dict) -> int:
    """Train steps start_step + 1 .. end_step. A stop signal (agreed by every rank after a step) saves that step
    and raises Preempted, unless it is the run's last step: then the run ends as usual (its checkpoint, then
    the export) and the signal's number is returned (0: none)."""
    recipe = run.recipe
    try:
        for step in range(run.start_step + 1, run.end_step + 1):
            out = train_step_once(run, state, step)
            poll_pending_save(run)  # a checkpoint written meanwhile becomes `latest` once every rank's is
            losses[step] = out.loss
            if step == run.start_step + 1 and run.accelerator.is_main_process:
                bar.write(first_step_line(run.setup_s, out.step_time_s))
            bar.update(1)
            bar.set_postfix(loss=f"{out.loss:.3f}", tok_s=f"{out.tokens_per_s:,.0f}")
            log_step(run, state, out)
            maybe_eval(run, state, step, say=bar.write)
            saved = maybe_save(run, step)
            if stop.names and (signum := stop.agreed()):  # every rank stops after this same step
                if not saved and recipe.checkpoint.dir:
                    save_run(run, step)
                if step == run.end_step:  # nothing left to train: the run ends as usual, and exports
                    return signum
                complete_pending_save(run)  # decided together: the last save is `latest` before the exit
                bar.close()
                finish(run)
                raise Preempted(signal_name(signum), step, saved=bool(recipe.checkpoint.dir))
            if run.stopped_early:  # eval.patience: end_step is this step now
                break
    except NonFiniteError:  # decided on every rank together: the checkpoint written meanwhile becomes `latest`
        complete_pending_save(run)
        raise
    except BaseException as e:  # maybe this rank's alone: its write finishes, no collective, `latest` stays
        if not isinstance(e, Preempted) and (dog := watchdog.active()) is not None:
            dog.report_failure(e)  # peers in a collective between steps say this in one line (runtime/watchdog.py)
        settle_pending_save(run)
        raise
    return 0


class SetupClock:
    """Seconds between the named points of `setup` (where the time before the first step went)."""

    def __init__(self):
        self.last, self.laps = time.perf_counter(), {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


def first_step_line(setup_s: dict, step_s: float) -> str:
    """What the first step's log says: how long set-up took, and where."""
    parts = ", ".join(f"{name} {s:.1f} s" for name, s in sorted(setup_s.items(), key=lambda kv: -kv[1]))
    return f"first step done in {step_s:.1f} s; set-up took {sum(setup_s.values()):.1f} s: {parts}"


def finish(run: Run) -> None:
    """The measured timeline of the last step as an image, then close the tracker and the watchdog."""
    recipe, pipe = run.recipe, run.pipe
    if recipe.logging.timeline_image and pipe.stats().get("timeline") is not None and run.start_step < run.end_step:
        timelines = [r for rank_records in gather(pipe.stats()["timeline"]) for r in rank_records]
        if run.accelerator.is_main_process:
            title = f"measured step {run.end_step}: {recipe.pipeline.schedule} {recipe.pipeline.method}"
            path = plot_measured_timeline(timelines, os.path.join(recipe.logging.output_dir, "timeline.png"), title)
            if path:
                run.tracker.log_image("perf/timeline", path, run.end_step)
    run.tracker.finish()
    pipe.close()  # stop the failure watchdog before the ranks exit in whatever order
