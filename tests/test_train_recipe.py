"""Recipe validation: errors name the key path; overrides are typed by the field; shipped recipes load."""

import glob
import json
import os

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


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"pipeline": {"microbatchs": 4}}, "pipeline.microbatchs: unknown key; did you mean microbatches?"),
        ({"optimzer": {}}, "optimzer: unknown key; did you mean optimizer?"),
        ({"pipeline": {"microbatches": "8"}}, "pipeline.microbatches: expected int, got str '8'"),
        ({"pipeline": {"microbatches": 2.5}}, "pipeline.microbatches: expected int"),
        ({"pipeline": {"method": "vocab2"}}, "pipeline.method: expected one of"),
        (
            {"pipeline": {"mixed_precision": "fp8"}},
            "pipeline.mixed_precision: expected one of 'no', 'bf16', 'fp16', 'pure-bf16', got 'fp8'",
        ),
        ({"train": {"precision": "bf16"}}, "train.precision was removed: set pipeline.mixed_precision: bf16"),
        ({"data": {"packing": "yes"}}, "data.packing: expected bool"),
        ({"optimizer": {"betas": [0.9, "x"]}}, "optimizer.betas[1]: expected float"),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr: expected float, got str 'fast'"),
        ({"pipeline": {"chunk_size": "big"}}, "pipeline.chunk_size: expected int"),
        (
            {"train": {"global_batch": 10}, "pipeline": {"microbatches": 4}},
            "train.global_batch: 10 sequences do not split into pipeline.dp_size=1 replicas x "
            "pipeline.microbatches=4 equal microbatches (a multiple of 4); use 8 or 12",
        ),
        (
            {"train": {"global_batch": 16}, "pipeline": {"dp_size": 3}},
            "train.global_batch: 16 sequences do not split into pipeline.dp_size=3 replicas x "
            "pipeline.microbatches=8 equal microbatches (a multiple of 24); use 24,",
        ),
        ({"train": {"steps": 0}}, "train.steps: must be >= 1"),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected two values"),
        ({"data": {"files": ["/nonexistent/*.jsonl"]}}, "data.files: no file matches"),
        (
            {"data": {"eval_files": ["/nowhere/demo_chat/eval.jsonl"]}},
            "data.eval_files: no file matches '/nowhere/demo_chat/eval.jsonl'; make it with "
            "`python scripts/make_demo_chat.py --out /nowhere/demo_chat`",
        ),
        (
            {"tokenizer": {"source": "bpe:/nonexistent/tok"}},
            "tokenizer.source: '/nonexistent/tok' has no tokenizer.json",
        ),
        ({"model": {"source": "./no/such/dir"}}, "model.source: directory './no/such/dir' does not exist"),
        ({"data": {"hub_id": "some/dataset"}}, "data: set exactly one of data.files"),
        ({"data": {"streaming": True, "packing": False}}, "data.packing: false is not supported with data.streaming"),
        ({"train": "fast"}, "train: expected a mapping"),
    ],
)
def test_errors_name_the_key(corpus, sections, message):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(base(corpus, **sections))
    assert message in str(e.value)


def test_yaml11_float_strings_are_accepted(corpus):
    r = recipe_from_dict(base(corpus, optimizer={"lr": "1e-3", "eps": 1}))
    assert r.optimizer.lr == 1e-3 and isinstance(r.optimizer.eps, float)


def test_overrides_are_typed(corpus):
    r = recipe_from_dict(
        base(corpus),
        [
            "pipeline.microbatches=2",
            "optimizer.lr=1e-4",
            "pipeline.chunk_size=null",
            "data.packing=false",
            "optimizer.betas=[0.8, 0.9]",
            "model.source=007",
            "model.config.hidden_size=64",
            "logging.run_name=run 1",
            "train.global_batch=4",
        ],
    )
    assert r.pipeline.microbatches == 2 and r.optimizer.lr == 1e-4 and r.pipeline.chunk_size is None
    assert r.data.packing is False and r.optimizer.betas == [0.8, 0.9]
    assert r.model.source == "007" and r.model.config == {"hidden_size": 64} and r.logging.run_name == "run 1"


