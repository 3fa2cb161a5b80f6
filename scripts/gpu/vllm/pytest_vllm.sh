#!/usr/bin/env bash
# The vLLM engine tests (tests/vllm/test_vllm_engine_gpu.py) on the GPU box, after box_install.sh,
# from the repository root:   bash scripts/gpu/vllm/pytest_vllm.sh [PYTEST ARGS, e.g. -k chunked]   (~2-5 min)
# Log: $OUT/vllm-pytest-h200.log (default OUT=/tmp/stage1-out). `python3 -P` keeps the
# repository root off sys.path, so `uniprefill` is the installed one in /tmp/usite (whose
# entry point vLLM's plugin loader finds), not the source tree (which has no uniprefill.kernels).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/stage1-out}"
mkdir -p "$OUT"
# shellcheck source=/dev/null
source scripts/gpu/vllm/env.sh
# -o addopts=: the repository's pytest-xdist options (CI's) do not apply here (one GPU, no xdist on the box)
timeout --kill-after=10 "${PYTEST_TIMEOUT:-400}" python3 -P -m pytest -p no:cacheprovider -o addopts= -q -rA \
    tests/vllm/test_vllm_engine_gpu.py "$@" > "$OUT/vllm-pytest-h200.log" 2>&1
rc=$?
echo "pytest rc=$rc" >> "$OUT/vllm-pytest-h200.log"
grep -E "passed|failed|error|PASSED|FAILED|SKIPPED" "$OUT/vllm-pytest-h200.log" | tail -8
exit $rc
