#!/usr/bin/env bash
# Stage 1 on the GPU box, after box_install.sh, from the repository root:
#   bash scripts/gpu/vllm/stage1.sh [--budget SECONDS] STEP...      (default steps: all, in this order)
# Steps (expected duration on one H200 shared with a ~40 GB HF job; each has a `timeout`):
#   api      probe_api.py + check_channel.py (docs/vllm.md)                          ~1 min  (cap 170 s)
#   gemma    standard vLLM (mode 3) on Gemma-3-270M ($GEMMA_DIR, real weights):
#            greedy texts + prefill throughput 8192,16384,32000 x 1,4,16            ~3 min  (cap 360 s)
#   dump     Gemma-3-270M through dump_backend.py (mode 2), texts only, 4K context;
#            the dump folder is packed into $OUT/vllm-dump.tar.gz                     ~1.5 min (cap 240 s)
#   llama4   4-layer Llama-shaped dummy through the uniprefill channel (mode 2)      ~1.5 min (cap 240 s)
#   llama4drop  the same with "vllm_drop": true: the experimental rewrite (drop at layer 1)  ~1.5 min
#   gemmadrop  Gemma-3-270M through the uniprefill channel with "vllm_drop": true, rewritten at
#            the "auto" layers (5, 11); its greedy prompts are shorter than min_tokens (256), so
#            they run through WITHOUT dropping (a check that short prompts are left alone; the
#            `needles` and `gemmadroptput` steps drop)                                       ~2 min
#   needles  needle parity (issue 6 stage 2): scripts/gpu/vllm/needle_parity.py on Gemma-3-270M,
#            niah_single_1..3 + niah_multikey_1 at 8K/16K/32K, NEEDLE_SAMPLES (10) each, standard
#            vLLM vs uniprefill p = 0.99 ("vllm_drop": true), then the paired comparison   ~6 min
#   gemmadroptput  prefill throughput of Gemma-3-270M with uniprefill dropping (p = 0.95), $THROUGHPUT
#   llama8bdrop    the same for the Llama-8B-shaped dummy, forced keep 0.3 at layer 7
#   llama8btp2, llama8bdroptp2  llama8b / llama8bdrop with tensor_parallel_size=2 (the two-GPU kind):
#            throughput, and `ranks_agree` in the JSON (every rank dropped the same rows)   ~5 min each
#   pytest   tests/vllm/test_vllm_engine_gpu.py (scripts/gpu/vllm/pytest_vllm.sh): a mixed batch drops
#            and decodes, opt-out, prefix caching refused, graph decode = eager decode; log
#            $OUT/vllm-pytest-h200.log                                                   ~3.5 min
#   llama8b  standard vLLM on the 32-layer Llama-3.1-8B-shaped dummy: throughput
#            8192,16384,32000 x 1,4,16                                                ~5 min  (cap 540 s)
#   llama8bdropcg  llama8bdrop with decode under CUDA graphs (--decode-graphs: cudagraph_mode
#            FULL_DECODE_ONLY, "vllm_decode_graphs": true; run on the H200 2026-12-01)  ~3 min
#   llama8beager, llama8bchannel  controls for the decode time per output token (DECODE=N): standard
#            vLLM with enforce_eager (no compile, no CUDA graphs), and the uniprefill channel (mode 2)
#            without dropping: how much of the dropping run's slower decode is eagerness, how much
#            the drop histories' metadata (2026-12-01: 21.8 vs 5.8 ms at 32K, batch 1)     ~3 min each
# A step that fails is logged and the next one runs. --budget (default 560 s from the start of
# this script) caps the sum: each step's timeout is cut to what is left, minus 20 s for packing.
# Out ($OUT, default /tmp/stage1-out): one JSON per run (names below), vllm-dump.tar.gz for
# `dump`, and all logs packed into stage1-logs-<steps>.tar.gz: at most 6 files per call.
# THROUGHPUT="8192,16384,32000 1,4,16" (lengths, batches) for the gemma and llama8b steps;
# DECODE=N adds the time per output token over N tokens after the first (eager decode in the
# uniprefill channel vs CUDA graphs in standard vLLM). THROUGHPUT=none skips the throughput points (e.g. while another job shares the GPU, when
# timings would mean nothing): the engines are then only built and generate.
# LLAMA_KV_GIB (default 8): the llama8b* steps' KV cache; 72 fits 16 prompts of 32K (2026-12-01 grid).
# GPU memory: every engine gets a fixed KV cache (--kv-cache-gib) and a low
# --gpu-memory-utilization (only vLLM's start-up check of free memory), so another job may share the GPU.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
budget=560
steps=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --budget) budget="$2"; shift 2 ;;
    api|gemma|gemmadrop|dump|llama4|llama4drop|llama8b|needles|gemmadroptput|llama8bdrop|pytest|llama8btp2|llama8bdroptp2|llama8beager|llama8bchannel|llama8bdropcg) steps+=("$1"); shift ;;
    all) steps+=(api gemma dump llama4 llama8b); shift ;;
    *) echo "unknown argument: $1 (steps: api gemma dump llama4 llama4drop gemmadrop needles gemmadroptput llama8b llama8bdrop llama8btp2 llama8bdroptp2 llama8beager llama8bchannel llama8bdropcg pytest all; --budget S)" >&2; exit 2 ;;
  esac
