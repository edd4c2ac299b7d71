"""Every import of every module keeps the layer order docs/ARCHITECTURE.md states: a package imports only
packages on its own line of the layer diagram or below it, and inside train/ a folder imports only the
folders after it in `cli -> run -> persist -> tokens -> data -> recipe`. The order is read from the page itself, so
the page and the code cannot drift apart. (tests/test_cost_layout.py checks the narrower case that the
runtime never loads the simulator at run time.) Imports inside functions count too: a lazy import is
still a dependency."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vp_accelerate"
PAGE = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def _package_levels() -> dict[str, int]:
    """Top-level package or module -> its level (higher imports lower), from the layer diagram."""
    block = PAGE.split("## The layers", 1)[1].split("```", 2)[1]
    lines = [ln for ln in block.strip().splitlines() if ln.strip()]
    levels = {}
    for i, line in enumerate(lines):
        names = re.match(r"^(\S+(?:, \S+)*)\s{2,}", line).group(1)
        for name in names.split(","):
            levels[name.strip().rstrip("/").removesuffix(".py")] = len(lines) - i
    return levels


def _train_levels() -> dict[str, int]:
    chain = re.search(r"dependencies point `([a-z ->]+)`", PAGE).group(1).split(" -> ")
    return {name: len(chain) - i for i, name in enumerate(chain)}


def _imports(path: Path) -> list[str]:
    """Absolute names of the vp_accelerate modules (or names) `path` imports, anywhere in it."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]  # a relative import's base (an __init__'s own package is its folder too)
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names += [f"{mod}.{a.name}" for a in node.names]
    return [n for n in names if n.startswith("vp_accelerate.")]


def _violations(level_of, where) -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = where(path.relative_to(PACKAGE).parts)
        if own not in level_of:
            continue
        for name in _imports(path):
            other = where(tuple(name.split(".")[1:]))
            if other in level_of and other != own and level_of[other] > level_of[own]:
                bad.append(f"{path.relative_to(ROOT)} ({own}) imports {name} ({other}, a layer above)")
    return bad


def test_packages_import_only_layers_below():
    levels = _package_levels()
    assert {"cli", "train", "runtime", "sim", "cost", "models", "schedule", "vocab"} <= set(levels)
    top = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if not p.name.startswith("_")} - {"py.typed"}
    assert top - {"__pycache__"} <= set(levels), "a package missing from ARCHITECTURE.md's layer diagram"
    assert _violations(levels, lambda parts: parts[0].removesuffix(".py") if parts else None) == []


def test_train_folders_import_only_folders_after_them():
    levels = _train_levels()
    folders = {p.name for p in (PACKAGE / "train").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - set(levels) == set(), "a train/ folder missing from ARCHITECTURE.md's chain (so unchecked)"
    where = lambda parts: parts[1].removesuffix(".py") if len(parts) > 2 and parts[0] == "train" else None  # noqa: E731
    assert _violations(levels, where) == []
