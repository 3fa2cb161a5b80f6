#!/usr/bin/env bash
# On the GPU box (vLLM installed by box_install.sh): vLLM's own `vllm bench serve` against a local `vllm serve`,
# standard vLLM on its defaults and the same server plus the one uniprefill option (serve_lib.sh), per prompt
# length and client concurrency, then the side-by-side table (scripts/gpu/vllm/serve_table.py). Run on the H200
# since 2026-12-04 (docs/results/vllm-bench-serve-*).
#   SETTINGS='{"keep_ratio": 0.3, "drop_layers": [7], "vllm_drop": true}' bash scripts/gpu/vllm/bench_serve.sh OUT_DIR [LENGTHS] [CONCURRENCIES] [NUM_PROMPTS]
# LENGTHS default 8192,16384,28672; CONCURRENCIES 1,4,16; NUM_PROMPTS 32 per point (random dataset, 16 output
# tokens, --ignore-eos). Each point has its own --seed (the same for both systems): vLLM's random dataset builds
# prompt i from an offset drawn from the seed, so one seed for every point repeats the same prompts and standard
# vLLM serves the later points from its prefix cache (the run of 2026-12-04). 28672, not 32000: the word-level
# test tokenizer spends 5.4 characters per token, and vLLM rejects a prompt over 5 x max_model_len characters. One server per system serves every point (about two minutes to start with the compile).
# POINTS="16384:4 28672:16" runs those (length:concurrency) points instead of the LENGTHS x CONCURRENCIES grid.
# SYSTEMS="standard" or "uniprefill" runs one side only (one call each on the box, whose calls stop at 600 s);
# "uniprefill-chunked" is uniprefill with vLLM's own step budget, "standard-onestep" standard vLLM with the budget a
# dropping server raises it to, "standard-onestep-split" / "uniprefill-split" those with a compiled range ending
# at vLLM's budget (serve_lib.sh's system_args). A point whose result file OUT_DIR
# already holds is kept, so a call cut at 600 s is continued by the same command in the next call (the box keeps
# /tmp between back-to-back calls; each call starts its server again, about 150 s). The table is made from
# whatever results OUT_DIR holds.
# A uniprefill system's point also leaves SYSTEM-L-cC.totals: the server's drop totals before and after it
# (vLLM's /collective_rpc, VLLM_SERVER_DEV_MODE=1), whence the table's retention.
# --save-detailed keeps each request's inter-token gaps (`itls`), whence serve_table.py's second table: the first
# gap after the first token against the later ones (a one-time step after a drop, or a slower decode throughout).
# CLOCKS=1: nvidia-smi samples the GPU's SM and memory clocks, power, utilisation, temperature and (where the
# driver has them) the clock event reasons every 10 ms during each point (SYSTEM-L-cC.clocks.csv with a header,
# gzipped after the point) beside SYSTEM-L-cC.clock0.json (the host's
# wall clock and the monotonic clock the client stamps requests with, read together; clock1.json again after the
# point), whence serve_clocks.py places the driver's readings (refreshed about every 100 ms) in each request.
set -uo pipefail
OUT="${1:?usage: bench_serve.sh OUT_DIR [LENGTHS] [CONCURRENCIES] [NUM_PROMPTS]}"
LENGTHS="${2:-8192,16384,28672}"
CONCURRENCIES="${3:-1,4,16}"
NUM_PROMPTS="${4:-32}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu/vllm/serve_lib.sh"  # env.sh, SERVE_MODEL, serve_*
sampler=""
trap 'serve_stop; [[ -n "$sampler" ]] && kill "$sampler" 2> /dev/null' EXIT  # CLOCKS=1's nvidia-smi too
serve_setup
echo "$SETTINGS" > "$OUT/settings.json"
grid_points() {  # one "LENGTH CONCURRENCY" line per point
  if [[ -n "${POINTS:-}" ]]; then
    for point in $POINTS; do
      [[ "$point" =~ ^[0-9]+:[0-9]+$ ]] || { echo "POINTS: '$point' is not LENGTH:CONCURRENCY" >&2; return 1; }
    done
    for point in $POINTS; do echo "${point%%:*} ${point##*:}"; done; return
  fi
  for length in ${LENGTHS//,/ }; do for concurrency in ${CONCURRENCIES//,/ }; do echo "$length $concurrency"; done; done
}
grid_points > /dev/null || exit 2
clock_pair() {  # the host's wall clock and the monotonic one `vllm bench serve` stamps requests with, read together
  python3 -c "import json, time; print(json.dumps({'wall': time.time(), 'monotonic': time.perf_counter(),
'utc_offset_s': time.localtime().tm_gmtoff}))"
}
clock_fields() {  # nvidia-smi's fields for CLOCKS=1: the basic ones, and the clock event reasons and instant power
  # where this driver knows them (an unknown field stops nvidia-smi; older drivers name the reasons "throttle")
  local fields="timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu" extra
  for extra in clocks_event_reasons.active,clocks_throttle_reasons.active power.draw.instant; do
    for name in ${extra//,/ }; do
      if nvidia-smi --query-gpu="$name" --format=csv,noheader > /dev/null 2>&1; then fields+=",$name"; break; fi
    done
  done
  echo "$fields"
}
failed=0  # server starts and clients that failed: the exit status says so after the tables
[[ "${CLOCKS:-0}" == 1 ]] && fields="$(clock_fields)"
for system in ${SYSTEMS:-standard uniprefill}; do
  todo=0
  while read -r length concurrency; do
    [[ -s "$OUT/$system-$length-c$concurrency.json" ]] || todo=$(( todo + 1 ))
  done < <(grid_points)
  (( todo )) || { echo "$system: every point already in $OUT"; continue; }
  serve_start "$system" "$OUT/$system.server.log" || { failed=1; continue; }
  while read -r length concurrency <&3; do  # fd 3: the clients cannot eat the list
    if [[ -s "$OUT/$system-$length-c$concurrency.json" ]]; then
      echo "$system $length c$concurrency: kept from an earlier call"; continue
    fi
    start=$(date +%s)
    [[ "$system" == uniprefill* ]] && before=$(serve_drop_totals)
    sampler=""
    if [[ "${CLOCKS:-0}" == 1 ]]; then
      clock_pair > "$OUT/$system-$length-c$concurrency.clock0.json"
      nvidia-smi --query-gpu="$fields" --format=csv,nounits -lms 10 \
        > "$OUT/$system-$length-c$concurrency.clocks.csv" 2>&1 &
      sampler=$!
    fi
    timeout 600 "${VLLM_CLI[@]}" bench serve --backend vllm --base-url http://127.0.0.1:8000 --model "$SERVE_MODEL" \
      --dataset-name random --random-input-len "$length" --random-output-len 16 --ignore-eos \
      --num-prompts "$NUM_PROMPTS" --max-concurrency "$concurrency" --seed "$(( length * 100 + concurrency ))" \
      --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 \
      --save-result --save-detailed --result-dir "$OUT" --result-filename "$system-$length-c$concurrency.json" \
      > "$OUT/$system-$length-c$concurrency.log" 2>&1
    client=$?
    echo "$system $length c$concurrency: exit $client in $(( $(date +%s) - start )) s"
    (( client == 0 )) || failed=1
    if [[ -n "$sampler" ]]; then
      kill "$sampler"; wait "$sampler" 2> /dev/null; sampler=""
      clock_pair > "$OUT/$system-$length-c$concurrency.clock1.json"  # serve_clocks.py warns if they drifted
      gzip -f "$OUT/$system-$length-c$concurrency.clocks.csv"
    fi
    [[ "$system" == uniprefill* ]] && printf '{"before": %s, "after": %s}\n' "$before" "$(serve_drop_totals)" \
      > "$OUT/$system-$length-c$concurrency.totals"  # serve_table.py's retention column
  done 3< <(grid_points)
  serve_stop
done
python3 -P "$ROOT/scripts/gpu/vllm/serve_table.py" "$OUT"; status=$?
if [[ "${CLOCKS:-0}" == 1 ]]; then python3 -P "$ROOT/scripts/gpu/vllm/serve_clocks.py" "$OUT" || status=$?; fi
(( status == 0 && failed )) && status=1
exit "$status"
