#!/usr/bin/env bash
# On the GPU box (vLLM installed by box_install.sh; SmolLM2 by box_install_models.sh): engines on vLLM's
# DEFAULT settings, standard vs. the one uniprefill option, each in its own process, back to back, then
# compared with the standard engine of the same model (scripts/gpu/vllm/compare_engines.py).
#   bash scripts/gpu/vllm/defaults_grid.sh OUT_DIR RUN...
# RUN: MODEL-VARIANT.
#   MODEL smollm2: SmolLM2-135M (real weights, 8K): 120 parity prompts (32..~8K tokens, 16 greedy tokens),
#          120 needle prompts (2048/4096/7900 tokens, 4 RULER tasks) and, unless SKIP_THROUGHPUT=1, prefill
#          throughput at 2048/7000 x batch 1/4/16
#   MODEL smollm2pw: the same with cudagraph_mode PIECEWISE (a diagnosis of p = 1 parity: decode without full
#          graphs; its variants compare with smollm2pw-standard)
#   MODEL llama: a Llama-3.1-8B shape (dummy weights, 32K context): prefill throughput at 8192/16384 x batch
#          1/4 with 8 decode tokens; llama32k: the same at 32000 tokens (longer than vLLM's default step
#          budget of 16384: chunked)
#   MODEL qwen3next: a Qwen3-Next-80B-A3B shape (dummy weights, 12 layers: Gated DeltaNet x 3 then full
#          attention, at 3 / 7 / 11; 512 experts, 10 active; about 40 GB): prefill throughput at 8192/16384/32000 x
#          batch 1/4 with 8 decode tokens (keep03 drops after layer 7, p095 where the option chooses)
#   MODEL qwen3nextpar: the same Qwen3-Next shape, 60 parity prompts (32..~32K tokens, 16 greedy tokens with
#          logprobs; the word-level tokenizer over the haystack), submitted at once and then again (prefix-cache
#          hits), no throughput: p = 1 against standard through the Gated DeltaNet metadata rebuild; the dummy
#          weights' matrices refilled with normal(0, 0.02) (--spread-dummy-weights, since 2026-12-06's second session:
#          before, every output was token 0 and the parity vacuous); qwen3nextpar-p095 runs the rebuild (rows removed)
#   MODEL gemma: Gemma-3-270M (real weights, 32K; box_install_models.sh cuda): 120 parity prompts (32..~32K
#          tokens) generated twice (the second pass hits the prefix cache), 80 needle prompts (4096/16384) and,
#          unless SKIP_THROUGHPUT=1, prefill throughput at 8192/16384/32000 x batch 1/4/16 (median of 5 calls)
#   VARIANT standard | again (a second standard engine) | onestep (standard with max_num_batched_tokens 33791, the
#          budget uniprefill's one-step prefill gives a dropping engine of 32K context at max_num_seqs 1024: gemma,
#          llama32k; the same step composition as p095 / keep03, to tell the budget's effect from the drop's; an
#          engine at p = 1 keeps vLLM's budget) | onestepsplit (onestep with vLLM's default budget, 16384 for `LLM` on
#          an H200, kept as the end of a compiled range: steps up to it run a graph compiled as standard's; gemma)
#          | p095split (p095 with the same range end) | nocombo (standard with Inductor's combo kernels on and
#          benchmark_combo_kernel off, as uniprefill's hook sets it; the run in vllm-gemma-p1-controls-h200-2026-12-05
#          gave only benchmark_combo_kernel, which made vLLM leave combo kernels off altogether) | p1 | p095 | p099 | keep03 (the option:
#          {"p": 1.0} / {"p": 0.95} / {"p": 0.99} / {"keep_ratio": 0.3, "drop_layers": [7]}, each with
#          "vllm_drop": true) | p099chunk2k (p099 with max_num_batched_tokens 2048: prompts chunked, the last
#          chunk drops; p095chunk2k the same at p = 0.95, no throughput) | keep03onestep (keep03 with max_num_batched_tokens 32768: prompts in one step) |
#          p1keepplan (p1 with the diagnosis aid UNIPREFILL_DEBUG_KEEP_FA3_PLAN=1, sound at p = 1 only) |
#          p1last (p1 with one drop point, after the last layer but one: SmolLM2's layer 28) | p1nohint (p1 with
#          Inductor's own unbacked_symint_fallback, 8192, for the kept rows: how uniprefill compiled the
#          pieces after a drop before it gave them the token count's hint) | p1combo (p1 with the diagnosis
#          aid UNIPREFILL_DEBUG_KEEP_COMBO_BENCHMARK=1: Inductor's benchmark_combo_kernel left on) | p095perrow (p095
#          with the A/B aid UNIPREFILL_DEBUG_PER_ROW_WINDOW=1: the per-row window kernel in prefill steps, as before
#          2026-12-04's tiled default) | p095unsplit (p095 with the A/B aid UNIPREFILL_DEBUG_UNSPLIT_WINDOW=1: decode
#          rows on one program each of the window kernel, as before 2026-12-05's split-KV default) | det (standard with
#          Inductor's deterministic mode, with benchmark_combo_kernel off, which that mode refuses: reduction
#          launch configs picked without timing) | p1det (p1 with the same;
#          compared with det, not standard: the rewrite's arithmetic apart from the autotuner's timing-based choices)
#          | detonestep / p1detonestep (det / p1det with max_num_batched_tokens 33791: no prompt longer than a step, though a batched pass still splits the
#          prompts at a step's end; p1detonestep
#          compared with detonestep)
# A RUN may end in .N (gemma-standard.2, gemma-p095.2): another start of the same engine under its own file name;
# scripts/gpu/vllm/pooled_grid.py reads a grid of several starts per engine against standard's own spread
# (run them interleaved: gemma-standard gemma-p095 gemma-standard.2 gemma-p095.2, two engines per device call).
# FRESH_CACHE=1 gives every engine its own vLLM cache, as DUMP_CODE=1 does: a later start of the same engine then
# compiles and tunes again instead of loading the first one's graphs (a noise estimate that includes the autotuner).
# DUMP_CODE=1 gives each engine a fresh vLLM cache (VLLM_CACHE_ROOT=OUT_DIR/cache-RUN) and keeps the Python
# Inductor generated there (the Triton kernels of every piece) and the launch configs its autotuner picked
# (`*.best_config`) in OUT_DIR/code-RUN.tar.gz, to diff two runs.
# SKIP_NEEDLES=1 leaves the needle prompts out; LOGPROBS=1 records the parity tokens' logprobs
# (compare_engines.py then says where two runs' numbers first part: the prefill or a decode step);
# SEQUENTIAL_AFTER=1 (gemma) adds a third pass in the same engine: the prefix cache emptied, the parity prompts one at
# a time (chunked_parity.py --pass sequential_after). SKIP_PARITY=1 (gemma) leaves the parity passes out (a
# throughput grid only, as pooled_grid.py reads). RECORD_STEPS=1 (gemma; not a default: the engine core in the
# script's process, every request added before the first step) records the first parity pass's schedule
# (chunked_parity.py then names the prompts the two engines scheduled apart): the run that tells other chunk
# boundaries from other arithmetic, RECORD_STEPS=1 SKIP_THROUGHPUT=1 SKIP_NEEDLES=1 LOGPROBS=1 ... gemma-det gemma-p1det.
# SEQUENTIAL=1 generates the parity prompts one at a time (no batch composition in the comparison). Both for
# smollm2 and gemma.
set -uo pipefail
OUT="${1:?usage: defaults_grid.sh OUT_DIR RUN...}"; shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # absolute: DUMP_CODE writes its archive from inside the cache folder
source "$ROOT/scripts/gpu/vllm/env.sh"
bash "$ROOT/scripts/gpu/vllm/box_refresh_uniprefill.sh" > /dev/null
export UNIPREFILL_HAYSTACK=/tmp/eval/PaulGrahamEssays.json
SMOLLM2=(--model-dir /tmp/smollm2-135m --parity 120)
[[ "${SKIP_NEEDLES:-0}" == 1 ]] || SMOLLM2+=(--needles 2048,4096,7900)
[[ "${LOGPROBS:-0}" == 1 ]] && SMOLLM2+=(--parity-logprobs)
[[ "${SEQUENTIAL:-0}" == 1 ]] && SMOLLM2+=(--parity-sequential)
[[ "${SKIP_THROUGHPUT:-0}" == 1 ]] || SMOLLM2+=(--throughput-lengths 2048,7000 --throughput-batches 1,4,16)
GEMMA=(--model-dir /tmp/gemma-270m --max-model-len 32768)
[[ "${SKIP_PARITY:-0}" == 1 ]] || GEMMA+=(--parity 120 --parity-repeat)
[[ "${SEQUENTIAL_AFTER:-0}" == 1 ]] && GEMMA+=(--parity-sequential-after)
[[ "${RECORD_STEPS:-0}" == 1 ]] && GEMMA+=(--record-steps)
[[ "${LOGPROBS:-0}" == 1 ]] && GEMMA+=(--parity-logprobs)
[[ "${SEQUENTIAL:-0}" == 1 ]] && GEMMA+=(--parity-sequential)
[[ "${SKIP_NEEDLES:-0}" == 1 ]] || GEMMA+=(--needles 4096,16384)
[[ "${SKIP_THROUGHPUT:-0}" == 1 ]] || GEMMA+=(--throughput-lengths 8192,16384,32000 --throughput-batches 1,4,16 --throughput-repeats 5 --decode-tokens 8)
LLAMA=(--layers 32 --throughput-lengths 8192,16384 --throughput-batches 1,4 --decode-tokens 8)
LLAMA32K=(--layers 32 --throughput-lengths 32000 --throughput-batches 1,4 --decode-tokens 8)
QWEN3NEXT=(--qwen3next-layers 12 --throughput-lengths 8192,16384,32000 --throughput-batches 1,4 --decode-tokens 8)
QWEN3NEXTPAR=(--qwen3next-layers 12 --parity 60 --parity-repeat --parity-logprobs --spread-dummy-weights 0.02)
declare -A SETTINGS=([standard]="" [p1]='{"p": 1.0, "vllm_drop": true}' [p095]='{"p": 0.95, "vllm_drop": true}'
                     [p099]='{"p": 0.99, "vllm_drop": true}'
                     [keep03]='{"keep_ratio": 0.3, "drop_layers": [7], "vllm_drop": true}')
