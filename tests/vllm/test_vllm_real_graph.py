"""The vLLM rewrite on vLLM's REAL Gemma-3-270M backbone graph (CPU).

`docs/results/vllm-dump-gemma-270m-h200.tar.gz` holds the graph vLLM 0.26.0's mode 2 handed to
its backend on the H200 (`graph-0.py`: 18 layers, vLLM's in-place `_C.rotary_embedding` and
`_C.gelu_tanh_and_mul`, `torch.Size([s72, ...])` output buffers, hoisted `LayerName`
placeholders). Here that code runs on CPU in float32 (its bf16 casts made fp32, so that a
difference means a bug, not rounding) with random weights of its shapes (a smaller
vocabulary), vLLM's ops replaced by CPU versions with vLLM's signatures (paged KV written
through slot mappings, attention read through block tables, sliding windows for every layer
but 5, 11 and 17, KV-cache groups {i, i + 6, i + 12} as vLLM built them).

Reference ("masked"): the same graph, not rewritten, whose attention at every layer after a
drop point sees only the keys that layer holds (kept at the drop points before it, windows
over original positions). Every other sublayer is row-wise, so at each kept row the masked
graph computes exactly what the dropping graph computes; the last token of each request is
compared, at prefill and at two decode steps.
"""

from __future__ import annotations

import inspect
import json
import re
import tarfile
import types
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fake_vllm import make_world, step
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.graph import analyze_vllm_graph
from uniprefill.vllm.rewrite import rewrite_vllm_graph
from uniprefill.vllm.drop import VllmDropRuntime, WindowLayer

DUMP = Path(__file__).resolve().parents[2] / "docs" / "results" / "vllm-dump-gemma-270m-h200.tar.gz"
LAYERS, FULL, GROUPS, BLOCK, WINDOW, VOCAB = 18, (5, 11, 17), 6, 16, 96, 1024
KV_HEADS, HEAD = 1, 256
NS = "uniprefill_realgraph"
WORLD = types.SimpleNamespace(context=None)


