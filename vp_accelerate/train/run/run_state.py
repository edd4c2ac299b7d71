"""Save and resume a training run's whole state (model, optimizer, LR schedule, data position, RNG)
through the checkpoint format of checkpoint.py. Both are collectives: every rank calls them."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from vp_accelerate.runtime.groups import host_group

from ..recipe import RecipeError, recipe_to_dict
from . import checkpoint as ckpt
from . import resume_check
from .nonfinite import check_weights_before_save
from .tracking import gather

log = logging.getLogger("vp_accelerate.train")


def fingerprint(recipe, pipe, layout) -> dict:
    """What must match for a checkpoint to be resumed by this run (layout, model, data order).

    `layout` is every rank's `RankLayout` (a runtime.PipelineLayout); its placement (chunks, decoder
    layers, vocabulary rows) is recorded, not its sizes (bf16 vs fp32 parameters is `precision`).
    """
    p = recipe.pipeline
    return {
        "model": ckpt.config_fingerprint(pipe.hf_config),
        "world_size": pipe.world_size,
        "dp_size": pipe.dp_size,
        "schedule": p.schedule,
        "method": p.method,
        "chunks_per_rank": p.chunks_per_rank,
        "pad_multiple": p.pad_multiple,
        "layout": layout.placement(),
        "precision": recipe.pipeline.mixed_precision,  # the resolved one (setup's recipe): no, bf16, fp16, pure-bf16
        "global_batch": recipe.train.global_batch,
        "seq_len": recipe.data.seq_len,
        "seed": recipe.train.seed,
        **({"adapter": recipe_to_dict(recipe)["adapter"]} if recipe.adapter.enabled else {}),
    }


def as_saved(saved: dict, current: dict, layout) -> dict:
    """`current` in the form `saved` was written in: checkpoints from before the layout was recorded as
    data hold describe()'s text lines without the size; those lines are made from the same fields."""
    old = saved.get("layout")
    if isinstance(old, list) and old and all(isinstance(x, str) for x in old):
        return {**current, "layout": [r.text(params=False) for r in layout.ranks]}
    return current


def save_run(run, step: int) -> None:
    """Checkpoint `run` after `step` into recipe.checkpoint.dir (keeping checkpoint.keep of them)."""
    pipe = run.pipe
    mods = getattr(pipe, "mods", None)
    rank_info = gather(
        {
            "rank": pipe.rank,
            "pp_rank": pipe.pp_rank,
            "dp_rank": pipe.dp_rank,
            "duplicates": sorted(n for n, _ in pipe.named_parameters() if mods is not None and mods.is_duplicate(n)),
        }
    )
    meta = {
        "fingerprint": run.fingerprint,
        "recipe": run.recipe_dict,
        "ranks": rank_info,
        "vocab_size": pipe.hf_config.vocab_size,
        "sharded_names": sorted(getattr(mods, "sharded_names", ()) or ()),
        "lora_transposed": sorted(n for names in gather(getattr(pipe, "lora_transposed", [])) for n in names),
        "data": resume_check.data_identity(run.recipe.data),  # by content, compared by --resume
    }

    def write_model_files(out_dir: str) -> None:
        pipe.hf_config.save_pretrained(out_dir)
        run.tokenizer.save_pretrained(out_dir)

    model_state, optimizer_state = pipe.state_dict(), run.optimizer.state_dict()
    check_weights_before_save(step, model_state, optimizer_state)
    trainer_state = {
        "scheduler": run.scheduler.state_dict(),
        "rng": ckpt.rng_state(),
        "data": run.train_it.state_dict(),
        "precision": pipe.precision_state_dict(),
        "step": step,
        "counters": dict(getattr(run, "counters", {})),
        "best": dict(getattr(run, "best", {})),
    }
    best = getattr(run, "best", {})
    if best.get("step") == step:  # this step's evaluation is the best so far
        meta["eval_loss"] = best["loss"]
    barrier = (lambda: dist.barrier(group=host_group())) if dist.is_initialized() else (lambda: None)
    c = run.recipe.checkpoint
    path = ckpt.save_checkpoint(
        c.dir,
        step,
        rank=pipe.rank,
        model_state=model_state,
        optimizer_state=optimizer_state,
        trainer_state=trainer_state,
        meta=meta,
        barrier=barrier,
        write_model_files=write_model_files,
        keep=c.keep,
        best=c.keep_best and best.get("step") == step,
        keep_best=c.keep_best,
        agree=gather,  # a write error on any rank (a full disk) stops every rank with the same line
    )
    if pipe.rank == 0:
        log.info("saved checkpoint %s", path)


