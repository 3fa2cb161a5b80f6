#!/usr/bin/env bash
# Issue 23's evals on the GPU box (after box_install_models.sh), in the background of a device
# call, resumable; everything under /tmp/eval23, results copied to $OUT_DIR at the end:
#   S1  SmolLM2-135M, 4K and 8K, untimed, PROCS_S processes: baseline, the paper's rule at
#       p = 0.99 and "content" at p = 0.95, each with drop_layers "auto" (6, 10, 14, 18, 22, 26)
#       and with the late set 14, 18, 22, 26 (from the first layer that ranks the needle well,
#       docs/selection.md).
# GEMMA_LENGTHS (default 16384,32000) sets the Gemma lengths of S2 and S3; SEED_TIMED=1 keeps the
# seed's timed records too (for an untimed-only run: STAGES=S3 TIMED=0).
#   S2  Gemma-3-270M at 16K and 32,000, timed (alone on the GPU, after WAIT_FOR exists):
#       baseline, paper p = 0.99 "auto" and content p = 0.95 "auto", the first TIMED samples.
#   S3  Gemma-3-270M at 16K and 32,000, untimed, PROCS_G processes: content p = 0.95 "auto";
#       the baseline and the paper's rule come from the committed issue-5 records (same
#       prompts: the record keys name model, system hash, task, length, sample, seed, haystack).
# Usage (repo root on the box; the box has no .git, so pass the commit):
#   UNIPREFILL_GIT_COMMIT=<hash> OUT_DIR=/tmp/eval23out BUDGET=1100 bash scripts/gpu/eval_issue23.sh
#   S4  more samples at the short lengths (SAMPLES_SHORT per task, default 100), 4K then 8K, untimed:
#       baseline and the defaults (content p = 0.95; SmolLM2's drops named 14,18,22,26, which is what
#       "auto" gives it, so its S1 records keep their key) on SmolLM2 (PROCS_S) and Gemma (PROCS_G) at
#       once; samples 0-24 come from the committed records of S1 / S3 (same prompts, same keys).
# STAGES=S1,S2,S3 picks stages (S4 only when named); COLLECT_ONLY=1 only merges and summarises.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT_DIR:-/tmp/eval23out} BUDGET=${BUDGET:-1100} STAGES=${STAGES:-S1,S2,S3}
PROCS_S=${PROCS_S:-8} PROCS_G=${PROCS_G:-10} TIMED=${TIMED:-2} WAIT_FOR=${WAIT_FOR:-}
GEMMA_LENGTHS=${GEMMA_LENGTHS:-16384,32000}  # S2 and S3 (the seed keeps the committed untimed records of these)
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
W=/tmp/eval23
mkdir -p "$W" "$OUT_DIR"
export PYTHONPATH=/tmp/site:/tmp/pp HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export UNIPREFILL_GEMMA_DIR=/tmp/gemma-270m UNIPREFILL_SMOLLM2_DIR=/tmp/smollm2-135m
[ -f "$W/seed-gemma.jsonl.gz" ] || python3 - docs/results/eval-gemma-issue5-h200.jsonl.gz "$W/seed-gemma.jsonl.gz" "$GEMMA_LENGTHS" "${SEED_TIMED:-0}" <<'PY'
import gzip, json, sys
# untimed records at GEMMA_LENGTHS only: the timed ones are timed again side by side in S2
lengths, keep_timed = {int(x) for x in sys.argv[3].split(",")}, sys.argv[4] == "1"
with gzip.open(sys.argv[1], "rt") as f, gzip.open(sys.argv[2], "wt") as out:
    for line in f:
        r = json.loads(line) if line.strip() else None
        if r is not None and r["length"] in lengths and (not r["timed"] or keep_timed):
            out.write(line)
PY
TASKS=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt
HAY=(--haystack /tmp/eval/PaulGrahamEssays.json)
SMOL=(--model /tmp/smollm2-135m --tasks "$TASKS" --lengths 4096,8192 --samples 25 "${HAY[@]}"
      --decode-sdpa no-cudnn --quiet)
# content first: a budget that runs out leaves the new rule measured (the paper rule has CPU data)
SMOL_SYSTEMS=("--selection content --p 0.95" "--selection paper --p 0.99")
GEMMA=(--model gemma-3-270m --tasks "$TASKS" --lengths "$GEMMA_LENGTHS" --samples 25 "${HAY[@]}"
       --decode-sdpa no-cudnn --timed-samples "$TIMED" --quiet)
