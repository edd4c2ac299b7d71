"""`vp-accelerate train` and `vp-accelerate export`: argument parsing around trainer and export.

    accelerate launch --config_file configs/accelerate_cpu_2proc.yaml -m vp_accelerate train recipes/quickstart.yaml
    vp-accelerate train RECIPE [--set key.path=value ...] [--resume [latest|STEP|PATH] [--override optimizer|data]]
                       [--stop-at STEP]
                       [--check [--world-size N]]
    vp-accelerate export CHECKPOINT OUT_DIR [--trust-remote-code]

The recipe is read and validated before accelerate creates any process group, so a bad recipe
fails in every process at once with the key it concerns and exit code 2 (`preflight.check_plan` also
asks the model config, tokenizer and schedule builder whether the run can exist). Bad data and NaN/inf
steps stop every rank together with exit code 3.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vp_accelerate import exit_codes

from .plan import resolve_auto


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s rank {rank}] %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _train_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vp-accelerate train", description="Train from a recipe (YAML).")
    ap.add_argument("recipe", help="recipe YAML file (see recipes/ and docs/training.md)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a recipe field, typed by the field (repeatable)",
    )
    ap.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="latest|STEP|PATH",
        help="continue a run from a checkpoint: the latest in the checkpoint dir (no value or `latest`), "
        "step STEP there, or the checkpoint at PATH",
    )
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        choices=["optimizer", "data"],
        help="with --resume: apply this run's settings where they differ from the checkpoint's instead of "
        "refusing (optimizer: the optimizer and lr sections, applied to the restored optimizer and schedule; "
        "data: other data files, read from the restored position); repeatable",
    )
    ap.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="STEP",
        help="stop after this step (checkpointing it) as if interrupted; the LR schedule still "
        "spans train.steps, so `--resume` later continues the same run",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="validate the recipe, the plan and every data row (tokenized as the run will), print what "
        "was found, and exit (2 on anything that would stop the run)",
    )
    ap.add_argument(
        "--show-example",
        action="store_true",
        help="with --check: print one packed training row with the tokens that carry loss marked",
    )
    ap.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="with --check: the number of processes the run will have, so the schedule and layout are "
        "checked too (under a launcher, WORLD_SIZE is used)",
    )
    return ap


def _checked_recipe(args) -> tuple:
    """(recipe, notes for --check, what the checks found): the recipe read, `schedule: auto` resolved, and the
    model, tokenizer, layout and checkpoint dirs checked before accelerate starts a process group (every rank
    runs them). Raises RecipeError."""
    # imported once the arguments parsed: they load torch and transformers, which `train --help` does without
    from ..recipe import RecipeError, load_recipe
    from .preflight import check_plan, check_run_dirs, world_size_from_env

    recipe = load_recipe(args.recipe, args.overrides)
    recipe, plan = resolve_auto(recipe, args.world_size or world_size_from_env())
    if plan is not None and os.environ.get("RANK", "0") == "0":
        print(
            f"pipeline.schedule auto: {plan.describe()} (predicted {plan.tokens_per_s:.0f} tokens/s, "
            f"MFU {plan.mfu * 100:.1f}%, bubble {plan.bubble * 100:.1f}%, peak "
            f"{max(plan.peak_memory_gb):.1f} GB per rank)",
            file=sys.stderr,
            flush=True,
        )
    world = world_size_from_env()
    # one process (or --check): also convert tokenizers and count a swap's rows; launched ranks skip that
    found: dict = {}
    notes = check_plan(recipe, args.world_size or world, full=args.check or (world or 1) == 1, found=found)
    if args.override and args.resume is None:
        raise RecipeError("--override applies to --resume only; add --resume, or drop --override")
    notes += check_run_dirs(recipe, args.resume, tuple(args.override))
    return recipe, notes, found


def _run(recipe, args) -> tuple | int:
    """(the run, its summary), or the exit code when it stopped: 2 for a user error at the start, 3 for bad data,
    a bad checkpoint or NaN/inf (the same decision on every rank: each says why), 75 for a stop signal (after the
    checkpoint was written: resume with --resume)."""
    from ..data import DataError  # after parse_args, as above
    from ..persist.files import CheckpointError
    from ..run.nonfinite import NonFiniteError
    from ..run.preemption import Preempted
    from ..run.run_lock import release_all
    from ..run.trainer import setup, train
    from ..run.user_errors import USER_ERRORS, leave, report

    try:
        run = setup(recipe, resume=args.resume, stop_at=args.stop_at, override=tuple(args.override))
    except USER_ERRORS as e:  # found at the start (data, model source): one line, every rank stops, exit 2
        from ..recipe.load import where  # yaml: read only to place an error in the recipe file

        report(e, where(args.recipe, str(e), args.overrides))
        leave()
        release_all()
        return exit_codes.USER_ERROR
    except (CheckpointError, NonFiniteError) as e:
        print(f"training stopped: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        release_all()
        return exit_codes.STOPPED
    try:
        summary = train(recipe, resume=args.resume, stop_at=args.stop_at, run=run)
    except Preempted as e:  # a stop signal: the checkpoint is written, every rank says so and exits 75
        print(str(e), file=sys.stderr, flush=True)
        return exit_codes.PREEMPTED
    except (CheckpointError, DataError, NonFiniteError) as e:
        print(f"training stopped: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return exit_codes.STOPPED
    finally:
        release_all()
    return run, summary


def _log_end(recipe, summary: dict, stop_at: int | None) -> None:
    """The run's last line: done, stopped early (eval.patience), or stopped at --stop-at."""
    log = logging.getLogger("vp_accelerate.train")
    best = summary.get("best") or {}
    if summary.get("stopped_early"):
        log.info(
            "stopped early after step %d of %d (eval.patience): best eval loss %.4f at step %d%s",
            summary["end_step"],
            recipe.train.steps,
            best.get("loss", float("nan")),
            best.get("step", 0),
            f"; the model is in {summary['hf_dir']}" if summary["hf_dir"] else "",
        )
    elif summary["end_step"] < recipe.train.steps:
        saved = (
            f"checkpoint {recipe.checkpoint.dir}; continue with --resume"
            if recipe.checkpoint.dir
            else "no checkpoint (checkpoint.enabled: false), so it cannot be resumed"
        )
        log.info(
            "stopped after step %d of %d (--stop-at %s): %s; %s; no final export",
            summary["end_step"],
            recipe.train.steps,
            stop_at,
            _eval_words(summary, "eval loss"),
            saved,
        )
    else:
        model = f"; the model is in {summary['hf_dir']}" if summary["hf_dir"] else ""
        if summary.get("start_step") == summary["end_step"]:  # --resume of a finished run: nothing trained
            log.info(
                "done: the run had already finished at step %d, nothing left to train%s", summary["end_step"], model
            )
        else:
            log.info("done: %s after step %d%s", _eval_words(summary, "final eval loss"), summary["end_step"], model)


