#!/usr/bin/env bash
# On the GPU box, while the machine is still held (vLLM in /tmp/vsite, uniprefill's wheel in
# /tmp/usite from box_install.sh): replace the installed uniprefill package by the working
# tree that came with this call, so a fix made here reaches the next run without rebuilding
# and re-sending the wheel. The wheel's metadata (and its vllm.general_plugins entry point)
# stays; only the package's files change (kernels/ becomes uniprefill/kernels, as in the wheel).
#   bash scripts/gpu/vllm/box_refresh_uniprefill.sh [--usite /tmp/usite]
set -euo pipefail
usite=/tmp/usite
[[ "${1:-}" == --usite ]] && usite="$2"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
[[ -d "$usite/uniprefill" ]] || { echo "no $usite/uniprefill: run box_install.sh first" >&2; exit 1; }
rm -rf "$usite/uniprefill"
cp -r "$ROOT/uniprefill" "$usite/uniprefill"
cp -r "$ROOT/kernels" "$usite/uniprefill/kernels"
find "$usite/uniprefill" -name __pycache__ -prune -exec rm -rf {} +
echo "uniprefill in $usite refreshed from $ROOT ($(find "$usite/uniprefill" -name '*.py' | wc -l) modules)"
