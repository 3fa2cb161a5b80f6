"""DeepSeek sparse attention (DSA): an attention mask that keeps, per query, the top-k keys of a
learned indexer run on the layer's own tokens, recognised so the layer can run on kept tokens.

The form (DeepSeek-V3.2, AXK-2, GLM-DSA as transformers writes them for SDPA)::

    scores  = indexer(hidden_states, ...)                     # [B, N, N], inside this attention
    scores  = scores.masked_fill(~visible[:, 0], -inf)        # or scores + visible[:, 0] (additive)
    chosen  = scores.topk(min(index_topk, N), dim=-1).indices
    dropped = ones([B, N, N]).scatter(-1, chosen, False)[:, None]
    mask    = visible & ~dropped                              # or visible.masked_fill(dropped, min)

where `visible` is a mask `classify.analyse_mask` recognises on its own (causal, padding, no
window). Why it may run on kept tokens: after a drop the indexer scores every (kept query, kept
key) pair from the kept tokens' own activations, and picks the top min(index_topk, T) keys among
them; that is the layer applied to the kept tokens, as a Mamba scan after a drop scans them.
What the rewrite must keep is `visible`: after a drop it is rebuilt from ORIGINAL positions and
rows (`uniprefill::packed_visibility`), so both the indexer's causal fill and the attention's
causal part follow original position order. k = min(index_topk, N) becomes min(index_topk, T):
every query's visible keys number at most T, so the visible keys chosen are the top
min(index_topk, visible) in both, as in the plain model (the extra picks are invisible keys).

The drop layer's own score stays the dense attention of the last queries over every key, not the
indexer's top-k: it is a score only (the layer's own output is computed by the graph unchanged,
so p = 1 is exact), and the indexer is trained to approximate exactly that dense attention.

Anything else stays refused by `mask_words`: a top-k whose k is not min(constant, N) (Doge's
keep_window), a top-k over smallest scores or another axis, scores read from outside this
attention module (a top-k shared from an earlier layer), a selection inside the scores, a
visible part with a window or one `analyse_mask` does not read as causal.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from .fx_utils import ancestors, example_value, module_paths, target_name

_VIEWS = ("unsqueeze", "view", "reshape", "expand", "squeeze", "getitem", "to", "long", "int", "contiguous")


@dataclass(frozen=True)
class IndexerMask:
    """A recognised DSA mask of one attention call."""

    visible: fx.Node  # the causal (+ padding) mask it is combined with; rebuilt after a drop
    topk: fx.Node
    # nodes that read `visible` only (its slice for the indexer, its inversion): recomputed on
    # the kept tokens from the rebuilt `visible` instead of gathered from all tokens
    visible_chain: frozenset


def match_indexer_mask(sdpa: fx.Node, mask: fx.Node) -> IndexerMask | str | None:
    """The DSA form of `mask` (the attention mask of `sdpa`), a reason when the form is there but
    a condition fails, or None when `mask` is not of this form at all."""
    split = _split_combination(mask)
    if split is None:
        return None
    visible, dropped = split
    scatter = _through(dropped, _VIEWS)
    if not _is_call(scatter, "scatter") or len(scatter.args) < 4 or scatter.args[1] not in (-1, _last(scatter)):
        return None
    base, chosen, fill = scatter.args[0], scatter.args[2], scatter.args[3]
    if fill not in (False, 0) or not _is_call(base, "new_ones", "ones", "ones_like"):
        return None
    picked = _through(chosen, ("to", "long", "int"))
    if not (_is_call(picked, "getitem") and picked.args[1] == 1) and not (
            isinstance(picked, fx.Node) and target_name(picked).endswith("indices")):
        return None
    topk = picked.args[0] if isinstance(picked, fx.Node) else None
    if not _is_call(topk, "topk"):
        return None
    scores_in, k = topk.args[0], topk.kwargs.get("k", topk.args[1] if len(topk.args) > 1 else None)
    dim = topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1)
    if not topk.kwargs.get("largest", topk.args[3] if len(topk.args) > 3 else True):
        return "the indexer's top-k keeps the smallest scores"
    if dim not in (-1, _last(scores_in)):
        return "the indexer's top-k runs over another axis than the keys"
    filled = _split_fill(scores_in, visible)
    if filled is None:
        return "the indexer's scores are not masked by the attention's own causal mask before the top-k"
    scores, chain = filled
    why = _scores_are_the_layers_own(scores, sdpa, visible) or _k_is_min_of_keys(k, scores)
    if why:
        return why
    return IndexerMask(visible, topk, frozenset(chain))


def causal_part(sdpa: fx.Node, mask):
    """The part of `mask` whose graph inputs have roles (`mask_inputs`): the causal part of a DSA
    mask (its indexer's scores read the activations), else `mask` itself."""
    found = match_indexer_mask(sdpa, mask) if isinstance(mask, fx.Node) else None
    return found.visible if isinstance(found, IndexerMask) else mask


def _split_combination(mask: fx.Node):
    """(visible, dropped) of `visible & ~dropped` or `visible.masked_fill(dropped, v)`."""
    if _is_call(mask, "and_", "logical_and", "__and__") and len(mask.args) == 2:
        for a, b in (mask.args, mask.args[::-1]):
            if _is_call(b, "invert", "logical_not", "__invert__") and isinstance(a, fx.Node):
                return a, b.args[0]
    if _is_call(mask, "masked_fill") and isinstance(mask.args[0], fx.Node) and isinstance(mask.args[1], fx.Node):
        return mask.args[0], mask.args[1]
    return None


def _split_fill(node, visible: fx.Node):
    """(scores, chain) of `scores.masked_fill(~v, -inf)` or `scores + v`, v a view of `visible`;
    chain: the nodes from `visible` to the fill's mask operand."""
    if _is_call(node, "masked_fill") and len(node.args) >= 3 and node.args[2] == float("-inf"):
        scores, cut = node.args[0], node.args[1]
        if not _is_call(cut, "invert", "logical_not", "__invert__"):
            return None
        chain = [cut]
        view = cut.args[0]
    elif _is_call(node, "add") and len(node.args) == 2:
        scores, view = node.args
        chain = []
    else:
        return None
    while view is not visible:
        if not _is_call(view, "getitem", "unsqueeze", "squeeze", "view", "to"):
            return None
        chain.append(view)
        view = view.args[0]
    return scores, chain


def _scores_are_the_layers_own(scores: fx.Node, sdpa: fx.Node, visible: fx.Node) -> str:
    """The scores are computed inside the module that calls `sdpa` (this layer's indexer), with
    no selection and no read of a mask on the way: an empty string, else the reason."""
    paths = module_paths(sdpa)
    if not paths:
        return "the attention call has no module"
    owner = paths[-1][0]

    def inside(n: fx.Node) -> bool:
        return any(p == owner or p.startswith(owner + ".") for p, _ in module_paths(n))

    if not inside(scores):
        return "the indexer's scores come from outside this attention (a top-k shared from another layer)"
    own = ancestors(scores, stop=lambda n: not inside(n)) | {scores}
    if visible in own or any(_is_call(n, "topk", "sort", "argsort", "kthvalue", "nonzero") for n in own if inside(n)):
        return "the indexer's scores read a mask or another selection"
    val = example_value(scores)
    q, k = example_value(sdpa.args[0]), example_value(sdpa.args[1])
    if not all(isinstance(t, torch.Tensor) for t in (val, q, k)) or val.dim() < 2 \
            or _expr(val.shape[-1]) != _expr(k.shape[-2]) or _expr(val.shape[-2]) != _expr(q.shape[-2]):
        return "the indexer's scores are not one score per (query, key) of this attention"
    return ""


def _k_is_min_of_keys(k, scores: fx.Node) -> str:
    """k is min(constant, keys) or the keys: it then shrinks with the kept count."""
    keys = _expr(example_value(scores).shape[-1])
    value = example_value(k) if isinstance(k, fx.Node) else k
    expr = _expr(value)
    if type(expr).__name__ == "Min" and len(expr.args) == 2 and any(a.is_Integer for a in expr.args):
        expr = next(a for a in expr.args if not a.is_Integer)
    if isinstance(expr, sympy.Symbol) and isinstance(value, torch.SymInt) and _same_length(expr, keys, value):
        return ""
    return f"the indexer's top-k keeps {expr} keys, not min(constant, keys): it would not follow the kept count"


def _same_length(a, b, value: torch.SymInt) -> bool:
    """Two size symbols of one length: the same, or aliases traced with the same size (the plan
    checks at run time that aliased inputs keep one length, `mask_inputs.size_aliases`)."""
    if a == b:
        return True
    env = value.node.shape_env
    hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    return a in hints and hints.get(a) == hints.get(b)


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size) if isinstance(size, int) else size


def _last(node) -> int | None:
    val = example_value(node) if isinstance(node, fx.Node) else None
    return val.dim() - 1 if isinstance(val, torch.Tensor) else None


def _through(node, names: tuple):
    while _is_call(node, *names) and isinstance(node.args[0], fx.Node) and not (
            _is_call(node, "getitem") and not isinstance(node.args[1], tuple)):
        node = node.args[0]
    return node


def _is_call(node, *names: str) -> bool:
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        return "getitem" in names
    return target_name(node).rsplit(".", 1)[-1] in names
