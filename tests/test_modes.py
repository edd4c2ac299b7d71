"""The mode tables (vp_accelerate/modes.py) are the one list of precision, output-layer memory and
activation-checkpointing modes: every name is accepted by the recipe and by PipelineConfig, an unknown one is
refused with the valid names, the removed `train.precision` says what replaces it, and `setup` resolves the
precision and the checkpoint dir into a new recipe, leaving the caller's as it was."""

from __future__ import annotations

import json
import typing

import pytest

from vp_accelerate import modes
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.train.recipe import RecipeError, recipe_from_dict, recipe_to_dict

TABLES = {
    "mixed_precision": modes.PRECISIONS,
    "memory": modes.MEMORY_MODES,
    "activation_checkpointing": modes.CHECKPOINTING,
}


def _recipe(tmp_path, **pipeline) -> dict:
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    return {"data": {"files": [str(tmp_path / "d.jsonl")]}, "tokenizer": {"source": "org/tok"}, "pipeline": pipeline}


def test_the_config_types_are_the_tables_keys():
    hints = typing.get_type_hints(PipelineConfig)
    for field, table in TABLES.items():
        tp = hints[field]
        if typing.get_origin(tp) is not typing.Literal:  # Optional[Literal[...]]
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        assert typing.get_args(tp) == tuple(table), field
        assert all(entry.name == name for name, entry in table.items())


@pytest.mark.parametrize("field, name", [(f, n) for f, table in TABLES.items() for n in table])
def test_every_mode_is_accepted_in_any_case(tmp_path, field, name):
    assert getattr(PipelineConfig(**{field: name.upper()}), field) == name
    assert getattr(recipe_from_dict(_recipe(tmp_path, **{field: name.upper()})).pipeline, field) == name
    assert getattr(recipe_from_dict(_recipe(tmp_path), [f"pipeline.{field}={name}"]).pipeline, field) == name


@pytest.mark.parametrize("field", list(TABLES))
def test_an_unknown_mode_is_refused_with_the_valid_names(tmp_path, field):
    names = ", ".join(TABLES[field])
    with pytest.raises(ValueError, match=f"^{field}: unknown value 'bogus'; choose one of {names}$"):
        PipelineConfig(**{field: "bogus"})
    cfg = PipelineConfig()
    setattr(cfg, field, "bogus")  # set after construction: check() refuses it before anything runs
    with pytest.raises(ValueError, match=f"^{field}: unknown value 'bogus'"):
        cfg.check()
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(_recipe(tmp_path, **{field: "bogus"}))
    assert str(e.value).startswith(f"pipeline.{field}: expected one of ")
    assert all(repr(n) in str(e.value) for n in TABLES[field])


def test_a_close_name_gets_a_hint():
    with pytest.raises(modes.ModeError, match="did you mean 'pure-bf16'"):
        modes.precision("pure_bf16")
    with pytest.raises(modes.ModeError, match="did you mean 'selective'"):
        modes.checkpointing("selectiv")


@pytest.mark.parametrize(
    "data, overrides",
    [({"train": {"precision": "bf16"}}, []), ({}, ["train.precision=fp32"])],
)
def test_train_precision_was_removed(tmp_path, data, overrides):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({**_recipe(tmp_path), **data}, overrides)
    message = str(e.value)
    assert message.startswith("train.precision was removed: set pipeline.mixed_precision: bf16") and "\n" not in message
    assert "pure-bf16" in message


def test_what_each_mode_implies():
    p = modes.PRECISIONS
    assert [n for n, e in p.items() if e.master_weights] == ["bf16", "fp16"]
    assert [n for n, e in p.items() if e.loss_scaling] == ["fp16"]
    assert p["pure-bf16"].param_dtype == "bfloat16" and not p["pure-bf16"].accelerate
    assert [n for n, e in modes.MEMORY_MODES.items() if e.keeps_logits] == ["store"]
    # the cost model counts exactly the layers a chunk checkpoints
    from vp_accelerate.cost.costs import CostModel
    from vp_accelerate.cost.shape import ModelShape

    shape = ModelShape(hidden=64, layers=5, heads=4, ffn=128, vocab=97, seq=16)
    for name, entry in modes.CHECKPOINTING.items():
        for n in range(6):
            want = {"none": [], "full": list(range(n)), "selective": list(range(0, n, 2))}[name]
            assert list(entry.layers(n)) == want, (name, n)
            model = CostModel(shape, "vocab-2", (0,), (n,), activation_checkpointing=name)
            assert model.checkpointed_layers(0) == len(want)


def _setup_and_compare(recipe):
    """setup() under accelerate's --mixed_precision bf16; the caller's recipe before and after, and what ran."""
    import os

    from vp_accelerate.train.run.trainer import setup

    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"  # what `accelerate launch --mixed_precision bf16` sets
    before = recipe_to_dict(recipe)
    run = setup(recipe)
    try:
        ran = run.recipe
        dtypes = {str(p.dtype) for p in run.pipe.parameters()}
        return (
            before == recipe_to_dict(recipe),
            ran is not recipe,
            ran.pipeline.mixed_precision,
            ran.checkpoint.dir,
            ran.train.steps,
            run.recipe_dict["pipeline"]["mixed_precision"],
            dtypes,
            str(run.pipe.compute_dtype),
        )
    finally:
        run.tracker.finish()
        run.pipe.close()


def test_setup_leaves_the_callers_recipe_unchanged(tmp_path, monkeypatch):
    from helpers.tiny import bpe
    from helpers.tiny import recipe as tiny_recipe
    from vp_accelerate.distributed import spawn

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))  # the spawned rank inherits it
    words = "alpha beta gamma delta paris france".split()
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": " ".join(words[(i + k) % 6] for k in range(12))}) + "\n")
    bpe([tmp_path / "train.jsonl"], tmp_path)
    recipe = recipe_from_dict(
        tiny_recipe(
            tmp_path / "tok",
            [tmp_path / "train.jsonl"],
            model={"config": {"hidden_size": 32, "intermediate_size": 64}},
            data={"seq_len": 16},
            pipeline={"microbatches": 2},
            train={"epochs": 1, "global_batch": 4},
            eval={"batches": 0},
            logging={"output_dir": str(tmp_path / "out")},
        )
    )
    assert recipe.pipeline.mixed_precision is None and recipe.checkpoint.dir is None and recipe.train.steps is None
    (unchanged, new, mode, cdir, steps, logged, dtypes, compute) = spawn(_setup_and_compare, 1, recipe)[0]
    assert unchanged and new
    assert mode == logged == "bf16"  # accelerate's flag, and the logged recipe says so
    assert cdir == str(tmp_path / "out" / "checkpoints") and steps >= 1
    assert dtypes == {"torch.float32"} and compute == "torch.bfloat16"  # fp32 master weights, bf16 compute
    assert recipe.pipeline.mixed_precision is None and recipe.train.steps is None  # the parent's copy too
