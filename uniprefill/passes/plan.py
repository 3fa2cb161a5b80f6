"""Analysis: what the token-drop rewrite will do to one dynamo graph, decided before any node
is copied (`plan_rewrite` returns a frozen `RewritePlan`, or raises `RewriteSkipped`).

It finds the token input and its symbolic axes (`fx_utils.TokenAxes`), refuses graphs the
rewrite must not touch (a static trace, a program traced for some lengths only, labels, dropout,
gradients, hidden states or attention maps requested), reads the roles of the inputs the masks
use (`mask_inputs`), classifies the layers (`classify`), resolves the drop layers
(`drop_points`) and finds, for each, the residual add after its attention, where the drop goes.
`token_drop.TokenDropPass` then applies the plan.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.node import map_aggregate

from ..config import UniPrefillConfig
from ..models.layer_kinds import LayerKind
from ..unaccelerated import Kind
from .classify import BIDIRECTIONAL, WITHIN_TOKEN, MaskInfo, _container_without_sdpa, classify_layers, sdpa_mask_node
from .drop_points import resolve_drop_layers
from .fx_utils import (TokenAxes, ancestors, example_value, is_sdpa, layer_container, layer_index, target_name,
                       through_same_shape_views)
from .graph_pieces import not_one_stack, why_no_tokens
from .indexer_mask import causal_part
from .length_guards import length_guard_violation
from .mask_inputs import InputCheck, InputRole, mask_input_roles, size_aliases
from .mask_meaning import mask_mismatch

_ADDS = {operator.add, torch.add, operator.iadd}


class RewriteSkipped(Exception):
    """The graph cannot be rewritten safely; the message says why, `kind` what sort of reason it is."""

    kind = Kind.GRAPH_NOT_FOLLOWED


class NothingToDrop(RewriteSkipped):
    """The graph is too short to drop from (a decode step): left unchanged without a warning."""

    kind = Kind.NOTHING_TO_DROP


class NoDecoderLayers(RewriteSkipped):
    """The graph holds no attention and no decoder layer: a piece of a model split by graph
    breaks (`graph_pieces`). Not a refusal of the model when another graph holds its layers; the
    backend then keeps that graph's reason."""


class NotInference(RewriteSkipped):
    """Gradients are enabled or labels were given: a loss or a backward pass needs every position."""

    kind = Kind.NOT_INFERENCE


class LengthSpecialized(RewriteSkipped):
    """The traced program holds only for a range of prompt lengths (the model branches on the
    length, e.g. a scan that recurses on it): no kept-token count can be run through it, and
    every new length would be traced again, so the caller may stop compiling this model."""

    kind = Kind.LENGTH_SPECIALIZED


@dataclass(frozen=True)
class RewritePlan:
    tokens: fx.Node  # the token input (ids into the embedding, or inputs_embeds)
    axes: TokenAxes
    input_roles: dict  # placeholder -> mask_inputs.InputRole
    padding: frozenset  # the padding-mask placeholder (at most one)
    input_checks: tuple  # mask_inputs.InputCheck, run before the rewritten graph
    container: str  # the module list that holds the decoder layers
    layers: dict  # layer index -> classify.LayerInfo
    drop_layers: tuple
    residual_adds: dict  # drop layer -> the residual add after its attention
    reentry: dict  # "suspend" policy: residual stream entering a later drop layer -> that layer
    sym_nodes: dict  # size symbol -> the placeholder that carries it (unbacked: the node computing it)


def plan_rewrite(gm: fx.GraphModule, config: UniPrefillConfig) -> RewritePlan:
    """The plan for `gm` under `config`, or `RewriteSkipped` with the reason."""
    return _Analysis(gm, config).plan()


