"""A causal mask sliced from a table the model holds (GPT-Neo, OpenAI-GPT: `passes/causal_table.py`).

The table (a registered buffer, a graph input) is read as causal, with GPT-Neo's local layers as a
window of 256 keys, only while its values are exactly that band: a table that is not, at compile
time, leaves the model unaccelerated with the reason; one changed in place after compiling makes
the next call run the original graph with the reason. Every result equals the plain model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill import sink_ops  # noqa: F401  (registers uniprefill::table_mask)
from uniprefill.passes.causal_table import TableRole, band, band_window
from uniprefill.testing.census import tiny_config
from uniprefill.unaccelerated import Kind

SMALL = dict(sink=16, last_q=16, block_size=16)
ATOL = 1e-5


def _model(model_type):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()


def _ids(rows, n):
    return torch.randint(3, 128, (rows, n), generator=torch.Generator().manual_seed(1))


def _tables(model):
    return [m.bias for m in model.modules() if "Attention" in type(m).__name__ and isinstance(
        getattr(m, "bias", None), torch.Tensor) and m.bias.dim() == 4]


def _exact(model):
    return uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SMALL))


@pytest.mark.parametrize("model_type, kinds", [
    ("gpt_neo", [("full", 0), ("sliding", 256), ("full", 0), ("sliding", 256)]),  # global / local layers
    ("openai-gpt", [("full", 0)] * 4),  # keys permuted to [B, H, d, N], logits / sqrt(d), hidden at -1e4
])
def test_table_masked_attention_is_accelerated_and_equals_the_plain_model(model_type, kinds):
    model = _model(model_type)
    ids = _ids(2, 300)  # longer than GPT-Neo's window: its local layers mask keys the global ones see
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = _exact(model)
        one = exact(input_ids=ids[:1], use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        torch.testing.assert_close(one, model(input_ids=ids[:1], use_cache=False).logits, atol=ATOL, rtol=0)
        report = [g for g in uniprefill.graph_reports(exact) if g.rewritten][-1]
        assert [(r.kind, r.window) for r in report.layers] == kinds
        assert report.counts["eager_attention_sites"] == 4
        two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(two[0], ref[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(two[1, 37:], ref[1, 37:], atol=ATOL, rtol=0)
        torch._dynamo.reset()
        fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SMALL))
        logits = fast(input_ids=ids[:1], use_cache=False).logits
        assert fast.backend.last_unaccelerated is None, fast.backend.last_unaccelerated
    torch._dynamo.reset()
    assert torch.isfinite(logits).all()
    assert uniprefill.last_drop_report(fast).overall_retention < 0.75


def test_a_table_that_is_not_causal_is_not_read_as_causal():
    """OpenAI-GPT's table is its only causal mask: one future key made visible in every layer."""
    model = _model("openai-gpt")
    for table in _tables(model):
        table[0, 0, 5, 9] = 1.0
    ids = _ids(1, 120)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = _exact(model)
        out = exact(input_ids=ids, use_cache=False).logits
        why = exact.backend.last_unaccelerated
        ref = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    assert why is not None and "table the model holds" in why and "not a lower-triangular band" in why, why
    assert uniprefill.last_drop_report(exact) is None or not uniprefill.last_drop_report(exact).points
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_a_table_changed_after_compiling_runs_the_original_graph():
    model = _model("openai-gpt")
    ids = _ids(1, 120)
    table = _tables(model)[2]
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = _exact(model)
        exact(input_ids=ids, use_cache=False)
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        table[0, 0, 3, 7] = 1.0  # in place: the same tensor, a new version
        out = exact(input_ids=ids, use_cache=False).logits
        why = exact.backend.last_unaccelerated
        torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, atol=ATOL, rtol=0)
        table[0, 0, 3, 7] = 0.0  # causal again: checked again, accelerated again
        back = exact(input_ids=ids, use_cache=False).logits
        assert exact.backend.last_unaccelerated is None, exact.backend.last_unaccelerated
        torch.testing.assert_close(back, model(input_ids=ids, use_cache=False).logits, atol=ATOL, rtol=0)
    torch._dynamo.reset()
    assert why is not None and why.kind is Kind.INPUT_NOT_MODELLED and "no longer lower-triangular" in why, why


