"""A model config is checked once (vp_accelerate/model_config.py) before anything is sized by it, by every
command that reads one: `plan`, `dryrun`, `train --check` and the trainer's own reader. Before, a config.json
with `num_hidden_layers: 10**9` grew the planner's memory until the process was killed, a negative
hidden_size or vocab_size ended in a ZeroDivisionError, NaN / 4.5 / "256" / a list in a TypeError and a file
nested 200,000 deep in a RecursionError. Now each is one line naming the file and the field, exit 2. No real
config is refused: every preset, every decoder family's tiny config and transformers' default of each."""

import json
import warnings

import pytest

from helpers import tiny
from vp_accelerate.model_config import ModelConfigError, check_model_config, read_config_json
from vp_accelerate.train.cli.commands import train_main
from vp_accelerate.train.cli.dryrun import dryrun_main
from vp_accelerate.train.cli.plan import plan_main
from vp_accelerate.train.recipe.convert import RecipeError
from vp_accelerate.train.recipe.presets import PRESETS, preset_config, recipe_model_config

BASE = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=512,
)

HOSTILE = [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000"),
    ({"hidden_size": -64}, "hidden_size is -64"),
    ({"vocab_size": -256}, "vocab_size is -256"),
    ({"vocab_size": 0}, "vocab_size is 0"),
    ({"hidden_size": float("nan")}, "hidden_size is nan"),
    ({"hidden_size": 4.5}, "hidden_size is 4.5"),
    ({"hidden_size": "256"}, 'hidden_size is "256" (a string)'),
    ({"num_attention_heads": [4]}, "num_attention_heads is [4] (a list)"),
    ({"num_hidden_layers": True}, "num_hidden_layers is true"),
    ({"num_key_value_heads": 8}, "num_key_value_heads is 8, more than num_attention_heads 4"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a finite number"),
]


def model_dir(tmp_path, change=None, text=None):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(text if text is not None else json.dumps({**BASE, **(change or {})}))
    return d


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


PLAN_ARGS = ["--gpus", "2", "--seq", "64", "--global-batch", "8", "--memory-gb", "80"]
DRYRUN_ARGS = ["--world-size", "2", "--seq", "64", "--global-batch", "8", "--memory-gb", "80"]


@pytest.mark.parametrize("change, said", HOSTILE)
def test_plan_and_dryrun_refuse_a_hostile_config_json_in_one_line(tmp_path, capsys, change, said):
    d = model_dir(tmp_path, change)
    for main, args in ((plan_main, PLAN_ARGS), (dryrun_main, DRYRUN_ARGS)):
        assert main([str(d), *args]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"error: {d / 'config.json'}: ") and said in line, line
        assert "correct" in line, line


def test_a_config_json_nested_200k_deep_or_too_large_is_one_line(tmp_path, capsys):
    d = model_dir(tmp_path, text='{"model_type": "llama", "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert plan_main([str(d), *PLAN_ARGS]) == 2
    assert "nested deeper than the parser's limit" in one_line(capsys.readouterr().err)
    nested = 1
    for _ in range(33):
        nested = [nested]
    d = model_dir(tmp_path, text=json.dumps({**BASE, "x": nested}))
    assert dryrun_main([str(d), *DRYRUN_ARGS]) == 2
    assert "nested more than 32 levels deep" in one_line(capsys.readouterr().err)
    d = model_dir(tmp_path, text=json.dumps({**BASE, "pad": " " * (17 << 20)}))
    with pytest.raises(ModelConfigError, match=r"config.json is 17,[\d,]+ bytes, more than a model config.json holds"):
        read_config_json(d / "config.json")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    with open(d / "train.jsonl", "w") as f:
        for i in range(100):
            f.write(json.dumps({"text": " ".join(["alpha", "beta", "gamma", "delta"][(i + k) % 4] for k in range(20))}))
            f.write("\n")
    tiny.bpe([d / "train.jsonl"], d)
    return d


def _recipe(tmp_path, tok_dir, source):
    return tiny.recipe_file(
        tmp_path / "recipe.yaml",
        tok_dir / "tok",
        [tok_dir / "train.jsonl"],
        model={"source": str(source), "pretrained_weights": False},
        data={"seq_len": 32},
        pipeline={"microbatches": 4},
        train={"global_batch": 8},
        eval={"batches": 0},
        logging={"output_dir": str(tmp_path / "out")},
    )


@pytest.mark.parametrize("change, said", [HOSTILE[0], HOSTILE[2], HOSTILE[6]])
def test_train_check_and_the_trainers_reader_refuse_it_naming_the_key(tmp_path, tok_dir, capsys, change, said):
    d = model_dir(tmp_path, change)
    recipe = _recipe(tmp_path, tok_dir, d)
    assert train_main([recipe, "--check", "--world-size", "2"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"model.source: {d / 'config.json'}: {said}" in line and "point model.source at another model" in line
    with pytest.raises(RecipeError, match="model.source: .*" + said.replace("(", r"\(").replace(")", r"\)")):
        recipe_model_config(str(d))  # what `trainer.plan_model` calls on every rank


def test_train_check_refuses_an_override_out_of_range_naming_model_config(tmp_path, tok_dir, capsys):
    recipe = _recipe(tmp_path, tok_dir, "llama-tiny")
    assert (
        train_main([recipe, "--check", "--world-size", "2", "--set", "model.config.num_hidden_layers=1000000000"]) == 2
    )
    line = one_line(capsys.readouterr().err)
    assert "model.config: num_hidden_layers is 1000000000" in line and "set model.config.num_hidden_layers" in line
    d = model_dir(tmp_path)
    with pytest.raises(RecipeError, match="model.config: vocab_size is -5"):
        recipe_model_config(str(d), {"vocab_size": -5})


def test_no_real_config_is_refused():
    """Every preset, every decoder family's tiny config (bench/coverage.py) and transformers' default config of
    each family, as an object and as the dict its config.json holds (Gemma 3n's per-layer MLP widths too)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from vp_accelerate.bench.coverage import tiny_family_config
    from vp_accelerate.models import decoder_families

    for name in PRESETS:
        check_model_config(preset_config(name), name)
        check_model_config(preset_config(name).to_dict(), name)
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in decoder_families():
            for make in (lambda: tiny_family_config(family), CONFIG_MAPPING[family]):
                try:
                    config = make()
                except Exception:  # noqa: BLE001 - a family whose tiny config needs a package not installed
                    continue
                check_model_config(config, family)
                check_model_config(config.to_dict(), family)
                checked += 1
    assert checked > 100


def test_layer_kinds_follow_the_config_object_and_an_older_config_json():
    """The mask kind per layer, the one rule of the runtime (models/adapter.py) and the planner: a config object's
    `layer_types`, and for a config.json without that field the family's alternation (Gemma-2: every other layer
    full; Gemma-3: every 6th), none when Qwen-2 turns the window off, else the window on every layer (Mistral)."""
    from transformers import AutoConfig

    from vp_accelerate.model_config import layer_kinds, masked_layer_share

    for family in ("gemma2", "gemma3_text", "cohere2", "qwen2", "mistral"):
        config = AutoConfig.for_model(family, num_hidden_layers=12)
        old_json = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
        assert (
            layer_kinds(old_json)
            == layer_kinds(config)
            == tuple(getattr(config, "layer_types", None) or (("sliding_attention",) * 12))
        ), family
    gemma2 = dict(model_type="gemma2", num_hidden_layers=4, sliding_window=4096)
    assert masked_layer_share(gemma2, 4096) == 0.0 and masked_layer_share(gemma2, 8192) == 0.5
    assert masked_layer_share(dict(model_type="llama", num_hidden_layers=2), 1 << 16) == 0.0
