"""Eager attention (with or without learned sinks), recognised in a dynamo graph as one attention site.

GPT-OSS (and other models transformers runs with eager attention only, `_supports_sdpa=False`,
because SDPA cannot apply their sinks) computes attention as plain tensor ops:

    k, v = repeat_kv(k), repeat_kv(v)                     # GQA: getitem(None) -> expand -> reshape
    logits = matmul(q, k.transpose(2, 3)) * scale (+ mask)
    combined = cat([logits, sinks.reshape(1, -1, 1, 1).expand(B, -1, Q, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values   # optional
    probs = softmax(combined, dim=-1)[..., :-1]           # the sink column dropped
    out = matmul(dropout(probs, p=0 or training=False).to(v.dtype), v)

`canonicalize_sink_attention` finds every such pattern and replaces it, in a copy of the graph,
by ONE node `uniprefill::sink_attention(q, k, v, attn_mask=..., scale=..., enable_gqa=...,
sinks=...)` with SDPA's argument names, on the keys and values before `repeat_kv`. The passes
then read it exactly as an SDPA call (`fx_utils.is_sdpa`): `classify.analyse_mask` reads its mask
(full or sliding, padding), a drop point scores with its q and k, and `attention_copy` replaces it
by `dense_sink_attention` / `packed_sink_attention`. An additive mask `where(visible, 0, min)`
becomes the boolean `visible` it came from (the form of transformers' SDPA masks), when that
leaves every dtype unchanged: adding the most negative float or masking with -inf gives the
same weights here, a sink keeping even a row without visible keys finite.

Every step is checked against the traced values (`example_value`: shapes, dtypes) before a
rewrite; an intermediate value read outside the pattern (attention weights returned to the
caller), a dropout that is on, a softmax in another dtype, or any other form leaves the
pattern alone, and the layer is then classified as having no attention site it understands.
The original graph is never changed (the backend falls back to it).

Without the sink column (a model loaded with `attn_implementation="eager"`, or one that has no
SDPA path) the same pattern, softmax straight on the logits, becomes an SDPA call on the same
q, k, v, mask and scale, which every later pass already reads. Its mask stays additive (a row
with no visible key then gets the same finite weights as in the eager code); `classify` reads it
through `visible_of_additive`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import sink_ops  # noqa: F401  (registers uniprefill::sink_attention)
from .fx_utils import example_value
from .graph_calls import keep_node

_NEGATIVE_FILL = -1e30  # an additive mask value at most this: "not visible"


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


def canonicalize_sink_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, int, int]:
    """(a graph module in which every eager attention pattern is one node, how many with sinks,
    how many without); `gm` itself when there is none."""
    sites = [s for s in (match_sink_attention(n) for n in gm.graph.nodes) if s is not None]
    if not sites:
        return gm, 0, 0
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for site in sites:
        old = env[site.output]
        mapped = lambda a: env[a] if isinstance(a, fx.Node) else a  # noqa: E731
        kwargs = {"attn_mask": mapped(site.mask), "dropout_p": 0.0, "is_causal": False, "scale": mapped(site.scale),
                  "enable_gqa": example_value(site.k).shape[1] != example_value(site.q).shape[1]}
        if site.sinks is not None:
            op, kwargs["sinks"] = torch.ops.uniprefill.sink_attention.default, env[site.sinks]
        else:  # plain eager attention: an SDPA call computes the same
            op = torch.nn.functional.scaled_dot_product_attention
        with graph.inserting_before(old):
            node = graph.call_function(op, (env[site.q], env[site.k], env[site.v]), kwargs)
        node.meta = dict(old.meta)
        old.replace_all_uses_with(node)
        for dead in site.internal:  # output first: each has no users left once the ones after it are gone
            if not env[dead].users:
                graph.erase_node(env[dead])
    graph.eliminate_dead_code(is_impure_node=keep_node)  # the additive masks no site reads any more
    graph.lint()
    with_sinks = sum(site.sinks is not None for site in sites)
    return fx.GraphModule(gm, graph), with_sinks, len(sites) - with_sinks


def match_sink_attention(node: fx.Node) -> SinkSite | None:
    """The pattern whose final matmul is `node`, or None."""
    if not _is(node, "matmul") or len(node.args) != 2:
        return None
    weights, v_rep = node.args
    chain = [node]
    # weights: [dropout] [.to(dtype)] in either order, then the slice that drops the sink column
    while _is(weights, "to", "dropout"):
        if _is(weights, "dropout") and not _dropout_off(weights):
            return None
        if _is(weights, "to") and not _casts_to(weights, example_value(v_rep)):
            return None
        chain.append(weights)
        weights = weights.args[0]
    with_sinks = _is(weights, "getitem") and _drops_last_column(weights)
    if with_sinks:
        chain.append(weights)
        weights = weights.args[0]
    probs = weights
    if not (_is(probs, "softmax") and _last_dim(probs, _arg(probs, 1, "dim"))):
        return None
    chain.append(probs)
    combined = probs.args[0]
    dtype = _arg(probs, 2, "dtype")
    if dtype is not None and dtype != example_value(combined).dtype:
        return None
    sinks = None
    if with_sinks:
        combined = _without_max(combined, chain)
        if not (_is(combined, "cat") and _last_dim(combined, _arg(combined, 1, "dim", 0))):
            return None
        parts = combined.args[0]
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and all(isinstance(p, fx.Node) for p in parts)):
            return None
        chain.append(combined)
        logits, sink_column = parts
        sinks = _sinks_of(sink_column, chain)
        if sinks is None:
            return None
    else:
        logits = combined
    scores = _scores_of(logits, chain)
    if scores is None:
        return None
    q, k_rep, scale, mask = scores
    (k, k_nodes), (v, v_nodes) = _before_repeat(k_rep), _before_repeat(v_rep)
    if k is None or v is None:
        return None
    if example_value(k).shape[1] != example_value(v).shape[1]:  # one of them read after its repeat only
        (k, k_nodes), (v, v_nodes) = (k_rep, []), (v_rep, [])
    if not _shapes_fit(q, k, v, sinks, node):
        return None
    chain += k_nodes + v_nodes
    inside = set(chain)
    # every intermediate value is read inside the pattern only (not the weights returned to a caller)
    if any(u not in inside for n in chain[1:] for u in n.users):
        return None
    if mask is not None and sinks is not None:
        # without sinks the additive form stays: a row with no visible key then gets finite
        # weights, as in the eager code (a boolean mask would give NaN there, and 0 * NaN leaks)
        mask = _boolean_form(mask, logits, scores_dtype=example_value(logits).dtype)
    return SinkSite(q, k, v, mask, scale, sinks, node, tuple(chain))


# ------------------------------------------------------------------ pattern pieces
def _without_max(combined, chain):
    """`combined - combined.max(dim=-1, keepdim=True).values` -> combined (the softmax ignores it)."""
    if not (_is(combined, "sub") and len(combined.args) == 2):
        return combined
    base, top = combined.args
    if not (_is(top, "getitem") and top.args[1] == 0 and _is(top.args[0], "max", "amax")):
        return combined
    reduce = top.args[0]
    if reduce.args[0] is not base or not _last_dim(base, _arg(reduce, 1, "dim")) or not _arg(reduce, 2, "keepdim"):
        return combined
    if set(base.users) != {combined, reduce}:
        return combined
    chain += [combined, top, reduce]
    return base


def _sinks_of(column, chain):
    """`sinks.reshape(1, H, 1, 1).expand(B, H, Q, 1)` -> sinks `[H]`, else None."""
    if not _is(column, "expand"):
        return None
    shaped = column.args[0]
    if not _is(shaped, "reshape", "view"):
        return None
    sinks = shaped.args[0]
    s, r, e = (example_value(n) for n in (sinks, shaped, column))
    if not all(isinstance(t, torch.Tensor) for t in (s, r, e)) or s.dim() != 1 or e.dim() != 4:
        return None
    if list(r.shape) != [1, s.shape[0], 1, 1] or e.shape[1] != s.shape[0] or e.shape[3] != 1:
        return None
    chain += [column, shaped]
    return sinks


def _scores_of(logits, chain):
    """`matmul(q, k.transpose(2, 3)) * scale (+ mask)` -> (q, k, scale, mask), else None."""
    mask = None
    if _is(logits, "add") and len(logits.args) == 2:
        scaled, mask = logits.args if _is(logits.args[0], "mul") else logits.args[::-1]
        if not (_is(scaled, "mul") and isinstance(mask, fx.Node)):
            return None
        m = example_value(mask)
        if not (isinstance(m, torch.Tensor) and m.is_floating_point() and m.dim() == 4):
            return None
        chain.append(logits)
    else:
        scaled = logits
    if not (_is(scaled, "mul") and len(scaled.args) == 2):
        return None
    a, b = scaled.args
    product, scale = (a, b) if _is(a, "matmul") else (b, a)
    if not _is(product, "matmul") or isinstance(example_value(scale), torch.Tensor) or isinstance(scale, (bool, str)):
        return None
    q, kt = product.args
    if not (_is(kt, "transpose") and {_dim(kt, d) for d in kt.args[1:3]} == {2, 3}):
        return None
    chain += [scaled, product, kt]
    return q, kt.args[0], scale, mask


def _before_repeat(rep):
    """repeat_kv's `x[:, :, None].expand(B, Hk, n, N, d).reshape(B, Hk * n, N, d)` -> (x, its nodes);
    any other 4-D value is read as it is (keys or values with one head per query head)."""
    val = example_value(rep)
    if not (isinstance(val, torch.Tensor) and val.dim() == 4):
        return None, []
    grown = rep.args[0] if _is(rep, "reshape", "view") else None
    if not (_is(grown, "expand") and _is(grown.args[0], "getitem")):
        return rep, []
    lifted = grown.args[0]
    full = slice(None, None, None)
    if lifted.args[1] != (full, full, None, full, full):
        return rep, []
    x = lifted.args[0]
    xv, gv = example_value(x), example_value(grown)
    if not (isinstance(xv, torch.Tensor) and isinstance(gv, torch.Tensor) and xv.dim() == 4 and gv.dim() == 5):
        return rep, []
    xs, gs = list(xv.shape), list(gv.shape)
    if gs[:2] != xs[:2] or gs[3:] != xs[2:] or list(val.shape) != [xs[0], xs[1] * gs[2], xs[2], xs[3]]:
        return rep, []
    single = len(rep.users) == 1 and len(grown.users) == 1 and len(lifted.users) == 1
    return x, ([rep, grown, lifted] if single else [])


def _shapes_fit(q, k, v, sinks, out) -> bool:
    qv, kv, vv, ov = (example_value(n) for n in (q, k, v, out))
    sv = example_value(sinks) if sinks is not None else None
    if not all(isinstance(t, torch.Tensor) for t in (qv, kv, vv, ov)):
        return False
    if sinks is not None and not (isinstance(sv, torch.Tensor) and list(sv.shape) == [qv.shape[1]]):
        return False
    if qv.dim() != 4 or kv.dim() != 4 or vv.dim() != 4:
        return False
    heads, kv_heads = qv.shape[1], kv.shape[1]
    return (qv.shape[0] == kv.shape[0] == vv.shape[0] and vv.shape[1] == kv_heads and heads % kv_heads == 0
            and kv.shape[2] == vv.shape[2] and qv.shape[3] == kv.shape[3] and ov.dtype == vv.dtype
            and qv.dtype == kv.dtype == vv.dtype and list(ov.shape) == [qv.shape[0], heads, qv.shape[2], vv.shape[3]])


def visible_of_additive(mask):
    """`where(visible, 0, most negative)` -> `visible` (a 4-D boolean node), else None.

    `classify.analyse_mask` reads an additive mask of this form through its boolean `visible`
    (the form of transformers' SDPA masks); eager attention computes with the additive one."""
    if not (_is(mask, "where") and len(mask.args) == 3):
        return None
    visible, zero, fill = mask.args
    vv = example_value(visible)
    if not (isinstance(vv, torch.Tensor) and vv.dtype == torch.bool and vv.dim() == 4):
        return None
    zero_ok = zero == 0 if isinstance(zero, (int, float)) and not isinstance(zero, bool) else (
        _is(zero, "zeros") and isinstance(example_value(zero), torch.Tensor) and example_value(zero).dim() == 0)
    if not zero_ok or not isinstance(fill, (int, float)) or isinstance(fill, bool) or not fill <= _NEGATIVE_FILL:
        return None
    return visible


def _boolean_form(mask, logits, scores_dtype):
    """`where(visible, 0, most negative)` -> `visible`, when adding it changed no dtype."""
    visible = visible_of_additive(mask)
    if visible is None or any(example_value(a).dtype != scores_dtype for a in logits.args):  # the add promoted nothing
        return mask
    return visible


# ------------------------------------------------------------------ small predicates
def _name(node) -> str:
    if not isinstance(node, fx.Node):
        return ""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        target = node.target
        if target is operator.matmul:
            return "matmul"
        return getattr(target, "__name__", "")
    return ""


def _is(node, *names: str) -> bool:
    return _name(node) in names


def _arg(node: fx.Node, index: int, name: str, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _dim(node: fx.Node, dim) -> int | None:
    val = example_value(node.args[0])
    if not isinstance(dim, int) or not isinstance(val, torch.Tensor):
        return None
    return dim % val.dim()


def _last_dim(node: fx.Node, dim) -> bool:
    val = example_value(node)
    if isinstance(val, (tuple, list)):
        val = val[0]
    return isinstance(dim, int) and isinstance(val, torch.Tensor) and dim % val.dim() == val.dim() - 1


def _drops_last_column(node: fx.Node) -> bool:
    index = node.args[1]
    full = slice(None, None, None)
    last = slice(None, -1, None)
    return index in ((Ellipsis, last), (full, full, full, last))


def _dropout_off(node: fx.Node) -> bool:
    p = _arg(node, 1, "p", 0.5)
    training = _arg(node, 2, "training", True)
    return isinstance(p, (int, float)) and isinstance(training, bool) and (p == 0 or not training)


def _casts_to(node: fx.Node, value) -> bool:
    """`x.to(dtype)` with value's dtype (a cast to anything else, or to a device, is not matched)."""
    args = node.args[1:]
    return (len(args) == 1 and not node.kwargs and isinstance(args[0], torch.dtype)
            and isinstance(value, torch.Tensor) and args[0] == value.dtype)


# ------------------------------------------------------------------ the copy (token_drop.TokenDropPass)
class SinkAttentionCopy:
    """Copies a `uniprefill::sink_attention` node whose mask `classify` understood as
    `dense_sink_attention` (before the first drop point) or `packed_sink_attention` (after it),
    with the masks `attention_copy` shares between layers (`_dense_mask_for`, `_packed_mask_for`). Mixed into `token_drop.TokenDropPass`."""

    def _copy_sink_attention(self, node: fx.Node, j: int, mask, qn, kn, vn, scale) -> None:
        ops = torch.ops.uniprefill
        sinks = self._value_at(node.kwargs["sinks"], 0)
        if j == 0:
            key_valid, shared = self._dense_mask_for(qn, mask)
            out = self.new.call_function(ops.dense_sink_attention.default,
                                         (qn, kn, vn, key_valid, mask.window, scale, sinks, shared))
            self.counts["dense_attention"] += 1
        else:
            lay = self.layouts[j]
            shared = self._packed_mask_for(qn, j, mask.window)
            out = self.new.call_function(ops.packed_sink_attention.default,
                                         (qn, kn, vn, lay.positions, lay.counts, mask.window, scale, sinks, shared))
            self.counts["packed_attention"] += 1
        out.meta = dict(node.meta)
        self.env[node] = out
        self.layout_of[node] = j
