"""The commands: `vp-accelerate train` and `export` (`commands.py`), `train --check` (`check.py`), `launch`
(`launch.py`), `plan` (`plan.py`), and the checks of a recipe against its model, tokenizer and world size before
any process group starts (`preflight.py`)."""
