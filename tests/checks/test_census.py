"""The architecture census over a bounded set of model types (the full census: `uniprefill census`)."""

from __future__ import annotations

import pytest

from uniprefill.testing.census import census_one, table


@pytest.mark.parametrize("model_type, status", [
    ("llama", "accelerated"),
    ("qwen3_5_text", "accelerated"),  # gated delta-net / full hybrid, 300 tokens > its 64-token chunk
    ("gpt2", "accelerated"),  # its embedding reads input_ids.view(-1, N): the token input all the same
    # embeds input_ids.to(device); chunked local-attention layers: prefill accelerated, generation runs
    # unaccelerated (decode after a drop does not model chunks), equal to the plain model
    ("llama4_text", "accelerated"),
    ("gpt_oss", "accelerated"),  # eager attention with learned sinks, recognised as one attention site
    ("bloom", "accelerated"),  # eager attention with ALiBi (a per-key bias); its attention bypasses the interface
    ("gpt_neo", "unaccelerated"),  # eager attention whose causal mask is sliced from a registered buffer
    ("bert", "skipped"),
])
def test_census_rows(model_type, status):
    row = census_one(model_type)
    assert row.status == status, row
    if status in ("unaccelerated", "skipped"):
        assert row.reason, "a type that is not accelerated says why"
    if model_type == "gpt_neo":
        assert "registered buffer" in row.reason, row.reason  # the form is named
    if status == "accelerated":
        expected = "equal (generation unaccelerated)" if model_type in ("llama4_text", "bloom") else "equal"
        assert row.generation == expected and row.dropped not in ("", "none"), row
        assert all(v is True for v in row.checks.values()), row.checks
    assert f"| {model_type} | {status} |" in table([row], "test")
