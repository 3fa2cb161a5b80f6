"""The dropping engine's settings (`uniprefill.vllm.engine_settings`, what examples/vllm_offline.py
and the GPU scripts ask vLLM for) are settings uniprefill's own vLLM checks accept (vLLM itself is
not installed here: the example runs on the GPU box only); the example starts without vLLM."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

from uniprefill.vllm.engine_settings import dropping_engine_kwargs
from uniprefill.vllm.plugin import BACKEND_QUALNAME, check_vllm_config, config_from_compilation_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_offline.py"


def llm_kwargs(settings: dict, max_model_len: int = 32768, decode_graphs: bool = False) -> dict:
    """What the example passes to `vllm.LLM` (the model aside)."""
    return dropping_engine_kwargs({"vllm_drop": True, **settings}, max_model_len=max_model_len,
                                  decode_graphs=decode_graphs)


def test_the_example_starts_without_vllm():
    done = subprocess.run([sys.executable, "-P", str(EXAMPLE), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--decode-graphs" in done.stdout, done.stderr
    assert "dropping_engine_kwargs(" in EXAMPLE.read_text()  # it asks for the settings tested below


def as_vllm_config(kwargs: dict) -> NS:
    """The parts of a VllmConfig that `check_vllm_config` reads, from LLM(...) keyword arguments."""
    cc = kwargs["compilation_config"]
    return NS(compilation_config=NS(mode=cc["mode"], backend=cc["backend"], cudagraph_mode=cc.get("cudagraph_mode"),
                                    inductor_compile_config=cc["inductor_compile_config"]),
              parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1), speculative_config=None,
              cache_config=NS(enable_prefix_caching=kwargs.get("enable_prefix_caching", True)),  # vLLM's default
              scheduler_config=NS(enable_chunked_prefill=kwargs["enable_chunked_prefill"],
                                  max_num_batched_tokens=kwargs["max_num_batched_tokens"]),
              model_config=NS(max_model_len=kwargs["max_model_len"], runner_type="generate"))


def test_a_dropping_engine_asks_for_settings_the_checks_accept():
    kwargs = llm_kwargs({"p": 0.95}, max_model_len=16384)
    assert kwargs["compilation_config"]["backend"] == BACKEND_QUALNAME
    assert config_from_compilation_config(kwargs["compilation_config"]).p == 0.95
    assert kwargs["max_num_batched_tokens"] >= kwargs["max_model_len"]  # whole prompts in one step
    check = check_vllm_config(as_vllm_config(kwargs), "0.26.0", aot_compile=False, drop_enabled=True)
    assert check.errors == []
    assert not any("chunked" in note for note in check.notes)
    assert "enable_prefix_caching" not in kwargs  # vLLM's default (on): the plugin guards the cache
    assert any("publish no KV blocks to the prefix cache" in note for note in check.notes)

    assert config_from_compilation_config(kwargs["compilation_config"]).vllm_drop  # the example drops
    graphs = llm_kwargs({"p": 0.95}, decode_graphs=True)
    assert config_from_compilation_config(graphs["compilation_config"]).vllm_decode_graphs
    assert check_vllm_config(as_vllm_config(graphs), "0.26.0", aot_compile=False).errors == []
    graphs["compilation_config"]["inductor_compile_config"]["uniprefill"]["vllm_decode_graphs"] = False
    (error,) = check_vllm_config(as_vllm_config(graphs), "0.26.0", aot_compile=False).errors
    assert "FULL_DECODE_ONLY" in error  # FULL_DECODE_ONLY without the option is refused
