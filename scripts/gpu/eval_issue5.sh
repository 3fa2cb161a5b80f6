#!/usr/bin/env bash
# Issue 5's accuracy minimum on the GPU box, resumable across device calls (run it again in
# the next call of the same warm machine and it carries on where the last one stopped).
#
# Gemma-3-270M (converted by gpu_install_gemma.sh into /tmp/gemma-270m), tasks niah_single_1..3,
# niah_multikey_1 and vt at 4K / 8K / 16K / 32,000 tokens, 25 samples each, the baseline and
# p in {0.8, 0.9, 0.95, 0.99} x drop layers {"all", "auto"}, cumulative.
#   Stage A (alone on the GPU): samples 0..TIMED-1 of every cell, TTFT timed (1 warm-up, 1 timed).
#   Stage B (PROCS processes at once): the remaining samples, generated and scored, untimed.
# Decode steps run without cuDNN's SDPA (see uniprefill/measure/sdpa.py); prefills use the default.
# Everything lands in /tmp/eval (kept between calls); each call ends by copying the result
# files (gzip) and the summary to $OUT. Stops itself after BUDGET seconds.
#
# The box gets no .git: pass the commit so that every record names it, e.g. in the device call
#   UNIPREFILL_GIT_COMMIT=<output of `git rev-parse HEAD` here> BUDGET=540 bash scripts/gpu/eval_issue5.sh
# Usage (repo root on the box): BUDGET=540 bash scripts/gpu/eval_issue5.sh
#   continuing the committed records: SEED=docs/results/eval-gemma-issue5-h200.jsonl.gz BUDGET=540 ...
# Stage B runs the lengths of UNTIMED_LENGTHS one after the other (all PROCS processes on one
# length, so that a budget that runs out leaves whole lengths done rather than scattered
# cells), for the drop sets of UNTIMED_DROP (default: both).
# Background use (so that other device calls can follow while it runs): give OUT a folder in
# /tmp and start it under setsid; a later call copies that folder to its own $OUT. The seed is
# copied into /tmp/eval first, because a later call may replace the working tree.
#   COLLECT_ONLY=1: skip stages A and B, only merge, summarise and write $OUT (e.g. after
#   stopping a background run early).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/evalout}
mkdir -p "$OUT"
BUDGET=${BUDGET:-540}
TIMED=${TIMED:-2}
PROCS=${PROCS:-4}
UNTIMED_LENGTHS=${UNTIMED_LENGTHS:-4096,8192,16384,32000}
UNTIMED_DROP=${UNTIMED_DROP:-all;auto}
START=$(date +%s)
export PYTHONPATH=/tmp/site:/tmp/pp UNIPREFILL_GEMMA_DIR=/tmp/gemma-270m PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/pp /tmp/eval && rm -rf /tmp/pp/uniprefill && cp -r uniprefill /tmp/pp/ \
    && cp -r kernels /tmp/pp/uniprefill/kernels
[ -f /tmp/eval/PaulGrahamEssays.json ] || cp .gpu_data/PaulGrahamEssays.json /tmp/eval/
COMMON=(--model gemma-3-270m --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt
        --lengths 4096,8192,16384,32000 --samples 25 --p 0.8,0.9,0.95,0.99 --drop-layers "all;auto"
        --policy cumulative --haystack /tmp/eval/PaulGrahamEssays.json --timed-samples "$TIMED"
        --decode-sdpa no-cudnn --quiet)
# Records of an earlier session (e.g. docs/results/eval-gemma-issue5-h200.jsonl.gz) count as
# done when SEED names them; they are merged into what this call returns.
# RETIME_LENGTHS=16384,32000: leave the seed's TIMED records of those lengths out, so that stage
# A times them again (with MEASURED_IDEAL=1 it also measures each method prompt's ideal).
SEED=${SEED:-}
if [ -n "$SEED" ]; then
    [ -f /tmp/eval/seed.jsonl.gz ] || python3 - "$SEED" /tmp/eval/seed.jsonl.gz "${RETIME_LENGTHS:-}" <<'PY'
import gzip, json, sys
source, target, retime = sys.argv[1], sys.argv[2], {int(x) for x in sys.argv[3].split(",") if x}
with gzip.open(source, "rt") as f, gzip.open(target, "wt") as out:
    for line in f:
        record = json.loads(line) if line.strip() else None
        if record is not None and not (record["timed"] and record["length"] in retime):
            out.write(line)
PY
    SEED=/tmp/eval/seed.jsonl.gz
    COMMON+=(--also-done "$SEED")
fi
left() { echo $((BUDGET - ($(date +%s) - START))); }
cd /tmp/eval  # nothing below reads the working tree (a later device call may replace it)

if [ "${COLLECT_ONLY:-0}" != 1 ]; then
echo "stage A (timed) from $(date -u +%T), $(left) s left"
MEASURE=(); if [ "${MEASURED_IDEAL:-0}" = 1 ]; then MEASURE=(--measured-ideal); fi
timeout "$(left)" python3 -P -m uniprefill eval "${COMMON[@]}" "${MEASURE[@]}" --part timed --out /tmp/eval/timed.jsonl \
    > /tmp/eval/timed.log 2>&1
echo "stage A rc=$? at $(date -u +%T): $(wc -l < /tmp/eval/timed.jsonl) records"
if [ "$(left)" -gt 60 ]; then
    for length in ${UNTIMED_LENGTHS//,/ }; do
        [ "$(left)" -gt 30 ] || break
        echo "stage B (untimed, $length tokens, drop sets $UNTIMED_DROP, $PROCS processes) from $(date -u +%T), $(left) s left"
        for i in $(seq 0 $((PROCS - 1))); do
            OMP_NUM_THREADS=${STAGE_B_THREADS:-2} timeout "$(left)" python3 -P -m uniprefill eval "${COMMON[@]}" --part untimed --shard "$i/$PROCS" \
                --lengths "$length" --drop-layers "$UNTIMED_DROP" \
                --out "/tmp/eval/untimed-$i.jsonl" >> "/tmp/eval/untimed-$i.log" 2>&1 &
        done
        wait
    done
    echo "stage B done at $(date -u +%T): $(cat /tmp/eval/untimed-*.jsonl | wc -l) records"
fi
fi
{ if [ -n "$SEED" ]; then zcat -f "$SEED"; fi; cat /tmp/eval/timed.jsonl /tmp/eval/untimed-*.jsonl 2>/dev/null; } \
    > /tmp/eval/all.jsonl
python3 -P -m uniprefill eval "${COMMON[@]}" --summary-only --out /tmp/eval/all.jsonl \
    --summary /tmp/eval/summary.json --plot "$OUT/pareto-gemma-issue5-h200.png" > "$OUT/summary-table.txt" 2>&1
gzip -c /tmp/eval/all.jsonl > "$OUT/eval-gemma-issue5-h200.jsonl.gz"
cp /tmp/eval/summary.json "$OUT/eval-gemma-issue5-h200.summary.json"
tail -n 3 /tmp/eval/*.log > "$OUT/eval-logs-tail.txt"
cat "$OUT/summary-table.txt" | grep -E "average|^length" | head -60