@pytest.mark.parametrize(
    "item, message",
    [
        ("pipeline.microbatchs=4", "pipeline.microbatchs: unknown key; did you mean microbatches?"),
        ("pipeline.microbatches=four", "pipeline.microbatches: expected int, got str 'four'"),
        ("pipeline.method=vocab-3", "pipeline.method: expected one of"),
        ("pipeline=3", "pipeline: expected a mapping"),
        ("train.steps.x=3", "train.steps: is a value (int or null), not a section"),
        ("noequals", "expected key.path=value"),
    ],
)
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
        out = tmp_path / "elsewhere" / os.path.basename(path)
        r = load_recipe(
            path,
            [f"data.files=[{corpus}]", f"data.eval_files=[{corpus}]", f"logging.output_dir={out}"]
            + ([f"tokenizer.source=bpe:{tok}"] if "bpe:" in open(path).read() else [])
            + ([f"model.source={model}", f"tokenizer.source={model}"] if "./outputs" in open(path).read() else []),
        )
        assert r.train.global_batch % (r.pipeline.dp_size * r.pipeline.microbatches) == 0, path
        # every output follows logging.output_dir: no recipe pins its checkpoints elsewhere
        assert r.checkpoint.dir is None and r.checkpoint.resolved_dir(str(out)) == str(out / "checkpoints"), path


def test_bad_recipe_fails_before_any_process_group(tmp_path, corpus):
    """`vp-accelerate train` exits 2 with the key path, without initialising torch.distributed. One plain process
    (no launcher variables) forked from the preloaded fork server: the same check as a fresh interpreter, whose
    torch import took seconds."""
    from helpers.launch import LAUNCHER_VARS, forked_ranks

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"data: {{files: [{corpus}]}}\ntokenizer: {{source: qwen}}\npipeline: {{microbatchs: 4}}\n")
    script = tmp_path / "train_bad.py"
    script.write_text(
        "import os, sys, torch.distributed as dist\n"
        f"for name in {LAUNCHER_VARS!r}:\n"
        "    os.environ.pop(name, None)\n"
        "from vp_accelerate.train.cli.commands import train_main\n"
        f"rc = train_main([{str(bad)!r}])\n"
        "assert not dist.is_initialized()\n"
        "sys.exit(rc)\n"
    )
    outs = forked_ranks(str(script), [], 1, timeout_s=120)
    assert outs is not None, "the process did not exit"
    code, _, err = outs[0]
    assert code == 2, err
    assert "pipeline.microbatchs: unknown key; did you mean microbatches?" in err


def test_pipeline_section_is_the_runtime_config(corpus):
    """The recipe's pipeline section loads straight into runtime.PipelineConfig."""
    import yaml

    from vp_accelerate.runtime import PipelineConfig

    r = recipe_from_dict(
        base(corpus, pipeline={"layers_per_stage": [1, 3], "attn_implementation": "eager"}),
        ["pipeline.watchdog_dead_after_s=null", "pipeline.label_smoothing=0.1"],
    )
    assert type(r.pipeline) is PipelineConfig
    assert r.pipeline.layers_per_stage == (1, 3) and r.pipeline.attn_implementation == "eager"
    assert r.pipeline.watchdog_dead_after_s is None and r.pipeline.label_smoothing == 0.1
    d = recipe_to_dict(r)
    assert d["pipeline"]["layers_per_stage"] == [1, 3]  # plain lists: YAML/JSON/wandb safe
    assert recipe_from_dict(yaml.safe_load(yaml.safe_dump(d))) == r
    r = recipe_from_dict(base(corpus), ["pipeline.layers_per_stage=[2,2]"])
    assert r.pipeline.layers_per_stage == (2, 2)


