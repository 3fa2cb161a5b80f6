"""Eager attention (with or without learned sinks), recognised in a dynamo graph as one attention site.

GPT-OSS (and other models transformers runs with eager attention only, `_supports_sdpa=False`,
because SDPA cannot apply their sinks) computes attention as plain tensor ops:

    k, v = repeat_kv(k), repeat_kv(v)                     # GQA: getitem(None) -> expand -> reshape
    logits = matmul(q, k.transpose(2, 3)) * scale
    logits = tanh(logits / cap) * cap                     # optional: Gemma-2's logit soft-capping
    logits = logits (+ mask)
    combined = cat([logits, sinks.reshape(1, -1, 1, 1).expand(B, -1, Q, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values   # optional
    probs = softmax(combined, dim=-1[, dtype=float32])[..., :-1]   # the sink column dropped
    out = matmul(dropout(probs, p=0 or training=False).to(v.dtype), v)

`canonicalize_sink_attention` finds every such pattern and replaces it, in a copy of the graph,
by ONE node `uniprefill::sink_attention(q, k, v, attn_mask=..., scale=..., enable_gqa=...,
sinks=...)` with SDPA's argument names, on the keys and values before `repeat_kv`. The passes
then read it exactly as an SDPA call (`fx_utils.is_sdpa`): `classify.analyse_mask` reads its mask
(full or sliding, padding), a drop point scores with its q and k, and `attention_copy` replaces it
by `dense_sink_attention` / `packed_sink_attention` (`softcap` and `upcast`, the float32 softmax
on half-precision logits, travel as keyword arguments). An additive mask `where(visible, 0, min)`
becomes the boolean `visible` it came from (the form of transformers' SDPA masks), when that
leaves every dtype unchanged: adding the most negative float or masking with -inf gives the
same weights here, a sink keeping even a row without visible keys finite.

Every step is checked against the traced values (`example_value`: shapes, dtypes) before a
rewrite; an intermediate value read outside the pattern (attention weights returned to the
caller), a dropout that is on, a softmax in another dtype, or any other form leaves the
pattern alone, and the layer is then classified as having no attention site it understands.
The original graph is never changed (the backend falls back to it).

Without the sink column (a model loaded with `attn_implementation="eager"`, or one that has no
SDPA path) the same pattern, softmax straight on the logits (a max subtracted or not), becomes an
SDPA call on the same q, k, v, mask and scale, which every later pass already reads; when its
logits are soft-capped, or its softmax runs in float32 on half-precision logits, it becomes
`uniprefill::sink_attention` with `sinks=None` instead (SDPA computes neither). Its mask stays additive (a row
with no visible key then gets the same finite weights as in the eager code); `classify` reads it
through `visible_of_additive`.

Older models write the same attention over heads merged into the batch axis (`bmm` / `baddbmm`,
views either side: `eager_attention_forms`), and some add a per-key bias to the logits: ALiBi,
Bloom's `baddbmm(alibi, q, k^T, beta, alpha)` and MPT's `logits + table[:, :, -N:]` (with
`masked_fill(logits, mask.to(bool), min)` for the mask). A value per key that every query adds is
`key_bias` of `uniprefill::sink_attention` (`bias_scale` its beta). After a drop the packed op reads
it at the kept keys' ORIGINAL positions, so each kept key keeps the bias the model gave it; the
nodes that build a bias inside a layer stay on all tokens (`_bias_nodes_on_all_tokens`). Decode
steps after a drop do not model a bias: these models compute attention themselves, and
`runtime.generation.decode_unsupported` runs their cache-filling calls unaccelerated (and a decode
step through the attention interface after such a prefill raises rather than drop the bias).

GPT-Neo and OpenAI-GPT mask their logits with a slice of a causal table they hold as a buffer
(`where(slice, logits, min)`, `logits * slice - 1e4 * (1 - slice)`), before adding their own mask:
`causal_table` reads that step, and the site's mask becomes `uniprefill::table_mask(slice, mask)`,
which `classify` reads as causal (or sliding: GPT-Neo's local layers) only while the table input is
that band, checked on every call. OpenAI-GPT's keys arrive permuted to `[B, H, d, N]` and its logits
divided by `sqrt(d)`: the site reads the keys' transpose (`k_transposed`) and the scale `1 / sqrt(d)`.

A bias computed from each key's own values (Doge's dynamic mask, an SDPA call's additive mask) is
matched by `kept_key_bias.match_value_bias_attention` into the same op with `bias_follows=True`:
the copy then reads it in the layer's own layout (the kept keys' bias, computed on them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import sink_ops  # noqa: F401  (registers uniprefill::sink_attention)
from .causal_table import table_masked
from .eager_attention_pieces import (
    Reciprocal, arg_of, before_repeat, boolean_form, casts_to, dropout_off, drops_last_column, is_call, is_last_dim,
    keys_permuted, scores_of, shapes_fit, sinks_of, without_max, visible_of_additive,
)
from .eager_attention_forms import bmm_output, is_head_view, through_head_views, without_clamp
from .fx_utils import ancestors, example_value, is_sink_attention, is_table_mask
from .graph_calls import keep_node
from .kept_key_bias import match_value_bias_attention

__all__ = ["SinkAttentionCopy", "SinkSite", "canonicalize_sink_attention", "match_lse_sink_attention",
           "match_sink_attention", "visible_of_additive"]


@dataclass(frozen=True)
class SinkSite:
    """One matched pattern: the values it reads and the nodes it replaces."""

    q: fx.Node
    k: fx.Node  # before repeat_kv
    v: fx.Node
    mask: object  # fx.Node (boolean or additive) or None
    scale: object  # float or a SymFloat node
    sinks: fx.Node | None  # [H]; None: plain eager attention
    output: fx.Node  # the final matmul
    internal: tuple  # nodes of the pattern, from the output back
    softcap: object = None  # float or SymFloat node: logits capped as softcap * tanh(logits / softcap) (Gemma-2)
    upcast: bool = False  # the softmax runs in float32 on half-precision logits
    logits: fx.Node | None = None  # the softmax's input before any sink column (scaled, capped, masked)
    key_bias: fx.Node | None = None  # a per-key bias added to the scaled logits (ALiBi), `sink_ops.key_bias_4d`
    bias_scale: object = 1.0  # float or a SymFloat node: the bias's factor (`baddbmm`'s beta)
    k_transposed: bool = False  # `k` is `[B, H, d, N]` (OpenAI-GPT permutes its keys so): the op reads its transpose
    table: fx.Node | None = None  # a causal mask sliced from a table the model holds (`causal_table`)
    bias_follows: bool = False  # the bias is computed from each key's own token (`kept_key_bias`), not its position


def canonicalize_sink_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, int, int]:
    """(a graph module in which every eager attention pattern is one node, how many with sinks,
    how many without); `gm` itself when there is none."""
    sites = [s for s in (match_sink_attention(n) or match_lse_sink_attention(n) or match_value_bias_attention(n)
                         for n in gm.graph.nodes) if s is not None]
    if not sites:
        return gm, 0, 0
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for site in sites:
        old = env[site.output]
        mapped = lambda a: env[a] if isinstance(a, fx.Node) else a  # noqa: E731
        with graph.inserting_before(old):
            k, mask = _keys_and_mask(graph, site, env)
        scale = mapped(site.scale)
        if isinstance(site.scale, Reciprocal):
            with graph.inserting_before(old):
                scale = graph.call_function(operator.truediv, (1.0, env[site.scale.divisor]))
            scale.meta["example_value"] = 1.0 / example_value(site.scale.divisor)
        kwargs = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": scale,
                  "enable_gqa": example_value(site.k).shape[1] != example_value(site.q).shape[1]}
        if site.sinks is not None or site.softcap is not None or site.upcast or site.key_bias is not None:
            # the op computes what the eager code computes; SDPA would take the softmax in its own precision
            op = torch.ops.uniprefill.sink_attention.default
            kwargs["sinks"] = env[site.sinks] if site.sinks is not None else None
            if site.softcap is not None:
                kwargs["softcap"] = mapped(site.softcap)
            if site.upcast:
                kwargs["upcast"] = True
            if site.key_bias is not None:
                kwargs["key_bias"], kwargs["bias_scale"] = env[site.key_bias], mapped(site.bias_scale)
                if site.bias_follows:
                    kwargs["bias_follows"] = True
        else:  # plain eager attention: an SDPA call computes the same
            op = torch.nn.functional.scaled_dot_product_attention
        with graph.inserting_before(old):
            node = graph.call_function(op, (env[site.q], k, env[site.v]), kwargs)
        node.meta = dict(old.meta)
        old.replace_all_uses_with(node)
        for dead in site.internal:  # output first: each has no users left once the ones after it are gone
            if not env[dead].users:
                graph.erase_node(env[dead])
    graph.eliminate_dead_code(is_impure_node=keep_node)  # the additive masks no site reads any more
    graph.lint()
    with_op = sum(site.sinks is not None or site.softcap is not None or site.upcast or site.key_bias is not None
                  for site in sites)
    return fx.GraphModule(gm, graph), with_op, len(sites) - with_op


def match_lse_sink_attention(node: fx.Node) -> SinkSite | None:
    """Sinks applied after the attention (Granite-SWA): `out * sigmoid(lse(logits) - sinks)`.

        out = matmul(softmax(logits), v)                          # the plain pattern
        scale = (logsumexp(logits, -1) - sinks.view(1, -1, 1)).to(float32).sigmoid()
        out = out * scale.unsqueeze(-1).to(out.dtype)

    `Z / (Z + exp(s))` with `Z = exp(lse)` is the factor by which the sink column shrinks every
    weight of the softmax over `[logits, s]`, so this is `uniprefill::sink_attention`; `node` is the
    final `mul`."""
    if not (is_call(node, "mul") and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args)):
        return None
    out, factor = node.args if is_call(node.args[0], "matmul") else node.args[::-1]
    chain = [node]
    ov, vv = example_value(node), example_value(out)
    if not (isinstance(ov, torch.Tensor) and isinstance(vv, torch.Tensor) and ov.dtype == vv.dtype):
        return None
    while is_call(factor, "to"):
        if not _casts_to_float(factor):
            return None
        chain.append(factor)
        factor = factor.args[0]
    if not (is_call(factor, "unsqueeze") and arg_of(factor, 1, "dim") in (-1, 3)):
        return None
    sigmoid = factor.args[0]
    chain += [factor, sigmoid]
    if not is_call(sigmoid, "sigmoid"):
        return None
    diff = sigmoid.args[0]
    while is_call(diff, "to"):
        if not _casts_to_float(diff):
            return None
        chain.append(diff)
        diff = diff.args[0]
    if not (is_call(diff, "sub") and len(diff.args) == 2 and not diff.kwargs):  # torch.sub(a, b, alpha=...)
        return None
    lse, shaped = diff.args
    if not (is_call(lse, "logsumexp") and is_last_dim(lse.args[0], arg_of(lse, 1, "dim")) and is_call(shaped, "view", "reshape")):
        return None
    sinks, sv, lv = shaped.args[0], example_value(shaped), example_value(lse)
    if not (isinstance(sv, torch.Tensor) and isinstance(lv, torch.Tensor) and sv.dim() == 3
            and list(sv.shape) == [1, lv.shape[1], 1] and isinstance(example_value(sinks), torch.Tensor)
            and example_value(sinks).dim() == 1):
        return None
    chain += [diff, lse, shaped]
    inner = match_sink_attention(out, readers=set(chain))
    if inner is None or inner.sinks is not None or lse.args[0] is not inner.logits:
        return None
    if any(u not in set(chain) | set(inner.internal) for n in chain[1:] for u in n.users):
        return None
    return SinkSite(inner.q, inner.k, inner.v, inner.mask, inner.scale, sinks, node, tuple(chain) + inner.internal,
                    inner.softcap, inner.upcast, inner.logits, inner.key_bias, inner.bias_scale)


def _casts_to_float(node: fx.Node) -> bool:
    """`x.to(dtype)` to a floating dtype, nothing else (no device, no kwargs)."""
    args = node.args[1:]
    return (len(args) == 1 and not node.kwargs and isinstance(args[0], torch.dtype)
            and args[0].is_floating_point)


def match_sink_attention(node: fx.Node, readers: frozenset | set = frozenset()) -> SinkSite | None:
    """The pattern whose final matmul is `node`, or None. `readers`: nodes outside the pattern
    allowed to read its intermediate values (`match_lse_sink_attention`'s)."""
    chain = []
    if is_call(node, "matmul") and len(node.args) == 2:
        weights, v_rep = node.args
        chain.append(node)
    else:  # bmm on heads merged into the batch axis, viewed back to [B, H, N, d]
        found = bmm_output(node, chain)
        if found is None:
            return None
        weights, v_rep = found
    # weights: [dropout] [.to(dtype)] [views merging heads] in any order, then the slice that drops the sink column
    while is_call(weights, "to", "dropout") or is_head_view(weights):
        if is_head_view(weights):
            weights = through_head_views(weights, chain)
            continue
        if is_call(weights, "dropout") and not dropout_off(weights):
            return None
        if is_call(weights, "to") and not casts_to(weights, example_value(v_rep)):
            return None
        chain.append(weights)
        weights = weights.args[0]
    with_sinks = is_call(weights, "getitem") and drops_last_column(weights)
    if with_sinks:
        chain.append(weights)
        weights = weights.args[0]
    probs = weights
    if not (is_call(probs, "softmax") and is_last_dim(probs, arg_of(probs, 1, "dim"))):
        return None
    chain.append(probs)
    combined = through_head_views(probs.args[0], chain)
    while is_call(combined, "float") and example_value(combined.args[0]).dtype == example_value(combined).dtype:
        chain.append(combined)  # a cast that changes nothing (MPT's .float() on float32 logits)
        combined = combined.args[0]
    dtype, scores_dtype = arg_of(probs, 2, "dtype"), example_value(combined).dtype
    # softmax in float32 on half-precision logits (transformers' eager functions): the op does the same
    upcast = dtype == torch.float32 and scores_dtype in (torch.float16, torch.bfloat16)
    if dtype is not None and dtype != scores_dtype and not upcast:
        return None
    sinks = None
    if with_sinks:
        combined = without_max(combined, chain)
        if not (is_call(combined, "cat") and is_last_dim(combined, arg_of(combined, 1, "dim", 0))):
            return None
        parts = combined.args[0]
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and all(isinstance(p, fx.Node) for p in parts)):
            return None
        chain.append(combined)
        logits, sink_column = parts
        sinks = sinks_of(sink_column, chain)
        if sinks is None:
            return None
    else:
        logits = without_clamp(without_max(combined, chain), chain)
    tabled = table_masked(logits, chain) if sinks is None else None  # a causal mask sliced from a table
    scores = scores_of(tabled.scores if tabled else logits, chain)
    if scores is None:
        return None
    q, k_rep, scale, mask, softcap, key_bias = scores
    if tabled is not None:
        if mask is not None:
            return None
        mask = tabled.mask
    k_transposed = keys_permuted(k_rep)
    (k, k_nodes), (v, v_nodes) = (k_rep, []) if k_transposed else before_repeat(k_rep), before_repeat(v_rep)
    if k is None or v is None:
        return None
    if example_value(k).shape[1] != example_value(v).shape[1]:  # one of them read after its repeat only
        (k, k_nodes), (v, v_nodes) = (k_rep, []), (v_rep, [])
    if not shapes_fit(q, k, v, sinks, node, k_transposed):
        return None
    chain += k_nodes + v_nodes
    inside = set(chain) | set(readers)
    # every intermediate value is read inside the pattern only (not the weights returned to a caller)
    if any(u not in inside for n in chain[1:] for u in n.users):
        return None
    if mask is not None and sinks is not None:
        # without sinks the additive form stays: a row with no visible key then gets finite
        # weights, as in the eager code (a boolean mask would give NaN there, and 0 * NaN leaks)
        mask = boolean_form(mask, logits, scores_dtype=example_value(logits).dtype)
    bias, beta = key_bias if key_bias is not None else (None, 1.0)
    return SinkSite(q, k, v, mask, scale, sinks, node, tuple(chain), softcap, upcast, logits, bias, beta,
                    k_transposed, tabled.table if tabled else None)


