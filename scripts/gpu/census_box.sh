#!/usr/bin/env bash
# The full architecture census (`uniprefill census`) on the GPU box's CPU cores, in PROCS
# parallel processes (one thread each), after box_install_models.sh put transformers 5.24 in
# /tmp/site and uniprefill in /tmp/pp. The census runs tiny random models on the CPU: the box is
# used for its 16 cores (about 3 minutes instead of 35 on a 2-core machine). Writes
# $OUT_DIR/census.jsonl and $OUT_DIR/architectures.md (the table of docs/architectures.md).
#
# Usage (repo root on the box): OUT_DIR=$OUT PROCS=15 BUDGET=420 bash scripts/gpu/census_box.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT_DIR:-/tmp/censusout} PROCS=${PROCS:-15} BUDGET=${BUDGET:-420}
W=/tmp/census
mkdir -p "$W" "$OUT_DIR"
export PYTHONPATH=/tmp/site:/tmp/pp HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
cd /tmp  # -P and a neutral folder: the checkout's uniprefill/ (no kernels/ inside) is never imported
types=$(python3 -P -c "from uniprefill.testing.census import causal_lm_types; print(' '.join(causal_lm_types()))")
# longest first (the slow hybrids of the committed census), then round-robin over the processes
i=0
declare -a lists
for t in kimi_linear falcon_h1 minimax bamba zamba2 zamba jamba granitemoehybrid nemotron_h falcon_mamba $types; do
    case " ${seen:-} " in *" $t "*) continue;; esac
    seen="${seen:-} $t"
    lists[$((i % PROCS))]+="${lists[$((i % PROCS))]:+,}$t"
    i=$((i + 1))
done
echo "$i model types in $PROCS processes, from $(date -u +%T)"
for p in $(seq 0 $((PROCS - 1))); do
    timeout "$BUDGET" python3 -P -m uniprefill census --types "${lists[$p]}" --out "$W/census-$p.jsonl" \
        > "$W/census-$p.log" 2>&1 &
done
wait
cat "$W"/census-[0-9]*.jsonl > "$OUT_DIR/census.jsonl"
# the table of the rows that finished (a type cut by the budget is listed, not run again here)
finished=$(python3 -P - "$OUT_DIR/census.jsonl" $types <<'PY'
import json, sys
done = {json.loads(line)["model_type"] for line in open(sys.argv[1]) if line.strip()}
missing = [t for t in sys.argv[2:] if t not in done]
print(f"not finished within the budget: {missing}", file=sys.stderr)
print(",".join(sorted(done)))
PY
)
python3 -P -m uniprefill census --types "$finished" --out "$OUT_DIR/census.jsonl" --table "$OUT_DIR/architectures.md"
echo "done at $(date -u +%T): $(wc -l < "$OUT_DIR/census.jsonl") rows"; head -8 "$OUT_DIR/architectures.md" | tail -4
tail -n 3 "$W"/census-*.log > "$OUT_DIR/census-logs-tail.txt"
