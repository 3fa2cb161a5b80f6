#!/usr/bin/env bash
# On the GPU box (vLLM installed by box_install.sh): vLLM's own `vllm bench throughput`, standard vLLM on its
# defaults against the same command plus the one uniprefill option, back to back per prompt length, then a
# table of the ratios (scripts/gpu/vllm/bench_table.py). First run on the H200 on 2026-12-04 with --input-len, which
# vLLM 0.26's random dataset ignores (it warns and takes --random-input-len, default 1024 in / 128 out).
#   bash scripts/gpu/vllm/bench_throughput.sh OUT_DIR SETTINGS_JSON [LENGTHS] [NUM_PROMPTS]
# e.g. bash scripts/gpu/vllm/bench_throughput.sh /tmp/bench '{"keep_ratio": 0.3, "drop_layers": [7], "vllm_drop": true}'
# Model: the Llama-3.1-8B shape with dummy weights (uniprefill.testing.word_llama, 32 layers, max_model_len
# 32768), or SERVE_MODEL_DIR=/tmp/gemma-270m (real weights, serve_lib.sh). LENGTHS default 8192,16384,28672 (32000 is
# over vLLM's 5-characters-per-token prompt bound with the word-level test tokenizer); NUM_PROMPTS default 16 (all queued at once: vLLM's own batching);
# --output-len 1, so the time is the prefill's. SYSTEMS (default "standard uniprefill") may add uniprefill-chunked
# (serve_lib.sh: vLLM's own step budget). Each run is one engine (about two minutes with the compile).
set -uo pipefail
OUT="${1:?usage: bench_throughput.sh OUT_DIR SETTINGS_JSON [LENGTHS] [NUM_PROMPTS]}"
SETTINGS="${2:?give the uniprefill settings as JSON}"
LENGTHS="${3:-8192,16384,28672}"
NUM_PROMPTS="${4:-16}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu/vllm/serve_lib.sh"  # env.sh, SERVE_MODEL, serve_*
serve_setup
MODEL="$SERVE_MODEL"
echo "$SETTINGS" > "$OUT/settings.json"
for length in ${LENGTHS//,/ }; do
  for system in ${SYSTEMS:-standard uniprefill}; do
    extra=()
    [[ "$system" == uniprefill* ]] && extra=(-cc "{\"inductor_compile_config\": {\"uniprefill\": $(system_settings "$system")}}")
    start=$(date +%s)
    timeout 540 "${VLLM_CLI[@]}" bench throughput --model "$MODEL" "${LOAD_ARGS[@]}" --max-model-len 32768 --seed 0 \
      --dataset-name random --random-input-len "$length" --random-output-len 1 --num-prompts "$NUM_PROMPTS" \
      --output-json "$OUT/$system-$length.json" "${extra[@]}" > "$OUT/$system-$length.log" 2>&1
    echo "$system $length: exit $? in $(( $(date +%s) - start )) s"
    grep -E "^Throughput|Traceback|Error" "$OUT/$system-$length.log" | head -3 | cut -c1-300
  done
done
python3 -P "$ROOT/scripts/gpu/vllm/bench_table.py" "$OUT"