def test_preference_section_is_the_runtime_config_and_runs_whole(corpus):
    """The recipe's preference section loads straight into runtime's PreferenceConfig, and the step's Preference
    takes every one of its settings (none copied by hand)."""
    import dataclasses

    from vp_accelerate.runtime.preference import Preference
    from vp_accelerate.runtime.preference_config import PreferenceConfig

    values = {"beta": 0.3, "loss_type": ["simpo", "sft"], "loss_weights": [1.0, 0.5], "label_smoothing": 0.1}
    values.update(simpo_gamma=0.7, alpha=0.2, desirable_weight=1.5, undesirable_weight=0.5)
    r = recipe_from_dict(base(corpus, data={"format": "preference"}, preference=values))
    assert type(r.preference) is PreferenceConfig
    assert {f.name for f in dataclasses.fields(PreferenceConfig)} == set(values)  # this test names every one
    p = Preference.of(r.preference, None)
    assert {k: getattr(p, k) for k in values} == values and p.types == ("simpo", "sft")


def test_a_loss_added_to_the_table_is_a_name_the_recipe_accepts(corpus, monkeypatch):
    """runtime/preference_config.py's LOSSES is the one table: the recipe's type and checks read it."""
    from vp_accelerate.runtime import preference_config

    def load(loss_type, fmt="preference"):
        return recipe_from_dict(base(corpus, data={"format": fmt}, preference={"loss_type": loss_type}))

    with pytest.raises(RecipeError, match="preference.loss_type: expected one of 'sigmoid'"):
        load("my_loss")
    monkeypatch.setitem(preference_config.LOSSES, "my_loss", preference_config.LossKind(reference=False))
    monkeypatch.setitem(preference_config.LOSSES, "my_kto", preference_config.LossKind(unpaired=True))
    assert load(["sigmoid", "my_loss"]).preference.types == ("sigmoid", "my_loss")
    assert load("my_kto", "unpaired_preference").preference.loss_type == "my_kto"
    with pytest.raises(RecipeError, match=r"preference.loss_type: \['my_kto'\] train on unpaired rows"):
        load("my_kto")


def test_cpo_trainers_losses_are_recipe_names_on_its_pairs_without_a_reference(corpus):
    """CPOConfig's loss_type sigmoid / hinge / ipo (with cpo_alpha as an `sft` weight) load as cpo_sigmoid /
    cpo_hinge / cpo_ipo: CPOTrainer's tokenization and metrics, no reference pass (the recipe refused them before)."""
    from vp_accelerate.runtime.preference import metric_style
    from vp_accelerate.runtime.preference_config import needs_reference
    from vp_accelerate.train.data.preference import pair_style

    for loss_type in (["cpo_sigmoid", "sft"], "cpo_hinge", ["cpo_ipo", "sft"]):
        r = recipe_from_dict(base(corpus, data={"format": "preference"}, preference={"loss_type": loss_type}))
        types = r.preference.types
        assert not needs_reference(types) and pair_style(types) == "cpo" and metric_style(types) == "cpo", types


def test_alphapo_is_simpo_with_alpha_and_alpha_needs_a_cpo_loss(corpus):
    """CPOConfig's `alpha` (AlphaPO) is preference.alpha on CPOTrainer's losses; TRL's loss_type `alphapo` says how to
    write it; alpha beside DPO's losses alone (which TRL's DPOTrainer does not shape) is refused naming the fix."""

    def load(**pref):
        return recipe_from_dict(base(corpus, data={"format": "preference"}, preference=pref))

    assert load(loss_type="simpo", alpha=0.25).preference.alpha == 0.25
    with pytest.raises(RecipeError, match=r"alphapo is loss_type: simpo with preference.alpha"):
        load(loss_type="alphapo")
    with pytest.raises(RecipeError, match=r"preference.alpha: 0.25 \(AlphaPO\) shapes CPOTrainer's losses"):
        load(loss_type="sigmoid", alpha=0.25)
    from vp_accelerate.runtime.preference import Preference  # the Python API says the same, before a step

    with pytest.raises(ValueError, match=r"alpha 0.25 \(AlphaPO\) shapes CPOTrainer's losses"):
        Preference(ref_logps=None, loss_type="sft", alpha=0.25).check(batch=4, microbatches=2)


