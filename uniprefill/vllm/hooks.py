"""Where the vLLM rewrite gets vLLM's per-step state: the forward context, the model runner's
request ids and prompt lengths (`runner_hook`), a sliding layer's paged cache, the TP group. Tests
build `VllmHooks` from fakes; `VllmHooks.from_vllm()` reads vLLM 0.26 (and wraps its model runners).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmHooks:
    """Where the experimental rewrite gets vLLM's per-step state (fakes in tests)."""

    context_fn: Any  # () -> the forward context (attn_metadata, slot_mapping dicts by layer name)
    request_ids_fn: Any  # () -> the step's request ids, batch order
    num_prompt_tokens_fn: Any  # () -> host [R] prompt lengths
    listeners: Any  # .add(runtime): runtime.free(request_id) for finished requests
    window_layer_fn: Any = None  # layer name -> vllm.drop.WindowLayer (sliding layers after a drop)
    tp_group_fn: Any = None  # () -> the tensor-parallel process group (block scores are summed across it)
    opted_out_fn: Any = None  # () -> host bool [R] of requests that must not drop (prompt logprobs), or None
    request_p_fn: Any = None  # () -> host float32 [R] of requests' own p (NaN: the config's), or None

    @classmethod
    def from_vllm(cls) -> "VllmHooks":
        """vLLM 0.26's forward context, and its GPU model runners (V1 and V2) wrapped (`vllm.runner_hook`)."""
        from vllm.forward_context import get_forward_context
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from . import runner_hook as hook
        from .gdn_metadata import record_vllm_builds

        hook.install(GPUModelRunner)
        record_vllm_builds()  # Gated DeltaNet metadata remembers its build, to be built again for kept rows
        try:  # the drop totals by name, for `vllm serve` (runner_hook.install_worker_method)
            from vllm.v1.worker.gpu_worker import Worker
        except ImportError:
            Worker = None
        if Worker is not None:
            hook.install_worker_method(Worker)
        try:  # vLLM 0.26's model runner V2, its default for non-MoE, non-hybrid models
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
        except ImportError:
            GPUModelRunnerV2 = None
        if GPUModelRunnerV2 is not None:
            hook.install_v2(GPUModelRunnerV2)
        return cls(get_forward_context, hook.step_request_ids, hook.num_prompt_tokens, hook.LISTENERS, vllm_window_layer,
                   vllm_tp_group, hook.opted_out, hook.request_p)


def vllm_tp_group():
    """vLLM's tensor-parallel device group ([read] vllm.distributed.parallel_state, 0.26)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().device_group


def vllm_window_layer(name: str):
    """A vLLM 0.26 FlashAttention layer's paged cache, scale and window, for
    `VllmDropRuntime.window_attention` ([read] in vLLM's flash_attn.py: the cache's logical
    shape is (blocks, kv heads, block size, 2 x head size); K and V are its two halves); None
    before vLLM allocated the cache."""
    from vllm.forward_context import get_forward_context

    from .drop import WindowLayer

    layer = get_forward_context().no_compile_layers[name]
    impl = layer.impl
    if getattr(impl, "kv_cache_dtype", "auto") != "auto":
        raise NotImplementedError(f"{name}: a quantised KV cache ({impl.kv_cache_dtype}) after a drop point")
    kv = layer.kv_cache
    if isinstance(kv, (list, tuple)):  # one per virtual engine in older versions
        kv = kv[0]
    if kv.numel() == 0:  # not allocated yet (vLLM's profiling run)
        return None
    key_cache, value_cache = kv.transpose(1, 2).split(impl.head_size, dim=-1)
    left, right = getattr(impl, "sliding_window", (-1, -1)) or (-1, -1)
    if right not in (0, -1):
        raise NotImplementedError(f"{name}: a bidirectional sliding window {impl.sliding_window}")
    return WindowLayer(key_cache, value_cache, float(impl.scale), getattr(impl, "logits_soft_cap", None) or None,
                       left + 1 if left >= 0 else None)
