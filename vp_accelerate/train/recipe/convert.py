"""Plain dicts <-> nested dataclasses, with errors that name the key path.

Supported field types: str, int, float, bool, dict, list[T], tuple[T, ...], Optional[T] (or `T | None`),
Literal[...], and nested dataclasses. That is all a recipe needs, and keeping it this small keeps the errors precise.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal, Union

import yaml


class RecipeError(ValueError):
    """A recipe problem; the message starts with the key path it concerns. `problems`: every problem found in one
    pass over the recipe (the message names the first's path, then each of the others after `; also `)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]

    @classmethod
    def of(cls, problems: list[str]) -> "RecipeError":
        """One error saying every problem (a recipe with nine wrong keys is fixed in one round, not nine)."""
        if len(problems) == 1:
            return cls(problems[0])
        return cls(f"{problems[0]}; also {'; also '.join(problems[1:])} ({len(problems)} problems)", problems)


def unknown_key(path: str, name: str, names: list[str]) -> RecipeError:
    """The error for key `name` at `path`: another tool's name for a key (schema.KEY_ALIASES) points at
    ours, else the same key in another section (`label_smoothing` at the top is preference.label_smoothing),
    else the closest known name, else the known names."""
    from .schema import KEY_ALIASES, KEY_NOTES, Recipe  # the recipe's own tables; this module converts any dataclass

    ours = KEY_ALIASES.get(name)
    if ours is not None:  # an unknown key here, so never the key it names
        note = KEY_NOTES.get(name, f"{name} is its name in transformers/TRL")
        return RecipeError(f"{path}: unknown key; did you mean {ours}? ({note})")
    sections = [f.name for f in dataclasses.fields(Recipe)]
    elsewhere = [f"{sec}.{name}" for sec in sections if name in _section_fields(sec) and not path.startswith(sec + ".")]
    if elsewhere:
        return RecipeError(f"{path}: unknown key here; did you mean {' or '.join(elsewhere)}?")
    hint = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    more = f"; did you mean {hint[0]}?" if hint else f"; known keys: {', '.join(names)}"
    return RecipeError(f"{path}: unknown key{more}")


def _value_note(path: str, value) -> str:
    """Another tool's value for the key at `path` (schema.VALUE_NOTES: TRL's `alphapo`): how to write it here."""
    from .schema import VALUE_NOTES

    note = VALUE_NOTES.get((path, value)) if isinstance(value, str) else None
    return f" ({note})" if note else ""


_SECTIONS: dict[str, list[str]] = {}


def _section_fields(section: str) -> list[str]:
    """The keys of the recipe's section `section` (cached)."""
    if section not in _SECTIONS:
        from .schema import Recipe

        cls = typing.get_type_hints(Recipe).get(section)
        _SECTIONS[section] = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    return _SECTIONS[section]


# PyYAML follows YAML 1.1, where `1e-3` (no dot) is a *string*. Accept such strings for float
# fields, since every user writes learning rates that way; anything else of the wrong type is an error.
_FLOAT_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _is_union(tp) -> bool:
    """Optional[T] and `T | None` (a types.UnionType when a module writes the PEP 604 form)."""
    return typing.get_origin(tp) in (Union, types.UnionType)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def convert(tp, value: Any, path: str) -> Any:
    """Check/convert one value to type `tp`; raise RecipeError naming `path` if it does not fit."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a mapping (section), got {type(value).__name__} {value!r}")
        return from_dict(tp, value, path)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise RecipeError(f"{path}: expected {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, path)
            except RecipeError as e:
                errors.append(str(e))
        message = errors[0] if len(errors) == 1 else f"{path}: expected {_type_name(tp)}, got {value!r}"
        raise RecipeError(message + _value_note(path, value))
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) and value not in allowed:  # names are case-insensitive: "1F1B", "Vocab-2"
            value = next((a for a in allowed if isinstance(a, str) and a.lower() == value.lower()), value)
        if value not in allowed:
            hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            more = f"; did you mean {hint[0]!r}?" if hint else ""
            raise RecipeError(f"{path}: expected {_type_name(tp)}, got {value!r}{more}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:  # only the homogeneous tuple[T, ...]; written as a list in YAML
        item, dots = typing.get_args(tp)
        if dots is not Ellipsis:
            raise TypeError(f"{path}: unsupported field type {tp!r}")  # a bug in the recipe definition
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return tuple(convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{path}: expected bool (true/false), got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{path}: expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise RecipeError(f"{path}: expected float, got bool {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
        raise RecipeError(f"{path}: expected float, got {type(value).__name__} {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{path}: expected str, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"{path}: unsupported field type {tp!r}")  # a bug in the recipe definition


def from_dict(cls, data: dict, path: str = ""):
    """Build dataclass `cls` from `data`; unknown keys are errors with a closest-name hint."""
    if not isinstance(data, dict):
        raise RecipeError(f"{path or 'recipe'}: expected a mapping, got {type(data).__name__}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs, problems = {}, []
    for key, value in data.items():  # every key's problem, nested sections' included, before raising
        key_path = _join(path, str(key))
        if key not in names:
            problems.append(str(unknown_key(key_path, str(key), names)))
            continue
        try:
            kwargs[key] = convert(hints[key], value, key_path)
        except RecipeError as e:
            problems += e.problems
    if problems:
        raise RecipeError.of(problems)
    return cls(**kwargs)


def to_dict(obj) -> Any:
    """Plain dicts, lists and scalars (tuples become lists), safe for YAML, JSON and wandb."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _parse_scalar(tp, text: str, path: str) -> Any:
    """Parse the text of an override for a field of type `tp`."""
    if _is_union(tp) and text.strip().lower() in ("null", "none", "~"):
        return None
    base = tp
    if _is_union(tp):
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        base = non_none[0] if len(non_none) == 1 else tp
    if base is str or (typing.get_origin(base) is Literal and all(isinstance(a, str) for a in typing.get_args(base))):
        return text  # keep strings verbatim: `--set model.source=007` must not become an int
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: cannot parse {text!r}: {e}") from None


def _yaml_value(text: str, key: str):
    """An override's value read as YAML (safe_load: plain data only); RecipeError naming the key when it is not."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise RecipeError(
            f"--set {key}: {text!r} is not a YAML value ({problem}); quote it or fix its brackets"
        ) from None


def set_override(recipe, item: str) -> None:
    """Apply one `key.path=value` override in place, typed by the field it sets."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected key.path=value")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    obj, path = recipe, ""
    for i, name in enumerate(parts):
        path = _join(path, name)
        names = [f.name for f in dataclasses.fields(obj)]
        if name not in names:
            raise unknown_key(path, name, names)
        tp = _hints(type(obj))[name]
        if i == len(parts) - 1:
            if tp is dict:
                value = _yaml_value(text, path)
                if not isinstance(value, dict):
                    raise RecipeError(f"--set {path}: expects a mapping such as {{hidden_size: 256}}, got {text!r}")
            else:
                value = _parse_scalar(tp, text, path)
            setattr(obj, name, convert(tp, value, path))
            return
        child = getattr(obj, name)
        if tp is dict:
            # model.config.hidden_size=256: set one entry of a free-form dict
            sub = child
            for sub_name in parts[i + 1 : -1]:
                sub = sub.setdefault(sub_name, {})
                if not isinstance(sub, dict):
                    raise RecipeError(f"--set {key.strip()}: {sub_name} holds a value, not a mapping")
            sub[parts[-1]] = _yaml_value(text, key.strip())
            return
        if not dataclasses.is_dataclass(child):
            raise RecipeError(f"{path}: is a value ({_type_name(tp)}), not a section")
        obj = child