def _keys_and_mask(graph: fx.Graph, site: SinkSite, env: dict) -> tuple:
    """The site's keys `[B, H, N, d]` and mask in the copy: keys permuted to `[B, H, d, N]` transposed
    back, and a mask sliced from a table joined to the model's own as `uniprefill::table_mask`."""
    k = env[site.k]
    if site.k_transposed:
        k = graph.call_function(torch.ops.aten.transpose.int, (k, 2, 3))
        k.meta = {**site.k.meta, "example_value": example_value(site.k).transpose(2, 3)}
    mask = env[site.mask] if isinstance(site.mask, fx.Node) else site.mask
    if site.table is not None:
        dtype = example_value(site.logits if mask is None else site.mask).dtype
        fake = torch.ops.uniprefill.table_mask(example_value(site.table),
                                               None if mask is None else example_value(site.mask), dtype)
        mask = graph.call_function(torch.ops.uniprefill.table_mask.default, (env[site.table], mask, dtype))
        mask.meta = {**site.table.meta, "example_value": fake}
    return k, mask


# ------------------------------------------------------------------ the copy (token_drop.TokenDropPass)
class SinkAttentionCopy:
    """Copies a `uniprefill::sink_attention` node whose mask `classify` understood as
    `dense_sink_attention` (before the first drop point) or `packed_sink_attention` (after it),
    with the masks `attention_copy` shares between layers (`_dense_mask_for`, `_packed_mask_for`). Mixed into `token_drop.TokenDropPass`."""

    def _copy_sink_attention(self, node: fx.Node, layer: int, j: int, mask, qn, kn, vn, scale) -> None:
        ops = torch.ops.uniprefill
        sinks = node.kwargs.get("sinks")
        sinks = self._value_at(sinks, 0) if sinks is not None else None
        cap = node.kwargs.get("softcap")
        softcap = {} if cap is None else {"softcap": self.env[cap] if isinstance(cap, fx.Node) else cap}
        if node.kwargs.get("upcast"):
            softcap["upcast"] = True
        bias = node.kwargs.get("key_bias")
        follows = bool(node.kwargs.get("bias_follows"))
        if bias is not None and follows:  # the kept keys' own bias, in this layer's layout (`kept_key_bias`)
            softcap["key_bias"], softcap["bias_follows"] = self._value_at(bias, j), True
            self.counts["bias_of_kept_keys"] = self.counts.get("bias_of_kept_keys", 0) + 1
        if bias is not None:  # else over all N keys (layout 0); the packed op reads it at the kept keys' positions
            scale_of_bias = node.kwargs.get("bias_scale", 1.0)
            if not follows:
                softcap["key_bias"] = self._value_at(bias, 0)  # raises when the bias was built on kept tokens
            softcap["bias_scale"] = self.env[scale_of_bias] if isinstance(scale_of_bias, fx.Node) else scale_of_bias
        self._ensure_layout0()  # the recorder's begin_prefill comes first
        # decode steps after this prefill compute the same form (runtime.decode_attention)
        self.new.call_function(ops.record_attention.default, (
            layer, softcap.get("softcap", 0.0), bool(softcap.get("upcast", False)), sinks is not None,
            bias is not None))
        if j == 0:
            key_valid, shared = self._dense_mask_for(qn, mask)
            dense = {name: value for name, value in softcap.items() if name != "bias_follows"}  # all N keys either way
            out = self.new.call_function(ops.dense_sink_attention.default,
                                         (qn, kn, vn, key_valid, mask.window, scale, sinks, shared), dense)
            self.counts["dense_attention"] += 1
        else:
            lay = self.layouts[j]
            shared = self._packed_mask_for(qn, j, mask.window)
            out = self.new.call_function(ops.packed_sink_attention.default,
                                         (qn, kn, vn, lay.positions, lay.counts, mask.window, scale, sinks, shared),
                                         softcap)
            self.counts["packed_attention"] += 1
        out.meta = dict(node.meta)
        self.env[node] = out
        self.layout_of[node] = j

    def _bias_nodes_on_all_tokens(self) -> set:
        """Nodes that build a per-key attention bias (`key_bias`) inside a layer, copied on all tokens
        even after a drop (MPT slices its ALiBi table by the prompt length in each layer): the packed
        op reads the bias at the kept keys' original positions. Only a bias that does not read the
        prompt's content (its subgraph does not reach the token input) and whose nodes feed nothing
        else; any other stays with the layer's layout (and is refused if it ends on kept tokens).
        Likewise a `table_mask` and the slices it reads (`causal_table`): `[.., N, N]` masks that the
        rewritten attention rebuilds from positions, left on all tokens like the model's own mask."""
        graph_inputs = {n for n in self.gm.graph.nodes if n.op in ("placeholder", "get_attr")}
        keep, tables = set(), set()
        for node in self.gm.graph.nodes:
            bias = node.kwargs.get("key_bias") if is_sink_attention(node) else None
            if isinstance(bias, fx.Node) and self.plan.tokens not in ancestors(bias):
                keep |= (ancestors(bias) | {bias}) - graph_inputs
            # a mask joined to a table's slice (`causal_table`): `[.., N, N]`, read by the site's attention only
            # where its mask was not understood; on all tokens it computes what it computes in the plain model
            if is_table_mask(node) and self.plan.tokens not in ancestors(node):
                tables |= (ancestors(node) | {node}) - graph_inputs
        if any(u not in keep and not is_sink_attention(u) for n in keep for u in n.users):
            return tables  # a node of a bias feeds something else: all keep the layers' layouts
        return keep | tables
