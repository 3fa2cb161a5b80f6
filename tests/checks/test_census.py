"""The architecture census over a bounded set of model types (the full census: `uniprefill census`)."""

from __future__ import annotations

import pytest

from uniprefill.testing.census import CensusRow, census_one, table
from uniprefill.testing.census_attention import accelerated_share, full_attention


@pytest.mark.parametrize("model_type, status", [
    ("llama", "accelerated"),
    ("qwen3_5_text", "accelerated"),  # gated delta-net / full hybrid, 300 tokens > its 64-token chunk
    ("gpt2", "accelerated"),  # its embedding reads input_ids.view(-1, N): the token input all the same
    # embeds input_ids.to(device); chunked local-attention layers: prefill accelerated, generation runs
    # unaccelerated (decode after a drop does not model chunks), equal to the plain model
    ("llama4_text", "accelerated"),
    ("gpt_oss", "accelerated"),  # eager attention with learned sinks, recognised as one attention site
    ("mixtral", "accelerated"),  # no sliding window by default: the tiny config keeps full attention
    ("deepseek_v3", "accelerated"),  # MLA (head_dim = the rotary part of a head), group-limited routing
    ("bloom", "accelerated"),  # eager attention with ALiBi (a per-key bias); its attention bypasses the interface
    ("bert-generation", "accelerated"),  # a causal LM with is_decoder=True (_FAMILY), its warning's advice
    # eager attention whose causal mask is sliced from a registered buffer, checked to be a causal band on every
    # call (local layers: a window of 256 keys); its attention bypasses the interface: generation unaccelerated
    ("gpt_neo", "accelerated"),
    ("bert", "skipped"),
])
def test_census_rows(model_type, status):
    row = census_one(model_type)
    assert row.status == status, row
    if status in ("unaccelerated", "skipped"):
        assert row.reason, "a type that is not accelerated says why"
    if status == "accelerated":
        expected = "equal (generation unaccelerated)" if model_type in ("llama4_text", "bloom", "gpt_neo") else "equal"
        assert row.generation == expected and row.dropped not in ("", "none"), row
        assert all(v is True for v in row.checks.values()), row.checks
        assert row.full_attention is True and row.full_attention_basis == "graph", row
    if model_type == "gpt_neo":
        assert row.layer_kinds == "full sliding", row  # global layers, and local ones read from the table's band
    assert row.causal is (None if status == "skipped" else True), row  # the probe runs on every run row
    assert f"| {model_type} | {status} |" in table([row], "test")


def test_accelerated_share_counts_types_with_full_attention_only():
    rows = [CensusRow("a", "accelerated", full_attention=True, full_attention_basis="graph"),
            CensusRow("b", "accelerated", full_attention=True, full_attention_basis="graph"),
            CensusRow("c", "unaccelerated", "eager attention", full_attention=True),
            CensusRow("d", "error", "boom", full_attention=None),  # unknown: counted, never overstating
            CensusRow("e", "mismatch", full_attention=True),
            CensusRow("f", "unaccelerated", "a scan", full_attention=False,
                      full_attention_basis="no attention layer (Mamba selective scan)"),
            CensusRow("g", "unaccelerated", "sliding", full_attention=False,
                      full_attention_basis="every attention layer is sliding-window (sliding_window=24)"),
            CensusRow("h", "skipped", "encoder-decoder model")]
    assert accelerated_share(rows) == (2, 5)
    text = table(rows, "test")
    assert "Accelerated share: 2 of 5 (40%)" in text and "2 run rows without one" in text
    assert "| f | unaccelerated |  | no: no attention layer (Mamba selective scan) |" in text
    assert "| a | accelerated |  | yes (graph) | ? |" in text and "| d | error |  | ? |" in text
    assert "| h | skipped |  |  |  |" in text


