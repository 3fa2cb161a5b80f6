#!/usr/bin/env bash
# On the GPU box, right after gpu_install_gemma.sh (docs/gpu.md): start issue 5's eval in the
# background, so that the calls that follow (e.g. the vLLM wheel transfers) overlap with it,
# and, once its timed stage A is over (timings must have the GPU to themselves), the
# GPU-capable tests against the box's own transformers.
#
#   UNIPREFILL_GIT_COMMIT=<hash> SEED=.gpu_data/seed.jsonl.gz BUDGET=1200 PROCS=8 \
#       UNTIMED_LENGTHS=8192,16384,32000 UNTIMED_DROP=auto bash scripts/gpu/start_background_eval.sh
#
# Both run under setsid (a device call kills the processes it leaves, except new sessions)
# and write only under /tmp: the eval's results to /tmp/evalout (OUT), its driver log to
# /tmp/eval-driver.log, the tests' log to /tmp/gpu-pytest.log. A later call waits with
#   until [ -f /tmp/eval-finished ]; do sleep 5; done; cp /tmp/evalout/* /tmp/gpu-pytest.log $OUT/
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -f /tmp/eval-finished /tmp/gpu-pytest.log
mkdir -p /tmp/evalout /tmp/tests-copy
cp -r tests pyproject.toml /tmp/tests-copy/
export OUT=/tmp/evalout
setsid nohup bash -c 'bash scripts/gpu/eval_issue5.sh; touch /tmp/eval-finished' \
    > /tmp/eval-driver.log 2>&1 < /dev/null &
# The tests import uniprefill from /tmp/pp (the copy the eval makes) with the box's
# transformers (5.17): the oldest version the package supports.
setsid nohup bash -c 'until grep -q "stage A rc" /tmp/eval-driver.log 2>/dev/null; do sleep 5; done
    cd /tmp/tests-copy && PYTHONPATH=/tmp/pp timeout 900 python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_kernels.py tests/vllm/test_vllm_window.py tests/passes/test_backend.py tests/runtime/test_generation.py tests/passes/test_hybrids.py \
        > /tmp/gpu-pytest.log 2>&1; echo "pytest rc=$?" >> /tmp/gpu-pytest.log' \
    > /dev/null 2>&1 < /dev/null &
sleep 15
cat /tmp/eval-driver.log
