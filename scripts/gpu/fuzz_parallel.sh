#!/usr/bin/env bash
# The differential fuzzer (`uniprefill fuzz`) on many CPU cores: WORKERS processes, each running
# cases from its own seed (BASE_SEED + worker) until SECONDS_BUDGET has passed, one JSON per
# worker, then all of them in one tar.gz under OUT_DIR (use a new BASE_SEED for every run). CPU only (CUDA hidden): the fuzzer's models are
# tiny; a machine with many cores (the GPU box has 16) runs thousands of cases in minutes.
#   WORKERS=16 SECONDS_BUDGET=420 BASE_SEED=5000 OUT_DIR=$OUT bash scripts/gpu/fuzz_parallel.sh
# Architectures that do not build under the installed transformers are left out (listed).
# The per-worker files live in /tmp and only one tar.gz lands in OUT_DIR, refreshed every 30 s: a
# device call cut at its time limit still returns what ran (a device call returns a bounded
# number of files, so 32 loose files would not all come back). Keep SECONDS_BUDGET at least 90 s
# under the device call's time limit (imports, building the models and the last tar come on top;
# with 470 s the whole call takes about 555 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
WORKERS=${WORKERS:-8} FRESH_EVERY=${FRESH_EVERY:-25} SECONDS_BUDGET=${SECONDS_BUDGET:-300} OUT_DIR=$(realpath -m "${OUT_DIR:-/tmp/fuzz-out}")
BASE_SEED=${BASE_SEED:-1000}
PP=/tmp/pp-fuzz
RUNS=/tmp/fuzz-runs-$BASE_SEED
rm -rf "$RUNS" && mkdir -p "$RUNS/runs" "$OUT_DIR" "$PP" && rm -rf "$PP/uniprefill" && cp -r uniprefill "$PP/" && cp -r kernels "$PP/uniprefill/kernels"
export PYTHONPATH=$PP PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# from /tmp, as the workers below: `python3 -` puts the working directory first on sys.path, and
# the checkout's uniprefill/ lacks uniprefill/kernels (a run from the repo root tested nothing)
ARCHS=$(cd /tmp && python3 - <<'PY'
import torch
from uniprefill.testing.fuzz import ARCHS, build_model
ok = []
for arch in ARCHS:
    try:
        build_model(arch, torch.float32); ok.append(arch)
    except Exception as exc:  # noqa: BLE001
        import sys; print(f"left out {arch}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
print(",".join(ok))
PY
)
echo "architectures: $ARCHS"
[ -n "$ARCHS" ] || { echo "error: no architecture builds (see above); nothing to fuzz" >&2; exit 1; }
python3 -c 'import sys, torch, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")'
# one long-lived process per worker (imports and compiled models are reused inside it); each
# rewrites its JSON after every case, so a run cut short keeps what it ran
for w in $(seq 0 $((WORKERS - 1))); do
  seed=$((BASE_SEED + w))
  # from /tmp: `python3 -m` puts the working directory first on sys.path, and the checkout's
  # uniprefill/ lacks uniprefill/kernels (the installed layout lives in $PP)
  (cd /tmp && timeout $((SECONDS_BUDGET + 60)) python3 -m uniprefill fuzz --cases 100000 --seed "$seed" \
     --archs "$ARCHS" --fresh-every "$FRESH_EVERY" --seconds "$SECONDS_BUDGET" --quiet \
     --out "$RUNS/runs/fuzz-$seed.json" > "$RUNS/runs/fuzz-$seed.log" 2>&1) &
done
(while sleep 30; do tar czf "$OUT_DIR/.fuzz-runs.tmp" -C "$RUNS" runs && mv "$OUT_DIR/.fuzz-runs.tmp" "$OUT_DIR/fuzz-runs.tar.gz"; done) &
TARRER=$!
wait $(jobs -p | grep -v "^$TARRER$")
kill $TARRER 2>/dev/null
python3 - "$RUNS/runs" <<'PY'
import collections, glob, json, sys
total = collections.Counter(); reasons = collections.Counter(); failures = []; cases = acc = 0
for path in sorted(glob.glob(sys.argv[1] + "/fuzz-*.json")):
    r = json.load(open(path)); cases += r["cases"]; acc += r["accelerated_calls"]
    total.update(r["by_status"]); reasons.update(r["unaccelerated_reasons"]); failures += r["failures"]
print(f"{cases} cases: {dict(total)}; calls that ran the rewritten graph: {acc}")
for reason, n in reasons.most_common(): print(f"  {n:5d}  {reason}")
for f in failures[:30]: print("FAILED", json.dumps(f)[:600])
PY
tar czf "$OUT_DIR/fuzz-runs.tar.gz" -C "$RUNS" runs && rm -f "$OUT_DIR/.fuzz-runs.tmp"
