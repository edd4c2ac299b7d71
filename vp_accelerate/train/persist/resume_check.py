"""`--resume` against a changed recipe: what the restored state would silently override, said or applied.

A checkpoint's optimizer and LR-scheduler states carry their own hyperparameters (lr, weight decay, betas, eps,
the schedule's base LR): loading them undoes `--set optimizer.lr=...` while the new meta.json records the new
value. And the data position is only meaningful for the data it counted through. So a resume compares the
checkpoint's recipe (`optimizer`, `lr`) and data identity (each file's size and content hash,
`data/identity.py`) with this run's, and refuses with one line per difference, unless the user names the group
with `--override` (`optimizer`: this run's optimizer and lr sections are applied to the restored state; `data`:
the new data is read from the restored position). Either way meta.json then describes the state beside it.
"""

from __future__ import annotations

import math

from ..data.identity import files_identity, identity_differences
from ..data.sources import nonempty_paths
from ..recipe import RecipeError

OVERRIDES = {"optimizer": ("optimizer", "lr"), "data": ("data",)}
"""`--override NAME`: the recipe sections (or the data identity) it lets differ from the checkpoint's."""


NOT_RESTORED = frozenset({"optimizer.grad_clip"})
"""Keys of those sections no restored state holds (read from the recipe at every step): a change just applies."""


def data_identity(data_cfg) -> dict:
    """What a run's data is, by content: each local file's identity, or the hub dataset's name and revision."""
    if data_cfg.hub_id:
        return {
            "hub": [data_cfg.hub_id, data_cfg.hub_name, data_cfg.hub_split, data_cfg.hub_revision],
        }
    out = {"files": files_identity(nonempty_paths(data_cfg.files))}
    if data_cfg.eval_files:
        out["eval_files"] = files_identity(nonempty_paths(data_cfg.eval_files, "data.eval_files"))
    return out


def _flat(section: dict, prefix: str) -> dict:
    out = {}
    for k, v in (section or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}.{k}"))
        else:
            out[f"{prefix}.{k}"] = v
    return out


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) or a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def differences(saved_recipe: dict, recipe: dict, saved_data: dict | None, data: dict | None) -> dict[str, list]:
    """{override name: one line per difference} between a checkpoint's recipe and data and this run's."""
    found: dict[str, list] = {name: [] for name in OVERRIDES}
    for section in OVERRIDES["optimizer"]:
        old, new = _flat(saved_recipe.get(section), section), _flat(recipe.get(section), section)
        for key in sorted(set(old) | set(new)):
            if key in NOT_RESTORED:
                continue
            if key in old and key in new and not _same(old[key], new[key]):
                found["optimizer"].append(f"{key}: the checkpoint has {old[key]!r}, this run {new[key]!r}")
    if saved_data is not None and data is not None:  # a checkpoint from before the data identity says nothing
        if "hub" in saved_data or "hub" in data:
            if saved_data.get("hub") != data.get("hub"):
                found["data"].append(
                    f"data.hub_*: the checkpoint has {saved_data.get('hub')}, this run {data.get('hub')}"
                )
        else:
            for key in ("files", "eval_files"):
                lines = identity_differences(saved_data.get(key) or [], data.get(key) or [])
                found["data"] += [line.replace("data.files", f"data.{key}", 1) for line in lines]
    return {k: v for k, v in found.items() if v}


def check(path: str, meta: dict, recipe: dict, data: dict | None, override=()) -> list[str]:
    """The `--override` groups to apply (those that differ and were named); RecipeError listing every
    difference that was not named, with the flag that applies it."""
    diffs = differences(meta.get("recipe") or {}, recipe, meta.get("data"), data)
    refused = {k: v for k, v in diffs.items() if k not in set(override or ())}
    if refused:
        lines = [line for v in refused.values() for line in v]
        flags = " ".join(f"--override {k}" for k in refused)
        raise RecipeError(
            f"--resume: checkpoint {path} was saved with other settings than this run's, which the restored state "
            f"would silently undo:\n  " + "\n  ".join(lines) + f"\nResume with the checkpoint's settings (drop the "
            f"--set / recipe change), or apply this run's to the restored state with --resume {flags}"
        )
    return sorted(diffs)


def fresh_hyperparameters(optimizer, scheduler) -> dict:
    """The optimizer's and scheduler's hyperparameters as this run built them (before a state is loaded): every
    key of each parameter group but its parameters, so a hyperparameter an optimizer adds is applied too."""
    return {
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "base_lrs": list(getattr(scheduler, "base_lrs", [])),
    }


def apply_hyperparameters(optimizer, scheduler, fresh: dict) -> None:
    """`--override optimizer`: this run's hyperparameters on the restored optimizer and scheduler (the moments
    and the step count stay restored); the LR is this run's schedule at the restored step."""
    for group, new in zip(optimizer.param_groups, fresh["groups"]):
        group.update({k: v for k, v in new.items() if k != "lr"})
    if fresh["base_lrs"]:
        scheduler.base_lrs = list(fresh["base_lrs"])
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is not None:
        lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, lambdas)]
    else:
        lrs = [g["lr"] for g in fresh["groups"]]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() (the logged LR) returns until the next step