@dataclass
class _Analysis:
    """The steps of `plan_rewrite`; each later step reads what the earlier ones found."""

    gm: fx.GraphModule
    config: UniPrefillConfig

    def plan(self) -> RewritePlan:
        graph = self.gm.graph
        pieces = not_one_stack(graph)
        if pieces:
            raise (NoDecoderLayers if pieces[1] else RewriteSkipped)(pieces[0])
        self.tokens = self._find_tokens()
        val = example_value(self.tokens)
        static = not isinstance(val.shape[1], torch.SymInt)
        self.axes = TokenAxes(_expr(val.shape[0]), _expr(val.shape[1]), static)
        if static and int(val.shape[1]) < self.config.effective_min_tokens:
            raise NothingToDrop(f"a graph traced for {int(val.shape[1])} token(s) (a decode step or a short "
                                "prompt): nothing to drop")
        if static:
            raise RewriteSkipped(
                "static-shape trace: the prompt length is baked into the graph; compile with "
                "dynamic=True (uniprefill.compile does) or let dynamo recompile with dynamic shapes"
            )
        aliases, alias_checks = size_aliases(graph, self.axes.batch, self.axes.seq)
        violation = length_guard_violation(self.axes.seq)
        if violation is not None:
            raise (LengthSpecialized if violation.bounded else RewriteSkipped)(violation.message)
        if isinstance(self.axes.batch, int) and self.axes.batch > 1:
            raise RewriteSkipped(
                f"the row count is a constant of the graph ({self.axes.batch} rows, traced with a symbolic length): "
                "sizes like (rows, length, heads, dim) cannot follow the rows packed into one sequence of kept "
                "tokens; let the row axis be dynamic (torch._dynamo.mark_dynamic(ids, 0), or dynamic=True)")
        self.axes = dataclasses.replace(self.axes, aliases=aliases)
        # Roles of the inputs the attention masks read (padding, document positions, ...),
        # found from the graph's structure; see passes/mask_inputs.py.
        masks = [m for m in (causal_part(n, sdpa_mask_node(n)) for n in graph.nodes if is_sdpa(n)) if isinstance(m, fx.Node)]
        self.input_roles, _ = mask_input_roles(graph, masks, self.axes)
        constant = [n.name for n, role in self.input_roles.items()  # a causal table (GPT-2's `bias`) is fixed-size
                    if isinstance(role, InputRole) and isinstance(example_value(n), torch.Tensor)
                    and not self.axes.depends_on_tokens(example_value(n))]
        if constant:
            raise RewriteSkipped(
                f"the mask input(s) {constant} have a constant length in a graph traced with a symbolic one (an input "
                "dynamo kept static beside dynamic ids): the rewrite cannot rebuild them for the kept tokens")
        self.padding = {n for n, role in self.input_roles.items() if role is InputRole.PADDING}
        if len(self.padding) > 1:
            raise RewriteSkipped(f"the masks read {len(self.padding)} padding-mask inputs; expected one")
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.input_checks = tuple(InputCheck(placeholders.index(n), role, n.name)
                                  for n, role in self.input_roles.items()) + tuple(
            InputCheck(placeholders.index(n), InputRole.SAME_LENGTH if which == "seq" else InputRole.SAME_ROWS, n.name, dim)
            for n, dim, which in alias_checks)
        self._check_requests()
        self.container, self.layers = classify_layers(graph, self.input_roles)
        if not self.layers:
            raise RewriteSkipped("no decoder layers found (no module list of attention layers in the graph)")
        self._check_mask_meanings()
        self._name_extra_keys()
        present = sorted(self.layers)
        if present != list(range(present[-1] + 1)):
            raise RewriteSkipped(f"graph break inside the decoder stack: this graph holds layers {present}")
        full = [i for i, info in self.layers.items() if info.kind is LayerKind.FULL]
        # attention calls over the tokens; one within each token (WITHIN_TOKEN) mixes none and says nothing of
        # the model's causality: a layer holding only such calls is read as one without an attention site
        over_tokens = {i: info for i, info in self.layers.items() if any(m.reason != WITHIN_TOKEN for m in info.masks)}
        if not full and over_tokens and all(m.reason == BIDIRECTIONAL for info in over_tokens.values()
                                            for m in info.masks if m.reason != WITHIN_TOKEN):
            raise RewriteSkipped("not a causal decoder: every attention layer is bidirectional (no mask and "
                                 "is_causal=False), so each token sees later tokens; token dropping applies to causal "
                                 "prefill only (an encoder built as a decoder, e.g. BERT, is causal with is_decoder=True)")
        if not full:
            kinds = "; ".join(f"{i}: {info.kind} ({info.detail})" for i, info in list(self.layers.items())[:4])
            details = {info.detail for info in over_tokens.values()}
            if len(details) == 1 and all(info.kind is LayerKind.OTHER for info in over_tokens.values()):
                raise RewriteSkipped(f"no full-attention layer the rewrite can follow: in every attention layer, "
                                     f"{details.pop()}")
            if over_tokens:
                raise RewriteSkipped(f"no full-attention layer in this graph: its attention layers are sliding-window "
                                     f"or use masks the rewrite does not model (layers: {kinds})")
            from .eager_attention_words import unmatched_eager_attention

            eager = unmatched_eager_attention(graph)
            if eager:  # attention written out by hand (transformers has no SDPA path for it)
                raise RewriteSkipped(f"no full-attention layer in this graph: {eager} (layers: {kinds})")
            if any(info.sdpa for info in self.layers.values()):
                raise RewriteSkipped(f"no attention over the tokens in this graph: every attention call is "
                                     f"{WITHIN_TOKEN} (layers: {kinds})")
            if all(info.kind is LayerKind.LINEAR for info in self.layers.values()):
                raise RewriteSkipped("an attention-free model: every layer is a recurrent or convolutional token mixer "
                                     "(no attention to score tokens with, so no layer to drop at)")
            raise RewriteSkipped("no full-attention layer (no scaled_dot_product_attention call) in this graph; "
                                 f"if the model has attention, load it with attn_implementation='sdpa' (layers: {kinds})")
        self.drop_layers = resolve_drop_layers(self.config.drop_layers, self.layers)
        if not self.drop_layers:
            raise RewriteSkipped(f"drop_layers={self.config.drop_layers!r} selects no layer of this model")
        self.residual_adds = {layer: self._residual_add(layer) for layer in self.drop_layers}
        self.reentry = {}
        if self.config.policy == "suspend":
            for layer in self.drop_layers[1:]:
                self.reentry[self._layer_input(layer)] = layer
        sym_nodes = {}  # a size symbol's placeholder, or the node computing an unbacked one (`.tolist()`)
        for n in graph.nodes:
            val = example_value(n)
            if isinstance(val, torch.SymInt) and (n.op == "placeholder" or free_unbacked_symbols(val) == {val.node.expr}):
                sym_nodes.setdefault(val.node.expr, n)
        return RewritePlan(self.tokens, self.axes, self.input_roles, frozenset(self.padding), self.input_checks,
                           self.container, self.layers, self.drop_layers, self.residual_adds, self.reentry, sym_nodes)

    def _find_tokens(self) -> fx.Node:
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and target_name(node).endswith("embedding"):
                src = through_same_shape_views(node.args[0])
                if isinstance(src, fx.Node) and src.op == "placeholder":
                    return src
        for node in self.gm.graph.nodes:
            if node.op == "placeholder" and "inputs_embeds" in node.name:
                return node
        sdpa = [n for n in self.gm.graph.nodes if is_sdpa(n)]
        container = layer_container(sdpa) if sdpa else _container_without_sdpa(self.gm.graph)
        raise RewriteSkipped(f"no token-id or inputs_embeds input found: {why_no_tokens(self.gm.graph, container)}")

    def _check_requests(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder" and "labels" in node.name:
                raise NotInference("labels were given: a loss needs every position")
            # `labels=input_ids` (the usual idiom) reaches the graph as the token input itself:
            # dynamo passes one tensor once, so look for the loss instead of its input
            if node.op in ("call_function", "call_method") and any(
                    loss in target_name(node) for loss in ("cross_entropy", "nll_loss")):
                raise NotInference("labels were given (the graph computes a loss): a loss needs every position")
            if _active_dropout(node):
                raise RewriteSkipped("dropout is active (the model is in training mode): every token's output is "
                                     "random; call model.eval() for inference")
            val = example_value(node)
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.requires_grad and torch.is_grad_enabled():
                raise NotInference("gradients are enabled: run inference under torch.no_grad()")
        outputs = self.gm.graph.output_node().args[0]
        flat = []
        map_aggregate(outputs, lambda a: flat.append(a) if isinstance(a, fx.Node) else None)
        hidden = [n for n in flat if isinstance(example_value(n), torch.Tensor) and example_value(n).dim() == 3
                  and len(self.axes.token_dims(example_value(n))) == 1 and example_value(n).is_floating_point()
                  and "logits" not in n.name]
        if len(hidden) > 1:
            raise RewriteSkipped("output_hidden_states was requested: every layer's hidden states need every position")
        if any(len(self.axes.token_dims(example_value(n))) >= 2 for n in flat):
            raise RewriteSkipped("output_attentions was requested: attention maps need every position")

    def _check_mask_meanings(self) -> None:
        """A layer whose mask, run on small inputs, is not the mask its structure was read as
        becomes "other" (passes/mask_meaning.py): never rewritten as full or sliding."""
        verdicts: dict = {}
        for info in self.layers.values():
            for k, (sdpa, mask) in enumerate(zip(info.sdpa, info.masks)):
                node = mask.indexer.visible if mask.indexer is not None else sdpa_mask_node(sdpa)
                if not mask.recognized or not isinstance(node, fx.Node):
                    continue
                key = (node, mask.window, mask.padding is not None)
                if key not in verdicts:
                    verdicts[key] = mask_mismatch(self.gm, node, mask.window, mask.padding is not None,
                                                  self.input_roles, self.axes, self.tokens)
                if verdicts[key]:
                    info.masks[k] = MaskInfo(False, reason=verdicts[key])
                    info.kind, info.window, info.detail = LayerKind.OTHER, 0, verdicts[key]

    def _name_extra_keys(self) -> None:
        """A layer left as "other" whose keys are more than the prompt's tokens (N + N / 128 entries:
        compressed blocks beside the tokens, DeepSeek-V4's) is named for that, the first fact a
        rewrite over tokens cannot follow."""
        for info in self.layers.values():
            keys = [example_value(n.args[1]) for n in info.sdpa if len(n.args) > 1]
            sizes = {self.axes.size_expr(k.shape[-2]) for k in keys if isinstance(k, torch.Tensor) and k.dim() >= 2}
            extra = [e for e in sizes if e != self.axes.seq and self.axes.seq in sympy.sympify(e).free_symbols]
            if info.kind is LayerKind.OTHER and extra:
                entries = str(sympy.sympify(extra[0]).xreplace({self.axes.seq: sympy.Symbol("N")}))
                info.detail = (f"its keys are more than the prompt's tokens ({entries} key entries for N tokens: "
                               "entries added beside the tokens, e.g. compressed blocks), which the rewrite does not model")

    def _residual_add(self, layer: int) -> fx.Node:
        info = self.layers[layer]
        if len(info.sdpa) > 1 and not _one_attention_map(info.sdpa):
            if _runs_again(info.sdpa):
                raise RewriteSkipped(
                    f"layer {layer} runs {len(info.sdpa)} times, each run on the output of the one before (a looped, "
                    "recurrent-depth stack that applies the same layers again): the rewrite expects each layer's "
                    "attention once per prefill")
            raise RewriteSkipped(f"layer {layer} has {len(info.sdpa)} attention calls with different queries or masks "
                                 "(e.g. a layer run twice in a loop); expected one attention map per layer")
        nodes = list(self.gm.graph.nodes)
        after = False
        downstream = set(info.sdpa)
        for node in nodes:
            if node in downstream:
                after = True
                continue
            if not after:
                continue
            if any(a in downstream for a in node.all_input_nodes):
                downstream.add(node)
            else:
                continue
            if layer_index(node, self.container) != layer:
                break
            if node.op == "call_function" and node.target in _ADDS and len(node.args) == 2:
                a, b = node.args
                if isinstance(a, fx.Node) and isinstance(b, fx.Node) and ((a in downstream) != (b in downstream)):
                    shapes = [_shape(example_value(x)) for x in (node, a, b)]
                    if shapes[0] is not None and shapes[0] == shapes[1] == shapes[2] and \
                            self.axes.token_dims(example_value(node)) == [1]:
                        return node
        raise RewriteSkipped(f"no residual add found after the attention of layer {layer}")

    def _layer_input(self, layer: int) -> fx.Node:
        producers = set()
        for node in self.gm.graph.nodes:
            if layer_index(node, self.container) != layer:
                continue
            for inp in node.all_input_nodes:
                if layer_index(inp, self.container) == layer - 1 and self.axes.token_dims(example_value(inp)):
                    producers.add(inp)
        if len(producers) != 1:
            raise RewriteSkipped(f"suspend policy: cannot identify the residual stream entering layer {layer}")
        return producers.pop()


def _one_attention_map(calls: list) -> bool:
    """Attention calls of one layer that share the queries, the mask and the scale (differential
    attention: one softmax map applied to two halves of the values): the drop point scores with the
    first, every call runs on the kept tokens."""
    from .eager_attention_pieces import before_repeat

    def form(n):  # everything but the values: queries, keys before repeat_kv, mask, scale, flags
        flags = {k: v for k, v in n.kwargs.items() if k not in ("attn_mask", "scale")}
        flags.update({f"arg{i}": a for i, a in enumerate(n.args[3:], 3) if i not in (3, 6)})
        scale = n.kwargs.get("scale", n.args[6] if len(n.args) > 6 else None)
        return (n.args[0], before_repeat(n.args[1])[0], sdpa_mask_node(n), scale), flags

    (nodes, flags), rest = form(calls[0]), [form(c) for c in calls[1:]]
    same = lambda a, b: a is b if isinstance(a, fx.Node) else a == b  # noqa: E731
    return all(all(map(same, other, nodes)) and other_flags == flags for other, other_flags in rest)


def _runs_again(calls: list) -> bool:
    """Every later attention call of the layer reads the output of the one before: the same layer
    module applied again (a loop over the stack), not several attentions side by side."""
    return all(before in ancestors(after) for before, after in zip(calls, calls[1:]))


def _active_dropout(node: fx.Node) -> bool:
    """A dropout that is on: SDPA with `dropout_p` > 0, or a dropout call in training mode."""
    if is_sdpa(node):
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return isinstance(p, fx.Node) or float(p) > 0.0
    if node.op == "call_function" and "dropout" in target_name(node):
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return bool(training) and (isinstance(p, fx.Node) or float(p) > 0.0)
    return False


def _shape(value):
    if not isinstance(value, torch.Tensor):
        return None
    return [_expr(d) for d in value.shape]


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else int(size)
