"""Recipe validation: errors name the key path; overrides are typed by the field; shipped recipes load."""

import glob
import json
import os
import subprocess
import sys

import pytest

from vp_accelerate.train.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict, recipe_to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    return str(path)


def base(corpus, **sections):
    data = {"data": {"files": [corpus]}, "tokenizer": {"source": "qwen"}}
    for k, v in sections.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return data


def test_defaults_and_roundtrip(corpus):
    r = recipe_from_dict(base(corpus))
    assert isinstance(r, Recipe) and r.pipeline.method == "vocab-2" and r.data.files == [corpus]
    assert recipe_from_dict(recipe_to_dict(r)) == r


@pytest.mark.parametrize("sections, message", [
    ({"pipeline": {"microbatchs": 4}}, "pipeline.microbatchs: unknown key; did you mean microbatches?"),
    ({"optimzer": {}}, "optimzer: unknown key; did you mean optimizer?"),
    ({"pipeline": {"microbatches": "8"}}, "pipeline.microbatches: expected int, got str '8'"),
    ({"pipeline": {"microbatches": 2.5}}, "pipeline.microbatches: expected int"),
    ({"pipeline": {"method": "vocab2"}}, "pipeline.method: expected one of"),
    ({"train": {"precision": "fp16"}}, "train.precision: expected one of 'fp32', 'bf16', got 'fp16'"),
    ({"data": {"packing": "yes"}}, "data.packing: expected bool"),
    ({"optimizer": {"betas": [0.9, "x"]}}, "optimizer.betas[1]: expected float"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr: expected float, got str 'fast'"),
    ({"pipeline": {"chunk_size": "big"}}, "pipeline.chunk_size: expected int"),
    ({"train": {"global_batch": 10}, "pipeline": {"microbatches": 4}}, "train.global_batch: the per-replica batch 10"),
    ({"train": {"global_batch": 16}, "pipeline": {"dp_size": 3}}, "train.global_batch: 16 is not divisible by pipeline.dp_size=3"),
    ({"train": {"steps": 0}}, "train.steps: must be >= 1"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected two values"),
    ({"data": {"files": ["/nonexistent/*.jsonl"]}}, "data.files: no file matches"),
    ({"tokenizer": {"source": "bpe:/nonexistent/tok"}}, "tokenizer.source: '/nonexistent/tok' has no tokenizer.json"),
    ({"model": {"source": "./no/such/dir"}}, "model.source: directory './no/such/dir' does not exist"),
    ({"data": {"hub_id": "some/dataset"}}, "data: set exactly one of data.files"),
    ({"data": {"streaming": True, "packing": False}}, "data.packing: false is not supported with data.streaming"),
    ({"train": "fast"}, "train: expected a mapping"),
])
def test_errors_name_the_key(corpus, sections, message):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(base(corpus, **sections))
    assert message in str(e.value)


def test_yaml11_float_strings_are_accepted(corpus):
    r = recipe_from_dict(base(corpus, optimizer={"lr": "1e-3", "eps": 1}))
    assert r.optimizer.lr == 1e-3 and isinstance(r.optimizer.eps, float)


def test_overrides_are_typed(corpus):
    r = recipe_from_dict(base(corpus), [
        "pipeline.microbatches=2", "optimizer.lr=1e-4", "pipeline.chunk_size=null", "data.packing=false",
        "optimizer.betas=[0.8, 0.9]", "model.source=007", "model.config.hidden_size=64",
        "logging.run_name=run 1", "train.global_batch=4"])
    assert r.pipeline.microbatches == 2 and r.optimizer.lr == 1e-4 and r.pipeline.chunk_size is None
    assert r.data.packing is False and r.optimizer.betas == [0.8, 0.9]
    assert r.model.source == "007" and r.model.config == {"hidden_size": 64} and r.logging.run_name == "run 1"


@pytest.mark.parametrize("item, message", [
    ("pipeline.microbatchs=4", "pipeline.microbatchs: unknown key; did you mean microbatches?"),
    ("pipeline.microbatches=four", "pipeline.microbatches: expected int, got str 'four'"),
    ("pipeline.method=vocab-3", "pipeline.method: expected one of"),
    ("pipeline=3", "pipeline: expected a mapping"),
    ("train.steps.x=3", "train.steps: is a value (int), not a section"),
    ("noequals", "expected key.path=value"),
])
def test_override_errors(corpus, item, message):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(base(corpus), [item])
    assert message in str(e.value)


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipeline: [1, 2\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(str(bad))
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(str(tmp_path / "missing.yaml"))
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="a recipe is a mapping"):
        load_recipe(str(bad))


def test_shipped_recipes_validate(corpus, tmp_path):
    """Every recipe in recipes/ is valid once its local inputs exist (pointed at stand-ins here)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    model = tmp_path / "model"
    model.mkdir()
    paths = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
    assert len(paths) >= 6
    for path in paths:
        r = load_recipe(path, [f"data.files=[{corpus}]", f"data.eval_files=[{corpus}]"]
                        + ([f"tokenizer.source=bpe:{tok}"] if "bpe:" in open(path).read() else [])
                        + ([f"model.source={model}", f"tokenizer.source={model}"]
                           if "./outputs" in open(path).read() else []))
        assert r.train.global_batch % (r.pipeline.dp_size * r.pipeline.microbatches) == 0, path


def test_bad_recipe_fails_before_any_process_group(tmp_path, corpus):
    """`vp-accelerate train` exits 2 with the key path, without initialising torch.distributed."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"data: {{files: [{corpus}]}}\ntokenizer: {{source: qwen}}\npipeline: {{microbatchs: 4}}\n")
    code = ("import sys, torch.distributed as dist\n"
            "from vp_accelerate.train.commands import train_main\n"
            f"rc = train_main([{str(bad)!r}])\n"
            "assert not dist.is_initialized()\n"
            "sys.exit(rc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "pipeline.microbatchs: unknown key; did you mean microbatches?" in out.stderr