def _layer(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


@torch.library.custom_op(f"{NS}::unified_kv_cache_update", mutates_args=())
def unified_kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    ctx = WORLD.context
    if ctx.attn_metadata is not None:
        slots = ctx.slot_mapping[layer_name]
        ctx.kv_caches[layer_name][0, slots] = key[:slots.numel()]
        ctx.kv_caches[layer_name][1, slots] = value[:slots.numel()]
    return key.new_empty(0)


@unified_kv_cache_update.register_fake
def _(key, value, layer_name):
    return key.new_empty(0)


@torch.library.custom_op(f"{NS}::unified_attention_with_output", mutates_args=("output",))
def unified_attention_with_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                                  layer_name: str, output_scale: torch.Tensor | None = None,
                                  output_block_scale: torch.Tensor | None = None,
                                  kv_cache_dummy_dep: torch.Tensor | None = None) -> None:
    """vLLM's FlashAttention on the paged cache; in the reference mode (`ctx.visible`), the
    keys each layer holds after the drops instead of every key."""
    ctx = WORLD.context
    if ctx.attn_metadata is None:
        output.zero_()
        return
    meta, cache, layer = ctx.attn_metadata[layer_name], ctx.kv_caches[layer_name], _layer(layer_name)
    window = 0 if layer in FULL else WINDOW
    qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for r, seq_len in enumerate(seq_lens):
        rows = slice(qsl[r], qsl[r + 1])
        n_q = qsl[r + 1] - qsl[r]
        logical = torch.arange(seq_len)
        slots = meta.block_table[r, logical // BLOCK].long() * BLOCK + logical % BLOCK
        k, v = cache[0, slots].float(), cache[1, slots].float()
        own = (seq_len - n_q + torch.arange(n_q))[:, None]  # positions = logical indices here
        visible = logical[None, :] <= own
        if window:
            visible &= logical[None, :] > own - window
        if ctx.visible is not None and layer in ctx.visible:
            visible &= ctx.visible[layer][r][None, :seq_len]
        q = query[rows].float()
        scores = torch.einsum("qhd,khd->hqk", q, k.expand(-1, q.shape[1], -1)) * HEAD ** -0.5
        # a dropped row of the reference may see no key at all: zeros, not NaN (its row is never compared)
        probs = torch.nan_to_num(scores.masked_fill(~visible, float("-inf")).softmax(-1), nan=0.0)
        output[rows] = torch.einsum("hqk,khd->qhd", probs, v.expand(-1, q.shape[1], -1)).to(output.dtype)


@unified_attention_with_output.register_fake
def _(query, key, value, output, layer_name, output_scale=None, output_block_scale=None, kv_cache_dummy_dep=None):
    return None


@torch.library.custom_op(f"{NS}::rotary_embedding", mutates_args=("query", "key"))
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """vLLM's in-place NeoX rotary embedding ([T, H * D] query and key)."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    for x in (query, key):
        view = x.view(x.shape[0], -1, head_size)
        x1, x2 = view[..., : head_size // 2].float(), view[..., head_size // 2:].float()
        c, s = cos[:, None, :], sin[:, None, :]
        view.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype))


@rotary_embedding.register_fake
def _(positions, query, key, head_size, cos_sin_cache, is_neox):
    return None


@torch.library.custom_op(f"{NS}::gelu_tanh_and_mul", mutates_args=("out",))
def gelu_tanh_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    half = input.shape[-1] // 2
    out.copy_((torch.nn.functional.gelu(input[..., :half].float(), approximate="tanh")
               * input[..., half:].float()).to(out.dtype))


@gelu_tanh_and_mul.register_fake
def _(out, input):
    return None


def _load_dump(dtype: torch.dtype = torch.float32):
    """The dumped GraphModule class (its bf16 casts made `dtype`) and its layer-name placeholders."""
    with tarfile.open(DUMP) as tar:
        code = tar.extractfile("vllm-dump/graph-0.py").read().decode()
        meta = json.load(tar.extractfile("vllm-dump/graph-0.json"))
    code = code.replace("torch.ops.vllm.", f"torch.ops.{NS}.").replace("torch.ops._C.", f"torch.ops.{NS}.")
    code = code.replace("device(type='cuda', index=0)", "device(type='cpu')")
    if dtype != torch.bfloat16:  # fp32 throughout: differences are then bugs, not rounding
        code = code.replace("torch.bfloat16", str(dtype))
    namespace = {"torch": torch, "device": torch.device, "vllm_utils_torch_utils_LayerName": str}
    exec(compile(code, "vllm-dump/graph-0.py", "exec", dont_inherit=True), namespace)  # noqa: S102  (our dump)
    layer_names = {p["target"]: p["example"]["LayerName"] for p in meta["placeholders"]
                   if isinstance(p.get("example"), dict) and "LayerName" in p["example"]}
    return namespace["GraphModule"], layer_names


class VllmGemmaBackbone(torch.nn.Module):
    """The dumped forward with its lifted parameters owned here: forward(input_ids, positions)."""

    def __init__(self, dumped_cls, layer_names: dict[str, str], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dumped = dumped_cls()
        self.layer_names = layer_names
        self.order = list(inspect.signature(self.dumped.forward).parameters)
        gen = torch.Generator().manual_seed(0)
        self.weights = {}
        annotations = self.dumped.forward.__annotations__
        for name in self.order:
            match = re.match(r"bf16\[([\d, ]*)\]", str(annotations.get(name, "")))
            if not name.startswith("L_self") or match is None:
                continue
            shape = [int(x) for x in match.group(1).split(",") if x.strip()]
            if "embed_tokens" in name:
                shape[0] = VOCAB
            if "cos_sin_cache" in name:  # NeoX cache: [max_position, cos | sin]
                inv = 1.0 / (10000 ** (torch.arange(0, HEAD, 2).float() / HEAD))
                angles = torch.arange(shape[0]).float()[:, None] * inv[None, :]
                value = torch.cat([angles.cos(), angles.sin()], dim=-1)
            elif "normalizer" in name:
                value = torch.tensor(640 ** 0.5)
            elif "norm" in name:
                value = 0.1 * torch.randn(shape, generator=gen)
            else:
                value = torch.randn(shape, generator=gen) / max(shape[-1], 1) ** 0.5
            self.weights[name] = value.to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = []
        for name in self.order:
            if name == "s72":
                args.append(input_ids.shape[0])
            elif name == "s80":
                args.append(positions.shape[0])
            elif name == "L_input_ids_":
                args.append(input_ids)
            elif name == "L_positions_":
                args.append(positions)
            elif name in self.layer_names:
                args.append(self.layer_names[name])
            else:
                args.append(self.weights[name])
        return self.dumped.forward(*args)[0]


def new_world(query_lens: list[int], dtype: torch.dtype = torch.float32):
    """vLLM's KV-cache groups for this model: layer i in group i % 6 ({0, 6, 12}, ...)."""
    return make_world(query_lens, layers=LAYERS, groups=GROUPS, block=BLOCK, kv_heads=KV_HEADS, head_size=HEAD,
                      dtype=dtype, request_prefix="r")


def window_layer(name: str) -> WindowLayer:
    cache = WORLD.context.kv_caches[name]
    return WindowLayer(cache[0].view(-1, BLOCK, KV_HEADS, HEAD), cache[1].view(-1, BLOCK, KV_HEADS, HEAD), HEAD ** -0.5,
                       window=WINDOW)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Per request: relative error of the last token's hidden state."""
    for r in range(want.shape[0]):
        err = ((got[r] - want[r]).norm() / want[r].norm()).item()
        assert err < 1e-4, f"{what}, request {r}: relative error {err:.2e}"


@pytest.fixture(scope="module")
def backbone():
    dumped_cls, layer_names = _load_dump()
    return VllmGemmaBackbone(dumped_cls, layer_names).eval()


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager-decode", "decode-graph-path"])
def test_the_rewrite_on_vllms_real_gemma_graph_matches_the_masked_reference(backbone, decode_graphs):
    """Drops at 5 and 11 of vLLM's Gemma-3-270M graph, sliding layers after both: prefill and two decode
    steps against the plain graph masked to the keys each layer holds. With `decode_graphs` the decode steps
    take the path of vLLM's default full decode graphs (window rows and later layers' metadata counted on
    the device from the tables `before_step` refills)."""
    drops = (5, 11)
    config = UniPrefillConfig(keep_ratio=0.3, block_size=BLOCK, last_q=32, sink=32, min_tokens=64)
    state = {}

    def backend(gm: fx.GraphModule, example_inputs):
        info = analyze_vllm_graph(gm)
        names = [s.layer_name for s in info.sites]
        runtime = VllmDropRuntime(config, names, drops, lambda: WORLD.context, lambda name: BLOCK,
                                  request_ids_fn=lambda: WORLD.context.request_ids,
                                  windows={n: WINDOW for i, n in enumerate(names) if i > drops[0] and i not in FULL},
                                  window_layer_fn=window_layer, graph_decode_max_reqs=8 if decode_graphs else 0)
        kinds = ["full" if i in FULL else "sliding" for i in range(LAYERS)]
        state.update(info=info, runtime=runtime, result=rewrite_vllm_graph(gm, info, drops, kinds, runtime))
        return gm.forward

    compiled = torch.compile(backbone, backend=backend, dynamic=True, fullgraph=True)
    query_lens = [300, 40, 220]  # the 40-token prompt is below min_tokens
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    dummy = WORLD.context = new_world(query_lens)  # vLLM's profiling run first: no metadata, no requests
    dummy.attn_metadata, dummy.request_ids = None, None
    with torch.no_grad():
        assert torch.isfinite(compiled(ids.to(torch.int32), positions)).all()
    assert state["runtime"].step.profiling and not state["runtime"].step.points
    world = WORLD.context = new_world(query_lens)
    with torch.no_grad():
        hidden = compiled(ids.to(torch.int32), positions)
    info, runtime, result = state["info"], state["runtime"], state["result"]
    assert info.layers == tuple(range(LAYERS)) and result.windowed == 10  # sliding layers 6-10 and 12-16
    assert result.gathered >= 3 * len(drops) and result.sizes_replaced >= 1
    kept = [[set((p.source_rows[(p.source_rows >= qsl[r]) & (p.source_rows < qsl[r + 1])] - qsl[r]).tolist())
             for p in runtime.step.points] for r in range(3)]
    assert len(kept[0][0]) < 0.5 * 300 and len(kept[1][0]) == 40 and kept[0][1] < kept[0][0]

    def masked_reference(tokens: list[torch.Tensor], extra: int):
        """The plain graph with each layer after a drop attending only to the keys it holds."""
        lens = [t.numel() for t in tokens]
        ref_world = WORLD.context = new_world(lens)
        ref_world.visible = {}
        for layer in range(LAYERS):
            point = sum(1 for d in drops if d < layer) - 1
            if point < 0:
                continue
            ref_world.visible[layer] = [
                torch.isin(torch.arange(n), torch.tensor(sorted(kept[r][point] | set(range(n - extra, n)))))
                for r, n in enumerate(lens)]
        with torch.no_grad():
            out = backbone(torch.cat(tokens).to(torch.int32), torch.cat([torch.arange(n) for n in lens]))
        ends = torch.tensor(lens).cumsum(0) - 1
        return out[ends].float()

    tokens = [ids[qsl[r]:qsl[r + 1]] for r in range(3)]
    ends = torch.tensor(query_lens).cumsum(0) - 1
    _assert_close(hidden[ends].float(), masked_reference(tokens, 0), "prefill")
    for decode in range(2):  # decode steps: each layer attends over the prompt keys it kept + the new ones
        new = torch.randint(0, VOCAB, (3,), generator=torch.Generator().manual_seed(10 + decode))
        computed = [q + decode for q in query_lens]
        WORLD.context = step(world, computed, [1, 1, 1])
        if decode_graphs:
            world.cudagraph_runtime_mode = types.SimpleNamespace(name="FULL")
            runtime.before_step(tuple(world.request_ids))
        with torch.no_grad():
            out = compiled(new.to(torch.int32), torch.tensor(computed))
        tokens = [torch.cat([t, new[r:r + 1]]) for r, t in enumerate(tokens)]
        _assert_close(out.float(), masked_reference(tokens, decode + 1), f"decode step {decode}")
    assert runtime.totals.decode_graph_captures == (2 if decode_graphs else 0)
    torch._dynamo.reset()
