#!/usr/bin/env bash
# Issue 5, results item 1, on the GPU box: TTFT of the random-weight presets shaped like
# Llama-3.1-8B, Gemma-3-12B and Qwen3-Next-80B-A3B (128 of 512 experts, docs/gpu.md) at
# 8K / 32K / 64K / 128K, forced retention at ONE drop point (the preset's first "auto" drop
# layer, as the backend benchmark does: speed judged apart from attention patterns), with
# the FLOP-model and the measured ideal beside each speedup.
#   keep 0.5 / 0.3 / 0.15: 0.15 is about what Gemma-3-270M kept at p = 0.9 at 32K (overall
#   retention 0.14 in docs/benchmarks.md), i.e. "a retention measured on a real model".
# Needs nothing carried: the presets use only transformers 5.17's classes. Qwen3-Next's
# Gated DeltaNet runs transformers' PyTorch fallback here (no fla on the box): its baseline
# is that fallback, and so is ours.
#
#   UNIPREFILL_GIT_COMMIT=<git rev-parse --short HEAD, here> \
#   PRESETS="llama-3.1-8b gemma-3-12b qwen3-next-80b-a3b" LENGTHS=8k,32k,64k,128k \
#       bash scripts/gpu/bench_presets.sh
# (the box gets no .git: without UNIPREFILL_GIT_COMMIT the JSON files say git_commit null).
# Measured 2026-12-01 (docs/benchmarks.md): Llama-3.1-8B 8K-128K in 7 min (128K 186 s);
# Gemma-3-12B 8K 96 s, 32K 146 s, 128K > 240 s; Qwen3-Next (PyTorch fallbacks) 8K 136 s.
# Writes /tmp/bench-out/bench-<preset>-<length>.json and .log, then packs them into
# /tmp/bench-presets-<out folder>-<HHMM>.tar.gz (copy that to $OUT: at most 8 files come back per call).
# Each (preset, length) is one process under `timeout $PER_LENGTH` (default 240 s; Llama-3.1-8B at 128K
# needs ~150 s by the issue-3 timings), so a call of 10 minutes fits about one preset; run the others in the next calls.
set -uo pipefail
cd "$(dirname "$0")/../.."
PRESETS=${PRESETS:-"llama-3.1-8b gemma-3-12b"}
LENGTHS=${LENGTHS:-8k,32k,64k,128k}
PER_LENGTH=${PER_LENGTH:-240}
EXTRA=${EXTRA:-}  # more bench arguments, e.g. EXTRA="--num-layers 2 --device cpu" for a dry run
REPEATS=${REPEATS:-2}  # timed prefills per system (median); 1 at 128K where one prefill takes ~1 min and
                       # the spread at 64K was 0.1 ms in 16.6 s (docs/benchmarks.md)
OUT=${BENCH_OUT:-/tmp/bench-out}
# FLA_SITE: a folder holding fla-core and einops (`python3 -m pip install --no-index --no-deps --target
# /tmp/fla-site .whl_fla/*.whl`): Qwen3-Next's Gated DeltaNet then runs fla's Triton kernels instead of
# transformers' Python chunk loop (the JSON's versions say "fla-core"); use another BENCH_OUT for those runs.
FLA_SITE=${FLA_SITE:-}
PP=/tmp/pp-bench  # its own copy: eval_issue5.sh replaces /tmp/pp, and both may run in one machine session
mkdir -p "$OUT" "$PP" && rm -rf "$PP/uniprefill" && cp -r uniprefill "$PP/" && cp -r kernels "$PP/uniprefill/kernels"
export PYTHONPATH=$PP${FLA_SITE:+:$FLA_SITE} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
declare -A FIRST_DROP=([llama-3.1-8b]=7 [gemma-3-12b]=11 [qwen3-next-80b-a3b]=11)  # each preset's first "auto" drop layer
for preset in $PRESETS; do
    for length in ${LENGTHS//,/ }; do  # one process per length: a timeout loses that length only
        echo "== $preset $length from $(date -u +%T)"
        timeout "$PER_LENGTH" python3 -P -m uniprefill bench --model "$preset" --lengths "$length" \
            --keep-ratio 0.5,0.3,0.15 --drop-layers "${FIRST_DROP[$preset]}" --baseline eager \
            --measured-ideal --warmup 1 --repeats "$REPEATS" --inputs random --quiet $EXTRA \
            --out "$OUT/bench-$preset-$length.json" > "$OUT/bench-$preset-$length.log" 2>&1
        echo "rc=$? at $(date -u +%T)"
        grep -A8 "TTFT ms" "$OUT/bench-$preset-$length.log" | head -8
    done
done
tar -czf "$OUT/../bench-presets-$(basename "$OUT")-$(date -u +%H%M).tar.gz" -C "$OUT" . && ls -l "$OUT"/..
