#!/usr/bin/env bash
# On the GPU box (vLLM installed by box_install.sh; SmolLM2 by box_install_models.sh for the set
# "smollm2"): engines on vLLM's DEFAULT settings, standard vs. the one uniprefill option, each in its
# own process, back to back, then compared (scripts/gpu/vllm/compare_engines.py).
#   bash scripts/gpu/vllm/defaults_grid.sh smollm2|llama OUT_DIR
# smollm2: SmolLM2-135M (real weights, 8K): 120 parity prompts (32..~8K tokens) + prefill throughput at
#          2048/7000 x batch 1/4/16, for standard, p = 1, p = 0.95 and keep 0.3 at layer 7.
# llama:   a Llama-3.1-8B shape (dummy weights, 32K): prefill throughput at 8192/16384/32000 x batch 1/4,
#          8 decode tokens, for standard and keep 0.3 at layer 7.
set -uo pipefail
SET="${1:?usage: defaults_grid.sh smollm2|llama OUT_DIR}"; OUT="${2:?OUT_DIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu/vllm/env.sh"
bash "$ROOT/scripts/gpu/vllm/box_refresh_uniprefill.sh"
export UNIPREFILL_HAYSTACK=/tmp/eval/PaulGrahamEssays.json
run() {  # name, timeout, arguments...
  local name="$1" limit="$2"; shift 2
  local start=$(date +%s)
  timeout "$limit" python3 -P "$ROOT/scripts/gpu/vllm/defaults_engine.py" "$@" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/$name.log" | cut -c1-300
}
compare() { python3 -P "$ROOT/scripts/gpu/vllm/compare_engines.py" "$OUT/$1.json" "$OUT/$2.json" --out "$OUT/compare-$2.json" \
  | python3 -c "import json,sys; d=json.load(sys.stdin); p=d['parity']; print('$2:', 'parity', p and (p['identical'], p['prompts']), 'throughput', [(r['length'], r['batch'], r['ratio']) for r in d['throughput']], 'drops', str(d['drop_totals'])[:300])"; }
case "$SET" in
  smollm2)
    M=(--model-dir /tmp/smollm2-135m --parity 120 --throughput-lengths 2048,7000 --throughput-batches 1,4,16)
    run standard 170 "${M[@]}"
    run p1 170 "${M[@]}" --uniprefill '{"p": 1.0, "vllm_drop": true}'
    run p095 170 "${M[@]}" --uniprefill '{"p": 0.95, "vllm_drop": true}'
    for x in p1 p095; do compare standard $x; done ;;
  llama)
    L=(--layers 32 --throughput-lengths 8192,16384,32000 --throughput-batches 1,4 --decode-tokens 8)
    run standard 280 "${L[@]}"
    run keep03 280 "${L[@]}" --uniprefill '{"keep_ratio": 0.3, "drop_layers": [7], "vllm_drop": true}'
    compare standard keep03 ;;
  *) echo "unknown set $SET" >&2; exit 2 ;;
esac
