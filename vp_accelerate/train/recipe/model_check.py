"""Checks of the model a recipe names, before launch: a hub model that cannot be had offline, LoRA targets that
name no module of the model's decoder layers.

A hub id is looked up in the local HF cache first (what an offline run can use); with `HF_HUB_OFFLINE=1`
and nothing cached that is an error naming `model.source`, not a `LocalEntryNotFoundError` inside every rank.
LoRA targets are matched as peft matches them (a name, or a dotted suffix of a module's name) against the
linear modules of one decoder layer built on the meta device (no weights), and a target that matches
nothing is an error listing the names there are. peft itself only fails when no target matches at all,
so `[q_proj, v_prj]` would silently adapt half of what was asked.
"""

from __future__ import annotations

import copy
import difflib
import os

import torch
from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from vp_accelerate.models.adapter import find_parts
from vp_accelerate.models.lora import target_modules_for

from .convert import RecipeError
from .presets import PRESETS, local_model_dir


def hub_offline() -> bool:
    """Whether the hub may not be reached (HF_HUB_OFFLINE, read now: tests and users set it late)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def hub_snapshot(source: str) -> str | None:
    """The local HF-cache snapshot dir of hub repo `source` when its config.json is cached, else None."""
    try:
        path = try_to_load_from_cache(source, "config.json")
    except ValueError:  # not a valid repo id (HFValidationError)
        return None
    return os.path.dirname(path) if isinstance(path, str) else None


def missing_hub_source(key: str, source: str) -> RecipeError:
    """The error for a hub id that is neither cached nor reachable."""
    return RecipeError(
        f"{key}: {source!r} is not a preset, a local directory, nor a model in the local HF cache, "
        f"and the hub is offline (HF_HUB_OFFLINE=1); fix the name, point {key} at a local checkpoint "
        f"directory, or download it once with the hub reachable (huggingface-cli download {source})"
    )


def valid_repo_id(source: str) -> bool:
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def config_source(source: str) -> str:
    """Where the config of model `source` is read from without a download: a preset's name, else `model_dir`'s
    directory, else the hub id itself (its config from the hub)."""
    return source if source in PRESETS else model_dir(source, download=False) or source


def model_dir(source: str, *, download: bool, key: str = "model.source") -> str | None:
    """The directory model `source` (not a preset) is read from, the one resolver of `--check`, `plan`, `dryrun`
    and the trainer: a local directory as it is; a hub id's snapshot in the local HF cache, or with `download` its
    files fetched (config, safetensors, tokenizer: `presets.local_model_dir`, on one process first). None: a hub id
    not cached, without `download` (its config is then read from the hub, or a launched rank leaves it to rank 0).
    RecipeError naming `key` and the fix: a preset's typo (a did-you-mean), a name that is no hub id, a hub id
    neither cached nor reachable (HF_HUB_OFFLINE=1), a download that fails."""
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return path
    hint = difflib.get_close_matches(source, list(PRESETS), n=1, cutoff=0.8)
    if hint and "/" not in source:  # a typo of a preset would otherwise become a hub download attempt
        raise RecipeError(f"{key}: {source!r} is not a preset (did you mean {hint[0]}?) nor a local directory")
    if not valid_repo_id(source):
        raise RecipeError(
            f"{key}: {source!r} is not a preset, a local directory nor a hub id (presets: {', '.join(PRESETS)})"
        )
    cached = hub_snapshot(source)  # what an offline run can use
    if cached is None and hub_offline():
        raise missing_hub_source(key, source)
    if not download:
        return cached
    try:
        return local_model_dir(source)
    except (OSError, ValueError) as e:  # huggingface_hub: not found, offline, gated
        raise RecipeError(
            f"{key}: cannot get {source!r}: {str(e).splitlines()[0]}; fix {key} or point it at a local checkpoint "
            f"directory"
        ) from None


def _linear_names(layer) -> list[str]:
    return [name for name, m in layer.named_modules() if name and isinstance(m, (nn.Linear, Conv1D))]


def decoder_layer_modules(config) -> list[str]:
    """The names of the linear modules of one decoder layer of `config`'s model (built on the meta device)."""
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    for key in ("layer_types",):  # per-layer lists must match the layer count
        if isinstance(getattr(one, key, None), list):
            setattr(one, key, getattr(one, key)[:1])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one)
    return _linear_names(find_parts(model).layers[0])


def _matches(target: str, name: str) -> bool:
    return name == target or name.endswith("." + target)


def check_adapter_targets(recipe, config) -> str | None:
    """A RecipeError naming `adapter.target_modules` when a target matches no linear module of a decoder layer;
    else a note naming what is adapted (None without an adapter)."""
    a = recipe.adapter
    if not a.enabled:
        return None
    try:
        targets = target_modules_for(config, a.target_modules)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    try:
        names = decoder_layer_modules(config)
    except Exception as e:  # noqa: BLE001 - a model this cannot build on meta is checked at launch instead
        return f"adapter targets {targets} not checked before launch ({type(e).__name__}: {e})"
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    for target in targets:
        if not any(_matches(target, n) for n in names):
            hint = difflib.get_close_matches(target.rsplit(".", 1)[-1], leaves, n=1)
            more = f"did you mean {hint[0]}? " if hint else ""
            raise RecipeError(
                f"adapter.target_modules: {target!r} matches no module of the model's decoder layers; "
                f"{more}(linear modules of a {config.model_type} decoder layer: {', '.join(names)})"
            )
    adapted = sorted(n for n in names if any(_matches(t, n) for t in targets))
    return f"LoRA adapters on {', '.join(adapted)} of every decoder layer"
