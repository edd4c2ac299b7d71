"""The training recipe: one validated config made of dataclasses, read from YAML.

A recipe is checked completely before any process group starts: unknown keys (with a "did you mean" hint),
wrong types and inconsistent values are errors that name the key path, e.g. `pipeline.microbatchs: unknown key;
did you mean microbatches?`. `--set key.path=value` overrides are typed by the field they set.

  schema.py       what a recipe contains (a dataclass per section; every key's docstring)
  checks.py       which combinations are valid (`check` returns the resolved recipe)
  load.py         YAML and overrides in, a plain dict out
  convert.py      the generic dict <-> dataclass conversion, errors naming the key path
  lr_schedule.py  the LR schedule the `lr` section names
  presets.py      model presets by name, and where a recipe's model comes from
  model_check.py  offline checks of the model a recipe names (hub cache, LoRA targets)
"""

from .checks import DEFAULT_STEPS, check, finish_steps
from .convert import RecipeError
from .load import REMOVED_KEYS, load_recipe, recipe_from_dict, recipe_to_dict
from .schema import (
    AdapterConfig,
    CheckpointSection,
    DataSection,
    EvalSection,
    LoggingSection,
    LRSection,
    ModelSection,
    OptimizerSection,
    PipelineConfig,
    Recipe,
    TokenizerSection,
    TrainSection,
)

__all__ = [
    "DEFAULT_STEPS",
    "REMOVED_KEYS",
    "AdapterConfig",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "LRSection",
    "LoggingSection",
    "ModelSection",
    "OptimizerSection",
    "TokenizerSection",
    "TrainSection",
    "PipelineConfig",
    "Recipe",
    "RecipeError",
    "check",
    "finish_steps",
    "load_recipe",
    "recipe_from_dict",
    "recipe_to_dict",
]
