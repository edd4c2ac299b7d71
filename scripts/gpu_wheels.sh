#!/usr/bin/env bash
# Wheels for the GPU lease's image: what scripts/gpu_check.sh needs there that the image lacks, downloaded here
# (PyPI reachable) into wheels/ (git-ignored), which travels with the working tree (64 MiB in all, so at most
# ~40 MiB here). gpu_check.sh installs from it offline, only what its interpreter is missing.
#   bash scripts/gpu_wheels.sh            # -> wheels/*.whl, then run the check on the lent machine
# The image (Python 3.12, torch 2.11.0+cu130, transformers 5.17.0, accelerate 1.15.0, peft, safetensors,
# tokenizers 0.23, pyarrow, numpy, huggingface-hub 1.33, fsspec, pandas, xxhash, pytest) has no datasets, wandb or
# trl. Carried: `datasets` (the trainer's data loading) with its dependencies the image may lack or hold in a
# version datasets refuses (dill, multiprocess, fsspec), and the small ones a barer interpreter (the CPU rehearsal:
# no pandas or xxhash) lacks too: xxhash (the checkpoint writer's hash), pandas, python-dateutil, tzdata; and the
# `demo` extra (faker, babel) for the quickstart part's corpus, which the image lacks. 25 MiB in all. Not
# carried, the image has them: torch, numpy, pyarrow (>= 24 needed by datasets 5.2), huggingface-hub.
# Not carried: wandb (a ~20 MB binary wheel plus its dependencies); the check's training runs set
# `logging.wandb_mode: disabled` when wandb is missing (metrics.jsonl is still written), as any recipe may.
# Each wheel is fetched with --no-deps for CPython 3.12 on manylinux x86-64, pinned so that the set is consistent
# (one version of each: two stop the install).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${1:-"$HERE/../wheels"}
PY=${PYTHON:-python3}
MAX_MIB=40
PINS=(
  "datasets==5.2.0"       # the version the suite runs; needs pyarrow>=24, huggingface-hub>=1.31, fsspec<=2026.9.0
  "dill==0.4.1"           # datasets: dill<0.4.2
  "multiprocess==0.70.19" # datasets: multiprocess<0.70.20 (needs dill>=0.4.1)
  "fsspec==2026.9.0"      # datasets: fsspec<=2026.9.0 (an image with a newer one gets this one)
  "xxhash==4.1.0"         # the checkpoint writer and datasets
  "pandas==3.1.1"         # datasets (the image has pandas; the rehearsal venv does not)
  "python-dateutil==4.0.0"
  "tzdata==2026.6"
  "faker==40.63.0"        # the `demo` extra: the quickstart part's demo corpus
  "babel==2.19.0"         # the `demo` extra (11 MB of locale data)
)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$DEST" "${PINS[@]}"
bytes=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f 1)
mib=$((bytes / 1048576))
ls -1 "$DEST"
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, ${mib} MiB in $DEST"
if [ "$mib" -ge "$MAX_MIB" ]; then
  echo "gpu_wheels: ${mib} MiB is over ${MAX_MIB} MiB: the working tree travels with at most 64 MiB" >&2
  exit 2
fi