def resume_run(run, which: str = "latest", override=()) -> int:
    """Load checkpoint `which` (latest / a step / a path, see `checkpoint.resume_path`) into every piece of
    `run`'s state; returns its step. `override`: the `--override` groups (`resume_check.py`) whose new values are
    applied to the restored state instead of refusing the resume.

    Every rank reads and checks all of its files first (each named on any error, with the fix); only when
    every rank has, anything is loaded and "resumed" said."""
    pipe, cdir = run.pipe, run.recipe.checkpoint.dir
    problem, loaded = None, None
    try:
        path = ckpt.resume_path(cdir, which)
        if path is not None:
            meta = ckpt.read_meta(path)
            ckpt.check_fingerprint(
                meta["fingerprint"], as_saved(meta["fingerprint"], run.fingerprint, run.layout), path
            )
            applied = resume_check.check(
                path, meta, run.recipe_dict, resume_check.data_identity(run.recipe.data), override
            )
            model_state, optimizer_state, trainer_state = ckpt.load_rank(path, pipe.rank)
            ckpt.check_shapes(model_state, pipe.state_dict(), path, pipe.rank)
            loaded = (path, meta, applied, model_state, optimizer_state, trainer_state)
    except (ckpt.CheckpointError, RecipeError) as e:
        problem = (type(e).__name__, str(e))
    outcomes = gather((problem, None if loaded is None else int(loaded[1]["step"])))
    _stop_on_any(outcomes, cdir)
    if loaded is None:
        if pipe.rank == 0:
            log.warning("--resume: no checkpoint in %s; starting from step 0", cdir)
        return 0
    path, meta, applied, model_state, optimizer_state, trainer_state = loaded
    fresh = resume_check.fresh_hyperparameters(run.optimizer, run.scheduler)
    pipe.load_state_dict(model_state)
    run.optimizer.load_state_dict(optimizer_state)
    run.scheduler.load_state_dict(trainer_state["scheduler"])
    if "optimizer" in applied:  # --override optimizer: this run's values on the restored moments and step
        resume_check.apply_hyperparameters(run.optimizer, run.scheduler, fresh)
    pipe.load_precision_state_dict(trainer_state.get("precision", {}))  # the fp16 loss scale
    run.train_it.load_state_dict(trainer_state["data"])
    ckpt.set_rng_state(trainer_state["rng"])
    # counters and the best eval loss go on (a checkpoint from before they were saved starts them afresh)
    run.counters.update(trainer_state.get("counters", {}))
    run.best.update(trainer_state.get("best", {}))
    if pipe.rank == 0:
        log.info("resumed from %s (step %d)", path, meta["step"])
        if applied:
            log.info("--resume --override: this run's %s applied to the restored state", " and ".join(applied))
    return int(meta["step"])


def _stop_on_any(outcomes: list, cdir) -> None:
    """Raise the first rank's problem on every rank (the same error type), or refuse ranks that found different
    checkpoints (`latest` moved between their reads)."""
    for problem, _ in outcomes:
        if problem is not None:
            kind, message = problem
            raise (RecipeError if kind == "RecipeError" else ckpt.CheckpointError)(message)
    steps = sorted({step for _, step in outcomes if step is not None})
    if len(steps) > 1 or (steps and any(step is None for _, step in outcomes)):
        raise ckpt.CheckpointError(
            f"ranks found different latest checkpoints in {cdir} (steps {[s for _, s in outcomes]}); is another "
            f"run still writing there? Stop it and resume again"
        )


#: fingerprint keys that must match for weights-only initialisation (data order, batch, seed may differ)
_WEIGHT_KEYS = (
    "model",
    "world_size",
    "dp_size",
    "schedule",
    "method",
    "chunks_per_rank",
    "pad_multiple",
    "layout",
    "adapter",
)


def init_weights_from(run, source: str) -> None:
    """model.init_from: this rank's weights from a training checkpoint and nothing else (the optimizer, LR
    schedule, data order and step count start afresh). Each rank reads only its own shard file."""
    pipe = run.pipe
    path = ckpt.resolve(os.path.expanduser(source))
    meta = ckpt.read_meta(path)
    saved = meta["fingerprint"]
    current = as_saved(saved, run.fingerprint, run.layout)
    try:
        ckpt.check_fingerprint({k: saved.get(k) for k in _WEIGHT_KEYS}, {k: current.get(k) for k in _WEIGHT_KEYS}, path)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(
            f"model.init_from: {e}\nFor a checkpoint of another model or layout, export it "
            f"(vp-accelerate export {source} DIR) and set model.source: DIR"
        ) from None
    rdir = os.path.join(path, ckpt.rank_dir_name(pipe.rank))
    if not os.path.isdir(rdir):
        raise ckpt.CheckpointError(f"model.init_from: checkpoint {path} has no shards for rank {pipe.rank}")
    state = ckpt.load_weights(path, pipe.rank)
    ckpt.check_shapes(state, pipe.state_dict(), path, pipe.rank)
    pipe.load_state_dict(state)
    if pipe.rank == 0:
        log.info(
            "initialised the weights from %s (step %d); optimizer, schedule and data start afresh", path, meta["step"]
        )


def final_checkpoint(run) -> str | None:
    """The checkpoint the run's final model comes from: the best one (checkpoint.keep_best), else the latest."""
    c = run.recipe.checkpoint
    if not c.dir:
        return None
    best = ckpt.read_best(c.dir) if c.keep_best else None
    return best or c.dir
