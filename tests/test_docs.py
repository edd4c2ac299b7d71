"""The docs that list what the code has are checked against it: the recipe key table of docs/training.md (made
from the dataclasses' field docstrings), the commands and packages of docs/ARCHITECTURE.md, and the README's
benchmark figures (written by scripts/readme_figures.py from one benchmark run). Each check is also shown to fail
when the code gains something the doc does not list."""

import dataclasses
import pkgutil
import re
from pathlib import Path

import pytest

import vp_accelerate
from vp_accelerate import cli
from vp_accelerate.train.recipe import DataSection, Recipe, reference

ROOT = Path(__file__).resolve().parents[1]
TRAINING = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")


def test_the_recipe_key_table_is_made_from_the_current_dataclasses():
    assert reference.rewrite(TRAINING) == TRAINING, (
        "docs/training.md's recipe key table is out of date: python -m vp_accelerate.train.recipe.reference "
        "docs/training.md"
    )


def test_every_recipe_key_has_a_docstring():
    missing = [key for key, _, _, doc in reference.rows() if not doc]
    assert not missing, f"recipe keys without a docstring under the field: {missing}"


def test_a_new_recipe_key_fails_the_doc_checks(monkeypatch):
    """A field added to a section (here `data.new_knob`, without a docstring) makes both checks fail."""

    @dataclasses.dataclass
    class Wider(DataSection):
        new_knob: int = 3

    fields = {f.name: f for f in dataclasses.fields(Recipe)}
    monkeypatch.setattr(fields["data"], "default_factory", Wider)
    keys = {key: doc for key, _, _, doc in reference.rows()}
    assert "data.new_knob" in keys and keys["data.new_knob"] == ""
    assert reference.rewrite(TRAINING) != TRAINING


def _documented_commands(text: str) -> set[str]:
    section = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z-]+)` \|", section, flags=re.M))


def test_architecture_lists_every_command(monkeypatch):
    assert _documented_commands(ARCHITECTURE) == set(cli.COMMANDS)
    monkeypatch.setitem(cli.COMMANDS, "new-command", ("m", "f", "a command added without its doc line"))
    assert _documented_commands(ARCHITECTURE) != set(cli.COMMANDS)


def _packages(root) -> set[str]:
    return {m.name for m in pkgutil.iter_modules(root) if m.ispkg}


def test_architecture_names_every_package_and_train_folder():
    top = _packages(vp_accelerate.__path__)
    train = _packages([str(ROOT / "vp_accelerate" / "train")])
    table = ARCHITECTURE.split("| package | holds |", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)/` \|", table, flags=re.M))
    assert listed == top, f"packages not in ARCHITECTURE.md's table: {top - listed}; gone: {listed - top}"
    folders = ARCHITECTURE.split("### train/", 1)[1].split("\n## ", 1)[0]
    listed_train = set(re.findall(r"^\| `train/([a-z_]+)/` \|", folders, flags=re.M))
    assert listed_train == train, f"train/ folders not in ARCHITECTURE.md: {train - listed_train}"


PACKAGES = "|".join(sorted(_packages(vp_accelerate.__path__)))


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_paths_named_in_the_docs_exist(doc):
    """Every module path a doc names (`vp_accelerate/train/run/loop.py`, or `train/run/loop.py` inside the package)
    exists: a moved or renamed module leaves no dangling path."""
    text = (ROOT / doc if doc == "README.md" else ROOT / "docs" / doc).read_text(encoding="utf-8")
    named = {m.group(1) for m in re.finditer(rf"(?<![\w/])(?:vp_accelerate/)?((?:{PACKAGES})/[\w/]+\.py)", text)}
    missing = sorted(p for p in named if not (ROOT / "vp_accelerate" / p).exists())
    assert not missing, f"{doc} names files that do not exist: {missing}"


def _readme_figures():
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_figures_say_what_the_benchmark_table_says():
    """README's "What it buys" is rendered from docs/benchmarks.md's table of one harness run; an edited number in
    either doc makes them differ."""
    figures = _readme_figures()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert figures.render() == readme, "README.md's figures are stale: python scripts/readme_figures.py render"
    rows, meta = figures.parse_table((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"))
    assert rows and {r["method"] for r in rows} >= {"peer", "1f1b-vocab-2"}
    vp = next(r for r in rows if r["method"] == "1f1b-vocab-2")
    vp["ratio"] += 1
    assert figures.figures(rows, meta) not in readme
