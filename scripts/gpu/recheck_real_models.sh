#!/usr/bin/env bash
# Regression check of the real models on the GPU box (after box_install_models.sh): the same
# prompts as the committed issue-23 records of 2026-12-03 (samples 25..SAMPLES-1 of
# niah_single_1/2/3, niah_multikey_1, vt at 4K and 8K; baseline and the defaults: content p = 0.95,
# SmolLM2's drops 14,18,22,26, Gemma's "auto") answered again by this commit, then compared prompt
# by prompt with those records: identical predictions where nothing changed for these models.
#
# Usage (repo root on the box): UNIPREFILL_GIT_COMMIT=<hash> OUT_DIR=$OUT SAMPLES=50 BUDGET=400 \
#     bash scripts/gpu/recheck_real_models.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
R=$PWD/docs/results
OUT_DIR=${OUT_DIR:-/tmp/recheckout} SAMPLES=${SAMPLES:-50} BUDGET=${BUDGET:-400} PROCS=${PROCS:-7}
W=/tmp/recheck
mkdir -p "$W" "$OUT_DIR"
export PYTHONPATH=/tmp/site:/tmp/pp HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export UNIPREFILL_GEMMA_DIR=/tmp/gemma-270m UNIPREFILL_SMOLLM2_DIR=/tmp/smollm2-135m
TASKS=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt
COMMON=(--tasks "$TASKS" --lengths 4096,8192 --samples "$SAMPLES" --haystack /tmp/eval/PaulGrahamEssays.json
        --decode-sdpa no-cudnn --quiet --selection content --p 0.95 --timed-samples 0 --part untimed)
# samples 0-24 are skipped: they are in the records of 2026-12-02 (same keys)
SEED_S=(--also-done "$R/eval-issue23-h200-2026-12-02/eval-smollm2-issue23-h200.jsonl.gz")
SEED_G=(--also-done "$R/eval-issue23-h200-2026-12-02/eval-gemma-4k8k-issue23-h200.new.jsonl.gz"
        --also-done "$R/eval-gemma-issue5-h200.jsonl.gz")
cd /tmp
for i in $(seq 0 $((PROCS - 1))); do
    timeout "$BUDGET" python3 -P -m uniprefill eval --model /tmp/smollm2-135m --drop-layers 14,18,22,26 "${COMMON[@]}" \
        "${SEED_S[@]}" --shard "$i/$PROCS" --out "$W/smol-$i.jsonl" > "$W/smol-$i.log" 2>&1 &
    timeout "$BUDGET" python3 -P -m uniprefill eval --model gemma-3-270m --drop-layers auto "${COMMON[@]}" \
        "${SEED_G[@]}" --shard "$i/$PROCS" --out "$W/gemma-$i.jsonl" > "$W/gemma-$i.log" 2>&1 &
done
wait
cat "$W"/smol-[0-9]*.jsonl "$W"/gemma-[0-9]*.jsonl | gzip > "$OUT_DIR/recheck.jsonl.gz"
python3 -P - "$OUT_DIR/recheck.jsonl.gz" "$R/eval-issue23-h200-2026-12-03" "${UNIPREFILL_GIT_COMMIT:-unknown}" \
    > "$OUT_DIR/recheck.txt" <<'PY'
import glob, gzip, json, sys
from collections import defaultdict
new = [json.loads(l) for l in gzip.open(sys.argv[1], "rt") if l.strip()]
old = {tuple(r["key"]): r for f in glob.glob(f"{sys.argv[2]}/s4-*-new.jsonl.gz") for r in map(json.loads, gzip.open(f, "rt"))}
rows = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])  # paired, same prediction, old score, new score, retention
for r in new:
    o = old.get(tuple(r["key"]))
    if o is None:
        continue
    g = rows[(r["model"].split("/")[-1], r["system_label"], r["length"])]
    g[0] += 1; g[1] += r["prediction"] == o["prediction"]; g[2] += o["score"]; g[3] += r["score"]
    g[4] += r.get("overall_retention") or 1.0
print(f"commit {sys.argv[3]} against the records of commit 59a8b07 (docs/results/eval-issue23-h200-2026-12-03), "
      f"{len(new)} new records")
print(f"{'model':<16} {'system':<30} {'length':>6} {'pairs':>5} {'same prediction':>15} {'score 59a8b07':>13} {'score now':>9} {'retention':>9}")
for (model, system, length), (n, same, a, b, keep) in sorted(rows.items()):
    print(f"{model:<16} {system:<30} {length:>6} {n:>5} {same:>15} {100 * a / n:>13.1f} {100 * b / n:>9.1f} {keep / n:>9.3f}")
PY
cat "$OUT_DIR/recheck.txt"; tail -n 2 "$W"/*.log > "$OUT_DIR/recheck-logs-tail.txt"
