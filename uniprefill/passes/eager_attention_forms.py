"""The batched-matmul forms of eager attention, read back to the 4-D form of `passes.sink_attention`.

Older models (XGLM, TrOCR, GPT-NeoX-Japanese, Bloom) write attention over `[B * H, N, d]`
tensors, merging the batch and head axes around `bmm` / `baddbmm`:

    q3 = q.view(B * H, N, d);  k3 = k.reshape(B * H, N, d)              # q, k, v: [B, H, N, d]
    logits = bmm(q3, k3.transpose(1, 2))                                # or baddbmm(bias, q3, k3^T, beta, alpha)
    logits = logits.view(B, H, N, N) + mask                             # the 4-D additive mask
    logits = max(logits, finfo.min)                                     # optional clamp (XGLM)
    probs = softmax(logits.view(B * H, N, N), -1)                       # views either side, any number
    out = bmm(probs, v3).view(B, H, N, d)

Every view merely merges or splits the batch and head axes (checked on the traced shapes,
symbolically), which no softmax over the last axis sees, so the site is the 4-D pattern on `q`, `k`,
`v`. `baddbmm(bias, q3, kT3, beta=b, alpha=a)` is `a * q3 @ kT3 + b * bias`; it is read as the
scale `a` when `bias` is a `zeros` tensor (GPT-NeoX-Japanese), and as a per-key bias (ALiBi) when
`bias` has one row for every query (`[B * H, 1, N]`, Bloom's ALiBi): a per-key bias, which
`sink_ops` applies at the kept keys' original positions after a drop.

The helpers follow the conventions of `eager_attention_pieces`: each reads one step backwards from
a node, checks it against the traced values, appends the nodes it consumed to `chain` and returns
what the step was applied to.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from .eager_attention_pieces import arg_of, is_call
from .fx_utils import example_value

_CLAMP_FILL = -1e30  # a clamp from below at most this changes no weight of a softmax with a visible key


def _expr(size):
    return sympy.sympify(size.node.expr) if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _same(a, b) -> bool:
    return sympy.expand(_expr(a) - _expr(b)) == 0


def _hint(size):
    if isinstance(size, torch.SymInt):
        return size.node.hint if size.node.has_hint() else None
    return int(size)


def merges_heads(four, three) -> bool:
    """`four` `[B, H, X, Y]` and `three` `[B * H, X, Y]` (traced values). The head count H must be a
    number (the batch is the axis that may be symbolic), so the batch stays the first axis."""
    if not (isinstance(four, torch.Tensor) and isinstance(three, torch.Tensor) and four.dim() == 4 and three.dim() == 3):
        return False
    if isinstance(four.shape[1], torch.SymInt):
        return False
    return (_same(four.shape[0] * four.shape[1], three.shape[0]) and _same(four.shape[2], three.shape[1])
            and _same(four.shape[3], three.shape[2]))


def is_head_view(node) -> bool:
    """A view / reshape between `[B, H, X, Y]` and `[B * H, X, Y]`, either way."""
    if not (is_call(node, "view", "reshape") and isinstance(node.args[0], fx.Node)):
        return False
    a, b = example_value(node.args[0]), example_value(node)
    return merges_heads(a, b) or merges_heads(b, a)


def through_head_views(node, chain):
    """Skips views that merge or split the batch and head axes (appending them to `chain`)."""
    while is_head_view(node):
        chain.append(node)
        node = node.args[0]
    return node


def lifted(x3):
    """`x.view(B * H, N, d)` (or reshape) -> x `[B, H, N, d]`, else None."""
    if is_call(x3, "view", "reshape") and isinstance(x3.args[0], fx.Node) \
            and merges_heads(example_value(x3.args[0]), example_value(x3)):
        return x3.args[0]
    return None


def bmm_output(node, chain):
    """`bmm(weights3, v3).view(B, H, N, d)` -> (weights3, v `[B, H, N, d]`), else None."""
    if not is_head_view(node) or example_value(node).dim() != 4:
        return None
    out3 = node.args[0]
    if not (is_call(out3, "bmm") and len(out3.args) == 2 and not out3.kwargs) or len(out3.users) != 1:
        return None
    weights3, v3 = out3.args
    v = lifted(v3)
    if v is None:
        return None
    chain += [node, out3]
    return weights3, v


def without_clamp(node, chain):
    """`max(x, full((), most negative))` -> x (XGLM's clamp of the masked logits): a logit plus the
    most negative float only overflows for logits near 1e31, so the clamp changes no weight."""
    if not (is_call(node, "max", "maximum") and len(node.args) == 2 and not node.kwargs):
        return node
    x, floor = node.args
    fv = example_value(floor)
    if not (is_call(floor, "full") and isinstance(fv, torch.Tensor) and fv.dim() == 0 and len(floor.users) == 1):
        return node
    fill = arg_of(floor, 1, "fill_value")
    if not (isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= _CLAMP_FILL):
        return node
    xv = example_value(x)
    if not (isinstance(xv, torch.Tensor) and fv.dtype == xv.dtype):
        return node
    chain += [node, floor]
    return x


def _per_key(bias, qv, kv, beta) -> bool:
    """`bias` `[B * H, 1, K]` (`kv` the keys `[B * H, K, d]`): one value per key for every query of a row and head (ALiBi), `beta` a
    number or a SymFloat node (a float attribute dynamo made an input)."""
    bv = example_value(bias)
    if isinstance(beta, fx.Node):
        if not isinstance(example_value(beta), torch.SymFloat):
            return False
    elif not isinstance(beta, (int, float)) or isinstance(beta, bool):
        return False
    return (isinstance(bias, fx.Node) and isinstance(bv, torch.Tensor) and bv.dim() == 3 and bv.dtype == qv.dtype
            and _same(bv.shape[0], qv.shape[0]) and _same(bv.shape[1], 1) and _same(bv.shape[2], kv.shape[1]))


def per_key_bias(node, keys=None) -> bool:
    """A float `[X, 1, K]` or `[B | 1, H | 1, 1, K]` value added to the logits: one value per key for
    every query (ALiBi); `keys` the key count K must equal, when known."""
    v = example_value(node)
    if not (isinstance(node, fx.Node) and isinstance(v, torch.Tensor) and v.is_floating_point()
            and v.dim() in (3, 4) and _same(v.shape[-2], 1) and isinstance(v.shape[-1], torch.SymInt)):
        return False
    # MPT's is `4096 - Max(0, 4096 - N)` keys wide: N wherever the model runs (elsewhere its own add fails,
    # and so do the ops that read the bias), so equal sizes at the trace suffice here
    return keys is None or _same(v.shape[-1], keys) or _hint(v.shape[-1]) == _hint(keys) is not None


def batched_scores(node, chain):
    """`bmm(q3, k3.transpose(1, 2))` (scale 1) or `baddbmm(zeros, q3, kT3, beta=b, alpha=a)` (scale a),
    read through the views that merge heads -> (q, k `[B, H, N, d]`, scale, bias), else None. `bias`
    is the `baddbmm`'s input when it is not zeros (with its `beta`), for `key_bias_of`."""
    product = through_head_views(node, chain)
    if is_call(product, "bmm") and len(product.args) == 2 and not product.kwargs:
        q3, kt3 = product.args
        scale, bias = 1.0, None
    elif is_call(product, "baddbmm"):
        bias = product.args[0]
        q3, kt3 = arg_of(product, 1, "batch1"), arg_of(product, 2, "batch2")
        beta, scale = arg_of(product, 3, "beta", 1.0), arg_of(product, 4, "alpha", 1.0)
        if len(product.args) > 3 or isinstance(example_value(scale), torch.Tensor) or isinstance(scale, bool):
            return None
        if is_call(bias, "zeros") and len(bias.users) == 1:
            chain.append(bias)
            bias = None
        else:
            bias = (bias, beta)
    else:
        return None
    if not (is_call(kt3, "transpose") and len(kt3.args) == 3):
        return None
    kv = example_value(kt3.args[0])
    if not (isinstance(kv, torch.Tensor) and kv.dim() == 3 and {d % 3 for d in kt3.args[1:3]} == {1, 2}):
        return None
    q, k = lifted(q3), lifted(kt3.args[0])
    if q is None or k is None:
        return None
    if bias is not None and not _per_key(bias[0], example_value(q3), kv, bias[1]):
        return None
    chain += [product, kt3]
    return q, k, scale, bias
