"""The fake vLLM's model side, shared by the vLLM rewrite tests (CPU): paged KV caches written
through slot mappings and attention read through block tables and `seq_lens` (custom ops with
vLLM 0.26's names and signatures, namespace `uniprefill_fakevllm`), driven by `WORLD.context`,
a forward context of per-layer metadata shaped like vLLM's (`FlashAttentionMetadata` field
names; `tests/vllm/fake_vllm.py` builds it), and a tiny token-major model traced by dynamo as
vLLM's mode 2 traces its backbone. One module, imported once: the custom ops are registered
at import (test modules are imported under their own names, so they must not define them).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from fake_vllm import make_world, step
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.graph import analyze_vllm_graph
from uniprefill.vllm.rewrite import rewrite_vllm_graph
from uniprefill.vllm.drop import VllmDropRuntime, WindowLayer


HEADS, DIM, HIDDEN, LAYERS, VOCAB, BLOCK = 2, 16, 32, 4, 64, 16
WORLD = types.SimpleNamespace(context=None)  # the fake vLLM's forward context (tests only)


@torch.library.custom_op("uniprefill_fakevllm::unified_kv_cache_update", mutates_args=())
def unified_kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    ctx = WORLD.context
    if ctx.attn_metadata is None:  # a dummy run: vLLM's slots are -1, nothing is written
        return key.new_empty(0)
    cache = ctx.kv_caches[layer_name]  # [2, slots, heads, dim]
    slots = ctx.slot_mapping[layer_name]
    cache[0, slots] = key
    cache[1, slots] = value
    return key.new_empty(0)


@unified_kv_cache_update.register_fake
def _(key, value, layer_name):
    return key.new_empty(0)


@torch.library.custom_op("uniprefill_fakevllm::unified_attention_with_output", mutates_args=("output",))
def unified_attention_with_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  output: torch.Tensor, layer_name: str,
                                  kv_cache_dummy_dep: torch.Tensor | None = None) -> None:
    ctx = WORLD.context
    if ctx.attn_metadata is None:  # a profiling run: vLLM's FlashAttention writes zeros
        output.zero_()
        return
    meta = ctx.attn_metadata[layer_name]
    cache = ctx.kv_caches[layer_name]
    qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    assert meta.num_actual_tokens == query.shape[0] == qsl[-1], "metadata does not describe this batch"
    for r, seq_len in enumerate(seq_lens):
        rows = slice(qsl[r], qsl[r + 1])
        n_q = qsl[r + 1] - qsl[r]
        window = getattr(ctx, "windows", {}).get(layer_name, 0)
        # FlashAttention's sliding window: the last `window` cache entries (it reads no others,
        # so entries in blocks vLLM freed behind the window are never touched)
        logical = torch.arange(max(0, seq_len - n_q - window + 1) if window else 0, seq_len)
        slots = meta.block_table[r, logical // BLOCK].long() * BLOCK + logical % BLOCK
        k, v = cache[0, slots], cache[1, slots]  # [entries, heads, dim]
        scores = torch.einsum("qhd,khd->hqk", query[rows], k) * DIM ** -0.5
        own = (seq_len - n_q + torch.arange(n_q))[:, None]
        visible = logical[None, :] <= own
        if window:
            visible &= logical[None, :] > own - window
        scores = scores.masked_fill(~visible, float("-inf"))
        output[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@unified_attention_with_output.register_fake
def _(query, key, value, output, layer_name, kv_cache_dummy_dep=None):
    return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Softmax attention of one request over its own rows [n, heads, dim]: causal, and within `window` ORIGINAL
    positions when given (the references' rule)."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM ** -0.5
    causal = torch.ones(len(q), len(q), dtype=torch.bool).tril()
    if window:
        causal &= (positions[:, None] - positions[None, :]) < window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A position-dependent rotation of pairs (stands in for RoPE: positions must stay original)."""
    angle = positions[:, None, None].float() * 0.05
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1).flatten(-2)