done
[[ ${#steps[@]} -gt 0 ]] || steps=(api gemma dump llama4 llama8b)
OUT="${OUT:-/tmp/stage1-out}"
GEMMA_DIR="${GEMMA_DIR:-/tmp/gemma-270m}"
LOGS="$(mktemp -d /tmp/stage1-logs.XXXX)"
mkdir -p "$OUT"
# shellcheck source=/dev/null
source scripts/gpu/vllm/env.sh
SMOKE="python3 scripts/gpu/vllm/smoke_llm.py"
SHARED=(--gpu-memory-utilization "${GPU_UTIL:-0.3}")  # GPU_UTIL: lower it when another job holds most of the GPU
THROUGHPUT="${THROUGHPUT:-8192,16384,32000 1,4,16}"
if [[ "$THROUGHPUT" == none ]]; then
  TPUT=()
else
  read -r tlens tbatches <<< "$THROUGHPUT"
  TPUT=(--throughput-lengths "$tlens" --throughput-batches "$tbatches")
  # DECODE=N: also time N output tokens after the first at each point (ms per output token)
  [[ "${DECODE:-0}" -gt 0 ]] && TPUT+=(--decode-tokens "$DECODE")
fi
start=$(date +%s)
summary="$LOGS/summary.txt"
{
  echo "stage1 steps: ${steps[*]}; budget ${budget} s; OUT=$OUT; GEMMA_DIR=$GEMMA_DIR"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | head -2
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1 | head -5
} | tee "$summary"

# run NAME CAP_SECONDS COMMAND...: one step with a timeout cut to the budget left; log in $LOGS/NAME.log.
run() {
  local name="$1" cap="$2"; shift 2
  local left=$(( budget - ($(date +%s) - start) - 20 ))
  local limit=$(( cap < left ? cap : left ))
  if (( limit < 30 )); then
    echo "$name: SKIPPED (${left} s of budget left)" | tee -a "$summary"
    return 0
  fi
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (timeout $limit s)$( ((rc == 124)) && echo ' TIMED OUT')" | tee -a "$summary"
  return 0
}

for step in "${steps[@]}"; do
  case "$step" in
    api)
      run probe-api 60 python3 scripts/gpu/vllm/probe_api.py --out "$OUT/vllm-api.json"
      run check-channel 150 python3 scripts/gpu/vllm/check_channel.py --out "$OUT/vllm-channel.json" ;;
    gemma)
      run gemma 360 $SMOKE --model-dir "$GEMMA_DIR" "${SHARED[@]}" --kv-cache-gib 4 --max-model-len 32768 \
        "${TPUT[@]}" --out "$OUT/gemma-vllm.json" ;;
    dump)
      rm -rf /tmp/vllm-dump
      export UNIPREFILL_VLLM_DUMP_DIR=/tmp/vllm-dump
      run gemma-dump 240 $SMOKE --model-dir "$GEMMA_DIR" --dump-graph \
        "${SHARED[@]}" --kv-cache-gib 2 --max-model-len 4096 --out "$OUT/gemma-dump.json"
      if [[ -d /tmp/vllm-dump ]]; then
        tar -czf "$OUT/vllm-dump.tar.gz" -C /tmp vllm-dump
        echo "dump: $(ls /tmp/vllm-dump | wc -l) files, $(du -sh /tmp/vllm-dump | cut -f1) -> vllm-dump.tar.gz" | tee -a "$summary"
      else
        echo "dump: no /tmp/vllm-dump folder" | tee -a "$summary"
      fi ;;
    llama4drop)
      # the EXPERIMENTAL vLLM rewrite: drop at layer 1 of 4, keep 50% (dropped on the H200, 2026-12-01)
      run llama4-drop 240 $SMOKE --layers 4 --uniprefill "${SHARED[@]}" --kv-cache-gib 2 \
        --max-model-len 4096 --prompt-words 1000 \
        --uniprefill-settings '{"drop_layers": [1], "keep_ratio": 0.5, "min_tokens": 64, "vllm_drop": true}' \
        --out "$OUT/smoke-uniprefill-4l-drop.json"
      ;;
    gemmadrop)
      run gemma-drop 300 $SMOKE --model-dir "$GEMMA_DIR" --uniprefill "${SHARED[@]}" --kv-cache-gib 4 \
        --max-model-len 32768 --uniprefill-settings '{"p": 0.99, "min_tokens": 256, "vllm_drop": true}' \
        --out "$OUT/gemma-vllm-drop.json"
      ;;
    llama4)
      run llama4-uniprefill 240 $SMOKE --layers 4 --uniprefill "${SHARED[@]}" --kv-cache-gib 2 --max-model-len 4096 \
        --prompt-words 1000 --out "$OUT/smoke-uniprefill-4l.json" ;;
    needles)
      NP="python3 scripts/gpu/vllm/needle_parity.py"
      HAYSTACK="${HAYSTACK:-.gpu_data/PaulGrahamEssays.json}"
      NEEDLE=(--model-dir "$GEMMA_DIR" --haystack "$HAYSTACK" --samples "${NEEDLE_SAMPLES:-10}" --kv-cache-gib 8)
      run needles-standard 300 $NP run --system standard "${NEEDLE[@]}" --out "$OUT/needles-standard.jsonl"
      run needles-p099 300 $NP run --system uniprefill --settings '{"p": 0.99, "vllm_drop": true}' "${NEEDLE[@]}" \
        --out "$OUT/needles-p099.jsonl"
      run needles-compare 60 $NP compare "$OUT/needles-standard.jsonl" "$OUT/needles-p099.jsonl" \
        --out "$OUT/needles-compare-p099.json" ;;
    gemmadroptput)
      run gemma-drop-tput 420 $SMOKE --model-dir "$GEMMA_DIR" --uniprefill "${SHARED[@]}" --kv-cache-gib 4 \
        --max-model-len 32768 --uniprefill-settings '{"p": 0.95, "min_tokens": 256, "vllm_drop": true}' "${TPUT[@]}" \
        --out "$OUT/gemma-vllm-drop-tput.json"
      ;;
    llama8bdrop)
      run llama8b-drop 540 $SMOKE "${SHARED[@]}" --uniprefill --kv-cache-gib "${LLAMA_KV_GIB:-8}" --max-model-len 32768 \
        --uniprefill-settings '{"drop_layers": [7], "keep_ratio": 0.3, "min_tokens": 256, "vllm_drop": true}' "${TPUT[@]}" \
        --out "$OUT/llama8b-vllm-drop.json"
      ;;
    pytest)
      run vllm-pytest 420 env OUT="$OUT" bash scripts/gpu/vllm/pytest_vllm.sh ;;
    llama8btp2)
      run llama8b-tp2 540 $SMOKE "${SHARED[@]}" --tensor-parallel-size 2 --kv-cache-gib "${LLAMA_KV_GIB:-8}" --max-model-len 32768 \
        "${TPUT[@]}" --out "$OUT/llama8b-vllm-tp2.json" ;;
    llama8bdroptp2)
      run llama8b-drop-tp2 540 $SMOKE "${SHARED[@]}" --uniprefill --tensor-parallel-size 2 --kv-cache-gib 8 \
        --max-model-len 32768 --uniprefill-settings '{"drop_layers": [7], "keep_ratio": 0.3, "min_tokens": 256, "vllm_drop": true}' \
        "${TPUT[@]}" --out "$OUT/llama8b-vllm-drop-tp2.json"
      ;;
    llama8b)
      run llama8b 540 $SMOKE "${SHARED[@]}" --kv-cache-gib "${LLAMA_KV_GIB:-8}" --max-model-len 32768 \
        "${TPUT[@]}" --out "$OUT/llama8b-vllm.json" ;;
    llama8bdropcg)
      run llama8b-drop-cg 540 $SMOKE "${SHARED[@]}" --uniprefill --decode-graphs --kv-cache-gib "${LLAMA_KV_GIB:-8}" --max-model-len 32768 \
        --uniprefill-settings '{"drop_layers": [7], "keep_ratio": 0.3, "min_tokens": 256, "vllm_drop": true}' "${TPUT[@]}" \
        --out "$OUT/llama8b-vllm-drop-cg.json"
      ;;
    llama8beager)
      run llama8b-eager 540 $SMOKE "${SHARED[@]}" --eager --kv-cache-gib "${LLAMA_KV_GIB:-8}" --max-model-len 32768 \
        "${TPUT[@]}" --out "$OUT/llama8b-vllm-eager.json" ;;
    llama8bchannel)
      run llama8b-channel 540 $SMOKE "${SHARED[@]}" --uniprefill --kv-cache-gib "${LLAMA_KV_GIB:-8}" --max-model-len 32768 \
        "${TPUT[@]}" --out "$OUT/llama8b-vllm-channel.json" ;;
  esac
done

# The lines worth reading first (stdout and highlights.txt), then the packed logs.
for log in "$LOGS"/*.log; do
  name="$(basename "$log" .log)"
  echo "=== $name"
  grep -E "throughput: L=|^text: |attention backend|Using .* backend|unaccelerated|first token drop|drop totals|ranks_agree|EXPERIMENTAL|probe: |\"ok\"|Error|error:|Traceback" "$log" \
    | grep -v "^ *\"error\": null" | head -20 | cut -c1-240
  tail -2 "$log" | cut -c1-240
done > "$LOGS/highlights.txt"
cat "$LOGS/highlights.txt"
echo "stage1 done in $(( $(date +%s) - start )) s" >> "$summary"
echo "=== summary"; cat "$summary"   # last, so a cut output tail still shows every step's rc
tag="$(IFS=-; echo "${steps[*]}")"
tar -czf "$OUT/stage1-logs-${tag}.tar.gz" -C "$LOGS" .
ls -l "$OUT"
