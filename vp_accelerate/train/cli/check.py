"""`vp-accelerate train RECIPE --check [--show-example]`: what the run would do, and everything that would stop it,
before anything is launched.

After the recipe and plan checks (`preflight.check_plan`) it reads every row of every data file with the run's
tokenizer and template (`data.check.data_report`; the tokenized rows are cached, so the launch reuses them)
and prints what it found. Exit code 2 and the key to change for anything that would stop the run.
"""

from __future__ import annotations

import json
import sys

from vp_accelerate import exit_codes

from ..data import BadRowsError, DataError
from ..data.check import bad_rows_text, data_report
from ..data.check import show_example as render_example
from ..recipe import RecipeError, recipe_to_dict


def run_check(recipe, notes: list[str], found: dict, show_example: bool = False) -> int:
    """Print the recipe (stdout) and what was checked (stderr); 2 on an error that would stop the run."""
    tokenizer, prepared = found.get("tokenizer"), None
    if tokenizer is None:
        notes.append("data: the tokenizer is not on disk yet, so the rows were not tokenized before launch")
    else:
        config, plan = found.get("config"), found.get("plan")
        vocab = plan.rows_after if plan is not None else config.vocab_size if config is not None else 2**62
        try:
            lines, prepared, recipe = data_report(recipe, tokenizer, vocab)
        except BadRowsError as e:
            print(bad_rows_text(e), file=sys.stderr)
            return exit_codes.USER_ERROR
        except (DataError, RecipeError) as e:
            print(f"data error: {e}", file=sys.stderr)
            return exit_codes.USER_ERROR
        notes += lines
    print(json.dumps(recipe_to_dict(recipe), indent=1))
    for note in notes:
        print(f"checked: {note}", file=sys.stderr)
    if show_example:
        if prepared is None:
            print("--show-example: no tokenized data to show (the tokenizer is not on disk yet)", file=sys.stderr)
        else:
            print(render_example(prepared, tokenizer, color=sys.stdout.isatty()))
    return 0
