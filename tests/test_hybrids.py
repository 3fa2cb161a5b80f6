"""The backend on tiny random-weight hybrids: linear/full, conv/full, Mamba2/full, sliding/full."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.models.layer_kinds import layer_kinds
from uniprefill.models.presets import build_random_model

SMALL = dict(sink=16, last_q=16, block_size=16)
HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-lfm2", "tiny-granitemoehybrid", "tiny-olmo3"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_kinds_parity_and_drop(name):
    torch.manual_seed(0)
    model = build_random_model(name, torch.float32, "cpu")
    kinds = layer_kinds(model.config)
    first_full = kinds.index("full")
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[:, -1]
        exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(first_full,), **SMALL))
        same = exact(input_ids=ids, use_cache=False).logits[:, -1]
        report = uniprefill.graph_reports(exact)[0]
        assert report.rewritten, report.reason
        assert [r.kind for r in report.layers] == kinds
        torch.testing.assert_close(same, ref, atol=1e-4, rtol=0)
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers=(first_full,), **SMALL))
        out = fast(input_ids=ids, use_cache=False).logits[:, -1]
    history = uniprefill.last_drop_report(fast)
    assert history.points[0].kept[0] <= 0.6 * 300
    assert torch.isfinite(out).all()
    if first_full < len(kinds) - 1:
        # p = 1 reproduces the model to ~1e-7 here; dropping half the tokens must move the answer.
        assert (out - ref).abs().max() > 1e-5, "later layers ran on fewer tokens"
