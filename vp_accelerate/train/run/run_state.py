"""Save and resume a training run's whole state (every part of `state_parts.PARTS`: model, optimizer, LR
schedule, data position, loss scale, RNG, counters) through the checkpoint format of `train/persist/store.py`.
Both are collectives: every rank calls them."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from vp_accelerate.runtime.groups import host_group

from ..persist import resume_check
from ..persist import store as ckpt
from ..persist.reshard import LAYOUT_KEYS
from ..recipe import RecipeError, recipe_to_dict
from .nonfinite import check_weights_before_save
from .state_parts import MODEL, Saved, load_parts, rank_state
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
        "zero": bool(getattr(pipe, "zero_sharded", False)),  # where the optimizer state lies (a layout key)
        "precision": recipe.pipeline.mixed_precision,  # the resolved one (setup's recipe): no, bf16, fp16, pure-bf16
        "global_batch": recipe.train.global_batch,
        "seq_len": recipe.data.seq_len,
        "seed": recipe.train.seed,
        **({"adapter": recipe_to_dict(recipe)["adapter"]} if recipe.adapter.enabled else {}),
    }


def must_match(fingerprint: dict) -> dict:
    """The keys a resume must keep (model, precision, batch, sequence length, data order, adapter); the
    layout keys (`reshard.LAYOUT_KEYS`) may change, and the checkpoint is resharded."""
    return {k: v for k, v in fingerprint.items() if k not in LAYOUT_KEYS}


def _barrier():
    return (lambda: dist.barrier(group=host_group())) if dist.is_initialized() else (lambda: None)


def complete_pending_save(run) -> None:
    """Collective: the checkpoint `run` is writing in the background, waited for and agreed on by every rank,
    then named by `latest` (a write error on any rank: CheckpointError on every rank). Every rank calls it at
    the same point: each save (before the next one starts), the end of training, a stop every rank decides
    together. Nothing to do without a pending save."""
    pending, run.pending_save = getattr(run, "pending_save", None), None
    if pending is None:
        return
    path = ckpt.complete_save(pending, _barrier(), agree=gather)
    if run.pipe.rank == 0:
        log.info("saved checkpoint %s", path)


def poll_pending_save(run) -> None:
    """Collective, once per step while a save is pending: every rank says whether its write has finished (a
    small all-gather); when all have, the save is completed (`complete_pending_save`) and `latest` moves, so a
    run killed between saves loses no more than a synchronous save would. The same answer on every rank: all
    complete it together, or none does."""
    pending = getattr(run, "pending_save", None)
    if pending is not None and all(gather(pending.write.done())):
        complete_pending_save(run)


def settle_pending_save(run) -> None:
    """This rank's background write waited for, no collective (a failure some ranks may not share): its files
    are whole or named a problem, and `latest` stays at the checkpoint before it."""
    pending, run.pending_save = getattr(run, "pending_save", None), None
    if pending is not None:
        try:
            pending.write.wait()
        except Exception:  # noqa: BLE001 - the run is already stopping on another error, which is the one said
            pass


def save_run(run, step: int) -> None:
    """Checkpoint `run` after `step` into recipe.checkpoint.dir (keeping checkpoint.keep of them). The previous
    checkpoint is completed first; with checkpoint.background this one is written while training goes on, and
    becomes `latest` at the first step after every rank's write finished (`poll_pending_save`), at the latest
    at the next save or the end (`complete_pending_save`)."""
    complete_pending_save(run)  # the next save waits for the previous one
    pipe = run.pipe
    mods = getattr(pipe, "mods", None)
    rank_info = gather(
        {
            "rank": pipe.rank,
            "pp_rank": pipe.pp_rank,
            "dp_rank": pipe.dp_rank,
            "tp_rank": pipe.groups.tp_rank,
            "duplicates": sorted(n for n, _ in pipe.named_parameters() if mods is not None and mods.is_duplicate(n)),
        }
    )
    meta = {
        "fingerprint": run.fingerprint,
        "recipe": run.recipe_dict,
        "ranks": rank_info,
        "vocab_size": pipe.hf_config.vocab_size,
        "sharded_names": sorted(getattr(mods, "sharded_names", ()) or ()),
        # tensor parallelism: the pipeline stage's TP ranks hold slices of these along the dim given
        "tp_size": pipe.groups.tp_size,
        "tp_sliced": {n: d for part in gather(getattr(mods, "tp_sliced", {}) or {}) for n, d in part.items()},
        "tp_packed": {n: p for part in gather(getattr(mods, "tp_packed", {}) or {}) for n, p in part.items()},
        "tp_vocab": sorted({n for part in gather(sorted(getattr(mods, "tp_vocab_names", ()) or ())) for n in part}),
        "lora_transposed": sorted(n for names in gather(getattr(pipe, "lora_transposed", [])) for n in names),
        "data": resume_check.data_identity(run.recipe.data),  # by content, compared by --resume
    }

    def write_model_files(out_dir: str) -> None:
        pipe.hf_config.save_pretrained(out_dir)
        run.tokenizer.save_pretrained(out_dir)

    best = run.best
    if best.get("step") == step:  # this step's evaluation is the best so far
        meta["eval_loss"] = best["loss"]
    state = rank_state(run, step, meta)  # the model and optimizer keyed by name: another layout finds each tensor
    check_weights_before_save(step, state.model, state.optimizer)
    c = run.recipe.checkpoint
    spec = ckpt.SaveSpec(
        c.dir, step, pipe.rank, write_model_files, c.keep, c.keep_best and best.get("step") == step, c.keep_best
    )
    run.pending_save = ckpt.begin_save(spec, state, _barrier(), background=c.background)
    if not c.background:
        complete_pending_save(run)  # a write error on any rank (a full disk) stops every rank with the same line


def resume_run(run, which: str = "latest", override=()) -> int:
    """Load checkpoint `which` (latest / a step / a path, see `checkpoint.resume_path`) into every piece of
    `run`'s state; returns its step. `override`: the `--override` groups (`resume_check.py`) whose new values are
    applied to the restored state instead of refusing the resume.

    First every rank checks what it will read (the fingerprint, the recipe's optimizer / LR / data against the
    checkpoint's, and its share of the checkpoint's files, each file by one rank, named on any error with the
    fix); only when every rank has, every part (`state_parts.PARTS`) is loaded and "resumed" said. A checkpoint
    resumes into any layout (reshard.py: each tensor from the saved ranks' overlapping rows)."""
    pipe, cdir = run.pipe, run.recipe.checkpoint.dir
    problem, found = None, None
    try:
        path = ckpt.resume_path(cdir, which)
        if path is not None:
            meta = ckpt.read_meta(path)
            same_layout = _same_layout(run, path, meta)
            applied = resume_check.check(
                path, meta, run.recipe_dict, resume_check.data_identity(run.recipe.data), override
            )
            world = dist.get_world_size() if dist.is_initialized() else 1
            _check_files_share(path, meta, pipe.rank, world)
            found = (path, meta, same_layout, applied)
    except (ckpt.CheckpointError, RecipeError) as e:
        problem = (type(e).__name__, str(e))
    outcomes = gather((problem, None if found is None else int(found[1]["step"])))
    _stop_on_any(outcomes, cdir)
    if found is None:
        if pipe.rank == 0:
            log.warning("--resume: no checkpoint in %s; starting from step 0", cdir)
        return 0
    path, meta, same_layout, applied = found
    fresh = resume_check.fresh_hyperparameters(run.optimizer, run.scheduler)
    load_parts(run, Saved(path, meta, pipe.rank if same_layout else 0))
    if "optimizer" in applied:  # --override optimizer: this run's values on the restored moments and step
        resume_check.apply_hyperparameters(run.optimizer, run.scheduler, fresh)
    if pipe.rank == 0:
        log.info("resumed from %s (step %d)", path, meta["step"])
        if applied:
            log.info("--resume --override: this run's %s applied to the restored state", " and ".join(applied))
    return int(meta["step"])


def _same_layout(run, path: str, meta: dict) -> bool:
    """Whether this run reads checkpoint `path` in the layout it was saved with (else it is resharded: every
    checkpoint resumes into any layout). Raises CheckpointError for what cannot resume: another model,
    precision, batch, ..."""
    saved = meta["fingerprint"]
    ckpt.check_fingerprint(must_match(saved), must_match(run.fingerprint), path)
    return all(saved.get(k) == run.fingerprint.get(k) for k in LAYOUT_KEYS)


def _check_files_share(path: str, meta: dict, rank: int, world: int, weights_only: bool = False) -> None:
    """Check this rank's share of the checkpoint's files against their recorded sizes and hashes: the saved
    rank folders k with k % world == rank (each file read by one rank, whatever the new layout), and model/'s
    files on rank 0; `weights_only`: of the rank folders, only the weights (model.init_from reads nothing else).
    CheckpointError names a missing, damaged or changed file and the fix."""
    if rank == 0:
        ckpt.check_model_files(path, meta)
    for k in ckpt.saved_ranks(path, meta):
        if k % world == rank:
            (ckpt.check_weight_file if weights_only else ckpt.check_rank_files)(path, k)


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


#: fingerprint keys that must match for weights-only initialisation (layout, data order, batch, seed may differ:
#: the weights are read by global name and row range, reshard.py)
_WEIGHT_KEYS = ("model", "adapter")


def init_weights_from(run, source: str) -> None:
    """model.init_from: this rank's weights from a training checkpoint and nothing else (the optimizer, LR
    schedule, data order and step count start afresh). As `resume_run` does, every rank first checks its share of
    the files it will read against their recorded sizes and hashes (a damaged shard is named, on every rank,
    before any weight loads); then each rank reads only the rows it holds."""
    pipe = run.pipe
    problem, found = None, None
    try:
        path = ckpt.resolve(os.path.expanduser(source))
        meta = ckpt.read_meta(path)
        saved, current = meta["fingerprint"], run.fingerprint
        try:
            ckpt.check_fingerprint(
                {k: saved.get(k) for k in _WEIGHT_KEYS}, {k: current.get(k) for k in _WEIGHT_KEYS}, path
            )
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError(
                f"model.init_from: {e}\nFor a checkpoint of another model or layout, export it "
                f"(vp-accelerate export {source} DIR) and set model.source: DIR"
            ) from None
        world = dist.get_world_size() if dist.is_initialized() else 1
        _check_files_share(path, meta, pipe.rank, world, weights_only=True)
        found = (path, meta)
    except (ckpt.CheckpointError, RecipeError) as e:
        problem = (type(e).__name__, str(e))
    _stop_on_any(gather((problem, None if found is None else int(found[1]["step"]))), source)
    path, meta = found
    MODEL.load(run, Saved(path, meta, pipe.rank))
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
