#!/usr/bin/env bash
# Download the wheels `vllm serve` and `vllm bench serve` need beyond the lean set (lean-wheels.txt drops the
# OpenAI server: uvicorn, prometheus-fastapi-instrumentator, anthropic, mcp, ...; ../shared/reference/vllm-on-gpu.md)
# into .whl_serve/ (git-ignored), for CPython 3.12 / manylinux x86_64, with their dependencies, less what the lean
# set carries and what the box's torch and transformers already bring. Runs on the dev machine (network to PyPI).
#   bash scripts/gpu/vllm/download_server_wheels.sh
# On the box: carry .whl_serve with the last part; box_install.sh installs it into /tmp/vsite when present.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
OUT="$ROOT/.whl_serve"
rm -rf "$OUT" && mkdir -p "$OUT"
python3 -m pip download -q -d "$OUT" --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  "uvicorn[standard]" "prometheus-fastapi-instrumentator>=8.0.0" "prometheus_client>=0.18.0" "anthropic>=0.71.0" mcp \
  "model-hosting-container-standards<1.0.0,>=0.1.14" sse-starlette watchfiles python-dotenv pydantic-settings \
  "aiohttp>=3.13.3" "fastapi[standard]==0.136.3" "pydantic==2.14.4" "starlette==1.10.0"
norm() { tr 'A-Z-.' 'a-z__'; }
lean=$(sed -E 's/[=<>!~ ].*//' "$HERE/lean-wheels.txt" | grep -v '^\s*#' | norm)
box="setuptools typing_extensions jinja2 markupsafe pyyaml certifi idna urllib3"  # the box's own (torch, transformers)
for wheel in "$OUT"/*.whl; do
  name=$(basename "$wheel" | sed -E 's/-[0-9].*//' | norm)
  if grep -qx "$name" <<< "$lean" || [[ " $box " == *" $name "* ]]; then
    rm "$wheel"
  fi
done
echo "$(ls "$OUT"/*.whl | wc -l) server wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
