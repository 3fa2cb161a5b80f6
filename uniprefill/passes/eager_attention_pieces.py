"""The pieces of the eager-attention patterns of `passes.sink_attention`: each reads one step of
the pattern backwards from a node, checks it against the traced values (`example_value`), appends
the nodes it consumed to `chain` and returns what the step was applied to (or None / the node
itself when the step is not there). Pure functions of the graph; nothing here changes it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .fx_utils import example_value

_NEGATIVE_FILL = -1e30  # an additive mask value at most this: "not visible"


class Reciprocal:
    """A site's scale `1 / divisor`, the divisor a SymFloat node: `sink_attention` computes it in the graph."""

    def __init__(self, divisor: fx.Node):
        self.divisor = divisor

    def __repr__(self) -> str:
        return f"1 / {self.divisor.name}"


# ------------------------------------------------------------------ pattern pieces
def without_max(combined, chain):
    """`combined - combined.max(dim=-1, keepdim=True).values` -> combined (the softmax ignores it)."""
    if not (is_call(combined, "sub") and len(combined.args) == 2):
        return combined
    base, top = combined.args
    if not (is_call(top, "getitem") and top.args[1] == 0 and is_call(top.args[0], "max", "amax")):
        return combined
    reduce = top.args[0]
    if reduce.args[0] is not base or not is_last_dim(base, arg_of(reduce, 1, "dim")) or not arg_of(reduce, 2, "keepdim"):
        return combined
    if set(base.users) != {combined, reduce}:
        return combined
    chain += [combined, top, reduce]
    return base


def sinks_of(column, chain):
    """`sinks.reshape(1, H, 1, 1).expand(B, H, Q, 1)` -> sinks `[H]`, else None."""
    if not is_call(column, "expand"):
        return None
    shaped = column.args[0]
    if not is_call(shaped, "reshape", "view"):
        return None
    sinks = shaped.args[0]
    s, r, e = (example_value(n) for n in (sinks, shaped, column))
    if not all(isinstance(t, torch.Tensor) for t in (s, r, e)) or s.dim() != 1 or e.dim() != 4:
        return None
    if list(r.shape) != [1, s.shape[0], 1, 1] or e.shape[1] != s.shape[0] or e.shape[3] != 1:
        return None
    chain += [column, shaped]
    return sinks


def scores_of(logits, chain):
    """`matmul(q, k.transpose(2, 3)) * scale [soft-capped] (+ mask)` -> (q, k, scale, mask, softcap,
    key_bias), else None (softcap None: not capped). The batched forms of `eager_attention_forms`
    (`bmm` / `baddbmm` on heads merged into the batch axis) are read as the same; `key_bias` is
    `(bias, beta)` of a `baddbmm` that adds a per-key bias (ALiBi), else None."""
    if is_call(logits, "masked_fill"):  # masked_fill(x, additive_mask.to(bool), most negative) (MPT)
        mask = _additive_of_hidden(logits)
        tried = [logits]
        found = _unmasked_scores(logits.args[0], tried) if mask is not None else None
        if found is None:
            return None
        chain += tried
        q, k, scale, _, softcap, key_bias = found
        return q, k, scale, mask, softcap, key_bias
    if is_call(logits, "add") and (len(logits.args) != 2 or logits.kwargs):  # torch.add(x, m, alpha=...)
        return None
    if not is_call(logits, "add"):
        return _unmasked_scores(logits, chain)
    for scaled, mask in (logits.args, logits.args[::-1]):
        m = example_value(mask)
        if not (isinstance(mask, fx.Node) and isinstance(m, torch.Tensor) and m.is_floating_point() and m.dim() == 4):
            continue
        tried = [logits]
        found = _unmasked_scores(scaled, tried)
        if found is not None:
            chain += tried
            q, k, scale, _, softcap, key_bias = found
            return q, k, scale, mask, softcap, key_bias
    return None


def _additive_of_hidden(node):
    """`masked_fill(x, where(visible, 0, min).to(bool), fill)` with fill the most negative float ->
    `where(visible, 0, min)` (the `to(bool)` of that mask is exactly the hidden keys), else None.
    Adding the mask instead of filling gives the same weights to every row with a visible key."""
    if not (len(node.args) == 3 and not node.kwargs):
        return None
    _, hidden, fill = node.args
    if not (isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= _NEGATIVE_FILL):
        return None
    if not (is_call(hidden, "to") and hidden.args[1:] == (torch.bool,) and not hidden.kwargs):
        return None
    additive = hidden.args[0]
    return additive if visible_of_additive(additive) is not None else None


