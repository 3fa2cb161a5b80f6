#!/usr/bin/env bash
# On the GPU box, in the call after the last part arrived: join, check, unpack and install the
# lean vllm==0.26.0 wheel set (into /tmp/vsite) and uniprefill's wheel (into /tmp/usite).
#   bash scripts/gpu/vllm/box_install.sh [--parts 7] [--work /tmp/vw] [--site /tmp/vsite]
#        [--usite /tmp/usite] [--python python3] [--platform-flags]
# --platform-flags: install for CPython 3.12 / manylinux x86_64 whatever runs pip (to rehearse
# the install on a machine that is not the box).
set -euo pipefail
parts_expected=7; work=/tmp/vw; site=/tmp/vsite; usite=/tmp/usite; py=python3; platform=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --parts) parts_expected="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --site) site="$2"; shift 2 ;;
    --usite) usite="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --platform-flags) platform=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:
                                --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
                                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any); shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$work"
parts=(w.tar.part.*)
if [[ ${#parts[@]} -ne $parts_expected ]]; then
  echo "found ${#parts[@]} parts in $work (${parts[*]}), expected $parts_expected: was the machine released between calls?" >&2
  exit 1
fi
cat w.tar.part.* > w.tar
sha256sum -c w.tar.sha256
tar -xf w.tar
rm -f w.tar w.tar.part.*
count=$(ls "$work"/*.whl | wc -l)
echo "wheels: $count"
[[ $count -eq 74 ]] || { echo "expected 74 wheels, found $count" >&2; exit 1; }
start=$(date +%s)
# One pip command: --target merges the shared nvidia_cutlass_dsl/ and opentelemetry/ folders only within one run.
"$py" -m pip install -q --no-index --no-deps "${platform[@]}" --target "$site" "$work"/*.whl
echo "vllm installed in $(( $(date +%s) - start )) s: $(du -sh "$site" | cut -f1) in $site"
if compgen -G "$ROOT/.whl_uniprefill/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps "${platform[@]}" --target "$usite" "$ROOT"/.whl_uniprefill/*.whl
  echo "uniprefill installed in $usite"
else
  echo "no .whl_uniprefill/ carried: uniprefill not installed (scripts/gpu/vllm/build_uniprefill_wheel.sh builds it)"
fi
"$py" -c "import importlib.metadata as m
for p in 'numpy numba protobuf typing_extensions setuptools cuda-bindings anyio idna h11 aiohttp opencv-python-headless packaging torch transformers'.split():
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, 'absent')"
