#!/usr/bin/env bash
# The one-GPU check (at most 10 minutes on one H200): writes <part>.json, <part>.log,
# results.json and summary.md into OUT_DIR; exits 0 only when every part ran and passed.
#   scripts/gpu_check.sh OUT_DIR                 # on the GPU machine, every part
#   scripts/gpu_check.sh OUT_DIR --cpu           # tiny sizes on the CPU: tests the plumbing, not a GPU
#   scripts/gpu_check.sh OUT_DIR [--cpu] PART... # only these parts (the summary lists the others as not run)
# One GPU runs one rank, so every part runs at world size 1 (no p2p; collectives move no data); what each
# part checks and when it passes: scripts/gpu_check.py (CHECKS, CRITERIA), repeated in summary.md. Each
# part runs in its own process under its own time limit, so one failure or hang does not stop the others.
# Python: $PYTHON if set, else the repository's .venv, else python3, else python.
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [--cpu] [PART ...]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
EXTRA=()
if [ "${1:-}" = "--cpu" ]; then
  EXTRA=(--tiny)
  export CUDA_VISIBLE_DEVICES=""
  shift
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$HERE/../.venv/bin/python" ]; then PY="$HERE/../.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then PY=python3
elif command -v python >/dev/null 2>&1; then PY=python
else echo "gpu_check: no python3 or python on PATH (and no .venv in the repository)" >&2; exit 2
fi
echo "gpu_check: $(command -v "$PY" || echo "$PY")"
mkdir -p "$OUT"
export PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Seconds per part (limit; what it is expected to take on one H200, each part a fresh process: Python,
# torch, transformers and CUDA ~10-15 s):
#   vocab_ws1          45  (~20: the selftest at V=8000, float64 reference on the CPU; first part: cold caches)
#   schedules_ws1      60  (~35: 9 float64 models, one step each, V=32000)
#   bf16_ws1           50  (~30: 2 x 50 steps of a 4-layer h256 model)
#   output_layer_1gpu 120  (~60: 9 configurations, each its own process of ~6 s, 6 repetitions each)
#   streams_1gpu      100  (~65: 13 models, 72 steps, the h2048 step-time model; it stops starting models
#                          25 s before its limit and names what it skipped, so its figures come back)
#   quickstart_bf16    75  (~45: corpus, tokenizer, then a launch of 40 steps of a 4-layer h128 model)
# 450 s, plus 5 s grace each: 480 s = 8 minutes, with the summary within a 10-minute lease.
LIMITS=(vocab_ws1:45 schedules_ws1:60 bf16_ws1:50 output_layer_1gpu:120 streams_1gpu:100 quickstart_bf16:75)
KNOWN=" ${LIMITS[*]%%:*} "
for part in "$@"; do
  if [ "${KNOWN/ $part /}" = "$KNOWN" ]; then echo "gpu_check: unknown part '$part'; parts:$KNOWN" >&2; exit 2; fi
done
WANT=" $* "
for spec in "${LIMITS[@]}"; do rm -f "$OUT/${spec%%:*}.json"; done  # the summary is of this run only
for spec in "${LIMITS[@]}"; do
  part=${spec%%:*}; limit=${spec##*:}
  if [ $# -gt 0 ] && [ "${WANT/ $part /}" = "$WANT" ]; then continue; fi
  GPU_CHECK_LIMIT_S=$limit timeout --kill-after=5 "$limit" "$PY" "$HERE/gpu_check.py" --part "$part" --out "$OUT" "${EXTRA[@]}" \
    >"$OUT/$part.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "$part: stopped after its $limit s limit" >>"$OUT/$part.log"; fi
  tail -n 1 "$OUT/$part.log"
done
"$PY" "$HERE/gpu_check.py" --summarize --out "$OUT"
