"""The vLLM rewrite on graphs whose data flow runs through IN-PLACE ops, as vLLM's Llama graph's
does (CPU, the fake vLLM of `tests/vllm/fake_vllm_model.py`).

vLLM's Llama layers call `_C.fused_add_rms_norm(x, residual, weight, eps)`, which overwrites
`residual` with `x + residual` and `x` with its RMS norm, and `_C.silu_and_mul(out, gate_up)`
into `out = torch.empty((s, intermediate))`; the graph returns the last `down_proj` output after
the final in-place norm. So a value computed after a drop point may have no FX edge to any
gathered value (only to the kept count), and the residual stream lives in a tensor made before
the drop and mutated after it. The H200 run of 2026-12-01 found the first (the output was not
scattered back: vLLM's `hidden_states[logits_indices]` hit a device-side assert); these tests
pin both, against a plain-PyTorch reference on the kept rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fake_vllm_model import (BLOCK, DIM, HEADS, HIDDEN, LAYERS, VOCAB, WORLD, TinyBackbone, causal_attention,
                             compile_with_drops, fake_context, kept_per_request, rope)
from uniprefill.config import UniPrefillConfig

EPS, INTERMEDIATE = 1e-5, 48


@torch.library.custom_op("uniprefill_fakevllm::gelu_into", mutates_args=("out",))
def gelu_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """Like vLLM's `_C.silu_and_mul(out, x)`: fills a preallocated buffer in place."""
    out.copy_(torch.nn.functional.gelu(x))


@gelu_into.register_fake
def _(out, x):
    return None


@torch.library.custom_op("uniprefill_fakevllm::silu_and_mul", mutates_args=("out",))
def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """vLLM's `_C.silu_and_mul`: out = silu(x[:, :d]) * x[:, d:]."""
    half = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :half]) * x[..., half:])


@silu_and_mul.register_fake
def _(out, x):
    return None


@torch.library.custom_op("uniprefill_fakevllm::fused_add_rms_norm", mutates_args=("input", "residual"))
def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """vLLM's `_C.fused_add_rms_norm`: residual <- input + residual; input <- rms_norm(residual)."""
    residual.add_(input)
    input.copy_(rms_norm(residual, weight, epsilon))


@fused_add_rms_norm.register_fake
def _(input, residual, weight, epsilon):
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class OutputThroughABuffer(TinyBackbone):
    """Ends with a projection of `torch.empty((s, ...))` filled in place: in FX the output
    descends from the token count only, not from any gathered value."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids, positions)
        buffer = torch.empty((x.shape[0], HIDDEN))
        torch.ops.uniprefill_fakevllm.gelu_into(buffer, x)
        return self.head(buffer)

    def reference(self, ids, kept, windows=None):
        return self.head(torch.nn.functional.gelu(super().reference(ids, kept, windows)))


class VllmLlamaStyle(nn.Module):
    """vLLM's Llama decoder layer order, in-place ops and buffers, at toy size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, 3 * HEADS * DIM, bias=False) for _ in range(LAYERS))
        self.o = nn.ModuleList(nn.Linear(HEADS * DIM, HIDDEN, bias=False) for _ in range(LAYERS))
        self.gate_up = nn.ModuleList(nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False) for _ in range(LAYERS))
        self.down = nn.ModuleList(nn.Linear(INTERMEDIATE, HIDDEN, bias=False) for _ in range(LAYERS))
        self.norms = nn.Parameter(1.0 + 0.1 * torch.randn(2 * LAYERS + 1, HIDDEN))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.uniprefill_fakevllm
        x, residual = self.embed(input_ids), None
        for i in range(LAYERS):
            if residual is None:
                residual, x = x, rms_norm(x, self.norms[2 * i])
            else:
                ops.fused_add_rms_norm(x, residual, self.norms[2 * i], EPS)
            q, k, v = self.qkv[i](x).view(-1, 3, HEADS, DIM).unbind(1)
            q, k = rope(q, positions), rope(k, positions)
            out = torch.empty((q.shape[0], HEADS, DIM))
            dep = ops.unified_kv_cache_update(k, v, f"model.layers.{i}.self_attn.attn")
            ops.unified_attention_with_output(q, k, v, out, f"model.layers.{i}.self_attn.attn", kv_cache_dummy_dep=dep)
            x = self.o[i](out.view(-1, HEADS * DIM))
            ops.fused_add_rms_norm(x, residual, self.norms[2 * i + 1], EPS)
            gate_up = self.gate_up[i](x)
            act = torch.empty((gate_up.shape[0], INTERMEDIATE))
            ops.silu_and_mul(act, gate_up)
            x = self.down[i](act)
        ops.fused_add_rms_norm(x, residual, self.norms[2 * LAYERS], EPS)
        return x

    def reference(self, ids: torch.Tensor, kept: dict[int, torch.Tensor]) -> torch.Tensor:
        """One request alone, out of place; rows `kept[layer]` survive that layer's attention."""
        x, positions = self.embed(ids), torch.arange(ids.numel())
        residual = x
        for i in range(LAYERS):
            h = rms_norm(residual, self.norms[2 * i])
            q, k, v = self.qkv[i](h).view(-1, 3, HEADS, DIM).unbind(1)
            q, k = rope(q, positions), rope(k, positions)
            residual = residual + self.o[i](causal_attention(q, k, v).reshape(-1, HEADS * DIM))
            if i in kept:
                residual, positions = residual[kept[i]], positions[kept[i]]
            gate, up = self.gate_up[i](rms_norm(residual, self.norms[2 * i + 1])).chunk(2, dim=-1)
            residual = residual + self.down[i](torch.nn.functional.silu(gate) * up)
        return rms_norm(residual, self.norms[2 * LAYERS])[-1]


