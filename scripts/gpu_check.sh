#!/usr/bin/env bash
# The one-GPU check (at most 8 minutes on one H200): writes <part>.json, <part>.log, results.json and
# summary.md into OUT_DIR.
#   scripts/gpu_check.sh OUT_DIR            # on the GPU machine
#   scripts/gpu_check.sh OUT_DIR --cpu      # tiny sizes on the CPU: tests the plumbing in about a minute
# Each part runs in its own process under its own time limit, so one failure or hang does not stop the
# others; the summary says plainly which parts did not run or failed, and why. Parts: see gpu_check.py.
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [--cpu]}
MODE=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
EXTRA=()
if [ "$MODE" = "--cpu" ]; then
  EXTRA=(--tiny)
  export CUDA_VISIBLE_DEVICES=""
fi
export PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# seconds per part; 60 + 60 + 90 + 200 + 40 = 450 s < 8 minutes with the summary
for spec in selftest:60 exact:60 bf16:90 output_layer:200 share:40; do
  part=${spec%%:*}; limit=${spec##*:}
  rm -f "$OUT/$part.json"
  timeout --kill-after=5 "$limit" python "$HERE/gpu_check.py" --part "$part" --out "$OUT" "${EXTRA[@]}" \
    >"$OUT/$part.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && echo "$part: stopped after its $limit s limit" >>"$OUT/$part.log"
  tail -n 1 "$OUT/$part.log"
done
python "$HERE/gpu_check.py" --summarize --out "$OUT"
