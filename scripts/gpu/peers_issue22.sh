#!/usr/bin/env bash
# Issue 22 on the GPU box: the peers (FlexPrefill, XAttention, MInference) beside uniprefill.
# Run from the repo root (or a copy of it) with the .gpu_peers folder of prepare_peers_payload.sh.
#   STAGES=setup,test,speed,accuracy (default: all), OUT_DIR (default /tmp/peers-out),
#   LENGTHS (speed; default 32768,65536,131072), BUDGET seconds (default 560).
# setup: minference's sdist unpacked to /tmp/peers (on PYTHONPATH as is), einops into
#   /tmp/peersite, uniprefill copied to /tmp/pp in the installed layout; MInference's CUDA index
#   builder compiled once (cached under ~/.cache/uniprefill/minference_cuda).
# test: the GPU tests of tests/peers/test_peers.py (each real peer at full density equals dense) and of
#   tests/passes/test_sparse_prefill.py (compiled flex_attention equals the reference).
# speed: `uniprefill bench` on the Llama-3.1-8B shape (random weights, bf16), one process per
#   length: the eager baseline, uniprefill keep 0.3, each peer at its published defaults and at
#   an attention density forced near 0.3 (FlexPrefill: gamma 1, tau 0, budget 0.0817 n tokens per
#   vertical and slash set; XAttention: threshold 0.3; MInference: 0.08 n vertical lines and
#   0.08 n diagonals): the density each really had is in the results.
# SPEED_PEERS / ACC_PEERS: the --peer specs of each stage (space-separated; {fb} and {mv} stand for
#   the forced budgets above); EARLY_SPARSE: --early-sparse of the uniprefill systems (Part 2:
#   block-sparse attention before the first drop point), e.g. "off,keep=0.1".
# accuracy: SmolLM2-135M 4K and 8K (after box_install_models.sh), the 5 RULER-style tasks x 25,
#   untimed, each peer at its defaults; the baseline and uniprefill records come from the
#   issue-23 run (same prompts, same box type) through --also-done.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
STAGES=${STAGES:-setup,test,speed,accuracy}
OUT_DIR=${OUT_DIR:-/tmp/peers-out}
LENGTHS=${LENGTHS:-131072,32768,65536}  # the target length first: a short budget still measures it
BUDGET=${BUDGET:-560}
PROCS=${PROCS:-8}
SPEED_PEERS=${SPEED_PEERS-"flexprefill xattention minference flexprefill:gamma=1.0,tau=0,min_budget={fb},max_budget={fb} xattention:threshold=0.3 minference:vertical_size={mv},slash_size={mv}"}
ACC_PEERS=${ACC_PEERS-"flexprefill xattention minference"}
EARLY_SPARSE=${EARLY_SPARSE:-off}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
has() { [[ ",$STAGES," == *",$1,"* ]]; }
mkdir -p "$OUT_DIR"
export PYTHONPATH=/tmp/site:/tmp/pp:/tmp/peersite:/tmp/peers/minference-0.1.6.0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export UNIPREFILL_SMOLLM2_DIR=/tmp/smollm2-135m