def run_and_compare(model: nn.Module, drops: tuple[int, ...], query_lens: list[int], seed: int) -> dict:
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, drops)
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        hidden = compiled(ids, positions)
    torch._dynamo.reset()
    assert state["result"].scattered == 1 and hidden.shape == (sum(query_lens), HIDDEN)
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    per_point = [kept_per_request(point, query_lens) for point in state["runtime"].step.points]
    assert all(len(k) < 0.6 * q for k, q in zip(per_point[-1], query_lens))  # every prompt dropped rows
    with torch.no_grad():
        for r in range(len(query_lens)):
            kept, alive = {}, list(range(query_lens[r]))  # positions entering each drop point
            for layer, points in zip(drops, per_point):
                kept[layer] = torch.tensor([j for j, position in enumerate(alive) if position in points[r]])
                alive = [alive[j] for j in kept[layer].tolist()]
            torch.testing.assert_close(hidden[qsl[r + 1] - 1], model.reference(ids[qsl[r]:qsl[r + 1]], kept),
                                       atol=1e-5, rtol=1e-5)
    return state


def test_an_output_filled_in_place_after_the_drop_is_scattered_back_to_every_row():
    """Regression (H200, 2026-12-01): the rewrite reported `scattered=0` on vLLM's Llama graph and
    the model returned the kept rows only."""
    run_and_compare(OutputThroughABuffer().eval(), (1,), [200, 130], seed=5)


def test_a_vllm_llama_style_graph_with_in_place_norms_matches_the_reference():
    """The residual stream is made before the drop and mutated in place after it (fused add-norm),
    MLP activations go through `torch.empty` buffers, and the output is the in-place-normed last
    projection: with one and two drop points, the last token of every request equals the
    out-of-place reference on the kept rows."""
    model = VllmLlamaStyle().eval()
    for drops in ((1,), (1, 2)):
        state = run_and_compare(model, drops, [210, 150], seed=6)
        assert state["result"].sizes_replaced >= 1  # the token symbol sizing the torch.empty buffers


def test_an_output_the_analysis_missed_fails_with_a_clear_error(monkeypatch):
    """The safety net behind the scatter: were the FX analysis to miss that an output is computed
    after the drop (simulated here), the output would reach vLLM with the kept rows only; instead
    `check_rows` stops the step with an error naming the shapes."""
    from uniprefill.vllm import rewrite as vllm_rewrite

    monkeypatch.setattr(vllm_rewrite, "_descends_from", lambda node, sources: False)
    model = OutputThroughABuffer().eval()
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, (1,))
    query_lens = [160, 120]
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(7))
    WORLD.context = fake_context(query_lens)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"has \d+ rows for a step of 280 tokens"):
        compiled(ids, torch.cat([torch.arange(q) for q in query_lens]))
    torch._dynamo.reset()
    assert state["result"].scattered == 0
    assert sum(node.target is torch.ops.uniprefill.check_rows.default for node in state["gm"].graph.nodes) == 1
