#!/usr/bin/env bash
# The one-GPU check (at most 9 minutes on one H200): writes <part>.json, <part>.log,
# results.json and summary.md into OUT_DIR; exits 0 only when every part ran and passed.
#   scripts/gpu_check.sh OUT_DIR                 # on the GPU machine, every part
#   scripts/gpu_check.sh OUT_DIR --cpu           # tiny sizes on the CPU: tests the plumbing, not a GPU
#   scripts/gpu_check.sh OUT_DIR [--cpu] PART... # only these parts (the summary lists the others as not run)
# One GPU runs one rank, so every part runs at world size 1 (no p2p; collectives move no data); what each
# part checks and when it passes: scripts/gpu_check.py (CHECKS, CRITERIA), repeated in summary.md. Each
# part runs in its own process under its own time limit, so one failure or hang does not stop the others.
# Python: $PYTHON if set, else python3 (on the lent GPU machine: the image's, which holds torch); never the
# repository's own .venv. The first lines name the interpreter and the versions it has. The package is imported
# from this checkout (PYTHONPATH). What the interpreter lacks of what the check needs (datasets, xxhash, faker) is
# installed offline from wheels/ (made by scripts/gpu_wheels.sh on a machine with PyPI) into a fresh folder under
# /tmp that goes first on PYTHONPATH: the interpreter's own environment is left as it was.
# The whole check is held to GPU_CHECK_TOTAL_S seconds (default 510: with the start and the summary, 9 minutes;
# --cpu: 3600 and every limit doubled): a part gets its own limit or what is left of that budget, whichever is
# less; one with under 10 s left is not started (the summary lists it as not run).
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [--cpu] [PART ...]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
EXTRA=()
SCALE=1
TOTAL_S=${GPU_CHECK_TOTAL_S:-510}
if [ "${1:-}" = "--cpu" ]; then
  EXTRA=(--tiny)
  SCALE=2  # the tiny sizes on a CPU shared with other work: the limits doubled, the 9-minute budget not applied
  TOTAL_S=${GPU_CHECK_TOTAL_S:-3600}
  export CUDA_VISIBLE_DEVICES=""
  shift
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif command -v python3 >/dev/null 2>&1; then PY=python3
elif command -v python >/dev/null 2>&1; then PY=python
else echo "gpu_check: no python3 or python on PATH (set PYTHON)" >&2; exit 2
fi
echo "gpu_check: $(command -v "$PY" || echo "$PY")"
# Seconds per part (limit; what it is expected to take on one H200, each part a fresh process: Python,
# torch, transformers and CUDA ~10-15 s; the figures in brackets are the CPU rehearsal's, --cpu on 2 shared cores):
#   vocab_ws1           40  (~20: the selftest at V=8000, float64 reference on the CPU; first part: cold caches)
#   schedules_ws1       55  (~35: 9 float64 models, one step each, V=32000)
#   bf16_ws1            45  (~30: 2 x 50 steps of a 4-layer h256 model)
#   zero_fused_1gpu     30  (~15: 4 fused AdamW steps of a 4-layer h256 model, ZeRO-1 on a 1-rank group and plain)
#   progress_device_1gpu 25 (~14: a 2 s torch.cuda._sleep read by Progress, then a host-side stall)
#   persist_1gpu        60  (~35: BPE, 8 steps in-process with 2 background saves, an 8-step resume in a process)
#   memory_1gpu        110  (~75: dryrun of the 1B layout on the CPU beside 2 processes of 2 steps each on the GPU)
#   output_layer_1gpu  100  (~60: 9 configurations, each its own process of ~6 s, 5 repetitions each)
#   streams_1gpu        85  (~65: 13 models, 72 steps, the h2048 step-time model; it stops starting models
#                           25 s before its limit and names what it skipped, so its figures come back)
#   quickstart_bf16     60  (~45: corpus, tokenizer, then a launch of 40 steps of a 4-layer h128 model)
# Expected ~395 s of parts + ~15 s of start (versions, wheels) + ~3 s of summary: under 7 minutes. The limits add
# up to 610 s; the 510 s budget caps the whole at 9 minutes even when parts run to their limits.
LIMITS=(vocab_ws1:40 schedules_ws1:55 bf16_ws1:45 zero_fused_1gpu:30 progress_device_1gpu:25 persist_1gpu:60
  memory_1gpu:110 output_layer_1gpu:100 streams_1gpu:85 quickstart_bf16:60)