def _unmasked_scores(scaled, chain):
    from .eager_attention_forms import per_key_bias

    key_bias = None
    if is_call(scaled, "add"):  # + a per-key bias (MPT's ALiBi), matched against the keys below
        if len(scaled.args) != 2 or scaled.kwargs:
            return None
        a, b = scaled.args
        base, bias = (a, b) if per_key_bias(b) else (b, a)
        if not per_key_bias(bias):
            return None
        chain.append(scaled)
        scaled, key_bias = base, (bias, 1.0)
    found = _scores_without_bias(scaled, chain)
    if found is None or key_bias is None:
        return found
    q, k, scale, _, softcap, inner_bias = found
    bv, qv, kv = example_value(key_bias[0]), example_value(q), example_value(k)
    if inner_bias is not None or not (per_key_bias(key_bias[0], kv.shape[-2]) and bv.dtype == qv.dtype):
        return None
    return q, k, scale, None, softcap, key_bias


def _scores_without_bias(scaled, chain):
    from .eager_attention_forms import batched_scores

    scaled, softcap = _without_softcap(scaled, chain)
    if is_call(scaled, "matmul"):  # no scale (GPT-Neo)
        product, scale, steps = scaled, 1.0, []
    elif is_call(scaled, "mul") and len(scaled.args) == 2:
        a, b = scaled.args
        product, scale = (a, b) if is_call(a, "matmul") else (b, a)
        if isinstance(example_value(scale), torch.Tensor) or isinstance(scale, (bool, str)):
            return None
        steps = [scaled]
    elif is_call(scaled, "truediv") and len(scaled.args) == 2 and not scaled.kwargs:  # w / sqrt(d) (OpenAI-GPT)
        product, divisor = scaled.args
        if isinstance(divisor, fx.Node) and isinstance(example_value(divisor), torch.SymFloat):
            scale = Reciprocal(divisor)  # a float attribute dynamo made a graph input (GPT-J's `scale_attn`, 5.17)
        elif isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor > 0:
            scale = 1.0 / divisor
        else:
            return None
        steps = [scaled]
    else:
        batched = batched_scores(scaled, chain)
        if batched is None:
            return None
        q, k, scale, key_bias = batched
        return q, k, scale, None, softcap, key_bias
    if not (is_call(product, "matmul") and len(product.args) == 2):
        return None
    q, kt = product.args
    if is_call(kt, "transpose") and {_dim(kt, d) for d in kt.args[1:3]} == {2, 3}:
        chain += steps + [product, kt]
        return q, kt.args[0], scale, None, softcap, None
    if keys_permuted(kt):  # read as they are; the site transposes them (`SinkSite.k_transposed`)
        chain += steps + [product]
        return q, kt, scale, None, softcap, None
    return None


def keys_permuted(node) -> bool:
    """`x.permute(0, 2, 3, 1)` of `[B, N, H, d]` keys: `[B, H, d, N]`, the keys already transposed (OpenAI-GPT)."""
    if not (is_call(node, "permute") and isinstance(node.args[0], fx.Node)):
        return False
    dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
    return tuple(dims) == (0, 2, 3, 1) and getattr(example_value(node), "dim", lambda: 0)() == 4


def _without_softcap(node, chain):
    """`tanh(x / c) * c` (Gemma-2's logit soft-capping) -> (x, c), else (node, None); c a positive
    number, or one SymFloat node (a float attribute dynamo made an input) read at both places."""
    if not (is_call(node, "mul") and len(node.args) == 2):
        return node, None
    tanh, cap = node.args if is_call(node.args[0], "tanh") else node.args[::-1]
    if not (is_call(tanh, "tanh") and len(tanh.args) == 1 and is_call(tanh.args[0], "truediv", "div")):
        return node, None
    divided = tanh.args[0]
    if len(divided.args) != 2 or divided.kwargs or not isinstance(divided.args[0], fx.Node):
        return node, None
    inner, cap_in = divided.args
    if isinstance(cap, fx.Node):
        value = example_value(cap)
        same = cap is cap_in and isinstance(value, torch.SymFloat)
    else:
        same = (isinstance(cap, (int, float)) and not isinstance(cap, bool) and isinstance(cap_in, (int, float))
                and cap == cap_in and cap > 0)
    if not same or len(tanh.users) != 1 or len(divided.users) != 1:
        return node, None
    chain += [node, tanh, divided]
    return inner, cap


