"""Small FX predicates and helpers shared by the uniprefill passes."""

from __future__ import annotations

import re
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_LAYER_PATH = re.compile(r"^(.*)\.(\d+)$")


def example_value(node):
    """The traced value of `node` (FakeTensor, SymInt, ...) or None."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def is_sdpa(node: fx.Node) -> bool:
    """An SDPA call, or `uniprefill::sink_attention` (eager attention with sinks, put into the graph
    by `passes.sink_attention` with SDPA's argument names)."""
    return node.op == "call_function" and (node.target in SDPA_TARGETS or is_sink_attention(node))


def is_sink_attention(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        target._schema.name == "uniprefill::sink_attention"  # noqa: SLF001


def is_table_mask(node: fx.Node) -> bool:
    """`uniprefill::table_mask`: a causal mask sliced from a table the model holds (`passes.causal_table`)."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        target._schema.name == "uniprefill::table_mask"  # noqa: SLF001


def module_paths(node: fx.Node) -> list[tuple[str, type]]:
    """(path, class) of the modules `node` was traced in, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(path, cls) for path, cls in stack.values()]


def layer_container(sdpa_nodes: list[fx.Node]) -> str | None:
    """The path of the module list that holds the decoder layers (e.g. "L['self'].model.layers")."""
    prefixes = set()
    for node in sdpa_nodes:
        for path, _ in reversed(module_paths(node)):
            match = _LAYER_PATH.match(path)
            if match:
                prefixes.add(match.group(1))
                break
    return prefixes.pop() if len(prefixes) == 1 else None


def layer_index(node: fx.Node, container: str) -> int | None:
    for path, _ in module_paths(node):
        match = _LAYER_PATH.match(path)
        if match and match.group(1) == container:
            return int(match.group(2))
    return None


def layer_module_classes(node: fx.Node, container: str) -> list[str]:
    """Class names of the modules inside the decoder layer that `node` belongs to."""
    names = []
    seen_layer = False
    for path, cls in module_paths(node):
        match = _LAYER_PATH.match(path)
        if match and match.group(1) == container:
            seen_layer = True
            continue
        if seen_layer:
            names.append(getattr(cls, "__name__", str(cls)))
    return names


def ancestors(node: fx.Node, stop=lambda n: False) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        for inp in current.all_input_nodes:
            if inp not in seen and not stop(inp):
                seen.add(inp)
                todo.append(inp)
    return seen


def target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{name}" if module and not name.startswith(module) else name


@dataclass(frozen=True)
class TokenAxes:
    """Which axes of a traced value are the batch and token axes of the prompt."""

    batch: object  # sympy expr or int
    seq: object  # sympy expr or int
    static: bool
    # other symbols that stand for the same sizes (an input recompiled with a symbol of its own;
    # the backend checks at run time that they are equal): ((symbol, batch or seq), ...)
    aliases: tuple = ()

    def size_expr(self, size):
        if isinstance(size, torch.SymInt):
            return self.unalias(size.node.expr)
        return int(size)

    def unalias(self, expr):
        if not self.aliases:
            return expr
        return sympy.sympify(expr).xreplace(dict(self.aliases))

    def token_dims(self, value) -> list[int]:
        """Axes of size N (one for activations, two for [N, N] masks)."""
        if not isinstance(value, torch.Tensor):
            return []
        return [i for i, s in enumerate(value.shape) if self.size_expr(s) == self.seq]

    def int_index_axis(self, value, index) -> int | None:
        """The token axis that `value[index]` indexes with a plain integer (a Python loop unrolled over
        the prompt), if any."""
        token_axes = set(self.token_dims(value))
        if not token_axes:
            return None
        items = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in items):
            cut = items.index(Ellipsis)
            head, tail = items[:cut], items[cut + 1:]
            positions = list(enumerate(head)) + [(value.dim() - len(tail) + k, t) for k, t in enumerate(tail)]
        else:
            positions = list(enumerate(items))
        for pos, item in positions:
            nones_before = sum(1 for p, other in positions if p < pos and other is None)
            if isinstance(item, int) and not isinstance(item, bool) and pos - nones_before in token_axes:
                return pos
        return None

    def derived_dims(self, value) -> list[int]:
        """Axes whose size is another expression of N (e.g. N + 3 after a padded convolution,
        N rounded up to a chunk multiple): such values follow the tokens but cannot be gathered."""
        if not isinstance(value, torch.Tensor) or isinstance(self.seq, int):
            return []
        out = []
        for i, s in enumerate(value.shape):
            expr = self.size_expr(s)
            if isinstance(expr, int) or expr == self.seq or (self.batch != 1 and expr == self.batch * self.seq):
                continue
            if self.seq in sympy.sympify(expr).free_symbols:
                out.append(i)
        return out

    def flat_dims(self, value) -> list[int]:
        """Axes of size B * N (batch and tokens flattened together), when B is not 1."""
        if not isinstance(value, torch.Tensor) or self.batch == 1:
            return []
        flat = self.batch * self.seq
        return [i for i, s in enumerate(value.shape) if self.size_expr(s) == flat]

    def is_token_count(self, value) -> bool:
        """A symbolic size equal to N (e.g. `x.size(0)` of a token-major value)."""
        return isinstance(value, torch.SymInt) and self.size_expr(value) == self.seq

    def depends_on_tokens(self, value) -> bool:
        """A symbolic size, or a tensor with an axis, whose expression involves N."""
        if isinstance(self.seq, int):
            return False
        sizes = [value] if isinstance(value, torch.SymInt) else list(value.shape) if isinstance(value, torch.Tensor) else []
        return any(isinstance(s, torch.SymInt) and self.seq in sympy.sympify(self.size_expr(s)).free_symbols
                   for s in sizes)

    def token_major(self, value) -> bool:
        """A tensor whose FIRST axis is the token axis and whose other axes do not involve N:
        the flat token-major layout of vLLM's graphs (`[s, hidden]`), one row per token."""
        return (isinstance(value, torch.Tensor) and value.dim() >= 1 and self.size_expr(value.shape[0]) == self.seq
                and not any(self.depends_on_tokens(s) for s in value.shape[1:] if isinstance(s, torch.SymInt)))

    def batch_dim(self, value, token_dim: int) -> int:
        """0 when axis 0 is the batch axis (size B, or 1 broadcast) ahead of the token axis, else -1."""
        if token_dim == 0 or value.dim() < 2:
            return -1
        first = self.size_expr(value.shape[0])
        return 0 if first in (self.batch, 1) else -1


# Not "to": Llama-4 embeds `input_ids.to(device)`, and following it accelerates its prefill
# (equal at p = 1) while `generate` then fails the decode check on its chunked-attention cache.
_SAME_SHAPE_METHODS = ("view", "reshape", "to")  # `to`: Llama-4 moves the ids to the embedding's device


def through_same_shape_views(node):
    """The tensor a chain of shape-preserving views reads: GPT-2 and OPT embed
    `input_ids.view(-1, input_shape[-1])`, which is `input_ids` itself for [B, N] ids; Llama-4
    embeds `input_ids.to(weight.device)`, the same ids on the embedding's device."""
    while (isinstance(node, fx.Node) and node.op == "call_method" and node.target in _SAME_SHAPE_METHODS
           and isinstance(node.args[0], fx.Node)):
        source = node.args[0]
        before, after = example_value(source), example_value(node)
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)) or before.shape != after.shape:
            break
        node = source
    return node