without_throughput() {  # the arguments less --throughput-lengths/--throughput-batches/--decode-tokens and their values
  local skip=0
  for a in "$@"; do
    if (( skip )); then skip=0; continue; fi
    case "$a" in --throughput-lengths|--throughput-batches|--throughput-repeats|--decode-tokens) skip=1 ;; *) echo "$a" ;; esac
  done
}
for name in "$@"; do
  model="${name%%-*}" variant="${name#*-}"
  variant="${variant%.[0-9]*}"  # RUN.N: the N-th start of the same engine (pooled_grid.py reads several)
  case "$model" in smollm2) args=("${SMOLLM2[@]}") ;; smollm2pw) args=("${SMOLLM2[@]}" --cudagraph-mode PIECEWISE) ;; llama) args=("${LLAMA[@]}") ;; gemma) args=("${GEMMA[@]}") ;; llama32k) args=("${LLAMA32K[@]}") ;; qwen3next) args=("${QWEN3NEXT[@]}") ;; qwen3nextpar) args=("${QWEN3NEXTPAR[@]}") ;;
    *) echo "unknown run $name" >&2; exit 2 ;; esac
  envs=()
  case "$variant" in
    again) ;;
    onestep) args+=(--max-num-batched-tokens 33791) ;;  # standard with the step budget uniprefill's one-step prefill sets
    onestepsplit) args+=(--max-num-batched-tokens 33791 --compile-ranges-endpoints 16384) ;;
    p095split) args+=(--uniprefill "${SETTINGS[p095]}" --compile-ranges-endpoints 16384) ;;
    p1keepplan) args+=(--uniprefill "${SETTINGS[p1]}"); envs=(UNIPREFILL_DEBUG_KEEP_FA3_PLAN=1) ;;
    p1last) args+=(--uniprefill '{"p": 1.0, "vllm_drop": true, "drop_layers": [28]}') ;;
    p1nohint) args+=(--uniprefill "${SETTINGS[p1]}" --inductor '{"unbacked_symint_fallback": 8192}') ;;
    p1combo) args+=(--uniprefill "${SETTINGS[p1]}"); envs=(UNIPREFILL_DEBUG_KEEP_COMBO_BENCHMARK=1) ;;
    p095perrow) args+=(--uniprefill "${SETTINGS[p095]}"); envs=(UNIPREFILL_DEBUG_PER_ROW_WINDOW=1) ;;
    p095unsplit) args+=(--uniprefill "${SETTINGS[p095]}"); envs=(UNIPREFILL_DEBUG_UNSPLIT_WINDOW=1) ;;
    # vLLM sets combo_kernels and benchmark_combo_kernel only where the user gives neither: name both
    nocombo) args+=(--inductor '{"combo_kernels": true, "benchmark_combo_kernel": false}') ;;
    # deterministic mode refuses vLLM's benchmark_combo_kernel (an untimed-choice mode: standard vLLM fails to start
    # with it, H100 2026-12-05), so both engines turn it off; uniprefill's hook does so in a rewritten graph anyway
    det) args+=(--inductor '{"deterministic": true, "combo_kernels": true, "benchmark_combo_kernel": false}') ;;
    p1det) args+=(--uniprefill "${SETTINGS[p1]}"
                  --inductor '{"deterministic": true, "combo_kernels": true, "benchmark_combo_kernel": false}') ;;
    detonestep) args+=(--inductor '{"deterministic": true, "combo_kernels": true, "benchmark_combo_kernel": false}'
                       --max-num-batched-tokens 33791) ;;
    p1detonestep) args+=(--uniprefill "${SETTINGS[p1]}" --max-num-batched-tokens 33791
                         --inductor '{"deterministic": true, "combo_kernels": true, "benchmark_combo_kernel": false}') ;;
    p099chunk2k) args+=(--uniprefill "${SETTINGS[p099]}" --max-num-batched-tokens 2048) ;;
    p095chunk2k) args=($(without_throughput "${args[@]}")); args+=(--uniprefill "${SETTINGS[p095]}" --max-num-batched-tokens 2048) ;;
    keep03onestep) args+=(--uniprefill "${SETTINGS[keep03]}" --max-num-batched-tokens 32768) ;;
    *) [[ -v "SETTINGS[$variant]" ]] || { echo "unknown variant $variant" >&2; exit 2; }
       [[ -n "${SETTINGS[$variant]}" ]] && args+=(--uniprefill "${SETTINGS[$variant]}") ;;
  esac
  if [[ "${DUMP_CODE:-0}" == 1 || "${FRESH_CACHE:-0}" == 1 ]]; then  # compiled and tuned afresh, not loaded
    rm -rf "$OUT/cache-$name"; envs+=(VLLM_CACHE_ROOT="$OUT/cache-$name")
  fi
  start=$(date +%s)
  env "${envs[@]}" timeout 420 python3 -P "$ROOT/scripts/gpu/vllm/defaults_engine.py" "${args[@]}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s"
  grep -E "Traceback|Error" "$OUT/$name.log" | head -3 | cut -c1-300
  if [[ "${DUMP_CODE:-0}" == 1 ]]; then
    (cd "$OUT/cache-$name" && find . \( -name "*.py" -o -name "*.best_config" \) -print0 | tar -czf "$OUT/code-$name.tar.gz" --null -T -)
    echo "$name: $(tar -tzf "$OUT/code-$name.tar.gz" | wc -l) generated files in code-$name.tar.gz"
  fi
  baseline=standard  # like against like: both in deterministic mode (and at one budget)
  [[ "$variant" == p1det ]] && baseline=det; [[ "$variant" == p1detonestep ]] && baseline=detonestep
  if [[ "$variant" != standard && -f "$OUT/$model-$baseline.json" ]]; then
    python3 -P "$ROOT/scripts/gpu/vllm/compare_engines.py" "$OUT/$model-$baseline.json" "$OUT/$name.json" \
      --out "$OUT/compare-$name.json" | python3 -c "import json,sys; d=json.load(sys.stdin); p=d['parity']
print('$name:', 'parity', p and (p['identical'], p['prompts']), 'repeat', p and p.get('repeat'), 'throughput', [(r['length'], r['batch'], r['ratio']) for r in d['throughput']], 'drops', str(d['drop_totals'])[:300])"
    if [[ -f "$OUT/$model-standard.needles.jsonl" && -f "$OUT/$name.needles.jsonl" ]]; then
      python3 -P "$ROOT/scripts/gpu/vllm/needle_parity.py" compare "$OUT/$model-standard.needles.jsonl" \
        "$OUT/$name.needles.jsonl" --out "$OUT/needles-$name.json"
    fi
  fi
done