def before_repeat(rep):
    """repeat_kv's `x[:, :, None].expand(B, Hk, n, N, d).reshape(B, Hk * n, N, d)` -> (x, its nodes);
    any other 4-D value is read as it is (keys or values with one head per query head)."""
    val = example_value(rep)
    if not (isinstance(val, torch.Tensor) and val.dim() == 4):
        return None, []
    grown = rep.args[0] if is_call(rep, "reshape", "view") else None
    if not (is_call(grown, "expand") and is_call(grown.args[0], "getitem")):
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


def shapes_fit(q, k, v, sinks, out, k_transposed: bool = False) -> bool:
    qv, kv, vv, ov = (example_value(n) for n in (q, k, v, out))
    if k_transposed and isinstance(kv, torch.Tensor) and kv.dim() == 4:
        kv = kv.transpose(2, 3)
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
    if not (is_call(mask, "where") and len(mask.args) == 3):
        return None
    visible, zero, fill = mask.args
    vv = example_value(visible)
    if not (isinstance(vv, torch.Tensor) and vv.dtype == torch.bool and vv.dim() == 4):
        return None
    if not _is_zero(zero) or not isinstance(fill, (int, float)) or isinstance(fill, bool) or not fill <= _NEGATIVE_FILL:
        return None
    return visible


def _is_zero(zero) -> bool:
    """The number 0, or a 0-dim zero tensor built in the graph: `torch.zeros(())` (the eager masks of transformers
    5.25), `torch.tensor(0.0)` (5.17's: without it no eager-attention model accelerated on 5.17) or
    `torch.full((), 0.0)` (Doge's dynamic mask, `kept_key_bias`)."""
    if isinstance(zero, (int, float)):
        return zero == 0 and not isinstance(zero, bool)
    value = example_value(zero)
    if not (isinstance(value, torch.Tensor) and value.dim() == 0):
        return False
    if is_call(zero, "zeros"):
        return True
    call = zero.op == "call_function"
    if call and zero.target is torch.tensor and len(zero.args) == 1:
        number = zero.args[0]
    elif call and zero.target is torch.full and len(zero.args) == 2 and zero.args[0] in ((), []):
        number = zero.args[1]
    else:
        return False
    return isinstance(number, (int, float)) and not isinstance(number, bool) and number == 0


def boolean_form(mask, logits, scores_dtype):
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


def is_call(node, *names: str) -> bool:
    return _name(node) in names


def arg_of(node: fx.Node, index: int, name: str, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _dim(node: fx.Node, dim) -> int | None:
    val = example_value(node.args[0])
    if not isinstance(dim, int) or not isinstance(val, torch.Tensor):
        return None
    return dim % val.dim()


def is_last_dim(node: fx.Node, dim) -> bool:
    val = example_value(node)
    if isinstance(val, (tuple, list)):
        val = val[0]
    return isinstance(dim, int) and isinstance(val, torch.Tensor) and dim % val.dim() == val.dim() - 1


def drops_last_column(node: fx.Node) -> bool:
    index = node.args[1]
    full = slice(None, None, None)
    last = slice(None, -1, None)
    return index in ((Ellipsis, last), (full, full, full, last))


def dropout_off(node: fx.Node) -> bool:
    p = arg_of(node, 1, "p", 0.5)
    training = arg_of(node, 2, "training", True)
    if training is False:  # off whatever p is (a float attribute dynamo made an input: a SymFloat node)
        return True
    return isinstance(p, (int, float)) and isinstance(training, bool) and p == 0


def casts_to(node: fx.Node, value) -> bool:
    """`x.to(dtype)` with value's dtype (a cast to anything else, or to a device, is not matched)."""
    args = node.args[1:]
    return (len(args) == 1 and not node.kwargs and isinstance(args[0], torch.dtype)
            and isinstance(value, torch.Tensor) and args[0] == value.dtype)
