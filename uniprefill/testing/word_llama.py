"""A Llama-3.1-8B-shaped model folder with a word-level tokenizer, for engine runs on dummy weights.

vLLM loads a model from a folder; with `load_format="dummy"` it needs only `config.json` and a
tokenizer. `write_model_folder` writes the Llama-3.1-8B shape (any layer count) and a
tokenizer whose words are "w0".."w1999" (ids 3..2002), so `prompts` of N words are N tokens
(plus BOS) on any machine, offline. Used by `scripts/gpu/vllm/smoke_llm.py` and the vLLM engine
tests.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "vocab_size": 128256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
WORDS = 2000


def write_model_folder(folder: Path, layers: int) -> None:
    """config.json plus a word-level tokenizer (ids 0-2 special, then "w0".."w1999")."""
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA_8B, num_hidden_layers=layers)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(folder)


QWEN3_NEXT_SMALL = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=256, linear_num_key_heads=8, linear_num_value_heads=16,
                        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=512, shared_expert_intermediate_size=512)
# Qwen3-Next-80B-A3B's layer shapes (its config.json; 48 layers there, a full-attention layer every 4th)
QWEN3_NEXT_80B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_attention_heads=16,
                          num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                          linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                          moe_intermediate_size=512, shared_expert_intermediate_size=512, partial_rotary_factor=0.25)


def qwen3_next_layer_types(layers: int) -> list[str]:
    """Qwen3-Next's order: three Gated DeltaNet layers, then a full-attention one (full_attention_interval 4)."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]


def write_qwen3_next_folder(folder: Path, layer_types: list[str], shape: dict | None = None) -> None:
    """A Qwen3-Next (Gated DeltaNet and full attention in the order of `layer_types`) of `shape`'s sizes (default
    `QWEN3_NEXT_SMALL`: 16 experts, hidden 1024, Qwen3-Next's head sizes; `QWEN3_NEXT_80B_A3B`: the real model's)
    with the same word-level tokenizer: for vLLM engine runs on dummy weights."""
    from transformers import Qwen3NextConfig

    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3NextConfig(**(shape or QWEN3_NEXT_SMALL), num_hidden_layers=len(layer_types),
                             layer_types=list(layer_types), max_position_embeddings=32768, bos_token_id=1,
                             eos_token_id=2).to_dict()
    config.update(architectures=["Qwen3NextForCausalLM"], torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(folder)


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def prompts(count: int, words: int) -> list[str]:
    return [" ".join(f"w{(i * 7919 + j * 104729) % WORDS}" for j in range(words)) for i in range(count)]


def spread_dummy_weights(worker, std: float = 0.02, seed: int = 0) -> int:
    """Refill every matrix of a vLLM worker's model (parameters of two or more axes: projections, embeddings,
    experts, convolutions) with normal(0, `std`) values, seeded per parameter in name order, so that two engines of
    one model class get the same weights. vLLM's dummy weights (uniform in +-1e-3) give a Qwen3-Next shape logits
    that do not depend on the prompt (every greedy token 0, H100 2026-12-06), which makes a parity run vacuous.
    Vectors (norm weights, biases, A_log, dt_bias) keep their values. For `LLM.collective_rpc(spread_dummy_weights,
    args=(std, seed))` after the engine started: the refill is in place, so captured CUDA graphs read it. Returns how
    many parameters were refilled."""
    import torch

    runner = getattr(worker, "model_runner", worker)
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    refilled = 0
    with torch.no_grad():
        for index, (_, param) in enumerate(sorted(model.named_parameters(), key=lambda item: item[0])):
            if param.dim() < 2 or not param.is_floating_point():
                continue
            generator = torch.Generator(device=param.device).manual_seed(seed + index)
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(0.0, std,
                                                                                                generator=generator)
            param.copy_(values)
            refilled += 1
    return refilled
