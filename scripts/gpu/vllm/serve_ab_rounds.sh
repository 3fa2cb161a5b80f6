#!/usr/bin/env bash
# On the GPU box: alternating rounds of bench_serve.sh, one server start per system and round, the order reversed
# every other round (A B C, then C B A, ...), each round into OUT/rK; meant to run unattended in the background
# (the box's calls stop at 600 s), from a copy of the tree in /tmp:
#   cp -r . /tmp/repo && cd /tmp/repo && SETTINGS=... POINTS=... CLOCKS=1 \
#     setsid nohup bash scripts/gpu/vllm/serve_ab_rounds.sh /tmp/ab "standard uniprefill-split uniprefill" 2 &
# DEADLINE (epoch seconds): no server starts after it. Writes OUT/progress.txt (a line per finished server) and
# OUT/finished when done; read the rounds with serve_rounds.py OUT/r1 OUT/r2 ...
set -uo pipefail
OUT="${1:?usage: serve_ab_rounds.sh OUT \"SYSTEM ...\" ROUNDS}"
read -r -a systems <<< "${2:?systems}"
rounds="${3:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
for (( round = 1; round <= rounds; round++ )); do
  order=("${systems[@]}")
  if (( round % 2 == 0 )); then
    order=(); for (( i = ${#systems[@]} - 1; i >= 0; i-- )); do order+=("${systems[$i]}"); done
  fi
  for system in "${order[@]}"; do
    if [[ -n "${DEADLINE:-}" ]] && (( $(date +%s) > DEADLINE )); then
      echo "$(date -u +%T) r$round $system: not started (past DEADLINE)" >> "$OUT/progress.txt"; continue
    fi
    start=$(date +%s)
    SYSTEMS="$system" bash "$ROOT/scripts/gpu/vllm/bench_serve.sh" "$OUT/r$round" > "$OUT/r$round-$system.log" 2>&1
    echo "$(date -u +%T) r$round $system: rc $? in $(( $(date +%s) - start )) s" >> "$OUT/progress.txt"
  done
done
touch "$OUT/finished"