class TinyBackbone(nn.Module):
    """Token-major decoder backbone, vLLM style: [s] ids and positions in, [s, hidden] out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, 3 * HEADS * DIM, bias=False) for _ in range(LAYERS))
        self.o = nn.ModuleList(nn.Linear(HEADS * DIM, HIDDEN, bias=False) for _ in range(LAYERS))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 64), nn.GELU(), nn.Linear(64, HIDDEN))
                                 for _ in range(LAYERS))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for i in range(LAYERS):
            name = f"model.layers.{i}.self_attn.attn"
            q, k, v = self.qkv[i](x).view(-1, 3, HEADS, DIM).unbind(1)
            q, k = rope(q, positions), rope(k, positions)
            out = torch.empty((q.shape[0], HEADS, DIM))  # as vLLM's Attention.forward sizes its output
            dep = torch.ops.uniprefill_fakevllm.unified_kv_cache_update(k, v, name)
            torch.ops.uniprefill_fakevllm.unified_attention_with_output(q, k, v, out, name, kv_cache_dummy_dep=dep)
            x = x + self.o[i](out.view(-1, HEADS * DIM))
            x = x + self.mlp[i](x)
        return x

    def reference(self, ids: torch.Tensor, kept: dict[int, torch.Tensor],
                  windows: dict[int, int] | None = None, rows_from: int | None = None) -> torch.Tensor:
        """One request alone; `kept[layer]` = rows kept right after that layer's attention;
        `windows[layer]`: a sliding window over ORIGINAL positions (the model's rule). The last row's
        hidden state, or with `rows_from` those of every row left at the end at that position or later."""
        x, positions = self.embed(ids), torch.arange(ids.numel())
        for i in range(LAYERS):
            q, k, v = self.qkv[i](x).view(-1, 3, HEADS, DIM).unbind(1)
            q, k = rope(q, positions), rope(k, positions)
            out = causal_attention(q, k, v, positions, (windows or {}).get(i))
            x = x + self.o[i](out.reshape(-1, HEADS * DIM))
            if i in kept:
                x, positions = x[kept[i]], positions[kept[i]]
            x = x + self.mlp[i](x)
        return x[-1] if rows_from is None else x[positions >= rows_from]

    def decode_reference(self, tokens: torch.Tensor, prompt_len: int, prompt_kept: list[set[int]],
                         drops, windows: dict[int, int] | None = None, rows_from: int | None = None) -> torch.Tensor:
        """The last token of one request decoding after a dropped prefill: `tokens` = prompt +
        decoded; `prompt_kept[i]` = the prompt positions drop point `drops[i]` kept; every decoded
        token is kept everywhere; `windows` as in `reference`."""
        n = tokens.numel()
        kept, entering = {}, torch.arange(n)
        for layer, kept_prompt in zip(drops, prompt_kept):
            keep_rows = torch.tensor(sorted(kept_prompt | set(range(prompt_len, n))))
            keep = torch.nonzero(torch.isin(entering, keep_rows)).flatten()
            kept[layer], entering = keep, entering[keep]
        extra = {} if windows is None and rows_from is None else {"windows": windows, "rows_from": rows_from}
        return self.reference(tokens, kept, **extra)  # subclasses without windows take (ids, kept)


def fake_window_layer(name: str) -> WindowLayer:
    """The fake vLLM's cache of one layer as vLLM's FlashAttention views it: [blocks, B, H, D]."""
    cache = WORLD.context.kv_caches[name]
    return WindowLayer(cache[0].view(-1, BLOCK, HEADS, DIM), cache[1].view(-1, BLOCK, HEADS, DIM), DIM ** -0.5)


def compile_with_drops(model: nn.Module, config: UniPrefillConfig, drops, windows: dict[int, int] | None = None,
                       graph_decode_max_reqs: int = 0) -> tuple:
    """torch.compile(model) with a backend that rewrites the graph as the vLLM plugin does
    (mode 2: dynamo hands over the whole backbone once, with a symbolic token count)."""
    state = {}
    windows = windows or {}
    kinds = ["sliding" if i in windows else "full" for i in range(LAYERS)]

    def backend(gm, example_inputs):
        info = analyze_vllm_graph(gm)
        names = [site.layer_name for site in info.sites]
        runtime = VllmDropRuntime(config, names, drops,
                                  context_fn=lambda: WORLD.context, block_size_fn=lambda name: BLOCK,
                                  request_ids_fn=lambda: WORLD.context.request_ids,
                                  request_p_fn=lambda: getattr(WORLD.context, "request_p", None),
                                  num_prompt_tokens_fn=lambda: getattr(WORLD.context, "num_prompt_tokens", None),
                                  windows={names[i]: w for i, w in windows.items() if i > drops[0]},
                                  window_layer_fn=fake_window_layer, graph_decode_max_reqs=graph_decode_max_reqs)
        state.update(info=info, runtime=runtime, gm=gm,
                     result=rewrite_vllm_graph(gm, info, drops, kinds, runtime))
        return gm.forward

    return torch.compile(model, backend=backend, dynamic=True, fullgraph=True), state


def fake_context(query_lens: list[int], groups: int = 2, room: int = 8):
    """A prefill-only step in the fake vLLM (tests/vllm/fake_vllm.py): layer i in KV-cache group i % groups."""
    return make_world(query_lens, layers=LAYERS, groups=groups, block=BLOCK, kv_heads=HEADS, head_size=DIM, room=room)


step_context = step


def kept_per_request(point, query_lens: list[int]) -> list[set[int]]:
    """The prompt positions each request of a prefill batch kept at a drop point."""
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    rows = point.source_rows
    return [set((rows[(rows >= qsl[r]) & (rows < qsl[r + 1])] - qsl[r]).tolist()) for r in range(len(query_lens))]
