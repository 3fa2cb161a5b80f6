#!/usr/bin/env bash
# On the GPU box, after box_install.sh (vLLM in /tmp/vsite), in a call that carries .whl_serve/
# (download_server_wheels.sh): install the OpenAI server's wheels next to vLLM, so that `vllm serve` and
# `vllm bench serve` run (serve_lib.sh, soak.sh, bench_serve.sh). Packages vLLM's set has already stay.
#   bash scripts/gpu/vllm/box_install_server.sh [--site /tmp/vsite]
set -euo pipefail
site=/tmp/vsite
[[ "${1:-}" == --site ]] && site="$2"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
compgen -G "$ROOT/.whl_serve/*.whl" > /dev/null || { echo "no .whl_serve/ carried" >&2; exit 1; }
[[ -d "$site/vllm" ]] || { echo "no vLLM in $site: run box_install.sh first" >&2; exit 1; }
python3 -m pip install -q --no-index --no-deps --target "$site" "$ROOT"/.whl_serve/*.whl 2>&1 | grep -v "already exists" | tail -3
source "$ROOT/scripts/gpu/vllm/env.sh"
python3 -P -c "import uvicorn, prometheus_fastapi_instrumentator, aiohttp, anthropic
import vllm.entrypoints.openai.api_server
print('vllm serve imports: ok')"