def _eval_words(summary: dict, what: str) -> str:
    """`what` and the loss, or that evaluation was off (eval.batches: 0): never a "nan" that only means "none"."""
    if not summary.get("eval_on", True):
        return "evaluation was off (eval.batches: 0)"
    return f"{what} {summary['final_eval_loss']:.4f}"


def train_main(argv: list[str] | None = None) -> int:
    args = _train_parser().parse_args(argv)
    from vp_accelerate.distributed import enable_fault_stacks

    enable_fault_stacks()  # a launched rank killed by a signal (an abort at exit) prints its threads' stacks
    from ..recipe import RecipeError  # after parse_args, as above
    from ..run.user_errors import say_once

    try:
        recipe, notes, found = _checked_recipe(args)
    except RecipeError as e:
        from ..recipe.load import where  # yaml: read only to place an error in the recipe file

        # every launched rank found the same: said once per machine, with the recipe line that set the key
        say_once(f"recipe error: {e} {where(args.recipe, str(e), args.overrides)}")
        return exit_codes.USER_ERROR
    if args.check:
        from .check import run_check

        return run_check(recipe, notes, found, args.show_example)
    _setup_logging()
    ran = _run(recipe, args)
    if isinstance(ran, int):
        return ran
    run, summary = ran
    _log_end(run.recipe, summary, args.stop_at)  # the recipe as it ran: train.steps from epochs, the checkpoint dir
    return 0


def export_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vp-accelerate export",
        description="Write an HF model dir (safetensors + config + tokenizer) "
        "from a training checkpoint's per-rank shards.",
    )
    ap.add_argument("checkpoint", help="a checkpoint step dir, or checkpoint.dir (its `latest` is used)")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write its peft adapter folder instead of the merged model",
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the weights' dtype in the export (default: the dtype they were trained in)",
    )
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model's own Python code (auto_map in the checkpoint's model/config.json) to read its config "
        "and tokenizer; only for a checkpoint you trust: a checkpoint's own files never turn this on",
    )
    args = ap.parse_args(argv)
    # imported once the arguments parsed: they load torch and transformers, which `export --help` does without
    import torch

    from ..persist.files import CheckpointError
    from ..persist.hf_export import export_checkpoint

    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            args.max_shard_size,
            adapter_only=args.adapter_only,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            trust_remote_code=args.trust_remote_code,
        )
    except CheckpointError as e:
        print(f"export error: {e}", file=sys.stderr)
        return exit_codes.USER_ERROR
    print(f"exported {args.checkpoint} -> {out}")
    return 0