cd "$W"  # nothing below reads the working tree (a later device call may replace it)
has() { [[ ",$STAGES," == *",$1,"* ]]; }

if [ "${COLLECT_ONLY:-0}" != 1 ]; then
if has S1; then
    echo "S1 SmolLM2 from $(date -u +%T), $(left) s left"
    for i in $(seq 0 $((PROCS_S - 1))); do
        ( for systems in "${SMOL_SYSTEMS[@]}"; do
              [ "$(left)" -gt 20 ] || break
              # shellcheck disable=SC2086
              OMP_NUM_THREADS=2 timeout "$(left)" python3 -P -m uniprefill eval "${SMOL[@]}" $systems \
                  --drop-layers "auto;14,18,22,26" --timed-samples 0 --part untimed --shard "$i/$PROCS_S" \
                  --out "$W/smol-$i.jsonl" >> "$W/smol-$i.log" 2>&1
          done ) &
    done
    wait
    echo "S1 done at $(date -u +%T): $(cat "$W"/smol-*.jsonl | wc -l) records"
fi
if [ -n "$WAIT_FOR" ]; then
    echo "waiting for $WAIT_FOR"; until [ -e "$WAIT_FOR" ] || [ "$(left)" -lt 60 ]; do sleep 5; done
fi
if has S2 && [ "$(left)" -gt 120 ]; then
    echo "S2 Gemma timed from $(date -u +%T), $(left) s left"
    for systems in "--selection paper --p 0.99" "--selection content --p 0.95"; do
        # shellcheck disable=SC2086
        timeout "$(left)" python3 -P -m uniprefill eval "${GEMMA[@]}" $systems --drop-layers auto \
            --part timed --out "$W/gemma-timed.jsonl" >> "$W/gemma-timed.log" 2>&1
    done
    echo "S2 done at $(date -u +%T): $(wc -l < "$W/gemma-timed.jsonl") records"
