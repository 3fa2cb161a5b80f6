"""Random-weight model configs by name, and building them straight onto a device.

Two families, all built with `attn_implementation="sdpa"` and all valid on transformers 5.17
(the GPU box) and 5.24:

Tiny CPU-test configs (hidden 64, 4 query / 2 KV heads of 16, vocab 256; a 300-token forward
takes well under a second on CPU). Every non-attention mixer runs its pure-PyTorch path:
transformers falls back to it when mamba-ssm, causal-conv1d, flash-linear-attention and
`kernels` are absent, which is the case here and on the GPU box.

    tiny-llama              2 layers, all full attention
    tiny-qwen3-next         4 layers, Gated DeltaNet / full 3:1, MoE (8 experts, top-2, shared)
    tiny-gemma3             6 layers, sliding / full 5:1, window 16
    tiny-qwen3.5            4 layers, Gated DeltaNet / full 3:1, dense MLP (Qwen3.5 text)
    tiny-lfm2               4 layers, short convolution / full attention (LFM2), full at 2
    tiny-granitemoehybrid   4 layers, Mamba2 / full attention, MoE (4 experts, top-2), full at 2
    tiny-jamba              4 layers, Mamba / full attention, MoE every other layer, full at 2
    tiny-olmo3              4 layers, sliding / full 3:1, window 16

GPT-OSS (sliding/full + MoE + attention sinks) is left out: neither 5.17 nor 5.24 lets it
use SDPA (`_supports_sdpa = False`, the sinks need eager or flex attention).

Benchmark presets (`max_position_embeddings >= 131072`):

    llama-3.1-8b        the real Llama-3.1-8B shape, llama3 RoPE scaling (factor 8).
    gemma-3-12b         the real Gemma-3-12B text shape: 48 layers, sliding/full 5:1, window
                        1024, 16 heads, 8 KV heads, head_dim 256, linear RoPE factor 8 on the
                        full layers.
    qwen3-next-80b-a3b  Qwen3-Next-80B-A3B with every width kept (hidden 2048, 16/2 attention
                        heads of 256, 16/32 DeltaNet key/value heads of 128, experts of width
                        512, top-10 routing plus a shared expert, vocab 151936) and all 48
                        layers (the same 3:1 DeltaNet/full layout, 12 full-attention layers),
                        but 128 routed experts per layer instead of 512. That keeps the FLOPs
                        per token of the real model (top-10 of equal-sized experts) while the
                        weights drop from ~80B to ~21.6B parameters (~43 GB in bf16), leaving
                        room on one 141 GB H200 for 128K-token activations (512 experts would
                        not fit at all; 256 would take ~82 GB).

`build_random_model` builds a preset on the meta device, materialises it directly on the
target device and initialises it there with the architecture's own init (normal weights of
std `initializer_range` = 0.02, ones/zeros for norms, its own values for DeltaNet/Mamba
parameters, RoPE and embedding-scale buffers recomputed), so an 8B model never touches CPU
memory and activations stay finite.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import transformers as hf

from uniprefill.models.layer_kinds import LayerKind, layer_kinds

__all__ = [
    "BENCHMARK_PRESETS",
    "PRESETS",
    "TINY_PRESETS",
    "build_random_model",
    "preset_config",
]

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_TINY_DELTANET = dict(
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _pattern(num_layers: int, every: int, other: str) -> list[str]:
    """`other` everywhere except "full_attention" at every `every`-th layer (1-based)."""
    return ["full_attention" if (i + 1) % every == 0 else other for i in range(num_layers)]


def tiny_llama() -> hf.PretrainedConfig:
    return hf.LlamaConfig(num_hidden_layers=2, head_dim=16, **_TINY)


def tiny_qwen3_next() -> hf.PretrainedConfig:
    return hf.Qwen3NextConfig(
        num_hidden_layers=4,
        layer_types=_pattern(4, 4, "linear_attention"),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **_TINY_DELTANET,
        **_TINY,
    )


def tiny_gemma3() -> hf.PretrainedConfig:
    return hf.Gemma3TextConfig(
        num_hidden_layers=6,
        layer_types=_pattern(6, 6, "sliding_attention"),
        sliding_window=16,
        head_dim=16,
        query_pre_attn_scalar=16,
        **_TINY,
    )


def tiny_qwen3_5() -> hf.PretrainedConfig:
    return hf.Qwen3_5TextConfig(
        num_hidden_layers=4,
        layer_types=_pattern(4, 4, "linear_attention"),
        **_TINY_DELTANET,
        **_TINY,
    )


def tiny_lfm2() -> hf.PretrainedConfig:
    return hf.Lfm2Config(
        num_hidden_layers=4,
        layer_types=["conv", "conv", "full_attention", "conv"],
        block_multiple_of=16,
        **_TINY,
    )


def tiny_granitemoehybrid() -> hf.PretrainedConfig:
    return hf.GraniteMoeHybridConfig(
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_head=16,
        mamba_chunk_size=64,
        **_TINY,
    )


def tiny_jamba() -> hf.PretrainedConfig:
    return hf.JambaConfig(
        num_hidden_layers=4,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        **_TINY,
    )


def tiny_olmo3() -> hf.PretrainedConfig:
    return hf.Olmo3Config(
        num_hidden_layers=4,
        layer_types=_pattern(4, 4, "sliding_attention"),
        sliding_window=16,
        **_TINY,
    )


def llama_3_1_8b() -> hf.PretrainedConfig:
    return hf.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
    )


def gemma_3_12b() -> hf.PretrainedConfig:
    return hf.Gemma3TextConfig(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=_pattern(48, 6, "sliding_attention"),
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
    )


QWEN3_NEXT_EXPERTS = 128
"""Routed experts per layer in the `qwen3-next-80b-a3b` preset (the real model has 512)."""


def qwen3_next_80b_a3b() -> hf.PretrainedConfig:
    return hf.Qwen3NextConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        layer_types=_pattern(48, 4, "linear_attention"),
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=QWEN3_NEXT_EXPERTS,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=False,
    )


TINY_PRESETS: types.MappingProxyType[str, Callable[[], hf.PretrainedConfig]] = (
    types.MappingProxyType(
        {
            "tiny-llama": tiny_llama,
            "tiny-qwen3-next": tiny_qwen3_next,
            "tiny-gemma3": tiny_gemma3,
            "tiny-qwen3.5": tiny_qwen3_5,
            "tiny-lfm2": tiny_lfm2,
            "tiny-granitemoehybrid": tiny_granitemoehybrid,
            "tiny-jamba": tiny_jamba,
            "tiny-olmo3": tiny_olmo3,
        }
    )
)
BENCHMARK_PRESETS: types.MappingProxyType[str, Callable[[], hf.PretrainedConfig]] = (
    types.MappingProxyType(
        {
            "llama-3.1-8b": llama_3_1_8b,
            "gemma-3-12b": gemma_3_12b,
            "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
        }
    )
)
PRESETS = types.MappingProxyType({**TINY_PRESETS, **BENCHMARK_PRESETS})


def preset_config(name: str, num_layers: int | None = None) -> hf.PretrainedConfig:
    """A fresh config of preset `name`, optionally cut to its first `num_layers` layers.

    Cutting keeps the layer pattern: `layer_types[:num_layers]` (Jamba re-derives its own).
    A cut without a full-attention layer raises `ValueError`: there would be nothing to drop
    tokens at (and transformers' hybrid caches then fail).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    config = PRESETS[name]()
    if num_layers is None:
        return config
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(
            f"num_layers must be in [1, {config.num_hidden_layers}] for {name!r}, got {num_layers}"
        )
    layer_types = config.__dict__.get("layer_types")  # a stored field, not Jamba's property
    if layer_types is not None:
        config.layer_types = list(layer_types)[:num_layers]
    config.num_hidden_layers = num_layers
    if LayerKind.FULL not in layer_kinds(config):
        first = layer_kinds(PRESETS[name]()).index(LayerKind.FULL)
        raise ValueError(
            f"num_layers={num_layers} of {name!r} keeps no full-attention layer (the first is "
            f"layer {first}); use num_layers >= {first + 1}"
        )
    return config


def _clear_init_flags(model: torch.nn.Module) -> None:
    """Forget transformers' "already initialised" marks, so `init_weights` redoes every tensor."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and "_is_hf_initialized" in tensor.__dict__:
                del tensor._is_hf_initialized


def build_random_model(
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
) -> hf.PreTrainedModel:
    """A causal LM of preset `name` with random weights, in `dtype` on `device`, eval mode.

    Built on the meta device, then `to_empty(device)` and the architecture's own init run
    on `device` (no full-size CPU copy). `num_layers` cuts the preset, see `preset_config`.
    """
    config = preset_config(name, num_layers)
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to_empty(device=device)
    _clear_init_flags(model)
    with torch.device(device):
        model.init_weights()  # weights, RoPE / embed-scale buffers, then weight tying
    return model.eval()
