#!/usr/bin/env bash
# The README's test command: set up (scripts/setup.sh), lint and format-check with ruff, run the test suite on CPU.
# Slow checks are marked `slow` and skipped here; run them with `pytest -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VP_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m ruff check .            # lint: pyflakes, pycodestyle, import order (pyproject.toml [tool.ruff])
python -m ruff format --check .   # the tree is formatted (`ruff format .` fixes it)
python -m pytest -q --timeout=600 "$@"