KNOWN=" ${LIMITS[*]%%:*} "
for part in "$@"; do
  if [ "${KNOWN/ $part /}" = "$KNOWN" ]; then echo "gpu_check: unknown part '$part'; parts:$KNOWN" >&2; exit 2; fi
done
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" - <<'PYEOF'
import importlib.metadata as md, sys
found = []
for name in ("torch", "transformers", "accelerate", "peft", "safetensors", "tokenizers", "pyarrow", "numpy",
             "datasets", "xxhash", "wandb", "trl"):
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} -")
print(f"gpu_check: Python {sys.version.split()[0]}; " + ", ".join(found), flush=True)
import torch
cuda = torch.cuda.is_available()
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      + (f"{torch.cuda.get_device_name(0)}" if cuda else "no GPU visible"), flush=True)
PYEOF
[ $? -eq 0 ] || { echo "gpu_check: $PY cannot import torch" >&2; exit 2; }
# what the check imports that the interpreter may lack (module:distribution)
NEEDED=(datasets:datasets xxhash:xxhash yaml:pyyaml faker:faker babel:babel)  # babel, faker: the demo corpus
missing=()
for spec in "${NEEDED[@]}"; do
  "$PY" -c "import ${spec%%:*}" >/dev/null 2>&1 || missing+=("${spec##*:}")
done
# A package that cannot be had costs only the parts that import it (the trainer's: persist_1gpu, quickstart_bf16):
# the check goes on, with a warning, rather than lose a 15-minute lease.
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/wheels}
if [ ${#missing[@]} -gt 0 ] && ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "gpu_check: WARNING: missing ${missing[*]} and no wheels in $WHEELS (run 'bash scripts/gpu_wheels.sh' where" \
    "PyPI is reachable); the parts that need them will fail" >&2
elif [ ${#missing[@]} -gt 0 ]; then
  SITE=$(mktemp -d /tmp/vp_gpu_site.XXXXXX)
  echo "gpu_check: installing ${missing[*]} offline from $WHEELS into $SITE"
  PIP=("$PY" -m pip install --quiet --no-index --prefix "$SITE" --no-warn-script-location --disable-pip-version-check)
  if ! "${PIP[@]}" --find-links "$WHEELS" "${missing[@]}"; then
    # the resolver wants a version the image lacks (e.g. an older pyarrow than datasets asks for): every carried
    # wheel as it is, without its dependencies' checks, into the same prefix (first on PYTHONPATH)
    echo "gpu_check: WARNING: the offline install failed (above); installing every wheel without dependency checks" >&2
    "${PIP[@]}" --no-deps "$WHEELS"/*.whl || echo "gpu_check: WARNING: that failed too (above)" >&2
  fi
  SITE_LIB=$("$PY" -c "import sysconfig, sys; v = {'base': sys.argv[1], 'platbase': sys.argv[1]}
print(':'.join(dict.fromkeys(sysconfig.get_path(k, vars=v) for k in ('purelib', 'platlib'))))" "$SITE")
  export PYTHONPATH="$ROOT:$SITE_LIB${PYTHONPATH#"$ROOT"}"
  for spec in "${NEEDED[@]}"; do
    "$PY" -c "import ${spec%%:*}" >/dev/null 2>&1 || echo "gpu_check: WARNING: ${spec%%:*} still does not import" >&2
  done
fi
mkdir -p "$OUT"
WANT=" $* "
for spec in "${LIMITS[@]}"; do rm -f "$OUT/${spec%%:*}.json"; done  # the summary is of this run only
BUDGET_END=$((SECONDS + TOTAL_S))
for spec in "${LIMITS[@]}"; do
  part=${spec%%:*}; limit=$((${spec##*:} * SCALE))
  if [ $# -gt 0 ] && [ "${WANT/ $part /}" = "$WANT" ]; then continue; fi
  left=$((BUDGET_END - SECONDS - 5))
  if [ "$left" -lt 10 ]; then
    echo "$part: not started: the check's budget (GPU_CHECK_TOTAL_S) is spent" | tee "$OUT/$part.log"
    continue
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  GPU_CHECK_LIMIT_S=$limit timeout --kill-after=5 "$limit" "$PY" "$HERE/gpu_check.py" --part "$part" --out "$OUT" "${EXTRA[@]}" \
    >"$OUT/$part.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "$part: stopped after its $limit s limit" >>"$OUT/$part.log"; fi
  tail -n 1 "$OUT/$part.log"
done
"$PY" "$HERE/gpu_check.py" --summarize --out "$OUT"
