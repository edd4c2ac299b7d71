"""The docs that list what the code has are checked against it: the recipe key table of docs/recipes.md (made
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
TRAINING = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")


def test_the_recipe_key_table_is_made_from_the_current_dataclasses():
    assert reference.rewrite(TRAINING) == TRAINING, (
        "docs/recipes.md's recipe key table is out of date: python -m vp_accelerate.train.recipe.reference "
        "docs/recipes.md"
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


# the repository's own top-level names (not outputs/ or a venv a run left behind)
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {"outputs", "wheels", "wandb"}
EXTENSIONS = {"py", "md", "sh", "yaml", "yml", "json", "jsonl", "toml", "txt", "png", "cfg", "safetensors"}
INNER = {p.name for p in (ROOT / "vp_accelerate").iterdir() if p.is_dir() and not p.name.startswith("_")}
INNER |= {p.name for p in (ROOT / "vp_accelerate" / "train").iterdir() if p.is_dir() and not p.name.startswith("_")}


def _backticked_paths(text: str) -> set[str]:
    """Paths in backticks that start at the repository (`docs/x.md`, `scripts/`) or inside the package
    (`train/run/`, `runtime/p2p.py`): a user's own paths (`path/to/dir`, `OUT/`) start elsewhere."""
    found = set()
    for token in re.findall(r"`([\w./-]+)`", text):
        first = token.split("/", 1)[0]
        # `train/loss` is a metric and `runtime/groups.warm_up` a function, not paths
        shaped = token.endswith("/") or token.rsplit(".", 1)[-1] in EXTENSIONS
        if "/" in token and shaped and (first in TOP or first in INNER) and "*" not in token and "..." not in token:
            found.add(token)
    return found


def _exists(path: str) -> bool:
    bases = [ROOT, ROOT / "vp_accelerate", ROOT / "vp_accelerate" / "train"]
    return any((base / path).exists() for base in bases)


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_folders_and_files_in_backticks_exist(doc):
    """Every backticked path or folder a doc names (`train/persist/`, `scripts/gpu_check.sh`, `docs/gpus.md`)
    exists, so a moved folder leaves no stale name (README once named `checkpoint/` after it became `persist/`)."""
    text = (ROOT / doc if doc == "README.md" else ROOT / "docs" / doc).read_text(encoding="utf-8")
    missing = sorted(p for p in _backticked_paths(text) if not _exists(p))
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_a_stale_folder_name_fails_the_backtick_check():
    assert _backticked_paths("the `checkpoint/` folder and `path/to/hf_dir`") == set()  # neither is ours
    assert _backticked_paths("`train/checkpoint/` and `train/persist/`") == {"train/checkpoint/", "train/persist/"}
    assert not _exists("train/checkpoint/") and _exists("train/persist/")


def _package_inits() -> list[Path]:
    return sorted(p for p in (ROOT / "vp_accelerate").rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("init", _package_inits(), ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_package_docstrings_name_files_that_exist(init):
    """A package's opening docstring names its modules by file (`world.py`, `persist/store.py`): each exists in
    the package (or relative to vp_accelerate/), so a renamed module is not described under its old name."""
    import ast

    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    named = set(re.findall(r"(?<![\w.])([\w/]+\.py)\b", doc))
    missing = sorted(n for n in named if not any((b / n).exists() for b in [init.parent, *init.parent.parents][:5]))
    assert not missing, f"{init.relative_to(ROOT)} names files that do not exist: {missing}"


def test_architecture_names_every_module_of_each_train_folder():
    """train/'s table in ARCHITECTURE.md names each folder's modules, so a newcomer finds every file's job there."""
    folders = ARCHITECTURE.split("### train/", 1)[1].split("\n## ", 1)[0]
    missing = []
    for row in re.findall(r"^\| `train/([a-z_]+)/` \|([^\n]*)$", folders, flags=re.M):
        name, text = row
        for module in sorted((ROOT / "vp_accelerate" / "train" / name).glob("*.py")):
            if module.name != "__init__.py" and f"`{module.name}`" not in text:
                missing.append(f"train/{name}/{module.name}")
    assert not missing, f"ARCHITECTURE.md's train/ table does not name: {missing}"


def test_readme_layer_table_names_every_package_and_train_folder():
    """README's layer table: one row per package, and the trainer row names train/'s folders as they are today."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| layer | package | what it holds |", 1)[1].split("\n\n", 1)[0]
    packages = set(re.findall(r"^\| [^|]+ \| `vp_accelerate/([a-z_]+)/` \|", table, flags=re.M))
    assert packages == _packages(vp_accelerate.__path__), "README's layer table and vp_accelerate/ differ"
    trainer = next(row for row in table.splitlines() if "`vp_accelerate/train/`" in row).split("|")[3]
    folders = set(re.findall(r"`([a-z_]+)/`", trainer))
    assert folders == _packages([str(ROOT / "vp_accelerate" / "train")]), "README's trainer row and train/ differ"


def test_every_doc_page_is_linked_from_the_readme_and_walkable():
    """A newcomer reaches every page from the README, and no page is longer than 700 lines (split by topic)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"
        assert page.read_text(encoding="utf-8").count("\n") <= 700, f"docs/{page.name} is over 700 lines: split it"