if has setup; then
    mkdir -p /tmp/peers /tmp/peersite /tmp/pp
    (cd .gpu_peers && sha256sum -c --quiet SHA256SUMS) || { echo "error: .gpu_peers is incomplete" >&2; exit 1; }
    tar xzf .gpu_peers/minference-0.1.6.0.tar.gz -C /tmp/peers
    python3 -m pip install -q --no-index --no-deps --target /tmp/peersite .gpu_peers/einops-*.whl 2>&1 | grep -v -i warning
    rm -rf /tmp/pp/uniprefill && cp -r uniprefill /tmp/pp/ && cp -r kernels /tmp/pp/uniprefill/kernels
    (cd /tmp && python3 -c "
import time; t = time.time()
from uniprefill.peers.minference_loader import load
for m in ('modules.flexprefill', 'modules.xattention', 'ops.pit_sparse_flash_attention_v2'):
    load(m)
print(f'peers loaded (MInference index builder compiled or cached) in {time.time() - t:.0f} s')
") 2>&1 | tail -3
fi
if has test; then
    (cd /tmp && python3 -m pytest -q -p no:cacheprovider "$REPO/tests/peers/test_peers.py" "$REPO/tests/passes/test_sparse_prefill.py" -m gpu \
        --rootdir "$REPO" 2>&1 | tail -15) | tee "$OUT_DIR/test-peers-gpu.log"
fi
if has speed; then
    for n in ${LENGTHS//,/ }; do
        [ "$(left)" -gt 60 ] || { echo "speed: budget spent before $n"; break; }
        fb=$(python3 -c "print(round(0.0817 * $n))"); mv=$(python3 -c "print(round(0.08 * $n))")
        peers=(); for spec in $SPEED_PEERS; do spec=${spec//\{fb\}/$fb}; peers+=(--peer "${spec//\{mv\}/$mv}"); done
        echo "speed $n from $(date -u +%T), $(left) s left"
        # cores 0-3: another job (e.g. the model conversion of box_install_models.sh) may use the rest
        (cd /tmp && timeout "$(left)" taskset -c 0-3 python3 -P -m uniprefill bench --model llama-3.1-8b --lengths "$n" \
            --baseline eager --warmup 1 --repeats 3 --inputs random --keep-ratio 0.3 \
            --early-sparse "$EARLY_SPARSE" "${peers[@]}" --out "$OUT_DIR/speed-llama8b-$n.json" --quiet) > "$OUT_DIR/speed-$n.log" 2>&1
        tail -12 "$OUT_DIR/speed-$n.log"
    done
fi
if has accuracy; then
    TASKS=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt
    SMOL=(--model /tmp/smollm2-135m --tasks "$TASKS" --lengths 4096,8192 --samples 25
          --haystack /tmp/eval/PaulGrahamEssays.json --decode-sdpa no-cudnn --quiet
          --selection content --p 0.95 --drop-layers "14,18,22,26" --early-sparse "$EARLY_SPARSE")
    peers=(); for spec in $ACC_PEERS; do peers+=(--peer "$spec"); done
    SEED="$REPO/docs/results/eval-issue23-h200-2026-12-02/eval-smollm2-issue23-h200.jsonl.gz"
    W=/tmp/peers-acc; mkdir -p "$W"; zcat "$SEED" > "$W/seed.jsonl"
    echo "accuracy from $(date -u +%T), $(left) s left"
    for i in $(seq 0 $((PROCS - 1))); do
        (cd /tmp && OMP_NUM_THREADS=2 timeout "$(left)" python3 -P -m uniprefill eval "${SMOL[@]}" \
            "${peers[@]}" --timed-samples 0 --part untimed \
            --shard "$i/$PROCS" --also-done "$W/seed.jsonl" --out "$W/peers-$i.jsonl" > "$W/peers-$i.log" 2>&1) &
    done
    wait
    cat "$W"/peers-*.jsonl > "$W/peers-all.jsonl"
    cat "$W/seed.jsonl" "$W/peers-all.jsonl" > "$W/merged.jsonl"
    (cd /tmp && python3 -P -m uniprefill eval "${SMOL[@]}" "${peers[@]}" \
        --summary-only --out "$W/merged.jsonl" --summary "$W/summary.json" \
        --plot "$OUT_DIR/pareto-smollm2-peers-h200.png") > "$OUT_DIR/smollm2-peers-table.txt" 2>&1
    gzip -c "$W/peers-all.jsonl" > "$OUT_DIR/eval-smollm2-peers-h200.jsonl.gz"
    tail -3 "$W"/peers-0.log
    echo "accuracy done at $(date -u +%T): $(wc -l < "$W/peers-all.jsonl") records"
fi
