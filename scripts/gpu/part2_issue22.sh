#!/usr/bin/env bash
# Issue 22 Part 2 on the GPU box, one unattended run that ends by DEADLINE (epoch seconds): speed
# at 128K (uniprefill keep 0.3 alone and with block-sparse attention before the first drop point,
# forced keep 0.05 / 0.15), then 32K (the same, and MInference at its defaults and forced), then
# SmolLM2-135M accuracy at 4K / 8K (early sparse keep 0.05 and p 0.9, MInference, FlexPrefill at a
# fixed 512-token budget) beside the issue-23 records. Needs `STAGES=setup` of peers_issue22.sh and
# box_install_models.sh first. Results in /tmp/peers-out.
#   DEADLINE=$(( $(date +%s) + 560 )) bash scripts/gpu/part2_issue22.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE=${DEADLINE:?epoch seconds by which the run must end}
OUT=/tmp/peers-out
mkdir -p "$OUT"
left() { echo $((DEADLINE - $(date +%s))); }
STAGES=speed LENGTHS=131072 SPEED_PEERS="" EARLY_SPARSE="off,keep=0.05,keep=0.15" BUDGET=$(left) OUT_DIR=$OUT \
    bash scripts/gpu/peers_issue22.sh
STAGES=speed LENGTHS=32768 SPEED_PEERS="minference minference:vertical_size={mv},slash_size={mv}" \
    EARLY_SPARSE="off,keep=0.05,keep=0.15" BUDGET=$(left) OUT_DIR=$OUT bash scripts/gpu/peers_issue22.sh
STAGES=accuracy PROCS=14 BUDGET=$(( $(left) - 45 )) EARLY_SPARSE="off,keep=0.05,p=0.9" OUT_DIR=$OUT \
    ACC_PEERS="minference flexprefill:gamma=1.0,tau=0,min_budget=512,max_budget=512" bash scripts/gpu/peers_issue22.sh
echo "DONE at $(date -u +%T)"
