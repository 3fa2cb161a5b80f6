#!/usr/bin/env bash
# vLLM 0.26.0's Python code importable on a CPU machine (no CUDA, no vLLM install): the wheel that
# scripts/gpu/vllm/download_wheels.sh fetched, unpacked into /tmp/vcpu/site, and the pure-Python packages its
# attention-metadata modules import, into /tmp/vcpu/deps. For tests that check uniprefill against vLLM's own
# code on CPU, e.g. tests/vllm/test_vllm_gdn_real_builder.py (skipped where vLLM cannot be imported):
#   bash scripts/vllm_source_on_cpu.sh
#   PYTHONPATH=/tmp/vcpu/site:/tmp/vcpu/deps python -m pytest -q -n 0 tests/vllm/test_vllm_gdn_real_builder.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheel=$(ls "$ROOT"/.whl_vllm_download/vllm-0.26.0-*.whl 2> /dev/null | head -1)
[[ -n "$wheel" ]] || { echo "no vllm-0.26.0 wheel in .whl_vllm_download/: run scripts/gpu/vllm/download_wheels.sh" >&2; exit 1; }
mkdir -p /tmp/vcpu/site /tmp/vcpu/deps
unzip -q -o "$wheel" 'vllm/*' -d /tmp/vcpu/site
python3 -m pip install -q --no-deps --target /tmp/vcpu/deps cbor2 psutil pyzmq aiohttp multidict yarl propcache \
  aiohappyeyeballs aiosignal frozenlist openai-harmony openai einops
PYTHONPATH=/tmp/vcpu/site:/tmp/vcpu/deps python3 -c "import vllm.v1.attention.backends.gdn_attn" \
  && echo "vLLM's source importable: PYTHONPATH=/tmp/vcpu/site:/tmp/vcpu/deps"
