#!/usr/bin/env bash
# Sourced by soak.sh and bench_serve.sh on the GPU box: one local `vllm serve` of the Llama-3.1-8B shape
# (dummy weights, max_model_len 32768) on 127.0.0.1:8000, on vLLM's defaults plus, for a system named
# uniprefill*, the one option `-cc {"inductor_compile_config": {"uniprefill": SETTINGS}}` (the system
# uniprefill-chunked adds "vllm_one_step_prefill": false: vLLM's own step budget, long prompts drop in their
# last chunk). The system standard-onestep is standard vLLM given the step budget a dropping server raises vLLM's
# to (prefill_budget.one_step_budget at max_model_len 32768 and vLLM 0.26's max_num_seqs 1024 for `vllm serve` on
# an H100 / H200: 33,791, as the uniprefill server logs) and nothing else: the budget's effect apart from the drop's.
# A system named *-split (standard-onestep-split, uniprefill-split) also ends a compiled range at 8192, vLLM's
# default budget for `vllm serve` (compilation_config.compile_ranges_endpoints): steps up to 8,192 tokens, the
# decodes among them, then run code compiled for standard's range (1, 8192) instead of (1, 33791).
#   serve_start SYSTEM LOG   (sets SERVER_PID; returns once /health answers; non-zero, the server stopped,
#                             if it died or did not answer within 300 s, or if port 8000 was taken already)
#   serve_stop               (also on the sourcing script's exit)
#   serve_model              (writes the model folder)
#   serve_setup              (the box's environment, uniprefill refreshed from this tree, the model folder)
#   serve_drop_totals        (uniprefill's drop totals of the running server, JSON, on stdout)
#   system_args SYSTEM       (the arguments SYSTEM adds to `vllm serve`, one a line; an unknown SYSTEM fails)
# Sources env.sh (VLLM_CLI). `vllm serve` needs the server wheels (box_install_server.sh).
# VLLM_SERVER_DEV_MODE=1 opens vLLM's /collective_rpc (the drop totals by name after a run).
SERVE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
source "$SERVE_ROOT/scripts/gpu/vllm/env.sh"
# SERVE_MODEL_DIR: a model folder with real weights (e.g. /tmp/gemma-270m from box_install_models.sh) instead of
# the Llama-3.1-8B shape with dummy weights
SERVE_MODEL="${SERVE_MODEL_DIR:-/tmp/llama8b-shaped-32}"
LOAD_ARGS=(--load-format dummy)
[[ -n "${SERVE_MODEL_DIR:-}" ]] && LOAD_ARGS=()
DEFAULT_SETTINGS='{"p": 1.0, "vllm_drop": true}'
SETTINGS="${SETTINGS:-$DEFAULT_SETTINGS}"
SERVER_PID=""
trap serve_stop EXIT

serve_model() {
  [[ -n "${SERVE_MODEL_DIR:-}" ]] && return 0
  python3 -P -c "from pathlib import Path; from uniprefill.testing.word_llama import write_model_folder as w; w(Path('$SERVE_MODEL'), 32)"
}

serve_setup() {
  bash "$SERVE_ROOT/scripts/gpu/vllm/box_refresh_uniprefill.sh" > /dev/null
  serve_model
}

system_settings() {  # SYSTEM: the uniprefill settings it runs with, as one line of JSON (fails on bad SETTINGS)
  python3 -c "import json, sys
s = json.loads(sys.argv[1])
if not isinstance(s, dict): raise SystemExit('SETTINGS is not a JSON object: ' + sys.argv[1])
if sys.argv[2] == 'uniprefill-chunked': s['vllm_one_step_prefill'] = False
print(json.dumps(s))" "$SETTINGS" "$1"
}

system_args() {  # SYSTEM: the arguments `vllm serve` gets beyond the shared ones, one a line
  local system="$1" cc=""
  case "$system" in
    standard|standard-onestep|standard-onestep-split|uniprefill|uniprefill-split|uniprefill-chunked) ;;
    *) echo "unknown system '$system'" >&2; return 1 ;;
  esac
  if [[ "$system" == uniprefill* ]]; then
    local settings
    settings="$(system_settings "$system")" || return 1
    cc="\"inductor_compile_config\": {\"uniprefill\": $settings}"
  fi
  if [[ "$system" == standard-onestep* ]]; then
    echo --max-num-batched-tokens
    python3 -P -c "from uniprefill.vllm.prefill_budget import one_step_budget; print(one_step_budget(32768, 1024))" \
      || return 1
  fi
  [[ "$system" == *-split ]] && cc="${cc:+$cc, }\"compile_ranges_endpoints\": [8192]"
  if [[ -n "$cc" ]]; then echo -cc; echo "{$cc}"; fi
}

serve_start() {
  local system="$1" log="$2" extra=() start
  local args
  args="$(system_args "$system")" || return 1
  [[ -n "$args" ]] && mapfile -t extra <<< "$args"
  if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2> /dev/null; then
    echo "$system: something already answers on 127.0.0.1:8000; not starting a second server"
    return 1
  fi
  start=$(date +%s)
  VLLM_SERVER_DEV_MODE=1 "${VLLM_CLI[@]}" serve "$SERVE_MODEL" "${LOAD_ARGS[@]}" --max-model-len 32768 --seed 0 \
    --host 127.0.0.1 --port 8000 "${extra[@]}" > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 150); do
    kill -0 "$SERVER_PID" 2> /dev/null || break
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2> /dev/null; then
      echo "$system: server up after $(( $(date +%s) - start )) s"
      return 0
    fi
    sleep 2
  done
  echo "$system: server did not come up"; grep -E "Traceback|Error" "$log" | head -3 | cut -c1-300
  serve_stop
  return 1
}

serve_drop_totals() {  # uniprefill's drop totals of the running server as JSON (soak.py's reader: a string saying
  # why where they cannot be read)
  python3 -P -c "import json, sys; sys.path.insert(0, '$SERVE_ROOT/scripts/gpu/vllm'); from urllib.parse import urlparse
from soak import drop_totals; print(json.dumps(drop_totals(urlparse('http://127.0.0.1:8000'))))"
}

serve_stop() {
  [[ -n "$SERVER_PID" ]] || return 0
  kill "$SERVER_PID" 2> /dev/null; wait "$SERVER_PID" 2> /dev/null
  SERVER_PID=""
}
