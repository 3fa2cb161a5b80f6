# Source on the GPU box before running vLLM from /tmp/vsite:  source scripts/gpu/vllm/env.sh
# Exported: vLLM spawns an EngineCore subprocess that must inherit it. A --target folder's
# .pth files are not processed, and nvidia-cutlass-dsl relies on one: hence its second entry.
export PYTHONPATH="/tmp/usite:/tmp/vsite:/tmp/vsite/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
# The FlashInfer top-k/top-p sampler JIT-compiles with nvcc on first use: keep vLLM's torch sampler.
export VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM's command line: pip --target puts the `vllm` script in /tmp/vsite/bin, off PATH, so scripts run
#   timeout N "${VLLM_CLI[@]}" serve|bench ...    (-P: the repository's uniprefill/ stays off sys.path)
VLLM_CLI=(python3 -P -m vllm.entrypoints.cli.main)
