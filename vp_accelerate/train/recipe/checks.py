"""Which recipes are valid: cross-field checks that need no process group, each error naming its key.

`check` is pure: it returns the resolved recipe (train.steps defaulted, warm-up steps from lr.warmup_ratio) and
leaves the one it is given as it was. `finish_steps` settles the length of a run given in epochs once the data
says how many steps an epoch is.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import math
import os
import signal

from vp_accelerate.runtime.preference_config import LOSSES, alpha_problem

from .convert import RecipeError
from .schema import Recipe


def check(recipe: Recipe) -> Recipe:
    """Cross-field checks that need no process group; the resolved recipe (a copy: `recipe` is not changed).
    Raises RecipeError naming the key."""
    recipe = copy.deepcopy(recipe)
    p, t, d, o = recipe.pipeline, recipe.train, recipe.data, recipe.optimizer
    _derive_batch(recipe)
    try:
        p.check()
    except ValueError as e:  # its message starts with the field name
        raise RecipeError(f"pipeline.{e}") from None
    try:
        recipe.adapter.check()
    except ValueError as e:  # its message starts with adapter.<field>
        raise RecipeError(str(e)) from None
    if recipe.adapter.enabled:
        if importlib.util.find_spec("peft") is None:
            raise RecipeError("adapter.type: lora needs the peft package; pip install 'vp-accelerate[lora]' (or peft)")
    _check_length(recipe)
    positive = {
        "train.steps": 1 if t.steps is None else t.steps,
        "train.global_batch": t.global_batch,
        "data.seq_len": d.seq_len,
        "logging.log_every": recipe.logging.log_every,
        "data.shuffle_buffer": d.shuffle_buffer,
        "tokenizer.pad_to_multiple_of": recipe.tokenizer.pad_to_multiple_of,
        "checkpoint.keep": recipe.checkpoint.keep,
        "train.max_skipped_steps": t.max_skipped_steps,
        "eval.max_new_tokens": recipe.eval.max_new_tokens,
    }
    for key, value in positive.items():
        if value < 1:
            raise RecipeError(f"{key}: must be >= 1, got {value}")
    for key, value in {
        "eval.every": recipe.eval.every,
        "checkpoint.every": recipe.checkpoint.every,
        "eval.batches": recipe.eval.batches or 0,
        "lr.warmup_steps": recipe.lr.warmup_steps,
    }.items():
        if value < 0:
            raise RecipeError(f"{key}: must be >= 0, got {value}")
    if p.schedule == "auto":  # the planner chooses dp_size and microbatches; checked again once it has
        if p.tp_size > 1:
            raise RecipeError(
                f"pipeline.tp_size: schedule auto chooses the tensor-parallel size itself; drop tp_size, or set "
                f"pipeline.plan_tp_sizes: [{p.tp_size}] to plan with {p.tp_size} only, or name a schedule"
            )
        if p.plan_tp_sizes is not None and (not p.plan_tp_sizes or min(p.plan_tp_sizes) < 1):  # ints: the reader
            raise RecipeError(
                f"pipeline.plan_tp_sizes: a list of tensor-parallel sizes >= 1 (e.g. [1, 2, 4, 8]) or null, got "
                f"{list(p.plan_tp_sizes)}"
            )
        if p.layers_per_stage is not None:
            raise RecipeError(
                "pipeline.layers_per_stage: cannot be set with schedule auto (the plan splits the "
                "layers); drop it or name a schedule"
            )
    elif t.global_batch % (p.dp_size * p.microbatches):
        unit = p.dp_size * p.microbatches
        lower, upper = (t.global_batch // unit) * unit, (t.global_batch // unit + 1) * unit
        near = f"{lower} or {upper}" if lower else f"{upper}"
        raise RecipeError(
            f"train.global_batch: {t.global_batch} sequences do not split into pipeline.dp_size={p.dp_size} "
            f"replicas x pipeline.microbatches={p.microbatches} equal microbatches (a multiple of {unit}); use "
            f"{near}, or set train.micro_batch_size (sequences per microbatch) instead of global_batch"
        )
    for key, folder in (("logging.output_dir", recipe.logging.output_dir), ("checkpoint.dir", recipe.checkpoint.dir)):
        if folder is not None and not str(folder).strip():  # "" would write the run into the current directory
            raise RecipeError(f"{key}: is empty; name a folder for the run (e.g. outputs/run), or drop the key")
    recipe.checkpoint.stop_signals = _stop_signals(recipe.checkpoint.stop_signals)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise RecipeError(f"optimizer.betas: expected two values in [0, 1), got {o.betas}")
    for key in ("lr", "eps", "weight_decay", "grad_clip"):
        value = getattr(o, key)
        if value is not None and not math.isfinite(value):  # NaN passes every comparison below
            raise RecipeError(f"optimizer.{key}: must be a finite number, got {value}")
    if o.lr <= 0 or o.eps <= 0 or o.weight_decay < 0:
        raise RecipeError("optimizer: lr and eps must be > 0 and weight_decay >= 0")
    if o.grad_clip is not None and o.grad_clip <= 0:
        raise RecipeError(f"optimizer.grad_clip: must be > 0 or null, got {o.grad_clip}")
    if not 0.0 <= recipe.lr.min_lr_ratio <= 1.0:
        raise RecipeError(f"lr.min_lr_ratio: must be in [0, 1], got {recipe.lr.min_lr_ratio}")
    _check_eval(recipe)
    if t.steps is not None:
        recipe = finish_steps(recipe)
    if not 0.0 <= d.eval_holdout < 1.0:
        raise RecipeError(f"data.eval_holdout: must be in [0, 1), got {d.eval_holdout}")
    if d.streaming and not d.packing:
        raise RecipeError("data.packing: false is not supported with data.streaming: true (streams are packed)")
    if bool(d.files) == bool(d.hub_id):
        raise RecipeError("data: set exactly one of data.files (local files) or data.hub_id")
    if recipe.logging.peak_tflops < 0:
        raise RecipeError("logging.peak_tflops: must be >= 0")
    _check_preference(recipe)
    _check_paths(recipe)
    return recipe


def _check_preference(recipe: Recipe) -> None:
    """DPO (data.format: preference) and KTO (unpaired_preference): what the loss and its rows need."""
    if recipe.data.format not in ("preference", "unpaired_preference"):
        return
    if not recipe.preference.beta > 0:
        raise RecipeError(f"preference.beta: must be > 0, got {recipe.preference.beta}")
    pref = recipe.preference
    types = list(pref.types)
    if not types:
        raise RecipeError("preference.loss_type: an empty list; name at least one loss (e.g. sigmoid)")
    if pref.loss_weights is not None and len(pref.loss_weights) != len(types):
        raise RecipeError(
            f"preference.loss_weights: {len(pref.loss_weights)} weights for {len(types)} loss types {types}; "
            f"give one weight per loss_type entry"
        )
    unpaired = recipe.data.format == "unpaired_preference"
    unpaired_losses = [t for t, kind in LOSSES.items() if kind.unpaired]
    kto = [t for t in types if t in unpaired_losses]
    if unpaired and len(kto) != len(types):
        raise RecipeError(
            f"preference.loss_type: data.format unpaired_preference trains {unpaired_losses} (KTO), got "
            f"{types}; set preference.loss_type: kto"
        )
    if not unpaired and kto:
        raise RecipeError(
            f"preference.loss_type: {kto} train on unpaired rows; set data.format: unpaired_preference (rows of "
            f"prompt, completion, label), or use a pair loss such as sigmoid"
        )
    if min(pref.desirable_weight, pref.undesirable_weight) <= 0:
        raise RecipeError(
            f"preference.desirable_weight / undesirable_weight: must be > 0, got {pref.desirable_weight} / "
            f"{pref.undesirable_weight}"
        )
    if alpha_problem(pref.alpha, types):
        raise RecipeError(f"preference.alpha: {alpha_problem(pref.alpha, types)}")
    if "robust" in types and not 0 <= pref.label_smoothing < 0.5:
        raise RecipeError(f"preference.label_smoothing: robust needs it in [0, 0.5), got {pref.label_smoothing}")
    if recipe.pipeline.label_smoothing:
        raise RecipeError(
            "pipeline.label_smoothing: DPO compares log-probabilities, which smoothing would change; set it to 0"
        )
    if recipe.data.streaming:
        raise RecipeError("data.streaming: preference pairs are read whole; set data.streaming: false")


# the demo data sets the shipped recipes read, and the script that makes each (offline, seconds)
_DEMO_DATA = {
    "demo_corpus": "python scripts/make_demo_corpus.py --out {dir}",
    "demo_chat": "python scripts/make_demo_chat.py --out {dir}",
    "demo_preference": "python scripts/make_demo_chat.py --preference --conversations 1000 --out {dir}",
    "demo_unpaired": "python scripts/make_demo_chat.py --unpaired --conversations 1000 --out {dir}",
}


def _stop_signals(names) -> list[str]:
    """checkpoint.stop_signals as signal-module names (SIGTERM, not term); RecipeError naming a bad one."""
    out = []
    for name in names:
        full = str(name).strip().upper()
        full = full if full.startswith("SIG") else f"SIG{full}"
        if full in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, full, None), signal.Signals):
            raise RecipeError(
                f"checkpoint.stop_signals: {name!r} is not a signal a run can catch (e.g. SIGTERM, SIGUSR1)"
            )
        out.append(full)
    return out


def _make_hint(pattern: str) -> str:
    folder = os.path.dirname(pattern)
    make = _DEMO_DATA.get(os.path.basename(folder))
    return f"; make it with `{make.format(dir=folder)}`" if make else ""


def _check_paths(recipe: Recipe) -> None:
    """Local inputs must exist before launching ranks, so a typo fails in a second, not after startup."""
    for key, patterns in (("data.files", recipe.data.files), ("data.eval_files", recipe.data.eval_files)):
        for pattern in patterns:
            if not glob.glob(os.path.expanduser(pattern)):
                raise RecipeError(f"{key}: no file matches {pattern!r}{_make_hint(pattern)}")
    tok = recipe.tokenizer.source or ""
    if tok.startswith("bpe:"):
        path = tok[4:]
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise RecipeError(
                f"tokenizer.source: {path!r} has no tokenizer.json; train one with "
                f"`python scripts/train_tokenizer.py --out {path} FILES...`"
            )
    elif tok.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(tok)):
        raise RecipeError(f"tokenizer.source: directory {tok!r} does not exist")
    src = recipe.model.source
    if src.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(src)):
        raise RecipeError(f"model.source: directory {src!r} does not exist")


DEFAULT_GLOBAL_BATCH = 16
"""train.global_batch when neither it nor train.micro_batch_size is set."""


def _derive_batch(recipe: Recipe) -> None:
    """TRL's spelling of the batch: gradient_accumulation_steps sets pipeline.microbatches, micro_batch_size
    derives global_batch = micro_batch_size x microbatches x dp_size (in place, on check's copy)."""
    t, p = recipe.train, recipe.pipeline
    for key in ("micro_batch_size", "gradient_accumulation_steps"):
        value = getattr(t, key)
        if value is not None and value < 1:
            raise RecipeError(f"train.{key}: must be >= 1 or null, got {value}")
        if value is not None and p.schedule == "auto":
            raise RecipeError(
                f"train.{key}: pipeline.schedule auto chooses dp_size and microbatches itself; set "
                f"train.global_batch, or name a schedule (e.g. 1f1b)"
            )
    if t.gradient_accumulation_steps is not None:
        p.microbatches = t.gradient_accumulation_steps
    if t.micro_batch_size is not None:
        if t.global_batch is not None:
            raise RecipeError(
                f"train.micro_batch_size: set train.global_batch ({t.global_batch}) or train.micro_batch_size "
                f"({t.micro_batch_size}), not both (global_batch = micro_batch_size x microbatches x dp_size)"
            )
        t.global_batch = t.micro_batch_size * p.microbatches * p.dp_size
    elif t.global_batch is None:
        t.global_batch = DEFAULT_GLOBAL_BATCH


def describe_batch(recipe: Recipe, pp_size: int | None = None) -> str:
    """How a (checked) recipe's global batch splits: replicas, microbatches, sequences per microbatch (pairs:
    pairs per microbatch and the two sequences of each)."""
    t, p = recipe.train, recipe.pipeline
    per_mb = t.global_batch // (p.dp_size * p.microbatches)
    if recipe.data.format == "preference":  # train.global_batch counts pairs, as TRL's batch sizes
        size = f"{t.global_batch} pairs = {per_mb} pair{'' if per_mb == 1 else 's'} ({2 * per_mb} sequences)"
    else:
        size = f"{t.global_batch} = {per_mb} sequences"
    how = "train.micro_batch_size" if t.micro_batch_size is not None else "from train.global_batch"
    accum = " (train.gradient_accumulation_steps)" if t.gradient_accumulation_steps is not None else ""
    tp = f" x {p.tp_size} tensor-parallel ranks" if p.tp_size > 1 else ""
    n = (pp_size or 0) * p.tp_size * p.dp_size
    ranks = f"; {pp_size} pipeline ranks{tp} x {p.dp_size} replicas = {n} processes" if pp_size else ""
    return (
        f"batch: global_batch {size} per microbatch ({how}) x "
        f"{p.microbatches} microbatches{accum} x dp_size {p.dp_size}{ranks}"
    )


DEFAULT_STEPS = 100
"""train.steps when neither it nor train.epochs is set."""


def _check_length(recipe: Recipe) -> None:
    """train.steps or train.epochs (one of them), lr.warmup_steps or lr.warmup_ratio (at most one)."""
    t, lr = recipe.train, recipe.lr
    if t.epochs is not None:
        if t.steps is not None:
            raise RecipeError(f"train.epochs: set train.steps ({t.steps}) or train.epochs ({t.epochs:g}), not both")
        if t.epochs <= 0:
            raise RecipeError(f"train.epochs: must be > 0, got {t.epochs:g}")
        if recipe.data.streaming:
            raise RecipeError(
                "train.epochs: a stream's length is not known before it is read (data.streaming); "
                "set train.steps instead"
            )
    elif t.steps is None:
        t.steps = DEFAULT_STEPS
    if lr.warmup_ratio is not None:
        if not 0.0 <= lr.warmup_ratio < 1.0:
            raise RecipeError(f"lr.warmup_ratio: must be in [0, 1), got {lr.warmup_ratio:g}")
        if lr.warmup_steps:
            raise RecipeError(
                f"lr.warmup_ratio: set lr.warmup_steps ({lr.warmup_steps}) or lr.warmup_ratio "
                f"({lr.warmup_ratio:g}), not both"
            )


def finish_steps(recipe: Recipe, steps_per_epoch: int | None = None) -> Recipe:
    """The recipe with the run's length settled (a copy): train.steps from train.epochs (`steps_per_epoch`
    optimizer steps per pass over the data), lr.warmup_steps from lr.warmup_ratio; the LR schedule is built once
    to check it."""
    from .lr_schedule import check_schedule  # loads torch and transformers' schedulers: the recipe check stays light

    recipe = copy.deepcopy(recipe)
    t, lr = recipe.train, recipe.lr
    if t.steps is None:
        if steps_per_epoch is None:
            raise ValueError("finish_steps: train.epochs needs the steps per epoch")
        t.steps = max(1, math.ceil(t.epochs * steps_per_epoch - 1e-9))
    if lr.warmup_ratio is not None:
        lr.warmup_steps = int(round(lr.warmup_ratio * t.steps))
    check_schedule(lr, t.steps)
    return recipe


def _check_eval(recipe: Recipe) -> None:
    """Early stopping and keep_best need evaluations (and keep_best one at every checkpoint)."""
    e, c = recipe.eval, recipe.checkpoint
    if e.patience is not None:
        if e.patience < 1:
            raise RecipeError(f"eval.patience: must be >= 1 or null, got {e.patience}")
        if e.batches == 0 or e.every == 0:
            raise RecipeError(
                "eval.patience: early stopping needs evaluations during the run; set eval.every > 0 "
                "and eval.batches other than 0"
            )
    if e.min_delta < 0:
        raise RecipeError(f"eval.min_delta: must be >= 0, got {e.min_delta:g}")
    if e.prompts and e.batches == 0:
        raise RecipeError("eval.prompts: completions are made at evaluations, and eval.batches: 0 turns them off")
    if c.keep_best:
        if not c.enabled:
            raise RecipeError("checkpoint.keep_best: needs checkpoints (checkpoint.enabled: true)")
        if e.batches == 0 or e.every == 0 or c.every == 0 or c.every % e.every:
            raise RecipeError(
                f"checkpoint.keep_best: every checkpoint needs an eval loss: set eval.every > 0 and "
                f"checkpoint.every a multiple of it (now eval.every={e.every}, checkpoint.every="
                f"{c.every}, eval.batches={e.batches})"
            )
