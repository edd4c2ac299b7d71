"""Save and resume a training run's whole state (model, optimizer, LR schedule, data position, RNG)
through the checkpoint format of checkpoint.py. Both are collectives: every rank calls them."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from vp_accelerate.runtime.groups import host_group

from ..recipe import recipe_to_dict
from . import checkpoint as ckpt
from .nonfinite import check_weights_before_save
from .reshard import (
    LAYOUT_KEYS,
    is_named,
    load_named_optimizer_state,
    rank_checkpoint_state,
    reshard_model,
    reshard_optimizer_state,
)
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


def as_saved(saved: dict, current: dict, layout) -> dict:
    """`current` in the form `saved` was written in: checkpoints from before the layout was recorded as
    data hold describe()'s text lines without the size; those lines are made from the same fields."""
    old = saved.get("layout")
    if isinstance(old, list) and old and all(isinstance(x, str) for x in old):
        return {**current, "layout": [r.text(params=False) for r in layout.ranks]}
    return current


def must_match(fingerprint: dict) -> dict:
    """The keys a resume must keep (model, precision, batch, sequence length, data order, adapter); the
    layout keys (`reshard.LAYOUT_KEYS`) may change, and the checkpoint is resharded."""
    return {k: v for k, v in fingerprint.items() if k not in LAYOUT_KEYS}


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
    }

    def write_model_files(out_dir: str) -> None:
        pipe.hf_config.save_pretrained(out_dir)
        run.tokenizer.save_pretrained(out_dir)

    # keyed by name, so that another layout can find each tensor (reshard.py); written once per replica group
    model_state, optimizer_state = rank_checkpoint_state(pipe, run.optimizer)
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
    )
    if pipe.rank == 0:
        log.info("saved checkpoint %s", path)


def resume_run(run, which: str = "latest") -> int:
    """Load checkpoint `which` (latest / a step / a path, see `checkpoint.resume_path`) into every piece of
    `run`'s state; returns its step."""
    pipe, cdir = run.pipe, run.recipe.checkpoint.dir
    path = ckpt.resume_path(cdir, which)
    if path is None:
        if pipe.rank == 0:
            log.warning("--resume: no checkpoint in %s; starting from step 0", cdir)
        return 0
    meta = ckpt.read_meta(path)
    steps = gather(int(meta["step"]))
    if len(set(steps)) > 1:  # `latest` moved between ranks' reads: another run is writing into this dir
        raise ckpt.CheckpointError(
            f"ranks found different latest checkpoints in {cdir} (steps {steps}); is another "
            f"run still writing there? Stop it and resume again"
        )
    saved = {"zero": False, **meta["fingerprint"]}  # a checkpoint from before ZeRO-1 was unsharded
    current = as_saved(saved, run.fingerprint, run.layout)
    ckpt.check_fingerprint(must_match(saved), must_match(current), path)
    same_layout = all(saved.get(k) == current.get(k) for k in LAYOUT_KEYS)
    if named_checkpoint(path):  # any layout: each tensor from the saved ranks' overlapping rows
        reshard_model(pipe, path, meta)
        load_named_optimizer_state(
            run.optimizer, pipe.named_parameters(), reshard_optimizer_state(pipe, path, meta), same_groups=False
        )
        trainer_state = ckpt.load_rank(path, pipe.rank if same_layout else 0)[2]
        if not same_layout:  # this rank's RNG: the saved rank of its number, where there is one
            rng_rank = pipe.rank if pipe.rank < len(meta["ranks"]) else 0
            trainer_state["rng"] = ckpt.load_rank(path, rng_rank)[2]["rng"]
    elif all(saved.get(k) == current.get(k) for k in LAYOUT_KEYS if k != "zero"):
        # saved before checkpoints were keyed by name (and before ZeRO-1): its own rank's files, the whole
        # optimizer state on every replica (a ZeroOptimizer keeps its own parameters' of it)
        model_state, optimizer_state, trainer_state = ckpt.load_rank(path, pipe.rank)
        ckpt.check_shapes(model_state, pipe.state_dict(), path, pipe.rank)
        pipe.load_state_dict(model_state)
        run.optimizer.load_state_dict(optimizer_state)
    else:
        diffs = ", ".join(k for k in LAYOUT_KEYS if saved.get(k) != current.get(k))
        raise ckpt.CheckpointError(
            f"checkpoint {path} was saved before checkpoints could reshard, and this run changes {diffs}. "
            f"Convert it once: resume it with the layout it was saved with (its meta.json recipe's pipeline "
            f"section) and --stop-at {int(meta['step']) + 1}; the checkpoint that saves resumes into any layout"
        )
    run.scheduler.load_state_dict(trainer_state["scheduler"])
    groups = len(run.optimizer.param_groups)
    for key in ("base_lrs", "_last_lr"):  # another layout may have another number of groups (all share the LR)
        values = getattr(run.scheduler, key, None)
        if isinstance(values, list) and values and len(values) != groups:
            setattr(run.scheduler, key, [values[0]] * groups)
    pipe.load_precision_state_dict(trainer_state.get("precision", {}))  # the fp16 loss scale
    run.train_it.load_state_dict(trainer_state["data"])
    ckpt.set_rng_state(trainer_state["rng"])
    # counters and the best eval loss go on (a checkpoint from before they were saved starts them afresh)
    run.counters.update(trainer_state.get("counters", {}))
    run.best.update(trainer_state.get("best", {}))
    if pipe.rank == 0:
        log.info("resumed from %s (step %d)", path, meta["step"])
    return int(meta["step"])


#: fingerprint keys that must match for weights-only initialisation (layout, data order, batch, seed may differ:
#: the weights are read by global name and row range, reshard.py)
_WEIGHT_KEYS = ("model", "adapter")


def init_weights_from(run, source: str) -> None:
    """model.init_from: this rank's weights from a training checkpoint and nothing else (the optimizer, LR
    schedule, data order and step count start afresh). Each rank reads only its own shard file."""
    pipe = run.pipe
    path = ckpt.resolve(os.path.expanduser(source))
    meta = ckpt.read_meta(path)
    saved = {"zero": False, **meta["fingerprint"]}  # a checkpoint from before ZeRO-1 was unsharded
    current = as_saved(saved, run.fingerprint, run.layout)
    try:
        ckpt.check_fingerprint({k: saved.get(k) for k in _WEIGHT_KEYS}, {k: current.get(k) for k in _WEIGHT_KEYS}, path)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(
            f"model.init_from: {e}\nFor a checkpoint of another model or layout, export it "
            f"(vp-accelerate export {source} DIR) and set model.source: DIR"
        ) from None
    reshard_model(pipe, path, meta)
    if pipe.rank == 0:
        log.info(
            "initialised the weights from %s (step %d); optimizer, schedule and data start afresh", path, meta["step"]
        )


def named_checkpoint(path: str) -> bool:
    """True when checkpoint `path` keeps its optimizer state by parameter name (it can reshard)."""
    state = torch.load(
        os.path.join(path, ckpt.rank_dir_name(0), "optimizer.pt"), weights_only=True, mmap=True, map_location="cpu"
    )
    return is_named(state)


def final_checkpoint(run) -> str | None:
    """The checkpoint the run's final model comes from: the best one (checkpoint.keep_best), else the latest."""
    c = run.recipe.checkpoint
    if not c.dir:
        return None
    best = ckpt.read_best(c.dir) if c.keep_best else None
    return best or c.dir
