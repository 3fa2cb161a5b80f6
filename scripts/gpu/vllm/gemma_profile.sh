#!/usr/bin/env bash
# On the GPU box (vLLM from box_install.sh, Gemma-3-270M from box_install_models.sh cuda); each engine takes 2.5-3.5
# minutes to start, so one or two engines a call: RUNS=standard (with the kernel bench), then RUNS="p095 p095unsplit" SKIP_BENCH=1:
# why Gemma-3-270M on vLLM's defaults at p = 0.95 was 0.68-0.91x standard (docs/results/vllm-gemma-defaults-h200-2026-12-04).
#   1. both paged-window kernels (per row, tiled) at Gemma's sliding-layer shapes (benchmarks/bench_paged_window.py);
#   2. one 32000-token prefill and 16 decode tokens under torch.profiler (scripts/gpu/vllm/profile_prefill.py):
#      standard vLLM, uniprefill p = 0.95 (the tiled window kernel in prefill steps), and the same uniprefill engine
#      again with the per-row kernel there (--per-row-too: UNIPREFILL_DEBUG_PER_ROW_WINDOW=1 set in-process);
#      RUNS=p095unsplit: uniprefill with the A/B aid UNIPREFILL_DEBUG_UNSPLIT_WINDOW=1 (decode rows on one program
#      each, as before split-KV became the default on 2026-12-05; a fresh engine: decode graphs keep the kernel
#      they captured);
#   3. the side-by-side device time by kernel kind.
# HOST=1 adds the host's side (profile_prefill.py --host: cProfile of one prefill, the top host calls).
# OWN_PROCESS=1 times the prefills only, with the engine in its own process as vLLM runs it by default
# (profile_prefill.py --own-process; files profile-RUN-own.*). TRACE=1 with it adds the engine process's allocator and
# GC counters over the timed prefills and one more prefill under vLLM's own profiler (--trace-dir /tmp/trace-RUN: the
# traces stay on the box, their summaries go into the JSON).
# PER_ROW_TOO=0 leaves the p095 run's second pass with the per-row window kernel out.
# LENGTH=16384 profiles a prompt of that many tokens instead of 32000 (files profile-RUN-16384*); BATCH=16 submits 16
# such prompts at once (files profile-RUN-LENGTHxBATCH*); PSTATS=1 with HOST=1 keeps the raw cProfile stats
# (OUT_DIR/pstats-TAG/*.pstats). RUNS=p1 is uniprefill at p = 1 (the rewrite and its drop points, nothing removed).
#   RUNS=standard bash scripts/gpu/vllm/gemma_profile.sh OUT_DIR; RUNS="p095 p095unsplit" SKIP_BENCH=1 bash ... OUT_DIR
set -uo pipefail
OUT="${1:?usage: gemma_profile.sh OUT_DIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
mkdir -p "$OUT"
source "$ROOT/scripts/gpu/vllm/env.sh"
bash "$ROOT/scripts/gpu/vllm/box_refresh_uniprefill.sh" > /dev/null
[[ "${SKIP_BENCH:-0}" == 1 ]] || timeout 180 python3 -P "$ROOT/benchmarks/bench_paged_window.py" --rows 4096,16384,32768 --out "$OUT/paged-window.json" \
  2>&1 | tee "$OUT/paged-window.log" | tail -6
P095='{"p": 0.95, "vllm_drop": true}'
for run in ${RUNS:-standard p095}; do
  length="${LENGTH:-32000}" tag="$run"
  [[ "$length" == 32000 ]] || tag="$run-$length"
  [[ "${BATCH:-1}" == 1 ]] || tag="${tag}x$BATCH"
  [[ "${OWN_PROCESS:-0}" == 1 ]] && tag="$tag-own"
  args=(--model-dir /tmp/gemma-270m --length "$length" --batch "${BATCH:-1}" --out "$OUT/profile-$tag.json")
  envs=()
  case "$run" in
    standard) ;;
    p095) args+=(--uniprefill "$P095"); [[ "${PER_ROW_TOO:-1}" == 1 ]] && args+=(--per-row-too) ;;
    p095unsplit) args+=(--uniprefill "$P095"); envs=(UNIPREFILL_DEBUG_UNSPLIT_WINDOW=1) ;;
    p1) args+=(--uniprefill '{"p": 1.0, "vllm_drop": true}') ;;
    *) echo "unknown run $run (standard | p095 | p095unsplit | p1)" >&2; exit 2 ;;
  esac
  [[ "${HOST:-0}" == 1 ]] && args+=(--host)
  [[ "${HOST:-0}" == 1 && "${PSTATS:-0}" == 1 ]] && args+=(--pstats-dir "$OUT/pstats-$tag")
  [[ "${OWN_PROCESS:-0}" == 1 ]] && args+=(--own-process)
  [[ "${OWN_PROCESS:-0}" == 1 && "${TRACE:-0}" == 1 ]] && { rm -rf "/tmp/trace-$tag"; args+=(--trace-dir "/tmp/trace-$tag"); }
  start=$(date +%s)
  env "${envs[@]}" timeout 420 python3 -P "$ROOT/scripts/gpu/vllm/profile_prefill.py" "${args[@]}" > "$OUT/profile-$tag.log" 2>&1
  echo "$tag: exit $? in $(( $(date +%s) - start )) s"
  grep -E "Traceback|Error" "$OUT/profile-$tag.log" | head -3 | cut -c1-300
done
suffix=""; [[ "${LENGTH:-32000}" == 32000 ]] || suffix="-$LENGTH"
[[ "${BATCH:-1}" == 1 ]] || suffix="${suffix}x$BATCH"
for own in "" -own; do
  for run in p095 p095unsplit p1; do
    base="$OUT/profile-standard$suffix$own.json" other="$OUT/profile-$run$suffix$own.json"
    [[ -f "$base" && -f "$other" ]] || continue
    echo "== standard$suffix$own -> $run$suffix$own"
    python3 -P "$ROOT/scripts/gpu/vllm/profile_prefill.py" --compare "$base" "$other"
  done
done
