#!/usr/bin/env bash
# The README's test command: set up (scripts/setup.sh), lint and format-check with ruff, run the test suite on CPU.
# Slow checks are marked `slow` and skipped here; run them with `pytest -m slow`.
# The suite runs on 2 pytest-xdist workers, a module at a time (a module-scoped fixture, often a
# training run, is then built once). The few timing-sensitive checks (marked `serial`) run afterwards,
# alone, so no other test's processes share the cores while they measure. Extra arguments go to both
# runs (e.g. a file or -k); a run that then selects no test (pytest's exit status 5) is not a failure. Each run
# writes a JUnit file (VP_JUNIT_DIR, default .pytest_cache/junit); the slowest modules are printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VP_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m ruff check .            # lint: pyflakes, pycodestyle, import order (pyproject.toml [tool.ruff])
python -m ruff format --check .   # the tree is formatted (`ruff format .` fixes it)
selected() { "$@" || [ $? -eq 5 ]; }
# each run's JUnit timing file, which scripts/suite_times.py reads: the slowest modules are printed at the end
JUNIT="${VP_JUNIT_DIR:-.pytest_cache/junit}"
mkdir -p "$JUNIT"
selected python -m pytest -q --timeout=600 -n "${VP_TEST_WORKERS:-2}" --dist loadfile -m "not slow and not serial" \
  --junitxml "$JUNIT/suite.xml" "$@"
selected python -m pytest -q --timeout=600 -m "serial and not slow" --junitxml "$JUNIT/suite_serial.xml" "$@"
python scripts/suite_times.py "$JUNIT/suite.xml" "$JUNIT/suite_serial.xml" > "$JUNIT/times.txt" || true
echo "slowest modules (all: $JUNIT/times.txt):"
head -n 8 "$JUNIT/times.txt"
tail -n 1 "$JUNIT/times.txt"
