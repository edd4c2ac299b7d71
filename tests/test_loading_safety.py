"""Loading is safe: checkpoints never unpickle code, recipes never construct objects, NaN is never saved."""

import ast
import json
import os
import random
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "vp_accelerate")


def _sources():
    for base, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def test_every_torch_load_in_the_package_is_weights_only():
    """An AST walk, not a grep: every call to torch.load passes weights_only=True."""
    calls = []
    for rel, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                ok = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                calls.append((rel, node.lineno, ok))
    assert calls, "expected the checkpoint loader to call torch.load"
    assert [c for c in calls if not c[2]] == []


def test_yaml_is_only_read_with_safe_load():
    unsafe = [
        (rel, m.group(0))
        for rel, text in _sources()
        for m in re.finditer(r"yaml\.(load|unsafe_load|full_load|load_all)\(", text)
    ]
    assert unsafe == []
    assert any("yaml.SafeLoader(" in text for rel, text in _sources() if rel.endswith("recipe/load.py"))


def test_recipe_with_a_python_object_tag_is_refused(tmp_path):
    from vp_accelerate.train.recipe import RecipeError, load_recipe

    marker = tmp_path / f"pwned{random.randrange(10**6)}"
    path = tmp_path / "evil.yaml"
    path.write_text(f"train: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(str(path))
    assert not marker.exists()


class _Evil:
    """Unpickling this runs `touch <marker>` (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["optimizer.pt", "trainer_state.pt"])
def test_a_checkpoint_with_a_malicious_pickle_is_refused(tmp_path, victim):
    from safetensors.torch import save_file

    from vp_accelerate.train.persist import files
    from vp_accelerate.train.persist.store import load_rank

    marker = tmp_path / f"pwned{random.randrange(10**6)}"
    rdir = tmp_path / "step_00000001" / "rank_00000"
    rdir.mkdir(parents=True)
    save_file({"w": torch.randn(3, 3)}, str(rdir / "model.safetensors"))
    for name in ("optimizer.pt", "trainer_state.pt"):
        torch.save({"state": {}} if name != victim else {"state": _Evil(str(marker))}, str(rdir / name))
    # its files recorded as a real save records them (size and hash), so the load reaches the pickle itself
    names = ("model.safetensors", "optimizer.pt", "trainer_state.pt")
    (rdir / files.MANIFEST).write_text(json.dumps(files.record(str(rdir), names)))
    with pytest.raises(Exception, match="a pickle that would run code\\): refused"):
        load_rank(str(tmp_path / "step_00000001"), 0)
    assert not marker.exists(), "the pickle's code ran"


def test_weights_are_read_with_safetensors_not_pickle(tmp_path):
    """A pickle renamed model.safetensors is not executed either: safetensors refuses its header."""
    from vp_accelerate.train.persist.store import load_rank

    marker = tmp_path / "pwned"
    rdir = tmp_path / "ck" / "rank_00000"
    rdir.mkdir(parents=True)
    torch.save({"w": _Evil(str(marker))}, str(rdir / "model.safetensors"))
    with pytest.raises(Exception):
        load_rank(str(tmp_path / "ck"), 0)
    assert not marker.exists()


def test_nonfinite_tensors_are_found_in_nested_states():
    from vp_accelerate.train.run.nonfinite import nonfinite_tensors

    bad = random.choice([float("nan"), float("inf"), -float("inf")])
    w = torch.randn(4, 4)
    w[random.randrange(4), random.randrange(4)] = bad
    state = {
        "model.a": torch.randn(3),
        "model.b": w,
        "step": torch.tensor(3),
        "opt": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.tensor([1.0, bad])}},
    }
    assert nonfinite_tensors(state) == ["model.b", "opt.0.exp_avg_sq"]
    assert nonfinite_tensors({"a": torch.ones(2), "ids": torch.tensor([1, 2])}) == []


def test_no_checkpoint_is_written_with_nonfinite_weights_or_moments():
    """The guard `_save` runs before any file (single process here: the all-reduce degrades to the local flag)."""
    from vp_accelerate.train.run.nonfinite import NonFiniteError, check_weights_before_save

    step = random.randrange(1, 1000)
    w = torch.randn(3, 3)
    check_weights_before_save(step, {"w": w}, {"state": {0: {"exp_avg": torch.zeros(3)}}})  # finite: no error
    with pytest.raises(
        NonFiniteError,
        match=rf"refusing to write the checkpoint of step {step}: non-finite values "
        rf"in rank 0: optimizer.0.exp_avg; the previous checkpoint stays",
    ):
        check_weights_before_save(step, {"w": w}, {"state": {0: {"exp_avg": torch.tensor([float("inf")])}}})
    w[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="rank 0: w"):
        check_weights_before_save(step, {"w": w}, {"state": {}})
