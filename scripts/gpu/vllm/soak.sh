#!/usr/bin/env bash
# On the GPU box (vLLM installed by box_install.sh): the serve soak of issue 20. For each RUN, a local
# `vllm serve` on loopback on vLLM's defaults (RUN standard*: nothing added; RUN uniprefill*: the one option,
# SETTINGS), the bounded client scripts/gpu/vllm/soak.py against it, the server stopped; then each run's
# answers compared with the first run's (`soak.py compare`). Run on the H200 on 2026-12-04, one server per call
# (docs/results/vllm-defaults-h200-2026-12-04/soak/; compare across calls with `soak.py compare`).
#   bash scripts/gpu/vllm/soak.sh OUT_DIR RUN... (e.g. standard uniprefill standard-again)
# Env: SETTINGS (default {"p": 1.0, "vllm_drop": true}), REQUESTS (300), CONCURRENCY (8), MIN_LEN (1000),
#      MAX_LEN (32000), MAX_TOKENS (16). The model: the Llama-3.1-8B shape with dummy weights
#      (uniprefill.testing.word_llama, 32 layers, max_model_len 32768). VLLM_SERVER_DEV_MODE=1 opens vLLM's
#      /collective_rpc, through which the client reads the drop totals after the last request.
# vLLM is not batch-invariant: under concurrent load the steps' composition differs run to run, so a
# `standard-again` run is the control for how many answers two standard servers share.
set -uo pipefail
OUT="${1:?usage: soak.sh OUT_DIR RUN...}"; shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu/vllm/serve_lib.sh"  # env.sh, SERVE_MODEL, serve_*
serve_setup
first=""
for run in "$@"; do
  start=$(date +%s)
  serve_start "$run" "$OUT/$run.server.log" || continue
  timeout 900 python3 -P "$ROOT/scripts/gpu/vllm/soak.py" run --model "$SERVE_MODEL" --requests "${REQUESTS:-300}" \
    --concurrency "${CONCURRENCY:-8}" --min-len "${MIN_LEN:-1000}" --max-len "${MAX_LEN:-32000}" \
    --max-tokens "${MAX_TOKENS:-16}" --totals --out "$OUT/$run.jsonl" > "$OUT/$run.client.log" 2>&1
  echo "$run: client exit $? after $(( $(date +%s) - start )) s"; tail -14 "$OUT/$run.client.log" | cut -c1-200
  serve_stop
  grep -E "Traceback|ERROR" "$OUT/$run.server.log" | head -3 | cut -c1-300
  if [[ -z "$first" ]]; then
    first="$run"
  else
    python3 -P "$ROOT/scripts/gpu/vllm/soak.py" compare "$OUT/$first.jsonl" "$OUT/$run.jsonl" \
      --out "$OUT/compare-$run.json" | head -4
  fi
done
