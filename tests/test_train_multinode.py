"""The 2-node x 8-GPU launch: the accelerate config names a recipe that exists, and `train --check
--world-size 16` accepts its layout (pp 8 inside a node x dp 2 across nodes) and refuses a wrong one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from vp_accelerate.train.preflight import check_plan
from vp_accelerate.train.recipe import load_recipe
from vp_accelerate.train.recipe_io import RecipeError

ROOT = Path(__file__).resolve().parents[1]


def _recipe(tmp_path, *overrides):
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"a document {i}"}) + "\n" for i in range(20)))
    return load_recipe(str(ROOT / "recipes" / "gpu_llama3_8b_vocab2_1f1b.yaml"),
                       [f"data.files=[{corpus}]", f"data.eval_files=[{corpus}]", *overrides])


def test_multinode_config_names_an_existing_recipe_and_16_processes():
    text = (ROOT / "configs" / "accelerate_multinode.yaml").read_text()
    config = yaml.safe_load(text)
    assert (config["num_machines"], config["num_processes"]) == (2, 16)
    named = set(re.findall(r"recipes/[\w.-]+\.yaml", text))
    assert named and all((ROOT / r).is_file() for r in named), named


def test_check_world_size_16_accepts_pp8_x_dp2_and_names_the_problem_otherwise(tmp_path):
    notes = check_plan(_recipe(tmp_path, "pipeline.dp_size=2"), 16)
    assert any("on 8 ranks" in n for n in notes), notes
    with pytest.raises(RecipeError, match="pp_size=8 x dp_size=4 = 32, but 16 processes"):
        check_plan(_recipe(tmp_path), 16)  # the recipe's own dp_size 4 is a 32-GPU layout
