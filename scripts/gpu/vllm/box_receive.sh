#!/usr/bin/env bash
# On the GPU box: copy one carried part folder into the work folder (kept while the machine is held).
#   bash scripts/gpu/vllm/box_receive.sh .whl_vllm_partNN [work folder, default /tmp/vw: not /tmp/w, which the Gemma install fills]
set -euo pipefail
src="${1:?usage: box_receive.sh <carried folder> [work folder]}"
work="${2:-/tmp/vw}"
if [[ ! -d "$src" ]]; then
  echo "missing carried folder $src (was it named in carry?)" >&2
  exit 1
fi
mkdir -p "$work"
cp "$src"/* "$work"/
ls -l "$work"
df -h "$work" | tail -1
