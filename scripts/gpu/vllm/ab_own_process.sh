#!/usr/bin/env bash
# On the GPU box (vLLM from box_install.sh, Gemma-3-270M from box_install_models.sh cuda): a before/after of the
# vLLM runtime on ONE machine. Hosts of one machine kind differ about twice in speed (docs/results/vllm-h100-2026-12-06g),
# so a change to the runtime's host work is only measured when both trees run on the same box, back to back.
#
#   bash scripts/gpu/vllm/ab_own_process.sh OUT_DIR RUN...
#
# Each RUN is `standard` (vLLM without uniprefill), `head` (this tree) or `NAME=DIR` (DIR holds an older
# `uniprefill/` and `kernels/`, e.g. from `git archive OLD uniprefill kernels`, carried to the box in a git-ignored
# folder). Each run starts its own engine (vLLM's own process, as vLLM runs by default) and times LENGTH x BATCH
# prefills (default 8192 x 16, REPEATS=9, medians) with scripts/gpu/vllm/profile_prefill.py --own-process at
# P (default 0.95); TRACE=1 adds one traced prefill and summarises the drop points' and the window calls' host work
# (OUT_DIR/NAME-inside-OP.json); TRACE_STACK=1 records Python stacks too and keeps the trace (OUT_DIR/NAME.pt.trace.json.gz),
# to name the callers of host ops (its host times are inflated: not for walls). Tree runs replace the installed package (/tmp/usite) by that tree; the script
# puts this tree back at the end. Results go straight into OUT_DIR (an outer `timeout` must not lose them).
# Order matters: on 2026-12-06 the first uniprefill engine of each call was the slowest in all three calls
# (docs/results/vllm-h100-2026-12-06h); name the runs in an ABBA order (`head old=DIR old=DIR head`: files head,
# old, old-2, head-2) and read the pairs. On a fresh box the first engine compiles from nothing and autotunes FlashInfer
# (2026-12-06 on an H200: over 135 s, RUN_TIMEOUT's share of a call): give the first run more, or let a throwaway
# first run warm the caches (docs/results/vllm-h200-2026-12-06i).
set -uo pipefail
OUT="${1:?usage: ab_own_process.sh OUT_DIR RUN...}"; shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu/vllm/env.sh"
settings="{\"p\": ${P:-0.95}, \"vllm_drop\": true}"

install_tree() {  # the package files of tree $1 into /tmp/usite (the wheel's metadata and entry point stay)
  rm -rf /tmp/usite/uniprefill && cp -r "$1/uniprefill" /tmp/usite/uniprefill && cp -r "$1/kernels" /tmp/usite/uniprefill/kernels
  find /tmp/usite/uniprefill -name __pycache__ -prune -exec rm -rf {} +
}

declare -A seen=()
for run in "$@"; do
  name="${run%%=*}"
  seen[$name]=$(( ${seen[$name]:-0} + 1 ))
  (( ${seen[$name]} > 1 )) && name="$name-${seen[$name]}"  # a run named again: its own files (ABBA orders)
  args=(--model-dir /tmp/gemma-270m --length "${LENGTH:-8192}" --batch "${BATCH:-16}"
                          --repeats "${REPEATS:-9}" --own-process --out "$OUT/$name.json")
  case "$run" in
    standard) ;;
    head) install_tree "$ROOT"; args+=(--uniprefill "$settings") ;;
    *=*) install_tree "${run#*=}"; args+=(--uniprefill "$settings") ;;
    *) echo "unknown run $run (standard | head | NAME=DIR)" >&2; exit 2 ;;
  esac
  [[ "${TRACE:-0}" == 1 && "$run" != standard ]] && { rm -rf "/tmp/trace-$name"; args+=(--trace-dir "/tmp/trace-$name"); }
  [[ "${TRACE:-0}" == 1 && "${TRACE_STACK:-0}" == 1 && "$run" != standard ]] && args+=(--trace-stack)
  start=$(date +%s)
  timeout "${RUN_TIMEOUT:-420}" python3 -P "$ROOT/scripts/gpu/vllm/profile_prefill.py" "${args[@]}" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s; $(grep -h -m1 prefill_wall_ms_median "$OUT/$name.log" | cut -c1-200)"
  grep -E "Traceback|Error" "$OUT/$name.log" | head -3 | cut -c1-300
  gzip -f "$OUT/$name.log"
  trace=""  # only this run's trace (an earlier call's may still lie in /tmp)
  [[ "${TRACE:-0}" == 1 ]] && trace="$(find "/tmp/trace-$name" -name '*.pt.trace.json*' 2>/dev/null | head -1)"
  if [[ -n "$trace" ]]; then
    [[ "${TRACE_STACK:-0}" == 1 ]] && cp "$trace" "$OUT/$name.pt.trace.json.gz"
    for op in vllm_drop vllm_window_attention; do
      python3 -P "$ROOT/scripts/gpu/vllm/profile_prefill.py" --summarise-trace "$trace" --inside "uniprefill::$op" \
        > "$OUT/$name-inside-$op.json" 2>&1
    done
  fi
done
install_tree "$ROOT"
