#!/usr/bin/env bash
# The README's main job: set up, make the demo corpus and tokenizer (offline), then train a tiny Llama
# with 1F1B + vocab-2 on 2 CPU processes under accelerate launch, and export it as an HF model.
# Extra arguments go to the trainer, e.g. `bash scripts/quickstart.sh --set train.steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VP_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-offline}"
[ -f outputs/demo_corpus/train.jsonl ] || python scripts/make_demo_corpus.py --out outputs/demo_corpus
[ -f outputs/demo_tokenizer/tokenizer.json ] || \
  python scripts/train_tokenizer.py --vocab-size 4096 --out outputs/demo_tokenizer outputs/demo_corpus/train.jsonl
# a second run continues the first (a finished one has nothing left to do) instead of mixing checkpoints
resume=(); [ -f outputs/quickstart/checkpoints/latest ] && resume=(--resume)
accelerate launch --config_file configs/accelerate_cpu_2proc.yaml -m vp_accelerate train recipes/quickstart.yaml \
  "${resume[@]}" "$@"
vp-accelerate export outputs/quickstart/checkpoints outputs/quickstart/hf  # the run exports too; this keeps it current
echo "done: metrics in outputs/quickstart/metrics.jsonl, wandb run in outputs/quickstart/wandb, HF model in outputs/quickstart/hf"