def test_accelerated_share_leaves_out_types_that_are_not_causal():
    rows = [CensusRow("a", "accelerated", full_attention=True, full_attention_basis="graph", causal=True),
            CensusRow("b", "unaccelerated", "eager attention", full_attention=True, causal=True),
            CensusRow("c", "unaccelerated", "bidirectional", full_attention=True, causal=False),
            CensusRow("d", "unaccelerated", "unknown", full_attention=True, causal=None),  # not measured: counted
            CensusRow("e", "unaccelerated", "a scan", full_attention=False, causal=False),  # counted once, as no-full
            CensusRow("f", "skipped", "encoder-decoder model", causal=False)]  # skipped rows never count
    assert accelerated_share(rows) == (1, 3)
    text = table(rows, "test")
    assert "Accelerated share: 1 of 3 (33%)" in text
    assert "1 run rows without one" in text and "1 run rows that are not causal decoders" in text
    assert "| c | unaccelerated |  | yes (config) | no: earlier logits change with later tokens |" in text
    assert "| a | accelerated |  | yes (graph) | yes |" in text


def test_causality_probe():
    """The probe on plain models: a causal decoder, and the same family built as a bidirectional encoder."""
    import torch

    from uniprefill.testing.census import _close, tiny_config
    from uniprefill.testing.census_causal import causal_probe
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    found = {}
    for is_decoder in (True, False):  # BertGeneration: causal only as a decoder
        config = tiny_config("bert-generation")
        config.is_decoder = is_decoder
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            plain = model(input_ids=ids, use_cache=False).logits
        found[is_decoder] = causal_probe(model, ids, plain, 3, 128, _close)
    assert found == {True: True, False: False}
    with pytest.raises(ValueError, match="two token ids"):
        causal_probe(model, ids, plain, 3, 4, _close)


@pytest.mark.parametrize("model_type, expected", [
    ("mixtral", True),  # no window in the default config: full attention in every layer
    ("mistral", False),  # a 4096-token window in every layer by default
    ("ministral", False),  # layer_types of sliding layers only
    ("gemma3_text", True),  # sliding / full pattern
    ("recurrent_gemma", False),  # recurrent blocks and local attention (attention_window_size)
    ("mamba", False),
])
def test_full_attention_from_the_tiny_config(model_type, expected):
    from uniprefill.testing.census import tiny_config

    found, basis = full_attention(model_type, tiny_config(model_type))
    assert found is expected and basis, (found, basis)


def test_tiny_configs_keep_the_default_attention_kind():
    from uniprefill.testing.census import _build, tiny_config

    for model_type in ("mixtral", "phi3", "phimoe", "starcoder2", "ministral3"):  # no window by default
        assert tiny_config(model_type).sliding_window is None, model_type
    assert tiny_config("mistral").sliding_window == 24 and tiny_config("gemma3_text").sliding_window == 24
    assert tiny_config("qwen2").sliding_window is None  # use_sliding_window=False: left as it is
    assert tiny_config("codegen").rotary_dim == 8  # half of a 16-wide head
    mla = tiny_config("deepseek_v3")
    assert (mla.head_dim, mla.qk_rope_head_dim, mla.n_group, mla.topk_group) == (8, 8, 1, 1)
    assert _build("gemma4_assistant")[1].startswith("a drafter")
    assert _build("gemma4")[1].startswith("multimodal")


def test_a_mismatch_says_when_torch_compile_itself_changes_the_answer():
    """transformers 5.17's Doge: its eager forward is not causal, its traced graph is, so uniprefill at p = 1 (a
    traced graph) differs from the eager model exactly as plain `torch.compile(backend="eager")` does. The census
    row says so; where uniprefill differs from the compiled model too, it says nothing of the kind."""
    from types import SimpleNamespace

    import torch

    from uniprefill.testing.census import _compiled_plain_differs

    class TracedDiffers(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            logits = input_ids.float()[..., None].expand(-1, -1, 4)
            if not torch.compiler.is_compiling():
                logits = logits + 1.0
            return SimpleNamespace(logits=logits)

    model, ids = TracedDiffers(), torch.arange(6)[None]
    eager = model(input_ids=ids).logits[:, -1]
    traced = eager - 1.0
    assert "torch.compile itself changes" in _compiled_plain_differs(model, ids, traced, eager)
    assert _compiled_plain_differs(model, ids, traced + 0.5, eager) == ""
