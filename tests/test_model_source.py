"""One resolver of a recipe's model source (`recipe/model_check.model_dir`) for `--check`, `plan`, `dryrun` and the
trainer: a preset's typo is the same line everywhere, with its did-you-mean (before: only `--check` said it; `plan`
and `dryrun` of a recipe asked the hub for the typo, the trainer said "cannot get")."""

import json

import pytest

from vp_accelerate.train.recipe import load_recipe

SAYS = "model.source: 'llama-tyni' is not a preset (did you mean llama-tiny?) nor a local directory"


@pytest.fixture
def typo_recipe(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "some words"}) + "\n")
    path = tmp_path / "r.yaml"
    path.write_text(
        f"model:\n  source: llama-tyni\ntokenizer:\n  source: qwen\ndata:\n  files: [{data}]\n"
        f"logging:\n  output_dir: {tmp_path / 'out'}\n  wandb_mode: disabled\n"
    )
    return str(path)


@pytest.mark.parametrize("command", ["plan", "dryrun"])
def test_plan_and_dryrun_of_a_recipe_name_a_preset_typo(typo_recipe, command, capsys):
    from vp_accelerate.train.cli.dryrun import dryrun_main
    from vp_accelerate.train.cli.plan import plan_main

    args = [typo_recipe, "--world-size", "2"] if command == "dryrun" else [typo_recipe, "--gpus", "2"]
    assert (dryrun_main if command == "dryrun" else plan_main)([*args, "--memory-gb", "8"]) == 2
    assert SAYS in capsys.readouterr().err


def test_check_and_the_trainer_say_the_same(typo_recipe):
    from vp_accelerate.train.cli.preflight import check_plan
    from vp_accelerate.train.recipe import RecipeError
    from vp_accelerate.train.run.trainer import load_model_and_tokenizers

    recipe = load_recipe(typo_recipe)
    for where in (lambda: check_plan(recipe, 1), lambda: load_model_and_tokenizers(recipe, None)):
        with pytest.raises(RecipeError) as e:
            where()
        assert str(e.value) == SAYS
