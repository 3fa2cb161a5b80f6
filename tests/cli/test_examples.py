"""The dropping engine's settings (`uniprefill.vllm.engine_settings`, what examples/vllm_offline.py
and the GPU scripts ask vLLM for) are settings uniprefill's own vLLM checks accept (vLLM itself is
not installed here: the example runs on the GPU box only); the example starts without vLLM."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from types import SimpleNamespace as NS

from uniprefill.vllm.engine_settings import dropping_engine_kwargs
from uniprefill.vllm.plugin import BACKEND_QUALNAME, check_vllm_config, config_from_compilation_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_offline.py"


def llm_kwargs(settings: dict, max_model_len: int = 32768, **kwargs) -> dict:
    """What the example passes to `vllm.LLM` (the model aside); kwargs: `dropping_engine_kwargs`'s."""
    return dropping_engine_kwargs({"vllm_drop": True, **settings}, max_model_len=max_model_len, **kwargs)


def test_the_example_starts_without_vllm():
    done = subprocess.run([sys.executable, "-P", str(EXAMPLE), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--max-model-len" in done.stdout, done.stderr
    assert "dropping_engine_kwargs(" in EXAMPLE.read_text()  # it asks for the settings tested below


def as_vllm_config(kwargs: dict) -> NS:
    """The parts of a VllmConfig that `check_vllm_config` reads, from LLM(...) keyword arguments,
    with vLLM's defaults where they leave a setting out (mode 3, FULL_AND_PIECEWISE, chunked prefill
    on with a step budget of 16384 for `LLM` on an H200, prefix caching on)."""
    cc = kwargs["compilation_config"]
    return NS(compilation_config=NS(mode=cc.get("mode", 3), backend=cc.get("backend", "inductor"),
                                    cudagraph_mode=cc.get("cudagraph_mode", "FULL_AND_PIECEWISE" if "mode" not in cc
                                                          else "NONE"),
                                    inductor_compile_config=cc["inductor_compile_config"]),
              parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1), speculative_config=None,
              cache_config=NS(enable_prefix_caching=kwargs.get("enable_prefix_caching", True)),
              scheduler_config=NS(enable_chunked_prefill=kwargs.get("enable_chunked_prefill", True),
                                  max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 16384), max_num_seqs=1024),
              model_config=NS(max_model_len=kwargs["max_model_len"], runner_type="generate"))


def test_the_example_asks_for_the_one_option_on_vllms_defaults():
    kwargs = llm_kwargs({"p": 0.95}, max_model_len=16384)
    assert kwargs == {"max_model_len": 16384,
                      "compilation_config": {"inductor_compile_config": {"uniprefill": {"vllm_drop": True, "p": 0.95}}}}
    check = check_vllm_config(as_vllm_config(kwargs), "0.26.0", aot_compile=True, drop_enabled=True)
    assert check.errors == []  # mode 3 with AOT compile, CUDA graphs, chunked prefill and prefix caching on
    assert any("FULL_AND_PIECEWISE" in note for note in check.notes)  # decode under vLLM's full graphs
    assert any("publish no KV blocks from the step that ends their prompt" in note for note in check.notes)
    assert not any("without Inductor" in note for note in check.notes)


def test_the_mode_2_channel_settings_are_ones_the_checks_accept():
    kwargs = llm_kwargs({"p": 0.95}, max_model_len=16384, mode=2)
    assert kwargs["compilation_config"]["backend"] == BACKEND_QUALNAME
    assert config_from_compilation_config(kwargs["compilation_config"]).p == 0.95
    assert kwargs["max_num_batched_tokens"] >= kwargs["max_model_len"]  # whole prompts in one step
    check = check_vllm_config(as_vllm_config(kwargs), "0.26.0", aot_compile=False, drop_enabled=True)
    assert check.errors == []
    assert not any("chunked" in note for note in check.notes)
    assert "enable_prefix_caching" not in kwargs  # vLLM's default (on): the plugin guards the cache
    assert any("publish no KV blocks from the step that ends their prompt" in note for note in check.notes)
    assert config_from_compilation_config(kwargs["compilation_config"]).vllm_drop
    graphs = llm_kwargs({"p": 0.95}, mode=2, decode_graphs=True)
    assert config_from_compilation_config(graphs["compilation_config"]).vllm_decode_graphs
    assert check_vllm_config(as_vllm_config(graphs), "0.26.0", aot_compile=False).errors == []
    graphs["compilation_config"]["inductor_compile_config"]["uniprefill"]["vllm_decode_graphs"] = False
    (error,) = check_vllm_config(as_vllm_config(graphs), "0.26.0", aot_compile=False).errors
    assert "FULL_DECODE_ONLY" in error  # FULL_DECODE_ONLY without the option is refused
    with pytest.raises(ValueError, match="mode-2 setting"):
        llm_kwargs({}, decode_graphs=True)