def test_band_window_reads_only_exact_bands():
    m = 12
    causal, local = band(m, 0), band(m, 4)
    assert band_window(causal[None, None]) == 0 and band_window(local[None, None]) == 4
    assert band_window(causal.float()[None, None]) == 0 and band_window(local.double()[None, None]) == 4
    gpt_neo_local = torch.bitwise_xor(causal, torch.tril(causal, -4))  # how GPT-Neo builds its local table
    assert torch.equal(gpt_neo_local, local)
    future = causal.clone()
    future[2, 5] = True
    soft = causal.float()
    soft[7, 3] = 0.5
    hole = causal.clone()
    hole[7, 3] = False
    for bad in (future, soft, hole, torch.ones(m, m, dtype=torch.bool), torch.zeros(m, m, dtype=torch.bool)):
        assert band_window(bad[None, None]) is None
    assert band_window(causal[None]) is None and band_window(causal.expand(2, 1, m, m)) is None  # not [1, 1, M, M]


def test_the_check_is_cached_per_tensor_version_only():
    m = 16
    table = band(m, 0).float()[None, None].clone()
    role = TableRole(0, (1, 1, m, m))
    assert role.failed(table, "t") is None
    table[0, 0, 0, 3] = 1.0  # in place after a passed check: checked again
    assert "no longer lower-triangular" in role.failed(table, "t")
    table[0, 0, 0, 3] = 0.0
    assert role.failed(table, "t") is None
    other = band(m, 3).float()[None, None]  # another tensor: checked on its own
    assert "band of 0" not in role.failed(other, "t") and role.failed(other, "t") is not None
    assert "not a [1, 1, 16, 16] tensor" in role.failed(table[..., :8, :8], "t")
    with torch.inference_mode():  # no version counter: checked on every call
        frozen = band(m, 0)[None, None].clone()
    assert role.failed(frozen, "t") is None and role.failed(frozen, "t") is None


def _captured(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, dynamic=True)(*args)
    torch._dynamo.reset()
    return graphs[0]


def _hide_at_1e4(b):
    return -1e4 * (1 - b)


def _hide_at_1(b):  # a soft mask: hidden keys keep some weight
    return -1.0 * (1 - b)


def _table_attention(n, hide):
    """OpenAI-GPT's attention on given q, k, v; `hide(b)` is added where the table hides a key (the fill
    is a literal of the code: a float held by an attribute or a closure reaches the graph as an input)."""

    class TableAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Buffer(torch.tril(torch.ones(n, n)).view(1, 1, n, n))

        def forward(self, q, k, v):
            w = torch.matmul(q, k.transpose(-1, -2)) / 4.0
            b = self.bias[:, :, : w.size(-2), : w.size(-1)]
            w = w * b + hide(b)
            return torch.matmul(torch.softmax(w, dim=-1), v)

    return TableAttention().eval()


@pytest.mark.parametrize("hide, matched", [(_hide_at_1e4, True), (_hide_at_1, False)], ids=["hiding", "soft"])
def test_only_a_hiding_fill_is_read_as_a_table_mask(hide, matched):
    from uniprefill.passes.sink_attention import canonicalize_sink_attention

    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    module = _table_attention(64, hide)
    gm, inputs = _captured(module, q, k, v)
    new, with_op, plain = canonicalize_sink_attention(gm)
    assert (with_op, plain) == (0, 1 if matched else 0)
    if matched:  # one SDPA call on a table_mask, computing what the module computes
        masks = [n for n in new.graph.nodes if n.target is torch.ops.uniprefill.table_mask.default]
        assert len(masks) == 1
        torch.testing.assert_close(new(*inputs)[0], module(q, k, v), atol=ATOL, rtol=0)