def test_every_loss_of_the_table_has_its_formula():
    from vp_accelerate.runtime.preference import FORMULAS, LOSSES

    assert list(FORMULAS) == list(LOSSES)


@pytest.mark.parametrize(
    "pipeline, message",
    [
        ({"microbatches": 0}, "pipeline.microbatches: must be >= 1, got 0"),
        ({"chunks_per_rank": 0}, "pipeline.chunks_per_rank: must be >= 1 or null, got 0"),
        ({"label_smoothing": 1.0}, "pipeline.label_smoothing: must be in [0, 1), got 1.0"),
        (
            {"layers_per_stage": [2, 0, 2]},
            "pipeline.layers_per_stage: every chunk but the first and the last needs at "
            "least one layer (the end chunks may hold none), got [2, 0, 2]",
        ),
        ({"layers_per_stage": "2,2"}, "pipeline.layers_per_stage: expected list of int, got str '2,2'"),
        ({"watchdog_dead_after_s": 0}, "pipeline.watchdog_dead_after_s: must be > 0 or null, got 0.0"),
        ({"schedule": "1f1c"}, "pipeline.schedule: expected one of"),
    ],
)
def test_pipeline_errors_name_the_key(corpus, pipeline, message):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(base(corpus, pipeline=pipeline))
    assert message in str(e.value)


def test_runtime_checks_its_config_before_starting():
    """PipelineModel runs the same checks as the recipe, before any process group or weights."""
    import torch.distributed as dist

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    with pytest.raises(ValueError, match="microbatches: must be >= 1, got 0"):
        PipelineModel("llama-tiny", PipelineConfig(microbatches=0))
    assert not dist.is_initialized()


def test_build_pipeline_passes_the_section_whole(corpus, monkeypatch):
    from vp_accelerate.train.run import trainer
    from vp_accelerate.train.run.trainer import build_pipeline

    seen = {}

    def fake_model(source, config, **kwargs):
        seen.update(config=config, **kwargs)

    monkeypatch.setattr(trainer, "PipelineModel", fake_model)
    r = recipe_from_dict(base(corpus, pipeline={"chunk_size": 64, "memory": "recompute"}))
    build_pipeline(r, tokenizer=list(range(300)), device="cpu")
    assert seen["config"] is r.pipeline and seen["seed"] == r.train.seed


def test_a_trl_style_recipe_gets_every_unknown_key_in_one_error():
    # before: one error per run, the first key only (a 9-key recipe took 9 `--check` runs), and misleading hints
    # (gradient_checkpointing -> "did you mean checkpoint?", reference_free -> "did you mean preference?")
    from vp_accelerate.train.recipe import RecipeError, recipe_from_dict

    trl = {
        "gradient_checkpointing": True,
        "reference_free": True,
        "label_smoothing": 0.1,
        "loss_weights": [1.0],
        "simpo_gamma": 0.3,
        "desirable_weight": 2.0,
        "cpo_alpha": 1.0,
        "max_completion_length": 64,
        "per_device_eval_batch_size": 4,
        "use_peft": True,
    }
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"model": {"source": "llama-tiny"}, **trl, "pipeline": {"microbatchs": 4}})
    problems = e.value.problems
    assert len(problems) == len(trl) + 1
    said = dict(p.split(":", 1) for p in problems)
    assert "pipeline.activation_checkpointing" in said["gradient_checkpointing"]
    assert "preference.loss_type" in said["reference_free"] and "cpo_sigmoid" in said["reference_free"]
    for key in ("loss_weights", "simpo_gamma", "desirable_weight"):
        assert f"did you mean preference.{key}?" in said[key]
    assert "preference.label_smoothing" in said["label_smoothing"]
    assert "loss_weights: [1, cpo_alpha]" in said["cpo_alpha"]
    assert "adapter.type" in said["use_peft"] and "eval.batches" in said["per_device_eval_batch_size"]
    assert "did you mean microbatches?" in said["pipeline.microbatchs"]
    assert str(e.value).startswith("gradient_checkpointing: ")  # the first key's path: `where` points at its line
    assert "(11 problems)" in str(e.value)
