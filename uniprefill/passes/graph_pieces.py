"""Graphs that are not one whole decoder stack, and the words that say so.

The rewrite needs the embedding (or `inputs_embeds`) and the decoder layers in one graph. A
model that dynamo splits at graph breaks (CTRL stores a module attribute in `forward`; Qwen4-Exp's
QSA indexer calls `torch.nonzero` once per query in a Python loop) arrives as several graphs, some of which hold no
decoder layer at all: the embedding and mask building, or the LM head. Such a piece has nothing
to drop: `plan.NoDecoderLayers` tells the backend so, and it keeps a more telling reason (the
graph that holds the layers) for the user. The other functions say, in words, why a graph that holds
layers does not start at the prompt's tokens or does not hold one stack of layers.
"""

from __future__ import annotations

import linecache
import re

import torch
import torch.fx as fx

from .fx_utils import _LAYER_PATH, example_value, is_sdpa, layer_index, module_paths, target_name
_HINT = "torch._dynamo.explain(model)(...) lists the graph breaks"


def not_one_stack(graph: fx.Graph) -> tuple[str, bool] | None:
    """`(reason, piece)` for a graph that is not one stack of decoder layers, else None: `piece`
    when it holds no attention and no decoder layer at all (a piece between graph breaks), else
    its attention calls sit in several module lists."""
    sdpa = [n for n in graph.nodes if is_sdpa(n)]
    lists = sorted({_list_of(n) for n in sdpa} - {None})
    if len(lists) > 1:
        names = [re.sub(r"^L\['\w+'\](\[\d+\])?\.", "", name) for name in lists]  # from the model
        nested = {re.sub(r"\.\d+\.\w+$", "", name) for name in names}
        if len(nested) == 1 and all(re.search(r"\.\d+\.\w+$", name) for name in names):
            outer, inner = nested.pop(), names[0].rsplit(".", 1)[-1]
            return (
                f"the attention calls sit in a module list inside each entry of {outer} ({outer}.N.{inner}[0], "
                f"{inner}[1], ...): several attention sublayers per decoder layer (LongCat-Flash runs two "
                "attention-and-MLP steps in each) or stacks of stacks; the rewrite follows one stack of decoder "
                "layers with one attention each", False)
        return (
            f"the attention calls sit in {len(lists)} module lists ({', '.join(names)}), e.g. stacks run in cycles (a "
            "hierarchical or looped model): the rewrite follows one stack of decoder layers, each run once", False)
    if sdpa or any(_list_of(n) for n in graph.nodes):
        return None
    return (
            "this graph holds no decoder layer and no attention: a piece of the model between graph breaks "
            "(the embedding and masks, the LM head, or part of a layer); the rewrite needs the embedding and the "
            f"decoder layers in one graph ({_HINT})", True)


def why_no_tokens(graph: fx.Graph, container: str | None) -> str:
    """Why no token input was found: where the graph starts instead."""
    for node in graph.nodes:
        if node.op == "call_function" and target_name(node).endswith("embedding"):
            ops = _path_to_input(node.args[0])
            if ops:
                return (f"the embedding reads the prompt's token ids through {', '.join(ops)}: its token axis is "
                        "not the prompt's (e.g. a time-major layout, or tokens added before the prompt), which "
                        "the rewrite does not follow")
            return "the embedding reads token ids computed inside the graph, not the prompt's ids"
    first = min((i for i in (layer_index(n, container) for n in graph.nodes) if i is not None), default=None) \
        if container else None
    where = f"inside the decoder stack (layer {first})" if first is not None else "from hidden states"
    return (f"this graph starts {where}, after a graph break{_break_site(graph)}, not at the embedding: the "
            f"rewrite needs the embedding and the decoder layers in one graph ({_HINT})")


_RESUME = re.compile(r'File "([^"]+)", line \d+, in torch_dynamo_resume_in_(\w+?)_at_(\d+)')


def _break_site(graph: fx.Graph) -> str:
    """' at file:line (code)': the call dynamo broke the graph at, read from the name of the
    function it resumes in (`torch_dynamo_resume_in_<function>_at_<line>`); '' when unknown."""
    for node in graph.nodes:
        matches = _RESUME.findall(node.meta.get("stack_trace") or "")
        if matches:  # outermost call first: the last is the function the break is in
            path, function, line = matches[-1][0], matches[-1][1], int(matches[-1][2])
            code = linecache.getline(path, line).strip()
            short = path.split("site-packages/")[-1]
            return f" at {short}:{line} in {function}" + (f" (`{code}`)" if code else "")
    return ""


def _list_of(node: fx.Node) -> str | None:
    for path, _ in reversed(module_paths(node)):
        match = _LAYER_PATH.match(path)
        if match:
            return match.group(1)
    return None


def _path_to_input(node) -> list[str]:
    """The ops from an integer graph input (the token ids) to `node`, shortest first; empty when
    no such input is reached within a few ops."""
    if not isinstance(node, fx.Node):
        return []
    paths, seen = [(node, [])], {node}
    for _ in range(8):
        nxt = []
        for current, ops in paths:
            if current.op == "placeholder":
                val = example_value(current)
                if isinstance(val, torch.Tensor) and not val.is_floating_point():
                    return list(reversed(ops))
                continue
            for inp in current.all_input_nodes:
                if inp not in seen:
                    seen.add(inp)
                    nxt.append((inp, ops + [target_name(current).rsplit(".", 1)[-1]]))
        paths = nxt
    return []
