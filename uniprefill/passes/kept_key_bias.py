"""A per-key attention bias computed from each key's own values (Doge's dynamic mask), as one node.

Doge adds to the logits of every query a value per (key head, key) computed from that key's
value states through learned weights, and hides the keys its causal / padding mask hides:

    dt = exp(A * softplus(dt_proj(v.transpose(1, 2).reshape(B, N, -1)))).transpose(-1, -2)  # [B, Hk, N]
    additive = where(visible, 0, min)[..., :N]
    mask = dt[:, :, None, :].expand(-1, -1, N, -1).masked_fill(additive != 0, min)
    out = sdpa(q, repeat_kv(k), repeat_kv(v), attn_mask=repeat_kv(mask), scale=...)

`match_value_bias_attention` reads this SDPA call as `uniprefill::sink_attention(q, k, v,
attn_mask=visible, key_bias=dt[:, :, None, :], bias_follows=True)`: the visible keys get the
same logit `q.k * scale + dt` (adding a bias of 0 changes nothing), the hidden ones the most
negative value, as the masked_fill gives them. `classify` then reads the boolean `visible` as it
reads every causal + padding mask.

Unlike ALiBi (`passes.sink_attention`: a table of the keys' ORIGINAL positions), this bias is a
function of the key's own token: the matcher walks from `dt` back to the attention's values
through operations that act on each token alone (`_per_token`: a linear map or an elementwise
function of the features, weights, axis permutations, reshapes that keep the token axis and
everything before it). After a drop the layer computes it on the kept rows, so each kept key
has the bias the model gives that key: `bias_follows` tells `SinkAttentionCopy` to read the
bias in the layer's own layout and `packed_sink_attention` to slice it per row, not at
original positions. Anything else (a bias per query and key, one that mixes tokens, a top-k
over keys: Doge above its `keep_window_size`) leaves the call alone; `mask_words` names it.

Decode steps after such a drop are not modelled (`uniprefill.runtime.decode_attention` knows no
bias); the copy counts the node under `bias_of_kept_keys`, and the backend runs a call that
fills a cache unaccelerated (`NO_DECODE_REASON`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .eager_attention_pieces import (
    _NEGATIVE_FILL,
    _name,
    before_repeat,
    is_call,
    visible_of_additive,
)
from .fx_utils import SDPA_TARGETS, example_value
from .mask_words import is_weight

__all__ = ["NO_DECODE_REASON", "match_value_bias_attention"]

NO_DECODE_REASON = ("an attention layer adds a per-key bias computed from each key's value states (a dynamic mask), "
                    "which decode steps after a drop do not model: a call that fills a cache runs unaccelerated "
                    "(use_cache=False prefills are accelerated)")

# operations that act on each token alone, the features along the last axis (or elementwise)
_ELEMENTWISE = ("exp", "softplus", "sigmoid", "tanh", "silu", "relu", "neg", "mul", "add", "sub", "div", "float", "to")
_FULL = slice(None, None, None)


def match_value_bias_attention(node: fx.Node):
    """The `SinkSite` of an SDPA call whose additive mask is a value-derived per-key bias plus a
    causal / padding mask, or None."""
    from .sink_attention import SinkSite  # the site type of the other eager forms

    if not (node.op == "call_function" and node.target in SDPA_TARGETS and len(node.args) == 3):
        return None
    kw = node.kwargs
    if kw.get("dropout_p", 0.0) != 0.0 or kw.get("is_causal", False) or kw.get("enable_gqa", False) \
            or not isinstance(kw.get("attn_mask"), fx.Node):
        return None
    q, k_rep, v_rep = node.args
    (k, k_nodes), (v, v_nodes) = before_repeat(k_rep), before_repeat(v_rep)
    (mask, m_nodes) = before_repeat(kw.get("attn_mask"))
    qv, kv, vv, mv = (example_value(n) if isinstance(n, fx.Node) else None for n in (q, k, v, mask))
    if not all(isinstance(t, torch.Tensor) for t in (qv, kv, vv, mv)) or qv.dim() != 4 or kv.shape[1] != vv.shape[1]:
        return None
    if not (qv.dtype == kv.dtype == vv.dtype == mv.dtype and qv.shape[1] % kv.shape[1] == 0 and mv.shape[1] == kv.shape[1]):
        return None
    found = _bias_and_visible(mask, qv, kv)
    if found is None:
        return None
    bias, visible, nodes = found
    if not _per_token(bias, v, vv.shape[2]):
        return None
    scale = kw.get("scale")
    scale = qv.shape[-1] ** -0.5 if scale is None else scale
    internal = (node, *k_nodes, *v_nodes, *m_nodes, *nodes)
    return SinkSite(q, k, v, visible, scale, None, node, internal, key_bias=bias, bias_follows=True)


def _bias_and_visible(mask: fx.Node, qv, kv):
    """`bias[:, :, None, :].expand(-1, -1, Q, -1).masked_fill(where(visible, 0, min)[..., :K] != 0, min)`
    -> (the `[B, Hk, 1, K]` bias node, `visible`, the pattern's nodes), else None."""
    if not (is_call(mask, "masked_fill") and len(mask.args) == 3 and not mask.kwargs):
        return None
    grown, hidden, fill = mask.args
    if not (isinstance(fill, float) and fill <= _NEGATIVE_FILL and is_call(grown, "expand")):
        return None
    bias = grown.args[0]
    if not (is_call(bias, "getitem") and bias.args[1] == (_FULL, _FULL, None, _FULL)):
        return None
    bv, gv = example_value(bias), example_value(grown)
    if not (isinstance(bv, torch.Tensor) and isinstance(gv, torch.Tensor) and bv.dim() == 4 and bv.shape[2] == 1):
        return None
    b, hk, n_q, n_k = qv.shape[0], kv.shape[1], qv.shape[2], kv.shape[2]
    if list(bv.shape) != [b, hk, 1, n_k] or list(gv.shape) != [b, hk, n_q, n_k]:  # one value per (row, head, key)
        return None
    if not (is_call(hidden, "ne") and len(hidden.args) == 2 and hidden.args[1] == 0):
        return None
    additive = hidden.args[0]
    if is_call(additive, "getitem"):  # `[..., :K]`: must keep the whole mask
        whole = additive.args[0]
        if not (isinstance(example_value(whole), torch.Tensor)
                and list(example_value(whole).shape) == list(example_value(additive).shape)):
            return None
        nodes, additive = [hidden, additive], whole
    else:
        nodes = [hidden]
    visible = visible_of_additive(additive)
    vis = example_value(visible) if visible is not None else None
    if not (isinstance(vis, torch.Tensor) and vis.shape[-2:] == (n_q, n_k)):
        return None
    return bias, visible, [mask, grown, *nodes, additive]


def _per_token(bias: fx.Node, values: fx.Node, tokens) -> bool:
    """Whether `bias` is computed from `values` (`[B, Hk, N, d]`) token by token, through weights."""
    seen, todo = set(), [bias.args[0]]
    reached = False
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is values:
            reached = True
            continue
        if not isinstance(example_value(node), torch.Tensor):
            if node.op == "placeholder" or _name(node) in ("size", "sym_size", "sym_size_int"):
                continue  # a size (the prompt's length in a reshape): no values of any token
            return False  # a number read from data (`.item()`): it may mix tokens
        if node.op in ("placeholder", "get_attr"):
            if node.op == "placeholder" and not is_weight(node):
                return False  # another input of the graph: not the key's own values
            continue
        if not _token_wise(node, tokens):
            return False
        todo.extend(node.all_input_nodes)
    return reached


def _token_wise(node: fx.Node, tokens) -> bool:
    """One step that computes each token's output from that token's input alone."""
    out = example_value(node)
    if not isinstance(out, torch.Tensor):
        return False
    name = _name(node)
    ins = [example_value(a) for a in node.all_input_nodes]
    if name in ("transpose", "permute"):
        return True
    if name in ("reshape", "view"):  # the token axis and every axis before it kept
        src = ins[0]
        axis = _token_axis(src, tokens)
        return axis is not None and src.dim() > axis and out.dim() > axis and \
            list(src.shape[:axis + 1]) == list(out.shape[:axis + 1])
    if name == "linear":  # features along the last axis; the token axis is another one
        axis = _token_axis(ins[0], tokens)
        return axis is not None and axis != ins[0].dim() - 1
    if name in _ELEMENTWISE:  # each input's token axis (if any) broadcasts onto the output's
        axis = _token_axis(out, tokens)
        return axis is not None and all(
            isinstance(t, torch.Tensor) and t.dim() <= out.dim() and (
                _token_axis(t, tokens) == axis - (out.dim() - t.dim()) if any(s == tokens for s in t.shape)
                else True) for t in ins)
    return False


def _token_axis(val, tokens) -> int | None:
    """The one axis of size `tokens` of `val`, else None."""
    if not isinstance(val, torch.Tensor):
        return None
    axes = [i for i, s in enumerate(val.shape) if s == tokens]
    return axes[0] if len(axes) == 1 else None
