"""The token-drop rewrite: score-and-select at drop points, everything after on kept tokens.

Design. Every value of the graph lives in a *layout*: layout 0 is the dense (B, N) grid the
model was traced with; each drop point creates a packed layout (batch axis 1, T kept
tokens, rows back to back). The pass copies the graph node by node. A node's layout is the
newest layout among its token-aligned inputs (a value is token-aligned when its traced shape
has an axis whose size is the prompt-length symbol N, or B * N); older inputs are gathered
into it once (`uniprefill::gather_tokens`, memoised), so position ids, cos/sin tables and
padding masks computed at the top follow the residual stream. Shape arguments of packed
nodes are rewritten symbolically (N -> T, B -> 1). Attention nodes are replaced by
`uniprefill::dense_attention` / `packed_attention`, which rebuild causal, sliding-window
and padding masks from ORIGINAL positions, so a sliding window after a drop is still a
window over original positions, and the N x N mask of the traced graph is never built.
Eager attention with learned sinks (GPT-OSS) is first made one SDPA-like node
(`passes.sink_attention`) and is replaced by the `*_sink_attention` ops of `sink_ops`.

At drop layer L the layer's own attention runs in full; right after its residual add the
pass inserts `uniprefill::score_select` on that attention's (q, k) and gathers the residual
stream to the kept tokens, so the MLP of layer L and everything later runs on them. Nodes
outside the decoder stack that read a packed value (the final norm) get it scattered back
into a dense *canvas* in which every dropped token holds the state it had when dropped.
Under the "suspend" policy the residual stream entering each later drop layer is scattered
back the same way, so dropped tokens re-enter and are scored again.

What the rewrite applies is decided first, by `passes.plan.plan_rewrite` (token axes, input
roles, layer kinds, drop points and their residual adds). What either cannot follow (a program
traced for some lengths only, an unknown op on packed values, a value with two token axes after
a drop, a graph break inside the decoder stack, ...) raises `RewriteSkipped` with the reason;
the backend then runs the graph unchanged (or raises under `strict`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from .. import ops, record_ops  # noqa: F401  (register the custom ops)
from ..config import UniPrefillConfig
from ..models.layer_kinds import LayerKind
from .attention_copy import AttentionCopy
from .fx_utils import example_value, layer_index, target_name
from .graph_calls import keep_node
from .plan import LengthSpecialized, NothingToDrop, RewriteSkipped, _expr, plan_rewrite  # noqa: F401  (re-exported)
from .rewrite_result import LayerReport, RewriteResult
from .shape_exprs import SymbolicShapes
from .sink_attention import SinkAttentionCopy, canonicalize_sink_attention

U = torch.ops.uniprefill
# Ops that mix information along the token axis in ways that are right for one row of
# packed tokens but would leak across rows when several rows are packed together.
_ROW_MIXERS = ("conv1d", "conv2d", "cumsum", "cumprod", "matmul", "bmm", "einsum", "baddbmm", "delta_rule", "scan",
               "lightning_attention")
_SAFE_MODULES = ("torch", "operator", "builtins", "math", "_operator", "transformers")


@dataclass
class _Layout:
    ident: int
    parent: int | None
    rel: fx.Node | None = None  # indices into the parent layout's token axis (flat for layout 0)
    orig_flat: fx.Node | None = None  # flat b * N + t index of every token, into the dense grid
    positions: fx.Node | None = None
    counts: fx.Node | None = None  # host int64 [rows]
    src_flat: fx.Node | None = None
    size: fx.Node | None = None  # runtime int T
    canvas: fx.Node | None = None  # dense residual in which dropped tokens hold their last state
    canvas_old: fx.Node | None = None


@dataclass
class TokenDropPass(SymbolicShapes, AttentionCopy, SinkAttentionCopy):
    """Rewrites one dynamo graph; `run()` returns a `RewriteResult` or raises `RewriteSkipped`."""

    gm: fx.GraphModule
    config: UniPrefillConfig
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("drop_points", "gathers", "scatters", "dense_attention", "dense_masks", "packed_attention",
         "packed_masks", "shape_rewrites"), 0))
    # masks shared by the layers that need the same one: before the first drop one per
    # (window, padding input), after it one per (layout, window)
    _dense_masks: dict = field(default_factory=dict)
    _packed_masks: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- rewrite
    def run(self) -> RewriteResult:
        # eager attention becomes one node first: with learned sinks (GPT-OSS) uniprefill::sink_attention,
        # without them an SDPA call
        self.gm, sink_sites, eager_sites = canonicalize_sink_attention(self.gm)
        if sink_sites:
            self.counts["sink_attention_sites"] = sink_sites
        if eager_sites:
            self.counts["eager_attention_sites"] = eager_sites
        self.plan = plan_rewrite(self.gm, self.config)
        self.bias_nodes = self._bias_nodes_on_all_tokens()  # passes/sink_attention.py
        old = self.gm.graph
        new = fx.Graph()
        self.new = new
        self.env: dict[fx.Node, fx.Node] = {}
        self.layout_of: dict[fx.Node, int] = {}
        self.layouts = [_Layout(0, None)]
        self.memo: dict[tuple[fx.Node, int], fx.Node] = {}
        self.single_row_reason = ""
        drop_at = {node: layer for layer, node in self.plan.residual_adds.items()}
        sdpa_info = {n: (info, m) for info in self.plan.layers.values() for n, m in zip(info.sdpa, info.masks)}
        dsa = [m.indexer for info in self.plan.layers.values() for m in info.masks if m.indexer is not None]
        self.indexer_visible = {d.visible for d in dsa}
        self.indexer_chain = {n for d in dsa for n in d.visible_chain}
        seen_first_drop = False
        self.stream_layout = 0
        last_layer_pos = max(i for i, n in enumerate(old.nodes) if layer_index(n, self.plan.container) is not None)
        self.stack_output = list(old.nodes)[last_layer_pos]  # the last layer's output: the residual stream
        self.after_stack = {n for i, n in enumerate(old.nodes) if i > last_layer_pos}
        for node in old.nodes:
            if node.op == "output":
                self.new.output(map_aggregate(node.args[0], lambda a: self._returned(a, node) if isinstance(a, fx.Node) else a))
                continue
            if node.op in ("placeholder", "get_attr"):
                self.env[node] = new.node_copy(node, lambda a: self.env[a])
                self.layout_of[node] = 0
                continue
            if node in sdpa_info:
                self._copy_attention(node, *sdpa_info[node])
            else:
                self._copy_node(node, seen_first_drop)
            if node in drop_at:
                self._insert_drop(node, drop_at[node])
                seen_first_drop = True
            if node in self.plan.reentry:
                self._reenter(node)
        new.eliminate_dead_code(is_impure_node=keep_node)
        gm = fx.GraphModule(self.gm, new)
        gm.recompile()
        reports = [
            LayerReport(i, info.kind, info.window, i in self.plan.drop_layers,
                        ("drop point; " if i in self.plan.drop_layers else "") + info.detail)
            for i, info in self.plan.layers.items()
        ]
        return RewriteResult(gm, reports, self.plan.drop_layers, dict(self.counts),
                             bool(self.single_row_reason), self.single_row_reason, self._returns_cache(),
                             self.plan.input_checks,
                             bool(self.single_row_reason) or any(i.kind is LayerKind.LINEAR for i in self.plan.layers.values()),
                             [n for n in self.gm.graph.nodes if n.op == "placeholder"].index(self.plan.tokens))

    def _returned(self, node: fx.Node, output: fx.Node) -> fx.Node:
        """The value the call returns for `node`. The stack's own output returned as it is (a base model without a
        final norm: OPT with `do_layer_norm_before=False`) goes back into the dense canvas, as a value read after
        the stack does: the logits and hidden states keep their shapes. Other values of a layer after a drop come
        back as they are (the caches, compacted by design), unless they hold one row per token."""
        if self.layout_of.get(node, 0) > 0:
            if node is self.stack_output:
                return self._scatter_back(node, output)
            self._refuse_token_rows(node)
        return self.env[node]

    def _refuse_token_rows(self, node: fx.Node) -> None:
        """A packed value with one row per token (rows of batch and tokens together: the router logits of
        `output_router_logits`) that the call returns or reads after the stack would have the kept rows only:
        refused, as the requests that need every position are. Caches keep their token axis elsewhere."""
        val = example_value(node)
        if isinstance(val, torch.Tensor) and val.dim() == 2 \
                and 0 in self.plan.axes.token_dims(val) + self.plan.axes.flat_dims(val):
            raise RewriteSkipped(f"{node.name} {list(val.shape)} holds one row per token of a layer after a drop (the "
                                 "router logits of output_router_logits, say), which the call returns: it needs every "
                                 "position")

    def _returns_cache(self) -> bool:
        """Whether the graph hands key/value tensors out (a cache is being filled)."""
        flat = []
        map_aggregate(self.gm.graph.output_node().args[0], lambda a: flat.append(a) if isinstance(a, fx.Node) else None)
        return any(isinstance(example_value(n), torch.Tensor) and example_value(n).dim() == 4
                   and self.plan.axes.token_dims(example_value(n)) == [2] for n in flat)

    def _node_layout(self, node: fx.Node) -> int:
        best = 0
        for inp in node.all_input_nodes:
            if self.layout_of.get(inp, 0) > best and self._follows_tokens(example_value(inp)):
                best = self.layout_of[inp]
        return best

    def _follows_tokens(self, val) -> bool:
        """Whether a value's sizes follow the token count: a token axis, an axis such as N + 3,
        or, for ops with several outputs (topk, split), any of its outputs."""
        if isinstance(val, (tuple, list)):
            return any(self._follows_tokens(v) for v in val)
        return bool(self.plan.axes.token_dims(val) or self.plan.axes.flat_dims(val) or self.plan.axes.derived_dims(val))

    def _token_aligned(self, node: fx.Node) -> bool:
        val = example_value(node)
        return bool(self.plan.axes.token_dims(val) or self.plan.axes.flat_dims(val))

    def _copy_node(self, node: fx.Node, after_first_drop: bool) -> None:
        if node in self.bias_nodes:  # a per-key attention bias stays on all tokens (passes/sink_attention.py)
            self.env[node] = self.new.node_copy(node, lambda a: self._arg_at(a, 0))
            self.layout_of[node] = 0
            return
        j = self._node_layout(node)
        if j > 0 and layer_index(node, self.plan.container) is None and node in self.after_stack:
            # Leaving the decoder stack: scatter packed values back into the dense canvas.
            def to_dense(a):
                if isinstance(a, fx.Node) and self.layout_of.get(a, 0) > 0 and self._token_aligned(a):
                    return self._scatter_back(a, node)
                return self._value_at(a, 0) if isinstance(a, fx.Node) else a
            self.env[node] = self.new.node_copy(node, lambda a: to_dense(a))
            self.layout_of[node] = 0
            return
        if j == 0 and self.stream_layout > 0 and layer_index(node, self.plan.container) is not None and self._mentions_tokens(node):
            # A creation op inside a layer on kept tokens (e.g. MoE index arithmetic): its
            # sizes follow the residual stream.
            j = self.stream_layout
        if j == 0 and self.stream_layout > 0 and node in self.indexer_chain:
            j = self.stream_layout  # a slice of a DSA layer's causal mask: taken from the rebuilt one
        if j > 0:
            self._check_packed_op(node)
        self.env[node] = self.new.node_copy(node, lambda a: self._arg_at(a, j))
        self.layout_of[node] = j

    def _mentions_tokens(self, node: fx.Node) -> bool:
        token_syms = {self.plan.axes.seq} | ({self.plan.axes.batch} if not isinstance(self.plan.axes.batch, int) else set()) \
            | {alias for alias, _ in self.plan.axes.aliases}
        found = []

        def visit(a):
            if isinstance(a, fx.Node):
                val = example_value(a)
                if isinstance(val, torch.SymInt) and sympy.sympify(val.node.expr).free_symbols & token_syms:
                    found.append(a)
            return a

        map_aggregate((node.args, node.kwargs), visit)
        return bool(found)

    def _check_packed_op(self, node: fx.Node) -> None:
        name = target_name(node)
        if node.op == "call_module":
            raise RewriteSkipped(f"opaque module call {node.target} on kept tokens")
        if node.op == "call_function":
            module = getattr(node.target, "__module__", "") or ""
            is_op_overload = isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            if is_op_overload:
                schema = getattr(node.target, "_schema", None)
                namespace = schema.name.split("::")[0] if schema is not None else str(node.target).split(".")[0]
                if namespace not in ("aten", "prims", "transformers", "uniprefill"):
                    raise RewriteSkipped(f"unknown custom op {name} runs on kept tokens (quantized or packed kernels are not followed)")
            elif not module.split(".")[0] in _SAFE_MODULES:
                raise RewriteSkipped(f"unknown function {name} runs on kept tokens")
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            axis = self.plan.axes.int_index_axis(example_value(node.args[0]), node.args[1])
            if axis is not None:
                raise RewriteSkipped(
                    f"{node.name} reads one token position (axis {axis}) of {node.args[0].name}: a Python loop "
                    "unrolled over the prompt, which cannot run on a different number of kept tokens")
        lowered = name.lower()
        if any(m in lowered for m in _ROW_MIXERS) and not self.single_row_reason:
            self.single_row_reason = f"{name} mixes tokens after a drop point (e.g. linear attention or convolution)"

    def _arg_at(self, arg, j: int):
        def fn(a):
            if isinstance(a, fx.Node):
                val = example_value(a)
                if j > 0 and isinstance(val, torch.SymInt):
                    return self._emit_expr(val.node.expr, j)
                return self._value_at(a, j)
            return a
        return map_aggregate(arg, fn)

    def _value_at(self, node: fx.Node, j: int) -> fx.Node:
        i = self.layout_of.get(node, 0)
        if i == j or not self._token_aligned(node):
            return self.env[node]
        if j > 0 and node in self.indexer_visible:  # a DSA layer reads its causal mask (attention_copy)
            return self._packed_visibility(node, j)
        if i > j:
            raise RewriteSkipped(f"{node.name} (kept tokens) is used by a node on all tokens")
        key = (node, j)
        if key in self.memo:
            return self.memo[key]
        val = example_value(node)
        tds, fds = self.plan.axes.token_dims(val), self.plan.axes.flat_dims(val)
        if len(tds) > 1:
            raise RewriteSkipped(f"{node.name} has two token axes (an N x N mask) and is used after a drop point")
        if tds:
            td = tds[0]
            bd = self.plan.axes.batch_dim(val, td)
        else:
            td, bd = fds[0], -1
        idx = self._indices_from(i, j)
        tokens = self.layouts[i].size if (tds or i > 0) else self.flat_tokens_node  # flat axis: B * N
        out = self.new.call_function(U.gather_tokens.default, (self.env[node], idx, bd, td, tokens))
        self.counts["gathers"] += 1
        self.memo[key] = out
        return out

    def _indices_from(self, i: int, j: int) -> fx.Node:
        """Indices that take layout i's token axis to layout j's."""
        if i == 0:
            return self.layouts[j].orig_flat
        chain = []
        cur = j
        while cur != i:
            if cur is None or cur == 0:
                raise RewriteSkipped(f"a value of layout {i} is used in layout {j}, which does not descend from it")
            chain.append(self.layouts[cur].rel)
            cur = self.layouts[cur].parent
        idx = chain[-1]
        for rel in reversed(chain[:-1]):
            idx = self.new.call_function(torch.index_select, (idx, 0, rel))
        return idx

    # ---------------------------------------------------------------- drop points
    def _ensure_layout0(self) -> None:
        lay = self.layouts[0]
        if lay.src_flat is not None:
            return
        new = self.new
        tokens = self.env[self.plan.tokens]
        rows = new.call_function(torch.ops.aten.sym_size.int, (tokens, 0))
        seq = new.call_function(torch.ops.aten.sym_size.int, (tokens, 1))
        new.call_function(U.begin_prefill.default, (rows, seq))
        padding = self.env[next(iter(self.plan.padding))] if len(self.plan.padding) == 1 else None
        live = new.call_function(U.live_tokens.default, (padding, rows, seq, tokens))
        lay.src_flat = new.call_function(operator.getitem, (live, 0))
        lay.counts = new.call_function(operator.getitem, (live, 1))
        lay.orig_flat = lay.src_flat
        lay.size = seq
        self.seq_node = seq
        self.flat_tokens_node = new.call_function(operator.mul, (rows, seq))

    def _insert_drop(self, residual: fx.Node, layer: int) -> None:
        self._ensure_layout0()
        new, cfg = self.new, self.config
        i = self.layout_of[residual]
        parent = self.layouts[i]
        sdpa = self.plan.layers[layer].sdpa[0]
        q = self.env[sdpa.args[0]] if self.layout_of.get(sdpa.args[0], 0) == i else self._value_at(sdpa.args[0], i)
        k = self.env[sdpa.args[1]] if self.layout_of.get(sdpa.args[1], 0) == i else self._value_at(sdpa.args[1], i)
        scale = sdpa.kwargs.get("scale")
        scale = self.env[scale] if isinstance(scale, fx.Node) else (scale or 1.0 / math.sqrt(example_value(sdpa.args[0]).shape[-1]))
        drop_index = self.plan.drop_layers.index(layer)
        ratio = cfg.keep_ratio_at(drop_index, len(self.plan.drop_layers))
        sel = new.call_function(U.score_select.default, (
            q, k, parent.src_flat, parent.counts, scale, cfg.block_size, float(cfg.p),
            -1.0 if ratio is None else float(ratio), cfg.sink, cfg.last_q, cfg.effective_min_tokens, cfg.impl,
            cfg.selection))
        rel = new.call_function(operator.getitem, (sel, 0))
        counts = new.call_function(operator.getitem, (sel, 1))
        lay = _Layout(len(self.layouts), i)
        lay.rel = rel
        lay.counts = counts
        lay.orig_flat = new.call_function(torch.index_select, (parent.orig_flat, 0, rel))
        new.call_function(U.record_drop.default, (layer, parent.counts, counts, lay.orig_flat))
        lay.positions = new.call_function(operator.mod, (lay.orig_flat, self.seq_node))
        lay.size = new.call_function(torch.ops.aten.sym_size.int, (rel, 0))
        lay.src_flat = new.call_function(U.arange_like.default, (lay.size, rel))
        cur = self.env[residual]
        if i == 0:
            lay.canvas = cur
            gathered = new.call_function(U.gather_tokens.default, (cur, lay.orig_flat, 0, 1, self.seq_node))
        else:
            lay.canvas = new.call_function(U.scatter_tokens.default, (parent.canvas, cur, parent.orig_flat, 0, 1))
            self.counts["scatters"] += 1
            gathered = new.call_function(U.gather_tokens.default, (cur, rel, 0, 1, parent.size))
        self.counts["gathers"] += 1
        self.counts["drop_points"] += 1
        self.layouts.append(lay)
        self.env[residual] = gathered
        self.layout_of[residual] = lay.ident
        self.stream_layout = lay.ident

    def _reenter(self, node: fx.Node) -> None:
        """Suspend policy: scatter the stream entering a later drop layer back to all tokens."""
        j = self.layout_of.get(node, 0)
        if j == 0:
            return
        self.env[node] = self._scatter_node(node, j)
        self.layout_of[node] = 0
        self.stream_layout = 0

    def _scatter_back(self, node: fx.Node, consumer: fx.Node) -> fx.Node:
        key = (node, -1)
        if key not in self.memo:
            j = self.layout_of[node]
            val = example_value(node)
            canvas_val = example_value(self._canvas_source())
            if [_expr(d) for d in val.shape] != [_expr(d) for d in canvas_val.shape]:
                self._refuse_token_rows(node)
                raise RewriteSkipped(f"{consumer.name} outside the decoder layers reads {node.name} "
                                     f"{list(val.shape)}, which is not the residual stream {list(canvas_val.shape)}")
            self.memo[key] = self._scatter_node(node, j)
        return self.memo[key]

    def _canvas_source(self) -> fx.Node:
        """The residual stream at the first drop point: the dense canvas has its shape."""
        return self.plan.residual_adds[self.plan.drop_layers[0]]

    def _scatter_node(self, node: fx.Node, j: int) -> fx.Node:
        lay = self.layouts[j]
        self.counts["scatters"] += 1
        return self.new.call_function(U.scatter_tokens.default, (lay.canvas, self.env[node], lay.orig_flat, 0, 1))