fi
if has S3 && [ "$(left)" -gt 60 ]; then
    for length in ${GEMMA_LENGTHS//,/ }; do
        [ "$(left)" -gt 40 ] || break
        echo "S3 Gemma untimed $length from $(date -u +%T), $(left) s left"
        for i in $(seq 0 $((PROCS_G - 1))); do
            OMP_NUM_THREADS=1 timeout "$(left)" python3 -P -m uniprefill eval "${GEMMA[@]}" --selection content --p 0.95 \
                --drop-layers auto --lengths "$length" --part untimed --shard "$i/$PROCS_G" \
                --also-done "$W/seed-gemma.jsonl.gz" --out "$W/gemma-$i.jsonl" >> "$W/gemma-$i.log" 2>&1 &
        done
        wait
    done
    echo "S3 done at $(date -u +%T)"
fi
if has S4; then
    R=$OLDPWD/docs/results
    SEED_S=$R/eval-issue23-h200-2026-12-02/eval-smollm2-issue23-h200.jsonl.gz
    SEED_G=(--also-done "$R/eval-issue23-h200-2026-12-02/eval-gemma-4k8k-issue23-h200.new.jsonl.gz"
            --also-done "$R/eval-gemma-issue5-h200.jsonl.gz")
    cp -f "$SEED_S" "$W/s4-seed-smol.jsonl.gz"; cp -f "${SEED_G[1]}" "$W/s4-seed-gemma-a.jsonl.gz"; cp -f "${SEED_G[3]}" "$W/s4-seed-gemma-b.jsonl.gz"
    for length in 4096 8192; do
        [ "$(left)" -gt 40 ] || break
        echo "S4 length $length from $(date -u +%T), $(left) s left"
        for i in $(seq 0 $((PROCS_S - 1))); do
            OMP_NUM_THREADS=1 timeout "$(left)" python3 -P -m uniprefill eval "${SMOL[@]}" --selection content --p 0.95 \
                --drop-layers 14,18,22,26 --lengths "$length" --samples "${SAMPLES_SHORT:-100}" --timed-samples 0 \
                --part untimed --shard "$i/$PROCS_S" --also-done "$W/s4-seed-smol.jsonl.gz" \
                --out "$W/s4-smol-$i.jsonl" >> "$W/s4-smol-$i.log" 2>&1 &
        done
        for i in $(seq 0 $((PROCS_G - 1))); do
            OMP_NUM_THREADS=1 timeout "$(left)" python3 -P -m uniprefill eval "${GEMMA[@]}" --selection content --p 0.95 \
                --drop-layers auto --lengths "$length" --samples "${SAMPLES_SHORT:-100}" --timed-samples 0 \
                --part untimed --shard "$i/$PROCS_G" --also-done "$W/s4-seed-gemma-a.jsonl.gz" \
                --also-done "$W/s4-seed-gemma-b.jsonl.gz" --out "$W/s4-gemma-$i.jsonl" >> "$W/s4-gemma-$i.log" 2>&1 &
        done
        wait
    done
    echo "S4 done at $(date -u +%T): $(cat "$W"/s4-smol-*.jsonl | wc -l) SmolLM2 and $(cat "$W"/s4-gemma-*.jsonl | wc -l) Gemma records"
fi
fi
# merge and summarise (whatever ran)
if has S4; then  # the short-length tables: baseline and the defaults only, the seed's records included
    python3 - "$W" <<'PY'
import glob, gzip, json, sys
w = sys.argv[1]
keep = {"baseline", "uniprefill-c743f65c01a3813e", "uniprefill-921108ae5010ef23"}  # content p = 0.95 (SmolLM2 drops named / auto)
for name, seeds in (("smol", ["s4-seed-smol.jsonl.gz"]), ("gemma", ["s4-seed-gemma-a.jsonl.gz", "s4-seed-gemma-b.jsonl.gz"])):
    seen, rows = set(), []
    lines = [l for s in seeds for l in gzip.open(f"{w}/{s}", "rt")]
    lines += [l for f in sorted(glob.glob(f"{w}/s4-{name}-[0-9]*.jsonl")) for l in open(f)]
    for line in lines:
        r = json.loads(line) if line.strip() else None
        if r is None or r["system"] not in keep or r["length"] not in (4096, 8192) or r["index"] >= 100:
            continue
        key = (r["system"], r["task"], r["length"], r["index"], r["haystack"])
        if key not in seen:
            seen.add(key); rows.append(line if line.endswith("\n") else line + "\n")
    open(f"{w}/s4-{name}-all.jsonl", "w").writelines(rows)
PY
    for name in smol gemma; do
        args=("${SMOL[@]}"); [ $name = gemma ] && args=("${GEMMA[@]}")
        python3 -P -m uniprefill eval "${args[@]}" --summary-only --out "$W/s4-$name-all.jsonl" \
            --summary "$OUT_DIR/s4-$name.summary.json" > "$OUT_DIR/s4-$name-table.txt" 2>&1
        cat "$W"/s4-$name-[0-9]*.jsonl 2>/dev/null | gzip -c > "$OUT_DIR/s4-$name-new.jsonl.gz"
        grep -E "average" "$OUT_DIR/s4-$name-table.txt"
    done
    tail -n 3 "$W"/s4-*.log > "$OUT_DIR/s4-logs-tail.txt" 2>/dev/null
    exit 0
fi
cat "$W"/smol-*.jsonl > "$W/smollm2-all.jsonl" 2>/dev/null
{ zcat "$W/seed-gemma.jsonl.gz"; cat "$W"/gemma-timed.jsonl "$W"/gemma-[0-9]*.jsonl 2>/dev/null; } > "$W/gemma-all.jsonl"
python3 -P -m uniprefill eval "${SMOL[@]}" --summary-only --out "$W/smollm2-all.jsonl" \
    --summary "$OUT_DIR/eval-smollm2-issue23-h200.summary.json" --plot "$OUT_DIR/pareto-smollm2-issue23-h200.png" \
    > "$OUT_DIR/smollm2-table.txt" 2>&1
python3 -P -m uniprefill eval "${GEMMA[@]}" --summary-only --out "$W/gemma-all.jsonl" \
    --summary "$OUT_DIR/eval-gemma-issue23-h200.summary.json" --plot "$OUT_DIR/pareto-gemma-issue23-h200.png" \
    > "$OUT_DIR/gemma-table.txt" 2>&1
gzip -c "$W/smollm2-all.jsonl" > "$OUT_DIR/eval-smollm2-issue23-h200.jsonl.gz"
cat "$W"/gemma-timed.jsonl "$W"/gemma-[0-9]*.jsonl 2>/dev/null | gzip -c > "$OUT_DIR/eval-gemma-issue23-h200.new.jsonl.gz"
tail -n 4 "$W"/*.log > "$OUT_DIR/eval-logs-tail.txt" 2>/dev/null
grep -E "average" "$OUT_DIR/smollm2-table.txt" "$OUT_DIR/gemma-table.txt" | head -60
