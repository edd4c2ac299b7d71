"""Reading a recipe: YAML (safe_load) plus `--set key.path=value` overrides into a checked `Recipe`, and back to a
plain dict (wandb config, checkpoints). The generic dict <-> dataclass conversion is `convert.py`."""

from __future__ import annotations

import os
import re

import yaml

from .checks import check
from .convert import RecipeError, from_dict, set_override, to_dict
from .schema import Recipe

REMOVED_KEYS = {
    "train.precision": "set pipeline.mixed_precision: bf16 (bf16 compute, fp32 master weights), pure-bf16 "
    "(bf16 parameters and AdamW state) or no (fp32)",
}
"""Keys earlier recipes had -> what to set instead (a recipe that sets one fails at load, saying so)."""


def _check_removed(data: dict, overrides) -> None:
    """A removed key, in the recipe or in an override, is a one-line RecipeError naming its replacement."""
    for key, instead in REMOVED_KEYS.items():
        section, name = key.split(".")
        in_data = isinstance(data.get(section), dict) and name in data[section]
        if in_data or any(str(item).split("=", 1)[0].strip() == key for item in overrides):
            raise RecipeError(f"{key} was removed: {instead}")


def recipe_from_dict(data: dict, overrides: list[str] = ()) -> Recipe:
    """Build and validate a Recipe from a plain dict plus `key.path=value` overrides."""
    _check_removed(data, overrides)
    recipe = from_dict(Recipe, data, path="")
    for item in overrides:
        set_override(recipe, item)
    return check(recipe)


MAX_RECIPE_VALUES = 100_000
"""Values a recipe may hold once its YAML aliases are expanded: real recipes hold a few hundred; a file whose
aliases multiply past this (a "billion laughs" file) is refused before anything is expanded."""


def _expanded_size(root, path: str) -> int:
    """How many values the YAML node graph `root` becomes once aliases are expanded, counted over the graph
    (each node once, its size remembered), so an alias bomb is measured without being expanded."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    while stack:  # post-order without recursion: a deeply nested file must not exhaust the stack here either
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = []
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        if not done:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        sizes[id(node)] = min(1 + sum(sizes.get(id(c), 1) for c in children), MAX_RECIPE_VALUES + 1)
    total = sizes[id(root)]
    if total > MAX_RECIPE_VALUES:
        raise RecipeError(
            f"{path}: its YAML aliases (&name / *name) expand to more than {MAX_RECIPE_VALUES:,} values; a recipe "
            f"holds a few hundred: write the repeated values out instead of nesting aliases"
        )
    return total


def _safe_load(f, path: str):
    """yaml.safe_load, with the node graph measured (`_expanded_size`) before any alias is expanded."""
    loader = yaml.SafeLoader(f)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_recipe(path: str, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe (yaml.safe_load), apply overrides, validate. Raises RecipeError."""
    if os.path.isdir(path):
        raise RecipeError(
            f"recipe file {path!r} is a directory; name a YAML file (e.g. {os.path.join(path, 'recipe.yaml')})"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = _safe_load(f, path) or {}
    except FileNotFoundError:
        raise RecipeError(f"recipe file {path!r} not found") from None
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: invalid YAML: {e}") from None
    except RecursionError:  # PyYAML's composer recurses per nesting level
        raise RecipeError(f"{path}: nested deeper than a YAML reader allows; a recipe is a few levels deep") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    return recipe_from_dict(data, overrides)


def recipe_to_dict(recipe: Recipe) -> dict:
    """Plain nested dict (for wandb config and checkpoints)."""
    return to_dict(recipe)


def key_lines(path: str) -> dict[str, int]:
    """key.path -> the 1-based line of the recipe file where it is written (YAML node marks); {} when the file
    cannot be read as YAML (that error names its own line)."""
    try:
        with open(path) as f:
            root = yaml.compose(f)
        _expanded_size(root, path)  # the walk below follows aliases: not through a bomb
    except (OSError, yaml.YAMLError, RecursionError, RecipeError):
        return {}
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = f"{prefix}.{key.value}" if prefix else str(key.value)
                lines[name] = key.start_mark.line + 1
                walk(value, name)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[f"{prefix}[{i}]"] = item.start_mark.line + 1
                walk(item, f"{prefix}[{i}]")

    walk(root, "")
    return lines


def where(path: str, message: str, overrides=()) -> str:
    """Where the key an error message starts with was set: "(--set KEY=...)", "(PATH, line N)" for the
    deepest part of it the file writes, or "(PATH)" when the file does not write it (a default)."""
    key = message.split(":", 1)[0].strip()
    if not re.fullmatch(r"[\w.\[\]-]+", key):  # not a key path ("recipe file ... not found")
        return f"(recipe {path})"
    for item in overrides:
        name = str(item).split("=", 1)[0].strip()
        if name == key or key.startswith(name + ".") or name.startswith(key + "."):
            return f"(--set {item})"
    lines = key_lines(path)
    parts = key
    while parts:
        if parts in lines:
            return f"({path}, line {lines[parts]})"
        parts = re.sub(r"(\[\d+\]|\.?[^.\[]+)$", "", parts)  # one level up
    return f"(recipe {path})"
